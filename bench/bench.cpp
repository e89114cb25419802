// swapopt-bench: microbenchmarks. Each subcommand prints one JSON object per line (for scripts:
// bench/report.py turns them into docs/benchmarks.md) and a human table on stderr. Times are the
// median of --reps timed runs after one warm-up run; "_lo"/"_hi" fields are the fastest and
// slowest of those runs (the spread).
//
//   swapopt-bench ns        Newton-Schulz GFLOP/s per shape and dtype vs the backend's GEMM
//   swapopt-bench momentum  GB/s of the fused momentum update vs memcpy
//   swapopt-bench swap      swapped vs bare Muon step, swap_times 1..8, packed on/off
//   swapopt-bench step      a whole Muon + AdamW step on transformer-like shapes, by width
//   swapopt-bench adamw     an AdamW step over the same shapes, by width
//   swapopt-bench scale     AdamW over 100..50000 small params: swapped vs bare step, state_dict
//                           and load_state_dict time per param (what grows with the param count);
//                           with --budget BYTES the swapped optimizer plans under that device budget,
//                           with --params N only that many params (scripts/host-instructions.sh),
//                           with --retain-arenas 1 the swapped step alone, its arenas kept across
//                           steps (SwapConfig::retain_arenas; a process of its own, since what an
//                           allocator keeps is process-wide)
//   swapopt-bench pipeline  GB/s of pinned H2D alone, D2H alone and both at once on two streams
//                           (as the swap pipeline copies), vs a device-to-device copy
//   swapopt-bench checkpoint  peak process memory (the kernel's VmHWM) of saving and of loading
//                           512 MiB of swapped AdamW state, through a StateDict and streamed, each
//                           in a process of its own, against a process that only steps
//   swapopt-bench ops       host time per op issued (swapopt's checks, dispatch and launch) for
//                           small ops and a whole Newton-Schulz, and on CUDA the same runtime or
//                           cuBLAS call made directly, on the same stream
//   options: --device cpu|cuda  --reps N  --dim D (model width: swap's, and the only one of step/adamw)
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "swapopt/swapopt.h"

#ifdef SWAPOPT_BENCH_RAW_CUDA
#include "raw_cuda.h"
#endif

using namespace swapopt;

namespace {

struct Options {
  Device device = Device::cpu();
  int reps = 5;
  int64_t dim = 512;
  bool dim_given = false;
  size_t budget = 0;  // scale: the swapped optimizer's device_budget_bytes (0: none)
  int64_t params = 0;  // scale: only this many params (0: 100 to 50000)
  bool retain_arenas = false;  // scale: SwapConfig::retain_arenas, and no state-dict timings
};

/** Repeated measurements of one figure: the median and the spread (fastest, slowest). */
struct Spread {
  double median = 0, lo = 0, hi = 0;

