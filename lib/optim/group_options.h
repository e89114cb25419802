#pragma once
// Validated setters over an optimizer's per-group options (internal; Muon and AdamW share them).

#include <string>
#include <vector>

#include "swapopt/core/error.h"

namespace swapopt {

/** Replaces group `group`'s options after validating them and calling `fits_state(options)`, a
 *  check the optimizer's state puts on them; nothing changes on a bad value. */
template <typename Options, typename FitsState>
void set_group_options(std::vector<Options>& all, size_t group, const Options& options, const std::string& optimizer,
                       const FitsState& fits_state) {
  SWAPOPT_CHECK(group < all.size(), "[" << optimizer << "] no param group " << group << " (" << all.size() << " groups)");
  options.validate();
  fits_state(options);
  all[group] = options;
}

/** Replaces group `group`'s options after validating them; nothing changes on a bad value. */
template <typename Options>
void set_group_options(std::vector<Options>& all, size_t group, const Options& options, const std::string& optimizer) {
  set_group_options(all, group, options, optimizer, [](const Options&) {});
}

/** Sets every group's lr, each validated before any changes. */
template <typename Options>
void set_every_lr(std::vector<Options>& all, double lr) {
  std::vector<Options> changed = all;
  for (Options& o : changed) {
    o.lr = lr;
    o.validate();
  }
  all = std::move(changed);
}

}  // namespace swapopt
