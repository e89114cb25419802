#pragma once
// An error from inside one part of a checkpoint (a set's member, an optimizer's group), named once
// (internal).

#include <string>

#include "swapopt/core/error.h"

namespace swapopt {

/** Throws "[checkpoint] <part>: <e's message>", dropping the message's own leading "[checkpoint] "
 *  so that it is said once: "[checkpoint] group 1: metadata: ns_steps must be an integer". */
[[noreturn]] inline void fail_in_checkpoint_part(const std::string& part, const Error& e) {
  std::string why = e.what();
  if (why.rfind("[checkpoint] ", 0) == 0) why.erase(0, 13);
  SWAPOPT_FAIL("[checkpoint] " << part << ": " << why);
}

}  // namespace swapopt
