#pragma once
/** Newton-Schulz orthogonalisation (Muon's "zeropower") on batches of matrices. */

#include <array>
#include <string>
#include <vector>

#include "swapopt/core/stream.h"
#include "swapopt/core/tensor.h"

namespace swapopt {

/** (a, b, c) of one step: A = X X^T, B = b A + c A^2, X = a X + B X. */
using NsCoefficients = std::array<float, 3>;

/** The most NS steps any variant runs (a checkpoint's larger value is refused before a schedule
 *  of that length is built). */
constexpr int kMaxNsSteps = 1000;

/** Per-step coefficients (a, b, c) of X' = a X + (b A + c A^2) X, A = X X^T, of a variant:
 *  - "legacy": (3.4445, -4.7750, 2.0315) every step;
 *  - "asym5" (the reference's default, at most 5 steps): (4.0848, -6.8946, 2.9270),
 *    (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
 *    (2.8366, -3.0525, 1.2012);
 *  - "polar_express" (Amsel et al. 2025, at most 5 steps): (8.1566, -22.4833, 15.8788),
 *    (4.0429, -2.8089, 0.5000), (3.8917, -2.7725, 0.5061), (3.2858, -2.3681, 0.4645),
 *    (2.3465, -1.7098, 0.4232) (as f32 of the paper's values, shown rounded);
 *  - "custom": `custom`, one triple per step (ns_steps <= their count).
 *  1 <= ns_steps <= kMaxNsSteps; throws a named error otherwise. */
std::vector<NsCoefficients> ns_schedule(const std::string& variant, int ns_steps, const std::vector<NsCoefficients>& custom);

/** Normalisation of a variant: X /= (||X||_F * norm_scale + eps); polar_express uses 1.02. */
float ns_norm_scale(const std::string& variant);

/** Orthogonalises each matrix of `x` ([B, m, n] contiguous, f32 or bf16: the working dtype) in place.
 *  Tall matrices (m > n) iterate on the Gram X^T X instead of transposing:
 *  A = X^T X, B = b A + c A^2, X = a X + X B. Symmetric products use SYRK. */
void newton_schulz(Stream& stream, const Tensor& x, const std::vector<NsCoefficients>& schedule, float eps,
                   float norm_scale = 1.f);

/** Flops of newton_schulz on one m x n matrix with `steps` steps, counting the symmetric products
 *  at half cost (what SYRK performs), for GFLOP/s figures. */
double newton_schulz_flops(int64_t m, int64_t n, int steps);

}  // namespace swapopt
