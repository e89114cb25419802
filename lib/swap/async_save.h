#pragma once
// A checkpoint written on a background thread from the host mirrors while training goes on
// (internal): the next steps' offloads into a mirror wait only until the writer has taken it.

#include <condition_variable>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "../optim/checkpoint_stream.h"
#include "swapopt/swap/pipeline_swap_runtime.h"

namespace swapopt {

class AsyncSave final : public MirrorReader {
 public:
  /** Starts writing `source` to `path` (as write_checkpoint does). `mirrors` names the tensor of
   *  `source` that reads each slot's mirror in place; every other source must own its bytes. */
  AsyncSave(CheckpointSource source, std::unordered_map<const SwapSlot*, std::string> mirrors, std::string path);
  /** Waits for the writer (an error it met is dropped: wait() reports it). */
  ~AsyncSave() override;
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;

  void wait_released(std::span<SwapSlot* const> slots) override;
  void wait_all() override;
  /** Waits for the file to be committed; throws what the writer met ("[checkpoint] saving ...
   *  in the background failed: ...") the first time it is asked. */
  void wait();
  /** The writer has finished (committed or failed): wait() would not block. */
  bool finished();

 private:
  void run();

  CheckpointSource source_;
  std::unordered_map<const SwapSlot*, std::string> mirrors_;
  std::string path_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::unordered_map<std::string, bool> written_;  // by tensor name: its bytes are in the file
  bool finished_ = false;
  std::exception_ptr error_;
  std::thread writer_;  // last: starts after the members above exist
};

}  // namespace swapopt
