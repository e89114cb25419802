#pragma once
// The fused ops as an optimizer's own step calls them (internal).

#include <span>

#include "swapopt/optim/optim_ops.h"

namespace swapopt::ops {

/** adamw_update_many less the check that no operands share memory, which AdamW's own updates pass
 *  by construction (its params are checked apart each step they move, its state is its own): at
 *  thousands of small params that check would add a sizeable part of the step's host work. */
void adamw_update_many_of_optimizer(Stream& stream, std::span<const AdamWUpdate> updates);

/** The memory checks of adamw_update_many alone, with its messages under `op`: each update's
 *  operands apart, and no write of one update overlapping another's operands. Undefined state
 *  tensors (those the update will create as zeros) share nothing. The optimizer's public update
 *  pieces run it before they create state or count a step, so that such input changes nothing. */
void check_adamw_updates_apart(std::span<const AdamWUpdate> updates, const char* op);

}  // namespace swapopt::ops