  explicit Spread(std::vector<double> v) {
    if (v.empty()) return;
    std::sort(v.begin(), v.end());
    median = v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
    lo = v.front();
    hi = v.back();
  }
  /** The same spread as a rate: `work / ms` (the fastest time is the highest rate). */
  Spread rate(double work) const { return Spread({work / median, work / hi, work / lo}); }
  /** The same spread times `k` (e.g. per item). */
  Spread scaled(double k) const { return Spread({median * k, lo * k, hi * k}); }
  /** JSON fields "<name>", "<name>_lo", "<name>_hi". */
  std::string json(const char* name) const {
    char buf[160];
    std::snprintf(buf, sizeof buf, "\"%s\":%.4g,\"%s_lo\":%.4g,\"%s_hi\":%.4g", name, median, name, lo, name, hi);
    return buf;
  }
};

/** Milliseconds of one run of `fn`, `sync` waiting for its work. */
double once_ms(const std::function<void()>& fn, const std::function<void()>& sync) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  sync();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/** Milliseconds of `fn` over `reps` runs (one warm-up run first); `sync` waits for the work. */
Spread time_ms(int reps, const std::function<void()>& fn, const std::function<void()>& sync) {
  once_ms(fn, sync);
  std::vector<double> samples;
  for (int r = 0; r < reps; ++r) samples.push_back(once_ms(fn, sync));
  return Spread(samples);
}

/** Milliseconds of `a` and of `b` over `reps` runs each, alternating (a warm-up of each first), so
 *  that both see the machine in the same state; sample r of one is paired with sample r of the other. */
std::pair<std::vector<double>, std::vector<double>> time_alternating_ms(int reps, const std::function<void()>& a,
                                                                        const std::function<void()>& b,
                                                                        const std::function<void()>& sync) {
  std::pair<std::vector<double>, std::vector<double>> samples;
  once_ms(a, sync);
  once_ms(b, sync);
  for (int r = 0; r < reps; ++r) {
    samples.first.push_back(once_ms(a, sync));
    samples.second.push_back(once_ms(b, sync));
  }
  return samples;
}

/** The median over the pairs of time_alternating_ms of (a_work / a's ms) / (b_work / b's ms). */
double median_pair_ratio(const std::vector<double>& a_ms, double a_work, const std::vector<double>& b_ms, double b_work) {
  std::vector<double> ratios;
  for (size_t r = 0; r < a_ms.size(); ++r) ratios.push_back((a_work / a_ms[r]) / (b_work / b_ms[r]));
  return Spread(ratios).median;
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
  std::vector<std::pair<int64_t, int64_t>> shapes = {{256, 256}, {512, 512}, {1024, 1024}, {512, 2048}, {2048, 512}};
  std::vector<DType> dtypes = {DType::f32};
  if (o.device.is_cuda()) {  // the sizes where a GPU's NS is compute-bound; minutes each on a CPU
    shapes.insert(shapes.end(), {{2048, 2048}, {4096, 4096}, {1024, 4096}, {4096, 1024}});
    dtypes.push_back(DType::bf16);
  }
  // On a GPU one sample is `inner` back-to-back runs, so that the wait for the stream (tens of us)
  // does not count as the work of a sub-millisecond op; on the CPU the ops run as they are queued.
  const int inner = o.device.is_cuda() ? 10 : 1;
  auto repeated = [inner](const std::function<void()>& fn) {
    return [inner, fn] {
      for (int i = 0; i < inner; ++i) fn();
    };
  };
  std::fprintf(stderr, "%-12s %-5s %10s %10s %10s %8s %8s\n", "shape", "dtype", "ns_ms", "ns_gflops", "gemm_gflops", "ratio",
               "norm_%");
  for (DType dt : dtypes)
    for (auto [m, n] : shapes) {
      const Tensor x0 = random_tensor({1, m, n}, dt, o.device, 1);
      const Tensor x = Tensor::empty_like(x0);
      const Tensor norms = Tensor::empty({1}, DType::f32, o.device);
      const auto schedule = ns_schedule("asym5", 5, {});
      // The same backend's GEMM on NS's dominant product: [k, k] @ [k, l], k = min, l = max.
      const int64_t k = std::min(m, n), l = std::max(m, n);
      const Tensor a = random_tensor({k, k}, dt, o.device, 2), b = random_tensor({k, l}, dt, o.device, 3);
      const Tensor c = Tensor::empty({k, l}, dt, o.device);
      // NS and GEMM alternate; the ratio is the median of each pair's ratio.
      const auto [ns_samples, gemm_samples] = time_alternating_ms(
          o.reps,
          repeated([&] {
            ops::copy(s, x0, x);
            newton_schulz(s, x, schedule, 1e-7f);
          }),
          repeated([&] { ops::gemm(s, a, false, b, false, c); }), [&] { s.synchronize(); });
      // The norm NS starts with, alone: its share of the NS time.
      const Spread norm_ms = time_ms(o.reps, repeated([&] { ops::frobenius_norm(s, x0, norms); }), [&] { s.synchronize(); })
                                 .scaled(1.0 / inner);
      const Spread ns_ms = Spread(ns_samples).scaled(1.0 / inner), gemm_ms = Spread(gemm_samples).scaled(1.0 / inner);
      const double useful = newton_schulz_flops(m, n, 5), gemm_flops = 2.0 * double(k) * double(k) * double(l);
      // As the backend runs it: CUDA has no bf16 SYRK, so there each symmetric product is a full
      // GEMM (twice its useful flops), or from side 4096 the GEMMs of 3 of its 2 x 2 blocks (1.5x);
      // everywhere else they are SYRKs. Per step: Gram k x k over l, its square, and the k x l GEMM.
      const double small = double(k), large = double(l);
      const double sym = !(o.device.is_cuda() && dt != DType::f32) ? 1.0 : k >= 4096 ? 1.5 : 2.0;
      const double executed = 5.0 * (sym * small * small * large + sym * small * small * small + 2 * small * small * large);
      const Spread ns_gflops = ns_ms.rate(useful / 1e6), executed_gflops = ns_ms.rate(executed / 1e6),
                   gemm_gflops = gemm_ms.rate(gemm_flops / 1e6);
      const double ratio = median_pair_ratio(ns_samples, useful, gemm_samples, gemm_flops);
      const double norm_share = norm_ms.median / ns_ms.median;
      std::printf("{\"bench\":\"ns\",\"device\":\"%s\",\"m\":%lld,\"n\":%lld,\"dtype\":\"%s\",%s,%s,%s,%s,\"ratio\":%.3f,%s,"
                  "\"norm_share\":%.4f}\n",
                  o.device.str().c_str(), (long long)m, (long long)n, dtype_name(dt), ns_ms.json("ns_ms").c_str(),
                  ns_gflops.json("ns_gflops").c_str(), executed_gflops.json("executed_gflops").c_str(),
                  gemm_gflops.json("gemm_gflops").c_str(), ratio, norm_ms.json("norm_ms").c_str(), norm_share);
      std::fprintf(stderr, "%5lldx%-6lld %-5s %10.3f %10.2f %10.2f %8.3f %8.2f\n", (long long)m, (long long)n, dtype_name(dt),
                   ns_ms.median, ns_gflops.median, gemm_gflops.median, ratio, 100 * norm_share);
    }
}

void run_momentum(const Options& o) {
  Stream s(o.device);
  std::fprintf(stderr, "%-10s %12s %12s %8s\n", "elements", "momentum_GBs", "memcpy_GBs", "ratio");
  for (int64_t n : {int64_t(1) << 20, int64_t(1) << 24}) {
    const Tensor g = random_tensor({n}, DType::f32, o.device, 1), buf = Tensor::zeros({n}, DType::f32, o.device);
    const Tensor u = Tensor::empty({n}, DType::f32, o.device);
    const Tensor src = random_tensor({n}, DType::f32, o.device, 2), dst = Tensor::empty({n}, DType::f32, o.device);
    // Alternating runs; the ratio is the median of each pair's ratio.
    const auto [mom_samples, copy_samples] = time_alternating_ms(
        o.reps, [&] { ops::muon_momentum(s, g, buf, u, 0.95f, 0.95f, true); }, [&] { ops::copy(s, src, dst); },
        [&] { s.synchronize(); });
    // momentum reads g and buf, writes buf and u; memcpy reads and writes once.
    const double mom_bytes = 16.0 * double(n), copy_bytes = 8.0 * double(n);
    const Spread mom_gbs = Spread(mom_samples).rate(mom_bytes / 1e6), copy_gbs = Spread(copy_samples).rate(copy_bytes / 1e6);
    const double ratio = median_pair_ratio(mom_samples, mom_bytes, copy_samples, copy_bytes);
    std::printf("{\"bench\":\"momentum\",\"device\":\"%s\",\"elements\":%lld,%s,%s,\"ratio\":%.3f}\n",
                o.device.str().c_str(), (long long)n, mom_gbs.json("momentum_gbs").c_str(), copy_gbs.json("memcpy_gbs").c_str(),
                ratio);
    std::fprintf(stderr, "%-10lld %12.2f %12.2f %8.3f\n", (long long)n, mom_gbs.median, copy_gbs.median, ratio);
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
  // A stand-in for the trainer's backward pass: per matrix [out, in], the two GEMMs of its
  // gradients for a batch of `dim` tokens (dX = dY W, dW = dY^T X), on the optimizer's stream.
  struct Grads {
    Tensor w, x, dy, dx, dw;
  };
  std::vector<Grads> grads;
  for (const ParamPtr& p : params) {
    if (p->data.dim() != 2) continue;
    const int64_t out = p->data.size(0), in = p->data.size(1);
    grads.push_back({p->data, random_tensor({o.dim, in}, DType::f32, o.device, 60), random_tensor({o.dim, out}, DType::f32, o.device, 61),
                     Tensor::empty({o.dim, in}, DType::f32, o.device), Tensor::empty({out, in}, DType::f32, o.device)});
  }
  const auto backward = [&] {
    for (const Grads& g : grads) {
      ops::gemm(stream, g.dy, false, g.w, false, g.dx);
      ops::gemm(stream, g.dy, true, g.x, false, g.dw);
    }
  };
  std::fprintf(stderr, "%-7s %-6s %10s %10s %8s %12s %14s %11s\n", "packed", "swaps", "bare_ms", "swap_ms", "ratio", "exposed_ms",
               "peak_resident", "loop_ratio");
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
      size_t peak = 0, state = 0;
      for (int r = 0; r < o.reps + 1; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        bare.step();
        stream.synchronize();
        const auto t1 = std::chrono::steady_clock::now();
        swapped->step();
        stream.synchronize();
        swapped->runtime().synchronize_copies();
        const auto t2 = std::chrono::steady_clock::now();
        const SwapStepReport report = swapped->last_report();
        if (r == 0) continue;  // warm-up
        bare_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        swap_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
        exposed.push_back(report.exposed_wait_ms);
        peak = report.peak_resident_bytes;
        state = report.state_bytes;
      }
      // The trainer's view: a backward pass then the step, kLoop times back to back with one wait
      // at the end. The swapped run calls prefetch_early() before each backward, so its first
      // loads overlap the backward, and its last offloads overlap the next one.
      constexpr int kLoop = 3;
      const auto loop = [&](bool swap) {
        for (int k = 0; k < kLoop; ++k) {
          if (swap) swapped->prefetch_early();
          backward();
          if (swap) {
            swapped->step();
          } else {
            bare.step();
          }
        }
      };
      const auto [loop_bare, loop_swap] = time_alternating_ms(
          o.reps, [&] { loop(false); }, [&] { loop(true); },
          [&] {
            stream.synchronize();
            swapped->runtime().synchronize_copies();
          });
      const Spread b(bare_ms), s(swap_ms), e(exposed);
      const Spread lb = Spread(loop_bare).scaled(1.0 / kLoop), ls = Spread(loop_swap).scaled(1.0 / kLoop);
      const double loop_ratio = median_pair_ratio(loop_bare, 1.0, loop_swap, 1.0);  // swapped time / bare time
      std::printf("{\"bench\":\"swap\",\"device\":\"%s\",\"dim\":%lld,\"packed\":%s,\"swap_times\":%d,%s,%s,"
                  "\"ratio\":%.3f,\"exposed_wait_ms\":%.3f,\"peak_resident_bytes\":%zu,\"state_bytes\":%zu,%s,%s,"
                  "\"loop_ratio\":%.3f}\n",
                  o.device.str().c_str(), (long long)o.dim, packed ? "true" : "false", t, b.json("bare_ms").c_str(),
                  s.json("swap_ms").c_str(), s.median / b.median, e.median, peak, state, lb.json("loop_bare_ms").c_str(),
                  ls.json("loop_swap_ms").c_str(), loop_ratio);
      std::fprintf(stderr, "%-7s %-6d %10.2f %10.2f %8.3f %12.3f %14zu %11.3f\n", packed ? "yes" : "no", t, b.median, s.median,
                   s.median / b.median, e.median, peak, loop_ratio);
    }
}

/** The widths step and adamw run at: --dim alone when given, else three. */
std::vector<int64_t> widths(const Options& o) {
  if (o.dim_given) return {o.dim};
  // A GPU's step at width 512 takes a fraction of a millisecond: its widths reach a model's.
  return o.device.is_cuda() ? std::vector<int64_t>{512, 1024, 2048} : std::vector<int64_t>{256, 384, 512};
}

void run_step(const Options& o) {
  const int layers = 4;
  for (int64_t dim : widths(o)) {
    auto params = model_params(dim, layers, o.device);
    set_grads(params);
    Stream stream(o.device);
    MuonWithAdamW opt(stream, params);
    const Spread ms = time_ms(o.reps, [&] { opt.step(); }, [&] { stream.synchronize(); });
    size_t muon_params = 0;
    for (const ParamPtr& p : opt.muon().param_groups()[0].params) muon_params += size_t(p->data.numel());
    std::printf("{\"bench\":\"step\",\"device\":\"%s\",\"dim\":%lld,\"layers\":%d,\"muon_params\":%zu,%s}\n",
                o.device.str().c_str(), (long long)dim, layers, muon_params, ms.json("step_ms").c_str());
    std::fprintf(stderr, "Muon+AdamW step, width %lld, %d layers (%zu Muon params): %.2f ms\n", (long long)dim, layers,
                 muon_params, ms.median);
  }
}

void run_adamw(const Options& o) {
  const int layers = 4;
  for (int64_t dim : widths(o)) {
    auto params = model_params(dim, layers, o.device);
    set_grads(params);
    Stream stream(o.device);
    AdamW adamw(stream);
    adamw.add_param_group(params);
    size_t elements = 0;
    for (const ParamPtr& p : params) elements += size_t(p->data.numel());
    // Per element the step reads param, grad, exp_avg and exp_avg_sq and writes param and both
    // moments: 28 bytes in f32. The baseline copies as many bytes (14 read, 14 written per element).
    const int64_t copy_n = int64_t(elements) * 7 / 2;
    const Tensor from = Tensor::zeros({copy_n}, DType::f32, o.device), to = Tensor::zeros({copy_n}, DType::f32, o.device);
    const auto [step_samples, copy_samples] = time_alternating_ms(
        o.reps, [&] { adamw.step(); }, [&] { ops::copy(stream, from, to); }, [&] { stream.synchronize(); });
    const Spread ms(step_samples);
    const double bytes = 28.0 * double(elements);
    const double ratio = median_pair_ratio(step_samples, bytes, copy_samples, bytes);
    std::printf("{\"bench\":\"adamw\",\"device\":\"%s\",\"dim\":%lld,\"layers\":%d,\"params\":%zu,%s,%s,%s,\"ratio\":%.3f}\n",
                o.device.str().c_str(), (long long)dim, layers, elements, ms.json("step_ms").c_str(),
                ms.rate(bytes / 1e6).json("gbs").c_str(), Spread(copy_samples).rate(bytes / 1e6).json("memcpy_gbs").c_str(), ratio);
    std::fprintf(stderr, "AdamW step, width %lld, %d layers (%zu params): %.2f ms, %.0f GB/s, %.2f of memcpy\n", (long long)dim,
                 layers, elements, ms.median, bytes / 1e6 / ms.median, ratio);
  }
}

/** Many small params (1024-4096 elements each, as a MoE's expert vectors or a model's norms):
 *  the per-param costs of planning, slot lookup and state dicts, which should stay flat. */
void run_scale(const Options& o) {
  if (o.retain_arenas)
    std::fprintf(stderr, "%8s %10s %10s %8s (retain_arenas)\n", "params", "bare_ms", "swap_ms", "ratio");
  else
    std::fprintf(stderr, "%8s %10s %10s %8s %14s %14s %14s %10s %10s\n", "params", "bare_ms", "swap_ms", "ratio",
                 "sd_bare_us/p", "sd_swap_us/p", "load_swap_us/p", "new_us/p", "into_us/p");
  std::vector<int64_t> counts = {100, 1000, 5000, 20000, 50000};
  if (o.params > 0) counts = {o.params};
  for (int64_t n : counts) {
    std::mt19937 gen(7);
    std::uniform_int_distribution<int64_t> size(1024, 4096);
    std::vector<ParamPtr> bare_params, swap_params;
    for (int64_t i = 0; i < n; ++i) {
      const Tensor w = Tensor::zeros({size(gen)}, DType::f32, o.device);
      std::string name = "p.";
      name += std::to_string(i);
      bare_params.push_back(make_param(name, w.clone()));
      swap_params.push_back(make_param(name, w.clone()));
      bare_params.back()->grad = Tensor::from_floats(std::vector<float>(size_t(w.numel()), 1e-3f), w.shape(), DType::f32, o.device);
      swap_params.back()->grad = bare_params.back()->grad;
    }
    Stream stream(o.device);
    AdamW bare(stream), inner(stream);
    bare.add_param_group(bare_params);
    inner.add_param_group(swap_params);
    SwapConfig config;
    if (o.budget > 0) config.device_budget_bytes = o.budget;
    config.retain_arenas = o.retain_arenas;
    auto swapped = swap_adamw(inner, config);
    std::vector<double> bare_ms, swap_ms;
    // Steps of few params take a millisecond, where a thread descheduled for a moment on a busy
    // machine adds several: they get more repetitions (20000 / params, at least --reps).
    const int step_reps = std::max(o.reps, int(20000 / n));
    for (int r = 0; r < step_reps + 1; ++r) {  // alternated, the first pair a warm-up
      const auto t0 = std::chrono::steady_clock::now();
      bare.step();
      stream.synchronize();
      const auto t1 = std::chrono::steady_clock::now();
      swapped->step();
      swapped->synchronize();
      const auto t2 = std::chrono::steady_clock::now();
      if (r == 0) continue;
      bare_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      swap_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
    const Spread b(bare_ms), s(swap_ms);
    if (o.retain_arenas) {
      std::printf(
          "{\"bench\":\"scale\",\"device\":\"%s\",\"params\":%lld,\"retain_arenas\":true,%s,%s,\"ratio\":%.3f}\n",
          o.device.str().c_str(), (long long)n, b.json("bare_ms").c_str(), s.json("swap_ms").c_str(),
          s.median / b.median);
      std::fprintf(stderr, "%8lld %10.2f %10.2f %8.3f\n", (long long)n, b.median, s.median, s.median / b.median);
      continue;
    }
    StateDict state = bare.state_dict();
    const double per_param = 1e3 / double(n);  // ms per run -> us per param
    // The floors under state_dict() and load_state_dict(): the same tensors copied by memcpy, into
    // new host memory (replacing the last copies, as `state = ...` does) and into memory that
    // exists. Past the caches each byte costs more, so what the optimizer itself adds per param is
    // its ratio to its floor, measured alternately with it.
    std::vector<Tensor> copies;
    const auto copy_to_new = [&] {
      std::vector<Tensor> fresh;
      fresh.reserve(state.tensors.size());
      for (const auto& [name, t] : state.tensors) {
        fresh.push_back(Tensor::empty(t.shape(), t.dtype(), Device::cpu()));
        std::memcpy(fresh.back().data_ptr(), t.data_ptr(), t.nbytes());
      }
      copies = std::move(fresh);
    };
    const auto copy_into = [&] {
      size_t i = 0;
      for (const auto& [name, t] : state.tensors) std::memcpy(copies[i++].data_ptr(), t.data_ptr(), t.nbytes());
    };
    const auto sync = [&] { swapped->synchronize(); };
    const auto [sd_bare_ms, new_ms] = time_alternating_ms(
        o.reps, [&] { state = bare.state_dict(); }, copy_to_new, sync);
    const auto [sd_swap_ms, new_ms2] = time_alternating_ms(
        o.reps, [&] { state = swapped->state_dict(); }, copy_to_new, sync);
    const auto [load_ms, into_ms] = time_alternating_ms(
        o.reps, [&] { swapped->load_state_dict(state); }, copy_into, sync);
    const Spread sd_bare(sd_bare_ms), sd_swap(sd_swap_ms), load_swap(load_ms), copy_new(new_ms), copy_existing(into_ms);
    // Each figure's time over its floor's, the median over the alternated pairs.
    const double sd_bare_ratio = median_pair_ratio(new_ms, 1, sd_bare_ms, 1);
    const double sd_swap_ratio = median_pair_ratio(new_ms2, 1, sd_swap_ms, 1);
    const double load_ratio = median_pair_ratio(into_ms, 1, load_ms, 1);
    std::printf(
        "{\"bench\":\"scale\",\"device\":\"%s\",\"params\":%lld,%s,%s,\"ratio\":%.3f,%s,%s,%s,%s,%s,"
        "\"state_dict_bare_per_copy\":%.3f,\"state_dict_swap_per_copy\":%.3f,\"load_swap_per_copy\":%.3f}\n",
        o.device.str().c_str(), (long long)n, b.json("bare_ms").c_str(), s.json("swap_ms").c_str(), s.median / b.median,
        sd_bare.scaled(per_param).json("state_dict_bare_us_per_param").c_str(),
        sd_swap.scaled(per_param).json("state_dict_swap_us_per_param").c_str(),
        load_swap.scaled(per_param).json("load_swap_us_per_param").c_str(),
        copy_new.scaled(per_param).json("copy_new_us_per_param").c_str(),
        copy_existing.scaled(per_param).json("copy_into_us_per_param").c_str(), sd_bare_ratio, sd_swap_ratio,
        load_ratio);
    std::fprintf(stderr, "%8lld %10.2f %10.2f %8.3f %14.2f %14.2f %14.2f %10.2f %10.2f\n", (long long)n, b.median,
                 s.median, s.median / b.median, sd_bare.median * per_param, sd_swap.median * per_param,
                 load_swap.median * per_param, copy_new.median * per_param, copy_existing.median * per_param);
  }
}

/** The swap pipeline's copies without the math: pinned host <-> device on two streams, one per
 *  direction (the runtime's layout), each direction alone and both at once. On a GPU, a
 *  full-duplex link moves nearly twice one direction's bytes at once; on the CPU backend both
 *  "sides" are the same RAM, so this is memory bandwidth shared by two threads. */
void run_pipeline(const Options& o) {
  std::fprintf(stderr, "%10s %10s %10s %12s %10s %8s\n", "MiB", "h2d_GB/s", "d2h_GB/s", "both_GB/s", "d2d_GB/s", "both/one");
  Stream h2d(o.device), d2h(o.device);
  for (int64_t mib : {int64_t(16), int64_t(64), int64_t(256)}) {
    const int64_t n = mib * (int64_t(1) << 20) / 4;
    auto pinned = [&] {
      auto storage = std::make_shared<Storage>(size_t(n) * 4, Device::cpu(), pinned_host_allocator());
      std::memset(storage->data(), 1, storage->nbytes());
      return Tensor::on_storage(storage, 0, {n}, DType::f32);
    };
    const Tensor host_in = pinned(), host_out = pinned();
    const Tensor dev_in = Tensor::zeros({n}, DType::f32, o.device), dev_out = Tensor::zeros({n}, DType::f32, o.device);
    const double gb = double(n) * 4 / 1e9;  // one direction's bytes, in GB (GB/s = gb / ms * 1e3)
    const auto sync_both = [&] {
      h2d.synchronize();
      d2h.synchronize();
    };
    const Spread one_h2d = time_ms(o.reps, [&] { ops::copy(h2d, host_in, dev_in); }, sync_both);
    const Spread one_d2h = time_ms(o.reps, [&] { ops::copy(d2h, dev_out, host_out); }, sync_both);
    const Spread both = time_ms(o.reps, [&] {
          ops::copy(h2d, host_in, dev_in);
          ops::copy(d2h, dev_out, host_out);
        }, sync_both);
    const Spread d2d = time_ms(o.reps, [&] { ops::copy(h2d, dev_in, dev_out); }, sync_both);
    const Spread h2d_gbs = one_h2d.rate(gb * 1e3), d2h_gbs = one_d2h.rate(gb * 1e3), both_gbs = both.rate(2 * gb * 1e3),
                 d2d_gbs = d2d.rate(gb * 1e3);
    // Both at once against the faster direction alone: 2.0 is perfect overlap, 1.0 none.
    const double duplex = both_gbs.median / std::max(h2d_gbs.median, d2h_gbs.median);
    std::printf("{\"bench\":\"pipeline\",\"device\":\"%s\",\"mib\":%lld,%s,%s,%s,%s,\"duplex\":%.3f}\n",
                o.device.str().c_str(), (long long)mib, h2d_gbs.json("h2d_gbs").c_str(), d2h_gbs.json("d2h_gbs").c_str(),
                both_gbs.json("both_gbs").c_str(), d2d_gbs.json("d2d_gbs").c_str(), duplex);
    std::fprintf(stderr, "%10lld %10.2f %10.2f %12.2f %10.2f %8.3f\n", (long long)mib, h2d_gbs.median, d2h_gbs.median,
                 both_gbs.median, d2d_gbs.median, duplex);
  }
}

/** The kernel's peak resident set of this process (VmHWM), in bytes. */
size_t peak_rss_bytes() {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  size_t kb = 0;
  while (std::fgets(line, sizeof line, f) != nullptr)
    if (std::strncmp(line, "VmHWM:", 6) == 0) kb = size_t(std::strtoull(line + 6, nullptr, 10));
  std::fclose(f);
  return kb * 1024;
}

constexpr const char* kCheckpointModes[] = {"step", "save_state_dict", "save_checkpoint", "load_state_dict", "load_checkpoint"};

/** One measurement of `swapopt-bench checkpoint`, in a process of its own (peaks only grow):
 *  a swapped AdamW over 64 params holding `mib` MiB of state steps once, then saves or loads. */
void run_checkpoint_child(const Options& o, const std::string& mode, int64_t mib, const std::string& path) {
  const int64_t count = 64, n = mib * (int64_t(1) << 20) / 8 / count;  // two f32 moments per element
  std::vector<ParamPtr> params;
  for (int64_t i = 0; i < count; ++i) {
    std::string name = "w.";
    name += std::to_string(i);
    params.push_back(make_param(name, Tensor::zeros({n}, DType::f32, o.device)));
    params.back()->grad = Tensor::zeros({n}, DType::f32, o.device);
  }
  Stream stream(o.device);
  AdamW adamw(stream);
  adamw.add_param_group(params);
  auto swapped = swap_adamw(adamw);
  swapped->step();
  swapped->synchronize();
  if (mode == "save_async") {  // step times without a save, then while one is written
    auto timed_step = [&] {
      const auto t0 = std::chrono::steady_clock::now();
      swapped->step();
      swapped->synchronize();
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    };
    std::vector<double> plain, during;
    for (int r = 0; r < 3; ++r) plain.push_back(timed_step());
    const auto t0 = std::chrono::steady_clock::now();
    swapped->save_async(path);
    for (int r = 0; r < 3; ++r) during.push_back(timed_step());
    swapped->wait_save();
    const double save_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%.3f %.3f %.3f\n", Spread(plain).median, Spread(during).median, save_s);
    std::fflush(stdout);
    std::_Exit(0);
  }
  const size_t stepped = peak_rss_bytes();
  const auto t0 = std::chrono::steady_clock::now();
  if (mode == "save_state_dict") save_state_dict(swapped->state_dict(), path);
  if (mode == "save_checkpoint") swapped->save_checkpoint(path);
  if (mode == "load_state_dict") swapped->load_state_dict(load_state_dict(path));
  if (mode == "load_checkpoint") swapped->load_checkpoint(path);
  swapped->synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%zu %zu %.3f\n", stepped, peak_rss_bytes(), seconds);
  std::fflush(stdout);
  std::_Exit(0);  // the peak is measured: skip handing 512 MiB back to the optimizer at exit
}

/** This program's path (the children of `checkpoint` run it again). */
std::string self_path() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  SWAPOPT_CHECK(n > 0, "[bench] cannot read /proc/self/exe");
  return std::string(buf, size_t(n));
}

void run_checkpoint(const Options& o, const std::string& self) {
  const int64_t mib = o.dim_given ? o.dim : 512;
  const std::string path = "/tmp/swapopt-bench-checkpoint.safetensors";
  std::fprintf(stderr, "%-16s %14s %14s %16s %10s\n", "mode", "peak_MB", "step_peak_MB", "above_step_MB", "seconds");
  size_t step_peak = 0;
  for (const char* mode : kCheckpointModes) {
    std::vector<double> seconds;
    size_t peak = 0, stepped = 0;
    for (int r = 0; r < o.reps; ++r) {  // the peaks are the same every run; the time is not
      const std::string command = self + " checkpoint-run " + mode + " --dim " + std::to_string(mib) +
                                  " --device " + (o.device.is_cuda() ? "cuda" : "cpu") + " --path " + path;
      std::FILE* child = popen(command.c_str(), "r");
      SWAPOPT_CHECK(child != nullptr, "[bench] cannot run " << command);
      unsigned long long a = 0, b = 0;
      double s = 0;
      const int got = std::fscanf(child, "%llu %llu %lf", &a, &b, &s);
      SWAPOPT_CHECK(pclose(child) == 0 && got == 3, "[bench] " << command << " failed");
      stepped = std::max(stepped, size_t(a));
      peak = std::max(peak, size_t(b));
      seconds.push_back(s);
    }
    if (std::string(mode) == "step") step_peak = peak;
    const Spread t(seconds);
    const double above = (double(peak) - double(step_peak)) / 1e6;
    std::printf("{\"bench\":\"checkpoint\",\"device\":\"%s\",\"mode\":\"%s\",\"state_mib\":%lld,\"peak_bytes\":%zu,"
                "\"step_peak_bytes\":%zu,\"above_step_mb\":%.1f,%s}\n",
                o.device.str().c_str(), mode, (long long)mib, peak, step_peak, above, t.json("seconds").c_str());
    std::fprintf(stderr, "%-16s %14.1f %14.1f %16.1f %10.3f\n", mode, double(peak) / 1e6, double(step_peak) / 1e6, above, t.median);
  }
  // Step time while save_async() writes the same file in the background.
  std::vector<double> plain, during, save_s;
  for (int r = 0; r < o.reps; ++r) {
    const std::string command = self + " checkpoint-run save_async --dim " + std::to_string(mib) + " --device " +
                                (o.device.is_cuda() ? "cuda" : "cpu") + " --path " + path;
    std::FILE* child = popen(command.c_str(), "r");
    SWAPOPT_CHECK(child != nullptr, "[bench] cannot run " << command);
    double a = 0, b = 0, c = 0;
    const int got = std::fscanf(child, "%lf %lf %lf", &a, &b, &c);
    SWAPOPT_CHECK(pclose(child) == 0 && got == 3, "[bench] " << command << " failed");
    plain.push_back(a);
    during.push_back(b);
    save_s.push_back(c);
  }
  const Spread p(plain), d(during), w(save_s);
  std::printf("{\"bench\":\"checkpoint_async\",\"device\":\"%s\",\"state_mib\":%lld,%s,%s,%s,\"ratio\":%.3f}\n",
              o.device.str().c_str(), (long long)mib, p.json("step_ms").c_str(), d.json("step_during_save_ms").c_str(),
              w.json("save_s").c_str(), d.median / p.median);
  std::fprintf(stderr, "step %.1f ms alone, %.1f ms while save_async writes (%.3fx); the save took %.2f s\n", p.median,
               d.median, d.median / p.median, w.median);
  std::remove(path.c_str());
}

/** One row of `ops`: an op issued `calls` times back to back. */
struct OpCase {
  std::string name;  // what is issued, with its shape
  int ops;           // swapopt ops per call (a Newton-Schulz issues many)
  std::function<void()> issue;
  std::function<void()> raw;  // the same runtime or cuBLAS call made directly (CUDA), or none
};

/** Per call, in us: the host's time to issue `calls` back to back, and to issue and then wait for
 *  them (the device's pace where it is the slower), each over `reps` samples after a warm-up. */
std::pair<Spread, Spread> time_issue_us(int reps, int calls, const std::function<void()>& issue, Stream& s) {
  std::vector<double> host, wall;
  for (int r = 0; r <= reps; ++r) {
    s.synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) issue();
    const auto t1 = std::chrono::steady_clock::now();
    s.synchronize();
    const auto t2 = std::chrono::steady_clock::now();
    if (r == 0) continue;  // warm-up: cuBLAS picks its kernels, pools grow
    host.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / calls);
    wall.push_back(std::chrono::duration<double, std::micro>(t2 - t0).count() / calls);
  }
  return {Spread(host), Spread(wall)};
}

