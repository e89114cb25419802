#pragma once
// Lists of names in error messages (internal).

#include <string>
#include <vector>

namespace swapopt {

/** `names` joined by ", ": {"a", "b"} -> "a, b", {} -> "". */
inline std::string comma_list(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

}  // namespace swapopt
