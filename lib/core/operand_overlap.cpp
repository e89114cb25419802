#include "operand_overlap.h"

#include <array>
#include <functional>
#include <utility>

#include "swapopt/core/error.h"
#include "view_span.h"

namespace swapopt {

using Span = std::pair<const char*, const char*>;

Span byte_span(const Tensor& x) {
  // A tensor's view was checked when it was made, so its span fits.
  const int64_t elements = x.is_contiguous() ? x.numel() : *view_span(x.shape(), x.strides(), 1);
  if (elements == 0) return {nullptr, nullptr};
  const char* begin = static_cast<const char*>(x.data_ptr());
  return {begin, begin + elements * int64_t(x.element_size())};
}

namespace {
bool overlap(const Span& x, const Span& y) {
  return x.first != nullptr && y.first != nullptr && std::less<>()(x.first, y.second) &&
         std::less<>()(y.first, x.second);
}

bool same_view(const Tensor& x, const Tensor& y) {
  return x.data_ptr() == y.data_ptr() && x.dtype() == y.dtype() && x.shape() == y.shape() && x.strides() == y.strides();
}

Span span_if_defined(const Tensor& x) { return x.defined() ? byte_span(x) : Span{nullptr, nullptr}; }

/** Whether x addresses one element through two indices: a dim of more than one element with
 *  stride 0 (torch's test; other self-overlapping strides are not looked for). A tensor without
 *  elements addresses none, whatever its strides. */
bool repeats_elements(const Tensor& x) {
  if (!x.defined() || x.numel() == 0) return false;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (x.size(d) > 1 && x.strides()[size_t(d)] == 0) return true;
  return false;
}
}  // namespace

bool spans_overlap(const Tensor& x, const Tensor& y) { return overlap(byte_span(x), byte_span(y)); }

void check_operands_apart(const char* op, std::initializer_list<NamedOperand> outputs,
                          std::initializer_list<NamedOperand> inputs) {
  // Each span once: the fused ops check every tensor of a list of thousands.
  constexpr size_t kMost = 8;
  SWAPOPT_CHECK(outputs.size() + inputs.size() <= kMost, "[" << op << "] too many operands to check");
  std::array<Span, kMost> spans;
  size_t n = 0;
  for (const NamedOperand& o : outputs) spans[n++] = span_if_defined(o.tensor);
  for (const NamedOperand& i : inputs) spans[n++] = span_if_defined(i.tensor);
  const NamedOperand* const out = outputs.begin();
  const NamedOperand* const in = inputs.begin();
  for (size_t o = 0; o < outputs.size(); ++o) {
    SWAPOPT_CHECK(!repeats_elements(out[o].tensor), "[" << op << "] " << out[o].name << " " << out[o].tensor.str()
                                                        << " has a dim of stride 0: an output must address each of its "
                                                           "elements once");
    for (size_t other = o + 1; other < outputs.size(); ++other)
      SWAPOPT_CHECK(!overlap(spans[o], spans[other]), "[" << op << "] " << out[o].name << " and " << out[other].name
                                                          << " share memory: an op's outputs must not overlap");
    for (size_t i = 0; i < inputs.size(); ++i)
      SWAPOPT_CHECK(!overlap(spans[o], spans[outputs.size() + i]) || same_view(out[o].tensor, in[i].tensor),
                    "[" << op << "] " << out[o].name << " and " << in[i].name
                        << " share memory without being the same view: an input may be written in place only as "
                           "the very same view, and must otherwise be apart from the outputs");
  }
}

}  // namespace swapopt