/** Host cost per op. Small ops (the device's work is a few us) issued back to back show what the
 *  host spends per op: swapopt's checks and dispatch, the device guard, stream-ordered scratch,
 *  and the runtime's or cuBLAS's own launch path; on CUDA the same call made directly, without
 *  swapopt, is the baseline. Fewer calls per sample than a CUDA stream's queue of pending launches
 *  holds, so that issuing never waits for the device. */
void run_ops(const Options& o) {
  Stream s(o.device);
  const Tensor one = Tensor::zeros({1}, DType::f32, o.device);
  const Tensor x = random_tensor({1024}, DType::f32, o.device, 1), y = Tensor::zeros({1024}, DType::f32, o.device);
  const Tensor a = random_tensor({64, 64}, DType::bf16, o.device, 2),
               b = random_tensor({64, 64}, DType::bf16, o.device, 3);
  const Tensor c = Tensor::zeros({64, 64}, DType::bf16, o.device);
  const Tensor g = random_tensor({1, 64, 64}, DType::bf16, o.device, 4),
               norms = Tensor::zeros({1}, DType::f32, o.device);
  const Tensor ns_x = random_tensor({1, 256, 256}, DType::bf16, o.device, 5);
  const auto schedule = ns_schedule("asym5", 5, {});
  std::vector<OpCase> cases = {
      {"fill_zero, 1 f32", 1, [&] { ops::fill_zero(s, one); }, {}},
      {"axpby, 1024 f32", 1, [&] { ops::axpby(s, 0.5f, x, 0.5f, y); }, {}},
      {"gemm, 64x64 @ 64x64 bf16", 1, [&] { ops::gemm(s, a, false, b, false, c); }, {}},
      {"syrk, 64x64 bf16", 1, [&] { ops::syrk(s, a, false, c); }, {}},
      {"frobenius_norm, 64x64 bf16", 1, [&] { ops::frobenius_norm(s, g, norms); }, {}},
      // Norm, scaling, then per step two Gram products, axpby, copy and GEMM; a last copy.
      {"newton_schulz, 256x256 bf16, 5 steps", 28, [&] { newton_schulz(s, ns_x, schedule, 1e-7f); }, {}},
  };
#ifdef SWAPOPT_BENCH_RAW_CUDA
  std::unique_ptr<bench::RawCublas> cublas;
  if (o.device.is_cuda()) {
    cublas = std::make_unique<bench::RawCublas>(s.native_handle());
    cases[0].raw = [&] { bench::raw_memset(s.native_handle(), one.data_ptr(), one.nbytes()); };
    cases[2].raw = [&] { cublas->gemm_bf16(a.data_ptr(), b.data_ptr(), c.data_ptr(), 64, 64, 64); };
  }
#endif
  std::fprintf(stderr, "%-40s %12s %12s %14s %12s\n", "op", "host_us", "host_us/op", "issue+wait_us", "raw_host_us");
  for (const OpCase& op : cases) {
    const int calls = op.ops > 1 ? 20 : 200;
    const auto [host, wall] = time_issue_us(o.reps, calls, op.issue, s);
    std::string raw_json;
    double raw_host = 0;
    if (op.raw) {
      const auto [raw_h, raw_w] = time_issue_us(o.reps, calls, op.raw, s);
      raw_json = "," + raw_h.json("raw_host_us") + "," + raw_w.json("raw_wall_us");
      raw_host = raw_h.median;
    }
    std::printf("{\"bench\":\"ops\",\"device\":\"%s\",\"op\":\"%s\",\"ops\":%d,%s,%s%s}\n", o.device.str().c_str(),
                op.name.c_str(), op.ops, host.json("host_us").c_str(), wall.json("wall_us").c_str(), raw_json.c_str());
    char raw_text[32] = "-";
    if (op.raw) std::snprintf(raw_text, sizeof raw_text, "%.2f", raw_host);
    std::fprintf(stderr, "%-40s %12.2f %12.2f %14.2f %12s\n", op.name.c_str(), host.median, host.median / op.ops,
                 wall.median, raw_text);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const char* usage =
      "usage: swapopt-bench ns|momentum|swap|step|adamw|scale|pipeline|checkpoint|ops [--device cpu|cuda] [--reps N] "
      "[--dim D] [--budget BYTES (scale)] [--params N (scale)] [--retain-arenas 0|1 (scale)]\n";
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--help" || std::string(argv[i]) == "-h") {
      std::printf("%s", usage);
      return 0;
    }
  }
  if (argc < 2) {
    std::fprintf(stderr, "%s", usage);
    return 2;
  }
  std::string command = argv[1];
  const std::vector<std::string> commands = {"ns",    "momentum", "swap",       "step", "adamw",
                                             "scale", "pipeline", "checkpoint", "ops",  "checkpoint-run"};
  if (std::find(commands.begin(), commands.end(), command) == commands.end()) {
    std::fprintf(stderr, "unknown subcommand %s\n%s", command.c_str(), usage);
    return 2;
  }
  Options o;
  int first_flag = 2;
  std::string child_mode, child_path;
  if (command == "checkpoint-run" && argc >= 3) {  // one measurement of `checkpoint` (internal)
    child_mode = argv[2];
    first_flag = 3;
  }
  for (int i = first_flag; i < argc; i += 2) {
    if (i + 1 == argc) {
      std::fprintf(stderr, "missing value for %s\n%s", argv[i], usage);
      return 2;
    }
    const std::string flag = argv[i], value = argv[i + 1];
    // A whole decimal integer in [least, most], or a named error (atoi read "--reps x" as 0).
    const auto integer = [&](long long least, long long most, long long& out) {
      char* end = nullptr;
      errno = 0;
      const long long v = std::strtoll(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0' || errno == ERANGE || v < least || v > most) {
        std::fprintf(stderr, "bad value '%s' for %s (an integer in [%lld, %lld])\n", value.c_str(), flag.c_str(), least,
                     most);
        return false;
      }
      out = v;
      return true;
    };
    long long v = 0;
    if (flag == "--path" && !child_mode.empty()) child_path = value;
    else if (flag == "--device") {
      if (value != "cpu" && value != "cuda") {
        std::fprintf(stderr, "bad value '%s' for --device (cpu or cuda)\n", value.c_str());
        return 2;
      }
      o.device = value == "cuda" ? Device::cuda(0) : Device::cpu();
    } else if (flag == "--reps") {
      if (!integer(1, INT32_MAX, v)) return 2;
      o.reps = int(v);
    } else if (flag == "--budget") {
      if (!integer(0, LLONG_MAX, v)) return 2;
      o.budget = size_t(v);
    } else if (flag == "--params") {
      if (!integer(0, INT32_MAX, v)) return 2;
      o.params = v;
    } else if (flag == "--retain-arenas") {
      if (value != "0" && value != "1") {
        std::fprintf(stderr, "bad value '%s' for --retain-arenas (0 or 1)\n", value.c_str());
        return 2;
      }
      o.retain_arenas = value == "1";
    } else if (flag == "--dim") {
      if (!integer(16, 1 << 20, v)) return 2;
      o.dim = v;
      o.dim_given = true;
    } else {
      std::fprintf(stderr, "unknown flag %s\n%s", flag.c_str(), usage);
      return 2;
    }
  }
  try {
    // clang-format off
    if (command == "ns") run_ns(o);
    else if (command == "momentum") run_momentum(o);
    else if (command == "swap") run_swap(o);
    else if (command == "step") run_step(o);
    else if (command == "adamw") run_adamw(o);
    else if (command == "scale") run_scale(o);
    else if (command == "pipeline") run_pipeline(o);
    else if (command == "checkpoint") run_checkpoint(o, self_path());
    else if (command == "ops") run_ops(o);
    else run_checkpoint_child(o, child_mode, o.dim, child_path);  // "checkpoint-run"
    // clang-format on
  } catch (const Error& e) {
    std::fprintf(stderr, "swapopt-bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
