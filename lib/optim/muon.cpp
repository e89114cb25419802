#include "swapopt/optim/muon.h"

#include <algorithm>
#include <cmath>

#include "../core/operand_overlap.h"
#include "group_options.h"
#include "json.h"
#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"
#include "swapopt/optim/optim_ops.h"

namespace swapopt {

namespace {

void check_unit_interval(double v, const char* name) {
  SWAPOPT_CHECK(std::isfinite(v) && v >= 0.0 && v < 1.0, "[Muon] " << name << " must be in [0, 1), got " << v);
}

void check_non_negative(double v, const char* name) {
  check_fits_f32(v, name, "Muon");
  SWAPOPT_CHECK(std::isfinite(v) && v >= 0.0, "[Muon] " << name << " must be finite and >= 0, got " << v);
}

}  // namespace

void MuonOptions::validate() const {
  check_non_negative(lr, "lr");
  check_non_negative(weight_decay, "weight_decay");
  check_non_negative(matched_adamw_rms, "matched_adamw_rms");
  check_unit_interval(momentum, "momentum");
  if (momentum2) check_unit_interval(*momentum2, "momentum2");
  check_non_negative(ns_epsilon, "ns_epsilon");
  ns_schedule(ns_variant, ns_steps, ns_coefficients);
  SWAPOPT_CHECK(zero_rms_scale_mode == "zero" || zero_rms_scale_mode == "use_lr",
                "[Muon] zero_rms_scale_mode must be 'zero' or 'use_lr', got '" << zero_rms_scale_mode << "'");
  SWAPOPT_CHECK(!ns_dtype || *ns_dtype != DType::f16, "[Muon] ns_dtype must be f32 or bf16, got f16");
  SWAPOPT_CHECK(max_batch_elements >= 1, "[Muon] max_batch_elements must be >= 1, got " << max_batch_elements);
  SWAPOPT_CHECK(min_batch_size >= 1, "[Muon] min_batch_size must be >= 1, got " << min_batch_size);
  check_derived_fits_f32(lr * weight_decay, "lr x weight_decay", "Muon");
  check_derived_fits_f32(lr * matched_adamw_rms, "lr x matched_adamw_rms", "Muon");  // the step checks it per shape
}

CoreShape core_shape(const Shape& shape) {
  SWAPOPT_CHECK(shape.size() >= 2, "[Muon] core shape needs at least 2 dims, got " << shape_str(shape));
  SWAPOPT_CHECK(std::all_of(shape.begin(), shape.end(), [](int64_t d) { return d >= 0; }),
                "[Muon] core shape of " << shape_str(shape) << ": a dim is negative");
  if (shape.size() == 3 && shape[1] == 1) return {shape[0], shape[2], 1};
  const int64_t numel = shape_numel(shape);  // checks the dims and that their product fits
  const int64_t rows = shape[shape.size() - 2], cols = shape.back();
  return {rows, cols, numel == 0 ? 0 : numel / (rows * cols)};
}

Muon::Muon(Stream stream, MuonHooks hooks) : Optimizer("Muon", std::move(stream)), hooks_(std::move(hooks)) {}

void Muon::check_unfixed_shape(const Param& p) const {
  SWAPOPT_CHECK(p.data.dim() >= 2, "[Muon] " << p.data.dim() << "-D parameter '" << p.name << "' (shape "
                                             << shape_str(p.data.shape()) << ") cannot use Muon");
}

void Muon::add_param_group(std::vector<ParamPtr> params, MuonOptions options) {
  options.validate();
  for (const ParamPtr& p : params) {
    SWAPOPT_CHECK(p != nullptr, "[Muon] null parameter");
    SWAPOPT_CHECK(p->data.defined(), "[Muon] parameter '" << p->name << "' must be a defined contiguous tensor");
    check_unfixed_shape(*p);
    SWAPOPT_CHECK(!(hsdp_enabled() && p->layout), "[Muon] parameter '"
                                                      << p->name
                                                      << "' has a DTensor layout but HSDP is already "
                                                         "enabled: enable_hsdp plans the HSDP schedule from "
                                                         "the groups it sees (add every group before it)");
  }
  add_group(std::move(params));
  options_.push_back(std::move(options));
}

DType Muon::state_dtype(const std::string&, const Param& param) const { return param.data.dtype(); }

DType Muon::ns_dtype(size_t group) const {
  return group_entry(options_, group).ns_dtype.value_or(device().is_cuda() ? DType::bf16 : DType::f32);
}

std::vector<Param*> Muon::params_with_grad(size_t group) const {
  std::vector<Param*> out;
  for (const ParamPtr& p : group_entry(groups_, group).params)
    if (p->has_grad()) out.push_back(p.get());
  return out;
}

std::vector<std::vector<Param*>> Muon::group_by_shape(const std::vector<Param*>& params) const {
  std::vector<std::vector<Param*>> groups;
  std::vector<CoreShape> shapes;
  for (Param* p : params) {
    const CoreShape cs = core_shape(p->data.shape());
    size_t i = 0;
    while (i < shapes.size() && !(shapes[i].rows == cs.rows && shapes[i].cols == cs.cols)) ++i;
    if (i == shapes.size()) {
      shapes.push_back(cs);
      groups.emplace_back();
    }
    groups[i].push_back(p);
  }
  return groups;
}

std::vector<std::vector<Param*>> Muon::split_into_memory_safe_batches(size_t group, const std::vector<Param*>& params,
                                                                        int64_t shard_size) const {
  const MuonOptions& o = group_entry(options_, group);
  SWAPOPT_CHECK(shard_size >= 1, "[Muon] shard_size must be >= 1, got " << shard_size);
  const int64_t cap = std::max<int64_t>(1, o.max_batch_elements / shard_size);
  std::vector<std::vector<Param*>> batches;
  std::vector<Param*> current;
  int64_t elements = 0;
  for (Param* p : params) {
    const int64_t n = shape_numel(p->logical_shape());
    if (!current.empty() && int64_t(current.size()) >= o.min_batch_size && elements + n > cap) {
      batches.push_back(std::move(current));
      current.clear();
      elements = 0;
    }
    current.push_back(p);
    elements += n;
  }
  if (!current.empty()) batches.push_back(std::move(current));
  return batches;
}

Shape Muon::ns_input_shape(const std::vector<Param*>& params) const {
  SWAPOPT_CHECK(!params.empty(), "[Muon] an NS batch needs at least one param");
  const CoreShape first = core_shape(params.front()->data.shape());
  int64_t total = 0;
  for (const Param* p : params) {
    const CoreShape cs = core_shape(p->data.shape());
    SWAPOPT_CHECK(cs.rows == first.rows && cs.cols == first.cols,
                  "[Muon] one NS batch needs one core shape: '" << p->name << "' is " << cs.rows << "x" << cs.cols << ", not "
                                                                << first.rows << "x" << first.cols);
    total += cs.count;
  }
  return {total, first.rows, first.cols};
}

Tensor Muon::allocate_ns_input(size_t group, const std::vector<Param*>& params) {
  check_in_group(group, params, "allocate_ns_input");
  return new_ns_input(group, params);
}

Tensor Muon::new_ns_input(size_t group, const std::vector<Param*>& params) {
  return Tensor::empty(ns_input_shape(params), ns_dtype(group), device(), &stream_);
}

std::vector<Tensor> Muon::ns_input_parts(const Tensor& ns_input, const std::vector<Param*>& params) const {
  std::vector<Tensor> parts;
  int64_t offset = 0;
  for (const Param* p : params) {
    const int64_t count = core_shape(p->data.shape()).count;
    parts.push_back(ns_input.narrow(0, offset, count).view(p->data.shape()));
    offset += count;
  }
  return parts;
}

Tensor Muon::update_momentum(size_t group, const std::vector<Param*>& params) {
  check_update_call(group, params, "update_momentum");
  check_local(params, "update_momentum");
  check_momentum_operands(params, nullptr);
  return stacked_momentum(group, params);
}

Tensor Muon::stacked_momentum(size_t group, const std::vector<Param*>& params) {
  Tensor stacked = new_ns_input(group, params);
  fill_momentum(group, params, ns_input_parts(stacked, params));
  return stacked;
}

namespace {
/** Throws unless `t` is a contiguous tensor on `device` with memory: what the momentum op needs of
 *  a tensor the caller passes, checked before anything changes. */
void check_operand(const Tensor& t, Device device, const std::string& what) {
  SWAPOPT_CHECK(t.defined() && !t.is_released(), "[Muon] " << what << " is undefined or released");
  SWAPOPT_CHECK(t.device() == device && t.is_contiguous(),
                "[Muon] " << what << " is " << t.str() << ": it must be contiguous, on " << device.str());
}
}  // namespace

void Muon::momentum_chunk(size_t group, const Param& param, int64_t begin, int64_t end, const Tensor& staged_buffer,
                          const Tensor& out_input) {
  const Param* const one[] = {&param};
  check_update_call(group, one, "momentum_chunk", begin == 0);
  check_local(one, "momentum_chunk");
  SWAPOPT_CHECK(!hooks_.momentum_update_fn, "[Muon] momentum_update_fn sees whole tensors: it cannot run in chunks");
  SWAPOPT_CHECK(0 <= begin && begin <= end && end <= param.data.numel() && out_input.numel() == end - begin,
                "[Muon] chunk [" << begin << ", " << end << ") of '" << param.name << "' (" << param.data.numel()
                                 << " elements) into " << out_input.str());
  check_chunk_start(param, begin, end, "momentum_chunk");
  check_operand(out_input, device(), "momentum_chunk's output");
  if (staged_buffer.defined()) {
    check_operand(staged_buffer, device(), "momentum_chunk's staged buffer");
    SWAPOPT_CHECK(
        staged_buffer.shape() == Shape{end - begin} && staged_buffer.dtype() == state_dtype("momentum_buffer", param),
        "[Muon] momentum_chunk's staged buffer is " << staged_buffer.str() << ", the chunk needs "
                                                    << dtype_name(state_dtype("momentum_buffer", param)) << " ["
                                                    << end - begin << "]");
  }
  // The op's memory checks, before the chunk creates state or counts a step.
  const auto range_of = [&](const Tensor& t) { return t.view({t.numel()}).narrow(0, begin, end - begin); };
  const Tensor own = existing_state_tensor(param, "momentum_buffer");
  const Tensor buffer = staged_buffer.defined() ? staged_buffer : own.defined() ? range_of(own) : Tensor();
  check_operands_apart("muon_momentum", {{buffer, "momentum_buffer"}, {out_input.view({end - begin}), "update"}},
                       {{range_of(param.grad), "grad"}});
  chunk_momentum(group, param, begin, end, staged_buffer, out_input);
}

void Muon::chunk_momentum(size_t group, const Param& param, int64_t begin, int64_t end, const Tensor& staged_buffer,
                          const Tensor& out_input) {
  const MuonOptions& o = group_entry(options_, group);
  const auto range_of = [&](const Tensor& t) { return t.view({t.numel()}).narrow(0, begin, end - begin); };
  if (begin == 0) count_update(group, state_[&param]);  // once per update, at its first chunk (as momentum_into counts)
  const Tensor buffer = staged_buffer.defined() ? staged_buffer : range_of(state_tensor(param, "momentum_buffer"));
  ops::muon_momentum(stream_, range_of(param.grad), buffer, out_input.view({end - begin}), float(o.momentum),
                     float(o.m2()), o.nesterov);
}

void Muon::momentum_into(size_t group, const std::vector<Param*>& params, const std::vector<Tensor>& out_inputs) {
  check_update_call(group, params, "momentum_into");
  check_local(params, "momentum_into");
  for (size_t i = 0; i < out_inputs.size(); ++i)
    check_operand(out_inputs[i], device(), "momentum_into's output " + std::to_string(i));
  check_momentum_operands(params, &out_inputs);
  fill_momentum(group, params, out_inputs);
}

void Muon::check_momentum_operands(const std::vector<Param*>& params, const std::vector<Tensor>* out_inputs) const {
  if (out_inputs != nullptr) {
    SWAPOPT_CHECK(out_inputs->size() == params.size(),
                  "[Muon] momentum_into: " << out_inputs->size() << " outputs for " << params.size() << " params");
    for (size_t i = 0; i < params.size(); ++i)
      SWAPOPT_CHECK((*out_inputs)[i].numel() == params[i]->data.numel(),
                    "[Muon] momentum_into: output " << i << " is " << (*out_inputs)[i].str() << ", '" << params[i]->name
                                                    << "' has " << params[i]->data.numel() << " elements");
  }
  if (hooks_.momentum_update_fn) return;
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = *params[i];
    check_operands_apart("muon_momentum",
                         {{existing_state_tensor(p, "momentum_buffer"), "momentum_buffer"},
                          {out_inputs ? (*out_inputs)[i].view(p.data.shape()) : Tensor(), "update"}},
                         {{p.grad, "grad"}});
  }
}

