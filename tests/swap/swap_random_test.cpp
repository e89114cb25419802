// Randomized differential test: bare vs swapped optimizers on random models, configs and
// schedules, compared by memcmp after every step. Any failure prints the seed that reproduces it.
//
// make test runs seeds 0..1999 (SWAPOPT_RANDOM_CONFIGS changes the count). With
// SWAPOPT_RANDOM_SECONDS set, it runs for that long instead, from SWAPOPT_RANDOM_SEED (default:
// the clock, printed), which is how CI spends a time budget under the sanitizers.
#include <chrono>
#include <cstdlib>
#include <sstream>

#include "swap/swap_fixture.h"

using namespace swapopt;

namespace {

enum class Kind { muon, adamw, mixed };
const char* kind_name(Kind k) { return k == Kind::muon ? "Muon" : k == Kind::adamw ? "AdamW" : "MuonWithAdamW"; }

/** One random case: everything derives from `seed`. */
struct Case {
  uint32_t seed = 0;
  Kind kind = Kind::muon;
  std::vector<std::pair<std::string, Shape>> params;
  std::vector<DType> dtypes;
  int steps = 0;
  std::vector<std::vector<bool>> has_grad;  // [step][param]
  int reload_after = -1;                    // save and load into a fresh wrapper after this step
  std::vector<bool> prefetch;               // [step]: prefetch_early before the step
  SwapConfig config, reload_config;
  /** Bit k set: the family's k-th state key is swapped, the others stay ordinary device state
   *  (SwapConfig::state_keys); 0: state_keys unset (all of them). */
  uint32_t keys_mask = 0;
  uint32_t options_seed = 0;
  /** > 0: each wrapper's device budget is its largest unit workspace plus this many eighths of
   *  its largest unit's state, so that many units run chunked between whole ones; 0: the
   *  config's own budget (or none). */
  int budget_eighths = 0;

