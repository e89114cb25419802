#pragma once
/** The elementwise formulas both backends compute, written once: dtype conversions (round to
 *  nearest even, NaN payloads kept) and the per-element math of axpby, lerp, the norm scaling and
 *  the fused optimizer updates. The CPU backend calls them in its loops and the CUDA kernels call
 *  the same functions; both sides are compiled without multiply-add contraction (-ffp-contract=off,
 *  nvcc --fmad=false) and with IEEE division and square root, so a CPU op and a CUDA op give the
 *  same bits for the same inputs, up to the sign and payload of NaNs (the GPU makes every NaN it
 *  computes canonical; x86 keeps an input NaN's payload). */

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SWAPOPT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SWAPOPT_HOST_DEVICE inline
#endif

namespace swapopt::formula {

/** Bits of a float. */
SWAPOPT_HOST_DEVICE uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

/** Float from its bits. */
SWAPOPT_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/** bf16 bits -> float (exact). */
SWAPOPT_HOST_DEVICE float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

/** float -> bf16 bits, round to nearest even; NaN stays a quiet NaN with its sign and top payload. */
SWAPOPT_HOST_DEVICE uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

/** f16 bits -> float (exact, subnormals included). */
SWAPOPT_HOST_DEVICE float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);  // signed zero
  const float magnitude = float(mantissa) * 0x1p-24f;  // subnormal: mantissa * 2^-24, exact in f32
  return sign ? -magnitude : magnitude;
}

/** float -> f16 bits, round to nearest even, overflow to inf, subnormals kept; NaN stays quiet. */
SWAPOPT_HOST_DEVICE uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // quiet NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65536: inf
  if (abs < 0x38800000u) {
    // Subnormal or zero: scaled so that one f16 ulp (2^-24) is 1.0, rounded to nearest even.
    const float scaled = bits_float(abs) * 0x1p24f;
#if defined(__CUDA_ARCH__)
    return uint16_t(sign | uint16_t(rintf(scaled)));
#else
    return uint16_t(sign | uint16_t(__builtin_nearbyintf(scaled)));
#endif
  }
  uint32_t rebased = abs - 0x38000000u;  // normal: exponent bias 127 -> 15, 13 bits rounded off
  rebased += 0xfffu + ((rebased >> 13) & 1u);
  return uint16_t(sign | (rebased >> 13));
}

/** dtype codes: swapopt::DType's values. */
enum : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

/** Element i of a buffer of dtype code `dtype`, as float. */
SWAPOPT_HOST_DEVICE float load(const void* base, size_t i, int dtype) {
  if (dtype == kF32) return static_cast<const float*>(base)[i];
  const uint16_t h = static_cast<const uint16_t*>(base)[i];
  return dtype == kBF16 ? bf16_to_float(h) : f16_to_float(h);
}

/** Writes v, rounded to dtype code `dtype`, into element i. */
SWAPOPT_HOST_DEVICE void store(void* base, size_t i, int dtype, float v) {
  if (dtype == kF32) {
    static_cast<float*>(base)[i] = v;
  } else {
    static_cast<uint16_t*>(base)[i] = dtype == kBF16 ? float_to_bf16(v) : float_to_f16(v);
  }
}

/** alpha * x + beta * y; y is not read when beta == 0 (so a NaN there does not propagate). */
SWAPOPT_HOST_DEVICE float axpby(float alpha, float x, float beta, float y) {
  return beta == 0.f ? alpha * x : alpha * x + beta * y;
}

/** torch.lerp's formula, exact at both ends, each operation rounded (no multiply-add: the CUDA
 *  kernels give the same bits). torch's CPU kernel fuses the multiply-add, so its results (and
 *  its AdamW's exp_avg) can differ from these by an ulp. */
SWAPOPT_HOST_DEVICE float lerp(float a, float b, float w) { return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.f - w); }

/** Newton-Schulz normalisation of one element. */
SWAPOPT_HOST_DEVICE float scale_by_inverse_norm(float x, float norm, float eps) { return x / (norm + eps); }

/** max that propagates NaN from either side, as torch.maximum does. */
SWAPOPT_HOST_DEVICE float propagating_max(float a, float b) { return (a < b || b != b) ? b : a; }

/** Muon momentum, SGD form: u = g + m1*buf; buf = m2*buf + g; with nesterov u = m1*u + g. */
struct MomentumOut {
  float buf;     ///< The new momentum buffer: m2*buf + g.
  float update;  ///< The update u (the Newton-Schulz input).
};
SWAPOPT_HOST_DEVICE MomentumOut muon_momentum(float g, float buf, float m1, float m2, bool nesterov) {
  float u = g + m1 * buf;
  if (nesterov) u = m1 * u + g;
  return {m2 * buf + g, u};
}

/** Per-step scalars of AdamW, computed on the host in f64 as torch does, then rounded to f32. */
struct AdamWScalars {
  float decay = 1.f;              ///< 1 - lr * weight_decay: multiplies the param first
  float one_minus_beta1 = 0.1f;   ///< 1 - beta1: lerp weight of g into exp_avg
  float beta2 = 0.999f;           ///< Multiplies exp_avg_sq.
  float one_minus_beta2 = 0.001f; ///< 1 - beta2: weight of g*g added to exp_avg_sq.
  float bias_correction2_sqrt = 1.f;  ///< sqrt(1 - beta2^step): divides sqrt(exp_avg_sq).
  float eps = 1e-8f;              ///< Added to the denominator after the bias correction.
  float neg_step_size = -1e-3f;   ///< -lr / (1 - beta1^step)
};

/** torch.optim.AdamW's single-tensor update of one element, in its order: p *= decay;
 *  m = lerp(m, g, 1-b1); v = v*b2 + ((1-b2)*g)*g; [vmax = max(vmax, v), used in v's place];
 *  p += (neg_step_size * m) / (sqrt(v)/bc2_sqrt + eps). Returns the new param; `vmax` null
 *  without amsgrad. */
SWAPOPT_HOST_DEVICE float adamw(float p, float g, float& m, float& v, float* vmax, const AdamWScalars& k) {
  p = p * k.decay;
  m = lerp(m, g, k.one_minus_beta1);
  v = v * k.beta2 + (k.one_minus_beta2 * g) * g;
  float second = v;
  if (vmax != nullptr) second = *vmax = propagating_max(*vmax, v);
#if defined(__CUDA_ARCH__)
  const float root = __fsqrt_rn(second);
#else
  const float root = __builtin_sqrtf(second);
#endif
  const float denom = root / k.bias_correction2_sqrt + k.eps;
  return p + (k.neg_step_size * m) / denom;  // torch's CPU addcdiv order: (value * t1) / t2
}

}  // namespace swapopt::formula
