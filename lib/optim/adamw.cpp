#include "swapopt/optim/adamw.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "../core/comma_list.h"
#include "group_options.h"
#include "json.h"
#include "optim_ops_of_optimizer.h"
#include "swapopt/core/error.h"
#include "swapopt/optim/optim_ops.h"

namespace swapopt {

void AdamWOptions::validate() const {
  check_fits_f32(lr, "lr", "AdamW");
  check_fits_f32(eps, "eps", "AdamW");
  check_fits_f32(weight_decay, "weight_decay", "AdamW");
  SWAPOPT_CHECK(std::isfinite(lr) && lr >= 0, "[AdamW] lr must be finite and >= 0, got " << lr);
  SWAPOPT_CHECK(std::isfinite(eps) && eps >= 0, "[AdamW] eps must be finite and >= 0, got " << eps);
  SWAPOPT_CHECK(std::isfinite(beta1) && beta1 >= 0 && beta1 < 1, "[AdamW] beta1 must be in [0, 1), got " << beta1);
  SWAPOPT_CHECK(std::isfinite(beta2) && beta2 >= 0 && beta2 < 1, "[AdamW] beta2 must be in [0, 1), got " << beta2);
  SWAPOPT_CHECK(std::isfinite(weight_decay) && weight_decay >= 0,
                "[AdamW] weight_decay must be finite and >= 0, got " << weight_decay);
  // The step's scalars: 1 - lr wd, and lr / (1 - beta1^step), largest at step 1.
  check_derived_fits_f32(lr * weight_decay, "lr x weight_decay", "AdamW");
  check_derived_fits_f32(lr / (1.0 - beta1), "lr / (1 - beta1), the first step's size,", "AdamW");
}

AdamW::AdamW(Stream stream) : Optimizer("AdamW", std::move(stream)) {}

void AdamW::add_param_group(std::vector<ParamPtr> params, AdamWOptions options) {
  options.validate();
  add_group(std::move(params));
  options_.push_back(options);
}

namespace {
/** The state keys a group with options `o` uses. */
std::vector<std::string> keys_for(const AdamWOptions& o) {
  if (o.amsgrad) return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  return {"exp_avg", "exp_avg_sq"};
}
}  // namespace

std::vector<std::string> AdamW::group_state_keys(size_t group) const { return keys_for(group_entry(options_, group)); }

namespace {
/** The step's host scalars for a param at `step` (this step included): f64, as torch computes
 *  them, rounded once to f32. */
ops::AdamWScalars scalars_for(const AdamWOptions& o, int64_t step) {
  const double bias_correction1 = 1.0 - std::pow(o.beta1, double(step));
  const double bias_correction2 = 1.0 - std::pow(o.beta2, double(step));
  ops::AdamWScalars k;
  k.decay = float(1.0 - o.lr * o.weight_decay);
  k.one_minus_beta1 = float(1.0 - o.beta1);
  k.beta2 = float(o.beta2);
  k.one_minus_beta2 = float(1.0 - o.beta2);
  k.bias_correction2_sqrt = float(std::sqrt(bias_correction2));
  k.eps = float(o.eps);
  k.neg_step_size = float(-(o.lr / bias_correction1));
  return k;
}

/** Elements [begin, end) of `t`, flattened. */
Tensor range_of(const Tensor& t, int64_t begin, int64_t end) { return t.view({t.numel()}).narrow(0, begin, end - begin); }
}  // namespace

void AdamW::update_param(size_t group, Param& param) {
  Param* const one[] = {&param};
  check_update_call(group, std::span<Param* const>(one), "update_param");
  check_update_operands_apart(group, one);
  apply_updates(group, one);
}

void AdamW::update_params(size_t group, std::span<Param* const> params) {
  check_update_call(group, params, "update_params");
  check_update_operands_apart(group, params);
  apply_updates(group, params);
}

void AdamW::check_update_operands_apart(size_t group, std::span<Param* const> params) const {
  const bool amsgrad = group_entry(options_, group).amsgrad;
  std::vector<ops::AdamWUpdate> updates;
  updates.reserve(params.size());
  for (const Param* p : params)
    updates.push_back({p->data,
                       p->grad,
                       existing_state_tensor(*p, "exp_avg"),
                       existing_state_tensor(*p, "exp_avg_sq"),
                       amsgrad ? existing_state_tensor(*p, "max_exp_avg_sq") : Tensor(),
                       {}});
  ops::check_adamw_updates_apart(updates, "adamw_update_many");
}

void AdamW::apply_updates(size_t group, std::span<Param* const> params) {
  const AdamWOptions& o = group_entry(options_, group);
  std::vector<ops::AdamWUpdate> updates;
  std::vector<ParamState*> states;  // map entries stay where they are as others are added
  updates.reserve(params.size());
  states.reserve(params.size());
  int64_t scalars_step = -1;  // the params of a group are mostly at one step: compute its scalars once
  ops::AdamWScalars scalars;
  for (Param* param : params) {
    const Tensor exp_avg = state_tensor(*param, "exp_avg");
    const Tensor exp_avg_sq = state_tensor(*param, "exp_avg_sq");
    const Tensor max_exp_avg_sq = o.amsgrad ? state_tensor(*param, "max_exp_avg_sq") : Tensor();
    states.push_back(&state_[param]);
    if (states.back()->step + 1 != scalars_step) {
      scalars_step = states.back()->step + 1;
      scalars = scalars_for(o, scalars_step);
    }
    updates.push_back({param->data, param->grad, exp_avg, exp_avg_sq, max_exp_avg_sq, scalars});
  }
  ops::adamw_update_many_of_optimizer(stream_, updates);
  for (ParamState* state : states) count_update(group, *state);
}

void AdamW::update_param_chunk(size_t group, Param& param, int64_t begin, int64_t end,
                               const std::map<std::string, Tensor>& staged) {
  const Param* const one[] = {&param};
  check_update_call(group, one, "update_param_chunk", begin == 0);
  SWAPOPT_CHECK(0 <= begin && begin <= end && end <= param.data.numel(),
                "[AdamW] chunk [" << begin << ", " << end << ") is outside '" << param.name << "' ("
                                  << param.data.numel() << " elements)");
  check_chunk_start(param, begin, end, "update_param_chunk");
  const std::vector<std::string> keys = group_state_keys(group);
  for (const auto& [key, t] : staged) {
    SWAPOPT_CHECK(std::find(keys.begin(), keys.end(), key) != keys.end(),
                  "[AdamW] update_param_chunk: staged state '" << key << "' is not a state key of group " << group
                                                               << " (" << comma_list(keys) << ")");
    SWAPOPT_CHECK(t.defined() && !t.is_released() && t.device() == device() && t.is_contiguous() &&
                      t.dtype() == DType::f32 && t.shape() == Shape{end - begin},
                  "[AdamW] update_param_chunk: staged '"
                      << key << "' is " << t.str() << ", the chunk needs a contiguous f32 [" << end - begin << "] on "
                      << device().str());
  }
  // The op's memory checks, before the chunk creates state or counts a step.
  const auto chunk_of = [&](const std::string& key) {
    const auto it = staged.find(key);
    if (it != staged.end()) return it->second;
    const Tensor own = existing_state_tensor(param, key);
    return own.defined() ? range_of(own, begin, end) : Tensor();
  };
  const ops::AdamWUpdate chunk{range_of(param.data, begin, end),
                               range_of(param.grad, begin, end),
                               chunk_of("exp_avg"),
                               chunk_of("exp_avg_sq"),
                               group_entry(options_, group).amsgrad ? chunk_of("max_exp_avg_sq") : Tensor(),
                               {}};
  ops::check_adamw_updates_apart({&chunk, 1}, "adamw_update");
  apply_update_chunk(group, param, begin, end, staged);
}

void AdamW::apply_update_chunk(size_t group, Param& param, int64_t begin, int64_t end,
                               const std::map<std::string, Tensor>& staged) {
  const AdamWOptions& o = group_entry(options_, group);
  const auto chunk_of = [&](const std::string& key) {
    const auto it = staged.find(key);
    if (it != staged.end()) return it->second;
    return range_of(state_tensor(param, key), begin, end);
  };
  const Tensor exp_avg = chunk_of("exp_avg");
  const Tensor exp_avg_sq = chunk_of("exp_avg_sq");
  const Tensor max_exp_avg_sq = o.amsgrad ? chunk_of("max_exp_avg_sq") : Tensor();
  ParamState& ps = state_[&param];
  if (begin == 0) count_update(group, ps);
  ops::adamw_update(stream_, range_of(param.data, begin, end), range_of(param.grad, begin, end), exp_avg, exp_avg_sq,
                    max_exp_avg_sq, scalars_for(o, ps.step));
}

void AdamW::check_amsgrad_fits_state(size_t group, const AdamWOptions& options) const {
  // Every param with state in a group was stepped with the amsgrad it has now (this check keeps
  // it so), so the first one answers for all.
  for (const ParamPtr& p : param_groups()[group].params) {
    const auto it = state_.find(p.get());
    if (it == state_.end() || it->second.tensors.empty()) continue;
    SWAPOPT_CHECK(options.amsgrad == (it->second.tensors.count("max_exp_avg_sq") != 0),
                  "[AdamW] group " << group << " cannot turn amsgrad " << (options.amsgrad ? "on" : "off")
                                   << ": param '" << p->name << "' has state from steps "
                                   << (options.amsgrad ? "without" : "with")
                                   << " it (amsgrad decides which state a param keeps: choose it in add_param_group, "
                                      "or before the group's first step)");
    break;
  }
  // Before the group's first step amsgrad may change, but a swap wrapper laid out no mirrors for
  // the state it would add.
  if (wrapped())
    check_keys_fit_wrapper(group, keys_for(options), "cannot turn amsgrad on while wrapped",
                           "drop the wrapper, change the options, wrap again");
}

void AdamW::set_options(size_t group, const AdamWOptions& options) {
  set_group_options(options_, group, options, name_,
                    [&](const AdamWOptions& o) { check_amsgrad_fits_state(group, o); });
}

void AdamW::set_lr(double lr) { set_every_lr(options_, lr, name_); }

void AdamW::validate_options() const {
  for (size_t g = 0; g < options_.size(); ++g) {
    validate_group(options_[g], g, name_);
    check_amsgrad_fits_state(g, options_[g]);  // mutable_options() may have changed it
  }
}

void AdamW::run_step() {
  for (ParamGroup& g : groups_) g.step += 1;
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<Param*> with_grads;
    for (const ParamPtr& p : groups_[g].params)
      if (p->has_grad()) with_grads.push_back(p.get());
    apply_updates(g, with_grads);  // the step's checks covered them
  }
}

