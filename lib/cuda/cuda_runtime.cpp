// CUDA devices, allocators, streams and events.
#include <cudaTypedefs.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>

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

/** Stream-ordered device memory from the device's pool (cudaMallocAsync). swapopt's streams are
 *  non-blocking, so memory taken or given back without a stream is synchronous instead: the
 *  allocation completes before it returns (usable on every stream), and the free waits for the
 *  device first (no stream may still be using it). Step paths always pass a stream. */
class CudaDeviceAllocator final : public Allocator {
 public:
  explicit CudaDeviceAllocator(int index) : index_(index) {}
  void* allocate(size_t nbytes, Stream* stream) override {
    if (nbytes == 0) return nullptr;
    DeviceGuard guard(index_);
    void* ptr = nullptr;
    SWAPOPT_CUDA_CHECK(cudaMallocAsync(&ptr, nbytes, raw(stream)));
    if (stream == nullptr) {
      const cudaError_t status = cudaStreamSynchronize(nullptr);
      if (status != cudaSuccess) (void)cudaFreeAsync(ptr, nullptr);
      SWAPOPT_CUDA_CHECK(status);
    }
    counter_.on_allocate(nbytes);
    return ptr;
  }
  void deallocate(void* ptr, size_t nbytes, Stream* stream) override {  // reached from ~Storage: never throws
    if (ptr == nullptr) return;
    DeviceGuard guard(index_, std::nothrow);
    if (stream == nullptr) {
      const cudaError_t synced = cudaDeviceSynchronize();
      if (synced == cudaErrorCudartUnloading) return;  // at exit: the driver takes everything back
      if (synced != cudaSuccess)
        std::fprintf(stderr, "swapopt: cudaDeviceSynchronize() before a free failed: %s\n", cudaGetErrorString(synced));
    }
    SWAPOPT_CUDA_WARN(cudaFreeAsync(ptr, raw(stream)));
    counter_.on_free(nbytes);
  }
  MemoryStats stats() const override { return counter_.stats(); }
  void reset_peak() override { counter_.reset_peak(); }
  /** Raises the release threshold of the pool cudaMallocAsync draws from (the device's current
   *  pool: the default one, or the trainer's from cudaDeviceSetMemPool) so that freed memory up to
   *  `bytes` stays in the pool across synchronisations instead of going back to the OS and being
   *  mapped again at the next allocation. The threshold counts all the pool holds, in use or
   *  freed, so it is raised to what is in use now plus `bytes`; never lowered. */
  void retain_freed(size_t bytes) override {
    std::lock_guard<std::mutex> lock(retain_mutex_);
    DeviceGuard guard(index_);
    cudaMemPool_t pool = nullptr;
    SWAPOPT_CUDA_CHECK(cudaDeviceGetMemPool(&pool, index_));
    cuuint64_t used = 0, threshold = 0;
    SWAPOPT_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    SWAPOPT_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    cuuint64_t wanted = used + bytes;
    if (threshold < wanted)  // the trainer may have set a higher one: never lower it
      SWAPOPT_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &wanted));
  }

 private:
  int index_;
  ByteCounter counter_;
  std::mutex retain_mutex_;
};

/** Page-locked host memory (cudaHostAlloc, portable: pinned for every device's context). It is
 *  allocated in the context of the device whose stream asks for it (the swap runtime passes its
 *  compute stream), else in use_device()'s or the thread's current device's, and freed in the
 *  same context: a thread that only used swapopt's streams of device k has no current device of
 *  its own, and the runtime's fallback, device 0, would get a context of its own on every rank. */
class PinnedAllocator final : public Allocator {
 public:
  void* allocate(size_t nbytes, Stream* stream) override {
    if (nbytes == 0) return nullptr;
    const int device = stream != nullptr && stream->device().is_cuda() ? stream->device().index : process_device();
    DeviceGuard guard(device);
    void* ptr = nullptr;
    SWAPOPT_CUDA_CHECK(cudaHostAlloc(&ptr, nbytes, cudaHostAllocPortable));
    {
      std::lock_guard<std::mutex> lock(mutex_);
      devices_[ptr] = device;
    }
    counter_.on_allocate(nbytes);
    return ptr;
  }
  void deallocate(void* ptr, size_t nbytes, Stream*) override {  // reached from ~Storage: never throws
    if (ptr == nullptr) return;
    int device = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const auto found = devices_.find(ptr);
      device = found != devices_.end() ? found->second : process_device(std::nothrow);
      if (found != devices_.end()) devices_.erase(found);
    }
    DeviceGuard guard(device, std::nothrow);
    SWAPOPT_CUDA_WARN(cudaFreeHost(ptr));
    counter_.on_free(nbytes);
  }
  MemoryStats stats() const override { return counter_.stats(); }
  void reset_peak() override { counter_.reset_peak(); }

 private:
  ByteCounter counter_;
  std::mutex mutex_;
  std::unordered_map<void*, int> devices_;  // the device each live allocation was made with
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

