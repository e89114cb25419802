#pragma once
/** An optimizer whose state lives in pinned host memory between steps, with steps bitwise equal to
 *  the bare optimizer's. */

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>

#include "swapopt/optim/adamw.h"
#include "swapopt/optim/muon.h"
#include "swapopt/swap/pipeline_swap_runtime.h"
#include "swapopt/swap/state_swap_adapter.h"

namespace swapopt {

struct CheckpointSource;
class AsyncSave;

/** Wraps one optimizer (through its StateSwapAdapter) so that its state lives in pinned host
 *  mirrors between steps and reaches the device a batch of update units at a time. */
class SwapOptimizer {
 public:
  /** Validates `config` and the adapter (null: a named error), allocates the pinned mirrors
   *  (once) and offloads any state the optimizer already holds, waiting for it. The optimizer must
   *  outlive this wrapper; while wrapped, its own step(), state_dict() and load_state_dict() and a
   *  second wrap are named errors. */
  SwapOptimizer(std::unique_ptr<StateSwapAdapter> adapter, SwapConfig config);
  /** Hands the optimizer back with its state on the device again (copied from the mirrors), so
   *  it can go on bare; nothing is lost. */
  ~SwapOptimizer();
  SwapOptimizer(const SwapOptimizer&) = delete;
  SwapOptimizer& operator=(const SwapOptimizer&) = delete;

  /** One optimizer step through the swap pipeline, with the bare step's contract (see
   *  Optimizer::step): checks first, then asynchronous; the math runs on the optimizer's stream
   *  and the state's copies on the runtime's two copy streams, ordered by events. */
  void step();
  /** Completes when the last step() has read every grad (the buffers may be reused). */
  const Event& grads_read() { return optimizer().grads_read(); }
  /** Completes when the last step() has written every param. */
  const Event& params_updated() { return optimizer().params_updated(); }
  /** The stream the optimizer steps on (its optimizer's). */
  Stream& stream() { return optimizer().stream(); }
  /** Blocks the host until the last step is done, its state copies to the host mirrors included. */
  void synchronize();
  /** The optimizer's zero_grad(). */
  void zero_grad() { optimizer().zero_grad(); }
  /** The optimizer's set_skip_nonfinite(on): a step whose grads hold a NaN or an infinity is
   *  skipped whole (nothing changes; last_step_skipped() says so). */
  void set_skip_nonfinite(bool on) { optimizer().set_skip_nonfinite(on); }
  /** Whether the last step was skipped for a non-finite grad. */
  bool last_step_skipped() { return optimizer().last_step_skipped(); }
  /** Starts the H2D of the next step's first batch(es) now, e.g. while the last layers' backward
   *  runs, planned as if every param will have a gradient; step() continues from there when the
   *  plan holds, and otherwise redoes those copies. Results are bitwise the same either way. A
   *  plan that cannot be made (a device budget it does not fit, a param whose data has another
   *  shape) prefetches nothing and throws nothing: step() names the error. A
   *  step() that throws its checks keeps the prefetch for the next step(); calling prefetch_early()
   *  again before that step adds nothing. */
  void prefetch_early();

  /** Host copies of the state (mirrors for swapped state) and metadata: the same format as the
   *  bare optimizer's, so either loads the other's checkpoints. */
  StateDict state_dict();
  /** Checks `state` like the bare optimizer, then writes swapped state into the host mirrors (no
   *  H2D); on a mismatch throws a named error and changes nothing. */
  void load_state_dict(const StateDict& state);
  /** Writes the file that `save_state_dict(state_dict(), path)` writes, byte for byte, straight
   *  from the host mirrors (state kept on the device goes through a 16 MiB staging buffer): no
   *  copy of the state is made. Synchronises. */
  void save_checkpoint(const std::string& path);
  /** Loads a checkpoint file as `load_state_dict(load_state_dict(path, options))` does, with the
   *  same checks and errors, reading swapped state from the file straight into the host mirrors.
   *  The file's checksums are verified in a first pass before anything changes; the file must not
   *  change while it loads. */
  void load_checkpoint(const std::string& path, const CheckpointReadOptions& options = {});
  /** Starts writing the checkpoint of the state as it is now (after the steps so far, waited
   *  for) on a background thread and returns: the file will be byte for byte what
   *  save_checkpoint(path) writes now, committed atomically. Training goes on meanwhile; the
   *  mirrors are read in place, and a later step's offload into a mirror waits only until the
   *  writer has written it (state kept on the device is copied to the host here). The writer
   *  checksums the whole state before it writes any of it, so the first offloads after this call
   *  wait for that pass. A save still running is waited for first (and its failure thrown here).
   *  A failure is thrown, once, by the first step() that begins after the writer failed (before
   *  it changes anything; a step beginning while the writer runs goes ahead), save_async() or
   *  wait_save(). save_checkpoint() and the loads wait for a running save first. */
  void save_async(const std::string& path);
  /** Blocks until the last save_async() has committed its file; throws its failure. */
  void wait_save();

