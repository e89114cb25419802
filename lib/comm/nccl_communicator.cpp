// NCCL: ids exchanged through the Gloo bootstrap; a non-blocking communicator whose lifecycle
// (init against the timeout, abort once, destroy once) is nccl_lifecycle.h's; collectives on the
// given CUDA stream; waits poll completion and NCCL's asynchronous error, aborting on a timeout.
#include <nccl.h>

#include <functional>
#include <thread>

#include "../cuda/cuda_check.h"
#include "nccl_lifecycle.h"
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

nccl::Status status_of(ncclResult_t r) {
  if (r == ncclSuccess) return nccl::Status::success;
  return r == ncclInProgress ? nccl::Status::in_progress : nccl::Status::error;
}

/** The real NCCL calls of nccl_lifecycle.h. */
class RealApi final : public nccl::Api {
 public:
  nccl::Status async_error(void* comm, std::string& message) override {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(static_cast<ncclComm_t>(comm), &state);
    if (r != ncclSuccess) state = r;
    if (status_of(state) == nccl::Status::error)
      message = std::string(ncclGetErrorString(state)) + " (" + ncclGetLastError(static_cast<ncclComm_t>(comm)) + ")";
    return status_of(state);
  }
  void abort(void* comm) override { ncclCommAbort(static_cast<ncclComm_t>(comm)); }
  void destroy(void* comm) override {
    // A non-blocking communicator finalises asynchronously: wait a bounded time, else abort.
    const ncclComm_t c = static_cast<ncclComm_t>(comm);
    ncclResult_t r = ncclCommFinalize(c);
    const auto deadline = nccl::Clock::now() + std::chrono::seconds(10);
    while (r == ncclInProgress && nccl::Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
      if (ncclCommGetAsyncError(c, &r) != ncclSuccess) break;
    }
    if (r == ncclSuccess) {
      ncclCommDestroy(c);
    } else {
      ncclCommAbort(c);
    }
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<nccl::CommState> state, int device, cudaEvent_t done, std::string what,
           std::chrono::milliseconds timeout)
      : state_(std::move(state)), device_(device), done_(done), what_(std::move(what)), timeout_(timeout),
        deadline_(nccl::Clock::now() + timeout) {}
  ~NcclWork() override {
    cuda::DeviceGuard guard(device_, std::nothrow);
    SWAPOPT_CUDA_WARN(cudaEventDestroy(done_));
  }

  void wait() override {
    cuda::DeviceGuard guard(device_);
    for (;;) {
      const cudaError_t status = cudaEventQuery(done_);
      if (status == cudaSuccess) return;
      SWAPOPT_CHECK(status == cudaErrorNotReady, "[comm] NCCL " << what_ << ": " << cudaGetErrorString(status));
      state_->check(what_);  // an asynchronous NCCL error (or an earlier abort) ends the wait
      if (nccl::Clock::now() > deadline_) state_->expire(what_, timeout_);
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

 private:
  std::shared_ptr<nccl::CommState> state_;
  int device_;
  cudaEvent_t done_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  nccl::Clock::time_point deadline_;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Communicator> bootstrap, const Stream& stream, std::chrono::milliseconds timeout)
      : bootstrap_(std::move(bootstrap)), stream_(stream), timeout_(timeout) {
    SWAPOPT_CHECK(stream_.device().is_cuda(), "[comm] NCCL needs a CUDA stream, got one on " << stream_.device().str());
    state_ = std::make_shared<nccl::CommState>(std::make_shared<RealApi>(), "[comm] NCCL rank " + std::to_string(rank()) +
                                                                                 " of " + std::to_string(size()));
    ncclUniqueId id{};
    if (bootstrap_->rank() == 0) SWAPOPT_NCCL_CHECK(ncclGetUniqueId(&id));
    const Tensor id_bytes = Tensor::from_blob(&id, {NCCL_UNIQUE_ID_BYTES / 4}, DType::f32, Device::cpu());
    bootstrap_->broadcast(id_bytes, 0)->wait();
    cuda::DeviceGuard guard(stream_.device().index);
    // Non-blocking init, polled against the timeout: a rank that never joins is a named error
    // here instead of a hang in ncclCommInitRank.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    state_->init(
        [&](void** comm) {
          return status_of(ncclCommInitRankConfig(reinterpret_cast<ncclComm_t*>(comm), size(), id, rank(), &config));
        },
        nccl::Clock::now() + timeout_, timeout_);
  }

