#include "swapopt/core/tensor.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <sstream>

#include "../cuda/cuda_backend.h"
#include "swapopt/core/allocator.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"
#include "swapopt/core/stream.h"
#include "view_span.h"

namespace swapopt {

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

int64_t shape_numel(const Shape& shape) {
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;  // whatever the other dims
  int64_t n = 1;
  for (int64_t d : shape)
    SWAPOPT_CHECK(!__builtin_mul_overflow(n, d, &n),
                  "[shape] " << shape_str(shape) << " has more elements than an int64 counts");
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    // Past int64 only where the tensor has no elements (a dim 0; any other shape is refused as too
    // large): those strides address nothing, so the largest int64 stands in.
    if (__builtin_mul_overflow(s, shape[i], &s)) s = std::numeric_limits<int64_t>::max();
  }
  return strides;
}

namespace {
/** Dims >= 0 whose bytes of `dtype` fit in an int64. */
void check_shape(const Shape& shape, const char* op, DType dtype) {
  SWAPOPT_CHECK(dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16,
                "[" << op << "] unknown dtype " << int(dtype) << " (f32, bf16 or f16)");
  int64_t bytes = int64_t(dtype_size(dtype));
  for (int64_t d : shape) {
    SWAPOPT_CHECK(d >= 0, "[" << op << "] negative dim in shape " << shape_str(shape));
    SWAPOPT_CHECK(!__builtin_mul_overflow(bytes, d, &bytes),
                  "[" << op << "] shape " << shape_str(shape) << " of " << dtype_name(dtype) << " is too large");
  }
}

int64_t wrap_dim(int64_t d, int64_t ndim, const char* op) {
  const int64_t wrapped = d < 0 ? d + ndim : d;
  SWAPOPT_CHECK(wrapped >= 0 && wrapped < ndim, "[" << op << "] dim " << d << " out of range for " << ndim << "-D tensor");
  return wrapped;
}
}  // namespace

std::optional<int64_t> view_span(const Shape& shape, const Shape& strides, size_t element_size) {
  if (shape_numel(shape) == 0) return 0;
  int64_t span = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t reach = 0;
    if (__builtin_mul_overflow(shape[i] - 1, strides[i], &reach) || __builtin_add_overflow(span, reach, &span))
      return std::nullopt;
  }
  int64_t bytes = 0;
  if (__builtin_mul_overflow(span, int64_t(element_size), &bytes)) return std::nullopt;
  return span;
}

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device, Stream* stream) {
  check_shape(shape, "Tensor::empty", dtype);
  // Stream-ordered device memory comes from the pool of the stream's device, on that stream.
  SWAPOPT_CHECK(stream == nullptr || device.is_cpu() || stream->device() == device,
                "[Tensor::empty] memory on " << device.str() << " ordered on a stream of " << stream->device().str()
                                             << ": give a stream of the same device, or none");
  const size_t nbytes = size_t(shape_numel(shape)) * dtype_size(dtype);
  return on_storage(std::make_shared<Storage>(nbytes, device, device_allocator(device), stream), 0, shape, dtype);
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  if (t.nbytes() == 0) return t;
  if (device.is_cpu()) {
    std::memset(t.data_ptr(), 0, t.nbytes());
  } else {
    cuda::memset_sync(t.data_ptr(), t.nbytes(), device.index);
  }
  return t;
}

Tensor Tensor::empty_like(const Tensor& other) {
  SWAPOPT_CHECK(other.defined(), "[Tensor::empty_like] undefined tensor: it has no shape, dtype or device to copy");
  return empty(other.shape(), other.dtype(), other.device());
}

Tensor Tensor::zeros_like(const Tensor& other) {
  SWAPOPT_CHECK(other.defined(), "[Tensor::zeros_like] undefined tensor: it has no shape, dtype or device to copy");
  return zeros(other.shape(), other.dtype(), other.device());
}

Tensor Tensor::from_blob(void* ptr, const Shape& shape, DType dtype, Device device) {
  return from_blob(ptr, shape, contiguous_strides(shape), dtype, device);
}

