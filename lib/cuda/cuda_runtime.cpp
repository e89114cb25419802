// CUDA devices, allocators, streams and events.
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>

#include "../core/counting_allocator.h"
#include "cuda_backend.h"
#include "cuda_check.h"
#include "cuda_stream.h"

namespace swapopt::cuda {

bool built() { return true; }

int device_count() {
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();  // no driver or no device: clear the sticky status
      return 0;
    }
    return n;
  }();
  return count;
}

namespace {

void check_device(int index, const char* what) {
  SWAPOPT_CHECK(index >= 0 && index < device_count(),
                "[cuda] " << what << ": no CUDA device " << index << " (" << device_count() << " visible)");
}

cudaStream_t raw(Stream* stream) { return stream ? static_cast<cudaStream_t>(stream->native_handle()) : nullptr; }

/** Stream-ordered device memory (cudaMallocAsync); a free without a stream goes on the legacy
 *  default stream, which orders after every blocking stream swapopt creates. */
class CudaDeviceAllocator final : public Allocator {
 public:
  explicit CudaDeviceAllocator(int index) : index_(index) {}
  void* allocate(size_t nbytes, Stream* stream) override {
    if (nbytes == 0) return nullptr;
    DeviceGuard guard(index_);
    void* ptr = nullptr;
    SWAPOPT_CUDA_CHECK(cudaMallocAsync(&ptr, nbytes, raw(stream)));
    counter_.on_allocate(nbytes);
    return ptr;
  }
  void deallocate(void* ptr, size_t nbytes, Stream* stream) override {  // reached from ~Storage: never throws
    if (ptr == nullptr) return;
    DeviceGuard guard(index_, std::nothrow);
    SWAPOPT_CUDA_WARN(cudaFreeAsync(ptr, raw(stream)));
    counter_.on_free(nbytes);
  }
  MemoryStats stats() const override { return counter_.stats(); }
  void reset_peak() override { counter_.reset_peak(); }

 private:
  int index_;
  ByteCounter counter_;
};

class PinnedAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Stream*) override {
    if (nbytes == 0) return nullptr;
    DeviceGuard guard(process_device());
    void* ptr = nullptr;
    // Portable: pinned for every device's context, not only the one current here.
    SWAPOPT_CUDA_CHECK(cudaHostAlloc(&ptr, nbytes, cudaHostAllocPortable));
    counter_.on_allocate(nbytes);
    return ptr;
  }
  void deallocate(void* ptr, size_t nbytes, Stream*) override {  // reached from ~Storage: never throws
    if (ptr == nullptr) return;
    DeviceGuard guard(process_device(std::nothrow), std::nothrow);
    SWAPOPT_CUDA_WARN(cudaFreeHost(ptr));
    counter_.on_free(nbytes);
  }
  MemoryStats stats() const override { return counter_.stats(); }
  void reset_peak() override { counter_.reset_peak(); }

 private:
  ByteCounter counter_;
};

}  // namespace

Allocator& device_allocator(int index) {
  check_device(index, "device_allocator");
  static std::mutex mutex;
  static std::map<int, CudaDeviceAllocator*> allocators;  // never destroyed: outlive static tensors
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = allocators[index];
  if (slot == nullptr) slot = new CudaDeviceAllocator(index);
  return *slot;
}

Allocator& pinned_allocator() {
  static PinnedAllocator* allocator = new PinnedAllocator();
  return *allocator;
}

std::shared_ptr<StreamImpl> borrow_stream(void* native, int index) {
  return std::make_shared<CudaStream>(index, static_cast<cudaStream_t>(native));
}

void memset_sync(void* ptr, size_t nbytes, int index) {
  DeviceGuard guard(index);
  SWAPOPT_CUDA_CHECK(cudaMemset(ptr, 0, nbytes));
  SWAPOPT_CUDA_CHECK(cudaDeviceSynchronize());
}

namespace {
std::atomic<int> g_process_device{-1};
}  // namespace

void set_process_device(int index) {
  check_device(index, "use_device");
  SWAPOPT_CUDA_CHECK(cudaSetDevice(index));
  g_process_device = index;
}

