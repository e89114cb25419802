#include "swapopt/optim/replicate_broadcaster.h"

#include <algorithm>

#include "swapopt/core/ops.h"

namespace swapopt {

AsyncReplicateBroadcaster::~AsyncReplicateBroadcaster() {
  // A step that failed between flush() and finish(): its stream never took the broadcasts, so
  // the buffers may be freed only once they completed.
  if (in_flight_.empty()) return;
  try {
    in_flight_work_->wait();
  } catch (...) {  // the step already failed; its error is the one that propagates
  }
}

WorkPtr AsyncReplicateBroadcaster::flush(const HsdpAssignment& assignment) {
  finish();  // at most one assignment in flight
  if (!assignment.replicas) return nullptr;
  // The same buffers on every rank of the block: owners, dtypes, local shapes and which params
  // have a grad (the step's checks compared them) agree there. A param without one was not
  // updated: each replica keeps its own.
  const auto sent_by = [&](size_t i, int owner) {
    return assignment.owners[i] == owner && assignment.params[i]->has_grad();
  };
  std::vector<Buffer> buffers;
  for (int owner = 0; owner < assignment.replicas->size(); ++owner) {
    std::vector<DType> dtypes;
    for (size_t i = 0; i < assignment.params.size(); ++i)
      if (sent_by(i, owner) &&
          std::find(dtypes.begin(), dtypes.end(), assignment.params[i]->data.dtype()) == dtypes.end())
        dtypes.push_back(assignment.params[i]->data.dtype());
    for (DType dtype : dtypes) {
      const int64_t cap = std::max<int64_t>(1, buffer_bytes_ / int64_t(dtype_size(dtype)));
      Buffer current;
      int64_t used = 0;
      auto close = [&] {
        if (current.params.empty()) return;
        current.packed = Tensor::empty({used}, dtype, stream_.device(), &stream_);
        current.root = owner;
        current.receive = owner != assignment.local_coordinate;
        buffers.push_back(std::move(current));
        current = Buffer();
        used = 0;
      };
      for (size_t i = 0; i < assignment.params.size(); ++i) {
        Param* p = assignment.params[i];
        if (!sent_by(i, owner) || p->data.dtype() != dtype) continue;
        if (used > 0 && used + p->data.numel() > cap) close();
        current.params.push_back(p);
        current.offsets.push_back(used);
        used = align_to_512_bytes(used + p->data.numel(), dtype);
      }
      close();
    }
  }
  if (buffers.empty()) return nullptr;
  std::vector<Tensor> packed;
  std::vector<int> roots;
  for (const Buffer& b : buffers) {
    if (!b.receive)
      for (size_t i = 0; i < b.params.size(); ++i)
        ops::copy(stream_, b.params[i]->data, b.slot(i));  // after the update: same stream
    packed.push_back(b.packed);
    roots.push_back(b.root);
  }
  assignment.replicas->start_after(stream_);  // the broadcasts read the packed buffers
  in_flight_work_ = assignment.replicas->broadcast_many(packed, roots);
  in_flight_ = std::move(buffers);
  return in_flight_work_;
}

void AsyncReplicateBroadcaster::finish() {
  if (in_flight_.empty()) return;
  // The stream waits for the broadcasts (no host wait): the receivers' copies below run after
  // them, and the buffers, freed in order on the stream, outlive them. (If this throws, the
  // buffers stay for the destructor's host wait.)
  in_flight_work_->finish_before(stream_);
  for (const Buffer& b : in_flight_)
    if (b.receive)
      for (size_t i = 0; i < b.params.size(); ++i) ops::copy(stream_, b.slot(i), b.params[i]->data);
  in_flight_.clear();
  in_flight_work_.reset();
}

}  // namespace swapopt
