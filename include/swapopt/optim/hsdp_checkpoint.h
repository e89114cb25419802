#pragma once
/** Full copies of HSDP Muon state for checkpoints: non-owners keep no momentum, so a replica that
 *  must save (or hand over) the whole state first receives it from the owners. */

#include "swapopt/optim/checkpoint.h"
#include "swapopt/optim/muon.h"

namespace swapopt {

/** Completes `state` (this rank's state_dict() of an HSDP Muon, bare or swapped) with the momentum
 *  of every HSDP param this rank does not own, broadcast from its owner over the replica block:
 *  every replica of a shard then holds the same full copy (to save one checkpoint per shard, or to
 *  load into a different replica layout; loading keeps only the owned state). Collective: every
 *  rank calls it at the same point. A rank's own state_dict() lists the params whose state it
 *  keeps ("param_kept"); a load that would update a param the saving rank did not keep (another
 *  plan or rank) refuses it by name, and the full copy drops the list. */
StateDict broadcast_state_to_replicas(Muon& muon, StateDict state);

}  // namespace swapopt
