#include "swapopt/swap/swap_optimizer_set.h"

#include <algorithm>
#include <cctype>
#include <numeric>
#include <optional>
#include <set>
#include <unordered_map>

#include "../core/comma_list.h"
#include "../optim/checkpoint_stream.h"
#include "../optim/disjoint_params.h"
#include "../optim/member_checkpoint.h"
#include "async_save.h"
#include "budget_miss.h"
#include "swapopt/core/error.h"

namespace swapopt {

namespace {

bool valid_member_name(const std::string& name) {
  if (name.empty()) return false;
  for (char c : name)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

}  // namespace

SwapOptimizerSet::SwapOptimizerSet(std::vector<Member> members) : members_(std::move(members)) {
  SWAPOPT_CHECK(!members_.empty(), "[swap] a SwapOptimizerSet needs at least one member");
  std::set<std::string> names;
  for (const Member& m : members_) {
    SWAPOPT_CHECK(valid_member_name(m.first),
                  "[swap] member name '" << m.first << "' must be letters, digits, '_' or '-' (it prefixes checkpoint names)");
    SWAPOPT_CHECK(names.insert(m.first).second, "[swap] member name '" << m.first << "' is used twice");
    SWAPOPT_CHECK(m.second != nullptr, "[swap] member '" << m.first << "' is null");
    // One queue: the same handle on the same device (two borrow() wrappers of one cudaStream_t
    // are distinct Streams of one queue).
    const Stream &mine = m.second->optimizer().stream(), &first = members_.front().second->optimizer().stream();
    SWAPOPT_CHECK(mine.device() == first.device() && mine.native_handle() == first.native_handle(),
                  "[swap] member '" << m.first << "' runs on another stream than '" << members_.front().first
                                    << "': the members of a set share one stream");
  }
  // Each member updates its own params: one in two members, or two sharing memory, would be
  // updated twice per step.
  std::unordered_map<const Param*, const std::string*> member_of;
  std::vector<const Param*> all;
  for (const Member& m : members_)
    for (const ParamGroup& g : m.second->optimizer().param_groups())
      for (const ParamPtr& p : g.params) {
        const auto [it, added] = member_of.emplace(p.get(), &m.first);
        SWAPOPT_CHECK(added, "[swap] parameter '" << p->name << "' is in members '" << *it->second << "' and '"
                                                  << m.first << "': each param belongs to one member");
        all.push_back(p.get());
      }
  check_disjoint_params(all, "swap");
  // A set votes on the budget for all its members when one has one (SwapOptimizerSet::step).
  const bool budgeted = std::any_of(members_.begin(), members_.end(), [](const Member& m) {
    return m.second->runtime().config().device_budget_bytes.has_value();
  });
  for (Member& m : members_) m.second->optimizer().votes_on_budget_ = budgeted;
  last_to_run_ = members_.size() - 1;
}

SwapOptimizerSet::~SwapOptimizerSet() {
  if (save_) save_->wait_all();  // it reads the members' mirrors
}

void SwapOptimizerSet::step() {
  // Every member's save, schedule and checks before any member plans, as MuonWithAdamW::step()
  // does: a bad grad in one member leaves every member's options and flags as the bare step would.
  std::vector<Optimizer*> optimizers;
  for (Member& m : members_) optimizers.push_back(&m.second->optimizer());
  Optimizer::check_together(optimizers, [&] {
    if (save_ && save_->finished()) wait_save();  // a failed background save is reported before anything changes
    for (Member& m : members_) m.second->check_save();
    for (Optimizer* o : optimizers) o->apply_schedule();
    for (Optimizer* o : optimizers) o->check_step_locally();
  });
  // Then the members' votes and plans as one, so that every rank reaches the same collectives: a
  // non-finite grad in any member, on any rank, skips them all, and a plan failing on one rank
  // fails the step on all.
  std::vector<SwapOptimizer::PlannedStep> plans(members_.size());
  const bool skip = Optimizer::skip_together(optimizers);
  for (size_t i = 0; i < members_.size(); ++i) {
    plans[i].skip = skip;
    members_[i].second->stamp(plans[i]);
  }
  if (!skip) {
    // Every member plans, also after one misses its budget, so that the error names the least
    // budget that runs every member (the largest of theirs), not the first missing member's.
    const auto plan_all = [&] {
      std::optional<BudgetMiss> first;
      size_t least = 0;
      bool rank_local = false;
      for (size_t i = 0; i < members_.size(); ++i) {
        try {
          members_[i].second->plan_units(plans[i]);
        } catch (const BudgetMiss& miss) {
          if (!first) first = miss;
          least = std::max(least, miss.least());
          rank_local = rank_local || miss.rank_local();
        }
      }
      if (first) throw first->naming(least, rank_local);
      return false;
    };
    const auto budgeted = std::find_if(members_.begin(), members_.end(), [](const Member& m) {
      return m.second->runtime().config().device_budget_bytes.has_value();
    });
    if (budgeted == members_.end()) {
      plan_all();  // without a budget no plan fails
    } else {
      Optimizer::vote_together(optimizers, plan_all, budgeted->second->budget_elsewhere());
    }
  }
  // Members whose updates are collective run first: an unexpected failure (a CUDA error, memory
  // despite the budget) in a rank-local member then cannot leave the other ranks waiting in a
  // collective of this step that this rank never reaches. The members' params are disjoint, so
  // the order changes no result.
  std::vector<size_t> order(members_.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_partition(order.begin(), order.end(), [&](size_t i) { return optimizers[i]->spans_ranks(); });
  for (size_t i : order) members_[i].second->run_step(plans[i]);
  last_to_run_ = order.back();
}

void SwapOptimizerSet::set_skip_nonfinite(bool on) {
  for (Member& m : members_) m.second->optimizer().set_skip_nonfinite(on);
}

SwapStepReport SwapOptimizerSet::last_report() {
  SwapStepReport total;
  for (Member& m : members_) {
    const SwapStepReport r = m.second->last_report();
    total.batches += r.batches;
    total.chunked_units += r.chunked_units;
    total.h2d_bytes += r.h2d_bytes;
    total.d2h_bytes += r.d2h_bytes;
    total.h2d_copies += r.h2d_copies;
    total.d2h_copies += r.d2h_copies;
    total.swapped_slots += r.swapped_slots;
    total.state_bytes += r.state_bytes;
    // Unmeasured in any member (-1) makes the sum unmeasured too.
    total.exposed_wait_ms = total.exposed_wait_ms < 0 || r.exposed_wait_ms < 0 ? -1.0 : total.exposed_wait_ms + r.exposed_wait_ms;
    total.peak_resident_bytes = std::max(total.peak_resident_bytes, r.peak_resident_bytes);
    total.peak_workspace_bytes = std::max(total.peak_workspace_bytes, r.peak_workspace_bytes);
    total.early_prefetch_used = total.early_prefetch_used || r.early_prefetch_used;
    total.skipped_nonfinite = total.skipped_nonfinite || r.skipped_nonfinite;
  }
  return total;
}

void SwapOptimizerSet::zero_grad() {
  for (Member& m : members_) m.second->zero_grad();
}

void SwapOptimizerSet::prefetch_early() {
  for (Member& m : members_) m.second->prefetch_early();
}

void SwapOptimizerSet::synchronize() {
  for (Member& m : members_) m.second->synchronize();
}

std::vector<std::string> SwapOptimizerSet::member_names() const {
  std::vector<std::string> names;
  for (const Member& m : members_) names.push_back(m.first);
  return names;
}

std::string SwapOptimizerSet::optimizer_names() const {
  std::string names;
  for (const Member& m : members_) names += (names.empty() ? "" : "+") + m.second->optimizer().name();
  return names;
}

StateDict SwapOptimizerSet::state_dict() {
  return join_members<StateDict>(
      member_names(), [&](size_t i) { return members_[i].second->state_dict(); }, optimizer_names());
}

CheckpointSource SwapOptimizerSet::checkpoint_source(bool copy_device_state,
                                                      std::unordered_map<const SwapSlot*, std::string>* mirrors) {
  return join_members<CheckpointSource>(
      member_names(),
      [&](size_t i) {
        std::unordered_map<const SwapSlot*, std::string> part_mirrors;
        CheckpointSource part = members_[i].second->checkpoint_source(copy_device_state, &part_mirrors);
        if (mirrors != nullptr)
          for (auto& [slot, name] : part_mirrors) mirrors->emplace(slot, members_[i].first + "/" + name);
        return part;
      },
      optimizer_names());
}

void SwapOptimizerSet::save_checkpoint(const std::string& path) {
  for (Member& m : members_) m.second->runtime().wait_mirror_reader();  // one writer of a file at a time
  write_checkpoint(checkpoint_source(false, nullptr), path);
}

void SwapOptimizerSet::save_async(const std::string& path) {
  wait_save();
  std::unordered_map<const SwapSlot*, std::string> mirrors;
  CheckpointSource source = checkpoint_source(true, &mirrors);
  save_ = std::make_shared<AsyncSave>(std::move(source), std::move(mirrors), path);
  for (Member& m : members_) m.second->runtime().set_mirror_reader(save_);
}

void SwapOptimizerSet::wait_save() {
  if (!save_) return;
  const std::shared_ptr<AsyncSave> save = std::move(save_);
  for (Member& m : members_) m.second->runtime().clear_mirror_reader(save.get());
  save->wait();
}

void SwapOptimizerSet::load_state_dict(const StateDict& state) { load_from(reader_of(state)); }

void SwapOptimizerSet::load_checkpoint(const std::string& path, const CheckpointReadOptions& options) {
  for (Member& m : members_) m.second->runtime().wait_mirror_reader();  // a background save may be writing this file
  const CheckpointFile file(path, options);
  load_from(file.reader());
}

void SwapOptimizerSet::load_from(const CheckpointReader& checkpoint) {
  const std::vector<std::string> names = member_names();
  load_members(names, split_members(checkpoint, names, optimizer_names()),
               [&](size_t i, const CheckpointReader& part) { return members_[i].second->prepare_load(part); });
}

SwapOptimizer& SwapOptimizerSet::member(const std::string& name) {
  std::vector<std::string> names;
  for (Member& m : members_) {
    if (m.first == name) return *m.second;
    names.push_back(m.first);
  }
  SWAPOPT_FAIL("[swap] no member '" << name << "' in the set (its members: " << comma_list(names) << ")");
}

std::unique_ptr<SwapOptimizerSet> swap_muon_with_adamw(MuonWithAdamW& opt, SwapConfig config) {
  // Both halves checked before either is wrapped: wrapping fixes a half's param layouts for good.
  for (const Optimizer* half :
       {static_cast<const Optimizer*>(&opt.muon()), static_cast<const Optimizer*>(&opt.adamw())})
    SWAPOPT_CHECK(!half->wrapped(), "[swap] " << half->name() << " is already wrapped by a SwapOptimizer");
  SwapConfig muon_config = config, adamw_config = config;
  if (config.state_keys) {
    // Each half swaps the listed keys of its own family; a half none are listed for swaps nothing.
    config.validate();
    const std::vector<std::string> muon_keys = opt.muon().state_keys(), adamw_keys = opt.adamw().state_keys();
    muon_config.state_keys.emplace();
    adamw_config.state_keys.emplace();
    std::vector<std::string> neither;
    for (const std::string& key : *config.state_keys) {
      if (std::find(muon_keys.begin(), muon_keys.end(), key) != muon_keys.end()) {
        muon_config.state_keys->push_back(key);
      } else if (std::find(adamw_keys.begin(), adamw_keys.end(), key) != adamw_keys.end()) {
        adamw_config.state_keys->push_back(key);
      } else {
        neither.push_back(key);
      }
    }
    SWAPOPT_CHECK(neither.empty(), "[swap] state keys ["
                                       << comma_list(neither) << "] are neither Muon nor AdamW state; Muon "
                                       << "swaps [" << comma_list(muon_keys) << "], AdamW [" << comma_list(adamw_keys)
                                       << "]");
  }
  // Wrapping fixes a half's param layouts, also when the other half's wrap or the set then
  // refuses: the layouts fixed here are unfixed again, so that a refused call changes nothing.
  const std::vector<bool> muon_fixed = SwapOptimizerSet::fixed_layouts(opt.muon()),
                          adamw_fixed = SwapOptimizerSet::fixed_layouts(opt.adamw());
  try {
    std::vector<SwapOptimizerSet::Member> members;
    members.emplace_back("muon", swap_muon(opt.muon(), muon_config));
    members.emplace_back("adamw", swap_adamw(opt.adamw(), adamw_config));
    return std::make_unique<SwapOptimizerSet>(std::move(members));
  } catch (...) {  // the wrappers made are gone, their state handed back
    SwapOptimizerSet::unfix_layouts_since(opt.muon(), muon_fixed);
    SwapOptimizerSet::unfix_layouts_since(opt.adamw(), adamw_fixed);
    throw;
  }
}

std::vector<bool> SwapOptimizerSet::fixed_layouts(const Optimizer& optimizer) {
  std::vector<bool> fixed;
  for (const Optimizer::ParamRecord& record : optimizer.records_) fixed.push_back(record.fixed);
  return fixed;
}

void SwapOptimizerSet::unfix_layouts_since(Optimizer& optimizer, const std::vector<bool>& fixed_before) {
  for (size_t i = 0; i < fixed_before.size() && i < optimizer.records_.size(); ++i)
    if (!fixed_before[i]) optimizer.records_[i].fixed = false;
}

}  // namespace swapopt
