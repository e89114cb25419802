#include "swapopt/optim/optimizer.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#include "../core/comma_list.h"
#include "../core/operand_overlap.h"
#include "checkpoint_stream.h"
#include "disjoint_params.h"
#include "json.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"

namespace swapopt {

Optimizer::Optimizer(std::string name, Stream stream)
    : name_(std::move(name)),
      stream_(std::move(stream)),
      grads_read_(stream_.device()),
      params_updated_(stream_.device()),
      retired_mark_(stream_.device()) {}

Optimizer::~Optimizer() {
  if (retired_grads_.empty()) return;
  try {
    retired_mark_.synchronize();
  } catch (const std::exception& e) {  // a failed stream: its work is not running any more either
    std::fprintf(stderr, "swapopt: waiting for the optimizer's stream failed: %s\n", e.what());
  }
}

void Optimizer::release_retired_grads() {
  if (!retired_grads_.empty() && retired_mark_.query()) retired_grads_.clear();
}

void Optimizer::synchronize() {
  stream_.synchronize();
  retired_grads_.clear();
}

void Optimizer::step() {
  release_retired_grads();
  check_unwrapped("step()");
  Optimizer* self = this;
  check_together({&self, 1}, [this] {
    apply_schedule();
    check_step_locally();
  });
  last_step_skipped_ = skip_this_step();
  if (!last_step_skipped_) run_step();
  record_step_events();
}

bool Optimizer::skip_this_step() {
  Optimizer* self = this;
  return skip_together({&self, 1});
}

bool Optimizer::skip_together(std::span<Optimizer* const> optimizers) {
  // skip_nonfinite() is the same on every rank (the trainer's setting): all vote or none.
  if (std::none_of(optimizers.begin(), optimizers.end(), [](const Optimizer* o) { return o->skip_nonfinite_; }))
    return false;
  return vote_together(
      optimizers,
      [&] {
        bool nonfinite = false;
        for (Optimizer* o : optimizers) nonfinite = (o->skip_nonfinite_ && o->grads_nonfinite_locally()) || nonfinite;
        return nonfinite;
      },
      "[" + optimizers.front()->name_ + "] the non-finite grad check failed on another rank (its error says why)");
}

bool Optimizer::grads_nonfinite() {
  Optimizer* self = this;
  return vote_together(
      {&self, 1}, [this] { return grads_nonfinite_locally(); },
      "[" + name_ + "] the non-finite grad check failed on another rank (its error says why)");
}

bool Optimizer::vote_together(std::span<Optimizer* const> optimizers, const std::function<bool()>& local,
                              const std::string& elsewhere) {
  bool mine = false;
  std::exception_ptr failure;
  try {
    mine = local();
  } catch (...) {
    failure = std::current_exception();
  }
  std::vector<float> votes = {mine ? 1.f : 0.f, failure ? 1.f : 0.f};
  for (Optimizer* o : optimizers) {
    votes = o->sum_over_step_ranks(votes);
    for (float& v : votes) v = v != 0.f ? 1.f : 0.f;  // summed again over the next one's ranks
  }
  if (failure) std::rethrow_exception(failure);
  SWAPOPT_CHECK(votes[1] == 0.f, elsewhere);
  return votes[0] != 0.f;
}

bool Optimizer::grads_nonfinite_locally() {
  const Tensor flag = Tensor::empty({1}, DType::f32, device(), &stream_);
  ops::fill_zero(stream_, flag);
  for (const ParamGroup& g : groups_)
    for (const ParamPtr& p : g.params)
      if (p->has_grad()) ops::flag_nonfinite(stream_, p->grad, flag);
  stream_.synchronize();
  return flag.to_float_vector()[0] != 0.f;
}

void Optimizer::apply_schedule() {
  check_step_counts();  // before the schedule counts one more
  if (schedule_) schedule_(groups_.empty() ? 1 : groups_.front().step + 1);
}

void Optimizer::record_step_events() {
  // Every grad read and param write of a step is on stream_ (HSDP's collectives read and write
  // packed buffers only; stream_ waits for them and copies their results), so its end is both points.
  grads_read_.record(stream_);
  params_updated_.record(stream_);
}

void Optimizer::check_disjoint(const std::vector<ParamPtr>& added) const {
  std::vector<const Param*> params;
  for (const ParamGroup& g : groups_)
    for (const ParamPtr& p : g.params) params.push_back(p.get());
  for (const ParamPtr& p : added) params.push_back(p.get());
  check_disjoint_params(params, name_);
}

void Optimizer::add_group(std::vector<ParamPtr> params) {
  SWAPOPT_CHECK(!wrapped_,
                "[" << name_
                    << "] add_param_group() on an optimizer wrapped by a SwapOptimizer: its host "
                       "mirrors hold the state of the params it had when wrapped (drop the wrapper, add the group, "
                       "wrap it again)");
  // Checked against the params of earlier groups and of this one; nothing changes until all pass.
  std::unordered_set<const Param*> seen;
  std::unordered_set<std::string> names;  // checkpoints name each param's state by its name
  for (const ParamPtr& p : params) {
    SWAPOPT_CHECK(p != nullptr, "[" << name_ << "] null parameter");
    SWAPOPT_CHECK(param_indices_.count(p.get()) == 0,
                  "[" << name_ << "] parameter '" << p->name << "' is in more than one group");
    SWAPOPT_CHECK(seen.insert(p.get()).second,
                  "[" << name_ << "] parameter '" << p->name << "' is listed twice in the group");
    SWAPOPT_CHECK(!p->name.empty(), "[" << name_ << "] a parameter has no name (checkpoints name each param's state)");
    SWAPOPT_CHECK(json::is_utf8(p->name), "[" << name_ << "] parameter name '" << p->name
                                              << "' is not valid UTF-8 (checkpoints store names as JSON text)");
    SWAPOPT_CHECK(param_names_.count(p->name) == 0 && names.insert(p->name).second,
                  "[" << name_ << "] two parameters are named '" << p->name << "' (checkpoints name each param's state)");
    SWAPOPT_CHECK(p->data.defined() && p->data.is_contiguous(),
                  "[" << name_ << "] parameter '" << p->name << "' must be a defined contiguous tensor");
    SWAPOPT_CHECK(!p->data.is_released(),
                  "[" << name_ << "] parameter '" << p->name << "' has no data (its storage is released)");
    SWAPOPT_CHECK(p->data.device() == device(), "[" << name_ << "] parameter '" << p->name << "' is on "
                                                    << p->data.device().str() << ", the optimizer on " << device().str());
  }
  check_disjoint(params);
  int64_t index = int64_t(param_indices_.size());
  for (const ParamPtr& p : params) {
    param_indices_.emplace(p.get(), index++);
    param_names_.insert(p->name);
    records_.push_back({p.get(), groups_.size(), p->name, false, {}, DType::f32});  // fixed later: fix_layout()
  }
  groups_.push_back({std::move(params), 0});
}

void Optimizer::check_params_with_grad() const {
  size_t index = 0;
  for (const ParamGroup& group : groups_)
    for (const ParamPtr& p : group.params) {
      // param_groups() is mutable: a param put there directly never passed add_param_group().
      SWAPOPT_CHECK(index < records_.size() && records_[index].param == p.get(),
                    "[" << name_ << "] parameter '" << (p ? p->name : std::string("null"))
                        << "' was put into param_groups() directly: add params with add_param_group()");
      const ParamRecord& record = records_[index++];
      if (p->has_grad()) check_param_with_grad(*p, record);
    }
}

void Optimizer::check_param_data(const Param& p, const ParamRecord& record) const {
  // Built only for a message: a step checks every param.
  const auto param = [&] { return "[" + name_ + "] parameter '" + p.name + "'"; };
  const Tensor& d = p.data;
  SWAPOPT_CHECK(d.defined() && !d.is_released(), param() << " has no data (undefined or released)");
  check_layout(p, record);
  SWAPOPT_CHECK(d.device() == device(),
                param() << " is on " << d.device().str() << ", the optimizer on " << device().str());
  SWAPOPT_CHECK(d.is_contiguous(), param() << " must be contiguous, got strides " << shape_str(d.strides()));
}

void Optimizer::check_param_with_grad(const Param& p, const ParamRecord& record) const {
  check_param_data(p, record);
  const Tensor& d = p.data;
  const Tensor& g = p.grad;
  const auto grad = [&] { return "[" + name_ + "] grad of '" + p.name + "'"; };
  SWAPOPT_CHECK(!g.is_released(), grad() << " is released");
  SWAPOPT_CHECK(g.device() == device(),
                grad() << " is on " << g.device().str() << ", the optimizer on " << device().str());
  SWAPOPT_CHECK(g.shape() == d.shape(), grad() << " is " << g.str() << ", the param " << d.str());
  SWAPOPT_CHECK(g.is_contiguous(), grad() << " must be contiguous, got strides " << shape_str(g.strides()));
}

void Optimizer::check_layout(const Param& p, const ParamRecord& record) const {
  const Tensor& d = p.data;
  if (!record.fixed) return check_unfixed_shape(p);
  SWAPOPT_CHECK(d.shape() == record.shape && d.dtype() == record.dtype,
                "[" << name_ << "] parameter '" << p.name << "' is " << d.str() << ", its state was laid out for "
                    << dtype_name(record.dtype) << " " << shape_str(record.shape)
                    << ": data may point at another buffer of that shape and dtype, not be reshaped or cast");
}

void Optimizer::check_layouts() const {
  for (const ParamRecord& record : records_) check_layout(*record.param, record);
}

void Optimizer::check_in_group(size_t group, std::span<const Param* const> params, const char* call) const {
  SWAPOPT_CHECK(group < groups_.size(), "[" << name_ << "] " << call << ": no group " << group << " (" << groups_.size()
                                            << (groups_.size() == 1 ? " group)" : " groups)"));
  for (const Param* p : params) {
    SWAPOPT_CHECK(p != nullptr, "[" << name_ << "] " << call << ": null parameter");
    const auto it = param_indices_.find(p);
    SWAPOPT_CHECK(it != param_indices_.end(),
                  "[" << name_ << "] " << call << ": parameter '" << p->name << "' is not in this optimizer");
    const size_t in = records_[size_t(it->second)].group;
    SWAPOPT_CHECK(in == group, "[" << name_ << "] " << call << ": parameter '" << p->name << "' is in group " << in
                                   << ", not group " << group);
  }
}

void Optimizer::check_group_index(size_t group, size_t groups) const {
  if (group >= groups)
    throw std::out_of_range("[" + name_ + "] no group " + std::to_string(group) + " (" + std::to_string(groups) +
                            (groups == 1 ? " group)" : " groups)"));
}

void Optimizer::check_update_call(size_t group, std::span<const Param* const> params, const char* call,
                                  bool counts_step) const {
  SWAPOPT_CHECK(!wrapped_ || in_swapped_step_,
                "[" << name_ << "] " << call
                    << "() on an optimizer wrapped by a SwapOptimizer, outside its step: the "
                       "state lives in the wrapper's host mirrors, and the wrapper's step() "
                       "updates the params");
  validate_options();
  check_in_group(group, params, call);
  check_listed_once(params, call);
  for (const Param* p : params) {
    SWAPOPT_CHECK(p->has_grad(), "[" << name_ << "] " << call << ": parameter '" << p->name << "' has no grad");
    check_param_with_grad(*p, records_[size_t(param_indices_.at(p))]);
    if (!counts_step) continue;
    const auto state = state_.find(p);
    SWAPOPT_CHECK(state == state_.end() || state->second.step < std::numeric_limits<int64_t>::max() - 1,
                  "[" << name_ << "] " << call << ": parameter '" << p->name << "' has taken " << state->second.step
                      << " steps: no update can follow it");
  }
}

void Optimizer::check_listed_once(std::span<const Param* const> params, const char* call) const {
  // A param listed twice would be updated twice (in one fused op, racing with itself).
  std::vector<const Param*> listed(params.begin(), params.end());
  std::sort(listed.begin(), listed.end(), std::less<>());
  const auto twice = std::adjacent_find(listed.begin(), listed.end());
  SWAPOPT_CHECK(twice == listed.end(),
                "[" << name_ << "] " << call << ": parameter '" << (*twice)->name << "' is listed twice");
}

void Optimizer::check_params_call(size_t group, std::span<const Param* const> params, const char* call) const {
  check_in_group(group, params, call);
  check_listed_once(params, call);
  for (const Param* p : params) check_param_data(*p, records_[size_t(param_indices_.at(p))]);
}

void Optimizer::count_update(size_t group, ParamState& state) {
  state.step += 1;
  groups_[group].step = std::max(groups_[group].step, state.step);
}

void Optimizer::check_chunk_start(const Param& param, int64_t begin, int64_t end, const char* call) const {
  const auto state = state_.find(&param);
  SWAPOPT_CHECK(begin == 0 || (state != state_.end() && state->second.step > 0),
                "[" << name_ << "] " << call << ": chunk [" << begin << ", " << end << ") of '" << param.name
                    << "' before its first update's chunk at 0 (that chunk counts the step)");
}

void Optimizer::fix_layout(const Param& param) { fix_layout(records_[size_t(param_index(&param))]); }

void Optimizer::fix_layout(ParamRecord& record) {
  if (record.fixed) return;
  record.fixed = true;
  record.shape = record.param->data.shape();
  record.dtype = record.param->data.dtype();
}

void Optimizer::set_wrapped(bool wrapped) {
  wrapped_ = wrapped;
  wrapped_state_keys_.clear();
  if (!wrapped) return;
  for (ParamRecord& record : records_) fix_layout(record);
  for (size_t g = 0; g < groups_.size(); ++g) wrapped_state_keys_.push_back(group_state_keys(g));
}

void Optimizer::check_keys_fit_wrapper(size_t group, const std::vector<std::string>& keys, const std::string& what,
                                       const char* remedy) const {
  if (wrapped_state_keys_.empty()) return;
  // Fewer keys leave some mirrors unused; a key without mirrors would stay on the device.
  const std::vector<std::string>& laid_out = wrapped_state_keys_.at(group);
  for (const std::string& key : keys)
    SWAPOPT_CHECK(std::find(laid_out.begin(), laid_out.end(), key) != laid_out.end(),
                  "[" << name_ << "] " << what << ": group " << group << " would keep state [" << comma_list(keys)
                      << "], and the SwapOptimizer wrapping it laid out host mirrors only for [" << comma_list(laid_out)
                      << "] (" << remedy << ")");
}

void Optimizer::zero_grad() {
  release_retired_grads();
  bool dropped = false;
  for (ParamGroup& g : groups_)
    for (ParamPtr& p : g.params)
      if (p->grad.defined()) {
        retired_grads_.push_back(std::move(p->grad));
        p->grad = Tensor();
        dropped = true;
      }
  if (dropped) retired_mark_.record(stream_);  // a later mark covers the earlier retired grads too
}

void Optimizer::check_unwrapped(const std::string& call) const {
  SWAPOPT_CHECK(!wrapped_, "[" << name_ << "] " << call << " on an optimizer wrapped by a SwapOptimizer: call the wrapper's "
                               << call << " (the state lives in its host mirrors)");
}

void Optimizer::check_step() {
  Optimizer* self = this;
  check_together({&self, 1}, [this] { check_step_locally(); });
}

void Optimizer::check_step_locally() {
  validate_options();
  check_step_counts();
  check_params_with_grad();
}

void Optimizer::check_step_counts() const {
  // A checkpoint loads steps up to INT64_MAX - 1: the step to INT64_MAX would write one that no
  // load takes, and the one after would overflow.
  for (size_t g = 0; g < groups_.size(); ++g)
    SWAPOPT_CHECK(groups_[g].step < std::numeric_limits<int64_t>::max() - 1, "[" << name_ << "] group " << g
                                                                                 << " has taken " << groups_[g].step
                                                                                 << " steps: no step can follow it");
}

namespace {
/** The params of optimizers checked together, and their names joined for errors ("Muon+AdamW"). */
std::pair<std::vector<const Param*>, std::string> params_of(std::span<Optimizer* const> optimizers) {
  std::pair<std::vector<const Param*>, std::string> out;
  for (const Optimizer* o : optimizers) {
    for (const ParamGroup& group : o->param_groups())
      for (const ParamPtr& p : group.params) out.first.push_back(p.get());
    out.second += (out.second.empty() ? "" : "+") + o->name();
  }
  return out;
}
}  // namespace

void Optimizer::check_moved_params_disjoint(std::span<Optimizer* const> optimizers) {
  const auto begin_of = [](const Tensor& data) -> const void* {
    return data.defined() && !data.is_released() ? data.data_ptr() : nullptr;
  };
  const auto nbytes_of = [](const Tensor& data) { return data.defined() ? data.nbytes() : size_t(0); };
  // The marks hold for the optimizers checked together: a check of fewer (one half of a
  // MuonWithAdamW) says nothing of memory shared with the others.
  const std::vector<const Optimizer*> scope(optimizers.begin(), optimizers.end());
  bool moved = false;
  for (const Optimizer* o : optimizers) {
    moved = moved || o->disjoint_scope_ != scope;
    for (const ParamRecord& r : o->records_)
      moved = moved || r.checked_begin != begin_of(r.param->data) || r.checked_nbytes != nbytes_of(r.param->data);
  }
  if (!moved) return;
  const auto [params, who] = params_of(optimizers);
  // Kept for the grads' check, which runs every step (grads are new tensors at any step).
  optimizers.front()->sorted_data_ = sorted_disjoint_data(params, who);
  for (Optimizer* o : optimizers) {
    o->disjoint_scope_ = scope;
    for (ParamRecord& r : o->records_) {
      r.checked_begin = begin_of(r.param->data);
      r.checked_nbytes = nbytes_of(r.param->data);
    }
  }
}

void Optimizer::check_grads_apart_from_data(std::span<Optimizer* const> optimizers) {
  // The data ranges are apart (checked) and sorted: a binary search per grad.
  const std::vector<detail::ParamBytes>& data = optimizers.front()->sorted_data_;
  for (const Optimizer* o : optimizers)
    for (const ParamRecord& r : o->records_) {
      const Tensor& g = r.param->grad;
      if (!g.defined() || g.nbytes() == 0 || g.is_released()) continue;  // no memory to share
      const auto begin = reinterpret_cast<uintptr_t>(g.data_ptr());
      const auto it = first_overlapping(data, begin, begin + g.nbytes());
      if (it == data.end()) continue;
      const auto [params, who] = params_of(optimizers);
      SWAPOPT_FAIL("[" << who << "] the grad of '" << r.param->name << "' shares memory with "
                       << (it->param == r.param ? std::string("its own data") : "the data of '" + it->param->name + "'")
                       << " (the step writes the params while it reads the grads: give each grad its own memory)");
    }
}

void Optimizer::check_together(std::span<Optimizer* const> optimizers, const std::function<void()>& local_checks) {
  std::exception_ptr failure;
  try {
    local_checks();
    check_moved_params_disjoint(optimizers);
    check_grads_apart_from_data(optimizers);
  } catch (...) {
    failure = std::current_exception();
  }
  const bool skips_nonfinite =
      std::any_of(optimizers.begin(), optimizers.end(), [](const Optimizer* o) { return o->skip_nonfinite_; });
  for (Optimizer* o : optimizers)
    o->agree_on_checks(failure, skips_nonfinite);  // one spanning ranks throws any failure
  if (failure) std::rethrow_exception(failure);
}

int64_t Optimizer::param_index(const Param* param) const {
  const auto it = param_indices_.find(param);
  SWAPOPT_CHECK(it != param_indices_.end(), "[" << name_ << "] parameter is not in this optimizer");
  return it->second;
}

std::string Optimizer::state_name(const Param* param, const std::string& key) const {
  std::string name = "state.";
  name += std::to_string(param_index(param));
  name += '.';
  name += key;
  return name;
}

Tensor& Optimizer::state_tensor(const Param& param, const std::string& key) {
  ParamState& ps = state_[&param];
  auto it = ps.tensors.find(key);
  if (it == ps.tensors.end()) {
    // Stream-ordered: no allocation on the legacy default stream (a barrier across all streams).
    Tensor zeros = Tensor::empty(param.data.shape(), state_dtype(key, param), device(), &stream_);
    ops::fill_zero(stream_, zeros);
    it = ps.tensors.emplace(key, zeros).first;
    fix_layout(param);
  }
  return it->second;
}

Tensor Optimizer::existing_state_tensor(const Param& param, const std::string& key) const {
  const auto state = state_.find(&param);
  if (state == state_.end()) return Tensor();
  const auto it = state->second.tensors.find(key);
  return it == state->second.tensors.end() ? Tensor() : it->second;
}

void Optimizer::check_names_unchanged() const {
  for (const ParamRecord& record : records_)
    SWAPOPT_CHECK(record.param->name == record.name,
                  "[" << name_ << "] parameter '" << record.name << "' was renamed '" << record.param->name
                      << "' after it was added: a param's name is fixed once added (checkpoints name its state by it)");
}

std::string Optimizer::metadata_json() const {
  using json::Value;
  validate_options();  // no non-finite or out-of-range value reaches a checkpoint
  check_names_unchanged();
  Value groups = Value::array(), param_steps = Value::array(), param_names = Value::array(),
        param_shards = Value::array(), param_kept = Value::array();
  bool sharded = false, all_kept = true;
  int64_t index = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    Value indices = Value::array();
    for (const ParamPtr& p : groups_[g].params) {
      indices.push_back(index++);
      param_names.push_back(p->name);
      sharded = sharded || p->layout.has_value();
      param_shards.push_back(p->layout ? Value(p->layout->local_offset()) : Value());
      param_kept.push_back(keeps_state(*p));
      all_kept = all_kept && keeps_state(*p);
      const auto it = state_.find(p.get());
      param_steps.push_back(it == state_.end() ? int64_t(0) : it->second.step);
    }
    groups.push_back(Value::object(
        {{"options", json::parse(group_options_json(g))}, {"step", groups_[g].step}, {"params", std::move(indices)}}));
  }
  Value meta = Value::object({{"optimizer", name_},
                              {"groups", std::move(groups)},
                              {"param_steps", std::move(param_steps)},
                              {"param_names", std::move(param_names)}});
  // Where each distributed param's shard lies in its tensor (null: not distributed), so that a
  // rank's file does not load onto another rank's shard of the same shape.
  if (sharded) meta["param_shards"] = std::move(param_shards);
  // Which params' state this rank keeps, where it keeps only some (HSDP: their owner): a param
  // missing here has no state in the file, which a rank that updates it must not take for "never
  // stepped" (its momentum would restart from zero).
  if (!all_kept) meta["param_kept"] = std::move(param_kept);
  return json::dump(meta, "the metadata");
}

