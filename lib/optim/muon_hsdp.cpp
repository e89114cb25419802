// HSDP Muon: the plan (enable_hsdp) and the update of one assignment, replicated or sharded.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>
#include <unordered_set>

#include "sum_over_ranks.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"
#include "swapopt/optim/muon.h"

namespace swapopt {

namespace {

/** Distinct per optimizer of one job (every rank creates its optimizers in the same order): the
 *  rendezvous prefix of its sub-groups. */
std::atomic<int> hsdp_instances{0};

bool is_shard(const Param& p) { return p.layout && p.data.shape() != p.logical_shape(); }

/** A shard updated without HSDP would be orthogonalised on its own. */
void check_not_shard(const Param& p) {
  SWAPOPT_CHECK(!is_shard(p), "[Muon] parameter '" << p.name << "' is a shard (" << shape_str(p.data.shape()) << " of "
                                                   << shape_str(p.logical_shape())
                                                   << "): call enable_hsdp so its update sees the whole matrix");
}

/** FNV-1a: the same 64 bits on every rank and host for the same text (std::hash promises neither). */
uint64_t fnv1a_64(const std::string& text) {
  uint64_t hash = 14695981039346656037ull;
  for (const unsigned char c : text) hash = (hash ^ c) * 1099511628211ull;
  return hash;
}

/** A setup every rank must share, voted on in a sum over the ranks: the 64 bits of its text's
 *  digest go after `votes`, one value each, so that every rank sends as many values. */
void push_digest_bits(std::vector<float>& votes, const std::string& setup) {
  const uint64_t digest = fnv1a_64(setup);
  for (int bit = 0; bit < 64; ++bit) votes.push_back(float((digest >> bit) & 1));
}

/** Whether the 64 digest bits from `at` of `sums` (push_digest_bits' votes summed over `ranks`
 *  ranks) agree: each bit is set on no rank or on all (exact in f32). */
bool digests_agree(const std::vector<float>& sums, size_t at, int ranks) {
  const auto bits = sums.begin() + std::ptrdiff_t(at);
  return std::all_of(bits, bits + 64, [&](float n) { return n == 0.f || n == float(ranks); });
}

}  // namespace

void Muon::check_local(std::span<const Param* const> params, const char* call) const {
  for (const Param* p : params) {
    SWAPOPT_CHECK(!(hsdp_enabled() && p->layout), "[Muon] " << call << ": parameter '" << p->name
                                                            << "' is laid out for HSDP: update_assignment updates it");
    check_not_shard(*p);
  }
}

std::vector<Param*> Muon::local_params(size_t group) const {
  std::vector<Param*> out;
  for (const ParamPtr& p : group_entry(groups_, group).params) {
    if (hsdp_enabled() && p->layout) continue;
    check_not_shard(*p);
    out.push_back(p.get());
  }
  return out;
}

int64_t Muon::assignment_workspace_bytes(const HsdpAssignment& a) const {
  const int64_t s = int64_t(dtype_size(ns_dtype(a.group)));
  const int64_t ranks = a.shards ? a.shards->size() : 1;
  int64_t total = 0;
  for (Param* p : a.params) {
    const int64_t logical = shape_numel(p->logical_shape()), local = p->data.numel();
    total += local * int64_t(p->data.element_size());  // its replicate broadcast buffer
    if (!a.owns(p)) continue;
    total += ns_workspace_bytes(core_shape(p->logical_shape()), s, device());  // NS of the full matrix
    if (a.sharded()) total += (ranks + 1) * local * s + logical * s + 512 * (ranks + 2);  // chunks, update, alignment
  }
  return total;
}

bool Muon::keeps_state(const Param& param) const {
  const auto found = keeps_state_.find(&param);  // a lookup: a checkpoint load asks for every tensor
  return found == keeps_state_.end() || found->second;
}

void Muon::enable_hsdp(std::shared_ptr<Communicator> world, HsdpOptions options) {
  SWAPOPT_CHECK(world != nullptr, "[Muon] enable_hsdp needs a communicator");
  // The checks are local; every rank learns whether all passed before the first collective (the
  // sub-groups' rendezvous), so that a rank refusing alone does not leave the others waiting there.
  const Param* first = nullptr;
  std::exception_ptr refused;
  // What every rank must agree on, compared by digest after the local checks: the options and
  // each param's place in the groups, dtype, logical shape and placements (the plan is made from
  // them; ranks differing would make different sub-groups and owners, and wait or skip updates).
  std::string options_text, layouts_text;
  size_t with_layout = 0;
  try {
    SWAPOPT_CHECK(!hsdp_enabled(), "[Muon] HSDP is already enabled");
    // The wrapper laid out its mirrors for every param, and a SwapOptimizerSet ordered its members,
    // before the step became collective.
    SWAPOPT_CHECK(!wrapped(),
                  "[Muon] enable_hsdp() on an optimizer wrapped by a SwapOptimizer: enable HSDP first, then "
                  "wrap the optimizer");
    options.validate();
    for (const ParamGroup& g : groups_)
      for (const ParamPtr& p : g.params) {
        if (!p->layout) continue;
        SWAPOPT_CHECK(p->data.shape() == p->layout->to_local().shape(),
                      "[Muon] enable_hsdp: parameter '" << p->name << "' holds " << shape_str(p->data.shape())
                                                        << " but its layout's local shard is "
                                                        << shape_str(p->layout->to_local().shape())
                                                        << " (data must be the shard its layout describes)");
        SWAPOPT_CHECK(p->layout->mesh().rank() == world->rank(), "[Muon] enable_hsdp: parameter '"
                                                                     << p->name << "' has the layout of mesh rank "
                                                                     << p->layout->mesh().rank() << ", this is rank "
                                                                     << world->rank() << " of the communicator");
        SWAPOPT_CHECK(state_.count(p.get()) == 0, "[Muon] enable_hsdp: parameter '"
                                                      << p->name
                                                      << "' has state already (a step or a load before): enable HSDP "
                                                         "before the first step, and load checkpoints after it");
        if (first == nullptr) first = p.get();
        SWAPOPT_CHECK(p->layout->mesh().shape() == first->layout->mesh().shape(),
                      "[Muon] enable_hsdp: parameter '" << p->name << "' is on a mesh of shape "
                                                        << shape_str(p->layout->mesh().shape()) << ", '" << first->name
                                                        << "' on " << shape_str(first->layout->mesh().shape())
                                                        << "; HSDP needs one mesh");
      }
    SWAPOPT_CHECK(first != nullptr, "[Muon] enable_hsdp: no parameter has a DTensor layout");
    // (not options.name: ranks sharing a process need names of their own)
    options_text = std::string("cap_bytes ") + std::to_string(options.cap_bytes) + ", replica_count " +
                   (options.replica_count ? std::to_string(*options.replica_count) : "unset") +
                   ", broadcast_buffer_bytes " + std::to_string(options.broadcast_buffer_bytes);
    for (size_t g = 0; g < groups_.size(); ++g)
      for (const ParamPtr& p : groups_[g].params) {
        // Appended piece by piece: GCC 12 warns (-Wrestrict, an error under werror) on "text" + string.
        layouts_text.append("; group ").append(std::to_string(g)).append(" '").append(p->name).append("' ");
        layouts_text.append(dtype_name(p->data.dtype()));
        if (!p->layout) continue;
        ++with_layout;
        layouts_text.append(" ").append(shape_str(p->layout->logical_shape()));
        layouts_text.append(" mesh ").append(shape_str(p->layout->mesh().shape()));
        int64_t replicas = 1;
        for (const int64_t d : p->layout->replicate_dims()) replicas *= p->layout->mesh().size(d);
        for (const Placement& placement : p->layout->placements()) layouts_text.append(" ").append(placement.str());
        // Checked here, not in the plan below: a rank refusing there would leave the others
        // waiting in the sub-groups' rendezvous.
        const int64_t block = options.replica_count ? std::min(*options.replica_count, replicas) : replicas;
        SWAPOPT_CHECK(replicas % block == 0, "[Muon] HsdpOptions::replica_count "
                                                 << *options.replica_count << " must divide the " << replicas
                                                 << " replicas of parameter '" << p->name << "'");
      }
  } catch (...) {
    refused = std::current_exception();
  }
  std::vector<float> digest;
  push_digest_bits(digest, options_text + layouts_text);
  const auto sum = [&](std::vector<float> values) {
    return world->size() > 1 ? sum_over_ranks(*world, device(), values) : values;
  };
  digest = vote_on_checks(sum, refused, digest, "[Muon] enable_hsdp", "HSDP is not enabled");
  // Every rank sees the same sums: a bit set on some ranks but not all is a difference.
  SWAPOPT_CHECK(digests_agree(digest, 0, world->size()),
                "[Muon] enable_hsdp: the ranks' setups differ (this rank: "
                    << options_text << "; " << with_layout
                    << " params with layouts): every rank must pass the same HsdpOptions, with the same params "
                       "(names, groups, dtypes, logical shapes, placements): HSDP is not enabled");
  const int instance = hsdp_instances++;  // counted whether named or not, so ranks stay in step
  auto mesh_groups = std::make_unique<MeshGroups>(world, first->layout->mesh_ptr(),
                                                  options.name.empty() ? "hsdp" + std::to_string(instance) : options.name);

  // Per group, per domain (replicate and shard mesh dims, in order of first appearance): assignments.
  std::vector<std::vector<std::vector<HsdpAssignment>>> plans(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    struct Domain {
      std::vector<int64_t> replicate, shard;
      std::vector<Param*> params;
    };
    std::vector<Domain> domains;
    for (const ParamPtr& p : groups_[g].params) {
      if (!p->layout) continue;
      const std::vector<int64_t> replicate = p->layout->replicate_dims(), shard = p->layout->shard_dims();
      auto it = std::find_if(domains.begin(), domains.end(),
                             [&](const Domain& d) { return d.replicate == replicate && d.shard == shard; });
      if (it == domains.end()) it = domains.insert(domains.end(), Domain{replicate, shard, {}});
      it->params.push_back(p.get());
    }
    for (const Domain& d : domains) {
      const int64_t replicas = mesh_groups->size(d.replicate);
      const int64_t block =
          options.replica_count ? std::min(*options.replica_count, replicas) : replicas;  // divides (checked)
      // A shard group of one rank holds whole tensors: the param is replicated in effect.
      const int64_t shard_ranks = mesh_groups->size(d.shard);
      std::vector<HsdpAssignment> assignments = make_hsdp_assignments(
          g, d.params, block, mesh_groups->index(d.replicate) % block, options.cap_bytes, shard_ranks);
      std::shared_ptr<Communicator> replica_group = block > 1 ? mesh_groups->group(d.replicate, block) : nullptr;
      std::shared_ptr<Communicator> shard_group = shard_ranks > 1 ? mesh_groups->group(d.shard, shard_ranks) : nullptr;
      for (HsdpAssignment& a : assignments) {
        a.replicas = replica_group;
        a.shards = shard_group;
        if (shard_group)
          for (int64_t s = 0; s < shard_ranks; ++s) a.shard_coordinates.push_back(mesh_groups->coordinate_at(d.shard, s));
      }
      plans[g].push_back(std::move(assignments));
    }
  }
  // Schedule: for each assignment index, each group, each domain.
  std::vector<HsdpAssignment> schedule;
  for (size_t b = 0;; ++b) {
    bool any = false;
    for (auto& domains : plans)
      for (auto& assignments : domains)
        if (b < assignments.size()) {
          schedule.push_back(std::move(assignments[b]));
          any = true;
        }
    if (!any) break;
  }
  mesh_groups_ = std::move(mesh_groups);
  schedule_ = std::move(schedule);
  for (const HsdpAssignment& a : schedule_)
    for (size_t i = 0; i < a.params.size(); ++i) {
      keeps_state_[a.params[i]] = a.owners[i] == a.local_coordinate;
      fix_layout(*a.params[i]);  // planned for its shard as it is now (checked above), on every rank
    }
  for (const ParamGroup& g : groups_)
    for (const ParamPtr& p : g.params) planned_layouts_.emplace(p.get(), PlannedLayout::of(p->layout));
  hsdp_options_ = options;
}

Muon::PlannedLayout Muon::PlannedLayout::of(const std::optional<DTensor>& layout) {
  if (!layout) return {};
  return {true, layout->logical_shape(), layout->placements(), layout->mesh().shape(), layout->mesh().rank()};
}

bool Muon::PlannedLayout::matches(const std::optional<DTensor>& layout) const {
  if (!layout) return !present;
  return present && layout->logical_shape() == logical_shape && layout->placements() == placements &&
         layout->mesh().shape() == mesh_shape && layout->mesh().rank() == mesh_rank;
}

std::string Muon::PlannedLayout::str() const {
  if (!present) return "none";
  std::string text =
      shape_str(logical_shape) + " on mesh " + shape_str(mesh_shape) + " (rank " + std::to_string(mesh_rank) + "):";
  for (const Placement& placement : placements) text.append(" ").append(placement.str());
  return text;
}

void Muon::check_layouts_as_planned() const {
  if (!hsdp_enabled()) return;
  static const PlannedLayout none;
  for (const ParamGroup& g : groups_)
    for (const ParamPtr& p : g.params) {
      const auto it = planned_layouts_.find(p.get());
      const PlannedLayout& planned = it == planned_layouts_.end() ? none : it->second;
      if (planned.matches(p->layout)) continue;
      SWAPOPT_FAIL("[Muon] parameter '" << p->name << "' has layout " << PlannedLayout::of(p->layout).str()
                                        << ", enable_hsdp planned its update for " << planned.str()
                                        << ": a param's layout is fixed once HSDP is enabled");
    }
}

void Muon::update_assignment(const HsdpAssignment& assignment, const std::vector<Param*>& params,
                             const MomentumWriter& write_momentum) {
  check_update_call(assignment.group, params, "update_assignment");
  const std::unordered_set<const Param*> in_assignment(assignment.params.begin(), assignment.params.end());
  for (const Param* p : params)
    SWAPOPT_CHECK(in_assignment.count(p) == 1,
                  "[Muon] update_assignment: parameter '" << p->name << "' is not in the assignment");
  if (!write_momentum) check_momentum_operands(params, nullptr);
  update_owned(assignment, params, write_momentum);
}

void Muon::update_owned(const HsdpAssignment& assignment, const std::vector<Param*>& params,
                        const MomentumWriter& write_momentum) {
  if (assignment.sharded()) {
    update_sharded(assignment, params, write_momentum);
  } else {
    update_local(assignment.group, params, write_momentum);
  }
}

std::vector<float> Muon::sum_over_step_ranks(std::vector<float> values) {
  if (!hsdp_enabled()) return values;
  return sum_over_ranks(mesh_groups_->world(), device(), values);
}

bool Muon::spans_ranks() const { return hsdp_enabled() && mesh_groups_->world().size() > 1; }

void Muon::agree_on_checks(std::exception_ptr local_failure, bool skips_nonfinite) {
  if (!spans_ranks()) return;
  // One all-reduce over the mesh: how many ranks failed their local checks, and per HSDP param how
  // many hold its grad (exact in f32). A check failing on one rank then fails the step on every
  // rank before any of them starts the update's collectives (which would wait for it). Every rank
  // must step the same HSDP params: the packing of update_sharded depends on it, and an owner
  // without a grad would leave its replicas' param as it was while theirs has a grad.
  // The step's settings, the groups, their options and step counts go in too, as the 64 bits of
  // one digest (a bit's count is 0 or every rank when all agree; one digest, so that every rank
  // sends as many values whatever its groups): ranks stepping a shard with another lr would leave
  // a param that no single-process step computes. An error describing them counts as a failed
  // local check.
  Communicator& world = mesh_groups_->world();
  std::string setup;
  try {
    // The settings that add collectives to a step come first: ranks differing there would issue
    // different collectives after this one.
    setup = std::string("skip_nonfinite ") + (skips_nonfinite ? "on" : "off") + ", device budget " +
            (votes_on_budget() ? "set" : "unset") + "; " + std::to_string(param_groups().size()) +
            (param_groups().size() == 1 ? " group" : " groups");
    for (size_t g = 0; g < param_groups().size(); ++g)
      setup += "; group " + std::to_string(g) + ": steps taken " + std::to_string(param_groups()[g].step) +
               ", options " + group_options_json(g);
  } catch (...) {
    if (!local_failure) local_failure = std::current_exception();
  }
  std::vector<const Param*> params;
  std::vector<float> counts = {local_failure ? 1.f : 0.f};
  for (const HsdpAssignment& a : schedule_)
    for (const Param* p : a.params) {
      params.push_back(p);
      counts.push_back(p->has_grad() ? 1.f : 0.f);
    }
  const size_t digest_at = counts.size();
  push_digest_bits(counts, setup);
  counts = sum_over_step_ranks(std::move(counts));
  if (local_failure) std::rethrow_exception(local_failure);
  SWAPOPT_CHECK(counts[0] == 0.f, "[Muon] the step's checks failed on " << counts[0] << " of " << world.size()
                                                                        << " ranks (their errors say why): the step "
                                                                           "changed nothing");
  SWAPOPT_CHECK(digests_agree(counts, digest_at, world.size()),
                "[Muon] the ranks' settings, param groups, options or step counts differ (this rank: "
                    << setup << "): every HSDP rank must step the same groups with the same options and settings");
  for (size_t i = 0; i < params.size(); ++i)
    SWAPOPT_CHECK(counts[i + 1] == 0.f || counts[i + 1] == float(world.size()),
                  "[Muon] '" << params[i]->name << "' has a grad on " << counts[i + 1] << " of " << world.size()
                             << " ranks (a grad is missing on some ranks): every HSDP rank must step the same params");
}

void Muon::update_sharded(const HsdpAssignment& a, const std::vector<Param*>& params, const MomentumWriter& write_momentum) {
  if (a.owned().empty()) return;  // this replica owns nothing here, and so does its whole shard group
  const DType dtype = ns_dtype(a.group);
  Communicator& shards = *a.shards;
  const size_t ranks = size_t(shards.size()), me = size_t(shards.rank());

  std::vector<size_t> position(params.size());  // of params[i] in the assignment
  for (size_t i = 0; i < params.size(); ++i)
    position[i] = size_t(std::find(a.params.begin(), a.params.end(), params[i]) - a.params.begin());
  if (params.empty()) return;

  // Rank-independent packing. Each rank's chunk holds its shard of every param; the update buffer
  // of rank r holds the full update of every param whose NS rank is r.
  struct Piece {
    Shape shape, offset;  // the shard of one rank and its place in the logical tensor
    int64_t packed = 0;   // element offset in that rank's chunk
  };
  std::vector<std::vector<Piece>> pieces(params.size(), std::vector<Piece>(ranks));
  std::vector<int64_t> chunk_used(ranks, 0), update_used(ranks, 0);
  std::vector<int64_t> ns_rank(params.size()), update_offset(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = *params[i];
    for (size_t s = 0; s < ranks; ++s) {
      Piece& piece = pieces[i][s];
      piece.shape = DTensor::local_shape_at(p.logical_shape(), p.layout->mesh(), p.layout->placements(),
                                            a.shard_coordinates[s], &piece.offset);
      piece.packed = chunk_used[s];
      chunk_used[s] = align_to_512_bytes(chunk_used[s] + shape_numel(piece.shape), dtype);
    }
    ns_rank[i] = a.ns_ranks[position[i]];
    update_offset[i] = update_used[size_t(ns_rank[i])];
    update_used[size_t(ns_rank[i])] = align_to_512_bytes(update_offset[i] + shape_numel(p.logical_shape()), dtype);
  }
  const int64_t chunk = *std::max_element(chunk_used.begin(), chunk_used.end());

  // Momentum of the local shards into this rank's chunk, then the all-gather of every chunk.
  Tensor send = Tensor::empty({chunk}, dtype, device(), &stream_);
  Tensor gathered = Tensor::empty({chunk * int64_t(ranks)}, dtype, device(), &stream_);
  std::vector<Tensor> inputs;
  for (size_t i = 0; i < params.size(); ++i)
    inputs.push_back(send.narrow(0, pieces[i][me].packed, params[i]->data.numel()).view(params[i]->data.shape()));
  if (write_momentum) {
    write_momentum(params, inputs);
  } else {
    fill_momentum(a.group, params, inputs);
  }
  shards.start_after(stream_);  // the all-gather reads `send`
  step_collectives_.push_back(shards.all_gather(send, gathered));
  step_collectives_.back()->finish_before(stream_);  // NS reads `gathered`; both are freed in order after it

  // Whole matrices assembled from the shards, orthogonalised by their NS rank.
  std::vector<Tensor> updates(ranks);
  for (size_t r = 0; r < ranks; ++r) updates[r] = Tensor::empty({update_used[r]}, dtype, device(), &stream_);
  auto full_update = [&](size_t i) {
    const Shape& logical = params[i]->logical_shape();
    return updates[size_t(ns_rank[i])].narrow(0, update_offset[i], shape_numel(logical)).view(logical);
  };
  for (size_t i = 0; i < params.size(); ++i) {
    if (size_t(ns_rank[i]) != me) continue;
    const Tensor full = full_update(i);
    for (size_t s = 0; s < ranks; ++s) {
      const Piece& piece = pieces[i][s];
      const Tensor shard =
          gathered.narrow(0, int64_t(s) * chunk + piece.packed, shape_numel(piece.shape)).view(piece.shape);
      ops::copy(stream_, shard, full.block(piece.offset, piece.shape));
    }
    const CoreShape cs = core_shape(full.shape());
    orthogonalize(a.group, full.view({cs.count, cs.rows, cs.cols}));
  }
  std::vector<Tensor> sent;
  std::vector<int> roots;
  for (size_t r = 0; r < ranks; ++r)
    if (update_used[r] > 0) {
      sent.push_back(updates[r]);
      roots.push_back(int(r));
    }
  shards.start_after(stream_);  // the broadcasts read the updates
  step_collectives_.push_back(shards.broadcast_many(sent, roots));
  step_collectives_.back()->finish_before(stream_);  // the slices below read them

  // Every rank applies its own slice.
  for (size_t i = 0; i < params.size(); ++i) {
    Param& p = *params[i];
    Tensor slice = full_update(i).block(pieces[i][me].offset, pieces[i][me].shape);
    if (!slice.is_contiguous()) {
      Tensor packed = Tensor::empty(slice.shape(), dtype, device(), &stream_);
      ops::copy(stream_, slice, packed);
      slice = packed;
    }
    apply_update(a.group, p, slice, core_shape(p.logical_shape()));
  }
}

void Muon::finish_assignment(const HsdpAssignment& assignment, AsyncReplicateBroadcaster& broadcaster,
                             const std::vector<Param*>& owned_with_grad) {
  run_post_update(assignment.group, owned_with_grad);
  WorkPtr broadcasts = broadcaster.flush(assignment);  // packs on stream_, after the update and the hooks
  if (broadcasts) step_collectives_.push_back(std::move(broadcasts));
}

void Muon::wait_collectives(const std::vector<WorkPtr>& works) {
  // In issue order: the first incomplete one is always running or about to (an NCCL timeout
  // counts from when the collective starts), each waited even after another failed (a stuck one
  // is aborted, and the streams waiting on it released, only by its own wait's timeout).
  try {
    wait_every(works);
  } catch (...) {
    try {
      stream_.synchronize();  // a CPU stream's task that waited on a failed collective holds its error
    } catch (...) {
    }
    throw;
  }
}

void Muon::finish_hsdp_step(AsyncReplicateBroadcaster& broadcaster) {
  std::exception_ptr first;
  try {
    broadcaster.finish();
  } catch (...) {
    first = std::current_exception();
  }
  // Moved out first: none of this step's collectives is left to a later step.
  const std::vector<WorkPtr> works = std::move(step_collectives_);
  step_collectives_.clear();
  try {
    wait_collectives(works);
  } catch (...) {
    if (!first) first = std::current_exception();
  }
  if (first) std::rethrow_exception(first);
}

void Muon::abandon_hsdp_step(AsyncReplicateBroadcaster& broadcaster) noexcept {
  try {
    finish_hsdp_step(broadcaster);
  } catch (...) {  // the step already failed; its error is the one that propagates
  }
}

}  // namespace swapopt
