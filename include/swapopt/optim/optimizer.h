#pragma once
/** Optimizer base: parameter groups, per-parameter named state, step(), state dicts. */

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "swapopt/core/stream.h"
#include "swapopt/optim/checkpoint.h"
#include "swapopt/optim/param.h"

namespace swapopt {

struct CheckpointReader;
struct CheckpointSource;
struct TensorReader;

/** Parameters that share options; `step` counts the optimizer steps taken by the group. */
struct ParamGroup {
  /** The group's params in the order added; checkpoints index params over all groups in order. */
  std::vector<ParamPtr> params;
  /** Steps the group has taken: each step that runs adds 1 to every group before any update (a
   *  skipped step does not count). The schedule gets the first group's step + 1. */
  int64_t step = 0;
};

/** Named state tensors of one parameter (e.g. "momentum_buffer") and the number of its updates. */
struct ParamState {
  /** State tensors by key, on the optimizer's device in state_dtype(); under swap, shells whose
   *  bytes live in the host mirrors between steps. */
  std::map<std::string, Tensor> tensors;
  /** Updates of this param (AdamW's bias-correction step; Muon's momentum updates): positive
   *  exactly when it has state, which is how a checkpoint missing a state tensor is caught. */
  int64_t step = 0;
};

/** Base of Muon and AdamW: param groups, per-param state, the step() contract with its events,
 *  schedules, non-finite skipping and checkpoints. A subclass adds its options per group and
 *  implements the pure virtual members (the update is run_step()). */
class Optimizer {
 public:
  /** `stream` runs every update; its device is where params, grads and state live. */
  Optimizer(std::string name, Stream stream);
  /** Waits for the grads zero_grad() dropped, if stream() may still read them. */
  virtual ~Optimizer();
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /** "Muon" or "AdamW": the name checkpoints carry. */
  const std::string& name() const { return name_; }
  /** The stream given at construction: every update is enqueued on it. */
  Stream& stream() { return stream_; }
  /** stream()'s device: where params, grads and state live. */
  Device device() const { return stream_.device(); }
  /** The groups, in the order added (the index is the `group` of options() and lr()). Changes
   *  made here (the swap adapters advance `step`) bypass add_param_group's checks. */
  std::vector<ParamGroup>& param_groups() { return groups_; }
  /** The groups, in the order added. */
  const std::vector<ParamGroup>& param_groups() const { return groups_; }
  /** State by parameter; a parameter never stepped with a gradient has none. */
  std::map<const Param*, ParamState>& state() { return state_; }