void Muon::fill_momentum(size_t group, const std::vector<Param*>& params, const std::vector<Tensor>& out_inputs) {
  const MuonOptions& o = group_entry(options_, group);
  for (const Param* p : params) {
    SWAPOPT_CHECK(p->has_grad(), "[Muon] param '" << p->name << "' has no grad");
    SWAPOPT_CHECK(p->grad.shape() == p->data.shape(),
                  "[Muon] grad of '" << p->name << "' is " << p->grad.str() << ", the param " << p->data.str());
  }
  const float m1 = float(o.momentum), m2 = float(o.m2());
  // Counted once the checks pass, before any buffer is created: a param with state has a step
  // (the checkpoint's proof that its momentum is there), also if the update below throws.
  for (const Param* p : params) count_update(group, state_[p]);
  if (hooks_.momentum_update_fn) {
    std::vector<Tensor> grads, bufs;
    for (const Param* p : params) {
      grads.push_back(p->grad);
      bufs.push_back(state_tensor(*p, "momentum_buffer"));
    }
    const std::vector<Tensor> updates = hooks_.momentum_update_fn(stream_, grads, bufs, m1, m2, o.nesterov);
    SWAPOPT_CHECK(updates.size() == grads.size(),
                  "[Muon] momentum_update_fn returned " << updates.size() << " updates for " << grads.size() << " grads");
    for (size_t i = 0; i < updates.size(); ++i) {
      SWAPOPT_CHECK(updates[i].numel() == out_inputs[i].numel() && updates[i].is_contiguous(),
                    "[Muon] momentum_update_fn update " << i << " is " << updates[i].str() << ", expected "
                                                       << shape_str(out_inputs[i].shape()) << " elements, contiguous");
      ops::cast(stream_, updates[i].view(out_inputs[i].shape()), out_inputs[i]);
    }
    return;
  }
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = *params[i];
    ops::muon_momentum(stream_, p.grad, state_tensor(p, "momentum_buffer"), out_inputs[i].view(p.data.shape()), m1, m2,
                       o.nesterov);
  }
}

