#pragma once
// CUDA streams and events (internal; includes CUDA headers).

#include <cublas_v2.h>
#include <cuda.h>
#include <cuda_runtime.h>

#include <mutex>
#include <new>

#include "../core/stream_impl.h"

namespace swapopt::cuda {

/** Makes device `index`'s primary context current for the scope and then restores exactly the
 *  caller's context, or none if the thread had none: no context is ever created on a device the
 *  caller did not use, and the runtime's selected device of the thread is never touched. */
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  /** For destructor paths: reports a failure on stderr instead of throwing. */
  DeviceGuard(int index, std::nothrow_t) noexcept;
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  CUcontext previous_ = nullptr;
  bool changed_ = false;
};

/** The device whose context allocates pinned memory no CUDA stream asked for: use_device()'s, else
 *  the calling thread's current. */
int process_device();
/** The same for destructor paths: device 0 when the runtime cannot answer; never throws. */
int process_device(std::nothrow_t) noexcept;

/** A non-blocking cudaStream_t, created here or borrowed from the caller (then never destroyed
 *  here), with its own cuBLAS handle (so cuBLAS workspaces never cross streams) made at its first
 *  GEMM or SYRK: copy streams and most borrowed ones never run cuBLAS, and a handle costs a
 *  workspace and a device synchronisation when destroyed. */
class CudaStream final : public StreamImpl {
 public:
  explicit CudaStream(int index);
  CudaStream(int index, cudaStream_t borrowed);
  ~CudaStream() override;
  Device device() const override { return Device::cuda(index_); }
  int index() const { return index_; }
  void wait(EventImpl& event) override;
  void synchronize() override;
  void* native_handle() const override { return stream_; }
  void enqueue(std::function<void()> fn) override;
  cudaStream_t stream() const { return stream_; }
  /** The stream's cuBLAS handle, made at the first call; call with the stream's device current. */
  cublasHandle_t cublas() const;

 private:
  int index_;
  cudaStream_t stream_ = nullptr;
  bool owned_ = true;
  mutable std::once_flag cublas_made_;
  mutable cublasHandle_t cublas_ = nullptr;
};

class CudaEvent final : public EventImpl {
 public:
  CudaEvent(int index, bool enable_timing);
  ~CudaEvent() override;
  void record(StreamImpl& stream) override;
  bool query() const override;
  void synchronize() const override;
  void* native_handle() const override { return event_; }
  double elapsed_ms_since(const EventImpl& start) const override;

 private:
  int index_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace swapopt::cuda
