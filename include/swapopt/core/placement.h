#pragma once
/** How a tensor is laid out along one mesh dim: split on a tensor dim, or fully copied. */

#include <cstdint>
#include <string>

namespace swapopt {

struct Placement {
  enum class Kind { shard, replicate };
  Kind kind = Kind::replicate;
  int64_t dim = -1;  // tensor dim split across the mesh dim (shard only)

  static Placement Shard(int64_t dim) { return {Kind::shard, dim}; }
  static Placement Replicate() { return {Kind::replicate, -1}; }
  bool is_shard() const { return kind == Kind::shard; }
  bool is_replicate() const { return kind == Kind::replicate; }
  bool operator==(const Placement&) const = default;
  /** "Shard(1)" or "Replicate()". */
  std::string str() const { return is_shard() ? "Shard(" + std::to_string(dim) + ")" : "Replicate()"; }
};

}  // namespace swapopt
