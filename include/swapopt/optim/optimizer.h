#pragma once
/** Optimizer base: parameter groups, per-parameter named state, step(), state dicts. */

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "swapopt/core/stream.h"
#include "swapopt/optim/checkpoint.h"
#include "swapopt/optim/param.h"

namespace swapopt {

/** Parameters that share options; `step` counts the optimizer steps taken by the group. */
struct ParamGroup {
  std::vector<ParamPtr> params;
  int64_t step = 0;
};

/** Named state tensors of one parameter (e.g. "momentum_buffer"), and a per-parameter step count
 *  for optimizers that keep one (AdamW's bias correction). */
struct ParamState {
  std::map<std::string, Tensor> tensors;
  int64_t step = 0;
};

class Optimizer {
 public:
  /** `stream` runs every update; its device is where params, grads and state live. */
  Optimizer(std::string name, Stream stream);
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /** "Muon" or "AdamW": the name checkpoints carry. */
  const std::string& name() const { return name_; }
  Stream& stream() { return stream_; }
  Device device() const { return stream_.device(); }
  std::vector<ParamGroup>& param_groups() { return groups_; }
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  /** State by parameter; a parameter never stepped with a gradient has none. */
  std::map<const Param*, ParamState>& state() { return state_; }

  /** Every state key this optimizer family can hold, e.g. {"momentum_buffer"}. */
  virtual std::vector<std::string> state_keys() const = 0;
  /** The dtype a state tensor `key` of `param` has. */
  virtual DType state_dtype(const std::string& key, const Param& param) const = 0;
  /** One update of every parameter that has a gradient; asynchronous on stream(). */
  virtual void step() = 0;

  /** Host copies of all state and the metadata (synchronises the stream). */
  virtual StateDict state_dict();
  /** Replaces options, steps and state from `state` after checking all of it against this
   *  optimizer's parameters; on any mismatch throws a named error and changes nothing. */
  virtual void load_state_dict(const StateDict& state);

  /** Whether this rank keeps state for `param` (HSDP Muon: owners only); loading a checkpoint
   *  checks the state of the others and skips it. */
  virtual bool keeps_state(const Param&) const { return true; }

  /** Index of `param` over all groups in order, as checkpoints name it. */
  int64_t param_index(const Param* param) const;

  /** Metadata JSON of the current groups and steps. */
  std::string metadata_json() const;
  /** Checks `state` against this optimizer; returns the change that applies it, `write_tensor`
   *  being how each checked host tensor reaches the state (the swap wrapper writes host mirrors).
   *  Nothing changes until the returned function runs. */
  std::function<void()> prepare_load(const StateDict& state,
                                     std::function<void(const Param&, const std::string&, const Tensor&)> write_tensor);

 protected:
  /** The options of group `group` as a JSON object. */
  virtual std::string group_options_json(size_t group) const = 0;
  /** Parses and checks every group's options JSON; returns the change to apply once the whole
   *  checkpoint is known to be good (throws, changing nothing, if any options are bad). */
  virtual std::function<void()> prepare_group_options(const std::vector<std::string>& options_json) = 0;
  /** Checks a new group's parameters (throws naming the parameter). */
  void add_group(std::vector<ParamPtr> params);
  /** The state tensor `key` of `param`, created as zeros when missing. */
  Tensor& state_tensor(const Param& param, const std::string& key);

  std::string name_;
  Stream stream_;
  std::vector<ParamGroup> groups_;
  std::map<const Param*, ParamState> state_;
};

}  // namespace swapopt
