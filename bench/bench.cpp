// swapopt-bench: microbenchmarks. Each subcommand prints one JSON object per line (prefixed by
// nothing, for scripts) followed by a human table on stderr. Times are medians of repeated runs.
//
//   swapopt-bench ns        Newton-Schulz GFLOP/s per shape and dtype vs the backend's GEMM
//   swapopt-bench momentum  GB/s of the fused momentum update vs memcpy
//   swapopt-bench swap      swapped vs bare Muon step, swap_times 1..8, packed on/off
//   swapopt-bench step      a whole Muon + AdamW step on transformer-like shapes
//   swapopt-bench adamw     an AdamW step over the same shapes
//   options: --device cpu|cuda  --reps N  --dim D (model width for swap/step)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "swapopt/swapopt.h"

using namespace swapopt;

namespace {

struct Options {
  Device device = Device::cpu();
  int reps = 5;
  int64_t dim = 512;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : (v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]));
}

/** Median milliseconds of `fn` (one warm-up run first); `sync` waits for the work. */
double time_ms(int reps, const std::function<void()>& fn, const std::function<void()>& sync) {
  fn();
  sync();
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    sync();
    samples.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(samples);
}

Tensor random_tensor(const Shape& shape, DType dtype, Device device, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(size_t(shape_numel(shape)));
  for (float& x : v) x = dist(gen);
  return Tensor::from_floats(v, shape, dtype, device);
}

void run_ns(const Options& o) {
  Stream s(o.device);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{256, 256}, {512, 512}, {1024, 1024}, {512, 2048}, {2048, 512}};
  std::vector<DType> dtypes = {DType::f32};
  if (o.device.is_cuda()) dtypes.push_back(DType::bf16);
  std::fprintf(stderr, "%-12s %-5s %10s %10s %10s %8s\n", "shape", "dtype", "ns_ms", "ns_gflops", "gemm_gflops", "ratio");
  for (DType dt : dtypes)
    for (auto [m, n] : shapes) {
      const Tensor x0 = random_tensor({1, m, n}, dt, o.device, 1);
      const Tensor x = Tensor::empty_like(x0);
      const auto schedule = ns_schedule("asym5", 5, {});
      const double ns_ms = time_ms(o.reps, [&] {
            ops::copy(s, x0, x);
            newton_schulz(s, x, schedule, 1e-7f);
          }, [&] { s.synchronize(); });
      const double useful = newton_schulz_flops(m, n, 5);
      // The same backend's GEMM on NS's dominant product: [k, k] @ [k, l], k = min, l = max.
      const int64_t k = std::min(m, n), l = std::max(m, n);
      const Tensor a = random_tensor({k, k}, dt, o.device, 2), b = random_tensor({k, l}, dt, o.device, 3);
      const Tensor c = Tensor::empty({k, l}, dt, o.device);
      const double gemm_ms = time_ms(o.reps, [&] { ops::gemm(s, a, false, b, false, c); }, [&] { s.synchronize(); });
      const double ns_gflops = useful / ns_ms / 1e6, gemm_gflops = 2.0 * double(k) * double(k) * double(l) / gemm_ms / 1e6;
      std::printf("{\"bench\":\"ns\",\"device\":\"%s\",\"m\":%lld,\"n\":%lld,\"dtype\":\"%s\",\"ns_ms\":%.3f,\"ns_gflops\":%.2f,"
                  "\"gemm_gflops\":%.2f,\"ratio\":%.3f}\n",
                  o.device.str().c_str(), (long long)m, (long long)n, dtype_name(dt), ns_ms, ns_gflops, gemm_gflops,
                  ns_gflops / gemm_gflops);
      std::fprintf(stderr, "%5lldx%-6lld %-5s %10.3f %10.2f %10.2f %8.3f\n", (long long)m, (long long)n, dtype_name(dt), ns_ms,
                   ns_gflops, gemm_gflops, ns_gflops / gemm_gflops);
    }
}

