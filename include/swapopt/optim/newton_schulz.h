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

/** Per-step coefficients of a variant: "legacy" (3.4445, -4.7750, 2.0315) every step; "asym5"
 *  (at most 5 steps); "polar_express" (Amsel et al. 2025, at most 5 steps); "custom" = `custom`
 *  (one triple per step, ns_steps <= their count); 1 <= ns_steps <= kMaxNsSteps. Throws a named
 *  error otherwise. */
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