namespace {

/** The driver's context calls, reached through the runtime (no link against libcuda), so a guard
 *  can restore "no context" on a thread that had none: cudaSetDevice back to the previous device
 *  would create a context there (device 0 on every thread that never chose one). */
struct DriverContextApi {
  PFN_cuCtxGetCurrent_v4000 get_current = nullptr;
  PFN_cuCtxSetCurrent_v4000 set_current = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDevicePrimaryCtxRetain_v7000 primary_retain = nullptr;
};

template <typename Fn>
cudaError_t driver_entry(const char* symbol, Fn& fn) {
  void* ptr = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const cudaError_t status = cudaGetDriverEntryPointByVersion(symbol, &ptr, 12000, cudaEnableDefault, &found);
  if (status != cudaSuccess) return status;
  if (found != cudaDriverEntryPointSuccess || ptr == nullptr) return cudaErrorSymbolNotFound;
  fn = reinterpret_cast<Fn>(ptr);
  return cudaSuccess;
}

const DriverContextApi& driver_context_api() {
  static const DriverContextApi api = [] {
    DriverContextApi a;
    SWAPOPT_CUDA_CHECK(driver_entry("cuCtxGetCurrent", a.get_current));
    SWAPOPT_CUDA_CHECK(driver_entry("cuCtxSetCurrent", a.set_current));
    SWAPOPT_CUDA_CHECK(driver_entry("cuDeviceGet", a.device_get));
    SWAPOPT_CUDA_CHECK(driver_entry("cuDevicePrimaryCtxRetain", a.primary_retain));
    return a;
  }();
  return api;
}

#define SWAPOPT_CU_CHECK(call) \
  SWAPOPT_CHECK((call) == CUDA_SUCCESS, "[cuda] " #call " failed at " << __FILE__ << ":" << __LINE__)

/** Device `index`'s primary context (the runtime's own), retained once for the process. The
 *  cache is read without a lock on every guarded call and never destroyed (frees at exit use it). */
CUcontext primary_context(int index) {
  static std::atomic<CUcontext>* const contexts = new std::atomic<CUcontext>[size_t(std::max(device_count(), 1))]();
  static std::mutex* const mutex = new std::mutex();
  check_device(index, "DeviceGuard");
  CUcontext ctx = contexts[index].load(std::memory_order_acquire);
  if (ctx != nullptr) return ctx;
  std::lock_guard<std::mutex> lock(*mutex);
  ctx = contexts[index].load(std::memory_order_relaxed);
  if (ctx == nullptr) {
    const DriverContextApi& api = driver_context_api();
    CUdevice device = 0;
    SWAPOPT_CU_CHECK(api.device_get(&device, index));
    SWAPOPT_CU_CHECK(api.primary_retain(&ctx, device));
    contexts[index].store(ctx, std::memory_order_release);
  }
  return ctx;
}

}  // namespace

// The comparison is with the primary context itself, not its device: a trainer's own context on
// the same device (cuCtxCreate, green contexts) cannot run swapopt's streams and handles.
DeviceGuard::DeviceGuard(int index) {
  const DriverContextApi& api = driver_context_api();
  SWAPOPT_CU_CHECK(api.get_current(&previous_));
  const CUcontext target = primary_context(index);
  if (previous_ == target) return;
  SWAPOPT_CU_CHECK(api.set_current(target));
  changed_ = true;
}

DeviceGuard::DeviceGuard(int index, std::nothrow_t) noexcept {
  try {
    const DriverContextApi& api = driver_context_api();
    if (api.get_current(&previous_) != CUDA_SUCCESS) return;
    const CUcontext target = primary_context(index);
    if (previous_ == target) return;
    changed_ = api.set_current(target) == CUDA_SUCCESS;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "swapopt: making CUDA device %d current failed: %s\n", index, e.what());
  }
}