void run_momentum(const Options& o) {
  Stream s(o.device);
  std::fprintf(stderr, "%-10s %12s %12s %8s\n", "elements", "momentum_GBs", "memcpy_GBs", "ratio");
  for (int64_t n : {int64_t(1) << 20, int64_t(1) << 24}) {
    const Tensor g = random_tensor({n}, DType::f32, o.device, 1), buf = Tensor::zeros({n}, DType::f32, o.device);
    const Tensor u = Tensor::empty({n}, DType::f32, o.device);
    const Tensor src = random_tensor({n}, DType::f32, o.device, 2), dst = Tensor::empty({n}, DType::f32, o.device);
    const double mom_ms = time_ms(o.reps, [&] { ops::muon_momentum(s, g, buf, u, 0.95f, 0.95f, true); }, [&] { s.synchronize(); });
    const double copy_ms = time_ms(o.reps, [&] { ops::copy(s, src, dst); }, [&] { s.synchronize(); });
    // momentum reads g and buf, writes buf and u; memcpy reads and writes once.
    const double mom_gbs = 16.0 * double(n) / mom_ms / 1e6, copy_gbs = 8.0 * double(n) / copy_ms / 1e6;
    std::printf("{\"bench\":\"momentum\",\"device\":\"%s\",\"elements\":%lld,\"momentum_gbs\":%.2f,\"memcpy_gbs\":%.2f,"
                "\"ratio\":%.3f}\n",
                o.device.str().c_str(), (long long)n, mom_gbs, copy_gbs, mom_gbs / copy_gbs);
    std::fprintf(stderr, "%-10lld %12.2f %12.2f %8.3f\n", (long long)n, mom_gbs, copy_gbs, mom_gbs / copy_gbs);
  }
}

/** Transformer-like matrices of width d: attention qkv and output, MLP up and down, per layer. */
std::vector<ParamPtr> model_params(int64_t d, int layers, Device device) {
  std::vector<ParamPtr> params;
  for (int l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    params.push_back(make_param(p + "attn.qkv", random_tensor({3 * d, d}, DType::f32, device, 10 + l)));
    params.push_back(make_param(p + "attn.out", random_tensor({d, d}, DType::f32, device, 20 + l)));
    params.push_back(make_param(p + "mlp.up", random_tensor({4 * d, d}, DType::f32, device, 30 + l)));
    params.push_back(make_param(p + "mlp.down", random_tensor({d, 4 * d}, DType::f32, device, 40 + l)));
    params.push_back(make_param(p + "norm.weight", random_tensor({d}, DType::f32, device, 50 + l)));
  }
  return params;
}

void set_grads(const std::vector<ParamPtr>& params) {
  for (const ParamPtr& p : params)
    if (!p->grad.defined()) p->grad = random_tensor(p->data.shape(), p->data.dtype(), p->data.device(), 99);
}

void run_swap(const Options& o) {
  const int layers = 2;
  auto params = model_params(o.dim, layers, o.device);
  set_grads(params);
  Stream stream(o.device);
  std::fprintf(stderr, "%-7s %-6s %10s %10s %8s %12s %14s\n", "packed", "swaps", "bare_ms", "swap_ms", "ratio", "exposed_ms",
               "peak_resident");
  for (bool packed : {true, false})
    for (int t = 1; t <= 8; ++t) {
      // One matrix per NS batch, so each matrix is its own unit and swap_times is honoured.
      MuonOptions mo;
      mo.max_batch_elements = 4 * o.dim * o.dim;
      Muon bare(stream);
      bare.add_param_group({params[0], params[1], params[2], params[3], params[5], params[6], params[7], params[8]}, mo);
      Muon inner(stream);
      inner.add_param_group({params[0], params[1], params[2], params[3], params[5], params[6], params[7], params[8]}, mo);
      SwapConfig c;
      c.swap_times = t;
      c.packed = packed;
      auto swapped = swap_muon(inner, c);
      // Interleave bare and swapped runs so that machine noise hits both alike.
      std::vector<double> bare_ms, swap_ms, exposed;
      size_t peak = 0;
      for (int r = 0; r < o.reps + 1; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        bare.step();
        stream.synchronize();
        const auto t1 = std::chrono::steady_clock::now();
        swapped->step();
        stream.synchronize();
        swapped->runtime().copy_stream().synchronize();
        const auto t2 = std::chrono::steady_clock::now();
        const SwapStepReport report = swapped->last_report();
        if (r == 0) continue;  // warm-up
        bare_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        swap_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
        exposed.push_back(report.exposed_wait_ms);
        peak = report.peak_resident_bytes;
      }
      const double b = median(bare_ms), s = median(swap_ms);
      std::printf("{\"bench\":\"swap\",\"device\":\"%s\",\"dim\":%lld,\"packed\":%s,\"swap_times\":%d,\"bare_ms\":%.3f,"
                  "\"swap_ms\":%.3f,\"ratio\":%.3f,\"exposed_wait_ms\":%.3f,\"peak_resident_bytes\":%zu}\n",
                  o.device.str().c_str(), (long long)o.dim, packed ? "true" : "false", t, b, s, s / b, median(exposed), peak);
      std::fprintf(stderr, "%-7s %-6d %10.2f %10.2f %8.3f %12.3f %14zu\n", packed ? "yes" : "no", t, b, s, s / b,
                   median(exposed), peak);
    }
}

