#include "cpu_stream.h"

#include <algorithm>
#include <atomic>
#include <vector>

#include "swapopt/core/error.h"

namespace swapopt::cpu {

void CompletionMark::signal() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    signalled_at_ = std::chrono::steady_clock::now();
  }
  cv_.notify_all();
}

void CompletionMark::wait() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return done_; });
}

std::chrono::steady_clock::time_point CompletionMark::signalled_at() {
  std::lock_guard<std::mutex> lock(mutex_);
  return signalled_at_;
}

bool CompletionMark::done() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_;
}

namespace {

/** The queue of every CPU stream whose worker runs, for after_queued_work(). Locked before any
 *  queue's mutex. Never destroyed: streams outlive statics. */
std::mutex& registry_mutex() {
  static std::mutex* const mutex = new std::mutex();
  return *mutex;
}
std::vector<CpuStream::Queue*>& registry() {
  static std::vector<CpuStream::Queue*>* const queues = new std::vector<CpuStream::Queue*>();
  return *queues;
}

}  // namespace

CpuStream::CpuStream() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().push_back(queue_.get());
  }
  worker_ = std::thread([queue = queue_] { run(*queue); });  // it leaves the registry as it ends
}

CpuStream::~CpuStream() {
  {
    std::lock_guard<std::mutex> lock(queue_->mutex);
    queue_->stopping = true;
  }
  queue_->work_cv.notify_all();
  if (worker_.get_id() == std::this_thread::get_id()) {
    worker_.detach();  // one of its own tasks dropped the last handle: it drains the queue and exits
  } else {
    worker_.join();
  }
}

void CpuStream::Queue::push(std::function<void()> fn, bool control) {
  {
    std::lock_guard<std::mutex> lock(mutex);
    tasks.push_back({std::move(fn), control});
    ++pending;
  }
  work_cv.notify_one();
}

bool CpuStream::Queue::busy() {
  std::lock_guard<std::mutex> lock(mutex);
  return pending > 0;
}

void after_queued_work(std::function<void()> fn) {
  {
    // Under the registry's lock no worker ends before its task is queued.
    std::lock_guard<std::mutex> lock(registry_mutex());
    std::vector<CpuStream::Queue*> busy;
    for (CpuStream::Queue* queue : registry())
      if (queue->busy()) busy.push_back(queue);
    if (!busy.empty()) {
      auto left = std::make_shared<std::atomic<size_t>>(busy.size());
      auto shared = std::make_shared<std::function<void()>>(std::move(fn));
      for (CpuStream::Queue* queue : busy)
        queue->push(
            [left, shared] {
              if (left->fetch_sub(1) == 1) (*shared)();
            },
            true);
      return;
    }
  }
  fn();
}

void CpuStream::run(Queue& queue) {
  std::unique_lock<std::mutex> lock(queue.mutex);
  for (;;) {
    queue.work_cv.wait(lock, [&] { return queue.stopping || !queue.tasks.empty(); });
    if (queue.tasks.empty()) {
      // Stopping and drained: the queue leaves the registry (locked first, as everywhere), unless
      // after_queued_work queued a task meanwhile.
      lock.unlock();
      std::lock_guard<std::mutex> registry_lock(registry_mutex());
      lock.lock();
      if (queue.tasks.empty()) {
        registry().erase(std::find(registry().begin(), registry().end(), &queue));
        return;
      }
      continue;
    }
    Queue::Task task = std::move(queue.tasks.front());
    queue.tasks.pop_front();
    const bool skip = queue.error && !task.control;
    lock.unlock();
    std::exception_ptr failure;
    if (!skip) {
      try {
        task.fn();
      } catch (...) {
        failure = std::current_exception();
      }
    }
    task.fn = nullptr;  // drop captured tensors (and maybe the stream's last handle) before reporting idle
    lock.lock();
    if (failure && !queue.error) queue.error = failure;
    if (--queue.pending == 0) queue.idle_cv.notify_all();
  }
}

void CpuStream::wait(EventImpl& event) {
  std::shared_ptr<CompletionMark> mark = static_cast<CpuEvent&>(event).mark();
  if (!mark) return;  // never recorded: nothing to wait for (as in CUDA)
  push([mark] { mark->wait(); }, true);
}

void CpuStream::synchronize() {
  // The task running now counts as pending: waiting for the stream from it would never end.
  SWAPOPT_CHECK(std::this_thread::get_id() != worker_.get_id(),
                "[Stream::synchronize] called from a task of the same stream, which would wait for itself forever "
                "(clone() and to() synchronise the default stream, so they cannot run in one of its tasks)");
  std::unique_lock<std::mutex> lock(queue_->mutex);
  queue_->idle_cv.wait(lock, [&] { return queue_->pending == 0; });
  if (queue_->error) {
    std::exception_ptr error = queue_->error;
    queue_->error = nullptr;
    std::rethrow_exception(error);
  }
}

void CpuEvent::record(StreamImpl& stream) {
  auto mark = std::make_shared<CompletionMark>();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    mark_ = mark;
  }
  static_cast<CpuStream&>(stream).push([mark] { mark->signal(); }, true);
}

std::shared_ptr<CompletionMark> CpuEvent::mark() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return mark_;
}

bool CpuEvent::query() const {
  std::shared_ptr<CompletionMark> current = mark();
  return !current || current->done();
}

double CpuEvent::elapsed_ms_since(const EventImpl& start) const {
  const std::shared_ptr<CompletionMark> from = static_cast<const CpuEvent&>(start).mark(), to = mark();
  SWAPOPT_CHECK(from && to && from->done() && to->done(), "[Event::elapsed_ms] both events must be recorded and complete");
  return std::chrono::duration<double, std::milli>(to->signalled_at() - from->signalled_at()).count();
}

void CpuEvent::synchronize() const {
  std::shared_ptr<CompletionMark> current = mark();
  if (current) current->wait();
}

}  // namespace swapopt::cpu