int process_device() {
  const int chosen = g_process_device;
  if (chosen >= 0) return chosen;
  int current = 0;
  SWAPOPT_CUDA_CHECK(cudaGetDevice(&current));
  return current;
}

int process_device(std::nothrow_t) noexcept {
  const int chosen = g_process_device;
  int current = 0;
  if (chosen >= 0 || cudaGetDevice(&current) != cudaSuccess) return chosen >= 0 ? chosen : 0;
  return current;
}

DeviceGuard::DeviceGuard(int index) : index_(index) {
  SWAPOPT_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != index) SWAPOPT_CUDA_CHECK(cudaSetDevice(index));
}

DeviceGuard::DeviceGuard(int index, std::nothrow_t) : index_(index) {
  if (cudaGetDevice(&previous_) != cudaSuccess) {
    previous_ = index_ = -1;  // nothing to restore
    return;
  }
  if (previous_ != index) SWAPOPT_CUDA_WARN(cudaSetDevice(index));
}

DeviceGuard::~DeviceGuard() {
  if (previous_ != index_) SWAPOPT_CUDA_WARN(cudaSetDevice(previous_));
}

CudaStream::CudaStream(int index) : index_(index) {
  check_device(index, "Stream");
  DeviceGuard guard(index);
  SWAPOPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamDefault));
  SWAPOPT_CUBLAS_CHECK(cublasCreate(&cublas_));
  SWAPOPT_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
}

CudaStream::CudaStream(int index, cudaStream_t borrowed) : index_(index), stream_(borrowed), owned_(false) {
  check_device(index, "Stream::borrow");
  DeviceGuard guard(index);
  // swapopt's frees without a stream go on the legacy default stream, which orders after blocking
  // streams only: a non-blocking one would let such a free overtake work still queued there.
  unsigned flags = 0;
  SWAPOPT_CUDA_CHECK(cudaStreamGetFlags(stream_, &flags));
  SWAPOPT_CHECK(!(flags & cudaStreamNonBlocking), "[Stream::borrow] the stream was created with cudaStreamNonBlocking; "
                                                  "swapopt needs a blocking stream (or the legacy default stream, 0)");
  SWAPOPT_CUBLAS_CHECK(cublasCreate(&cublas_));
  SWAPOPT_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
}

CudaStream::~CudaStream() {
  DeviceGuard guard(index_, std::nothrow);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (owned_ && stream_ != nullptr) SWAPOPT_CUDA_WARN(cudaStreamDestroy(stream_));
}

void CudaStream::wait(EventImpl& event) {
  SWAPOPT_CUDA_CHECK(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(event.native_handle()), 0));
}

void CudaStream::synchronize() { SWAPOPT_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void CudaStream::enqueue(std::function<void()>) {
  SWAPOPT_FAIL("[Stream::enqueue] host functions run only on CPU streams");
}

CudaEvent::CudaEvent(int index, bool enable_timing) : index_(index) {
  check_device(index, "Event");
  DeviceGuard guard(index);
  SWAPOPT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
}

double CudaEvent::elapsed_ms_since(const EventImpl& start) const {
  float ms = 0.f;
  SWAPOPT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.native_handle()), event_));
  return double(ms);
}

CudaEvent::~CudaEvent() {
  DeviceGuard guard(index_, std::nothrow);
  if (event_ != nullptr) SWAPOPT_CUDA_WARN(cudaEventDestroy(event_));
}

void CudaEvent::record(StreamImpl& stream) {
  SWAPOPT_CUDA_CHECK(cudaEventRecord(event_, static_cast<cudaStream_t>(stream.native_handle())));
}

bool CudaEvent::query() const {
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) return false;
  SWAPOPT_CUDA_CHECK(status);
  return true;
}

void CudaEvent::synchronize() const { SWAPOPT_CUDA_CHECK(cudaEventSynchronize(event_)); }

std::shared_ptr<StreamImpl> make_stream(int index) { return std::make_shared<CudaStream>(index); }

std::shared_ptr<EventImpl> make_event(int index, bool enable_timing) {
  return std::make_shared<CudaEvent>(index, enable_timing);
}

}  // namespace swapopt::cuda
