#pragma once
// CPU streams and events (internal): a stream is a worker thread running its queue in order.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "../core/stream_impl.h"

namespace swapopt::cpu {

/** A task's failure, shared by every stream it reaches through events (a stream that waits on an
 *  event recorded behind it fails too, as CUDA's errors are sticky); reported once in all. */
class StreamFailure {
 public:
  explicit StreamFailure(std::exception_ptr error) : error_(std::move(error)) {}
  /** Rethrows the error, unless a synchronize() of any stream it reached did already. */
  void report();
  /** Whether report() ran: a stream waiting on it then no longer takes it up (the trainer was
   *  told; its work after a reload must run). */
  bool reported() const { return reported_.load(); }

 private:
  const std::exception_ptr error_;
  std::atomic<bool> reported_{false};
};

/** One recorded point of an event: set once when the stream reaches it, with the failure that
 *  stream held then (null if none). */
class CompletionMark {
 public:
  void signal(std::shared_ptr<StreamFailure> failure);
  /** Blocks until signalled; returns the failure held by the recording stream at that point. */
  std::shared_ptr<StreamFailure> wait();
  bool done();
  /** When signal() ran (valid once done). */
  std::chrono::steady_clock::time_point signalled_at();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::shared_ptr<StreamFailure> failure_;
  std::chrono::steady_clock::time_point signalled_at_;
};

class CpuStream final : public StreamImpl {
 public:
  CpuStream();
  ~CpuStream() override;
  Device device() const override { return Device::cpu(); }
  void wait(EventImpl& event) override;
  void synchronize() override;
  /** The queue itself (what Stream::borrow takes on the CPU). */
  void* native_handle() const override { return const_cast<CpuStream*>(this); }
  void enqueue(std::function<void()> fn) override { push(std::move(fn), false); }
  /** Control tasks (event signals and waits) run even after an earlier task failed, so no waiter
   *  is left blocked; ordinary tasks after a failure are skipped until synchronize() reports it. */
  void push(std::function<void()> fn, bool control);
  /** True while a task is queued or running. */
  bool busy();
  /** The failure the stream holds (an earlier task threw, here or behind an event it waited on;
   *  not yet taken by synchronize), or null. */
  std::shared_ptr<StreamFailure> held_failure();

 private:
  struct Task {
    std::function<void()> fn;
    bool control;
  };
  void run();
  /** Holds `failure` unless the stream holds one already: its later ordinary tasks are skipped. */
  void adopt(std::shared_ptr<StreamFailure> failure);

  std::mutex mutex_;
  std::condition_variable work_cv_;  // worker: queue non-empty or stopping
  std::condition_variable idle_cv_;  // synchronize: nothing queued or running
  std::deque<Task> queue_;
  size_t pending_ = 0;  // queued + running
  bool stopping_ = false;
  std::shared_ptr<StreamFailure> error_;
  std::thread worker_;  // last: starts after the members above exist
};

/** Runs `fn` once every CPU stream has run the work queued on it so far: now when all are idle,
 *  else as a control task on each busy one, the last of them running it. Never waits, so a
 *  stream's own task may call it. */
void after_queued_work(std::function<void()> fn);

class CpuEvent final : public EventImpl {
 public:
  void record(StreamImpl& stream) override;
  bool query() const override;
  void synchronize() const override;
  void* native_handle() const override { return nullptr; }
  double elapsed_ms_since(const EventImpl& start) const override;
  /** The last recorded mark, or null if never recorded. */
  std::shared_ptr<CompletionMark> mark() const;

 private:
  mutable std::mutex mutex_;
  std::shared_ptr<CompletionMark> mark_;
};

}  // namespace swapopt::cpu
