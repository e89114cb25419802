#include "swapopt/core/stream.h"

#include <atomic>
#include <map>
#include <mutex>

#include "../cpu/cpu_stream.h"
#include "../cuda/cuda_backend.h"
#include "stream_impl.h"
#include "swapopt/core/error.h"

namespace swapopt {

namespace {
std::atomic<uint64_t> g_streams_created{0};
std::atomic<uint64_t> g_events_created{0};

/** `device`, or a named error for a device no stream or event can be on (the CPU is index 0). */
Device checked(Device device, const char* who) {
  SWAPOPT_CHECK(device.is_cpu() ? device.index == 0 : device.index >= 0,
                "[" << who << "] no device " << (device.is_cpu() ? "cpu" : "cuda") << " index " << device.index
                    << (device.is_cpu() ? " (the CPU is Device::cpu(), index 0)" : ""));
  return device;
}
}  // namespace

Stream::Stream(Device device) {
  checked(device, "Stream");
  if (device.is_cpu()) {
    impl_ = std::make_shared<cpu::CpuStream>();
  } else {
    impl_ = cuda::make_stream(device.index);
  }
  ++g_streams_created;
}

Stream Stream::borrow(void* native_handle, Device device) {
  if (device.is_cuda()) return Stream(cuda::borrow_stream(native_handle, device.index));  // 0: the legacy default stream
  SWAPOPT_CHECK(native_handle != nullptr, "[Stream::borrow] null stream handle for " << device.str());
  // The CPU handle is the queue itself; the no-op deleter leaves it to its owner.
  return Stream(std::shared_ptr<StreamImpl>(static_cast<cpu::CpuStream*>(native_handle), [](StreamImpl*) {}));
}

Device Stream::device() const { return impl_->device(); }

void Stream::wait(const Event& event) {
  SWAPOPT_CHECK(event.device().type == device().type,
                "[Stream::wait] event on " << event.device().str() << " cannot order a stream on " << device().str());
  impl_->wait(event.impl());
}

void Stream::synchronize() { impl_->synchronize(); }

void* Stream::native_handle() const { return impl_->native_handle(); }

void Stream::enqueue(std::function<void()> fn) {
  SWAPOPT_CHECK(device().is_cpu(), "[Stream::enqueue] host functions run only on CPU streams, not " << device().str());
  SWAPOPT_CHECK(fn != nullptr, "[Stream::enqueue] empty function");
  impl_->enqueue(std::move(fn));
}

Stream& default_stream(Device device) {
  static std::mutex mutex;
  // Never destroyed: at exit the CUDA runtime may already be gone, so their handles stay with the process.
  static auto* streams = new std::map<std::pair<int, int>, Stream>();
  checked(device, "default_stream");
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(int(device.type), device.index);
  auto it = streams->find(key);
  if (it == streams->end()) it = streams->emplace(key, Stream(device)).first;
  return it->second;
}

Event::Event(Device device, bool enable_timing) {
  checked(device, "Event");
  if (device.is_cpu()) {
    impl_ = std::make_shared<cpu::CpuEvent>();
  } else {
    impl_ = cuda::make_event(device.index, enable_timing);
  }
  ++g_events_created;
  device_ = device;
  timing_ = enable_timing;
}

Device Event::device() const { return device_; }

void Event::record(Stream& stream) {
  SWAPOPT_CHECK(stream.device() == device_,
                "[Event::record] event of " << device_.str() << " recorded on a stream of " << stream.device().str());
  impl_->record(stream.impl());
}

bool Event::query() const { return impl_->query(); }

void Event::synchronize() const { impl_->synchronize(); }

double Event::elapsed_ms(const Event& start) const {
  SWAPOPT_CHECK(start.device() == device_, "[Event::elapsed_ms] events on " << start.device().str() << " and " << device_.str());
  SWAPOPT_CHECK(timing_ && start.timing_, "[Event::elapsed_ms] both events must be created with enable_timing");
  return impl_->elapsed_ms_since(start.impl());
}

HandleStats handle_stats() { return {g_streams_created.load(), g_events_created.load()}; }

}  // namespace swapopt