  /** Every state key this optimizer family can hold, e.g. {"momentum_buffer"}. */
  virtual std::vector<std::string> state_keys() const = 0;
  /** The dtype a state tensor `key` of `param` has. */
  virtual DType state_dtype(const std::string& key, const Param& param) const = 0;
  /** The state keys group `group` uses with its current options (AdamW without amsgrad: no
   *  max_exp_avg_sq); a checkpoint may hold no other key for its params. */
  virtual std::vector<std::string> group_state_keys(size_t /*group*/) const { return state_keys(); }
  /** One update of every parameter that has a gradient. Checks first (check_step(); a wrapped
   *  optimizer refuses), then enqueues the update on stream() and returns: the step is
   *  asynchronous (HSDP steps also wait on the host for their collectives). Work the trainer puts
   *  on stream() afterwards runs after the step; work on another stream orders itself with
   *  grads_read() and params_updated(), or the host waits with synchronize(). The grads must be
   *  ready on stream() when step() is called: produced there, or stream().wait(event) first. */
  void step();
  /** Completes when the last step() has read every grad: the grad buffers may then be written
   *  again (the next backward) or freed. Recorded on stream() by each step. */
  const Event& grads_read() const { return grads_read_; }
  /** Completes when the last step() has written every param: the next forward may read them. */
  const Event& params_updated() const { return params_updated_; }
  /** Blocks the host until everything enqueued on stream() (the last step included) is done. */
  void synchronize();
  /** A learning-rate (or any option) schedule: step() calls it first, before its checks, with the
   *  number of the step about to run (1 for the first), e.g. to set_lr() from a warm-up and decay;
   *  the checks then validate what it set. It should depend on that number alone: a step that
   *  fails its checks calls it again with the same number. Empty: none. */
  void set_schedule(std::function<void(int64_t step)> schedule) { schedule_ = std::move(schedule); }
  /** With `on`, each step first looks for NaN or infinity in every grad it would read (one host
   *  sync per step); if it finds one (on any rank, under HSDP), the whole step is skipped: nothing
   *  changes, step counters included, and last_step_skipped() says so. The schedule has run.
   *  Under HSDP every rank must set the same (the ranks vote only when it is on). */
  void set_skip_nonfinite(bool on) { skip_nonfinite_ = on; }
  /** Whether steps skip on a non-finite grad (set_skip_nonfinite; off by default). */
  bool skip_nonfinite() const { return skip_nonfinite_; }
  /** Whether the last step() was skipped for a non-finite grad. */
  bool last_step_skipped() const { return last_step_skipped_; }
  /** Whether any grad the next step would read holds a NaN or infinity; waits for the stream.
   *  Collective under HSDP: every rank gets the same answer, and an error on one rank (a failure
   *  its stream holds) throws on every rank. */
  bool grads_nonfinite();
  /** Whether `mine` holds on any rank the optimizer's steps span: under HSDP an all-reduce over
   *  every rank (collective), otherwise `mine`. */
  bool on_any_rank(bool mine) { return sum_over_step_ranks({mine ? 1.f : 0.f})[0] != 0.f; }
  /** Each of `values` summed over the ranks the optimizer's steps span: under HSDP an all-reduce
   *  over every rank of the mesh (collective), otherwise `values`. */
  virtual std::vector<float> sum_over_step_ranks(std::vector<float> values) { return values; }
  /** Whether the optimizer's steps are collective over more than one rank (HSDP Muon on a mesh of
   *  several ranks): a SwapOptimizerSet runs such members' updates first. */
  virtual bool spans_ranks() const { return false; }
  /** The learning rate of `group`. */
  virtual double lr(size_t group) const = 0;
  /** Sets every group's learning rate, validated first: "[AdamW] lr must be finite and >= 0, got
   *  nan" and nothing changes. */
  virtual void set_lr(double lr) = 0;
  /** Drops every param's grad (torch's zero_grad(set_to_none=True)): the next step skips a param
   *  whose grad was not set again. The dropped grads are kept alive until the work already queued
   *  on stream() (which may read them) has passed, so their memory is never freed under a step. */
  void zero_grad();
  /** Checks everything step() relies on, changing nothing: every group's options (those changed
   *  through mutable_options since included) and every param the step updates: its data (not
   *  released, contiguous, on the device; once the optimizer laid out its state, the shape and
   *  dtype it had then: the trainer may point `data` at another buffer between steps, not reshape
   *  or cast it, see ParamRecord::fixed; after such a move, no two params may share memory) and
   *  its grad (shape, device, contiguous, not released, sharing no memory with any param's data,
   *  its own included: the step writes params while it reads grads). A grad must not share
   *  memory with the optimizer's state either (state() hands it out); that is not checked: it
   *  would cost a sort of every state tensor per step, since state() may change them at any
   *  time. step() and the swapped step
   *  call it before they change anything, so bad input leaves every byte of params, state,
   *  counters and host mirrors as it was. Collective under HSDP: the ranks compare which params
   *  they step, and a check failing on one rank fails on every rank ("[Muon] the step's checks
   *  failed on 1 of 2 ranks ..." where the rank's own error is not), so no rank is left waiting
   *  in a collective. */
  void check_step();
  /** Throws the first bad option of any group, as the group's constructor would. */
  virtual void validate_options() const = 0;

