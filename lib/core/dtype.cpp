#include "swapopt/core/dtype.h"

#include "swapopt/core/error.h"

namespace swapopt {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
  }
  return "?";
}

DType dtype_from_name(const std::string& name) {
  if (name == "f32") return DType::f32;
  if (name == "bf16") return DType::bf16;
  if (name == "f16") return DType::f16;
  SWAPOPT_FAIL("[dtype] unknown dtype '" << name << "' (expected f32, bf16 or f16)");
}

float f16_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent != 0) return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_float(sign);  // signed zero
  // Subnormal: value = mantissa * 2^-24, exact in f32.
  const float magnitude = float(mantissa) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  const uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return uint16_t(sign | 0x7e00u | ((abs >> 13) & 0x3ffu));  // quiet NaN
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65536: inf
  if (abs < 0x38800000u) {
    // Result is subnormal (or zero): scale so that one f16 subnormal ulp (2^-24) is 1.0, then let
    // the f32 adder round to nearest even at that position.
    const float scaled = bits_float(abs) * 0x1p24f;
    return uint16_t(sign | uint16_t(__builtin_nearbyintf(scaled)));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  uint32_t rebased = abs - 0x38000000u;  // exponent bias 127 -> 15
  rebased += 0xfffu + ((rebased >> 13) & 1u);
  return uint16_t(sign | (rebased >> 13));
}

}  // namespace swapopt
