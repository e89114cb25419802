#pragma once
/** AdamW as torch.optim.AdamW computes it (single-tensor order), f32 state for any param dtype.
 *  The same operations in the same order, each rounded once: torch's own kernels fuse some of
 *  them (its CPU lerp is a multiply-add), so results agree with torch's to about an ulp, not
 *  bitwise. */

#include <map>
#include <span>
#include <string>
#include <vector>

#include "swapopt/optim/optimizer.h"

namespace swapopt {

/** One group's AdamW options; the defaults are torch.optim.AdamW's. */
struct AdamWOptions {
  /** Step size: the update is -lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) /
   *  sqrt(1 - beta2^step) + eps). Finite, >= 0. */
  double lr = 1e-3;
  /** Decay rate of exp_avg (the first moment), in [0, 1). */
  double beta1 = 0.9;
  /** Decay rate of exp_avg_sq (the second moment), in [0, 1). */
  double beta2 = 0.999;
  /** Added to the bias-corrected sqrt(exp_avg_sq) in the denominator; finite, >= 0. */
  double eps = 1e-8;
  /** Decoupled decay: each step first multiplies the param by 1 - lr * weight_decay. Finite,
   *  >= 0. */
  double weight_decay = 1e-2;
  /** Keep max_exp_avg_sq, the running max of exp_avg_sq, and divide by its root instead. */
  bool amsgrad = false;

  /** Throws "[AdamW] <option> ..." for the first bad value. */
  void validate() const;
};

/** AdamW over param groups, each with its own options. Every param gets f32 exp_avg and
 *  exp_avg_sq (and max_exp_avg_sq with amsgrad) at its first update, and its own step count. */
class AdamW : public Optimizer {
 public:
  /** `stream` runs every update; params, grads and state live on its device. */
  explicit AdamW(Stream stream);

  /** Adds a group with `options`; throws "[AdamW] ..." for a bad option or param (null, already
   *  in a group, a missing, non-UTF-8 or duplicate name, data not contiguous or on another
   *  device) and while a SwapOptimizer wraps it. */
  void add_param_group(std::vector<ParamPtr> params, AdamWOptions options = {});
  /** Group `group`'s options; throws std::out_of_range for a bad index. */
  const AdamWOptions& options(size_t group) const { return group_entry(options_, group); }
  /** Group `group`'s options, to change in place: checked only by the next step() or checkpoint
   *  save, which throw for a bad value (set_options() checks at once). Throws std::out_of_range
   *  for a bad index. */
  AdamWOptions& mutable_options(size_t group) { return group_entry(options_, group); }
  /** Replaces group `group`'s options, validated first (a bad value throws, nothing changes).
   *  amsgrad decides which state a param keeps: once the group's params have state it cannot
   *  change (a named error, here or, after mutable_options(), at the next step or save), and
   *  while a SwapOptimizer wraps the optimizer it cannot be turned on (its host mirrors were laid
   *  out without max_exp_avg_sq). */
  void set_options(size_t group, const AdamWOptions& options);
  double lr(size_t group) const override { return group_entry(options_, group).lr; }
  void set_lr(double lr) override;

  /** exp_avg, exp_avg_sq and (amsgrad) max_exp_avg_sq, all f32. */
  std::vector<std::string> state_keys() const override { return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}; }
  DType state_dtype(const std::string&, const Param&) const override { return DType::f32; }
  /** Keys `group` uses: without amsgrad, no max_exp_avg_sq. */
  std::vector<std::string> group_state_keys(size_t group) const override;
  void validate_options() const override;

  /** One parameter's update (state created as zeros if missing; its step += 1, and its group's
   *  step raised to at least that, so that a checkpoint of an optimizer driven by these pieces
   *  alone loads). This and the two
   *  below check the params as a step does first, so bad input changes nothing, and are refused
   *  while a SwapOptimizer wraps the optimizer (its state is in the wrapper's host mirrors). */
  void update_param(size_t group, Param& param);
  /** update_param on each of `params` (all of `group`), as one fused op on the stream
   *  (ops::adamw_update_many): many small params share the CPU threads. Grads are checked (present,
   *  of the param's shape; each param listed once) and the op's memory checks (no update writes
   *  what another reads or writes) run before anything changes; missing state is then created as
   *  zeros, and the op's own checks (contiguous, on the stream's device) run before any step count
   *  changes. */
  void update_params(size_t group, std::span<Param* const> params);
  /** update_param on elements [begin, end) of the flattened param (the same bits there): the
   *  chunk that starts at 0 counts the param's step, so chunks must cover [0, numel) in order
   *  within one step. `staged` holds the range of any state kept elsewhere (1-D, end - begin
   *  elements, by key); other keys are read from the optimizer's own state. What the swap adapter
   *  does, unchecked, for a param too large for the device budget. */
  void update_param_chunk(size_t group, Param& param, int64_t begin, int64_t end,
                          const std::map<std::string, Tensor>& staged);

 protected:
  void run_step() override;
  std::string group_options_json(size_t group) const override;
  PreparedOptions prepare_group_options(const std::vector<std::string>& options_json) override;

 private:
  friend class AdamWSwapAdapter;  // its batches call apply_updates: the swapped step's checks covered them
  /** Throws unless `options`' amsgrad matches the state group `group`'s params already have. */
  void check_amsgrad_fits_state(size_t group, const AdamWOptions& options) const;
  /** The memory checks of the op update_params() runs (its operands apart), before it creates
   *  state or counts a step: the step's own checks cover only params and grads. */
  void check_update_operands_apart(size_t group, std::span<Param* const> params) const;
  /** update_params() after its checks (a step's own calls, bare or swapped: its checks covered them). */
  void apply_updates(size_t group, std::span<Param* const> params);
  /** update_param_chunk() after its checks (the swap adapter's chunks: the step's checks covered them). */
  void apply_update_chunk(size_t group, Param& param, int64_t begin, int64_t end,
                          const std::map<std::string, Tensor>& staged);

  std::vector<AdamWOptions> options_;
};

}  // namespace swapopt