  /** Host copies of all state and the metadata (synchronises the stream). */
  virtual StateDict state_dict();
  /** Replaces options, steps and state from `state` after checking all of it against this
   *  optimizer's parameters; on any mismatch throws a named error and changes nothing. */
  virtual void load_state_dict(const StateDict& state);
  /** Writes the checkpoint file that `save_state_dict(state_dict(), path)` writes, byte for byte,
   *  streaming each state tensor from the device through a 16 MiB host staging buffer: no host
   *  copy of the whole state is made (synchronises the stream). */
  void save_checkpoint(const std::string& path);
  /** Loads a checkpoint file as `load_state_dict(load_state_dict(path, options))` does, with the
   *  same checks and errors, streaming each tensor from the file to the device through a 16 MiB
   *  host staging buffer. The file's checksums are verified in a first pass before anything
   *  changes; the file must not change while it loads. */
  void load_checkpoint(const std::string& path, const CheckpointReadOptions& options = {});

  /** Whether a SwapOptimizer wraps this optimizer: its state then lives in the wrapper's host
   *  mirrors, so step(), state_dict() and load_state_dict() go through the wrapper. */
  bool wrapped() const { return wrapped_; }
  /** Set by SwapOptimizer while it wraps this optimizer; wrapping fixes every param's shape and
   *  dtype and each group's state keys (the host mirrors are laid out for them): options that
   *  would add a key to a group (AdamW's amsgrad turned on), set or loaded, are refused while
   *  wrapped. */
  void set_wrapped(bool wrapped);
  /** Throws "[Muon] step() on an optimizer wrapped by a SwapOptimizer: ..." when wrapped. */
  void check_unwrapped(const std::string& call) const;

  /** Whether this rank keeps state for `param` (HSDP Muon: owners only); loading a checkpoint
   *  checks the state of the others and skips it. */
  virtual bool keeps_state(const Param&) const { return true; }

  /** Index of `param` over all groups in order, as checkpoints name it. */
  int64_t param_index(const Param* param) const;
  /** The checkpoint name of `param`'s state `key`: "state.<param_index>.<key>". */
  std::string state_name(const Param* param, const std::string& key) const;

  /** Metadata JSON of the current groups and steps; validates the options first, so no bad or
   *  non-finite value reaches a checkpoint. */
  std::string metadata_json() const;
 protected:
  /** Whether the wrapper (or set) that steps this optimizer votes on a device budget each step. */
  bool votes_on_budget() const { return votes_on_budget_; }
  /** Checks `checkpoint` against this optimizer; returns the change that applies it,
   *  `write_tensor` being how each checked tensor reaches the state (the swap wrapper reads into
   *  host mirrors). Nothing changes until the returned function runs. */
  std::function<void()> prepare_load(const CheckpointReader& checkpoint,
                                     std::function<void(const Param&, const std::string&, const TensorReader&)> write_tensor);
  /** Checks `checkpoint` and loads it into device state of this optimizer's own. */
  void load_from(const CheckpointReader& checkpoint);
  /** load_from's checks; returns the change that loads (it waits for the stream around it). */
  std::function<void()> prepare_device_load(const CheckpointReader& checkpoint);
  /** The state as save_checkpoint() writes it, read from the device through staging buffers. */
  CheckpointSource checkpoint_source();

