#include "swapopt/core/dtensor.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "swapopt/core/error.h"

namespace swapopt {

DeviceMesh::DeviceMesh(std::vector<int64_t> shape, std::vector<std::string> names, int64_t rank)
    : shape_(std::move(shape)), names_(std::move(names)), rank_(rank) {
  SWAPOPT_CHECK(!shape_.empty(), "[DeviceMesh] needs at least one dim");
  SWAPOPT_CHECK(names_.size() == shape_.size(), "[DeviceMesh] " << names_.size() << " names for " << shape_.size() << " dims");
  for (size_t i = 0; i < names_.size(); ++i)
    SWAPOPT_CHECK(
        std::find(names_.begin(), names_.begin() + std::ptrdiff_t(i), names_[i]) == names_.begin() + std::ptrdiff_t(i),
        "[DeviceMesh] dim name '" << names_[i] << "' is given twice: dims are found by name");
  int64_t ranks = 1;
  for (int64_t d : shape_) {
    SWAPOPT_CHECK(d >= 1, "[DeviceMesh] dim sizes must be >= 1, got " << shape_str(shape_));
    SWAPOPT_CHECK(!__builtin_mul_overflow(ranks, d, &ranks),
                  "[DeviceMesh] a mesh " << shape_str(shape_) << " has more ranks than an int64 counts");
  }
  SWAPOPT_CHECK(rank_ >= 0 && rank_ < size(), "[DeviceMesh] rank " << rank_ << " outside mesh " << shape_str(shape_));
  coordinate_.resize(shape_.size());
  int64_t rest = rank_;
  for (size_t i = shape_.size(); i-- > 0;) {
    coordinate_[i] = rest % shape_[i];
    rest /= shape_[i];
  }
}

int64_t DeviceMesh::size() const { return shape_numel(shape_); }

int64_t DeviceMesh::size(int64_t dim) const {
  if (dim < 0 || dim >= ndim())
    throw std::out_of_range("[DeviceMesh] no mesh dim " + std::to_string(dim) + " (the mesh has " +
                            std::to_string(ndim()) + (ndim() == 1 ? " dim)" : " dims)"));
  return shape_[size_t(dim)];
}

int64_t DeviceMesh::dim_index(const std::string& name) const {
  const auto it = std::find(names_.begin(), names_.end(), name);
  SWAPOPT_CHECK(it != names_.end(), "[DeviceMesh] no mesh dim named '" << name << "'");
  return int64_t(it - names_.begin());
}

int64_t DeviceMesh::rank_at(const std::vector<int64_t>& coordinate) const {
  SWAPOPT_CHECK(coordinate.size() == shape_.size(), "[DeviceMesh::rank_at] coordinate of " << coordinate.size()
                                                                                            << " dims for a " << ndim()
                                                                                            << "-D mesh");
  int64_t rank = 0;
  for (size_t i = 0; i < shape_.size(); ++i) {
    SWAPOPT_CHECK(coordinate[i] >= 0 && coordinate[i] < shape_[i],
                  "[DeviceMesh::rank_at] coordinate " << shape_str(coordinate) << " outside mesh " << shape_str(shape_));
    rank = rank * shape_[i] + coordinate[i];
  }
  return rank;
}

Shape DTensor::local_shape_at(const Shape& logical_shape, const DeviceMesh& mesh, const std::vector<Placement>& placements,
                              const std::vector<int64_t>& coordinate, Shape* offset) {
  SWAPOPT_CHECK(int64_t(placements.size()) == mesh.ndim(),
                "[DTensor] " << placements.size() << " placements for a " << mesh.ndim() << "-D mesh");
  SWAPOPT_CHECK(int64_t(coordinate.size()) == mesh.ndim(),
                "[DTensor] coordinate " << shape_str(coordinate) << " for a " << mesh.ndim() << "-D mesh");
  for (size_t m = 0; m < coordinate.size(); ++m)
    SWAPOPT_CHECK(
        coordinate[m] >= 0 && coordinate[m] < mesh.size(int64_t(m)),
        "[DTensor] coordinate " << shape_str(coordinate) << " is outside the mesh " << shape_str(mesh.shape()));
  for (int64_t d : logical_shape)
    SWAPOPT_CHECK(d >= 0, "[DTensor] negative dim in logical shape " << shape_str(logical_shape));
  int64_t elements = 1;
  for (int64_t d : logical_shape)
    SWAPOPT_CHECK(!__builtin_mul_overflow(elements, d, &elements),
                  "[DTensor] logical shape " << shape_str(logical_shape) << " has more elements than an int64 counts");
  Shape shape = logical_shape;
  Shape start(logical_shape.size(), 0);
  for (size_t m = 0; m < placements.size(); ++m) {
    if (!placements[m].is_shard()) continue;
    const int64_t d = placements[m].dim;
    SWAPOPT_CHECK(d >= 0 && d < int64_t(shape.size()),
                  "[DTensor] " << placements[m].str() << " out of range for logical shape " << shape_str(logical_shape));
    const int64_t parts = mesh.size(int64_t(m));
    const int64_t extent = shape[size_t(d)];
    const int64_t chunk = extent / parts + (extent % parts != 0 ? 1 : 0);  // ceil, without overflow
    int64_t begin = extent;  // past the end where chunk * coordinate overflows
    if (!__builtin_mul_overflow(chunk, coordinate[m], &begin)) begin = std::min(extent, begin);
    const int64_t end = begin + std::min(chunk, extent - begin);
    start[size_t(d)] += begin;
    shape[size_t(d)] = end - begin;
  }
  if (offset != nullptr) *offset = start;
  return shape;
}

DTensor::DTensor(Tensor local, Shape logical_shape, std::shared_ptr<const DeviceMesh> mesh, std::vector<Placement> placements)
    : local_(std::move(local)), logical_shape_(std::move(logical_shape)), mesh_(std::move(mesh)), placements_(std::move(placements)) {
  SWAPOPT_CHECK(mesh_ != nullptr, "[DTensor] null mesh");
  SWAPOPT_CHECK(local_.defined(), "[DTensor] undefined local shard");
  const Shape expected = local_shape_at(logical_shape_, *mesh_, placements_, mesh_->coordinate());
  SWAPOPT_CHECK(local_.shape() == expected, "[DTensor] local shard " << shape_str(local_.shape()) << " does not match "
                                                                     << shape_str(expected) << " expected for logical "
                                                                     << shape_str(logical_shape_) << " at rank "
                                                                     << mesh_->rank());
}

std::vector<int64_t> DTensor::replicate_dims() const {
  std::vector<int64_t> dims;
  for (size_t m = 0; m < placements_.size(); ++m)
    if (placements_[m].is_replicate()) dims.push_back(int64_t(m));
  return dims;
}

std::vector<int64_t> DTensor::shard_dims() const {
  std::vector<int64_t> dims;
  for (size_t m = 0; m < placements_.size(); ++m)
    if (placements_[m].is_shard()) dims.push_back(int64_t(m));
  return dims;
}

Shape DTensor::local_offset() const {
  Shape offset;
  local_shape_at(logical_shape_, *mesh_, placements_, mesh_->coordinate(), &offset);
  return offset;
}

}  // namespace swapopt
