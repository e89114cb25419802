#include "operand_overlap.h"

#include <functional>

#include "swapopt/core/error.h"
#include "view_span.h"

namespace swapopt {

std::pair<const char*, const char*> byte_span(const Tensor& x) {
  // A tensor's view was checked when it was made, so its span fits.
  const int64_t bytes = *view_span(x.shape(), x.strides(), x.element_size()) * int64_t(x.element_size());
  if (bytes == 0) return {nullptr, nullptr};
  const char* begin = static_cast<const char*>(x.data_ptr());
  return {begin, begin + bytes};
}

bool spans_overlap(const Tensor& x, const Tensor& y) {
  const auto [x_begin, x_end] = byte_span(x);
  const auto [y_begin, y_end] = byte_span(y);
  return x_begin != nullptr && y_begin != nullptr && std::less<>()(x_begin, y_end) && std::less<>()(y_begin, x_end);
}

namespace {
bool same_view(const Tensor& x, const Tensor& y) {
  return x.data_ptr() == y.data_ptr() && x.dtype() == y.dtype() && x.shape() == y.shape() && x.strides() == y.strides();
}
}  // namespace

void check_operands_apart(const char* op, std::initializer_list<NamedOperand> outputs,
                          std::initializer_list<NamedOperand> inputs) {
  for (auto out = outputs.begin(); out != outputs.end(); ++out) {
    if (!out->tensor.defined()) continue;
    for (auto other = std::next(out); other != outputs.end(); ++other)
      SWAPOPT_CHECK(!other->tensor.defined() || !spans_overlap(out->tensor, other->tensor),
                    "[" << op << "] " << out->name << " and " << other->name
                        << " share memory: an op's outputs must not overlap");
    for (const NamedOperand& in : inputs)
      SWAPOPT_CHECK(!in.tensor.defined() || !spans_overlap(out->tensor, in.tensor) || same_view(out->tensor, in.tensor),
                    "[" << op << "] " << out->name << " and " << in.name
                        << " share memory without being the same view: an input may be written in place only as "
                           "the very same view, and must otherwise be apart from the outputs");
  }
}

}  // namespace swapopt