Tensor Tensor::from_blob(void* ptr, const Shape& shape, const Shape& strides, DType dtype, Device device) {
  check_shape(shape, "Tensor::from_blob", dtype);
  SWAPOPT_CHECK(strides.size() == shape.size(), "[Tensor::from_blob] " << strides.size() << " strides for shape "
                                                                          << shape_str(shape));
  SWAPOPT_CHECK(ptr != nullptr || shape_numel(shape) == 0, "[Tensor::from_blob] null pointer for shape " << shape_str(shape));
  // The ops load and store whole elements (vectors on the CPU, 2- to 16-byte accesses on CUDA).
  SWAPOPT_CHECK(reinterpret_cast<uintptr_t>(ptr) % dtype_size(dtype) == 0,
                "[Tensor::from_blob] pointer " << ptr << " is not aligned to the " << dtype_size(dtype)
                                               << " bytes of a " << dtype_name(dtype) << " element");
  for (const int64_t stride : strides) SWAPOPT_CHECK(stride >= 0, "[Tensor::from_blob] negative stride " << stride);
  const std::optional<int64_t> span = view_span(shape, strides, dtype_size(dtype));
  SWAPOPT_CHECK(span.has_value(), "[Tensor::from_blob] strides " << shape_str(strides) << " for shape "
                                                                 << shape_str(shape) << " are too large");
  Tensor t;
  t.storage_ = std::make_shared<Storage>(ptr, size_t(*span) * dtype_size(dtype), device);
  t.set_layout(shape, strides);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::on_storage(std::shared_ptr<Storage> storage, int64_t offset, const Shape& shape, DType dtype) {
  check_shape(shape, "Tensor::on_storage", dtype);
  SWAPOPT_CHECK(storage != nullptr, "[Tensor::on_storage] null storage");
  SWAPOPT_CHECK(offset >= 0, "[Tensor::on_storage] offset " << offset << " is negative");
  SWAPOPT_CHECK(reinterpret_cast<uintptr_t>(storage->data()) % dtype_size(dtype) == 0,
                "[Tensor::on_storage] storage at " << storage->data() << " is not aligned to the " << dtype_size(dtype)
                                                   << " bytes of a " << dtype_name(dtype) << " element");
  const size_t elements = storage->nbytes() / dtype_size(dtype);
  SWAPOPT_CHECK(size_t(offset) <= elements, "[Tensor::on_storage] offset "
                                                << offset << " is past the end of a storage of " << elements << " "
                                                << dtype_name(dtype) << " elements");
  // Both terms are below 2^63 bytes (the offset checked against the storage, the shape above).
  const size_t end = (size_t(offset) + size_t(shape_numel(shape))) * dtype_size(dtype);
  SWAPOPT_CHECK(end <= storage->nbytes(), "[Tensor::on_storage] view " << shape_str(shape) << " at offset " << offset
                                                                       << " needs " << end << " bytes, storage has "
                                                                       << storage->nbytes());
  Tensor t;
  t.storage_ = std::move(storage);
  t.offset_ = offset;
  t.set_layout(shape, contiguous_strides(shape));
  t.dtype_ = dtype;
  return t;
}

Tensor::Layout::Layout(Shape shape_in, Shape strides_in)
    : shape(std::move(shape_in)), strides(std::move(strides_in)), numel(shape_numel(shape)), contiguous(true) {
  // Row-major dense: each stride is the product of the later dims' sizes (a dim of size 1 may
  // have any stride). No elements: contiguous whatever the strides (as in torch), and the
  // product of the other dims may not fit an int64.
  if (numel == 0) return;
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 1) continue;
    if (strides[i] != expected) {
      contiguous = false;
      break;
    }
    expected *= shape[i];
  }
}

const Shape& Tensor::no_dims() {
  static const Shape none;
  return none;
}

int64_t Tensor::size(int64_t d) const { return shape()[size_t(wrap_dim(d, dim(), "Tensor::size"))]; }

Device Tensor::device() const { return storage_ ? storage_->device() : Device::cpu(); }

void* Tensor::data_ptr() const {
  SWAPOPT_CHECK(defined(), "[Tensor::data_ptr] undefined tensor");
  SWAPOPT_CHECK(!storage_->released(), "[Tensor::data_ptr] storage of " << str() << " is released");
  return static_cast<char*>(storage_->data()) + offset_ * int64_t(element_size());
}