void run_step(const Options& o) {
  const int layers = 4;
  auto params = model_params(o.dim, layers, o.device);
  set_grads(params);
  Stream stream(o.device);
  MuonWithAdamW opt(stream, params);
  const double ms = time_ms(o.reps, [&] { opt.step(); }, [&] { stream.synchronize(); });
  size_t muon_params = 0;
  for (const ParamPtr& p : opt.muon().param_groups()[0].params) muon_params += size_t(p->data.numel());
  std::printf("{\"bench\":\"step\",\"device\":\"%s\",\"dim\":%lld,\"layers\":%d,\"muon_params\":%zu,\"step_ms\":%.3f}\n",
              o.device.str().c_str(), (long long)o.dim, layers, muon_params, ms);
  std::fprintf(stderr, "Muon+AdamW step, width %lld, %d layers (%zu Muon params): %.2f ms\n", (long long)o.dim, layers,
               muon_params, ms);
}

void run_adamw(const Options& o) {
  const int layers = 4;
  auto params = model_params(o.dim, layers, o.device);
  set_grads(params);
  Stream stream(o.device);
  AdamW adamw(stream);
  adamw.add_param_group(params);
  const double ms = time_ms(o.reps, [&] { adamw.step(); }, [&] { stream.synchronize(); });
  size_t elements = 0;
  for (const ParamPtr& p : params) elements += size_t(p->data.numel());
  std::printf("{\"bench\":\"adamw\",\"device\":\"%s\",\"dim\":%lld,\"layers\":%d,\"params\":%zu,\"step_ms\":%.3f}\n",
              o.device.str().c_str(), (long long)o.dim, layers, elements, ms);
  std::fprintf(stderr, "AdamW step, width %lld, %d layers (%zu params): %.2f ms\n", (long long)o.dim, layers, elements, ms);
}

}  // namespace

int main(int argc, char** argv) {
  const char* usage = "usage: swapopt-bench ns|momentum|swap|step|adamw [--device cpu|cuda] [--reps N] [--dim D]\n";
  if (argc >= 2 && (std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h")) {
    std::printf("%s", usage);
    return 0;
  }
  if (argc < 2) {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  const std::string command = argv[1];
  Options o;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--device") o.device = value == "cuda" ? Device::cuda(0) : Device::cpu();
    else if (flag == "--reps") o.reps = std::max(1, std::atoi(value.c_str()));
    else if (flag == "--dim") o.dim = std::max(16, std::atoi(value.c_str()));
    else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  try {
    if (command == "ns") run_ns(o);
    else if (command == "momentum") run_momentum(o);
    else if (command == "swap") run_swap(o);
    else if (command == "step") run_step(o);
    else if (command == "adamw") run_adamw(o);
    else {
      std::fprintf(stderr, "unknown subcommand %s\n", command.c_str());
      return 2;
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "swapopt-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
