#pragma once
/** Splitting a model's parameters between Muon and AdamW the way trainers do, stepped together. */

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "swapopt/optim/adamw.h"
#include "swapopt/optim/muon.h"

namespace swapopt {

/** Where a parameter goes. */
enum class Route { muon, adamw_decay, adamw_no_decay };
/** "muon", "adamw" or "adamw (no decay)", as routing_report() prints it. */
const char* route_name(Route route);

/** Params `matches` accepts go to `route`; `why` says so in the routing report. */
struct RoutingRule {
  std::string why{};                            ///< The reason the routing report shows, e.g. "an embedding".
  std::function<bool(const Param&)> matches{};  ///< The predicate; an empty function matches nothing.
  Route route = Route::adamw_decay;  ///< Where a matched param goes.
};

/** Predicates for rules: a dot-separated component of the name equal to one of `components`; the
 *  first component equal to one of them; fewer than `ndim` dims. Whole components, never
 *  substrings: "multihead_proj" is not "head". */
std::function<bool(const Param&)> has_name_component(std::vector<std::string> components);
/** Predicate: the first dot-separated component of the name is one of `components`. */
std::function<bool(const Param&)> first_name_component(std::vector<std::string> components);
/** Predicate: the param's logical shape has fewer than `ndim` dims. */
std::function<bool(const Param&)> ndim_below(int64_t ndim);

/** The reference trainer's routing, in order: 1-D params (norm scales, biases) and biases to AdamW
 *  without decay; embeddings (a component "embed", "embeddings", "embed_tokens", "wte", "wpe",
 *  ...) and output heads (a component "lm_head", or a first component "output", "head" or
 *  "classifier") to AdamW with decay. */
std::vector<RoutingRule> default_routing_rules();

/** Rules checked in order, the first match decides; a param no rule matches goes to Muon. */
struct RoutingRules {
  /** The rules, checked in order; default_routing_rules() unless replaced (empty: every param to
   *  Muon). */
  std::vector<RoutingRule> rules = default_routing_rules();
};

/** Where one param went and which rule sent it. */
struct RoutingDecision {
  std::string param;  ///< The param's name.
  Route route;        ///< Where it went.
  std::string why;    ///< The matching rule's `why`, or "no rule matched" (Muon).
};

/** What route_params() returns: the params by route, each list in input order. */
struct RoutedParams {
  std::vector<ParamPtr> muon;             ///< ndim >= 2, matched by no rule
  std::vector<ParamPtr> adamw_decay;      ///< e.g. embeddings, heads
  std::vector<ParamPtr> adamw_no_decay;   ///< e.g. 1-D params and biases
  std::vector<RoutingDecision> decisions;  ///< one per param, in order
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
  /** AdamW's no-decay group gets weight_decay 0 whatever `adamw_options` says. Throws a named
   *  error, before either half takes a param, for a null or undefined param, two params of one name or
   *  two sharing memory, whichever halves they go to, for bad options of either half (also one
   *  no param is routed to), and for what each half refuses. */
  MuonWithAdamW(Stream stream, const std::vector<ParamPtr>& params, MuonOptions muon_options = {},
                AdamWOptions adamw_options = {}, const RoutingRules& rules = {}, MuonHooks hooks = {});
  /** Muon's step, then AdamW's, on the same stream (both checked before either changes anything);
   *  the contract of Optimizer::step. */
  void step();
  /** Both halves share one stream, so AdamW's events (recorded last) cover the whole step. */
  const Event& grads_read() const { return adamw_->grads_read(); }
  /** Completes when the last step() has written every param (AdamW's event, as grads_read()). */
  const Event& params_updated() const { return adamw_->params_updated(); }
  /** Blocks the host until everything enqueued on the shared stream is done. */
  void synchronize() {
    muon_->synchronize();
    adamw_->synchronize();
  }
  /** Drops every param's grad, in both halves (Optimizer::zero_grad). */
  void zero_grad() {
    muon_->zero_grad();
    adamw_->zero_grad();
  }
  /** Both halves' set_skip_nonfinite (Optimizer's): with it on, a NaN or infinity in any grad of
   *  either half skips the whole step, both halves, changing nothing. */
  void set_skip_nonfinite(bool on) {
    muon_->set_skip_nonfinite(on);
    adamw_->set_skip_nonfinite(on);
  }
  /** Whether the last step() was skipped for a non-finite grad (both halves agree). */
  bool last_step_skipped() const { return muon_->last_step_skipped(); }
  /** The Muon half: one group of the params routed to Muon (no group when there are none). */
  Muon& muon() { return *muon_; }
  /** The AdamW half: the decay group, then the no-decay group (weight_decay 0); a route with no
   *  params has no group. */
  AdamW& adamw() { return *adamw_; }
  /** Where each param went and why (route_params' decisions). */
  const std::vector<RoutingDecision>& routing() const { return routing_; }

  /** Both halves' state as one checkpoint, the format of swap_muon_with_adamw's (members "muon"
   *  and "adamw"): either loads the other's, so a trainer can swap or not from one run to the
   *  next. Each half's own state_dict() is its member's part. */
  StateDict state_dict();
  /** Checks both parts before either half changes (a member's error names it), then loads. */
  void load_state_dict(const StateDict& state);
  /** Writes the file that `save_state_dict(state_dict(), path)` writes, streaming the state from
   *  the device through a staging buffer (Optimizer::save_checkpoint). */
  void save_checkpoint(const std::string& path);
  /** Loads a file save_checkpoint() or a swapped set's save_checkpoint() wrote (the checks of
   *  load_state_dict). */
  void load_checkpoint(const std::string& path, const CheckpointReadOptions& options = {});

 private:
  /** Muon's half, then AdamW's: the order of a step and of a checkpoint's members. */
  std::array<Optimizer*, 2> halves();
  /** Throws the named error of a half that a SwapOptimizer wraps, for `call`. */
  void check_halves_unwrapped(const std::string& call);
  /** "Muon+AdamW", the metadata's "optimizer" (as a swapped set of the two writes it). */
  std::string optimizer_names() const;
  /** Checks both halves' parts of `checkpoint`, then loads them. */
  void load_from(const CheckpointReader& checkpoint);
  std::unique_ptr<Muon> muon_;
  std::unique_ptr<AdamW> adamw_;
  std::vector<RoutingDecision> routing_;
};

}  // namespace swapopt
