#pragma once
/** Muon: SGD-momentum, Newton-Schulz orthogonalisation of each matrix's update, decoupled decay. */

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "swapopt/optim/hsdp.h"
#include "swapopt/optim/mesh_groups.h"
#include "swapopt/optim/newton_schulz.h"
#include "swapopt/optim/optimizer.h"
#include "swapopt/optim/replicate_broadcaster.h"

namespace swapopt {

/** Defaults are the reference system's. */
struct MuonOptions {
  /** Learning rate: the param gets -lr * scale * (orthogonalised update), scale from
   *  matched_adamw_rms. Finite, >= 0. */
  double lr = 2e-2;
  /** Decoupled decay: the param is multiplied by 1 - lr * weight_decay as the update is added.
   *  Finite, >= 0. */
  double weight_decay = 0.1;
  /** Update RMS matched to AdamW's: scale = sqrt(max(rows, cols)) * matched_adamw_rms. */
  double matched_adamw_rms = 0.2;
  /** m1: weight of the old buffer in the update; m2: in the new buffer (the pair form). */
  double momentum = 0.95;
  std::optional<double> momentum2{};  ///< m2, in [0, 1); unset: m2 = momentum
  /** Nesterov: the update becomes m1 * u + g (u = g + m1 * buf, the old buffer). */
  bool nesterov = true;
  /** Newton-Schulz iterations, >= 1; at most 5 for asym5 and polar_express, at most the number
   *  of ns_coefficients for custom. */
  int ns_steps = 5;
  /** Coefficient schedule (see ns_schedule): "legacy", "asym5", "polar_express" or "custom". */
  std::string ns_variant = "asym5";
  /** The (a, b, c) triples of "custom", one per step; must be empty for the other variants. */
  std::vector<NsCoefficients> ns_coefficients{};
  /** eps of the Newton-Schulz normalisation X / (||X||_F * norm_scale + eps); finite, >= 0. */
  double ns_epsilon = 1e-10;
  /** With matched_adamw_rms == 0: "zero" gives scale 0 (decay only), "use_lr" gives scale 1. */
  std::string zero_rms_scale_mode = "zero";
  /** Fold -lr into the update before it is added (rounded in the NS dtype), as the reference can. */
  bool apply_lr_in_update = false;
  /** Working dtype of Newton-Schulz: unset = f32 on the CPU, bf16 on CUDA (the reference's). */
  std::optional<DType> ns_dtype{};
  /** Memory-safe batches: a param whose logical elements would take a batch past
   *  max(1, max_batch_elements / shard_size) starts the next batch, once the current one holds
   *  min_batch_size params (so one large param, or min_batch_size, can exceed it). >= 1. */
  int64_t max_batch_elements = 512LL * 1024 * 1024;
  /** The fewest params a memory-safe batch holds before max_batch_elements may close it; >= 1. */
  int64_t min_batch_size = 1;

