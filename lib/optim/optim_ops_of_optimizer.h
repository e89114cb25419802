#pragma once
// The fused ops as an optimizer's own step calls them (internal).

#include <span>

#include "swapopt/optim/optim_ops.h"

namespace swapopt::ops {

/** adamw_update_many less the check that no operands share memory, which AdamW's own updates pass
 *  by construction (its params are checked apart each step they move, its state is its own): at
 *  thousands of small params that check would add a sizeable part of the step's host work. */
void adamw_update_many_of_optimizer(Stream& stream, std::span<const AdamWUpdate> updates);

}  // namespace swapopt::ops
