#pragma once
/** Global gradient-norm clipping, as torch.nn.utils.clip_grad_norm_ computes it, across HSDP ranks. */

#include <memory>
#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/optim/param.h"

namespace swapopt {

/** The L2 norm over every element of every defined grad of `params`, then, when it exceeds
 *  `max_norm`, every grad scaled by max_norm / (norm + 1e-6) on `stream` (torch's rule); returns
 *  the norm before clipping. Per-grad sums of squares run on `stream`; their total is taken on the
 *  host in f64 (this synchronises `stream`). With `world` (the group of every rank of the params'
 *  mesh, the one Muon::enable_hsdp takes), each element counts once across ranks: a param with a DTensor
 *  layout weighs its local shard by 1 / (ranks holding the same elements), a param without one
 *  (the same on every rank) by 1 / world size, and each rank's f64 sum is exchanged exactly and
 *  added in rank order, with its max_norm: every rank gets the same norm and clips alike, and
 *  ranks passing different max_norm all throw ("[clip_grad_norm] ranks pass different max_norm
 *  (rank 0: 1, rank 1: 100): ..."), scaling nothing. A non-finite norm is
 *  returned and clips nothing. Throws, changing nothing, for a null param, a param listed twice,
 *  a grad released, of another shape than its param's data, not contiguous or on another
 *  device, and grads sharing memory (each would be
 *  counted and scaled twice). With `world`, a rank whose checks fail still joins the exchange,
 *  and every other rank throws too ("[clip_grad_norm] failed its checks on 1 of 2 ranks ..."),
 *  so none is left waiting in it.
 */
double clip_grad_norm(const std::vector<ParamPtr>& params, double max_norm, Stream& stream, Communicator* world = nullptr);
/** clip_grad_norm with `world` held in a shared_ptr, as Muon::enable_hsdp takes it. */
inline double clip_grad_norm(const std::vector<ParamPtr>& params, double max_norm, Stream& stream,
                             const std::shared_ptr<Communicator>& world) {
  return clip_grad_norm(params, max_norm, stream, world.get());
}

}  // namespace swapopt