std::string AdamW::group_options_json(size_t group) const {
  const AdamWOptions& o = group_entry(options_, group);
  return json::Value::object({{"lr", o.lr},
                              {"beta1", o.beta1},
                              {"beta2", o.beta2},
                              {"eps", o.eps},
                              {"weight_decay", o.weight_decay},
                              {"amsgrad", o.amsgrad}})
      .dump();
}

Optimizer::PreparedOptions AdamW::prepare_group_options(const std::vector<std::string>& options_json) {
  std::vector<AdamWOptions> parsed;
  PreparedOptions prepared;
  for (const std::string& text : options_json) {
    parsed.push_back(read_checkpoint_group(parsed.size(), [&] {
      const json::Value v = json::parse(text);
      const std::string w = "AdamW options";
      for (const auto& [key, value] : json::get_object(v, w))
        SWAPOPT_CHECK(key == "lr" || key == "beta1" || key == "beta2" || key == "eps" || key == "weight_decay" ||
                          key == "amsgrad",
                      "[AdamW] unknown option '" << key << "'");
      auto number = [&](const std::string& key) { return json::get_number(json::member(v, key, w), key); };
      AdamWOptions o;
      o.lr = number("lr");
      o.beta1 = number("beta1");
      o.beta2 = number("beta2");
      o.eps = number("eps");
      o.weight_decay = number("weight_decay");
      o.amsgrad = json::get_bool(json::member(v, "amsgrad", w), "amsgrad");
      return o;
    }));
    prepared.group_state_keys.push_back(keys_for(parsed.back()));
  }
  prepared.apply = [this, parsed] { options_ = parsed; };
  return prepared;
}

}  // namespace swapopt
