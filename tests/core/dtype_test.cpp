#include <cmath>
#include <limits>

#include "test_util.h"

using namespace swapopt;

TEST_CASE("bf16: every one of the 65536 patterns round-trips through float") {
  int mismatches = 0;
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const uint16_t h = uint16_t(bits);
    const float f = bf16_to_float(h);
    const uint16_t back = float_to_bf16(f);
    const bool is_nan = std::isnan(f);
    if (is_nan ? !std::isnan(bf16_to_float(back)) : back != h) ++mismatches;
  }
  CHECK(mismatches == 0);
}

TEST_CASE("bf16: rounds to nearest, ties to even") {
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1 + 2^-7: ties go to the even mantissa (1.0).
  CHECK(float_to_bf16(1.0f + 0x1p-8f) == 0x3f80);
  // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even): rounds up.
  CHECK(float_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82);
  CHECK(float_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);  // just above the tie: up
  CHECK(float_to_bf16(std::numeric_limits<float>::max()) == 0x7f80);  // overflows to inf
  CHECK(float_to_bf16(-0.0f) == 0x8000);
  CHECK(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
}

TEST_CASE("f16: every pattern round-trips and edge cases round correctly") {
  int mismatches = 0;
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const float f = f16_to_float(uint16_t(bits));
    if (std::isnan(f)) {
      if (!std::isnan(f16_to_float(float_to_f16(f)))) ++mismatches;
    } else if (float_to_f16(f) != bits) {
      ++mismatches;
    }
  }
  CHECK(mismatches == 0);
  CHECK(f16_to_float(0x7bff) == 65504.f);              // largest finite
  CHECK(float_to_f16(65519.f) == 0x7bff);              // below the tie: stays finite
  CHECK(float_to_f16(65520.f) == 0x7c00);              // tie to even: inf
  CHECK(f16_to_float(0x0001) == 0x1p-24f);             // smallest subnormal
  CHECK(float_to_f16(0x1p-25f) == 0x0000);             // half of it: tie to even zero
  CHECK(float_to_f16(0x1p-25f + 0x1p-40f) == 0x0001);  // just above: up
  CHECK(float_to_f16(3 * 0x1p-25f) == 0x0002);         // 1.5 ulp: tie to even (2)
  CHECK(f16_to_float(0x0400) == 0x1p-14f);             // smallest normal
  CHECK(float_to_f16(0x1p-14f - 0x1p-26f) == 0x0400);  // rounds up into the normal range
  CHECK(float_to_f16(-2.f) == 0xc000);
  CHECK(float_to_f16(1.f + 0x1p-11f) == 0x3c00);       // tie below 1 ulp: even
  CHECK(float_to_f16(1.f + 3 * 0x1p-11f) == 0x3c02);
  CHECK(float_to_f16(1e-10f) == 0x0000);
  CHECK(float_to_f16(-std::numeric_limits<float>::infinity()) == 0xfc00);
}

TEST_CASE("dtype names parse and bad names are named in the error") {
  CHECK(dtype_from_name("bf16") == DType::bf16);
  CHECK(dtype_size(DType::f16) == 2);
  CHECK_THROWS_WITH_AS(dtype_from_name("f64"), "[dtype] unknown dtype 'f64' (expected f32, bf16 or f16)", Error);
}

TEST_CASE("the version: macros from the project version, and the linked library's") {
  CHECK(std::string(version()) == SWAPOPT_VERSION_STRING);
  CHECK(std::string(SWAPOPT_VERSION_STRING) ==
        std::to_string(SWAPOPT_VERSION_MAJOR) + "." + std::to_string(SWAPOPT_VERSION_MINOR) + "." +
            std::to_string(SWAPOPT_VERSION_PATCH));
}
