// swapopt-train: a residual tanh MLP trained on a synthetic teacher task with Muon (matrices) and
// AdamW (biases, output head), optimizer state swapped to host memory. Forward and backward are
// written by hand on swapopt's ops; the model runs on the CPU backend.
//
//   swapopt-train [--hidden 384] [--layers 4] [--steps 150] [--batch 256] [--swap-times 4]
//                 [--packed 1] [--no-swap] [--budget BYTES] [--seed 1] [--log-every 10]
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>

#include "swapopt/swapopt.h"

using namespace swapopt;

namespace {

struct Config {
  int64_t input = 128;
  int64_t hidden = 384;
  int64_t layers = 4;
  int64_t classes = 16;
  int64_t batch = 256;
  int steps = 150;
  int swap_times = 4;
  bool packed = true;
  bool swap = true;
  size_t budget = 0;
  uint32_t seed = 1;
  int log_every = 10;
};

constexpr const char* kFlags =
    "flags: --hidden N --layers N --steps N --batch N --swap-times N --packed 0|1 --no-swap --budget BYTES --seed N "
    "--log-every N --help\n";

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "swapopt-train: %s\n%s", why, kFlags);
  std::exit(2);
}

Config parse(int argc, char** argv) {
  Config c;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::printf("swapopt-train: a residual MLP trained with Muon + AdamW, optimizer state swapped to host memory\n%s",
                  kFlags);
      std::exit(0);
    }
    if (flag == "--no-swap") {
      c.swap = false;
      continue;
    }
    const std::map<std::string, std::function<void(long long)>> valued = {
        {"--hidden", [&](long long v) { c.hidden = v; }},
        {"--layers", [&](long long v) { c.layers = v; }},
        {"--steps", [&](long long v) { c.steps = int(v); }},
        {"--batch", [&](long long v) { c.batch = v; }},
        {"--swap-times", [&](long long v) { c.swap_times = int(v); }},
        {"--packed", [&](long long v) { c.packed = v == 1; }},
        {"--budget", [&](long long v) { c.budget = size_t(v); }},
        {"--seed", [&](long long v) { c.seed = uint32_t(v); }},
        {"--log-every", [&](long long v) { c.log_every = int(v); }},
    };
    const auto set = valued.find(flag);
    if (set == valued.end()) usage(("unknown flag " + flag).c_str());
    if (i + 1 >= argc) usage(("missing value for " + flag).c_str());
    const std::string text = argv[++i];
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(text.c_str(), &end, 10);
    if (text.empty() || *end != '\0' || errno == ERANGE) usage(("bad value '" + text + "' for " + flag).c_str());
    const long long most = flag == "--budget"   ? LLONG_MAX
                           : flag == "--seed"   ? UINT32_MAX
                           : flag == "--packed" ? 1
                                                : INT32_MAX;
    // Sizes and counts start at 1; --packed is 0 or 1, --budget (0: none) and --seed may be 0.
    const long long least = flag == "--packed" || flag == "--budget" || flag == "--seed" ? 0 : 1;
    if (v < least || v > most) usage(("value " + text + " for " + flag + " is out of range").c_str());
    set->second(v);
  }
  if (!c.swap && c.budget > 0) usage("--budget plans the swap: it cannot go with --no-swap");
  return c;
}

Tensor random_matrix(std::mt19937& gen, const Shape& shape, float scale) {
  std::normal_distribution<float> dist(0.f, scale);
  std::vector<float> v(size_t(shape_numel(shape)));
  for (float& x : v) x = dist(gen);
  return Tensor::from_floats(v, shape);
}

/** The model's parameters and the activations kept for backward. */
struct Model {
  ParamPtr w_in, b_in, head;
  std::vector<ParamPtr> blocks;
  std::vector<Tensor> acts;   // H_0 .. H_L  [batch, hidden]
  std::vector<Tensor> tanhs;  // tanh(Z_k) of each block [batch, hidden]

  std::vector<ParamPtr> params() const {
    std::vector<ParamPtr> out = {w_in, b_in};
    out.insert(out.end(), blocks.begin(), blocks.end());
    out.push_back(head);
    return out;
  }
};

