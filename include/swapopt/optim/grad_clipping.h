#pragma once
/** Global gradient-norm clipping, as torch.nn.utils.clip_grad_norm_ computes it, across HSDP ranks. */

#include <vector>

#include "swapopt/comm/communicator.h"
#include "swapopt/optim/param.h"

namespace swapopt {

/** The L2 norm over every element of every defined grad of `params`, then, when it exceeds
 *  `max_norm`, every grad scaled by max_norm / (norm + 1e-6) on `stream` (torch's rule); returns
 *  the norm before clipping. Per-grad sums of squares run on `stream`; their total is taken on the
 *  host in f64 (this synchronises `stream`). With `world` (every rank of the params' mesh, as
 *  Muon::enable_hsdp takes it), each element counts once across ranks: a param with a DTensor
 *  layout weighs its local shard by 1 / (ranks holding the same elements), a param without one
 *  (the same on every rank) by 1 / world size, and the weighted sums are all-reduced. Every rank
 *  gets the same norm and clips alike. A non-finite norm is returned and clips nothing. */
double clip_grad_norm(const std::vector<ParamPtr>& params, double max_norm, Stream& stream, Communicator* world = nullptr);

}  // namespace swapopt
