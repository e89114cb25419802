#pragma once
// How a 2-D or 3-D tensor lays out its matrices (internal; used by both backends' GEMMs).

#include <cstdint>

#include "swapopt/core/tensor.h"

namespace swapopt {

/** Row-major matrices: element (b, i, j) is at offset b*batch_stride + i*ld + j. */
struct MatrixLayout {
  int64_t batch = 1;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;            // elements between rows
  int64_t batch_stride = 0;  // elements between matrices
};

/** Layout of `t` (2-D or 3-D, unit stride in the last dim); throws naming `op` otherwise. */
MatrixLayout matrix_layout(const Tensor& t, const char* op);

}  // namespace swapopt
