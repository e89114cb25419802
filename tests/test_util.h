#pragma once
// Helpers shared by the test files: seeded data, naive references, error reports.

#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "swapopt/swapopt.h"

namespace swapopt::test {

/** `baked` (an absolute path recorded at build time) when it exists, else `relative` to this test
 *  binary's directory: the tree may have been copied elsewhere since (e.g. to a GPU machine). */
inline std::string test_path(const std::string& baked, const std::string& relative) {
  if (std::filesystem::exists(baked)) return baked;
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / relative).string();
}

/** A path in /tmp named after `name` and this process, so that test runs side by side (a CI job and
 *  a developer's run, two build directories) never share a file. */
inline std::string temp_file(const std::string& name) { return "/tmp/swapopt_test_" + std::to_string(::getpid()) + "_" + name; }

/** The whole file at `path`, or "" when it cannot be read. */
inline std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

/** Deterministic values in [-1, 1). */
inline std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = dist(gen);
  return v;
}

inline Tensor random_tensor(const Shape& shape, DType dtype, uint32_t seed, Device device = Device::cpu()) {
  return Tensor::from_floats(random_values(size_t(shape_numel(shape)), seed), shape, dtype, device);
}

/** `x` rounded to `dtype` and read back, as a tensor of that dtype stores it. */
inline float round_to(float x, DType dtype) {
  float out = 0;
  store_from_float(&out, 0, dtype, x);
  return load_as_float(&out, 0, dtype);
}

inline std::vector<float> rounded(std::vector<float> v, DType dtype) {
  for (float& x : v) x = round_to(x, dtype);
  return v;
}

/** Largest absolute and relative difference; prints "label: max abs E, max rel R" as the style asks. */
struct ErrorReport {
  double max_abs = 0;
  double max_rel = 0;
};

inline ErrorReport compare(const std::string& label, const std::vector<float>& got, const std::vector<float>& want) {
  REQUIRE(got.size() == want.size());
  ErrorReport r;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(double(got[i]) - double(want[i]));
    r.max_abs = std::max(r.max_abs, d);
    r.max_rel = std::max(r.max_rel, d / std::max(1e-6, std::fabs(double(want[i]))));
  }
  MESSAGE(label << ": max abs " << r.max_abs << ", max rel " << r.max_rel);
  return r;
}

/** Bitwise equality of two tensors' bytes (after bringing both to the host). */
inline bool same_bits(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  return a.nbytes() == 0 || std::memcmp(ha.data_ptr(), hb.data_ptr(), a.nbytes()) == 0;
}

/** Bitwise equality, except that any two NaNs count as equal: the GPU makes every NaN it computes
 *  the canonical 0x7fffffff, x86 keeps an input NaN's payload (or makes 0xffc00000). */
inline bool same_bits_or_both_nan(const Tensor& a, const Tensor& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const Tensor ha = a.to(Device::cpu()), hb = b.to(Device::cpu());
  for (size_t i = 0; i < size_t(a.numel()); ++i) {
    const float x = load_as_float(ha.data_ptr(), i, a.dtype()), y = load_as_float(hb.data_ptr(), i, b.dtype());
    if (std::isnan(x) && std::isnan(y)) continue;
    if (formula::float_bits(x) != formula::float_bits(y)) return false;
  }
  return true;
}

/** Naive f64 reference of c = alpha * op(a) op(b) + beta * c for one row-major matrix. */
inline std::vector<float> naive_gemm(const std::vector<float>& a, int64_t ar, int64_t ac, bool ta, const std::vector<float>& b,
                                     int64_t br, int64_t bc, bool tb, const std::vector<float>& c, float alpha, float beta) {
  const int64_t m = ta ? ac : ar, k = ta ? ar : ac, n = tb ? br : bc;
  std::vector<float> out(size_t(m * n));
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? a[size_t(p * ac + i)] : a[size_t(i * ac + p)];
        const double bv = tb ? b[size_t(j * bc + p)] : b[size_t(p * bc + j)];
        s += av * bv;
      }
      out[size_t(i * n + j)] = float(alpha * s + (beta == 0.f ? 0.0 : double(beta) * c[size_t(i * n + j)]));
    }
  return out;
}

/** The message of what `f` throws (a swapopt::Error), or "" when it does not throw. */
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

/** A small model that MuonWithAdamW splits both ways: an embedding and a bias to AdamW, two
 *  matrices to Muon. */
inline std::vector<ParamPtr> muon_adamw_model() {
  return {make_param("embed.weight", random_tensor({20, 8}, DType::f32, 1)),
          make_param("blocks.0.w", random_tensor({24, 16}, DType::f32, 2)),
          make_param("blocks.0.b", random_tensor({24}, DType::f32, 3)),
          make_param("blocks.1.w", random_tensor({16, 24}, DType::f32, 4))};
}

/** True when a CUDA device can run the CUDA suites. */
inline bool no_gpu() { return cuda_device_count() == 0; }

}  // namespace swapopt::test