Model make_model(const Config& c, std::mt19937& gen) {
  Model m;
  m.w_in = make_param("input.weight", random_matrix(gen, {c.hidden, c.input}, 1.f / std::sqrt(float(c.input))));
  m.b_in = make_param("input.bias", Tensor::zeros({c.hidden}, DType::f32, Device::cpu()));
  for (int64_t k = 0; k < c.layers; ++k)
    m.blocks.push_back(make_param("blocks." + std::to_string(k) + ".weight",
                                  random_matrix(gen, {c.hidden, c.hidden}, 0.5f / std::sqrt(float(c.hidden)))));
  m.head = make_param("head.weight", random_matrix(gen, {c.classes, c.hidden}, 1.f / std::sqrt(float(c.hidden))));
  return m;
}

void tanh_inplace(const Tensor& t) {
  float* v = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = std::tanh(v[i]);
}

/** Forward; returns the mean cross-entropy and writes d(loss)/d(logits) into `dlogits`. */
float forward(Stream& s, Model& m, const Tensor& x, const std::vector<int>& labels, const Tensor& dlogits) {
  const int64_t batch = x.size(0), hidden = m.w_in->data.size(0);
  Tensor h = Tensor::empty({batch, hidden}, DType::f32, Device::cpu());
  ops::gemm(s, x, false, m.w_in->data, true, h);
  s.synchronize();
  const float* bias = m.b_in->data.data<float>();
  float* hv = h.data<float>();
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t j = 0; j < hidden; ++j) hv[i * hidden + j] = std::tanh(hv[i * hidden + j] + bias[j]);
  m.acts = {h};
  m.tanhs.clear();
  for (const ParamPtr& w : m.blocks) {
    Tensor t = Tensor::empty({batch, hidden}, DType::f32, Device::cpu());
    ops::gemm(s, m.acts.back(), false, w->data, true, t);
    s.synchronize();
    tanh_inplace(t);
    Tensor next = m.acts.back().clone();
    ops::axpby(s, 1.f, t, 1.f, next);  // residual
    m.tanhs.push_back(t);
    m.acts.push_back(next);
  }
  const int64_t classes = m.head->data.size(0);
  Tensor logits = Tensor::empty({batch, classes}, DType::f32, Device::cpu());
  ops::gemm(s, m.acts.back(), false, m.head->data, true, logits);
  s.synchronize();
  const float* lv = logits.data<float>();
  float* dv = dlogits.data<float>();
  double loss = 0;
  for (int64_t i = 0; i < batch; ++i) {
    float top = lv[i * classes];
    for (int64_t j = 1; j < classes; ++j) top = std::max(top, lv[i * classes + j]);
    double sum = 0;
    for (int64_t j = 0; j < classes; ++j) sum += std::exp(double(lv[i * classes + j] - top));
    for (int64_t j = 0; j < classes; ++j) {
      const double p = std::exp(double(lv[i * classes + j] - top)) / sum;
      dv[i * classes + j] = float((p - (j == labels[size_t(i)] ? 1.0 : 0.0)) / double(batch));
    }
    loss -= double(lv[i * classes + labels[size_t(i)]] - top) - std::log(sum);
  }
  return float(loss / double(batch));
}

