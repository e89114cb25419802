#pragma once
/** AdamW as torch.optim.AdamW computes it (single-tensor order), f32 state for any param dtype. */

#include <string>
#include <vector>

#include "swapopt/optim/optimizer.h"

namespace swapopt {

struct AdamWOptions {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool amsgrad = false;

  /** Throws "[AdamW] <option> ..." for the first bad value. */
  void validate() const;
};

class AdamW : public Optimizer {
 public:
  explicit AdamW(Stream stream);

  void add_param_group(std::vector<ParamPtr> params, AdamWOptions options = {});
  const AdamWOptions& options(size_t group) const { return options_.at(group); }
  AdamWOptions& mutable_options(size_t group) { return options_.at(group); }
  /** Replaces group `group`'s options, validated first (a bad value throws, nothing changes). */
  void set_options(size_t group, const AdamWOptions& options);
  double lr(size_t group) const override { return options_.at(group).lr; }
  void set_lr(double lr) override;

  /** exp_avg, exp_avg_sq and (amsgrad) max_exp_avg_sq, all f32. */
  std::vector<std::string> state_keys() const override { return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}; }
  DType state_dtype(const std::string&, const Param&) const override { return DType::f32; }
  /** Keys `group` uses: without amsgrad, no max_exp_avg_sq. */
  std::vector<std::string> group_state_keys(size_t group) const override;
  void validate_options() const override;

  /** One parameter's update (state created as zeros if missing; its step += 1). The swap adapter
   *  calls this for each param of a unit. */
  void update_param(size_t group, Param& param);

 protected:
  void run_step() override;
  std::string group_options_json(size_t group) const override;
  PreparedOptions prepare_group_options(const std::vector<std::string>& options_json) override;
  bool counts_param_steps() const override { return true; }

 private:
  std::vector<AdamWOptions> options_;
};

}  // namespace swapopt
