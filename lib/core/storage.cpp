#include "swapopt/core/storage.h"

#include "../cpu/cpu_stream.h"
#include "swapopt/core/allocator.h"
#include "swapopt/core/error.h"

namespace swapopt {

namespace {

/** `device`, refused if no such device can exist ("cpu" is index 0; CUDA ordinals are >= 0). */
Device checked(Device device) {
  SWAPOPT_CHECK(device.is_cpu() ? device.index == 0 : device.index >= 0,
                "[Tensor] no device " << (device.is_cpu() ? "cpu" : "cuda") << " index " << device.index
                                      << (device.is_cpu() ? " (the CPU is Device::cpu(), index 0)" : ""));
  return device;
}

}  // namespace

Storage::Storage(size_t nbytes, Device device, Allocator& allocator, Stream* stream)
    : nbytes_(nbytes), device_(checked(device)), allocator_(&allocator) {
  // CPU storages never keep a stream: a CPU stream's worker may be the last holder of a storage,
  // and must not end up owning (and joining) itself.
  if (stream != nullptr && device.is_cuda()) stream_ = *stream;
  ptr_ = allocator_->allocate(nbytes_, stream);
}

Storage::Storage(void* ptr, size_t nbytes, Device device) : ptr_(ptr), nbytes_(nbytes), device_(checked(device)) {}

Storage::~Storage() {
  if (allocator_ != nullptr && ptr_ != nullptr && !bound_) allocator_->deallocate(ptr_, nbytes_, stream_ ? &*stream_ : nullptr);
}

void Storage::release(Stream* stream) {
  SWAPOPT_CHECK(owned(), "[Storage::release] cannot release memory swapopt does not own (from_blob)");
  if (ptr_ == nullptr) return;
  if (bound_) {
    ptr_ = nullptr;
    bound_ = false;
    return;
  }
  if (stream == nullptr && !stream_ && device_.is_cpu()) {
    // As a CUDA free without a stream waits for the device: the bytes go back once the work queued
    // on every CPU stream so far has run (queued ops may still use them; they hold the storage,
    // not its bytes).
    cpu::after_queued_work(
        [allocator = allocator_, ptr = ptr_, nbytes = nbytes_] { allocator->deallocate(ptr, nbytes, nullptr); });
  } else {
    allocator_->deallocate(ptr_, nbytes_, stream != nullptr ? stream : stream_ ? &*stream_ : nullptr);
  }
  ptr_ = nullptr;
}

void Storage::restore(Stream* stream) {
  SWAPOPT_CHECK(owned(), "[Storage::restore] cannot restore memory swapopt does not own (from_blob)");
  if (ptr_ != nullptr || nbytes_ == 0) return;
  ptr_ = allocator_->allocate(nbytes_, stream != nullptr ? stream : stream_ ? &*stream_ : nullptr);
}

void Storage::bind(void* external) {
  SWAPOPT_CHECK(owned() && ptr_ == nullptr, "[Storage::bind] only a released storage swapopt owns can be bound");
  SWAPOPT_CHECK(external != nullptr, "[Storage::bind] null memory");
  ptr_ = external;
  bound_ = true;
}

}  // namespace swapopt