StateDict Optimizer::state_dict() {
  check_unwrapped("state_dict()");
  stream_.synchronize();
  StateDict out;
  out.metadata = metadata_json();
  // Every copy on the optimizer's stream, one wait at the end (not one round trip per tensor).
  for (const auto& [param, ps] : state_)
    for (const auto& [key, tensor] : ps.tensors) {
      Tensor host = Tensor::empty(tensor.shape(), tensor.dtype(), Device::cpu());
      ops::copy(stream_, tensor, host);
      out.tensors.emplace(state_name(param, key), std::move(host));
    }
  stream_.synchronize();
  return out;
}

namespace {

/** A checkpoint's param names (by index) against the optimizer's: any difference is a named error
 *  listing them. */
void check_param_names(const std::vector<std::string>& ours, const std::vector<std::string>& theirs) {
  if (ours == theirs) return;
  // Each index whose name differs, the first few.
  std::ostringstream diff;
  size_t shown = 0, differing = 0;
  for (size_t i = 0; i < std::max(ours.size(), theirs.size()); ++i) {
    const std::string a = i < theirs.size() ? "'" + theirs[i] + "'" : "(none)";
    const std::string b = i < ours.size() ? "'" + ours[i] + "'" : "(none)";
    if (a == b) continue;
    ++differing;
    if (shown++ < 8) diff << (shown > 1 ? "; " : "") << i << ": " << a << " in the checkpoint, " << b << " here";
  }
  if (differing > shown) diff << "; and " << (differing - shown) << " more";
  SWAPOPT_FAIL("[checkpoint] its params are not this optimizer's (renamed, reordered, added or removed), by index: "
               << diff.str());
}

}  // namespace

