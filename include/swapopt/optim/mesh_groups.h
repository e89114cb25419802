#pragma once
/** Communicators over the ranks of a device mesh that differ from this rank only along some mesh
 *  dims (a replicate group, a shard group), made from the world group on first use. */

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/core/device_mesh.h"

namespace swapopt {

/** The sub-group communicators of one device mesh (Muon's HSDP holds one), created on demand
 *  from the world communicator and cached by (dims, block). */
class MeshGroups {
 public:
  /** `world` holds every rank of `mesh` (world rank == mesh rank); `name` must be unique per
   *  MeshGroups of one job: it prefixes every sub-group's rendezvous. */
  MeshGroups(std::shared_ptr<Communicator> world, std::shared_ptr<const DeviceMesh> mesh, std::string name);

  /** The mesh given at construction. */
  const DeviceMesh& mesh() const { return *mesh_; }
  /** Every rank of the mesh. */
  Communicator& world() { return *world_; }
  /** Ranks along `dims` (distinct mesh dims, ascending; else a named error, as in every method
   *  here): the product of their sizes. */
  int64_t size(const std::vector<int64_t>& dims) const;
  /** This rank's index along `dims`, row-major over them. */
  int64_t index(const std::vector<int64_t>& dims) const;
  /** The mesh coordinate at `index` (in [0, size(dims)), else a named error) along `dims`, every
   *  other dim as this rank's. */
  std::vector<int64_t> coordinate_at(const std::vector<int64_t>& dims, int64_t index) const;
  /** This rank's group along `dims`, cut into blocks of `block` consecutive indices (block divides
   *  size(dims)); its rank is the index within the block. Creating one is collective over its
   *  members, so every rank asks for its groups in the same order. Cached. */
  std::shared_ptr<Communicator> group(const std::vector<int64_t>& dims, int64_t block);

 private:
  /** Throws unless `dims` are distinct dims of the mesh in ascending order. */
  void check_dims(const std::vector<int64_t>& dims) const;
  std::shared_ptr<Communicator> world_;
  std::shared_ptr<const DeviceMesh> mesh_;
  std::string name_;
  std::map<std::pair<std::vector<int64_t>, int64_t>, std::shared_ptr<Communicator>> groups_;
};

}  // namespace swapopt
