#pragma once
/** Broadcasts HSDP owners' updated params to the other replicas of their block, packed and
 *  asynchronously. */

#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/core/stream.h"
#include "swapopt/optim/hsdp.h"

namespace swapopt {

/** One per step: flush() at the end of each assignment (at most one assignment in flight: it
 *  finishes the previous one first), wait_all() at the end of the step. Per owner and dtype, the
 *  params (their local shards) are packed into buffers of at most `buffer_bytes` (a larger param
 *  gets one of its own), each param at a 512-byte boundary, and each buffer is one broadcast. */
class AsyncReplicateBroadcaster {
 public:
  /** `stream` (the optimizer's) runs the packing and unpacking copies. */
  explicit AsyncReplicateBroadcaster(Stream& stream, int64_t buffer_bytes = 512LL << 20)
      : stream_(stream), buffer_bytes_(buffer_bytes) {}
  /** Waits for what is in flight without throwing: the buffers must outlive the collectives. */
  ~AsyncReplicateBroadcaster();
  AsyncReplicateBroadcaster(const AsyncReplicateBroadcaster&) = delete;
  AsyncReplicateBroadcaster& operator=(const AsyncReplicateBroadcaster&) = delete;

  /** Packs the owners' params (copies on `stream`, so after the update that precedes them there)
   *  and starts the broadcasts. */
  void flush(const HsdpAssignment& assignment);
  /** Waits for the broadcasts in flight; receivers' params are written by copies enqueued on
   *  `stream`. */
  void wait_all();

 private:
  struct Buffer {
    Tensor packed;
    std::vector<Param*> params;
    std::vector<int64_t> offsets;  // element offset of each param in `packed`
    int root = 0;                  // the owner
    bool receive = false;          // this rank is not the owner: unpack after the broadcast
    WorkPtr work;

    /** Where params[i] lives in `packed`, shaped like it. */
    Tensor slot(size_t i) const {
      return packed.narrow(0, offsets[i], params[i]->data.numel()).view(params[i]->data.shape());
    }
  };
  Stream& stream_;
  int64_t buffer_bytes_;
  std::vector<Buffer> in_flight_;
};

}  // namespace swapopt
