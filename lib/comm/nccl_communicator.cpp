// NCCL: ids exchanged through the Gloo bootstrap; collectives on the given CUDA stream; waits poll
// completion and NCCL's asynchronous error, aborting the communicator on a timeout.
#include <nccl.h>

#include <thread>

#include "../cuda/cuda_check.h"
#include "../cuda/cuda_stream.h"
#include "swapopt/comm/communicator.h"
#include "swapopt/core/error.h"
#include "swapopt/core/stream.h"

/** Throws swapopt::Error with the call text, file:line and NCCL's error string. */
#define SWAPOPT_NCCL_CHECK(call)                                                                                      \
  do {                                                                                                                \
    const ncclResult_t swapopt_nccl_status_ = (call);                                                                 \
    SWAPOPT_CHECK(swapopt_nccl_status_ == ncclSuccess, "[nccl] " #call " failed at " << __FILE__ << ":" << __LINE__ \
                                                                 << ": " << ncclGetErrorString(swapopt_nccl_status_)); \
  } while (0)

namespace swapopt {

bool nccl_built() { return true; }

namespace {

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
  }
  return ncclFloat32;
}

class NcclWork final : public Work {
 public:
  NcclWork(ncclComm_t comm, cudaEvent_t done, std::string what, std::chrono::milliseconds timeout)
      : comm_(comm), done_(done), what_(std::move(what)), deadline_(std::chrono::steady_clock::now() + timeout) {}
  ~NcclWork() override { SWAPOPT_CUDA_WARN(cudaEventDestroy(done_)); }

  void wait() override {
    for (;;) {
      const cudaError_t status = cudaEventQuery(done_);
      if (status == cudaSuccess) return;
      SWAPOPT_CHECK(status == cudaErrorNotReady, what_ << ": " << cudaGetErrorString(status));
      ncclResult_t async = ncclSuccess;
      SWAPOPT_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
      if (async != ncclSuccess && async != ncclInProgress) {
        ncclCommAbort(comm_);
        SWAPOPT_FAIL(what_ << ": " << ncclGetErrorString(async));
      }
      if (std::chrono::steady_clock::now() > deadline_) {
        ncclCommAbort(comm_);
        SWAPOPT_FAIL(what_ << ": timed out; the communicator was aborted");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  ncclComm_t comm_;
  cudaEvent_t done_;
  std::string what_;
  std::chrono::steady_clock::time_point deadline_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Communicator> bootstrap, const Stream& stream, std::chrono::milliseconds timeout)
      : bootstrap_(std::move(bootstrap)), stream_(stream), timeout_(timeout) {
    SWAPOPT_CHECK(stream_.device().is_cuda(), "[comm] NCCL needs a CUDA stream, got one on " << stream_.device().str());
    ncclUniqueId id{};
    if (bootstrap_->rank() == 0) SWAPOPT_NCCL_CHECK(ncclGetUniqueId(&id));
    const Tensor id_bytes = Tensor::from_blob(&id, {NCCL_UNIQUE_ID_BYTES / 4}, DType::f32, Device::cpu());
    bootstrap_->broadcast(id_bytes, 0)->wait();
    cuda::DeviceGuard guard(stream_.device().index);
    SWAPOPT_NCCL_CHECK(ncclCommInitRank(&comm_, bootstrap_->size(), id, bootstrap_->rank()));
  }
  ~NcclCommunicator() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }

  int rank() const override { return bootstrap_->rank(); }
  int size() const override { return bootstrap_->size(); }
  std::string backend() const override { return "nccl"; }

  WorkPtr broadcast(const Tensor& tensor, int root) override {
    check(tensor, "broadcast");
    SWAPOPT_NCCL_CHECK(ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.nbytes(), ncclUint8, root, comm_, raw()));
    return finish("broadcast");
  }
  WorkPtr all_gather(const Tensor& in, const Tensor& out) override {
    check(in, "all_gather");
    check(out, "all_gather");
    SWAPOPT_CHECK(out.nbytes() == in.nbytes() * size_t(size()), "[comm] all_gather output " << out.str() << " must hold "
                                                                                             << size() << " x " << in.str());
    SWAPOPT_NCCL_CHECK(ncclAllGather(in.data_ptr(), out.data_ptr(), in.nbytes(), ncclUint8, comm_, raw()));
    return finish("all_gather");
  }
  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out) override {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    SWAPOPT_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * size(),
                  "[comm] reduce_scatter: input of " << size() << " x the output's elements, got " << in.str() << " -> "
                                                     << out.str());
    SWAPOPT_NCCL_CHECK(ncclReduceScatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()), nccl_type(out.dtype()), ncclSum,
                                         comm_, raw()));
    return finish("reduce_scatter");
  }
  WorkPtr all_reduce(const Tensor& tensor) override {
    check(tensor, "all_reduce");
    SWAPOPT_NCCL_CHECK(ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), size_t(tensor.numel()), nccl_type(tensor.dtype()),
                                     ncclSum, comm_, raw()));
    return finish("all_reduce");
  }
  void barrier() override {
    const Tensor token = Tensor::zeros({1}, DType::f32, stream_.device());
    all_reduce(token)->wait();
  }
  std::unique_ptr<Communicator> sub_group(const std::vector<int>& ranks, const std::string& name) override {
    std::shared_ptr<Communicator> sub_bootstrap = bootstrap_->sub_group(ranks, name + ".nccl");
    return std::make_unique<NcclCommunicator>(std::move(sub_bootstrap), stream_, timeout_);
  }

 private:
  cudaStream_t raw() const { return static_cast<cudaStream_t>(stream_.native_handle()); }

  void check(const Tensor& t, const char* op) const {
    SWAPOPT_CHECK(t.device() == stream_.device() && t.is_contiguous(),
                  "[comm] " << op << " on NCCL needs contiguous tensors on " << stream_.device().str() << ", got " << t.str());
  }

  WorkPtr finish(const char* collective) {
    cudaEvent_t done = nullptr;
    SWAPOPT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    SWAPOPT_CUDA_CHECK(cudaEventRecord(done, raw()));
    return std::make_shared<NcclWork>(comm_, done, std::string("[comm] ") + collective + " on rank " + std::to_string(rank()),
                                      timeout_);
  }

  std::shared_ptr<Communicator> bootstrap_;
  Stream stream_;
  std::chrono::milliseconds timeout_;
  ncclComm_t comm_ = nullptr;
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, const Stream& stream,
                                                     std::chrono::milliseconds timeout) {
  SWAPOPT_CHECK(bootstrap != nullptr, "[comm] make_nccl_communicator needs a bootstrap communicator");
  return std::make_unique<NcclCommunicator>(std::move(bootstrap), stream, timeout);
}

}  // namespace swapopt
