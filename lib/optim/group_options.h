#pragma once
// Validated setters over an optimizer's per-group options (internal; Muon and AdamW share them).

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "checkpoint_part_error.h"
#include "swapopt/core/error.h"

namespace swapopt {

/** Throws "[AdamW] lr 1e+39 is beyond the f32 range the updates compute in (at most 3.40282e+38)"
 *  for a finite option that turns infinite in f32. */
inline void check_fits_f32(double value, const char* name, const char* optimizer) {
  SWAPOPT_CHECK(!std::isfinite(value) || std::isfinite(float(value)),
                "[" << optimizer << "] " << name << " " << value
                    << " is beyond the f32 range the updates compute in (at most " << std::numeric_limits<float>::max()
                    << ")");
}

/** Throws "[AdamW] lr x weight_decay is 1e+40: beyond the f32 range the updates compute in (at
 *  most 3.40282e+38)" for a value the update derives from finite options that turns infinite in
 *  f32 (each option fitting alone). */
inline void check_derived_fits_f32(double value, const char* what, const char* optimizer) {
  SWAPOPT_CHECK(std::isfinite(float(value)), "[" << optimizer << "] " << what << " is " << value
                                                 << ": beyond the f32 range the updates compute in (at most "
                                                 << std::numeric_limits<float>::max() << ")");
}

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

/** `message`, an error of `optimizer`'s options ("[AdamW] beta1 ..."), naming the group after its
 *  prefix: "[AdamW] group 1: beta1 ...". */
inline std::string in_group(const std::string& message, const std::string& optimizer, size_t group) {
  const std::string prefix = "[" + optimizer + "] ";
  if (message.rfind(prefix, 0) != 0) return message;
  return prefix + "group " + std::to_string(group) + ": " + message.substr(prefix.size());
}

/** Validates group `group`'s options, naming the group in the error. */
template <typename Options>
void validate_group(const Options& options, size_t group, const std::string& optimizer) {
  try {
    options.validate();
  } catch (const Error& e) {
    SWAPOPT_FAIL(in_group(e.what(), optimizer, group));
  }
}

/** The options `read()` parses from a checkpoint's group `group`, validated; any error names both:
 *  "[checkpoint] group 1: [AdamW] beta1 ...", "[checkpoint] group 0: [Muon] unknown option 'x'",
 *  "[checkpoint] group 0: metadata: ns_steps must be an integer". */
template <typename Read>
auto read_checkpoint_group(size_t group, const Read& read) {
  try {
    auto options = read();
    options.validate();
    return options;
  } catch (const Error& e) {
    fail_in_checkpoint_part("group " + std::to_string(group), e);
  }
}

/** Sets every group's lr, each group validated before any changes: a bad lr is named as the
 *  options name it ("[AdamW] lr must be ..."), another bad option with its group. */
template <typename Options>
void set_every_lr(std::vector<Options>& all, double lr, const std::string& optimizer) {
  Options alone;  // the defaults are valid: only the lr can fail here
  alone.lr = lr;
  alone.validate();
  std::vector<Options> changed = all;
  for (size_t g = 0; g < changed.size(); ++g) {
    changed[g].lr = lr;
    validate_group(changed[g], g, optimizer);
  }
  all = std::move(changed);
}

}  // namespace swapopt