  /** Throws "[Muon] <option> ..." for the first bad value. */
  void validate() const;
  /** m2: momentum2 when set, else momentum. */
  double m2() const { return momentum2.value_or(momentum); }
};

/** What post_update_fn learns about the update it follows. */
struct PostUpdateContext {
  std::string name;        ///< The param's name.
  Shape logical_shape;     ///< The param's full shape (its DTensor's logical shape, or its own).
  double lr;               ///< The group's lr used by this update.
  double weight_decay;     ///< The group's weight_decay used by this update.
  int64_t step;            ///< The group's step count, this step included (1 after the first).
};

/** Replace parts of the math. Each runs on the host and must enqueue its work on `stream`. They
 *  run inside the step, after its checks: an exception from one, or a result of the wrong count
 *  or size (a named error), leaves that step partly applied, as a CUDA error would (reload the
 *  last checkpoint). */
struct MuonHooks {
  /** Returns one NS input per grad (any shape with the grad's numel); replaces the momentum update. */
  std::function<std::vector<Tensor>(Stream& stream, const std::vector<Tensor>& grads, const std::vector<Tensor>& bufs,
                                    float m1, float m2, bool nesterov)>
      momentum_update_fn{};
  /** Orthogonalises x [B, m, n] in place; replaces the built-in Newton-Schulz. */
  std::function<void(Stream& stream, const Tensor& x, int ns_steps)> zeropower_fn{};
  /** Called for each updated param after its group's updates (owners only, before broadcasts).
   *  Under HSDP the hooks run while the stream waits on collectives on the device: they must not
   *  synchronise it (that wait has no timeout; the step's end has). */
  std::function<void(Stream& stream, Param& param, const Tensor& local, const PostUpdateContext& context)>
      post_update_fn{};
};

/** The last two dims of a Muon param, with [A, 1, B] read as (A, B); `count` matrices of rows x cols. */
struct CoreShape {
  int64_t rows = 0;   ///< Rows of each matrix (the second-to-last dim; A for [A, 1, B]).
  int64_t cols = 0;   ///< Columns of each matrix (the last dim).
  int64_t count = 0;  ///< Matrices: the product of the leading dims (1 for [A, 1, B]; 0 when rows or cols is 0).
  /** Same rows, cols and count. */
  bool operator==(const CoreShape&) const = default;
};
/** The core shape of `shape`; throws for fewer than 2 dims. */
CoreShape core_shape(const Shape& shape);

/** Device bytes Newton-Schulz on the matrices of `cs` allocates on `device` with `element_size`-byte
 *  elements, its stacked input included: 2 B m n + 2 B k^2 elements (k = min(m, n)), B f32 norms,
 *  and on CUDA the norm's partial sums (ops::frobenius_norm_scratch_bytes). */
int64_t ns_workspace_bytes(const CoreShape& cs, int64_t element_size, Device device = Device::cpu());

/** Muon over param groups of matrices, each group with its own options: a momentum_buffer per
 *  param (in the param's dtype), Newton-Schulz of each matrix's update, decoupled weight decay;
 *  with enable_hsdp(), across the ranks of a device mesh. */
class Muon : public Optimizer {
 public:
  /** `stream` runs every update (params, grads and state live on its device); `hooks` replace
   *  parts of the math. */
  explicit Muon(Stream stream, MuonHooks hooks = {});

  /** Adds a group (not while a SwapOptimizer wraps it); every param must be at least 2-D:
   *  "[Muon] 1-D parameter 'ln.bias' (shape [768]) cannot use Muon". */
  void add_param_group(std::vector<ParamPtr> params, MuonOptions options = {});
  /** Group `group`'s options; throws std::out_of_range for a bad index. */
  const MuonOptions& options(size_t group) const { return group_entry(options_, group); }
  /** Group `group`'s options, to change in place: checked only by the next step() or checkpoint
   *  save, which throw for a bad value (set_options() checks at once). Throws std::out_of_range
   *  for a bad index. */
  MuonOptions& mutable_options(size_t group) { return group_entry(options_, group); }
  /** Replaces group `group`'s options, validated first (a bad value throws, nothing changes). */
  void set_options(size_t group, const MuonOptions& options);
  double lr(size_t group) const override { return group_entry(options_, group).lr; }
  void set_lr(double lr) override;
  /** The hooks given at construction. */
  const MuonHooks& hooks() const { return hooks_; }

  std::vector<std::string> state_keys() const override { return {"momentum_buffer"}; }
  DType state_dtype(const std::string& key, const Param& param) const override;
  /** Under HSDP, an all-reduce over the world group. */
  std::vector<float> sum_over_step_ranks(std::vector<float> values) override;
  bool spans_ranks() const override;
  void validate_options() const override;