int64_t ns_workspace_bytes(const CoreShape& cs, int64_t element_size, Device device) {
  SWAPOPT_CHECK(cs.rows >= 0 && cs.cols >= 0 && cs.count >= 0 && element_size >= 1 && element_size <= 8,
                "[Muon] no Newton-Schulz workspace for " << cs.count << " matrices of " << cs.rows << " x " << cs.cols
                                                         << " with " << element_size << "-byte elements");
  const int64_t k = std::min(cs.rows, cs.cols);
  // count (2 m n B + 2 k^2 B + 4) + scratch, each step checked: a core shape's dims fit an int64
  // product, its workspace need not.
  int64_t mn = 0, per = 0, kk = 0, total = 0;
  const bool overflow = __builtin_mul_overflow(cs.rows, cs.cols, &mn) ||
                        __builtin_mul_overflow(mn, 2 * element_size, &per) || __builtin_mul_overflow(k, k, &kk) ||
                        __builtin_mul_overflow(kk, 2 * element_size, &kk) ||
                        __builtin_add_overflow(per, kk + 4, &per) || __builtin_mul_overflow(per, cs.count, &total) ||
                        __builtin_add_overflow(total, ops::frobenius_norm_scratch_bytes(device, cs.count, mn), &total);
  SWAPOPT_CHECK(!overflow, "[Muon] the Newton-Schulz workspace of " << cs.count << " matrices of " << cs.rows << " x "
                                                                    << cs.cols
                                                                    << " has more bytes than an int64 counts");
  return total;
}

