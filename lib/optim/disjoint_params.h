#pragma once
// The checks that no two params, or grads, share memory (internal; optimizers, MuonWithAdamW and
// clip_grad_norm use them).

#include <string>
#include <vector>

#include "swapopt/optim/param.h"

namespace swapopt {

/** Throws "[who] parameters 'a' and 'b' share memory (...)" if two of `params` overlap: each
 *  param's update writes its memory, so two over the same bytes would be updated twice (and, in
 *  one fused op, at once). Params without memory (empty or released) share nothing. */
void check_disjoint_params(const std::vector<const Param*>& params, const std::string& who);

/** Throws check_disjoint_params' error for params `a` and `b` (for a check that found them itself). */
[[noreturn]] void fail_params_share_memory(const Param& a, const Param& b, const std::string& who);

/** Throws "[who] the grads of 'a' and 'b' share memory (...)" if two of `params`' grads overlap
 *  (contiguous grads; undefined, empty or released ones share nothing). */
void check_disjoint_grads(const std::vector<const Param*>& params, const std::string& who);

}  // namespace swapopt