  /** Turns on HSDP over `world`, the group of every rank of the params' mesh (world rank == mesh
   *  rank). Params with a DTensor layout are grouped, per group, by communication domain (their
   *  replicate and shard mesh dims, in order of first appearance) and split into assignments
   *  (make_hsdp_assignments); params without one stay local. A replicated param is updated by its
   *  owner and broadcast to its replica block; a sharded param's shards are all-gathered (packed,
   *  512-byte aligned) in the owner's shard group, one rank computes Newton-Schulz of the full
   *  matrix and broadcasts the update in the shard group, and every rank applies its slice. Only
   *  owners keep momentum (of their shard). Creates the sub-groups it needs (collective). Not
   *  while a SwapOptimizer wraps the optimizer: enable HSDP first, then wrap. Before the
   *  collectives, throws for a param whose layout is another mesh rank's or that has state
   *  already, or a replica_count that does not divide a param's replicas: turn HSDP on before the
   *  first step, and load checkpoints after it. The ranks agree on those checks first (one
   *  all-reduce): when one rank refuses, every rank throws, the others naming "another rank", and
   *  none enables HSDP. The same all-reduce compares a digest of `options` (but its name) and of
   *  every param's name, group, dtype, logical shape, mesh shape and placements: ranks that
   *  differ there (their plans would) all throw "[Muon] enable_hsdp: the ranks' setups differ
   *  (this rank: ...)". The plan is fixed then: a later step refuses, on every rank, a param
   *  whose layout is not the one planned ("[Muon] parameter 'a' has layout none, enable_hsdp
   *  planned its update for ..."); a group added later holds params without layouts. */
  void enable_hsdp(std::shared_ptr<Communicator> world, HsdpOptions options = {});
  /** Whether enable_hsdp() has succeeded. */
  bool hsdp_enabled() const { return mesh_groups_ != nullptr; }
  /** Every assignment in schedule order: for each assignment index, each group, each domain (the
   *  same order on every rank). Empty without HSDP. */
  const std::vector<HsdpAssignment>& hsdp_schedule() const { return schedule_; }
  /** The options enable_hsdp() took (validated); default values without HSDP. */
  const HsdpOptions& hsdp_options() const { return hsdp_options_; }
  /** False for a param HSDP gives to another replica: loading a checkpoint skips its state. */
  bool keeps_state(const Param& param) const override;
  /** Params of `group` updated locally: all of them without HSDP (a sharded one is an error then),
   *  those without a layout with it. */
  std::vector<Param*> local_params(size_t group) const;
  /** Writes the NS input of each of `params` (`inputs[i]`, shaped like `params[i]`'s data) in
   *  place of momentum_into: the swap adapter streams a chunked unit's momentum through it. */
  using MomentumWriter = std::function<void(const std::vector<Param*>& params, const std::vector<Tensor>& inputs)>;
  /** Momentum, Newton-Schulz and update of `params` (owned params of `assignment` with grads;
   *  the same list on every rank of the shard group). Sharded: all-gather, NS by the computing
   *  ranks, broadcast of the updates (one group), each rank's slice applied, all ordered on the
   *  stream without a host wait (finish_hsdp_step waits for the collectives). With
   *  `write_momentum`, it writes the NS inputs (the same bits as momentum_into): of all `params`
   *  in one call when sharded (they go into one all-gather), else of each memory-safe batch just
   *  before its Newton-Schulz, one call per batch, as the momentum is made without it. Its
   *  checks are this rank's alone, not agreed like step()'s: bad input on one rank throws there
   *  while the group's other ranks wait in the collective until its timeout. */
  void update_assignment(const HsdpAssignment& assignment, const std::vector<Param*>& params,
                         const MomentumWriter& write_momentum = {});
  /** After update_assignment: post_update_fn for `owned_with_grad`, then the broadcast of every
   *  param of the assignment from its owner (packed on the stream, after the update). */
  void finish_assignment(const HsdpAssignment& assignment, AsyncReplicateBroadcaster& broadcaster,
                         const std::vector<Param*>& owned_with_grad);
  /** The end of an HSDP step: the stream takes the broadcasts in flight (receivers' copies), then
   *  the host waits for every collective of the step, in issue order, each one even after
   *  another failed, rethrowing the first error. Besides the checks' agreement (and the non-finite vote
   *  when enabled), that is the step's only host wait (in between the collectives and the stream
   *  order each other on the device, Communicator::start_after and Work::finish_before), and it is
   *  what turns a lost peer into an error from the step (NCCL: the timeout aborts the
   *  communicator, releasing the streams that wait on it) instead of a hang in a later
   *  synchronize. */
  void finish_hsdp_step(AsyncReplicateBroadcaster& broadcaster);
  /** finish_hsdp_step for a step that threw: settles its collectives, never throws. Call it before
   *  synchronising a stream the step ordered after them. */
  void abandon_hsdp_step(AsyncReplicateBroadcaster& broadcaster) noexcept;

  /** Momentum, Newton-Schulz and update of `params` (with grads), by shape group and memory-safe
   *  batch; with `write_momentum`, as update_assignment says. Each param's step += 1, and the
   *  group's step is raised to at least that (so that a checkpoint of an optimizer driven by
   *  these pieces alone loads). This and the other pieces that
   *  update momentum (update_assignment, update_momentum, momentum_chunk, momentum_into) check
   *  the params as a step does first, so bad input changes nothing, and are refused while a
   *  SwapOptimizer wraps the optimizer (its state is in the wrapper's host mirrors). */
  void update_params(size_t group, const std::vector<Param*>& params, const MomentumWriter& write_momentum = {});

