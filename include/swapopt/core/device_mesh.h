#pragma once
/** An n-D grid of ranks (row-major) and this process's coordinate in it. */

#include <cstdint>
#include <string>
#include <vector>

namespace swapopt {

class DeviceMesh {
 public:
  /** `shape` per mesh dim, `names` one per dim (e.g. {"replicate", "shard"}), `rank` this process's
   *  global rank in [0, product(shape)). */
  DeviceMesh(std::vector<int64_t> shape, std::vector<std::string> names, int64_t rank);

  int64_t ndim() const { return int64_t(shape_.size()); }
  int64_t size() const;
  int64_t size(int64_t dim) const { return shape_.at(size_t(dim)); }
  const std::vector<int64_t>& shape() const { return shape_; }
  const std::vector<std::string>& names() const { return names_; }
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