  int rank() const override { return bootstrap_->rank(); }
  int size() const override { return bootstrap_->size(); }
  std::string backend() const override { return "nccl"; }

  WorkPtr broadcast(const Tensor& tensor, int root) override {
    check(tensor, "broadcast");
    cuda::DeviceGuard guard(stream_.device().index);
    return finish("broadcast", [&](ncclComm_t c) {
      return ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.nbytes(), ncclUint8, root, c, raw());
    });
  }
  WorkPtr all_gather(const Tensor& in, const Tensor& out) override {
    check(in, "all_gather");
    check(out, "all_gather");
    SWAPOPT_CHECK(out.nbytes() == in.nbytes() * size_t(size()), "[comm] all_gather output " << out.str() << " must hold "
                                                                                             << size() << " x " << in.str());
    cuda::DeviceGuard guard(stream_.device().index);
    return finish("all_gather",
                  [&](ncclComm_t c) { return ncclAllGather(in.data_ptr(), out.data_ptr(), in.nbytes(), ncclUint8, c, raw()); });
  }
  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out) override {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    SWAPOPT_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * size(),
                  "[comm] reduce_scatter: input of " << size() << " x the output's elements, got " << in.str() << " -> "
                                                     << out.str());
    cuda::DeviceGuard guard(stream_.device().index);
    return finish("reduce_scatter", [&](ncclComm_t c) {
      return ncclReduceScatter(in.data_ptr(), out.data_ptr(), size_t(out.numel()), nccl_type(out.dtype()), ncclSum, c, raw());
    });
  }
  WorkPtr all_reduce(const Tensor& tensor) override {
    check(tensor, "all_reduce");
    cuda::DeviceGuard guard(stream_.device().index);
    return finish("all_reduce", [&](ncclComm_t c) {
      return ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), size_t(tensor.numel()), nccl_type(tensor.dtype()), ncclSum, c,
                           raw());
    });
  }
  void barrier() override {
    const Tensor token = Tensor::zeros({1}, DType::f32, stream_.device());
    all_reduce(token)->wait();
  }
  // Sub-groups get ids through the bootstrap's own sub-group: only the members call, which is
  // the Communicator contract (ncclCommSplit would need every rank of this group to call it).
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

  /** Issues `collective` on the handle (held against a concurrent abort), settles it (a
   *  non-blocking communicator may still be enqueueing it), then records its completion on the
   *  stream (event on the stream's device, which is current here). */
  WorkPtr finish(const char* collective, const std::function<ncclResult_t(ncclComm_t)>& issue) {
    const std::string what = collective;  // the state's errors name the rank and group size
    ncclResult_t result = ncclSuccess;
    state_->call([&](void* comm) {
      result = issue(static_cast<ncclComm_t>(comm));
      return status_of(result);
    });
    if (status_of(result) == nccl::Status::error) {
      state_->abort();
      SWAPOPT_FAIL("[comm] NCCL rank " << rank() << " of " << size() << ": " << what << " failed: "
                                        << ncclGetErrorString(result) << " (the communicator was aborted)");
    }
    state_->settle(status_of(result), collective, nccl::Clock::now() + timeout_, timeout_);
    cudaEvent_t done = nullptr;
    SWAPOPT_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    SWAPOPT_CUDA_CHECK(cudaEventRecord(done, raw()));
    return std::make_shared<NcclWork>(state_, stream_.device().index, done, what, timeout_);
  }

  std::shared_ptr<Communicator> bootstrap_;
  Stream stream_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<nccl::CommState> state_;  // shared with the work handles: destroyed once, after the last
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, const Stream& stream,
                                                     std::chrono::milliseconds timeout) {
  SWAPOPT_CHECK(bootstrap != nullptr, "[comm] make_nccl_communicator needs a bootstrap communicator");
  return std::make_unique<NcclCommunicator>(std::move(bootstrap), stream, timeout);
}

}  // namespace swapopt