  // The schedule, in the pieces the swap adapter replays (same functions, same order).

  /** Params grouped by core shape, groups in order of first appearance. */
  std::vector<std::vector<Param*>> group_by_shape(const std::vector<Param*>& params) const;
  /** Greedy split of one shape group (see MuonOptions::max_batch_elements). */
  std::vector<std::vector<Param*>> split_into_memory_safe_batches(size_t group, const std::vector<Param*>& params,
                                                                   int64_t shard_size = 1) const;
  /** Updates the momentum of `params` (one core shape, all with grads; buffers created as zeros
   *  if missing) and returns their stacked NS input [matrices, rows, cols] in the NS dtype. */
  Tensor update_momentum(size_t group, const std::vector<Param*>& params);
  /** The stacked NS input of `params` (one core shape), not yet written: [matrices, rows, cols]
   *  in the NS dtype. */
  Tensor allocate_ns_input(size_t group, const std::vector<Param*>& params);
  /** Each param's part of `ns_input` (from allocate_ns_input), viewed with the param's shape. */
  std::vector<Tensor> ns_input_parts(const Tensor& ns_input, const std::vector<Param*>& params) const;
  /** The momentum update of elements [begin, end) of `param` (flattened; the same bits there as
   *  update_momentum) into `out_input`, end - begin elements of its NS input part.
   *  `staged_buffer` is that range of the momentum buffer when it is kept elsewhere; undefined,
   *  the optimizer's own buffer is used (created as zeros if missing). What the swap adapter's
   *  chunked units do, checked; momentum_update_fn cannot run in chunks. */
  void momentum_chunk(size_t group, const Param& param, int64_t begin, int64_t end, const Tensor& staged_buffer,
                      const Tensor& out_input);
  /** Writes each param's NS input (its momentum update, any shape with the param's numel) into
   *  `out_inputs[i]`, creating missing buffers as zeros. */
  void momentum_into(size_t group, const std::vector<Param*>& params, const std::vector<Tensor>& out_inputs);
  /** Newton-Schulz on `ns_input` (from update_momentum) and the parameter updates. Every param's
   *  data (as a step checks it; each listed once) and ns_input (its shape, dtype, device, and no
   *  memory shared with a param) are checked before any param changes. */
  void process_unsharded_batch(size_t group, const std::vector<Param*>& params, const Tensor& ns_input);
  /** post_update_fn for `params`, if set. */
  void run_post_update(size_t group, const std::vector<Param*>& params);
  /** The params of `group` that have a grad, in order. */
  std::vector<Param*> params_with_grad(size_t group) const;
  /** Working dtype of Newton-Schulz for `group`. */
  DType ns_dtype(size_t group) const;
  /** Device bytes update_momentum + process_unsharded_batch allocate for `params` (one core shape):
   *  the stacked NS input and Newton-Schulz's workspaces (2 B m n + 2 B k^2 in the NS dtype, k =
   *  min(m, n), plus B norms). */
  int64_t workspace_bytes(size_t group, const std::vector<Param*>& params) const;
  /** An upper bound of the device bytes one HSDP assignment allocates while it runs on this rank:
   *  the NS of every param it owns on full matrices, the packed gather and update buffers of a
   *  sharded one, and the replicate broadcast buffers. */
  int64_t assignment_workspace_bytes(const HsdpAssignment& assignment) const;

 protected:
  /** Every group's step += 1; then for each group, every local (no-comm) param with a grad by
   *  shape group and memory-safe batch: momentum, Newton-Schulz, update; then post_update_fn for
   *  the group's updated params. With HSDP, then every assignment of hsdp_schedule(): its owned
   *  params with grads (update_assignment, finish_assignment); finish_hsdp_step before step()
   *  returns, abandon_hsdp_step when an assignment throws. */
  void run_step() override;
  bool older_files_hold_no_param_steps() const override { return true; }

  std::string group_options_json(size_t group) const override;
  PreparedOptions prepare_group_options(const std::vector<std::string>& options_json) override;