  std::string str() const {
    std::ostringstream out;
    out << "seed " << seed << ": " << kind_name(kind) << ", swap_times " << config.swap_times << (config.packed ? " packed" : " unpacked")
        << ", min_numel " << config.min_numel;
    if (config.device_budget_bytes) out << ", device_budget_bytes " << *config.device_budget_bytes;
    if (config.retain_arenas) out << ", retain_arenas";
    if (keys_mask != 0) out << ", state keys mask " << keys_mask;
    if (budget_eighths != 0) out << ", budget: workspace + " << budget_eighths << "/8 of the largest unit";
    out << ", " << steps << " steps, reload after " << reload_after << ", params";
    for (size_t i = 0; i < params.size(); ++i)
      out << " " << params[i].first << shape_str(params[i].second) << dtype_name(dtypes[i]);
    return out.str();
  }
};

SwapConfig random_config(std::mt19937& rng) {
  SwapConfig c;
  const int times[] = {1, 2, 3, 4, 5, 7, 16, 100};
  c.swap_times = times[rng() % 8];
  c.packed = rng() % 3 != 0;
  const int64_t min_numel[] = {0, 1, 16, 64, 256, 1024};
  c.min_numel = min_numel[rng() % 6];
  // A device budget instead of swap_times now and then: from far too small (a named error that
  // must change nothing) to ample. Bytes of state per param here are at most a few tens of KiB.
  if (rng() % 5 == 0) {
    const size_t budgets[] = {256, 4096, 16384, 65536, 262144, size_t(1) << 22};
    c.device_budget_bytes = budgets[rng() % 6];
  }
  c.retain_arenas = rng() % 4 == 0;
  return c;
}

Case make_case(uint32_t seed) {
  std::mt19937 rng(seed);
  Case c;
  c.seed = seed;
  c.kind = Kind(rng() % 3);
  const int64_t dims[] = {1, 2, 3, 4, 5, 8, 16, 24, 32, 40, 64};
  const size_t count = 1 + rng() % 8;
  std::vector<Shape> cores;
  for (size_t i = 0; i < count; ++i) {
    Shape shape;
    const uint32_t form = rng() % 10;
    if (c.kind != Kind::muon && form == 0) {
      shape = {dims[rng() % 11] * 4};  // 1-D: AdamW only
    } else if (!cores.empty() && form < 4) {
      shape = cores[rng() % cores.size()];  // the same core shape again, elsewhere in the list
    } else {
      shape = {dims[rng() % 11], dims[rng() % 11]};
    }
    if (shape.size() == 2 && rng() % 5 == 0) shape.insert(shape.begin(), int64_t(1 + rng() % 3));  // a batch of matrices
    if (rng() % 24 == 0) shape.front() = 0;  // an empty param (a 0-byte state, if swapped)
    if (shape.size() >= 2) cores.push_back({shape[shape.size() - 2], shape.back()});
    // Names that route: "embed"/"norm" send a matrix to AdamW in MuonWithAdamW.
    const char* stems[] = {"w", "embed", "norm", "proj"};
    c.params.push_back({std::string(stems[rng() % 4]) + std::to_string(i), shape});
    const DType types[] = {DType::f32, DType::f32, DType::bf16, DType::f16};
    c.dtypes.push_back(types[rng() % 4]);
  }
  c.steps = 2 + int(rng() % 4);
  const double missing = (rng() % 3) * 0.2;  // 0, 0.2 or 0.4 of the grads missing per step
  for (int s = 0; s < c.steps; ++s) {
    std::vector<bool> grads;
    for (size_t i = 0; i < count; ++i) grads.push_back(std::uniform_real_distribution<double>(0, 1)(rng) >= missing);
    c.has_grad.push_back(grads);
    c.prefetch.push_back(rng() % 3 == 0);
  }
  c.reload_after = rng() % 2 == 0 ? int(rng() % uint32_t(c.steps)) : -1;
  c.config = random_config(rng);
  c.reload_config = random_config(rng);
  c.keys_mask = rng() % 3 == 0 ? 1 + rng() % 7 : 0;
  c.options_seed = uint32_t(rng());
  c.budget_eighths = rng() % 4 == 0 ? int(1 + rng() % 12) : 0;
  return c;
}

/** The optimizers of one side (bare or swapped) over `params`. */
struct Model {
  std::unique_ptr<Muon> muon;
  std::unique_ptr<AdamW> adamw;
  std::vector<Optimizer*> optimizers;
};

MuonOptions random_muon_options(std::mt19937& rng) {
  MuonOptions o;
  o.lr = 0.01 + 0.01 * double(rng() % 5);
  o.weight_decay = 0.1 * double(rng() % 3);
  o.nesterov = rng() % 2 == 0;
  if (rng() % 2 == 0) o.momentum2 = 0.8;
  const char* variants[] = {"asym5", "legacy", "polar_express"};
  o.ns_variant = variants[rng() % 3];
  o.ns_steps = 1 + int(rng() % 5);
  if (rng() % 4 == 0) o.max_batch_elements = 2048;  // memory-safe batches split shape groups
  return o;
}

AdamWOptions random_adamw_options(std::mt19937& rng) {
  AdamWOptions o;
  o.lr = 1e-3 * double(1 + rng() % 5);
  o.weight_decay = 0.01 * double(rng() % 3);
  o.amsgrad = rng() % 2 == 0;
  return o;
}

Model make_model(const Case& c, const std::vector<ParamPtr>& params) {
  std::mt19937 rng(c.options_seed);
  Model m;
  const Stream stream(Device::cpu());
  std::vector<ParamPtr> muon_params, adamw_params;
  for (const ParamPtr& p : params) {
    const bool matrix = p->data.dim() >= 2;
    const bool routed_to_adamw = p->name.rfind("embed", 0) == 0 || p->name.rfind("norm", 0) == 0;
    if (c.kind == Kind::muon || (c.kind == Kind::mixed && matrix && !routed_to_adamw)) {
      muon_params.push_back(p);
    } else {
      adamw_params.push_back(p);
    }
  }
  // One or two groups each, with their own options.
  auto add_groups = [&](auto& optimizer, std::vector<ParamPtr>& list, auto random_options) {
    if (list.empty()) return;
    const size_t cut = rng() % 2 == 0 ? list.size() : list.size() / 2;
    if (cut > 0) optimizer->add_param_group({list.begin(), list.begin() + long(cut)}, random_options(rng));
    if (cut < list.size()) optimizer->add_param_group({list.begin() + long(cut), list.end()}, random_options(rng));
    m.optimizers.push_back(optimizer.get());
  };
  m.muon = std::make_unique<Muon>(stream);
  m.adamw = std::make_unique<AdamW>(stream);
  add_groups(m.muon, muon_params, random_muon_options);
  add_groups(m.adamw, adamw_params, random_adamw_options);
  return m;
}

std::vector<std::unique_ptr<SwapOptimizer>> wrap(Model& m, SwapConfig config, uint32_t keys_mask, int budget_eighths) {
  auto configure = [&](const std::vector<std::string>& family, const StateSwapAdapter& adapter) {
    SwapConfig c = config;
    if (budget_eighths > 0) {
      int64_t workspace = 0, largest = 0;
      for (const UpdateUnit& u : adapter.plan_units(true)) {
        workspace = std::max(workspace, u.workspace_bytes);
        largest = std::max(largest, u.logical_bytes);
      }
      c.device_budget_bytes = size_t(workspace + std::max<int64_t>(512, largest * budget_eighths / 8));
    }
    if (keys_mask == 0) return c;
    c.state_keys.emplace();
    for (size_t k = 0; k < family.size(); ++k)
      if (keys_mask & (1u << k)) c.state_keys->push_back(family[k]);
    return c;
  };
  std::vector<std::unique_ptr<SwapOptimizer>> out;
  if (!m.muon->param_groups().empty())
    out.push_back(swap_muon(*m.muon, configure({"momentum_buffer"}, MuonSwapAdapter(*m.muon))));
  if (!m.adamw->param_groups().empty())
    out.push_back(swap_adamw(*m.adamw, configure(m.adamw->state_keys(), AdamWSwapAdapter(*m.adamw))));
  return out;
}

std::vector<ParamPtr> make_params(const Case& c) {
  std::vector<ParamPtr> out;
  for (size_t i = 0; i < c.params.size(); ++i)
    out.push_back(make_param(c.params[i].first, test::random_tensor(c.params[i].second, c.dtypes[i], c.seed * 7919u + uint32_t(i))));
  return out;
}

void set_grads(const Case& c, const std::vector<ParamPtr>& params, int step) {
  for (size_t i = 0; i < params.size(); ++i)
    params[i]->grad = c.has_grad[size_t(step)][i]
                          ? test::random_tensor(params[i]->data.shape(), c.dtypes[i], c.seed * 104729u + uint32_t(step * 131 + int(i)))
                          : Tensor();
}

/** Empty when bare and swapped agree bitwise; else what differs first. */
std::string compare(const std::vector<ParamPtr>& bare_params, const std::vector<ParamPtr>& swap_params, Model& bare,
                    std::vector<std::unique_ptr<SwapOptimizer>>& swapped) {
  for (Optimizer* o : bare.optimizers) o->stream().synchronize();
  for (auto& s : swapped) s->optimizer().stream().synchronize();
  for (size_t i = 0; i < bare_params.size(); ++i)
    if (!test::same_bits(bare_params[i]->data, swap_params[i]->data)) return "param '" + bare_params[i]->name + "'";
  for (size_t k = 0; k < swapped.size(); ++k) {
    const StateDict want = bare.optimizers[k]->state_dict(), got = swapped[k]->state_dict();
    if (want.metadata != got.metadata) return bare.optimizers[k]->name() + " metadata";
    if (want.tensors.size() != got.tensors.size()) return bare.optimizers[k]->name() + " state tensor count";
    for (const auto& [name, tensor] : want.tensors) {
      const auto it = got.tensors.find(name);
      if (it == got.tensors.end() || !test::same_bits(tensor, it->second)) return bare.optimizers[k]->name() + " " + name;
    }
  }
  return "";
}

long g_budget_errors = 0;  // cases that ended at a device budget too small for them

/** Runs one case; empty when it passed, else the first difference. */
std::string run_case(const Case& c) {
  const std::vector<ParamPtr> bare_params = make_params(c), swap_params = make_params(c);
  Model bare = make_model(c, bare_params);
  Model inner = make_model(c, swap_params);
  std::vector<std::unique_ptr<SwapOptimizer>> swapped = wrap(inner, c.config, c.keys_mask, c.budget_eighths);
  for (int step = 0; step < c.steps; ++step) {
    // Before the grads are known, as a trainer would; a budget too small prefetches nothing (the
    // step below names it).
    if (c.prefetch[size_t(step)])
      for (auto& s : swapped) s->prefetch_early();
    set_grads(c, bare_params, step);
    set_grads(c, swap_params, step);
    // Swapped first: a budget too small for this step's units is a named error that must leave
    // everything as it was, so the swapped side still equals the bare side before its step.
    size_t stepped = 0;
    try {
      for (; stepped < swapped.size(); ++stepped) swapped[stepped]->step();
    } catch (const Error& e) {
      if (std::string(e.what()).rfind("[swap] device_budget_bytes ", 0) != 0) throw;
      for (size_t k = 0; k < stepped; ++k) bare.optimizers[k]->step();  // those that did step
      const std::string diff = compare(bare_params, swap_params, bare, swapped);
      if (!diff.empty()) return "after a budget error at step " + std::to_string(step + 1) + ": " + diff + " differs";
      ++g_budget_errors;
      return "";  // the case ends here: its budget cannot run it
    }
    for (Optimizer* o : bare.optimizers) o->step();
    const std::string diff = compare(bare_params, swap_params, bare, swapped);
    if (!diff.empty()) return "after step " + std::to_string(step + 1) + ": " + diff + " differs";
    if (step == c.reload_after) {  // through the file format, into fresh optimizers and wrappers
      std::vector<std::string> files;
      for (auto& s : swapped) files.push_back(serialize_state_dict(s->state_dict()));
      swapped.clear();
      inner = make_model(c, swap_params);
      swapped = wrap(inner, c.reload_config, c.keys_mask, c.budget_eighths);
      for (size_t k = 0; k < swapped.size(); ++k) swapped[k]->load_state_dict(parse_state_dict(files[k].data(), files[k].size()));
      const std::string after = compare(bare_params, swap_params, bare, swapped);
      if (!after.empty()) return "after reloading at step " + std::to_string(step + 1) + ": " + after + " differs";
    }
  }
  return "";
}

}  // namespace