int64_t Muon::workspace_bytes(size_t group, const std::vector<Param*>& params) const {
  const int64_t s = int64_t(dtype_size(ns_dtype(group)));
  int64_t total = 0;
  for (const Param* p : params) total += ns_workspace_bytes(core_shape(p->data.shape()), s, device());
  return total;
}

void Muon::orthogonalize(size_t group, const Tensor& x) {
  const MuonOptions& o = group_entry(options_, group);
  if (hooks_.zeropower_fn) {
    hooks_.zeropower_fn(stream_, x, o.ns_steps);
  } else {
    newton_schulz(stream_, x, ns_schedule(o.ns_variant, o.ns_steps, o.ns_coefficients), float(o.ns_epsilon),
                  ns_norm_scale(o.ns_variant));
  }
}

namespace {
/** What the orthogonalized update of a matrix of `logical` is multiplied by: -lr x scale. */
double update_multiplier(const MuonOptions& o, const CoreShape& logical) {
  double scale = std::sqrt(double(std::max(logical.rows, logical.cols))) * o.matched_adamw_rms;
  if (o.matched_adamw_rms == 0.0) scale = o.zero_rms_scale_mode == "use_lr" ? 1.0 : 0.0;
  return -o.lr * scale;
}
}  // namespace

void Muon::apply_update(size_t group, Param& param, const Tensor& update, const CoreShape& logical) {
  const MuonOptions& o = group_entry(options_, group);
  const float decay = float(1.0 - o.lr * o.weight_decay);
  const float alpha = float(update_multiplier(o, logical));
  if (o.apply_lr_in_update) {
    ops::scale(stream_, update, alpha);
    ops::axpby(stream_, 1.f, update, decay, param.data);
  } else {
    ops::axpby(stream_, alpha, update, decay, param.data);
  }
}

