#pragma once
// Thread-safe byte counters shared by every allocator (internal).

#include <mutex>

#include "swapopt/core/allocator.h"

namespace swapopt {

class ByteCounter {
 public:
  void on_allocate(size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.current_bytes += nbytes;
    if (stats_.current_bytes > stats_.peak_bytes) stats_.peak_bytes = stats_.current_bytes;
    ++stats_.allocations;
  }
  void on_free(size_t nbytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.current_bytes -= nbytes;
    ++stats_.frees;
  }
  MemoryStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_;
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.peak_bytes = stats_.current_bytes;
  }

 private:
  mutable std::mutex mutex_;
  MemoryStats stats_;
};

}  // namespace swapopt