std::function<void()> Optimizer::prepare_load(
    const CheckpointReader& checkpoint, std::function<void(const Param&, const std::string&, const TensorReader&)> write_tensor) {
  const json::Value meta = json::parse(checkpoint.metadata);
  const std::string& optimizer = json::optimizer_named(meta);
  SWAPOPT_CHECK(optimizer == name_, "[checkpoint] holds " << optimizer << " state, this optimizer is " << name_);
  json::check_optimizer_metadata_keys(meta);
  check_names_unchanged();
  if (meta.contains("param_names")) {  // files written before swapopt 0.3 have none: they load by index
    std::vector<std::string> ours, theirs;
    for (const ParamGroup& g : groups_)
      for (const ParamPtr& p : g.params) ours.push_back(p->name);
    for (const json::Value& v : json::get_array(json::member(meta, "param_names", "metadata"), "param_names"))
      theirs.push_back(json::get_string(v, "param_names"));
    check_param_names(ours, theirs);
  }
  const auto& groups = json::get_array(json::member(meta, "groups", "metadata"), "groups");
  SWAPOPT_CHECK(groups.size() == groups_.size(),
                "[checkpoint] has " << groups.size() << " param groups, the optimizer " << groups_.size());
  std::vector<const Param*> by_index;
  std::vector<std::string> options_json;
  std::vector<int64_t> group_steps;
  for (size_t g = 0; g < groups.size(); ++g) {
    const std::string what = "groups[" + std::to_string(g) + "]";
    json::check_known_keys(groups[g], {"options", "step", "params"}, what);
    const auto& indices = json::get_array(json::member(groups[g], "params", what), what + ".params");
    SWAPOPT_CHECK(indices.size() == groups_[g].params.size(), "[checkpoint] group " << g << " has " << indices.size()
                                                                                    << " params, the optimizer's "
                                                                                    << groups_[g].params.size());
    for (size_t i = 0; i < indices.size(); ++i) {
      const int64_t index = json::get_int(indices[i], what + ".params");
      SWAPOPT_CHECK(index == int64_t(by_index.size() + i),
                    "[checkpoint] group " << g << " lists param " << index << " at position " << i << ", where param "
                                          << by_index.size() + i
                                          << " belongs (each param once, numbered across the groups in order)");
    }
    for (const ParamPtr& p : groups_[g].params) by_index.push_back(p.get());
    const int64_t step = json::get_int(json::member(groups[g], "step", what), what + ".step");
    SWAPOPT_CHECK(step >= 0, "[checkpoint] group " << g << " has negative step " << step);
    SWAPOPT_CHECK(step < std::numeric_limits<int64_t>::max(),  // step() stops one below
                  "[checkpoint] group " << g << " has step " << step << ": no step can follow it");
    group_steps.push_back(step);
    options_json.push_back(json::member(groups[g], "options", what).dump());
  }
  if (meta.contains("param_shards")) {  // written for distributed params; compared where both are
    const auto& shards = json::get_array(json::member(meta, "param_shards", "metadata"), "param_shards");
    SWAPOPT_CHECK(shards.size() == by_index.size(), "[checkpoint] param_shards lists " << shards.size()
                                                                                       << " params, the optimizer has "
                                                                                       << by_index.size());
    for (size_t i = 0; i < shards.size(); ++i) {
      const Param& p = *by_index[i];
      if (shards[i].is_null() || !p.layout) continue;
      Shape theirs;
      for (const json::Value& d : json::get_array(shards[i], "param_shards"))
        theirs.push_back(json::get_int(d, "param_shards"));
      SWAPOPT_CHECK(theirs == p.layout->local_offset(),
                    "[checkpoint] param " << i << " ('" << p.name << "') holds the shard at " << shape_str(theirs)
                                          << " of its tensor, this rank the shard at "
                                          << shape_str(p.layout->local_offset()) << " (another rank's checkpoint?)");
    }
  }
  if (meta.contains("param_kept")) {  // a rank's file under HSDP (a full copy has every param's state)
    const auto& kept = json::get_array(json::member(meta, "param_kept", "metadata"), "param_kept");
    SWAPOPT_CHECK(kept.size() == by_index.size(),
                  "[checkpoint] param_kept lists " << kept.size() << " params, the optimizer has " << by_index.size());
    for (size_t i = 0; i < kept.size(); ++i)
      SWAPOPT_CHECK(!keeps_state(*by_index[i]) || json::get_bool(kept[i], "param_kept"),
                    "[checkpoint] param " << i << " ('" << by_index[i]->name
                                          << "') is updated by this rank, but the rank that saved the file did not "
                                             "keep its state (another HSDP plan or rank): load a full copy made by "
                                             "broadcast_state_to_replicas");
  }
  const auto& steps = json::get_array(json::member(meta, "param_steps", "metadata"), "param_steps");
  SWAPOPT_CHECK(steps.size() == by_index.size(),
                "[checkpoint] has " << steps.size() << " param steps for " << by_index.size() << " params");
  std::vector<int64_t> param_steps;
  for (const json::Value& s : steps) {
    param_steps.push_back(json::get_int(s, "param_steps"));
    SWAPOPT_CHECK(param_steps.back() >= 0, "[checkpoint] negative param step " << param_steps.back());
  }
  // The tensors are checked against each param's data below: a param whose layout is fixed must
  // still have it (a load cannot re-lay out state, the swap wrapper's mirrors least of all), and
  // one the load fixes must be a shape this optimizer takes.
  for (size_t i = 0; i < by_index.size(); ++i)
    SWAPOPT_CHECK(i < records_.size() && records_[i].param == by_index[i],
                  "[" << name_ << "] parameter '" << by_index[i]->name
                      << "' was put into param_groups() directly: add params with add_param_group()");
  check_layouts();
  const PreparedOptions options = prepare_group_options(options_json);
  std::vector<size_t> group_of;  // by param index
  for (size_t g = 0; g < groups_.size(); ++g) group_of.insert(group_of.end(), groups_[g].params.size(), g);
  const std::vector<std::string> keys = state_keys();
  SWAPOPT_CHECK(keys.size() < 32,  // a bit each below, and one for a key not among them
                "[" << name_ << "] has " << keys.size() << " state keys: a load takes at most 31");
  const auto key_bit = [&](const std::string& key) {
    return uint32_t(1) << (std::find(keys.begin(), keys.end(), key) - keys.begin());
  };
  std::vector<uint32_t> used_bits;  // by group: the keys its options use
  for (const std::vector<std::string>& used : options.group_state_keys) {
    used_bits.push_back(0);
    for (const std::string& key : used) used_bits.back() |= key_bit(key);
  }
  struct Entry {
    size_t index;  // the param's, in by_index
    size_t key;    // in keys
    const TensorReader* tensor;
  };
  std::vector<Entry> entries;
  std::vector<uint32_t> keys_of(by_index.size(), 0);  // by param index: a bit for each key the checkpoint holds
  for (const auto& [name, tensor] : checkpoint.tensors) {
    // "state.<index>.<key>", the index written as std::to_string writes it (one name per tensor)
    const size_t dot = name.find('.', 6);
    SWAPOPT_CHECK(name.rfind("state.", 0) == 0 && dot != std::string::npos && dot > 6,
                  "[checkpoint] unexpected tensor name '" << name << "'");
    const std::string index_text = name.substr(6, dot - 6), key = name.substr(dot + 1);
    SWAPOPT_CHECK(index_text.size() <= 9 && std::all_of(index_text.begin(), index_text.end(), ::isdigit),
                  "[checkpoint] unexpected tensor name '" << name << "'");
    const size_t index = size_t(std::stoll(index_text));
    SWAPOPT_CHECK(std::to_string(index) == index_text,
                  "[checkpoint] tensor name '" << name << "' is not canonical: the param index is written '" << index << "'");
    SWAPOPT_CHECK(index < by_index.size(), "[checkpoint] tensor '" << name << "' names param " << index << " of "
                                                                   << by_index.size());
    const size_t k = size_t(std::find(keys.begin(), keys.end(), key) - keys.begin());
    SWAPOPT_CHECK(k < keys.size(),
                  "[checkpoint] tensor '" << name << "': '" << key << "' is not " << name_ << " state");
    SWAPOPT_CHECK(used_bits[group_of[index]] & (uint32_t(1) << k),
                  "[checkpoint] tensor '" << name << "': group " << group_of[index] << " does not use '" << key
                                          << "' with its options");
    const Param& param = *by_index[index];
    SWAPOPT_CHECK(tensor.shape == param.data.shape(), "[checkpoint] tensor '" << name << "' has shape "
                                                                              << shape_str(tensor.shape) << ", param '"
                                                                                << param.name << "' needs "
                                                                                << shape_str(param.data.shape()));
    SWAPOPT_CHECK(tensor.dtype == state_dtype(key, param), "[checkpoint] tensor '" << name << "' is "
                                                                                   << dtype_name(tensor.dtype) << ", "
                                                                                     << name_ << " keeps "
                                                                                     << dtype_name(state_dtype(key, param)));
    keys_of[index] |= uint32_t(1) << k;
    if (keeps_state(param)) entries.push_back({index, k, &tensor});
  }
  // Written in param order, not the names' ("state.10" before "state.2"): each param's records
  // and state are then reached in the order they were made, not at random over all of them.
  std::sort(entries.begin(), entries.end(),
            [](const Entry& a, const Entry& b) { return a.index != b.index ? a.index < b.index : a.key < b.key; });
  // Muon files written before swapopt 0.4 hold 0 for every param step: a param with state is taken
  // as stepped with its group (Muon's math reads no per-param step).
  if (older_files_hold_no_param_steps() &&
      std::all_of(param_steps.begin(), param_steps.end(), [](int64_t s) { return s == 0; }))
    for (size_t i = 0; i < by_index.size(); ++i)
      if (keys_of[i] != 0) param_steps[i] = group_steps[group_of[i]];
  // A param holds all the state its group uses or none, exactly when stepped.
  for (size_t i = 0; i < by_index.size(); ++i) {
    const auto what = [&] { return "[checkpoint] param " + std::to_string(i) + " ('" + by_index[i]->name + "')"; };
    const std::vector<std::string>& used = options.group_state_keys[group_of[i]];
    if (keys_of[i] != 0 && (used_bits[group_of[i]] & ~keys_of[i]) != 0) {
      // The first key it holds, in the names' order, and the first its group uses that it lacks.
      std::string held;
      for (size_t k = 0; k < keys.size(); ++k)
        if ((keys_of[i] >> k & 1) && (held.empty() || keys[k] < held)) held = keys[k];
      const auto missing =
          std::find_if(used.begin(), used.end(), [&](const std::string& key) { return !(keys_of[i] & key_bit(key)); });
      SWAPOPT_FAIL(what() << " has '" << held << "' but not '" << *missing << "'");
    }
    SWAPOPT_CHECK((keys_of[i] == 0) == (param_steps[i] == 0),
                  what() << (keys_of[i] == 0 ? " has no state but step " : " has state but step ") << param_steps[i]);
    SWAPOPT_CHECK(param_steps[i] <= group_steps[group_of[i]],
                  what() << " has step " << param_steps[i] << ", beyond its group's " << group_steps[group_of[i]]);
  }
  // Last: a checkpoint that is wrong in itself gets the message it gets unwrapped.
  for (size_t g = 0; g < groups_.size(); ++g)
    check_keys_fit_wrapper(g, options.group_state_keys[g], "cannot load this checkpoint's options while wrapped",
                           "give the optimizer these options before wrapping it, or load the checkpoint unwrapped");
  std::function<void()> apply_options = options.apply;
  return [this, apply_options, group_steps, param_steps = std::move(param_steps), by_index = std::move(by_index),
          entries = std::move(entries), keys, write_tensor] {
    apply_options();
    for (size_t g = 0; g < groups_.size(); ++g) groups_[g].step = group_steps[g];
    state_.clear();
    for (const Entry& e : entries) {
      write_tensor(*by_index[e.index], keys[e.key], *e.tensor);
      fix_layout(records_[e.index]);  // the tensors were checked against its data as it is now
    }
    for (size_t i = 0; i < by_index.size(); ++i) {
      auto it = state_.find(by_index[i]);
      if (it != state_.end()) it->second.step = param_steps[i];
    }
  };
}

