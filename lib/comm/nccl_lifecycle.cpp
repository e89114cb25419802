#include "nccl_lifecycle.h"

#include <thread>

#include "swapopt/core/error.h"

namespace swapopt::nccl {

CommState::CommState(std::shared_ptr<Api> api, std::string what) : api_(std::move(api)), what_(std::move(what)) {}

CommState::~CommState() {
  std::unique_lock lock(mutex_);
  if (comm_ != nullptr && !aborted_) api_->destroy(comm_);
}

void CommState::init(const std::function<Status(void**)>& start, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  Status status;
  {
    std::unique_lock lock(mutex_);
    SWAPOPT_CHECK(comm_ == nullptr && !aborted_, what_ << ": init called twice");
    status = start(&comm_);
  }
  if (status == Status::error && comm_ == nullptr) fail(what_ + ": init failed");
  settle(status, "init (waiting for every rank to join)", deadline, timeout);
}

void CommState::settle(Status status, const std::string& op, Clock::time_point deadline, std::chrono::milliseconds timeout) {
  for (;;) {
    std::string message;
    if (status != Status::error) status = call([&](void* comm) { return api_->async_error(comm, message); });
    if (status == Status::success) return;
    if (status == Status::error) {
      abort();
      fail(what_ + ": " + op + " failed: " + (message.empty() ? std::string("NCCL error") : message) +
           " (the communicator was aborted)");
    }
    if (Clock::now() > deadline) expire(op, timeout);
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

void CommState::check(const std::string& op) {
  std::string message;
  if (call([&](void* comm) { return api_->async_error(comm, message); }) != Status::error) return;
  abort();
  fail(what_ + ": " + op + " failed: " + message + " (the communicator was aborted)");
}

void CommState::expire(const std::string& op, std::chrono::milliseconds timeout) {
  abort();
  fail(what_ + ": " + op + " did not complete within " + std::to_string(timeout.count()) + " ms (the communicator was aborted)");
}

Status CommState::call(const std::function<Status(void*)>& f) {
  std::shared_lock lock(mutex_);
  SWAPOPT_CHECK(!aborted_, what_ << " was aborted after an earlier error or timeout: create a new communicator");
  return f(comm_);
}

void CommState::abort() noexcept {
  std::unique_lock lock(mutex_);
  if (aborted_ || comm_ == nullptr) {
    aborted_ = true;
    return;
  }
  aborted_ = true;
  api_->abort(comm_);
}

bool CommState::aborted() {
  std::shared_lock lock(mutex_);
  return aborted_;
}

void CommState::fail(const std::string& message) { throw Error(message); }

}  // namespace swapopt::nccl