void Muon::process_unsharded_batch(size_t group, const std::vector<Param*>& params, const Tensor& ns_input) {
  check_params_call(group, params, "process_unsharded_batch");
  check_local(params, "process_unsharded_batch");
  const Shape shape = ns_input_shape(params);
  SWAPOPT_CHECK(ns_input.defined() && !ns_input.is_released() && ns_input.shape() == shape &&
                    ns_input.dtype() == ns_dtype(group) && ns_input.device() == device() && ns_input.is_contiguous(),
                "[Muon] process_unsharded_batch: ns_input is " << ns_input.str() << ", the params need a contiguous "
                                                               << dtype_name(ns_dtype(group)) << " " << shape_str(shape)
                                                               << " on " << device().str());
  // Newton-Schulz works in ns_input, then each update is read from it as its param is written.
  for (const Param* p : params)
    SWAPOPT_CHECK(!spans_overlap(ns_input, p->data), "[Muon] process_unsharded_batch: ns_input shares memory with '"
                                                         << p->name << "' (its update is read from there)");
  orthogonalize_and_apply(group, params, ns_input);
}

void Muon::orthogonalize_and_apply(size_t group, const std::vector<Param*>& params, const Tensor& ns_input) {
  orthogonalize(group, ns_input);
  int64_t offset = 0;
  for (Param* p : params) {
    const CoreShape cs = core_shape(p->data.shape());
    apply_update(group, *p, ns_input.narrow(0, offset, cs.count).view(p->data.shape()), core_shape(p->logical_shape()));
    offset += cs.count;
  }
}

