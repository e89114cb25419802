#include "swapopt/optim/routing.h"

#include <algorithm>
#include <array>
#include <sstream>
#include <unordered_set>

#include "checkpoint_stream.h"
#include "disjoint_params.h"
#include "member_checkpoint.h"
#include "swapopt/core/error.h"

namespace swapopt {

namespace {

std::vector<std::string> name_components(const std::string& name) {
  std::vector<std::string> out;
  std::istringstream parts(name);
  std::string part;
  while (std::getline(parts, part, '.')) out.push_back(part);
  return out;
}

bool one_of(const std::string& s, const std::vector<std::string>& set) {
  return std::find(set.begin(), set.end(), s) != set.end();
}

}  // namespace

const char* route_name(Route route) {
  switch (route) {
    case Route::muon: return "muon";
    case Route::adamw_decay: return "adamw";
    case Route::adamw_no_decay: return "adamw (no decay)";
  }
  return "?";
}

std::function<bool(const Param&)> has_name_component(std::vector<std::string> components) {
  return [components = std::move(components)](const Param& p) {
    for (const std::string& part : name_components(p.name))
      if (one_of(part, components)) return true;
    return false;
  };
}

std::function<bool(const Param&)> first_name_component(std::vector<std::string> components) {
  return [components = std::move(components)](const Param& p) {
    const std::vector<std::string> parts = name_components(p.name);
    return !parts.empty() && one_of(parts.front(), components);
  };
}

std::function<bool(const Param&)> ndim_below(int64_t ndim) {
  return [ndim](const Param& p) { return int64_t(p.logical_shape().size()) < ndim; };
}

std::vector<RoutingRule> default_routing_rules() {
  return {
      {"fewer than 2 dims (norm scales, biases)", ndim_below(2), Route::adamw_no_decay},
      {"a bias",
       [](const Param& p) {
         const std::vector<std::string> parts = name_components(p.name);
         return !parts.empty() && parts.back() == "bias";
       },
       Route::adamw_no_decay},
      {"an embedding",
       has_name_component({"embed", "embeds", "embedding", "embeddings", "embed_tokens", "tok_embeddings",
                           "word_embeddings", "position_embeddings", "wte", "wpe"}),
       Route::adamw_decay},
      {"an output head", has_name_component({"lm_head"}), Route::adamw_decay},
      {"an output head", first_name_component({"output", "head", "classifier"}), Route::adamw_decay},
  };
}

std::string RoutedParams::report() const { return routing_report(decisions); }

std::string routing_report(const std::vector<RoutingDecision>& decisions) {
  size_t width = 0;
  for (const RoutingDecision& d : decisions) width = std::max(width, d.param.size());
  std::ostringstream out;
  for (const RoutingDecision& d : decisions) {
    out << d.param << std::string(width + 2 - d.param.size(), ' ') << route_name(d.route);
    out << std::string(18 - std::string(route_name(d.route)).size(), ' ') << d.why << "\n";
  }
  return out.str();
}

RoutedParams route_params(const std::vector<ParamPtr>& params, const RoutingRules& rules) {
  RoutedParams out;
  for (const ParamPtr& p : params) {
    SWAPOPT_CHECK(p != nullptr, "[routing] null parameter");
    SWAPOPT_CHECK(!p->name.empty(),
                  "[routing] a parameter has no name (the rules read names, checkpoints name each "
                  "param's state)");
    Route route = Route::muon;
    std::string why = "no rule matched";
    for (const RoutingRule& rule : rules.rules)
      if (rule.matches && rule.matches(*p)) {
        route = rule.route;
        why = rule.why;
        break;
      }
    SWAPOPT_CHECK(route != Route::muon || p->logical_shape().size() >= 2,
                  "[routing] '" << p->name << "' (shape " << shape_str(p->logical_shape()) << ") would go to Muon (" << why
                                << "), which needs 2 or more dims: route it with a rule");
    (route == Route::muon ? out.muon : route == Route::adamw_decay ? out.adamw_decay : out.adamw_no_decay).push_back(p);
    out.decisions.push_back({p->name, route, why});
  }
  return out;
}

MuonWithAdamW::MuonWithAdamW(Stream stream, const std::vector<ParamPtr>& params, MuonOptions muon_options,
                             AdamWOptions adamw_options, const RoutingRules& rules, MuonHooks hooks)
    : muon_(std::make_unique<Muon>(stream, std::move(hooks))), adamw_(std::make_unique<AdamW>(stream)) {
  // Both options, also of a half no param is routed to (a bad value is a mistake either way).
  muon_options.validate();
  adamw_options.validate();
  // Each half checks its own params; these checks span both (one checkpoint names them all, and
  // a Muon param sharing memory with an AdamW one would be updated by both).
  std::unordered_set<std::string> names;
  std::unordered_set<const Param*> seen;
  std::vector<const Param*> all;
  for (const ParamPtr& p : params) {
    SWAPOPT_CHECK(p != nullptr, "[MuonWithAdamW] null parameter");
    SWAPOPT_CHECK(!p->name.empty(), "[MuonWithAdamW] a parameter has no name (checkpoints name each param's state)");
    SWAPOPT_CHECK(seen.insert(p.get()).second, "[MuonWithAdamW] parameter '" << p->name << "' is listed twice");
    SWAPOPT_CHECK(names.insert(p->name).second,
                  "[MuonWithAdamW] two parameters are named '" << p->name << "' (checkpoints name each param's state)");
    SWAPOPT_CHECK(p->data.defined(),
                  "[MuonWithAdamW] parameter '" << p->name << "' must be a defined contiguous tensor");
    SWAPOPT_CHECK(!p->data.is_released(),
                  "[MuonWithAdamW] parameter '" << p->name << "' has no data (its storage is released)");
    all.push_back(p.get());
  }
  check_disjoint_params(all, "MuonWithAdamW");
  RoutedParams routed = route_params(params, rules);
  routing_ = routed.decisions;
  if (!routed.muon.empty()) muon_->add_param_group(std::move(routed.muon), muon_options);
  if (!routed.adamw_decay.empty()) adamw_->add_param_group(std::move(routed.adamw_decay), adamw_options);
  adamw_options.weight_decay = 0.0;
  if (!routed.adamw_no_decay.empty()) adamw_->add_param_group(std::move(routed.adamw_no_decay), adamw_options);
}

void MuonWithAdamW::step() {
  // Both halves scheduled and checked before either changes anything.
  const std::array<Optimizer*, 2> halves = this->halves();
  check_halves_unwrapped("step()");
  Optimizer::check_together(halves, [&] {
    for (Optimizer* half : halves) half->apply_schedule();
    for (Optimizer* half : halves) half->check_step_locally();
  });
  const bool skip = Optimizer::skip_together(halves);  // a non-finite grad in either half skips both
  for (Optimizer* half : halves) half->last_step_skipped_ = skip;  // both agree, also if a half throws
  for (Optimizer* half : halves) {
    if (!skip) half->run_step();
    half->record_step_events();
  }
}

namespace {
// The member names swap_muon_with_adamw gives its halves: one checkpoint format for both.
const std::vector<std::string> kHalves = {"muon", "adamw"};
}  // namespace

std::string MuonWithAdamW::optimizer_names() const { return muon_->name() + "+" + adamw_->name(); }

std::array<Optimizer*, 2> MuonWithAdamW::halves() { return {muon_.get(), adamw_.get()}; }

void MuonWithAdamW::check_halves_unwrapped(const std::string& call) {
  for (Optimizer* half : halves()) half->check_unwrapped(call);
}

StateDict MuonWithAdamW::state_dict() {
  check_halves_unwrapped("state_dict()");
  return join_members<StateDict>(
      kHalves, [&](size_t i) { return halves()[i]->state_dict(); }, optimizer_names());
}

void MuonWithAdamW::load_from(const CheckpointReader& checkpoint) {
  load_members(kHalves, split_members(checkpoint, kHalves, optimizer_names()),
               [&](size_t i, const CheckpointReader& part) { return halves()[i]->prepare_device_load(part); });
}

void MuonWithAdamW::load_state_dict(const StateDict& state) {
  check_halves_unwrapped("load_state_dict()");
  load_from(reader_of(state));
}

void MuonWithAdamW::save_checkpoint(const std::string& path) {
  check_halves_unwrapped("save_checkpoint()");
  write_checkpoint(join_members<CheckpointSource>(
                       kHalves, [&](size_t i) { return halves()[i]->checkpoint_source(); }, optimizer_names()),
                   path);
}

void MuonWithAdamW::load_checkpoint(const std::string& path, const CheckpointReadOptions& options) {
  check_halves_unwrapped("load_checkpoint()");
  const CheckpointFile file(path, options);
  load_from(file.reader());
}

}  // namespace swapopt