/** Backward: sets every parameter's grad. */
void backward(Stream& s, Model& m, const Tensor& x, const Tensor& dlogits) {
  const int64_t batch = x.size(0), hidden = m.w_in->data.size(0);
  m.head->grad = Tensor::empty(m.head->data.shape(), DType::f32, Device::cpu());
  ops::gemm(s, dlogits, true, m.acts.back(), false, m.head->grad);
  Tensor dh = Tensor::empty({batch, hidden}, DType::f32, Device::cpu());
  ops::gemm(s, dlogits, false, m.head->data, false, dh);
  for (size_t k = m.blocks.size(); k-- > 0;) {
    s.synchronize();
    Tensor dz = Tensor::empty({batch, hidden}, DType::f32, Device::cpu());
    const float* t = m.tanhs[k].data<float>();
    const float* g = dh.data<float>();
    float* dzv = dz.data<float>();
    for (int64_t i = 0; i < batch * hidden; ++i) dzv[i] = g[i] * (1.f - t[i] * t[i]);
    m.blocks[k]->grad = Tensor::empty(m.blocks[k]->data.shape(), DType::f32, Device::cpu());
    ops::gemm(s, dz, true, m.acts[k], false, m.blocks[k]->grad);
    ops::gemm(s, dz, false, m.blocks[k]->data, false, dh, 1.f, 1.f);  // dH_{k} += dZ W
  }
  s.synchronize();
  Tensor dz = Tensor::empty({batch, hidden}, DType::f32, Device::cpu());
  const float* h0 = m.acts[0].data<float>();
  const float* g = dh.data<float>();
  float* dzv = dz.data<float>();
  for (int64_t i = 0; i < batch * hidden; ++i) dzv[i] = g[i] * (1.f - h0[i] * h0[i]);
  m.w_in->grad = Tensor::empty(m.w_in->data.shape(), DType::f32, Device::cpu());
  ops::gemm(s, dz, true, x, false, m.w_in->grad);
  m.b_in->grad = Tensor::zeros({hidden}, DType::f32, Device::cpu());
  float* db = m.b_in->grad.data<float>();
  for (int64_t i = 0; i < batch; ++i)
    for (int64_t j = 0; j < hidden; ++j) db[j] += dzv[i * hidden + j];
}

}  // namespace

int run(const Config& c);

