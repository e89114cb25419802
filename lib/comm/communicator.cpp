// The Communicator defaults that a backend may override with a stream-ordered version.
#include "swapopt/comm/communicator.h"

#include "swapopt/core/error.h"
#include "swapopt/core/stream.h"

namespace swapopt {

namespace {

/** Several collectives as one: done when all are. */
class WorkList final : public Work {
 public:
  explicit WorkList(std::vector<WorkPtr> works) : works_(std::move(works)) {}
  void wait() override {
    for (const WorkPtr& w : works_) w->wait();
  }
  void finish_before(Stream& consumer) override {
    for (const WorkPtr& w : works_) w->finish_before(consumer);
  }

 private:
  std::vector<WorkPtr> works_;
};

}  // namespace

WorkPtr Communicator::broadcast_many(const std::vector<Tensor>& tensors, const std::vector<int>& roots) {
  SWAPOPT_CHECK(tensors.size() == roots.size(),
                "[comm] broadcast_many: " << tensors.size() << " tensors and " << roots.size() << " roots");
  std::vector<WorkPtr> works;
  for (size_t i = 0; i < tensors.size(); ++i) works.push_back(broadcast(tensors[i], roots[i]));
  return std::make_shared<WorkList>(std::move(works));
}

void Communicator::start_after(Stream& producer) { producer.synchronize(); }

}  // namespace swapopt