Tensor Tensor::view(const Shape& shape) const {
  SWAPOPT_CHECK(defined(), "[Tensor::view] undefined tensor");
  SWAPOPT_CHECK(is_contiguous(), "[Tensor::view] " << str() << " is not contiguous");
  Shape resolved = shape;
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < resolved.size(); ++i) {
    if (resolved[i] == -1) {
      SWAPOPT_CHECK(infer < 0, "[Tensor::view] more than one -1 in " << shape_str(shape));
      infer = int(i);
    } else {
      SWAPOPT_CHECK(resolved[i] >= 0, "[Tensor::view] negative dim in " << shape_str(shape));
      SWAPOPT_CHECK(!__builtin_mul_overflow(known, resolved[i], &known),
                    "[Tensor::view] cannot view " << str() << " as " << shape_str(shape));
    }
  }
  if (infer >= 0) {
    SWAPOPT_CHECK(known != 0 && numel() % known == 0, "[Tensor::view] cannot view " << str() << " as " << shape_str(shape));
    resolved[size_t(infer)] = numel() / known;
  }
  SWAPOPT_CHECK(shape_numel(resolved) == numel(), "[Tensor::view] cannot view " << str() << " as " << shape_str(shape));
  Tensor t = *this;
  t.set_layout(resolved, contiguous_strides(resolved));
  return t;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  const size_t a = size_t(wrap_dim(d0, dim(), "Tensor::transpose"));
  const size_t b = size_t(wrap_dim(d1, dim(), "Tensor::transpose"));
  Shape shape = this->shape(), strides = this->strides();
  std::swap(shape[a], shape[b]);
  std::swap(strides[a], strides[b]);
  Tensor t = *this;
  t.set_layout(std::move(shape), std::move(strides));
  return t;
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  const size_t i = size_t(wrap_dim(d, dim(), "Tensor::narrow"));
  if (!(start >= 0 && length >= 0 && start <= shape()[i] && length <= shape()[i] - start)) {
    int64_t end = 0;  // the message's bound, which may not fit an int64
    const bool huge = __builtin_add_overflow(start, length, &end);
    SWAPOPT_FAIL("[Tensor::narrow] range ["
                 << start << ", " << (huge ? std::string("beyond int64") : std::to_string(end)) << ") out of dim " << d
                 << " of " << str());
  }
  Shape shape = this->shape();
  shape[i] = length;
  Tensor t = *this;
  // A view without elements addresses nothing: its offset stays (its strides may be past int64,
  // as a dim of 0 allows, and the product with them past int64 too; so may a size-1 dim's stride,
  // which a range [1, 1) of it would multiply).
  if (numel() > 0 && length > 0) t.offset_ += start * strides()[i];
  t.set_layout(std::move(shape), strides());
  return t;
}

Tensor Tensor::block(const Shape& offset, const Shape& shape) const {
  SWAPOPT_CHECK(defined(), "[Tensor::block] undefined tensor");
  SWAPOPT_CHECK(
      offset.size() == this->shape().size() && shape.size() == this->shape().size(),
      "[Tensor::block] offset " << shape_str(offset) << " and shape " << shape_str(shape) << " for " << str());
  Tensor t = *this;
  for (size_t d = 0; d < shape.size(); ++d) t = t.narrow(int64_t(d), offset[d], shape[d]);
  return t;
}

Tensor Tensor::select(int64_t d, int64_t index) const {
  const size_t i = size_t(wrap_dim(d, dim(), "Tensor::select"));
  SWAPOPT_CHECK(index >= 0 && index < shape()[i],
                "[Tensor::select] index " << index << " out of dim " << d << " of " << str());
  Shape shape = this->shape(), strides = this->strides();
  shape.erase(shape.begin() + int64_t(i));
  strides.erase(strides.begin() + int64_t(i));
  Tensor t = *this;
  if (numel() > 0) t.offset_ += index * this->strides()[i];  // as in narrow()
  t.set_layout(std::move(shape), std::move(strides));
  return t;
}

Tensor Tensor::to(Device device) const {
  // A copy touching a GPU runs on a stream of the source's GPU if it has one (ops::copy's rule,
  // also from one GPU to another), else of the destination's.
  Stream& stream = default_stream(this->device().is_cuda() ? this->device() : device);
  // A copy across devices needs contiguous memory on both sides: a strided view is first made
  // contiguous on its own device (a strided copy there). On a GPU that memory is taken and given
  // back on the copy's stream: a free without a stream would wait for the whole device.
  if (device != this->device() && !is_contiguous()) {
    if (this->device().is_cpu()) return to(this->device()).to(device);
    Tensor dense = empty(shape(), dtype_, this->device(), &stream);
    ops::copy(stream, *this, dense);
    return dense.to(device);
  }
  Tensor out = empty(shape(), dtype_, device);
  ops::copy(stream, *this, out);
  stream.synchronize();
  return out;
}

Tensor Tensor::clone() const { return to(device()); }

std::vector<float> Tensor::to_float_vector() const {
  const Tensor host = device().is_cpu() && is_contiguous() ? *this : to(Device::cpu());
  std::vector<float> values(size_t(host.numel()));
  const void* base = host.numel() ? host.data_ptr() : nullptr;
  for (size_t i = 0; i < values.size(); ++i) values[i] = load_as_float(base, i, dtype_);
  return values;
}

Tensor Tensor::from_floats(const std::vector<float>& values, const Shape& shape, DType dtype, Device device) {
  SWAPOPT_CHECK(int64_t(values.size()) == shape_numel(shape),
                "[Tensor::from_floats] " << values.size() << " values for shape " << shape_str(shape));
  Tensor host = empty(shape, dtype, Device::cpu());
  for (size_t i = 0; i < values.size(); ++i) store_from_float(host.data_ptr(), i, dtype, values[i]);
  return device.is_cpu() ? host : host.to(device);
}

std::string Tensor::str() const {
  if (!defined()) return "Tensor(undefined)";
  std::ostringstream os;
  os << "Tensor(" << dtype_name(dtype_) << ", " << shape_str(shape()) << ", " << device().str() << ")";
  return os.str();
}

}  // namespace swapopt
