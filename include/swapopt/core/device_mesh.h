#pragma once
/** An n-D grid of ranks (row-major) and this process's coordinate in it. */

#include <cstdint>
#include <string>
#include <vector>

namespace swapopt {

/** Ranks laid out row-major over named mesh dims: global rank r sits at the coordinate whose
 *  row-major index in `shape` is r. Immutable once built. */
class DeviceMesh {
 public:
  /** `shape` per mesh dim, `names` one per dim and distinct (e.g. {"replicate", "shard"}), `rank` this process's
   *  global rank in [0, product(shape)). */
  DeviceMesh(std::vector<int64_t> shape, std::vector<std::string> names, int64_t rank);

  /** Number of mesh dims (at least 1). */
  int64_t ndim() const { return int64_t(shape_.size()); }
  /** Number of ranks: the product of shape(). */
  int64_t size() const;
  /** Ranks along mesh dim `dim`; throws std::out_of_range "[DeviceMesh] no mesh dim 5 (the mesh
   *  has 2 dims)" for a dim outside [0, ndim()). */
  int64_t size(int64_t dim) const;
  /** Ranks along each mesh dim (each >= 1). */
  const std::vector<int64_t>& shape() const { return shape_; }
  /** The name of each mesh dim, as given. */
  const std::vector<std::string>& names() const { return names_; }
  /** This process's global rank. */
  int64_t rank() const { return rank_; }
  /** This rank's index along each mesh dim. */
  const std::vector<int64_t>& coordinate() const { return coordinate_; }
  /** Index of the dim called `name`; throws if absent. */
  int64_t dim_index(const std::string& name) const;
  /** Global rank at `coordinate`. */
  int64_t rank_at(const std::vector<int64_t>& coordinate) const;

 private:
  std::vector<int64_t> shape_;
  std::vector<std::string> names_;
  int64_t rank_;
  std::vector<int64_t> coordinate_;
};

}  // namespace swapopt