DeviceGuard::~DeviceGuard() {
  // Back to exactly the caller's context, or to none: never a context the caller did not have.
  if (changed_ && driver_context_api().set_current(previous_) != CUDA_SUCCESS)
    std::fprintf(stderr, "swapopt: restoring the caller's CUDA context failed\n");
}

CudaStream::CudaStream(int index) : index_(index) {
  check_device(index, "Stream");
  DeviceGuard guard(index);
  // Non-blocking: ordered with other streams (the trainer's, the legacy default stream) only
  // through events, so a copy stream never waits for unrelated work there.
  SWAPOPT_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

CudaStream::CudaStream(int index, cudaStream_t borrowed) : index_(index), stream_(borrowed), owned_(false) {
  check_device(index, "Stream::borrow");
}

cublasHandle_t CudaStream::cublas() const {
  // A failed attempt leaves the flag unset: the next call tries again.
  std::call_once(cublas_made_, [this] {
    DeviceGuard guard(index_);
    cublasHandle_t handle = nullptr;
    SWAPOPT_CUBLAS_CHECK(cublasCreate(&handle));
    const cublasStatus_t bound = cublasSetStream(handle, stream_);
    if (bound != CUBLAS_STATUS_SUCCESS) cublasDestroy(handle);
    SWAPOPT_CUBLAS_CHECK(bound);
    cublas_ = handle;
  });
  return cublas_;
}

CudaStream::~CudaStream() {
  DeviceGuard guard(index_, std::nothrow);
  if (cublas_ != nullptr) {
    const cublasStatus_t destroyed = cublasDestroy(cublas_);
    if (destroyed != CUBLAS_STATUS_SUCCESS)
      std::fprintf(stderr, "swapopt: cublasDestroy() failed: %s\n", cublasGetStatusString(destroyed));
  }
  if (owned_ && stream_ != nullptr) SWAPOPT_CUDA_WARN(cudaStreamDestroy(stream_));
}

void CudaStream::wait(EventImpl& event) {
  DeviceGuard guard(index_);  // every call: on a thread without a context the runtime binds device 0's
  SWAPOPT_CUDA_CHECK(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(event.native_handle()), 0));
}

void CudaStream::synchronize() {
  DeviceGuard guard(index_);
  SWAPOPT_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaStream::enqueue(std::function<void()>) {
  SWAPOPT_FAIL("[Stream::enqueue] host functions run only on CPU streams");
}

CudaEvent::CudaEvent(int index, bool enable_timing) : index_(index) {
  check_device(index, "Event");
  DeviceGuard guard(index);
  SWAPOPT_CUDA_CHECK(cudaEventCreateWithFlags(&event_, enable_timing ? cudaEventDefault : cudaEventDisableTiming));
}

double CudaEvent::elapsed_ms_since(const EventImpl& start) const {
  DeviceGuard guard(index_);
  float ms = 0.f;
  SWAPOPT_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.native_handle()), event_));
  return double(ms);
}

CudaEvent::~CudaEvent() {
  DeviceGuard guard(index_, std::nothrow);
  if (event_ != nullptr) SWAPOPT_CUDA_WARN(cudaEventDestroy(event_));
}

void CudaEvent::record(StreamImpl& stream) {
  DeviceGuard guard(index_);
  SWAPOPT_CUDA_CHECK(cudaEventRecord(event_, static_cast<cudaStream_t>(stream.native_handle())));
}

bool CudaEvent::query() const {
  DeviceGuard guard(index_);
  const cudaError_t status = cudaEventQuery(event_);
  if (status == cudaErrorNotReady) return false;
  SWAPOPT_CUDA_CHECK(status);
  return true;
}

void CudaEvent::synchronize() const {
  DeviceGuard guard(index_);
  SWAPOPT_CUDA_CHECK(cudaEventSynchronize(event_));
}

std::shared_ptr<StreamImpl> make_stream(int index) { return std::make_shared<CudaStream>(index); }

std::shared_ptr<EventImpl> make_event(int index, bool enable_timing) {
  return std::make_shared<CudaEvent>(index, enable_timing);
}

}  // namespace swapopt::cuda