void Muon::run_post_update(size_t group, const std::vector<Param*>& params) {
  if (!hooks_.post_update_fn) return;
  const MuonOptions& o = group_entry(options_, group);
  for (Param* p : params)
    hooks_.post_update_fn(stream_, *p, p->data, {p->name, p->logical_shape(), o.lr, o.weight_decay, groups_[group].step});
}

void Muon::update_params(size_t group, const std::vector<Param*>& params, const MomentumWriter& write_momentum) {
  check_update_call(group, params, "update_params");
  check_local(params, "update_params");
  if (!write_momentum) check_momentum_operands(params, nullptr);
  update_local(group, params, write_momentum);
}

void Muon::update_local(size_t group, const std::vector<Param*>& params, const MomentumWriter& write_momentum) {
  // Batch by batch, its momentum written just before its Newton-Schulz: a hook throwing there
  // leaves the later batches' momentum as it was, with a writer (a chunked swap) or without.
  for (const std::vector<Param*>& shape_group : group_by_shape(params))
    for (const std::vector<Param*>& batch : split_into_memory_safe_batches(group, shape_group)) {
      const Tensor input = new_ns_input(group, batch);
      const std::vector<Tensor> parts = ns_input_parts(input, batch);
      if (write_momentum) {
        write_momentum(batch, parts);
      } else {
        fill_momentum(group, batch, parts);
      }
      orthogonalize_and_apply(group, batch, input);
    }
}

void Muon::set_options(size_t group, const MuonOptions& options) { set_group_options(options_, group, options, name_); }

void Muon::set_lr(double lr) { set_every_lr(options_, lr, name_); }

void Muon::validate_options() const {
  for (size_t g = 0; g < options_.size(); ++g) validate_group(options_[g], g, name_);
}

void Muon::check_step_locally() {
  validate_options();
  check_step_counts();
  for (size_t g = 0; g < groups_.size(); ++g) local_params(g);  // throws for a shard without HSDP
  check_params_with_grad();
  check_layouts_as_planned();                  // after the check that every param was added
  for (size_t g = 0; g < groups_.size(); ++g)  // lr x sqrt(the larger side) x matched_adamw_rms, in f32
    for (const ParamPtr& p : groups_[g].params)
      if (p->has_grad()) {
        const double multiplier = update_multiplier(options_[g], core_shape(p->logical_shape()));
        if (!std::isfinite(float(multiplier)))  // the message only where it fails: no string per param and step
          check_derived_fits_f32(-multiplier,
                                 ("parameter '" + p->name + "': lr x sqrt(" + shape_str(p->logical_shape()) +
                                  "'s larger side) x matched_adamw_rms")
                                     .c_str(),
                                 "Muon");
      }
}

void Muon::run_step() {
  std::vector<std::vector<Param*>> local(groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g)
    for (Param* p : local_params(g))
      if (p->has_grad()) local[g].push_back(p);
  for (ParamGroup& g : groups_) g.step += 1;  // all groups first, as the reference does
  for (size_t g = 0; g < groups_.size(); ++g) {
    update_local(g, local[g], {});
    run_post_update(g, local[g]);
  }
  if (!hsdp_enabled()) return;
  AsyncReplicateBroadcaster broadcaster(stream_, hsdp_options_.broadcast_buffer_bytes);
  try {
    for (const HsdpAssignment& a : schedule_) {
      std::vector<Param*> owned;
      for (Param* p : a.owned())
        if (p->has_grad()) owned.push_back(p);
      update_owned(a, owned, {});
      finish_assignment(a, broadcaster, owned);
    }
  } catch (...) {
    abandon_hsdp_step(broadcaster);  // before anyone synchronises a stream that waits on them
    throw;
  }
  finish_hsdp_step(broadcaster);
}

