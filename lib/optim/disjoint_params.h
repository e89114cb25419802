#pragma once
// The check that no two params share memory (internal; optimizers and MuonWithAdamW use it).

#include <string>
#include <vector>

#include "swapopt/optim/param.h"

namespace swapopt {

/** Throws "[who] parameters 'a' and 'b' share memory (...)" if two of `params` overlap: each
 *  param's update writes its memory, so two over the same bytes would be updated twice (and, in
 *  one fused op, at once). Params without memory (empty or released) share nothing. */
void check_disjoint_params(const std::vector<const Param*>& params, const std::string& who);

}  // namespace swapopt
