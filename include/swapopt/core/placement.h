#pragma once
/** How a tensor is laid out along one mesh dim: split on a tensor dim, or fully copied. */

#include <cstdint>
#include <string>

namespace swapopt {

/** The placement along one mesh dim: Shard(d) splits tensor dim d across the ranks of that mesh
 *  dim (torch's chunk rule, see DTensor); Replicate() gives each of them the whole extent. */
struct Placement {
  /** Shard or replicate. */
  enum class Kind { shard, replicate };
  Kind kind = Kind::replicate;  ///< Which of the two.
  int64_t dim = -1;  ///< tensor dim split across the mesh dim (shard only; -1 for replicate)

  /** Splits tensor dim `dim`; DTensor checks it against the logical shape, not this. */
  static Placement Shard(int64_t dim) { return {Kind::shard, dim}; }
  /** A full copy on every rank along the mesh dim. */
  static Placement Replicate() { return {Kind::replicate, -1}; }
  /** True for Shard. */
  bool is_shard() const { return kind == Kind::shard; }
  /** True for Replicate. */
  bool is_replicate() const { return kind == Kind::replicate; }
  /** Same kind and dim. */
  bool operator==(const Placement&) const = default;
  /** "Shard(1)" or "Replicate()". */
  std::string str() const { return is_shard() ? "Shard(" + std::to_string(dim) + ")" : "Replicate()"; }
};

}  // namespace swapopt
