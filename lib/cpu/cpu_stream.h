#pragma once
// CPU streams and events (internal): a stream is a worker thread running its queue in order.

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

/** One recorded point of an event: set once when the stream reaches it. */
class CompletionMark {
 public:
  void signal();
  void wait();
  bool done();
  /** When signal() ran (valid once done). */
  std::chrono::steady_clock::time_point signalled_at();

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
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
  void push(std::function<void()> fn, bool control) { queue_->push(std::move(fn), control); }

  /** The tasks and the worker's state, shared with the worker thread: a task that drops the
   *  stream's last handle destroys the stream on its own worker, which then finishes this queue
   *  and exits by itself (a thread cannot join itself). The queue stays in after_queued_work's
   *  registry until its worker has run its last task. */
  struct Queue {
    struct Task {
      std::function<void()> fn;
      bool control;
    };
    void push(std::function<void()> fn, bool control);
    /** True while a task is queued or running. */
    bool busy();

    std::mutex mutex;
    std::condition_variable work_cv;  // worker: tasks queued or stopping
    std::condition_variable idle_cv;  // synchronize: nothing queued or running
    std::deque<Task> tasks;
    size_t pending = 0;  // queued + running
    bool stopping = false;
    std::exception_ptr error;
  };

 private:
  static void run(Queue& queue);

  std::shared_ptr<Queue> queue_ = std::make_shared<Queue>();
  std::thread worker_;  // last: starts after the queue exists
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
