#include "swapopt/optim/replicate_broadcaster.h"

#include <algorithm>
#include <iterator>

#include "swapopt/core/ops.h"

namespace swapopt {

AsyncReplicateBroadcaster::~AsyncReplicateBroadcaster() {
  for (Buffer& b : in_flight_) try {
      b.work->wait();
    } catch (...) {  // the step already failed; its error is the one that propagates
    }
}

void AsyncReplicateBroadcaster::flush(const HsdpAssignment& assignment) {
  wait_all();  // at most one assignment in flight
  if (!assignment.replicas) return;
  // The same buffers on every rank of the block: owners, dtypes and local shapes agree there.
  std::vector<Buffer> buffers;
  for (int owner = 0; owner < assignment.replicas->size(); ++owner) {
    std::vector<DType> dtypes;
    for (size_t i = 0; i < assignment.params.size(); ++i)
      if (assignment.owners[i] == owner && std::find(dtypes.begin(), dtypes.end(), assignment.params[i]->data.dtype()) == dtypes.end())
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
        if (assignment.owners[i] != owner || p->data.dtype() != dtype) continue;
        if (used > 0 && used + p->data.numel() > cap) close();
        current.params.push_back(p);
        current.offsets.push_back(used);
        used = align_to_512_bytes(used + p->data.numel(), dtype);
      }
      close();
    }
  }
  for (Buffer& b : buffers)
    if (!b.receive)
      for (size_t i = 0; i < b.params.size(); ++i)
        ops::copy(stream_, b.params[i]->data, b.slot(i));  // after the update: same stream
  stream_.synchronize();  // the broadcasts read the packed buffers now
  for (Buffer& b : buffers) {
    b.work = assignment.replicas->broadcast(b.packed, b.root);
    in_flight_.push_back(std::move(b));
  }
}

void AsyncReplicateBroadcaster::wait_all() {
  std::vector<Buffer> pending = std::move(in_flight_);
  in_flight_.clear();
  for (size_t k = 0; k < pending.size(); ++k) {
    Buffer& b = pending[k];
    try {
      b.work->wait();
    } catch (...) {
      in_flight_.assign(std::make_move_iterator(pending.begin() + ptrdiff_t(k) + 1), std::make_move_iterator(pending.end()));
      throw;  // the destructor waits for the rest before their buffers go
    }
    if (!b.receive) continue;
    for (size_t i = 0; i < b.params.size(); ++i) ops::copy(stream_, b.slot(i), b.params[i]->data);
  }
}

}  // namespace swapopt