 private:
  /** Orthogonalises x [matrices, rows, cols] in place (zeropower_fn or the built-in NS). */
  void orthogonalize(size_t group, const Tensor& x);
  /** param = decay * param - lr * scale * update, `update` shaped like the local param and
   *  `logical` the full matrix shape the scale comes from. */
  void apply_update(size_t group, Param& param, const Tensor& update, const CoreShape& logical);
  void update_sharded(const HsdpAssignment& assignment, const std::vector<Param*>& params,
                      const MomentumWriter& write_momentum);
  /** At least 2 dims (a matrix or a stack of them). */
  void check_unfixed_shape(const Param& param) const override;
  /** Also: no shard without HSDP. */
  void check_step_locally() override;
  /** With HSDP: throws for a param whose layout is not the one enable_hsdp planned its update for. */
  void check_layouts_as_planned() const;
  /** Under HSDP, one all-reduce over the mesh: the local failures, per HSDP param the ranks
   *  holding its grad (every rank steps the same HSDP params), and a digest of the settings that
   *  add collectives to a step (skip_nonfinite of any optimizer stepped with this one, a device
   *  budget), the groups, their options and
   *  step counts (every rank steps the same ones alike). */
  void agree_on_checks(std::exception_ptr local_failure, bool skips_nonfinite) override;
  // The bodies of the public update pieces, for the calls of a step, bare or swapped (its checks
  // covered them): the public ones first check that the params are of `group`, a hash lookup per
  // param.
  friend class MuonSwapAdapter;
  /** [matrices, rows, cols] of the stacked NS input of `params` (one core shape, at least one). */
  Shape ns_input_shape(const std::vector<Param*>& params) const;
  /** An uninitialised stacked NS input of `params`, in the group's NS dtype, on the step's stream. */
  Tensor new_ns_input(size_t group, const std::vector<Param*>& params);
  Tensor stacked_momentum(size_t group, const std::vector<Param*>& params);
  void chunk_momentum(size_t group, const Param& param, int64_t begin, int64_t end, const Tensor& staged_buffer,
                      const Tensor& out_input);
  void fill_momentum(size_t group, const std::vector<Param*>& params, const std::vector<Tensor>& out_inputs);
  void orthogonalize_and_apply(size_t group, const std::vector<Param*>& params, const Tensor& ns_input);
  void update_local(size_t group, const std::vector<Param*>& params, const MomentumWriter& write_momentum);
  void update_owned(const HsdpAssignment& assignment, const std::vector<Param*>& params,
                    const MomentumWriter& write_momentum);
  /** For the pieces that update params locally: none laid out for HSDP, none a shard. */
  void check_local(std::span<const Param* const> params, const char* call) const;
  /** For the public pieces, before any buffer is created or step counted: momentum_into's list
   *  of outputs (one per param, each of its param's numel), then the momentum op's memory checks
   *  of each param's grad, existing buffer and output (`out_inputs` null: new buffers, which
   *  share nothing). Without the op (momentum_update_fn) only the list is checked. */
  void check_momentum_operands(const std::vector<Param*>& params, const std::vector<Tensor>* out_inputs) const;
  /** wait_every(works); on a failure also consumes the stream's error (a Gloo wait task's). */
  void wait_collectives(const std::vector<WorkPtr>& works);

  MuonHooks hooks_;
  std::vector<MuonOptions> options_;
  std::unique_ptr<MeshGroups> mesh_groups_;  // with HSDP
  std::vector<HsdpAssignment> schedule_;
  std::unordered_map<const Param*, bool> keeps_state_;  // with HSDP: whether this rank owns each param
  /** A param's layout as enable_hsdp planned its update (none: updated locally). */
  struct PlannedLayout {
    bool present = false;
    Shape logical_shape;
    std::vector<Placement> placements;
    std::vector<int64_t> mesh_shape;
    int64_t mesh_rank = 0;
    static PlannedLayout of(const std::optional<DTensor>& layout);
    bool matches(const std::optional<DTensor>& layout) const;
    std::string str() const;
  };
  // With HSDP: the layout of each param enable_hsdp planned (those added later have none: a
  // param with a layout is refused then).
  std::unordered_map<const Param*, PlannedLayout> planned_layouts_;
  HsdpOptions hsdp_options_;
  std::vector<WorkPtr> step_collectives_;  // this step's collectives in issue order, for finish_hsdp_step
};

}  // namespace swapopt
