#pragma once
// The lifecycle of one NCCL communicator (internal), with the NCCL calls behind a seam so that the
// logic is tested on machines without a GPU: non-blocking init polled against a deadline, abort at
// most once, destroy exactly once and never after an abort (ncclCommAbort frees the communicator).

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>

namespace swapopt::nccl {

/** What an NCCL call or its asynchronous state says. */
enum class Status { success, in_progress, error };

/** The NCCL calls on a communicator handle: nccl_communicator.cpp has the real ones. */
class Api {
 public:
  virtual ~Api() = default;
  /** ncclCommGetAsyncError; on an error, `message` gets NCCL's string. */
  virtual Status async_error(void* comm, std::string& message) = 0;
  /** ncclCommAbort (frees the communicator). */
  virtual void abort(void* comm) = 0;
  /** ncclCommFinalize, then ncclCommDestroy (frees the communicator). */
  virtual void destroy(void* comm) = 0;
};

using Clock = std::chrono::steady_clock;

/** Sole owner of one communicator handle, shared by the communicator and its work handles. */
class CommState {
 public:
  /** `what` names the communicator in errors, e.g. "[comm] NCCL rank 1 of 4". */
  CommState(std::shared_ptr<Api> api, std::string what);
  /** Destroys the communicator unless it was aborted or never made; never throws. */
  ~CommState();
  CommState(const CommState&) = delete;
  CommState& operator=(const CommState&) = delete;

  /** Runs `start` (a non-blocking ncclCommInitRankConfig writing the handle), then polls until the
   *  communicator is ready. An error, or `deadline` passing (a peer that never joins), aborts it
   *  and throws "<what>: init ... " naming the cause. */
  void init(const std::function<Status(void** comm)>& start, Clock::time_point deadline, std::chrono::milliseconds timeout);
  /** After a call that returned `status`: polls while it is in progress; an error or the deadline
   *  aborts and throws "<what>: <op>: ...". */
  void settle(Status status, const std::string& op, Clock::time_point deadline, std::chrono::milliseconds timeout);
  /** One poll of the asynchronous state: an error aborts and throws "<what>: <op> failed: ...". */
  void check(const std::string& op);
  /** Aborts and throws "<what>: <op> did not complete within <timeout> ms ...". */
  [[noreturn]] void expire(const std::string& op, std::chrono::milliseconds timeout);
  /** Runs `call` on the handle, which no abort can free meanwhile (another thread's timeout waits
   *  until the call returns); throws once the communicator was aborted. */
  Status call(const std::function<Status(void* comm)>& call);
  /** Aborts once (later calls do nothing); never throws. */
  void abort() noexcept;
  bool aborted();

 private:
  [[noreturn]] void fail(const std::string& message);

  std::shared_ptr<Api> api_;
  std::string what_;
  std::shared_mutex mutex_;  // shared while NCCL uses the handle, exclusive to make or free it
  void* comm_ = nullptr;
  bool aborted_ = false;
};

}  // namespace swapopt::nccl
