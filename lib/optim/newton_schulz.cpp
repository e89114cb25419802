#include "swapopt/optim/newton_schulz.h"

#include <cmath>

#include "swapopt/core/error.h"
#include "swapopt/core/ops.h"

namespace swapopt {

namespace {

const std::vector<NsCoefficients> kAsym5 = {{4.0848f, -6.8946f, 2.9270f},
                                            {3.9505f, -6.3029f, 2.6377f},
                                            {3.7418f, -5.5913f, 2.3037f},
                                            {2.8769f, -3.1427f, 1.2046f},
                                            {2.8366f, -3.0525f, 1.2012f}};

const std::vector<NsCoefficients> kPolarExpress = {
    {8.156554524902461f, -22.48329292557795f, 15.878769915207462f},
    {4.042929935166739f, -2.808917465908714f, 0.5000178451051316f},
    {3.8916678022926607f, -2.772484153217685f, 0.5060648178503393f},
    {3.285753657755655f, -2.3681294933425376f, 0.46449024233003106f},
    {2.3465413258596377f, -1.7097828382687081f, 0.42323551169305323f}};

constexpr NsCoefficients kLegacy = {3.4445f, -4.7750f, 2.0315f};

std::vector<NsCoefficients> first_steps(const std::vector<NsCoefficients>& table, int steps, const std::string& variant) {
  SWAPOPT_CHECK(steps <= int(table.size()),
                "[Muon] ns_steps " << steps << " exceeds the " << table.size() << " steps of ns_variant '" << variant << "'");
  return {table.begin(), table.begin() + steps};
}

}  // namespace

std::vector<NsCoefficients> ns_schedule(const std::string& variant, int ns_steps, const std::vector<NsCoefficients>& custom) {
  SWAPOPT_CHECK(ns_steps >= 1, "[Muon] ns_steps must be >= 1, got " << ns_steps);
  SWAPOPT_CHECK(ns_steps <= kMaxNsSteps, "[Muon] ns_steps must be <= " << kMaxNsSteps << ", got " << ns_steps);
  SWAPOPT_CHECK(variant == "custom" || custom.empty(),
                "[Muon] ns_coefficients are given but ns_variant is '" << variant << "' (use 'custom')");
  if (variant == "legacy") return std::vector<NsCoefficients>(size_t(ns_steps), kLegacy);
  if (variant == "asym5") return first_steps(kAsym5, ns_steps, variant);
  if (variant == "polar_express") return first_steps(kPolarExpress, ns_steps, variant);
  if (variant == "custom") {
    SWAPOPT_CHECK(!custom.empty(), "[Muon] ns_variant 'custom' needs ns_coefficients");
    for (const NsCoefficients& c : custom)
      for (float v : c) SWAPOPT_CHECK(std::isfinite(v), "[Muon] ns_coefficients must be finite, got " << v);
    return first_steps(custom, ns_steps, variant);
  }
  SWAPOPT_FAIL("[Muon] unknown ns_variant '" << variant << "' (expected legacy, asym5, polar_express or custom)");
}

float ns_norm_scale(const std::string& variant) { return variant == "polar_express" ? 1.02f : 1.f; }

void newton_schulz(Stream& stream, const Tensor& x, const std::vector<NsCoefficients>& schedule, float eps, float norm_scale) {
  SWAPOPT_CHECK(x.dim() == 3 && x.is_contiguous(), "[newton_schulz] expects a contiguous [B, m, n] tensor, got " << x.str());
  // Checked here, before the normalisation changes x: the products run in f32 or bf16 only.
  SWAPOPT_CHECK(x.dtype() == DType::f32 || x.dtype() == DType::bf16,
                "[newton_schulz] works in f32 or bf16, got " << x.str());
  if (x.numel() == 0) return;  // matrices without elements: nothing to orthogonalise
  const int64_t batch = x.size(0), m = x.size(1), n = x.size(2);
  const bool tall = m > n;
  const int64_t k = tall ? n : m;  // side of the Gram matrix
  const Device dev = x.device();
  // Workspaces live on `stream` only: stream-ordered allocation and free.
  Tensor norms = Tensor::empty({batch}, DType::f32, dev, &stream);
  Tensor gram = Tensor::empty({batch, k, k}, x.dtype(), dev, &stream);
  Tensor poly = Tensor::empty({batch, k, k}, x.dtype(), dev, &stream);
  Tensor next = Tensor::empty(x.shape(), x.dtype(), dev, &stream);
  ops::frobenius_norm(stream, x, norms);
  if (norm_scale != 1.f) ops::scale(stream, norms, norm_scale);
  ops::scale_by_inverse_norm(stream, x, norms, eps);
  Tensor cur = x, other = next;
  for (const NsCoefficients& c : schedule) {
    ops::syrk(stream, cur, tall, gram);           // A = X X^T  (tall: X^T X)
    ops::syrk(stream, gram, false, poly, c[2]);   // B = c A A^T = c A^2 (A symmetric)
    ops::axpby(stream, c[1], gram, 1.f, poly);    // B += b A
    ops::copy(stream, cur, other);
    if (tall) {
      ops::gemm(stream, cur, false, poly, false, other, 1.f, c[0]);  // X' = X B + a X
    } else {
      ops::gemm(stream, poly, false, cur, false, other, 1.f, c[0]);  // X' = B X + a X
    }
    std::swap(cur, other);
  }
  if (cur.data_ptr() != x.data_ptr()) ops::copy(stream, cur, x);
}

double newton_schulz_flops(int64_t m, int64_t n, int steps) {
  const double small = double(std::min(m, n)), large = double(std::max(m, n));
  // Gram (SYRK, half of 2 s^2 l), A^2 (SYRK, half of 2 s^3), B X (2 s^2 l).
  return double(steps) * (small * small * large + small * small * small + 2 * small * small * large);
}

}  // namespace swapopt
