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

}  // namespace swapopt
