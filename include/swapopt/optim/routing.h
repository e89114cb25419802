#pragma once
/** Splitting a model's parameters between Muon and AdamW the way trainers do, stepped together. */

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "swapopt/optim/adamw.h"
#include "swapopt/optim/muon.h"

namespace swapopt {

/** Where a parameter goes. */
enum class Route { muon, adamw_decay, adamw_no_decay };
const char* route_name(Route route);

/** Params `matches` accepts go to `route`; `why` says so in the routing report. */
struct RoutingRule {
  std::string why;
  std::function<bool(const Param&)> matches;
  Route route = Route::adamw_decay;
};

/** Predicates for rules: a dot-separated component of the name equal to one of `components`; the
 *  first component equal to one of them; fewer than `ndim` dims. Whole components, never
 *  substrings: "multihead_proj" is not "head". */
std::function<bool(const Param&)> has_name_component(std::vector<std::string> components);
std::function<bool(const Param&)> first_name_component(std::vector<std::string> components);
std::function<bool(const Param&)> ndim_below(int64_t ndim);

/** The reference trainer's routing, in order: 1-D params (norm scales, biases) and biases to AdamW
 *  without decay; embeddings (a component "embed", "embeddings", "embed_tokens", "wte", "wpe",
 *  ...) and output heads (a component "lm_head", or a first component "output", "head" or
 *  "classifier") to AdamW with decay. */
std::vector<RoutingRule> default_routing_rules();

/** Rules checked in order, the first match decides; a param no rule matches goes to Muon. */
struct RoutingRules {
  std::vector<RoutingRule> rules = default_routing_rules();
};

/** Where one param went and which rule sent it. */
struct RoutingDecision {
  std::string param;
  Route route;
  std::string why;
};

struct RoutedParams {
  std::vector<ParamPtr> muon;             // ndim >= 2, matched by no rule
  std::vector<ParamPtr> adamw_decay;      // e.g. embeddings, heads
  std::vector<ParamPtr> adamw_no_decay;   // e.g. 1-D params and biases
  std::vector<RoutingDecision> decisions;  // one per param, in order
  /** routing_report(decisions). */
  std::string report() const;
};

/** Decisions as a table, one line per param: name, route, why ("no rule matched" for Muon). */
std::string routing_report(const std::vector<RoutingDecision>& decisions);

/** Routes `params` in order. A param of fewer than 2 dims that would go to Muon is an error. */
RoutedParams route_params(const std::vector<ParamPtr>& params, const RoutingRules& rules = {});

/** Muon for the matrices and AdamW for the rest, on one stream, stepped together. */
class MuonWithAdamW {
 public:
  /** AdamW's no-decay group gets weight_decay 0 whatever `adamw_options` says. */
  MuonWithAdamW(Stream stream, const std::vector<ParamPtr>& params, MuonOptions muon_options = {},
                AdamWOptions adamw_options = {}, const RoutingRules& rules = {}, MuonHooks hooks = {});
  /** Muon's step, then AdamW's, on the same stream (both checked before either changes anything);
   *  the contract of Optimizer::step. */
  void step();
  /** Both halves share one stream, so AdamW's events (recorded last) cover the whole step. */
  const Event& grads_read() const { return adamw_->grads_read(); }
  const Event& params_updated() const { return adamw_->params_updated(); }
  void synchronize() {
    muon_->synchronize();
    adamw_->synchronize();
  }
  void zero_grad() {
    muon_->zero_grad();
    adamw_->zero_grad();
  }
  Muon& muon() { return *muon_; }
  AdamW& adamw() { return *adamw_; }
  /** Where each param went and why (route_params' decisions). */
  const std::vector<RoutingDecision>& routing() const { return routing_; }

 private:
  std::unique_ptr<Muon> muon_;
  std::unique_ptr<AdamW> adamw_;
  std::vector<RoutingDecision> routing_;
};

}  // namespace swapopt