std::string Muon::group_options_json(size_t group) const {
  using json::Value;
  const MuonOptions& o = group_entry(options_, group);
  Value coefficients = Value::array();
  for (const NsCoefficients& c : o.ns_coefficients) coefficients.push_back(Value::array({c[0], c[1], c[2]}));
  return Value::object({{"lr", o.lr},
                        {"weight_decay", o.weight_decay},
                        {"matched_adamw_rms", o.matched_adamw_rms},
                        {"momentum", o.momentum},
                        {"momentum2", o.momentum2 ? Value(*o.momentum2) : Value()},
                        {"nesterov", o.nesterov},
                        {"ns_steps", o.ns_steps},
                        {"ns_variant", o.ns_variant},
                        {"ns_coefficients", std::move(coefficients)},
                        {"ns_epsilon", o.ns_epsilon},
                        {"zero_rms_scale_mode", o.zero_rms_scale_mode},
                        {"apply_lr_in_update", o.apply_lr_in_update},
                        {"ns_dtype", o.ns_dtype ? Value(dtype_name(*o.ns_dtype)) : Value()},
                        {"max_batch_elements", o.max_batch_elements},
                        {"min_batch_size", o.min_batch_size}})
      .dump();
}

Optimizer::PreparedOptions Muon::prepare_group_options(const std::vector<std::string>& options_json) {
  std::vector<MuonOptions> parsed;
  for (const std::string& text : options_json) {
    parsed.push_back(read_checkpoint_group(parsed.size(), [&] {
      const json::Value v = json::parse(text);
      static const char* known[] = {"lr",         "weight_decay",        "matched_adamw_rms",
                                    "momentum",   "momentum2",           "nesterov",
                                    "ns_steps",   "ns_variant",          "ns_coefficients",
                                    "ns_epsilon", "zero_rms_scale_mode", "apply_lr_in_update",
                                    "ns_dtype",   "max_batch_elements",  "min_batch_size"};
      const std::string w = "Muon options";
      for (const auto& [key, value] : json::get_object(v, w)) {
        bool ok = false;
        for (const char* k : known) ok = ok || key == k;
        SWAPOPT_CHECK(ok, "[Muon] unknown option '" << key << "'");
      }
      auto field = [&](const std::string& key) -> const json::Value& { return json::member(v, key, w); };
      auto number = [&](const std::string& key) { return json::get_number(field(key), key); };
      auto string = [&](const std::string& key) { return json::get_string(field(key), key); };
      MuonOptions o;
      o.lr = number("lr");
      o.weight_decay = number("weight_decay");
      o.matched_adamw_rms = number("matched_adamw_rms");
      o.momentum = number("momentum");
      if (!field("momentum2").is_null()) o.momentum2 = number("momentum2");
      o.nesterov = json::get_bool(field("nesterov"), "nesterov");
      const int64_t steps = json::get_int(field("ns_steps"), "ns_steps");
      SWAPOPT_CHECK(steps >= 1, "[Muon] ns_steps must be >= 1, got " << steps);
      SWAPOPT_CHECK(steps <= kMaxNsSteps, "[Muon] ns_steps must be <= " << kMaxNsSteps << ", got " << steps);
      o.ns_steps = int(steps);
      o.ns_variant = string("ns_variant");
      for (const json::Value& triple : json::get_array(field("ns_coefficients"), "ns_coefficients")) {
        const auto& abc = json::get_array(triple, "ns_coefficients triple");
        SWAPOPT_CHECK(abc.size() == 3, "[Muon] each ns_coefficients triple needs exactly 3 values, got " << abc.size());
        o.ns_coefficients.push_back({float(json::get_number(abc[0], "coefficient")),
                                     float(json::get_number(abc[1], "coefficient")),
                                     float(json::get_number(abc[2], "coefficient"))});
      }
      o.ns_epsilon = number("ns_epsilon");
      o.zero_rms_scale_mode = string("zero_rms_scale_mode");
      o.apply_lr_in_update = json::get_bool(field("apply_lr_in_update"), "apply_lr_in_update");
      if (!field("ns_dtype").is_null()) o.ns_dtype = dtype_from_name(string("ns_dtype"));
      o.max_batch_elements = json::get_int(field("max_batch_elements"), "max_batch_elements");
      o.min_batch_size = json::get_int(field("min_batch_size"), "min_batch_size");
      return o;
    }));
  }
  return {[this, parsed] { options_ = parsed; }, std::vector<std::vector<std::string>>(parsed.size(), state_keys())};
}

}  // namespace swapopt