std::function<void()> Optimizer::prepare_device_load(const CheckpointReader& checkpoint) {
  std::function<void()> apply =
      prepare_load(checkpoint, [this](const Param& param, const std::string& key, const TensorReader& tensor) {
        // Stream-ordered on the optimizer's stream, the only one that uses state: freeing it later
        // (a load replacing it) needs no wait for the whole device.
        Tensor device_copy = Tensor::empty(tensor.shape, tensor.dtype, device(), &stream_);
        fill_from(stream_, device_copy, tensor);
        state_[&param].tensors[key] = device_copy;
      });
  return [this, apply] {
    stream_.synchronize();  // no update may still be reading the state being replaced
    apply();
    stream_.synchronize();
  };
}

void Optimizer::load_from(const CheckpointReader& checkpoint) { prepare_device_load(checkpoint)(); }

CheckpointSource Optimizer::checkpoint_source() {
  stream_.synchronize();
  CheckpointSource source;
  source.metadata = metadata_json();
  for (const auto& [param, ps] : state_)
    for (const auto& [key, tensor] : ps.tensors)
      source.tensors.emplace(state_name(param, key), device_source(stream_, tensor));
  return source;
}

void Optimizer::load_state_dict(const StateDict& state) {
  check_unwrapped("load_state_dict()");
  load_from(reader_of(state));
}

void Optimizer::save_checkpoint(const std::string& path) {
  check_unwrapped("save_checkpoint()");
  write_checkpoint(checkpoint_source(), path);
}

void Optimizer::load_checkpoint(const std::string& path, const CheckpointReadOptions& options) {
  check_unwrapped("load_checkpoint()");
  const CheckpointFile file(path, options);
  load_from(file.reader());
}

}  // namespace swapopt
