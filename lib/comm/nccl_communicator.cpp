// NCCL: ids exchanged through the Gloo bootstrap; a non-blocking communicator whose lifecycle
// (init against the timeout, abort once, destroy once) is nccl_lifecycle.h's; collectives on the
// given CUDA stream; waits poll completion and NCCL's asynchronous error, aborting on a timeout.
#include <nccl.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "../cuda/cuda_check.h"
#include "../cuda/cuda_stream.h"
#include "collective_args.h"
#include "nccl_lifecycle.h"
#include "swapopt/comm/communicator.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"
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

/** Timing-free events of one device, reused: a collective takes one for its completion and its
 *  Work gives it back (a later record does not disturb a stream wait already enqueued on it). */
class EventPool {
 public:
  explicit EventPool(int device) : device_(device) {}
  ~EventPool() {
    cuda::DeviceGuard guard(device_, std::nothrow);
    for (cudaEvent_t e : free_) SWAPOPT_CUDA_WARN(cudaEventDestroy(e));
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  /** A free event (the device is current). */
  cudaEvent_t take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        const cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    SWAPOPT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  void give(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(e);
  }

 private:
  int device_;
  std::mutex mutex_;  // works may be destroyed on any thread
  std::vector<cudaEvent_t> free_;
};

/** An event of the pool, given back when destroyed. */
class PooledEvent {
 public:
  explicit PooledEvent(std::shared_ptr<EventPool> pool) : pool_(std::move(pool)), event_(pool_->take()) {}
  ~PooledEvent() { pool_->give(event_); }
  PooledEvent(const PooledEvent&) = delete;
  PooledEvent& operator=(const PooledEvent&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t event_;
};

/** A collective (or a group of them) between two events of its stream. Its timeout counts from
 *  when the stream reaches `started`: the host may enqueue a whole step ahead of the device, and
 *  the work queued before a collective is not the collective's to wait for. */
class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<nccl::CommState> state, const std::shared_ptr<EventPool>& events, int device,
           std::string what, std::chrono::milliseconds timeout)
      : state_(std::move(state)),
        started_(events),
        done_(events),
        device_(device),
        what_(std::move(what)),
        timeout_(timeout) {}
  cudaEvent_t started() const { return started_.get(); }
  cudaEvent_t done() const { return done_.get(); }

