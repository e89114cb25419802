#pragma once
/** Device and pinned-host allocators that count current and peak bytes. */

#include <cstddef>
#include <cstdint>

#include "swapopt/core/device.h"

namespace swapopt {

class Stream;

/** Byte counters of one allocator. */
struct MemoryStats {
  /** Bytes allocated and not yet freed, as requested (before any rounding up for alignment). A
   *  stream-ordered free counts when deallocate() is called, not when the stream reaches it. */
  size_t current_bytes = 0;
  /** The highest current_bytes since the allocator was created or reset_peak() last ran. */
  size_t peak_bytes = 0;
  /** Allocations made; a request for 0 bytes returns null and is not counted. */
  uint64_t allocations = 0;
  /** Deallocations of non-null pointers. */
  uint64_t frees = 0;
};

/** Raw memory source. Implementations are thread-safe; sizes passed to deallocate match allocate. */
class Allocator {
 public:
  virtual ~Allocator() = default;
  /** Returns at least `nbytes` bytes, aligned to 256 bytes or more (cudaMalloc's guarantee; 512 on
   *  the CPU backend); `stream` orders the allocation (CUDA) or is ignored. */
  virtual void* allocate(size_t nbytes, Stream* stream) = 0;
  /** Frees `ptr`; on CUDA the free is ordered after work already enqueued on `stream`. */
  virtual void deallocate(void* ptr, size_t nbytes, Stream* stream) = 0;
  /** A snapshot of this allocator's counters. */
  virtual MemoryStats stats() const = 0;
  /** Sets peak to current. */
  virtual void reset_peak() = 0;
  /** Keeps up to `bytes` of freed memory for reuse instead of handing it back to the system (CUDA:
   *  the release threshold of the device's current pool, raised to what is in use plus `bytes`;
   *  CPU backend: freed blocks of 1 MiB and more). Only ever raised; the counters do not include
   *  what is kept. Default: nothing kept. */
  virtual void retain_freed(size_t bytes) { (void)bytes; }
};

/** The allocator of device memory (cudaMallocAsync on CUDA; aligned malloc on the CPU backend). */
Allocator& device_allocator(Device device);

/** Page-locked host memory (cudaHostAlloc when a CUDA device is present; aligned pageable otherwise). */
Allocator& pinned_host_allocator();

/** Shorthand for device_allocator(device).stats(). */
MemoryStats memory_stats(Device device);

/** Shorthand for device_allocator(device).reset_peak(). */
void reset_peak_memory(Device device);

}  // namespace swapopt
