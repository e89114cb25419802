// The Communicator defaults that a backend may override with a stream-ordered version.
#include "swapopt/comm/communicator.h"

#include <exception>

#include "swapopt/core/error.h"
#include "swapopt/core/stream.h"

namespace swapopt {

namespace {

/** Several collectives as one: done when all are. */
class WorkList final : public Work {
 public:
  explicit WorkList(std::vector<WorkPtr> works) : works_(std::move(works)) {}
  void wait() override { wait_every(works_); }
  void finish_before(Stream& consumer) override {
    std::exception_ptr first;  // every one ordered, even after another failed
    for (const WorkPtr& w : works_) try {
        w->finish_before(consumer);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    if (first) std::rethrow_exception(first);
  }

 private:
  std::vector<WorkPtr> works_;
};

}  // namespace

void wait_every(const std::vector<WorkPtr>& works) {
  std::exception_ptr first;
  for (const WorkPtr& w : works) try {
      w->wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  if (first) std::rethrow_exception(first);
}

WorkPtr Communicator::broadcast_many(const std::vector<Tensor>& tensors, const std::vector<int>& roots) {
  SWAPOPT_CHECK(tensors.size() == roots.size(),
                "[comm] broadcast_many: " << tensors.size() << " tensors and " << roots.size() << " roots");
  std::vector<WorkPtr> works;
  for (size_t i = 0; i < tensors.size(); ++i) works.push_back(broadcast(tensors[i], roots[i]));
  return std::make_shared<WorkList>(std::move(works));
}

void Communicator::start_after(Stream& producer) { producer.synchronize(); }

}  // namespace swapopt
