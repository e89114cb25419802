#pragma once
// Whether an op's operands share memory (internal; used by the ops' argument checks).

#include <initializer_list>
#include <utility>

#include "swapopt/core/tensor.h"

namespace swapopt {

/** The bytes from x's first to one past its last addressed element; {null, null} for no elements. */
std::pair<const char*, const char*> byte_span(const Tensor& x);

/** Whether x and y address a byte in common (by their spans; a view of no elements shares none). */
bool spans_overlap(const Tensor& x, const Tensor& y);

/** One operand of an op, with the name its errors give it. */
struct NamedOperand {
  const Tensor& tensor;
  const char* name;
};

/** An elementwise op reads element i of each input and writes element i of each output, on
 *  threads or in vectors: an output may be the very same view as an input (in place), and must
 *  otherwise share no memory with any other operand. Throws "[op] y and x share memory without
 *  being the same view ..." or "[op] exp_avg and exp_avg_sq share memory: ...". Undefined
 *  tensors are skipped. */
void check_operands_apart(const char* op, std::initializer_list<NamedOperand> outputs,
                          std::initializer_list<NamedOperand> inputs);

}  // namespace swapopt
