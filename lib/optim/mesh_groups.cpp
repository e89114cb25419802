#include "swapopt/optim/mesh_groups.h"

#include <sstream>

#include "swapopt/core/error.h"

namespace swapopt {

MeshGroups::MeshGroups(std::shared_ptr<Communicator> world, std::shared_ptr<const DeviceMesh> mesh, std::string name)
    : world_(std::move(world)), mesh_(std::move(mesh)), name_(std::move(name)) {
  SWAPOPT_CHECK(world_ != nullptr && mesh_ != nullptr, "[MeshGroups] needs a communicator and a mesh");
  SWAPOPT_CHECK(world_->size() == mesh_->size() && world_->rank() == mesh_->rank(),
                "[MeshGroups] the mesh " << shape_str(mesh_->shape()) << " at rank " << mesh_->rank()
                                         << " does not match the communicator (rank " << world_->rank() << " of "
                                         << world_->size() << ")");
}

void MeshGroups::check_dims(const std::vector<int64_t>& dims) const {
  for (size_t k = 0; k < dims.size(); ++k)
    SWAPOPT_CHECK(dims[k] >= 0 && dims[k] < mesh_->ndim() && (k == 0 || dims[k - 1] < dims[k]),
                  "[MeshGroups] dims " << shape_str(dims) << " must be distinct dims of the mesh "
                                       << shape_str(mesh_->shape()) << ", ascending");
}

int64_t MeshGroups::size(const std::vector<int64_t>& dims) const {
  check_dims(dims);
  int64_t n = 1;
  for (int64_t d : dims) n *= mesh_->size(d);
  return n;
}

int64_t MeshGroups::index(const std::vector<int64_t>& dims) const {
  check_dims(dims);
  int64_t i = 0;
  for (int64_t d : dims) i = i * mesh_->size(d) + mesh_->coordinate()[size_t(d)];
  return i;
}

std::vector<int64_t> MeshGroups::coordinate_at(const std::vector<int64_t>& dims, int64_t index) const {
  const int64_t n = size(dims);
  SWAPOPT_CHECK(index >= 0 && index < n,
                "[MeshGroups] index " << index << " is outside the " << n << " ranks along dims " << shape_str(dims));
  std::vector<int64_t> coordinate = mesh_->coordinate();
  for (size_t k = dims.size(); k-- > 0;) {
    coordinate[size_t(dims[k])] = index % mesh_->size(dims[k]);
    index /= mesh_->size(dims[k]);
  }
  return coordinate;
}

std::shared_ptr<Communicator> MeshGroups::group(const std::vector<int64_t>& dims, int64_t block) {
  const int64_t n = size(dims);
  SWAPOPT_CHECK(block >= 1 && n % block == 0, "[MeshGroups] block " << block << " does not divide " << n << " ranks");
  auto& cached = groups_[{dims, block}];
  if (cached) return cached;
  if (block == world_->size()) return cached = world_;
  // Row-major order over `dims` with the other dims fixed is ascending in world rank.
  const int64_t first = index(dims) / block * block;
  std::vector<int> ranks;
  for (int64_t i = first; i < first + block; ++i) ranks.push_back(int(mesh_->rank_at(coordinate_at(dims, i))));
  // Unique per group: the dims, the block and the fixed coordinates (the first member's).
  std::ostringstream name;
  name << name_ << "/dims";
  for (int64_t d : dims) name << "." << d;
  name << "/block" << block << "/first" << ranks.front();
  return cached = std::shared_ptr<Communicator>(world_->sub_group(ranks, name.str()));
}

}  // namespace swapopt
