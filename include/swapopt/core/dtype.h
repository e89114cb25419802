#pragma once
/** Storage element types and exact round-to-nearest-even conversions. */

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "swapopt/core/elementwise_formulas.h"

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
inline uint32_t float_bits(float f) { return formula::float_bits(f); }
/** Float from its bits. */
inline float bits_float(uint32_t u) { return formula::bits_float(u); }
/** bf16 bits -> float (exact). */
inline float bf16_to_float(uint16_t h) { return formula::bf16_to_float(h); }
/** float -> bf16 bits, round to nearest even; NaN stays a quiet NaN of the same sign. */
inline uint16_t float_to_bf16(float f) { return formula::float_to_bf16(f); }
/** f16 bits -> float (exact, subnormals included). */
inline float f16_to_float(uint16_t h) { return formula::f16_to_float(h); }
/** float -> f16 bits, round to nearest even, overflow to inf, subnormals kept. */
inline uint16_t float_to_f16(float f) { return formula::float_to_f16(f); }

/** Reads element i of a buffer of type t as float. */
inline float load_as_float(const void* base, size_t i, DType t) { return formula::load(base, i, int(t)); }

/** Writes float v, rounded to type t, into element i of a buffer. */
inline void store_from_float(void* base, size_t i, DType t, float v) { formula::store(base, i, int(t), v); }

}  // namespace swapopt
