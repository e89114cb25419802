#pragma once
// The checks that no two params, or grads, share memory (internal; optimizers, MuonWithAdamW and
// clip_grad_norm use them).

#include <string>
#include <vector>

#include "swapopt/optim/param.h"

namespace swapopt {

/** The bytes of `params`' data, sorted by address and pairwise apart; params without memory (empty
 *  or released) are left out. Throws "[who] parameters 'a' and 'b' share memory (...)" if two
 *  overlap: each param's update writes its memory, so two over the same bytes would be updated
 *  twice (and, in one fused op, at once). */
std::vector<detail::ParamBytes> sorted_disjoint_data(const std::vector<const Param*>& params, const std::string& who);

/** Throws sorted_disjoint_data's error if two of `params` share memory. */
inline void check_disjoint_params(const std::vector<const Param*>& params, const std::string& who) {
  (void)sorted_disjoint_data(params, who);
}

/** Throws "[who] the grads of 'a' and 'b' share memory (...)" if two of `params`' grads overlap
 *  (contiguous grads; undefined, empty or released ones share nothing). */
void check_disjoint_grads(const std::vector<const Param*>& params, const std::string& who);

}  // namespace swapopt