  // The parts of step(), for the wrappers that step several optimizers as one.
  friend class MuonWithAdamW;
  friend class SwapOptimizer;
  friend class SwapOptimizerSet;
  /** Calls the schedule, if any, with the number of the step about to run. */
  void apply_schedule();
  /** check_layout() of every param: before a load or a swap wrapper fixes their layouts. */
  void check_layouts() const;
  /** What the optimizer requires of a param's shape while it is not fixed (ParamRecord::fixed):
   *  checked when added and at each step until fixed. */
  virtual void check_unfixed_shape(const Param& /*param*/) const {}
  /** The checks of check_step() this rank makes alone: nothing collective, nothing changed. */
  virtual void check_step_locally();
  /** After every local check of a step, `local_failure` their first error or null: an optimizer
   *  whose steps span ranks has them agree (collective) and throws on every rank when a check
   *  failed on any (this rank's own error where it failed); the others do nothing.
   *  `skips_nonfinite`: whether any optimizer stepped with this one skips non-finite steps (then
   *  the step votes on its grads, a collective every rank must reach alike). */
  virtual void agree_on_checks(std::exception_ptr /*local_failure*/, bool /*skips_nonfinite*/) {}
  /** Runs `local_checks` (this rank's checks of one step of `optimizers`, stepped as one), catching
   *  its error, then has every optimizer agree_on_checks() before the error is rethrown: every
   *  rank reaches the same collectives and throws or passes alike. */
  static void check_together(std::span<Optimizer* const> optimizers, const std::function<void()>& local_checks);
  /** Whether `local` (this rank's part of a decision of one step of `optimizers`) holds on any
   *  rank: runs it catching its error, then sums {its answer, whether it threw} over each
   *  optimizer's ranks in turn (every rank makes the same calls). Rethrows the local error, or
   *  throws Error(`elsewhere`) where `local` threw on another rank only. */
  static bool vote_together(std::span<Optimizer* const> optimizers, const std::function<bool()>& local,
                            const std::string& elsewhere);
  /** Whether this rank's grads hold a NaN or infinity (waits for the stream; no vote). */
  bool grads_nonfinite_locally();
  /** After the checks: whether this step is skipped (skip_nonfinite() and grads_nonfinite()).
   *  Changes nothing: the caller sets last_step_skipped() once the step cannot throw its checks. */
  bool skip_this_step();
  /** skip_this_step() of `optimizers` stepped as one: a non-finite grad of any of them that skips
   *  non-finite steps, on any rank, skips them all (the grads of one that does not are not read;
   *  a vote only when one of them skips non-finite steps). */
  static bool skip_together(std::span<Optimizer* const> optimizers);
  /** The update itself, after step()'s checks passed. */
  virtual void run_step() = 0;
  /** Records grads_read() and params_updated() at the current end of stream(). */
  void record_step_events();
  /** The options of group `group` as a JSON object. */
  virtual std::string group_options_json(size_t group) const = 0;
  /** `per_group[group]` for the indexed accessors (options(), mutable_options(), lr()); a bad
   *  index throws std::out_of_range "[AdamW] no group 5 (1 group)". */
  template <class T>
  T& group_entry(std::vector<T>& per_group, size_t group) const {
    check_group_index(group, per_group.size());
    return per_group[group];
  }
  /** group_entry() of a const list. */
  template <class T>
  const T& group_entry(const std::vector<T>& per_group, size_t group) const {
    check_group_index(group, per_group.size());
    return per_group[group];
  }
  /** Throws group_entry()'s std::out_of_range unless group < groups. */
  void check_group_index(size_t group, size_t groups) const;
  /** What prepare_group_options found: the change that applies the options once the whole
   *  checkpoint is known to be good, and the state keys each group uses with them. */
  struct PreparedOptions {
    /** Replaces every group's options with the parsed ones; prepare_load's change runs it only
     *  once the whole checkpoint has passed its checks. */
    std::function<void()> apply;
    /** Per group, the state keys it uses with the parsed options (what group_state_keys() will
     *  return after `apply`); a checkpoint tensor of another key is rejected. */
    std::vector<std::vector<std::string>> group_state_keys;
  };
  /** Parses and checks every group's options JSON as the constructor would (throws, changing
   *  nothing, if any options are bad). */
  virtual PreparedOptions prepare_group_options(const std::vector<std::string>& options_json) = 0;
  /** Whether this optimizer's files written before swapopt 0.4 hold 0 for every param step (Muon
   *  counted none then): such a file loads, each param with state taking its group's step. Since,
   *  a checkpoint's param holds state exactly when its step is positive. */
  virtual bool older_files_hold_no_param_steps() const { return false; }
  /** Checks a new group's parameters (throws naming the parameter). */
  void add_group(std::vector<ParamPtr> params);
  /** Checks every param with a grad: its data (not released, contiguous, on this device, the
   *  shape and dtype fixed for it if any: ParamRecord::fixed), then its grad against its
   *  data (same shape, contiguous, on this device, not released). A grad's dtype may be any (bf16 or
   *  f16 grads on f32 params): the fused updates read it exactly, as if converted to f32 first. */
  void check_params_with_grad() const;
  /** Throws when a group has taken INT64_MAX - 1 steps (the most a checkpoint loads). */
  void check_step_counts() const;
  /** For the update pieces the swap adapters call (public, so checked): throws unless `group` is
   *  one of this optimizer's groups and every one of `params` is a param of it, naming `call`. */
  void check_in_group(size_t group, std::span<const Param* const> params, const char* call) const;
  /** For the public update pieces that change state (Muon's momentum, AdamW's update): refused on
   *  a wrapped optimizer (its state lives in the wrapper's host mirrors), then the options as a
   *  step checks them (validate_options()), check_in_group(), each param listed once, and every
   *  param's data and grad as a step checks them, and, with `counts_step` (all but a chunk past
   *  the first, whose update counted already), that each param's step can be counted once more
   *  (below INT64_MAX - 1, as a checkpoint load takes), so that bad input throws before anything
   *  changes. */
  void check_update_call(size_t group, std::span<const Param* const> params, const char* call,
                         bool counts_step = true) const;
  /** For the public pieces that write params but not state (Muon's process_unsharded_batch):
   *  check_in_group(), each param listed once, and every param's data as a step checks it. */
  void check_params_call(size_t group, std::span<const Param* const> params, const char* call) const;
  /** Counts one update of a param of group `group` whose state is `state`: its step += 1, and the
   *  group's step raised to at least that, so that no param has more steps than its group (as a
   *  checkpoint load requires) also when the update pieces are called outside step(). */
  void count_update(size_t group, ParamState& state);
  /** While wrapped, throws "[name] `what`: group g would keep state [...], and the SwapOptimizer
   *  wrapping it laid out host mirrors only for [...] (`remedy`)" unless each of `keys` is one of
   *  the group's state keys at the wrap (fewer leave mirrors unused; more would stay on the
   *  device, never swapped). */
  void check_keys_fit_wrapper(size_t group, const std::vector<std::string>& keys, const std::string& what,
                              const char* remedy) const;
  /** For the chunked update pieces: a chunk past 0 needs the param's first update counted (the
   *  chunk at 0 counts the step), else a named error naming `call`. */
  void check_chunk_start(const Param& param, int64_t begin, int64_t end, const char* call) const;
  /** Fixes `param`'s shape and dtype, as its data has them now, unless fixed already. */
  void fix_layout(const Param& param);
  /** The state tensor `key` of `param`, created as zeros when missing (fixing its layout). */
  Tensor& state_tensor(const Param& param, const std::string& key);
  /** The state tensor `key` of `param` if it has one, else an undefined tensor (one that
   *  state_tensor() would create): what the update pieces check before anything changes. */
  Tensor existing_state_tensor(const Param& param, const std::string& key) const;