TEST_SUITE("swap") {
  TEST_CASE("randomized: swapped equals bare bitwise over random models, configs, missing grads, prefetch and reloads") {
    const char* seconds_env = std::getenv("SWAPOPT_RANDOM_SECONDS");
    const char* count_env = std::getenv("SWAPOPT_RANDOM_CONFIGS");
    const char* seed_env = std::getenv("SWAPOPT_RANDOM_SEED");
    const double seconds = seconds_env ? std::atof(seconds_env) : 0.0;
    const long count = count_env ? std::atol(count_env) : 2000;
    const uint32_t first = seed_env ? uint32_t(std::strtoul(seed_env, nullptr, 10))
                           : seconds > 0 ? uint32_t(std::chrono::system_clock::now().time_since_epoch().count())
                                         : 0u;
    const auto start = std::chrono::steady_clock::now();
    auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    long ran = 0, failed = 0;
    for (uint32_t seed = first;; ++seed) {
      if (seconds > 0 ? elapsed() >= seconds : ran >= count) break;
      const Case c = make_case(seed);
      std::string diff;
      try {
        diff = run_case(c);
      } catch (const std::exception& e) {
        diff = std::string("threw: ") + e.what();
      }
      ++ran;
      if (!diff.empty()) {
        ++failed;
        FAIL_CHECK("randomized case failed (rerun with SWAPOPT_RANDOM_SEED=" << seed << " SWAPOPT_RANDOM_CONFIGS=1): "
                                                                              << c.str() << ": " << diff);
        if (failed >= 5) break;
      }
    }
    MESSAGE("randomized bare vs swapped: " << ran << " configurations from seed " << first << " in " << elapsed() << " s, "
                                           << failed << " failed, " << g_budget_errors << " ended at a budget too small for them (nothing changed)");
    CHECK(ran > 0);
  }
}
