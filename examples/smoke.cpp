// Smoke run of the core: a Newton-Schulz-shaped chain of ops on a compute stream while a copy
// stream moves a buffer out and back, ordered with events. Prints timings and a checksum.
#include <chrono>
#include <cstdio>
#include <random>

#include "swapopt/swapopt.h"

using namespace swapopt;

int main() {
  const Device dev = cuda_device_count() > 0 ? Device::cuda(0) : Device::cpu();
  std::printf("swapopt smoke on %s\n", dev.str().c_str());
  Stream compute(dev), copy(dev);
  Event computed(dev), copied(dev);
  const int64_t m = 512, n = 1024;
  std::vector<float> values(size_t(m * n));
  std::mt19937 gen(0);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (float& v : values) v = dist(gen);
  Tensor x = Tensor::from_floats(values, {m, n}, DType::f32, dev);
  Tensor a = Tensor::empty({m, m}, DType::f32, dev), b = Tensor::empty({m, m}, DType::f32, dev);
  Tensor y = Tensor::empty({m, n}, DType::f32, dev), norm = Tensor::empty({1}, DType::f32, dev);
  Tensor host = Tensor::empty({m, n}, DType::f32, Device::cpu());
  const auto t0 = std::chrono::steady_clock::now();
  ops::frobenius_norm(compute, x, norm);
  ops::scale_by_inverse_norm(compute, x, norm, 1e-7f);
  for (int step = 0; step < 5; ++step) {
    ops::syrk(compute, x, false, a);                      // A = X X^T
    ops::syrk(compute, a, false, b, 2.0315f);             // B = c A^2 ...
    ops::axpby(compute, -4.7750f, a, 1.f, b);      //   ... + b A
    ops::gemm(compute, b, false, x, false, y);     // B X
    ops::axpby(compute, 3.4445f, x, 1.f, y);       // a X + B X
    computed.record(compute);
    copy.wait(computed);
    ops::copy(copy, y, host);                      // offload the iterate while ...
    copied.record(copy);
    compute.wait(copied);                          // ... the next step waits for it
    ops::copy(compute, y, x);
  }
  compute.synchronize();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  double checksum = 0;
  for (float v : host.to_float_vector()) checksum += double(v) * v;
  std::printf("5 Newton-Schulz steps on [%lld, %lld]: %.1f ms, sum of squares %.3f (an orthogonalised [m, n] matrix has about m = 512)\n", (long long)m, (long long)n, ms, checksum);
  const MemoryStats stats = memory_stats(dev);
  std::printf("device bytes: current %zu, peak %zu\n", stats.current_bytes, stats.peak_bytes);
  return 0;
}
