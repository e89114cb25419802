#pragma once
// CUDA streams and events (internal; includes CUDA headers).

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "../core/stream_impl.h"

namespace swapopt::cuda {

/** Makes `index` the current device for the scope, restoring the previous one. */
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

/** A blocking cudaStream_t with its own cuBLAS handle (so cuBLAS workspaces never cross streams). */
class CudaStream final : public StreamImpl {
 public:
  explicit CudaStream(int index);
  ~CudaStream() override;
  Device device() const override { return Device::cuda(index_); }
  void wait(EventImpl& event) override;
  void synchronize() override;
  void* native_handle() const override { return stream_; }
  void enqueue(std::function<void()> fn) override;
  cudaStream_t stream() const { return stream_; }
  cublasHandle_t cublas() const { return cublas_; }

 private:
  int index_;
  cudaStream_t stream_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
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
