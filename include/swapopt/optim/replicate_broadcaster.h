#pragma once
/** Broadcasts HSDP owners' updated params to the other replicas of their block, packed and
 *  asynchronously. */

#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/core/stream.h"
#include "swapopt/optim/hsdp.h"

namespace swapopt {

/** One per step: flush() at the end of each assignment (at most one assignment in flight: it
 *  hands the previous one to the stream first), finish() at the end of the step. Per owner and
 *  dtype, the params (their local shards) are packed into buffers of at most `buffer_bytes` (a
 *  larger param gets one of its own), each param at a 512-byte boundary; an assignment's buffers
 *  are one broadcast_many. The stream and the broadcasts order each other on the device
 *  (Communicator::start_after, Work::finish_before); nothing here waits on the host but the
 *  destructor of a broadcaster whose step failed. The caller waits for the works flush() returns
 *  (in issue order with its other collectives: Muon::finish_hsdp_step). */
class AsyncReplicateBroadcaster {
 public:
  /** `stream` (the optimizer's) runs the packing and unpacking copies. */
  explicit AsyncReplicateBroadcaster(Stream& stream, int64_t buffer_bytes = 512LL << 20)
      : stream_(stream), buffer_bytes_(buffer_bytes) {}
  /** Waits on the host for broadcasts the stream has not taken (a failed step), without throwing:
   *  the buffers must outlive them. */
  ~AsyncReplicateBroadcaster();
  AsyncReplicateBroadcaster(const AsyncReplicateBroadcaster&) = delete;
  AsyncReplicateBroadcaster& operator=(const AsyncReplicateBroadcaster&) = delete;

  /** Packs the owners' params (copies on `stream`, so after the update that precedes them there)
   *  and starts the broadcasts, after the stream's work so far; returns their work (null when
   *  the assignment has no replicas to broadcast to), for the caller's host wait. */
  WorkPtr flush(const HsdpAssignment& assignment);
  /** Hands the broadcasts in flight to the stream: receivers' params are written by copies
   *  enqueued on it, after them. */
  void finish();

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
  Stream& stream_;
  int64_t buffer_bytes_;
  std::vector<Buffer> in_flight_;  // the last flush()'s buffers, until the stream takes them
  WorkPtr in_flight_work_;         // their broadcasts
};

}  // namespace swapopt
