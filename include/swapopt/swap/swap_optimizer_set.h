#pragma once
/** Several swapped optimizers stepped, checked and saved as one: Muon and AdamW of a
 *  MuonWithAdamW, or any list of SwapOptimizers on one stream. */

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "swapopt/optim/routing.h"
#include "swapopt/swap/swap_optimizer.h"

namespace swapopt {

class SwapOptimizerSet;

/** Wraps both halves of `opt` (Muon's momentum, AdamW's moments) as members "muon" and "adamw",
 *  each with `config`. `config.state_keys`, when set, is split by family: each half swaps the
 *  listed keys of its own ({"momentum_buffer"} swaps Muon's momentum and no AdamW moment, which
 *  then stays on the device); a key of neither family is an error. A refused wrap (of either
 *  half, or of the set) changes nothing: neither half stays wrapped, no layout stays fixed. */
std::unique_ptr<SwapOptimizerSet> swap_muon_with_adamw(MuonWithAdamW& opt, SwapConfig config = {});

/** Steps, synchronises and checkpoints its members together; it owns their wrappers. */
class SwapOptimizerSet {
 public:
  /** A member's name and its wrapper. */
  using Member = std::pair<std::string, std::unique_ptr<SwapOptimizer>>;
  /** `members`: a unique name each (letters, digits, '_' and '-'; the checkpoint's tensor prefix)
   *  and its wrapper; all on one stream (the same handle: one Stream, or borrow() wrappers of one
   *  cudaStream_t). Throws "[swap] ..." naming what is wrong. */
  explicit SwapOptimizerSet(std::vector<Member> members);
  /** Waits for a save_async() still writing (its failure, if any, is dropped). */
  ~SwapOptimizerSet();
  SwapOptimizerSet(const SwapOptimizerSet&) = delete;
  SwapOptimizerSet& operator=(const SwapOptimizerSet&) = delete;

  /** One step of every member, with Optimizer::step's contract: every member is checked and
   *  planned (budget included) before any of them changes anything. The updates then run in the
   *  members' order, except that those spanning ranks (Optimizer::spans_ranks: HSDP Muon) run
   *  first, so that a failure of a rank-local member cannot leave other ranks in this step's
   *  collectives. */
  void step();
  /** Every member's zero_grad(). */
  void zero_grad();
  /** Every member's prefetch_early(). */
  void prefetch_early();
  /** Completes when the last step() has read every grad (members share the stream: the event of
   *  the member that stepped last covers them all). */
  const Event& grads_read() { return members_[last_to_run_].second->grads_read(); }
  /** Completes when the last step() has written every param (the event of the member that stepped
   *  last). */
  const Event& params_updated() { return members_[last_to_run_].second->params_updated(); }
  /** Blocks the host until every member's last step is done, its state copies included. */
  void synchronize();
  /** The stream every member steps on (one for all: the constructor checks it). */
  Stream& stream() { return members_.front().second->stream(); }
  /** set_skip_nonfinite(on) on every member's optimizer: a non-finite grad in any member (on any
   *  rank, under HSDP: every rank must set the same) then skips the whole set's step. */
  void set_skip_nonfinite(bool on);
  /** Whether the last step() was skipped for a non-finite grad (the members skip together). */
  bool last_step_skipped() { return members_.front().second->optimizer().last_step_skipped(); }
  /** The last completed step of the set, summed over the members (they run one after another):
   *  batches, bytes and copies each way, slots, state bytes and exposed wait are sums; the peaks
   *  are the largest member's; early_prefetch_used and skipped_nonfinite hold if any member's do.
   *  Never waits. The members' own: member(name).last_report(). */
  SwapStepReport last_report();

  /** One state dict: each member's tensors under "<name>/" ("muon/state.0.momentum_buffer") and
   *  metadata {"optimizer": the members' optimizer names joined by '+' ("Muon+AdamW"), "members":
   *  [{"name", "metadata"}]}. */
  StateDict state_dict();
  /** Checks the whole checkpoint against every member before any changes; a checkpoint of other
   *  members, or of one optimizer, is a named error. */
  void load_state_dict(const StateDict& state);
  /** Writes the file that `save_state_dict(state_dict(), path)` writes, byte for byte, straight
   *  from every member's host mirrors: no copy of the state is made. Synchronises. */
  void save_checkpoint(const std::string& path);
  /** Loads a checkpoint file as `load_state_dict(load_state_dict(path, options))` does, with the
   *  same checks and errors, reading swapped state from the file straight into the mirrors. The
   *  file's checksums are verified in a first pass before anything changes; the file must not
   *  change while it loads. */
  void load_checkpoint(const std::string& path, const CheckpointReadOptions& options = {});
  /** SwapOptimizer::save_async over every member: one file, byte for byte what save_checkpoint
   *  writes now, written in the background while the set keeps stepping. */
  void save_async(const std::string& path);
  /** Blocks until the last save_async() has committed its file; throws its failure. */
  void wait_save();

  /** The member called `name`; throws "[swap] no member ..." when there is none. */
  SwapOptimizer& member(const std::string& name);
  /** The members in the order given: the order they step and are saved in. */
  const std::vector<Member>& members() const { return members_; }

 private:
  /** Checks `checkpoint` against every member, then loads it (nothing changes on an error). */
  void load_from(const CheckpointReader& checkpoint);
  /** Every member's SwapOptimizer::checkpoint_source under its name's prefix, and the set's
   *  metadata. */
  CheckpointSource checkpoint_source(bool copy_device_state, std::unordered_map<const SwapSlot*, std::string>* mirrors);
  /** The members' optimizer names joined by '+' (the metadata's "optimizer"), e.g. "Muon+AdamW". */
  std::string optimizer_names() const;
  /** The members' names, in order. */
  std::vector<std::string> member_names() const;
  std::vector<Member> members_;
  // The member whose update runs last: step() runs those spanning ranks first.
  size_t last_to_run_ = 0;
  std::shared_ptr<AsyncSave> save_;  // the last save_async(), until waited for

  friend std::unique_ptr<SwapOptimizerSet> swap_muon_with_adamw(MuonWithAdamW& opt, SwapConfig config);
  /** Whether each of `optimizer`'s params has its layout fixed, in the order they were added. */
  static std::vector<bool> fixed_layouts(const Optimizer& optimizer);
  /** Unfixes the layouts fixed since fixed_layouts() gave `fixed_before` (a wrap that failed). */
  static void unfix_layouts_since(Optimizer& optimizer, const std::vector<bool>& fixed_before);
};

}  // namespace swapopt
