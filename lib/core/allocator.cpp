#include "swapopt/core/allocator.h"

#include <cstdlib>
#include <new>

#include "../cpu/cpu_stream.h"
#include "../cuda/cuda_backend.h"
#include "counting_allocator.h"
#include "swapopt/core/error.h"
#include "swapopt/core/stream.h"

namespace swapopt {

namespace {

constexpr size_t kAlignment = 512;

/** Aligned host memory with byte counters: the CPU backend's "device" memory, and the pinned-host
 *  stand-in when no CUDA device is present. Kept as separate instances so that tests can tell
 *  device-resident bytes from host-mirror bytes on the CPU backend too. */
class HostAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Stream*) override {
    if (nbytes == 0) return nullptr;
    const size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    void* ptr = std::aligned_alloc(kAlignment, rounded);
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
    if (stream != nullptr && stream->device().is_cpu()) {
      static_cast<cpu::CpuStream&>(stream->impl()).push([ptr] { std::free(ptr); }, true);
    } else {
      std::free(ptr);
    }
  }
  MemoryStats stats() const override { return counter_.stats(); }
  void reset_peak() override { counter_.reset_peak(); }

 private:
  ByteCounter counter_;
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
