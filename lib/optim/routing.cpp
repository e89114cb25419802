#include "swapopt/optim/routing.h"

#include <sstream>

namespace swapopt {

namespace {

bool matches(const std::string& name, const RoutingRules& rules) {
  std::istringstream parts(name);
  std::string part;
  while (std::getline(parts, part, '.'))
    for (const std::string& pattern : rules.adamw_patterns)
      if (part.find(pattern) != std::string::npos) return true;
  return false;
}

bool is_bias(const std::string& name) {
  const std::string suffix = "bias";
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

RoutedParams route_params(const std::vector<ParamPtr>& params, const RoutingRules& rules) {
  RoutedParams out;
  for (const ParamPtr& p : params) {
    if (p->data.dim() < 2 || is_bias(p->name)) {
      out.adamw_no_decay.push_back(p);
    } else if (matches(p->name, rules)) {
      out.adamw_decay.push_back(p);
    } else {
      out.muon.push_back(p);
    }
  }
  return out;
}

MuonWithAdamW::MuonWithAdamW(Stream stream, const std::vector<ParamPtr>& params, MuonOptions muon_options,
                             AdamWOptions adamw_options, const RoutingRules& rules, MuonHooks hooks)
    : muon_(std::make_unique<Muon>(stream, std::move(hooks))), adamw_(std::make_unique<AdamW>(stream)) {
  RoutedParams routed = route_params(params, rules);
  if (!routed.muon.empty()) muon_->add_param_group(std::move(routed.muon), muon_options);
  if (!routed.adamw_decay.empty()) adamw_->add_param_group(std::move(routed.adamw_decay), adamw_options);
  adamw_options.weight_decay = 0.0;
  if (!routed.adamw_no_decay.empty()) adamw_->add_param_group(std::move(routed.adamw_no_decay), adamw_options);
}

void MuonWithAdamW::step() {
  // Both halves scheduled and checked before either changes anything.
  Optimizer* halves[] = {muon_.get(), adamw_.get()};
  for (Optimizer* half : halves) half->check_unwrapped("step()");
  for (Optimizer* half : halves) half->apply_schedule();
  for (Optimizer* half : halves) half->check_step();
  bool skip = false;  // a non-finite grad in either half skips both
  for (Optimizer* half : halves) skip = half->skip_this_step() || skip;
  for (Optimizer* half : halves) {
    half->last_step_skipped_ = skip;
    if (!skip) half->run_step();
    half->record_step_events();
  }
}

}  // namespace swapopt