  /** The report of the last step that has completed; never waits, so logging it costs no sync
   *  (after synchronize(), the last step's). */
  SwapStepReport last_report() { return runtime_.last_report(); }
  /** The wrapped optimizer. */
  Optimizer& optimizer() { return adapter_->optimizer(); }
  /** The adapter given at construction (owned by this wrapper). */
  StateSwapAdapter& adapter() { return *adapter_; }
  /** The swap pipeline: mirrors, slots, copy streams and reports. */
  PipelineSwapRuntime& runtime() { return runtime_; }
  /** The state keys being swapped. */
  const std::vector<std::string>& state_keys() const { return keys_; }

  /** A step checked and planned, not yet run (what step() does in two parts, so that a set of
   *  optimizers changes nothing until every member is known to be able to step). */
  struct PlannedStep {
    std::vector<UpdateUnit> units;  ///< The step's units in schedule order, slots attached; empty when skipped.
    std::vector<size_t> batch_sizes;  ///< Units per batch, in order (PipelineSwapRuntime::plan_batches).
    /** Skipped whole for a non-finite grad (Optimizer::set_skip_nonfinite); a set of optimizers
     *  skips every member when one does. */
    bool skip = false;
    /** Which plan_step() made it: run_step() takes only the latest plan, once. */
    uint64_t id = 0;
  };
  /** The optimizer's check_step(), the units, their slots and the batches (budget checked);
   *  changes nothing. */
  PlannedStep plan_step();
  /** Runs a step plan_step() just made (or, with plan.skip, records a skipped step). An older
   *  plan, another wrapper's, one run already, or one made before a load (load_state_dict,
   *  load_checkpoint), is a named error that changes nothing. The params, grads and options must
   *  not change in between: the plan's checks are not rerun. */
  void run_step(PlannedStep& plan);
 private:
  friend class SwapOptimizerSet;
  /** Checks `checkpoint` and returns the change that loads it (nothing changes before it runs). */
  std::function<void()> prepare_load(const CheckpointReader& checkpoint);
  /** The state as save_checkpoint writes it, after synchronize(): mirrors read in place (each
   *  slot's tensor name put in `mirrors`, when given); state kept on the device streamed through
   *  the staging buffer, or with `copy_device_state` copied to host memory now. */
  CheckpointSource checkpoint_source(bool copy_device_state = false,
                                     std::unordered_map<const SwapSlot*, std::string>* mirrors = nullptr);
  /** Throws the failure of a finished save_async(), once. */
  void check_save();
  /** plan_step() after its checks (the save's, the schedule, the optimizer's check_step()): the
   *  skip vote, the units and the batches (budget checked, the ranks voting on it); changes
   *  nothing. A set votes and plans for all its members at once instead (SwapOptimizerSet::step). */
  PlannedStep plan_checked_step();
  /** The units, their slots and the batches (budget checked) into `plan`: this rank alone. */
  void plan_units(PlannedStep& plan);
  /** What the other ranks throw when this rank's plan does not fit device_budget_bytes. */
  std::string budget_elsewhere() const;
  /** Makes `plan` this wrapper's latest, the one run_step() takes. */
  void stamp(PlannedStep& plan);
  uint64_t latest_plan_ = 0;         // the id of the plan stamped last
  uint64_t plan_run_ = 0;            // the id of the plan run_step() took last
  std::shared_ptr<AsyncSave> save_;  // the last save_async(), until waited for

  std::unique_ptr<StateSwapAdapter> adapter_;
  std::vector<std::string> keys_;
  PipelineSwapRuntime runtime_;
};

/** Wraps `muon` with momentum-only swap. */
std::unique_ptr<SwapOptimizer> swap_muon(Muon& muon, SwapConfig config = {});
/** Wraps `adamw` with swap of its moments. */
std::unique_ptr<SwapOptimizer> swap_adamw(AdamW& adamw, SwapConfig config = {});

}  // namespace swapopt