  void wait() override {
    cuda::DeviceGuard guard(device_);
    // A backstop for a stream held by something outside the waits (see make_nccl_communicator).
    const nccl::Clock::time_point unstarted_limit = nccl::Clock::now() + 4 * timeout_;
    for (;;) {
      // An asynchronous NCCL error (or an earlier abort) ends the wait: also where the completion
      // was reached, since an abort ends the collective's kernels without finishing them.
      const bool done = reached(done_.get());
      state_->check(what_);
      if (done) return;
      const nccl::Clock::time_point now = nccl::Clock::now();
      if (!deadline_) {
        if (reached(started_.get())) {
          deadline_ = now + timeout_;
        } else if (now > unstarted_limit) {
          state_->expire(what_ + " (its stream never reached it)", 4 * timeout_);
        }
      } else if (now > *deadline_) {
        state_->expire(what_, timeout_);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  /** `consumer` waits on the completion event on the device. An error NCCL already reported
   *  throws here; a later one or a hang surfaces in wait(). */
  void finish_before(Stream& consumer) override {
    SWAPOPT_CHECK(consumer.device().is_cuda(),
                  "[comm] an NCCL collective orders CUDA streams, got one on " << consumer.device().str());
    cuda::DeviceGuard guard(consumer.device().index);
    // Ordered first, then checked: an aborted collective's kernel still ends, and the buffers the
    // consumer frees in order must outlive it.
    SWAPOPT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(consumer.native_handle()), done_.get(), 0));
    state_->check(what_);
  }

 private:
  /** Whether the stream has passed `event`'s record. */
  bool reached(cudaEvent_t event) const {
    const cudaError_t status = cudaEventQuery(event);
    SWAPOPT_CHECK(status == cudaSuccess || status == cudaErrorNotReady,
                  "[comm] NCCL " << what_ << ": " << cudaGetErrorString(status));
    return status == cudaSuccess;
  }

  std::shared_ptr<nccl::CommState> state_;
  PooledEvent started_, done_;
  int device_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::optional<nccl::Clock::time_point> deadline_;  // set once the stream reached started_
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Communicator> bootstrap, const Stream& stream, std::chrono::milliseconds timeout)
      : bootstrap_(std::move(bootstrap)), stream_(stream), timeout_(timeout) {
    SWAPOPT_CHECK(stream_.device().is_cuda(), "[comm] NCCL needs a CUDA stream, got one on " << stream_.device().str());
    events_ = std::make_shared<EventPool>(stream_.device().index);
    producer_point_.emplace(stream_.device());
    state_ = std::make_shared<nccl::CommState>(std::make_shared<RealApi>(), "[comm] NCCL rank " + std::to_string(rank()) +
                                                                                 " of " + std::to_string(size()));
    alignas(4) ncclUniqueId id{};  // crosses the bootstrap as f32 elements (from_blob wants them aligned)
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
    // Checked here: NCCL fails a bad root asynchronously, which aborts the communicator.
    SWAPOPT_CHECK(root >= 0 && root < size(), "[comm] broadcast root " << root << " outside group of " << size());
    void* data = tensor.data_ptr();
    cuda::DeviceGuard guard(stream_.device().index);
    return finish("broadcast",
                  [&](ncclComm_t c) { return ncclBroadcast(data, data, tensor.nbytes(), ncclUint8, root, c, raw()); });
  }
  /** One NCCL group per kMaxGroupOps broadcasts (older NCCL caps a group at 2048 operations). */
  WorkPtr broadcast_many(const std::vector<Tensor>& tensors, const std::vector<int>& roots) override {
    SWAPOPT_CHECK(tensors.size() == roots.size(),
                  "[comm] broadcast_many: " << tensors.size() << " tensors and " << roots.size() << " roots");
    std::vector<void*> data;  // read before any group opens: nothing may throw inside one
    for (size_t i = 0; i < tensors.size(); ++i) {
      check(tensors[i], "broadcast_many");
      SWAPOPT_CHECK(roots[i] >= 0 && roots[i] < size(),
                    "[comm] broadcast_many root " << roots[i] << " outside group of " << size());
      data.push_back(tensors[i].data_ptr());
    }
    comm_args::check_apart(tensors, "broadcast_many");
    cuda::DeviceGuard guard(stream_.device().index);
    constexpr size_t kMaxGroupOps = 1024;
    return collective("broadcast_many", [&] {
      for (size_t begin = 0; begin < tensors.size(); begin += kMaxGroupOps) {
        const size_t end = std::min(tensors.size(), begin + kMaxGroupOps);
        issue("broadcast_many", [&](ncclComm_t c) {
          ncclResult_t r = ncclGroupStart();
          if (r != ncclSuccess) return r;
          for (size_t i = begin; i < end && (r == ncclSuccess || r == ncclInProgress); ++i)
            r = ncclBroadcast(data[i], data[i], tensors[i].nbytes(), ncclUint8, roots[i], c, raw());
          const ncclResult_t ended = ncclGroupEnd();  // closes the group whatever happened inside it
          return r == ncclSuccess || r == ncclInProgress ? ended : r;
        });
      }
    });
  }
  WorkPtr all_gather(const Tensor& in, const Tensor& out) override {
    check(in, "all_gather");
    check(out, "all_gather");
    SWAPOPT_CHECK(out.nbytes() == in.nbytes() * size_t(size()), "[comm] all_gather output " << out.str() << " must hold "
                                                                                             << size() << " x " << in.str());
    comm_args::check_in_out_apart(in, out, "all_gather");
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
    comm_args::check_in_out_apart(in, out, "reduce_scatter");
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
  /** The NCCL stream waits for an event recorded on `producer` (one event, re-recorded: each
   *  stream wait captures the record before it). */
  void start_after(Stream& producer) override {
    SWAPOPT_CHECK(producer.device() == stream_.device(),
                  "[comm] NCCL on " << stream_.device().str() << " starts after streams of that device, got one on "
                                    << producer.device().str());
    if (producer == stream_ || producer.native_handle() == stream_.native_handle()) return;  // one queue already
    producer_point_->record(producer);
    stream_.wait(*producer_point_);
  }
  void barrier() override {
    // Allocated, zeroed and freed in order on the NCCL stream: a token made without a stream would
    // synchronise the whole device (Tensor::zeros, and its free) and block there, out of reach of
    // the timeout, behind a collective that a missing peer keeps from finishing.
    const Tensor token = Tensor::empty({1}, DType::f32, stream_.device(), &stream_);
    ops::fill_zero(stream_, token);
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
    comm_args::check_usable(t, op);
    SWAPOPT_CHECK(t.device() == stream_.device() && t.is_contiguous(),
                  "[comm] " << op << " on NCCL needs contiguous tensors on " << stream_.device().str() << ", got " << t.str());
  }

  /** Issues `collective` and returns its work (the stream's device is current here). */
  WorkPtr finish(const char* collective, const std::function<ncclResult_t(ncclComm_t)>& call) {
    return this->collective(collective, [&] { issue(collective, call); });
  }

  /** Runs `issue_calls` between the work's two events on the stream. The events are taken
   *  first, so that once a collective is issued only the record of its completion can fail, and
   *  then the communicator is aborted: nothing could order the buffers' frees after it. */
  WorkPtr collective(const char* name, const std::function<void()>& issue_calls) {
    auto work = std::make_shared<NcclWork>(state_, events_, stream_.device().index, name, timeout_);
    SWAPOPT_CUDA_CHECK(cudaEventRecord(work->started(), raw()));
    try {
      issue_calls();
    } catch (...) {
      drain_after_failure(work->done());
      throw;
    }
    const cudaError_t recorded = cudaEventRecord(work->done(), raw());
    if (recorded != cudaSuccess) {
      state_->abort();
      SWAPOPT_FAIL("[comm] NCCL rank " << rank() << " of " << size() << ": recording the end of " << name << " failed: "
                                       << cudaGetErrorString(recorded) << " (the communicator was aborted)");
    }
    return work;
  }

  /** After an issue failed (the communicator is aborted by then): calls issued before it, such as
   *  the earlier groups of a broadcast_many, may still be queued on the stream, and the caller,
   *  given no work to wait on, frees their buffers. The abort ends their kernels; wait for that,
   *  bounded by the timeout, before the error goes up. */
  void drain_after_failure(cudaEvent_t done) {
    if (cudaEventRecord(done, raw()) != cudaSuccess) return;
    const nccl::Clock::time_point deadline = nccl::Clock::now() + timeout_;
    while (cudaEventQuery(done) == cudaErrorNotReady && nccl::Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::microseconds(100));
  }

  /** Runs `call` on the handle (held against a concurrent abort) and settles it: a non-blocking
   *  communicator may still be enqueueing it. */
  void issue(const char* collective, const std::function<ncclResult_t(ncclComm_t)>& call) {
    const std::string what = collective;  // the state's errors name the rank and group size
    ncclResult_t result = ncclSuccess;
    state_->call([&](void* comm) {
      result = call(static_cast<ncclComm_t>(comm));
      return status_of(result);
    });
    if (status_of(result) == nccl::Status::error) {
      state_->abort();
      SWAPOPT_FAIL("[comm] NCCL rank " << rank() << " of " << size() << ": " << what << " failed: "
                                        << ncclGetErrorString(result) << " (the communicator was aborted)");
    }
    state_->settle(status_of(result), collective, nccl::Clock::now() + timeout_, timeout_);
  }

  std::shared_ptr<Communicator> bootstrap_;
  Stream stream_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<nccl::CommState> state_;  // shared with the work handles: destroyed once, after the last
  std::shared_ptr<EventPool> events_;       // shared with the work handles, which give their events back
  std::optional<Event> producer_point_;     // start_after's mark (an Event has no default constructor)
};

}  // namespace

std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, const Stream& stream,
                                                     std::chrono::milliseconds timeout) {
  SWAPOPT_CHECK(bootstrap != nullptr, "[comm] make_nccl_communicator needs a bootstrap communicator");
  return std::make_unique<NcclCommunicator>(std::move(bootstrap), stream, timeout);
}

}  // namespace swapopt
