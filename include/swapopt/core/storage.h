#pragma once
/** A block of bytes on one device, shared by every tensor view of it, releasable and restorable. */

#include <cstddef>
#include <optional>

#include "swapopt/core/device.h"
#include "swapopt/core/stream.h"

namespace swapopt {

class Allocator;

/** Invariants: nbytes never changes; data() is null exactly while released; a borrowed storage
 *  (from_blob) is never freed by swapopt and can be neither released nor restored. */
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

  void* data() const { return ptr_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  bool owned() const { return allocator_ != nullptr; }
  bool released() const { return ptr_ == nullptr && nbytes_ > 0; }
  Allocator* allocator() const { return allocator_; }

  /** Frees the bytes and keeps the size (a "shell"); on CUDA the free is ordered on `stream`
   *  (default: the stream the storage was allocated on). */
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