  /** The family name given at construction ("Muon", "AdamW"): checkpoints carry it and errors
   *  start with "[name]". */
  std::string name_;
  /** The stream every update is enqueued on (stream()). */
  Stream stream_;
  /** The param groups (param_groups()); add_group() appends one, the subclass keeps its options
   *  at the same index. */
  std::vector<ParamGroup> groups_;
  /** State by param (state()); state_tensor() creates entries, load_state_dict() replaces them. */
  std::map<const Param*, ParamState> state_;
  /** Whether a SwapOptimizer wraps this optimizer (wrapped(), set_wrapped()). */
  bool wrapped_ = false;
  /** Each group's state keys when the wrapper laid out its mirrors (set_wrapped()); empty while
   *  not wrapped. */
  std::vector<std::vector<std::string>> wrapped_state_keys_;
  /** Set by SwapOptimizer (a friend) while its step runs its adapter: the update pieces that
   *  change state (AdamW::update_params, Muon::update_params and the like) are refused on a
   *  wrapped optimizer, except as the adapter's calls inside the wrapper's step. */
  bool in_swapped_step_ = false;
  /** Set by the swap wrapper (or the set) that steps this optimizer: whether its steps vote on
   *  whether the plan fits a device budget (an all-reduce under HSDP, so every rank must). */
  bool votes_on_budget_ = false;
  /** The schedule set_schedule() gave; empty: none. apply_schedule() calls it. */
  std::function<void(int64_t)> schedule_;
  /** set_skip_nonfinite()'s flag. */
  bool skip_nonfinite_ = false;
  /** What last_step_skipped() returns; set by step() after the checks (and by the wrappers that
   *  step several optimizers as one, so all of them skip together). */
  bool last_step_skipped_ = false;
  /** grads_read(): recorded on stream_ by record_step_events(). */
  Event grads_read_;
  /** params_updated(): recorded on stream_ by record_step_events(). */
  Event params_updated_;
  /** Grads zero_grad() dropped, held until stream() passes `retired_mark_`. */
  std::vector<Tensor> retired_grads_;
  /** Recorded on stream_ by the zero_grad() that last dropped grads: once it completes, no queued
   *  work reads `retired_grads_` any more. */
  Event retired_mark_;
  /** Drops the retired grads once stream() has passed their mark. */
  void release_retired_grads();