int main(int argc, char** argv) {
  const Config c = parse(argc, argv);
  try {
    return run(c);
  } catch (const Error& e) {  // e.g. a --budget below a unit's workspace: the message says both sizes
    std::fflush(stdout);      // the banner printed so far comes before the error, also in one log
    std::fprintf(stderr, "swapopt-train: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {  // sizes too large for this machine's memory
    std::fflush(stdout);
    std::fprintf(stderr, "swapopt-train: out of memory for --hidden %lld, --layers %lld, --batch %lld\n",
                 (long long)c.hidden, (long long)c.layers, (long long)c.batch);
    return 1;
  }
}

int run(const Config& c) {
  std::mt19937 gen(c.seed);
  Stream stream(Device::cpu());
  Model model = make_model(c, gen);
  // The teacher: a fixed random 2-layer net whose argmax labels the inputs.
  const Tensor teacher1 = random_matrix(gen, {64, c.input}, 1.f), teacher2 = random_matrix(gen, {c.classes, 64}, 1.f);

  MuonOptions muon_options;
  muon_options.lr = 0.02;
  // One matrix per Newton-Schulz batch, so that each block is its own swap unit (Muon's default
  // would batch all equal-shaped blocks together, and a unit is never split).
  muon_options.max_batch_elements = c.hidden * c.hidden;
  AdamWOptions adamw_options;
  adamw_options.lr = 3e-3;
  MuonWithAdamW opt(stream, model.params(), muon_options, adamw_options);
  SwapConfig swap;
  swap.swap_times = c.swap_times;
  swap.packed = c.packed;
  if (c.budget > 0) swap.device_budget_bytes = c.budget;
  std::unique_ptr<SwapOptimizerSet> swapped;  // Muon's momentum and AdamW's moments, stepped as one
  if (c.swap) swapped = swap_muon_with_adamw(opt, swap);
  std::printf("swapopt-train: hidden %lld, %lld blocks, batch %lld, %d steps, swap %s (swap_times %d, %s)\n",
              (long long)c.hidden, (long long)c.layers, (long long)c.batch, c.steps, c.swap ? "on" : "off", c.swap_times,
              c.packed ? "packed" : "per-tensor");
  std::printf("routing:\n%s\n", routing_report(opt.routing()).c_str());

  std::normal_distribution<float> normal(0.f, 1.f);
  Tensor x = Tensor::empty({c.batch, c.input}, DType::f32, Device::cpu());
  Tensor teacher_hidden = Tensor::empty({c.batch, 64}, DType::f32, Device::cpu());
  Tensor teacher_logits = Tensor::empty({c.batch, c.classes}, DType::f32, Device::cpu());
  Tensor dlogits = Tensor::empty({c.batch, c.classes}, DType::f32, Device::cpu());
  std::vector<int> labels(size_t(c.batch));
  size_t peak_swapped_resident = 0;
  int chunked_units = 0;  // per step, the most (a unit too large for --budget streams in chunks)
  float loss = 0.f, first_loss = 0.f;
  double total_ms = 0.0, steady_ms = 0.0;
  const int warmup = std::min(10, c.steps / 2);  // first steps allocate and warm caches: not steady state
  for (int step = 1; step <= c.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    float* xv = x.data<float>();
    for (int64_t i = 0; i < x.numel(); ++i) xv[i] = normal(gen);
    ops::gemm(stream, x, false, teacher1, true, teacher_hidden);
    stream.synchronize();
    tanh_inplace(teacher_hidden);
    ops::gemm(stream, teacher_hidden, false, teacher2, true, teacher_logits);
    stream.synchronize();
    const float* tl = teacher_logits.data<float>();
    for (int64_t i = 0; i < c.batch; ++i)
      labels[size_t(i)] = int(std::max_element(tl + i * c.classes, tl + (i + 1) * c.classes) - (tl + i * c.classes));

    loss = forward(stream, model, x, labels, dlogits);
    if (step == 1) first_loss = loss;
    backward(stream, model, x, dlogits);
    if (c.swap) {
      swapped->step();
      // The last completed step's reports (reading them never waits).
      peak_swapped_resident = std::max(peak_swapped_resident, swapped->member("muon").last_report().peak_resident_bytes +
                                                                  swapped->member("adamw").last_report().peak_resident_bytes);
      chunked_units = std::max(chunked_units, swapped->last_report().chunked_units);
    } else {
      opt.step();
    }
    stream.synchronize();
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    total_ms += ms;
    if (step > warmup) steady_ms += ms;
    if (step % c.log_every == 0 || step == 1 || step == c.steps)
      std::printf("step %4d  loss %.4f  step %.1f ms\n", step, loss, ms);
  }
  // Device-resident optimizer bytes: without swap, all state; with swap, the state that stays on
  // the device (below min_numel) plus the peak that the pipeline brought over at once.
  size_t all_state = 0, stays = 0;
  if (swapped) swapped->synchronize();
  const std::pair<Optimizer*, SwapOptimizer*> pairs[] = {{&opt.muon(), swapped ? &swapped->member("muon") : nullptr},
                                                         {&opt.adamw(), swapped ? &swapped->member("adamw") : nullptr}};
  for (const auto& [o, wrapper] : pairs)
    for (const auto& [param, ps] : o->state())
      for (const auto& [key, t] : ps.tensors) {
        all_state += t.nbytes();
        if (wrapper == nullptr || wrapper->runtime().find_slot(param, key) == nullptr) stays += t.nbytes();
      }
  std::printf("\nsummary\n");
  std::printf("  loss: %.4f -> %.4f\n", first_loss, loss);
  const int steady = c.steps - warmup;
  if (warmup == 0) {
    std::printf("  steps/s: %.2f (%.1f ms/step; no warm-up in a run of %d step%s)\n", 1000.0 * steady / steady_ms,
                steady_ms / steady, c.steps, c.steps == 1 ? "" : "s");
  } else {
    std::printf(
        "  steps/s: %.2f steady state (%.1f ms/step over steps %d-%d; with the %d warm-up step%s %.1f ms/step)\n",
        1000.0 * steady / steady_ms, steady_ms / steady, warmup + 1, c.steps, warmup, warmup == 1 ? "" : "s",
        total_ms / c.steps);
  }
  std::printf("  optimizer state: %zu bytes\n", all_state);
  std::printf("  peak device-resident optimizer bytes without swap: %zu\n", all_state);
  if (c.swap) std::printf("  peak device-resident optimizer bytes with swap:    %zu (%.1f%%)\n", stays + peak_swapped_resident,
                          100.0 * double(stays + peak_swapped_resident) / double(all_state));
  if (chunked_units > 0) std::printf("  units streamed in chunks (too large for the budget whole): %d per step\n", chunked_units);
  return loss < first_loss ? 0 : 1;
}
