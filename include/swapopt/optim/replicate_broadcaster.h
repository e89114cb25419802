#pragma once
/** Broadcasts HSDP owners' updated params to the other replicas of their block, packed and
 *  asynchronously. */

#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/core/stream.h"
#include "swapopt/optim/hsdp.h"

namespace swapopt {

/** One per step: flush() at the end of each assignment (at most one assignment in flight: it
 *  hands the previous one to the stream first), wait_all() at the end of the step. Per owner and
 *  dtype, the params (their local shards) are packed into buffers of at most `buffer_bytes` (a
 *  larger param gets one of its own), each param at a 512-byte boundary; an assignment's buffers
 *  are one broadcast_many. The stream and the broadcasts order each other on the device
 *  (Communicator::start_after, Work::finish_before); only wait_all() waits on the host. */
class AsyncReplicateBroadcaster {
 public:
  /** `stream` (the optimizer's) runs the packing and unpacking copies. */
  explicit AsyncReplicateBroadcaster(Stream& stream, int64_t buffer_bytes = 512LL << 20)
      : stream_(stream), buffer_bytes_(buffer_bytes) {}
  /** Waits on the host for what no stream took, without throwing: the buffers must outlive it. */
  ~AsyncReplicateBroadcaster();
  AsyncReplicateBroadcaster(const AsyncReplicateBroadcaster&) = delete;
  AsyncReplicateBroadcaster& operator=(const AsyncReplicateBroadcaster&) = delete;

  /** Packs the owners' params (copies on `stream`, so after the update that precedes them there)
   *  and starts the broadcasts, after the stream's work so far. */
  void flush(const HsdpAssignment& assignment);
  /** Hands the broadcasts in flight to the stream (receivers' params are written by copies
   *  enqueued on it, after them), then waits on the host for every broadcast since construction
   *  or the last wait_all(), rethrowing the first error. */
  void wait_all();

 private:
  struct Buffer {
    Tensor packed;
    std::vector<Param*> params;
    std::vector<int64_t> offsets;  // element offset of each param in `packed`
    int root = 0;                  // the owner
    bool receive = false;          // this rank is not the owner: unpack after the broadcast

    /** Where params[i] lives in `packed`, shaped like it. */
    Tensor slot(size_t i) const {
      return packed.narrow(0, offsets[i], params[i]->data.numel()).view(params[i]->data.shape());
    }
  };
  /** The stream waits for the broadcasts in flight and unpacks them; their work moves to taken_. */
  void take_in_flight();

  Stream& stream_;
  int64_t buffer_bytes_;
  std::vector<Buffer> in_flight_;  // the last flush()'s buffers, until the stream takes them
  WorkPtr in_flight_work_;         // their broadcasts
  std::vector<WorkPtr> taken_;     // broadcasts the stream took, for wait_all()'s host wait
};

}  // namespace swapopt
