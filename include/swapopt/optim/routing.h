#pragma once
/** Splitting a model's parameters between Muon and AdamW the way trainers do, stepped together. */

#include <memory>
#include <string>
#include <vector>

#include "swapopt/optim/adamw.h"
#include "swapopt/optim/muon.h"

namespace swapopt {

/** Name parts that send an ndim >= 2 parameter to AdamW: embeddings, output heads, norms. A part is
 *  one dot-separated component of the name, matched when it contains the pattern. */
struct RoutingRules {
  std::vector<std::string> adamw_patterns = {"embed", "lm_head", "head", "norm", "output"};
};

struct RoutedParams {
  std::vector<ParamPtr> muon;             // ndim >= 2, not matched by the rules
  std::vector<ParamPtr> adamw_decay;      // matched ndim >= 2 (embeddings, heads)
  std::vector<ParamPtr> adamw_no_decay;   // 1-D params and biases
};

/** Routes `params` in order. */
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

 private:
  std::unique_ptr<Muon> muon_;
  std::unique_ptr<AdamW> adamw_;
};

}  // namespace swapopt
