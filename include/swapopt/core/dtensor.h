#pragma once
/** A distributed tensor: this rank's local shard plus the logical shape, mesh and placements. */

#include <memory>
#include <vector>

#include "swapopt/core/device_mesh.h"
#include "swapopt/core/placement.h"
#include "swapopt/core/tensor.h"

namespace swapopt {

/** Sharding follows torch's chunk rule: a dim of size n split k ways gives chunks of ceil(n/k),
 *  the last ones shorter or empty. Several mesh dims may shard one tensor dim, outer mesh dim first. */
class DTensor {
 public:
  /** Checks that `local` has exactly the shape these placements give this rank. */
  DTensor(Tensor local, Shape logical_shape, std::shared_ptr<const DeviceMesh> mesh, std::vector<Placement> placements);

  /** This rank's shard (a view sharing the tensor given at construction; may be empty). */
  const Tensor& to_local() const { return local_; }
  /** The shape of the whole distributed tensor. */
  const Shape& logical_shape() const { return logical_shape_; }
  /** The mesh the tensor is laid out on. */
  const DeviceMesh& mesh() const { return *mesh_; }
  /** The mesh, shared (never null). */
  const std::shared_ptr<const DeviceMesh>& mesh_ptr() const { return mesh_; }
  /** One placement per mesh dim. */
  const std::vector<Placement>& placements() const { return placements_; }
  /** Mesh dims holding Replicate placements, ascending. */
  std::vector<int64_t> replicate_dims() const;
  /** Mesh dims holding Shard placements, ascending. */
  std::vector<int64_t> shard_dims() const;
  /** Offset of this rank's shard in the logical tensor, per tensor dim. */
  Shape local_offset() const;

  /** The shape of the shard at mesh `coordinate`, and its offset. */
  static Shape local_shape_at(const Shape& logical_shape, const DeviceMesh& mesh, const std::vector<Placement>& placements,
                              const std::vector<int64_t>& coordinate, Shape* offset = nullptr);

 private:
  Tensor local_;
  Shape logical_shape_;
  std::shared_ptr<const DeviceMesh> mesh_;
  std::vector<Placement> placements_;
};

}  // namespace swapopt
