#pragma once
/** A block of bytes on one device, shared by every tensor view of it, releasable and restorable. */

#include <cstddef>
#include <optional>

#include "swapopt/core/device.h"
#include "swapopt/core/stream.h"

namespace swapopt {

class Allocator;

/** Invariants: nbytes never changes; data() is null while released (an owned storage of 0 bytes
 *  has null data() too, but is never released); a borrowed storage (from_blob) is never freed by
 *  swapopt and can be neither released nor restored. */
class Storage {
 public:
  /** Allocates `nbytes` from `allocator` (owned). With a `stream`, the allocation and every later
   *  free without an explicit stream are ordered on it (CUDA stream-ordered memory), so a
   *  workspace used only on that stream never synchronises other streams. */
  Storage(size_t nbytes, Device device, Allocator& allocator, Stream* stream = nullptr);
  /** Wraps memory the caller owns and keeps alive (borrowed). */
  Storage(void* ptr, size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  /** The bytes (owned, borrowed or bound); null while released. */
  void* data() const { return ptr_; }
  /** Size in bytes, fixed at construction (a borrowed storage: the span its view addresses). */
  size_t nbytes() const { return nbytes_; }
  /** Where the bytes live; pinned host memory is Device::cpu(). */
  Device device() const { return device_; }
  /** True when swapopt allocated the bytes and frees them; false for borrowed memory (from_blob). */
  bool owned() const { return allocator_ != nullptr; }
  /** True while the bytes are freed (a shell): after release(), until restore() or bind(). */
  bool released() const { return ptr_ == nullptr && nbytes_ > 0; }
  /** The allocator that allocates and frees the bytes; null for borrowed memory. */
  Allocator* allocator() const { return allocator_; }

  /** Frees the bytes and keeps the size (a "shell"). With a `stream` (or on CUDA the stream the
   *  storage was allocated on) the free is ordered on it; without one it comes after all work
   *  queued so far (CUDA: a synchronous free; CPU: once every CPU stream has run its queue up to
   *  now, without waiting). */
  void release(Stream* stream = nullptr);
  /** Allocates the bytes again at the same size; contents are undefined. */
  void restore(Stream* stream = nullptr);
  /** Points a released owned storage at `nbytes()` bytes of memory owned elsewhere (a staging
   *  arena) without owning them; release() then only drops the pointer. */
  void bind(void* external);
  /** True while bound to external memory. */
  bool bound() const { return bound_; }

 private:
  void* ptr_ = nullptr;
  size_t nbytes_ = 0;
  Device device_;
  Allocator* allocator_ = nullptr;  // null for borrowed memory
  std::optional<Stream> stream_;    // CUDA only: orders frees without an explicit stream
  bool bound_ = false;              // ptr_ is external memory (bind), not ours to free
};

}  // namespace swapopt
