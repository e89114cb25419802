#include "async_save.h"

#include "swapopt/core/error.h"

namespace swapopt {

AsyncSave::AsyncSave(CheckpointSource source, std::unordered_map<const SwapSlot*, std::string> mirrors, std::string path)
    : source_(std::move(source)), mirrors_(std::move(mirrors)), path_(std::move(path)) {
  for (const auto& [name, tensor] : source_.tensors) written_[name] = false;
  writer_ = std::thread([this] { run(); });
}

AsyncSave::~AsyncSave() {
  if (writer_.joinable()) writer_.join();
}

void AsyncSave::run() {
  std::exception_ptr error;
  try {
    write_checkpoint(source_, path_, [this](const std::string& name) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        written_.at(name) = true;
      }
      changed_.notify_all();
    });
  } catch (...) {
    error = std::current_exception();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::move(error);  // this thread keeps no reference: the waiter may free the exception
    finished_ = true;
  }
  changed_.notify_all();
}

void AsyncSave::wait_released(std::span<SwapSlot* const> slots) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (const SwapSlot* slot : slots) {
    const auto it = mirrors_.find(slot);
    if (it == mirrors_.end()) continue;
    const bool& written = written_.at(it->second);
    changed_.wait(lock, [&] { return finished_ || written; });
  }
}

void AsyncSave::wait_all() {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return finished_; });
}

bool AsyncSave::finished() {
  std::lock_guard<std::mutex> lock(mutex_);
  return finished_;
}

void AsyncSave::wait() {
  wait_all();
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    std::swap(error, error_);
  }
  if (!error) return;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    SWAPOPT_FAIL("[checkpoint] saving '" << path_ << "' in the background failed: " << e.what());
  }
}

}  // namespace swapopt
