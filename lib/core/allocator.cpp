#include "swapopt/core/allocator.h"

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <new>

#include "../cpu/cpu_stream.h"
#include "../cuda/cuda_backend.h"
#include "counting_allocator.h"
#include "swapopt/core/error.h"
#include "swapopt/core/stream.h"

namespace swapopt {

namespace {

constexpr size_t kAlignment = 512;
/** Blocks of at least this size are rounded up to a multiple of it, and kept for reuse when freed. */
constexpr size_t kCachedBlock = size_t(1) << 20;

/** Aligned host memory with byte counters: the CPU backend's "device" memory, and the pinned-host
 *  stand-in when no CUDA device is present. Kept as separate instances so that tests can tell
 *  device-resident bytes from host-mirror bytes on the CPU backend too.
 *
 *  After retain_freed(n), freed blocks of 1 MiB and more are kept (up to n bytes) and handed out
 *  again for the same rounded size, as CUDA's pool keeps memory below its release threshold: a
 *  large block malloc'ed afresh is mapped afresh, and its first touch faults in zeroed pages. The
 *  counters see allocations and frees as the caller makes them, whatever the cache holds. */
class HostAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Stream*) override {
    if (nbytes == 0) return nullptr;
    // Rounding up must not wrap past SIZE_MAX (a request that large would get a tiny block).
    SWAPOPT_CHECK(nbytes <= std::numeric_limits<size_t>::max() - kCachedBlock,
                  "[allocator] out of host memory allocating " << nbytes << " bytes");
    const size_t rounded = block_size(nbytes);
    void* ptr = take_cached(rounded);
    if (ptr == nullptr) ptr = std::aligned_alloc(kAlignment, rounded);
    SWAPOPT_CHECK(ptr != nullptr, "[allocator] out of host memory allocating " << nbytes << " bytes");
    counter_.on_allocate(nbytes);
    return ptr;
  }
  /** With a CPU stream the free runs when the stream reaches it (as cudaFreeAsync), so memory a
   *  stream may still read is never handed back early; the counters change at the call, in the
   *  stream-ordered view the CUDA allocator has too. */
  void deallocate(void* ptr, size_t nbytes, Stream* stream) override {
    if (ptr == nullptr) return;
    counter_.on_free(nbytes);
    const size_t rounded = block_size(nbytes);
    if (stream != nullptr && stream->device().is_cpu()) {
      static_cast<cpu::CpuStream&>(stream->impl()).push([this, ptr, rounded] { give_back(ptr, rounded); }, true);
    } else {
      give_back(ptr, rounded);
    }
  }
  MemoryStats stats() const override { return counter_.stats(); }
  void reset_peak() override { counter_.reset_peak(); }
  void retain_freed(size_t bytes) override {
    std::lock_guard<std::mutex> lock(mutex_);
    cache_limit_ = std::max(cache_limit_, bytes);
  }

 private:
  static size_t block_size(size_t nbytes) {
    const size_t unit = nbytes >= kCachedBlock ? kCachedBlock : kAlignment;
    return (nbytes + unit - 1) / unit * unit;
  }
  void* take_cached(size_t rounded) {
    if (rounded < kCachedBlock) return nullptr;
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = cache_.find(rounded);
    if (found == cache_.end()) return nullptr;
    void* ptr = found->second;
    cache_.erase(found);
    cached_bytes_ -= rounded;
    return ptr;
  }
  void give_back(void* ptr, size_t rounded) {
    if (rounded >= kCachedBlock) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_bytes_ + rounded <= cache_limit_) {
        cache_.emplace(rounded, ptr);
        cached_bytes_ += rounded;
        return;
      }
    }
    std::free(ptr);
  }

  ByteCounter counter_;
  std::mutex mutex_;                    // guards the cache: frees run on stream worker threads
  size_t cache_limit_ = 0;              // retain_freed()'s bytes
  std::multimap<size_t, void*> cache_;  // freed blocks by rounded size
  size_t cached_bytes_ = 0;
};

HostAllocator& cpu_device_allocator() {
  static HostAllocator* allocator = new HostAllocator();  // never destroyed: outlives static tensors
  return *allocator;
}

HostAllocator& pageable_pinned_stand_in() {
  static HostAllocator* allocator = new HostAllocator();
  return *allocator;
}

}  // namespace

Allocator& device_allocator(Device device) {
  if (device.is_cpu()) return cpu_device_allocator();
  return cuda::device_allocator(device.index);
}

Allocator& pinned_host_allocator() {
  if (cuda::device_count() > 0) return cuda::pinned_allocator();
  return pageable_pinned_stand_in();
}

MemoryStats memory_stats(Device device) { return device_allocator(device).stats(); }

void reset_peak_memory(Device device) { device_allocator(device).reset_peak(); }

}  // namespace swapopt