 private:
  /** Throws if two params (those already added and `added`) share memory, naming both. */
  void check_disjoint(const std::vector<ParamPtr>& added) const;
  /** A step's check that the params of `optimizers`, stepped as one, share no memory: rerun only
   *  when some param's `data` points elsewhere than at the last check (re-pointing is allowed). */
  static void check_moved_params_disjoint(std::span<Optimizer* const> optimizers);
  std::vector<const Optimizer*> disjoint_scope_;  // the optimizers its params were last checked with
  /** A step's check that no grad of `optimizers` shares memory with a param's data (the step
   *  writes params while it reads grads): a binary search per grad in the first one's
   *  sorted_data_, which check_moved_params_disjoint keeps. */
  static void check_grads_apart_from_data(std::span<Optimizer* const> optimizers);
  /** The data of the params of disjoint_scope_ (when this optimizer is its first), sorted by
   *  address: made again whenever the params are checked for sharing memory. */
  std::vector<detail::ParamBytes> sorted_data_;
  /** What the optimizer knows of each param, by param_index(). */
  struct ParamRecord {
    const Param* param;
    size_t group;
    /** The param's name when it was added: checkpoints name its state by it, so it stays. */
    std::string name;
    /** Whether the shape and dtype below are fixed: once the optimizer lays out state for the
     *  param (its first update makes its state, a checkpoint loads it, a SwapOptimizer wraps the
     *  optimizer, enable_hsdp plans it), `data` may point at another buffer of them, nothing else.
     *  Until then the trainer may cast or reshard the param. */
    bool fixed = false;
    Shape shape;
    DType dtype = DType::f32;
    /** Where `data` was when a step last checked that no two params share memory (null: not
     *  checked yet): a step whose params all stay put skips that check. */
    const void* checked_begin = nullptr;
    size_t checked_nbytes = 0;
  };
  std::vector<ParamRecord> records_;
  /** fix_layout() for the param of `record`, one of records_ (no lookup of its index). */
  static void fix_layout(ParamRecord& record);
  /** Throws unless `param`'s data has the shape and dtype fixed in `record`, or, not fixed yet,
   *  passes check_unfixed_shape(). */
  void check_layout(const Param& param, const ParamRecord& record) const;
  /** check_params_with_grad() for one param with a grad. */
  void check_param_with_grad(const Param& param, const ParamRecord& record) const;
  /** The half of check_param_with_grad() that checks the data. */
  void check_param_data(const Param& param, const ParamRecord& record) const;
  /** Throws naming `call` if a param is listed twice in `params` (it would be updated twice). */
  void check_listed_once(std::span<const Param* const> params, const char* call) const;
  /** param_index() of every param, kept by add_group(): a lookup costs the same at 50000 params. */
  std::unordered_map<const Param*, int64_t> param_indices_;
  /** Every param's name, kept by add_group() to refuse a duplicate. */
  std::unordered_set<std::string> param_names_;
  /** Throws "[<optimizer>] parameter 'b' was renamed 'a' after it was added ..." for the first
   *  param whose name changed: a checkpoint written then would name its state wrongly. */
  void check_names_unchanged() const;
};

}  // namespace swapopt
