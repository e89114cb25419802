#pragma once
/** Tensor: shared Storage + element offset + shape + strides + dtype. */

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "swapopt/core/device.h"
#include "swapopt/core/dtype.h"
#include "swapopt/core/storage.h"

namespace swapopt {

class Stream;

/** Sizes per dim (also used for strides and offsets, in elements). */
using Shape = std::vector<int64_t>;

/** "[3, 517]". */
std::string shape_str(const Shape& shape);
/** Product of the dims (1 for a scalar shape [], 0 with any dim 0); throws "[shape] [...] has more
 *  elements than an int64 counts" where the product overflows. */
int64_t shape_numel(const Shape& shape);
/** Row-major strides of a contiguous tensor of `shape` (a stride past int64, possible only with a
 *  dim 0, is the largest int64: it addresses nothing). */
Shape contiguous_strides(const Shape& shape);

/** A view of typed elements. Cheap to copy: copies share the storage and the shape (a copy
 *  allocates nothing).
 *
 * Invariants: shape and strides have the same length; offset and strides are in elements; every
 * addressed element lies inside the storage; views made by view/transpose/narrow/select share the
 * storage, so a release or restore through one is seen by all.
 */
class Tensor {
 public:
  Tensor() = default;  // undefined tensor

  /** Uninitialised contiguous tensor; `stream` orders its allocation and free (see Storage), and
   *  for a CUDA tensor must be a stream of `device`. Without a stream, a CUDA tensor's memory is
   *  synchronous: usable on every stream once this returns, and its free waits for the device. */
  static Tensor empty(const Shape& shape, DType dtype, Device device, Stream* stream = nullptr);
  /** Zero-filled contiguous tensor (synchronous). */
  static Tensor zeros(const Shape& shape, DType dtype, Device device);
  /** empty() with `other`'s shape, dtype and device (contiguous, synchronous: no stream); throws
   *  for an undefined `other`. */
  static Tensor empty_like(const Tensor& other);
  /** zeros() with `other`'s shape, dtype and device (contiguous); throws for an undefined `other`. */
  static Tensor zeros_like(const Tensor& other);
  /** Wraps trainer-owned memory without owning it; the caller keeps `ptr` alive. `ptr` must be
   *  aligned to the dtype's element size ("[Tensor::from_blob] pointer 0x... is not aligned to the
   *  4 bytes of a f32 element"). */
  static Tensor from_blob(void* ptr, const Shape& shape, DType dtype, Device device);
  /** Strided variant; `strides` in elements. */
  static Tensor from_blob(void* ptr, const Shape& shape, const Shape& strides, DType dtype, Device device);
  /** A contiguous tensor on `storage` at element `offset`; used to carve views of one arena. The
   *  storage's memory must be aligned to the dtype's element size. */
  static Tensor on_storage(std::shared_ptr<Storage> storage, int64_t offset, const Shape& shape, DType dtype);

  /** False for a default-constructed tensor (no storage). */
  bool defined() const { return storage_ != nullptr; }
  /** Size of each dim. */
  const Shape& shape() const { return layout_ ? layout_->shape : no_dims(); }
  /** Stride of each dim, in elements. */
  const Shape& strides() const { return layout_ ? layout_->strides : no_dims(); }
  /** Number of dims (0 for a scalar). */
  int64_t dim() const { return int64_t(shape().size()); }
  /** Size of dim `d`; negative d counts from the end. */
  int64_t size(int64_t d) const;
  /** Elements from the start of the storage to element 0. */
  int64_t offset() const { return offset_; }
  /** Element type of the storage. */
  DType dtype() const { return dtype_; }
  /** The storage's device; Device::cpu() for an undefined tensor. */
  Device device() const;
  /** Number of elements: the product of the shape (1 for a scalar). */
  int64_t numel() const { return layout_ ? layout_->numel : 1; }
  /** Bytes per element of dtype(). */
  size_t element_size() const { return dtype_size(dtype_); }
  /** Logical bytes: numel * element_size. */
  size_t nbytes() const { return size_t(numel()) * element_size(); }
  /** Row-major dense: each stride is the product of the later dims' sizes (a dim of size 1 may
   *  have any stride). */
  bool is_contiguous() const { return !layout_ || layout_->contiguous; }
  /** The shared storage; null for an undefined tensor. */
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  /** True while the storage is released (a shell). */
  bool is_released() const { return storage_ && storage_->released(); }

  /** Address of element 0; throws when the storage is released. */
  void* data_ptr() const;
  /** data_ptr() as a T*; T is not checked against dtype(). */
  template <typename T>
  T* data() const { return static_cast<T*>(data_ptr()); }

  /** Same elements with a new shape (one dim may be -1); contiguous tensors only. */
  Tensor view(const Shape& shape) const;
  /** Swaps two dims (strided view). */
  Tensor transpose(int64_t d0, int64_t d1) const;
  /** Elements [start, start+length) of dim `d`. */
  Tensor narrow(int64_t d, int64_t start, int64_t length) const;
  /** The block at `offset` with `shape` (one entry per dim): narrow() on every dim. */
  Tensor block(const Shape& offset, const Shape& shape) const;
  /** Index `index` of dim `d`, which is removed. */
  Tensor select(int64_t d, int64_t index) const;

  /** A contiguous copy on `device` (synchronous; on the default stream of the source's GPU, else
   *  of the destination's, else of the CPU).
   *  It is not ordered after work still queued on other streams: synchronise the stream that
   *  writes this tensor first (the same holds for clone() and to_float_vector()). */
  Tensor to(Device device) const;
  /** A contiguous copy with the same dtype and device (synchronous; see to()). */
  Tensor clone() const;
  /** Host values as float (synchronous copy for device tensors); for tests and small reads. */
  std::vector<float> to_float_vector() const;
  /** A contiguous tensor of `dtype` on `device` holding `values` rounded to it (built on the CPU,
   *  then copied synchronously as to() does). */
  static Tensor from_floats(const std::vector<float>& values, const Shape& shape, DType dtype = DType::f32,
                            Device device = Device::cpu());

  /** "Tensor(f32, [3, 4], cpu)". */
  std::string str() const;

 private:
  /** Shape and strides, shared by a tensor's copies and never changed once built: a view with
   *  other dims builds its own. */
  struct Layout {
    Layout(Shape shape, Shape strides);
    Shape shape;
    Shape strides;  // elements
    int64_t numel;  // the product of shape
    bool contiguous;
  };
  /** The shape of an undefined tensor. */
  static const Shape& no_dims();
  void set_layout(Shape shape, Shape strides) {
    layout_ = std::make_shared<const Layout>(std::move(shape), std::move(strides));
  }

  std::shared_ptr<Storage> storage_;
  std::shared_ptr<const Layout> layout_;  // null for an undefined tensor
  int64_t offset_ = 0;                    // elements from storage start
  DType dtype_ = DType::f32;
};

}  // namespace swapopt
