#pragma once
/** Storage element types and exact round-to-nearest-even conversions. */

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace swapopt {

/** Element type of a tensor's storage. Math always accumulates in f32. */
enum class DType : uint8_t { f32, bf16, f16 };

/** Bytes per element. */
constexpr size_t dtype_size(DType t) { return t == DType::f32 ? 4 : 2; }

/** "f32", "bf16" or "f16". */
const char* dtype_name(DType t);

/** Parses "f32"/"bf16"/"f16"; throws swapopt::Error for anything else. */
DType dtype_from_name(const std::string& name);

/** Bits of a float. */
inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

/** Float from its bits. */
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/** bf16 bits -> float (exact). */
inline float bf16_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }

/** float -> bf16 bits, round to nearest even; NaN stays a quiet NaN of the same sign. */
inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

/** f16 bits -> float (exact, subnormals included). */
float f16_to_float(uint16_t h);

/** float -> f16 bits, round to nearest even, overflow to inf, subnormals kept. */
uint16_t float_to_f16(float f);

/** Reads element i of a buffer of type t as float. */
inline float load_as_float(const void* base, size_t i, DType t) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(base)[i];
    case DType::bf16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    case DType::f16: return f16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.f;
}

/** Writes float v, rounded to type t, into element i of a buffer. */
inline void store_from_float(void* base, size_t i, DType t, float v) {
  switch (t) {
    case DType::f32: static_cast<float*>(base)[i] = v; break;
    case DType::bf16: static_cast<uint16_t*>(base)[i] = float_to_bf16(v); break;
    case DType::f16: static_cast<uint16_t*>(base)[i] = float_to_f16(v); break;
  }
}

}  // namespace swapopt
