#include "operand_overlap.h"

#include <algorithm>
#include <array>
#include <functional>
#include <utility>
#include <vector>

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

enum class Repeats { no, stride_zero, folded, too_large };
constexpr int64_t kMostListed = int64_t(1) << 20;  // offsets listed to decide interleaved dims

/** Whether x addresses one element through two indices: a dim of more than one element with
 *  stride 0 (named as such), or strides that fold the dims onto each other ([2, 2] with strides
 *  [1, 1]); too_large when deciding would list more than kMostListed offsets. A tensor without
 *  elements addresses none, whatever its strides. */
Repeats repeats_elements(const Tensor& x) {
  if (!x.defined() || x.numel() < 2 || x.is_contiguous()) return Repeats::no;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of the dims of more than one element
  for (int64_t d = 0; d < x.dim(); ++d)
    if (x.size(d) > 1) dims.emplace_back(x.strides()[size_t(d)], x.size(d));
  std::sort(dims.begin(), dims.end());
  if (dims.front().first == 0) return Repeats::stride_zero;
  // Each dim, by stride, past every offset the smaller ones reach: no element twice (the common
  // case: permuted and narrowed views). The view was checked when it was made, so no sum overflows.
  // Otherwise the dims up to the last that fails this interleave ([2, 3] with strides [3, 2] is
  // fine, [2, 2] with [1, 1] is not): their offsets are listed, up to a bound; the dims after
  // them nest past them.
  int64_t reach = 0;
  size_t interleaved = 0;  // the dims [0, interleaved) to list
  for (size_t d = 0; d < dims.size(); ++d) {
    if (dims[d].first <= reach) interleaved = d + 1;
    reach += dims[d].first * (dims[d].second - 1);
  }
  if (interleaved == 0) return Repeats::no;
  int64_t listed = 1;
  for (size_t d = 0; d < interleaved; ++d) listed *= dims[d].second;  // at most numel()
  if (listed > kMostListed) return Repeats::too_large;
  std::vector<int64_t> offsets = {0};
  for (size_t d = 0; d < interleaved; ++d) {
    const auto [stride, size] = dims[d];
    const size_t n = offsets.size();
    for (int64_t i = 1; i < size; ++i)
      for (size_t j = 0; j < n; ++j) offsets.push_back(offsets[j] + i * stride);
  }
  std::sort(offsets.begin(), offsets.end());
  return std::adjacent_find(offsets.begin(), offsets.end()) != offsets.end() ? Repeats::folded : Repeats::no;
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
    const Repeats repeats = repeats_elements(out[o].tensor);
    SWAPOPT_CHECK(repeats == Repeats::no,
                  "[" << op << "] " << out[o].name << " " << out[o].tensor.str()
                      << (repeats == Repeats::stride_zero ? " has a dim of stride 0"
                          : repeats == Repeats::folded
                              ? " has strides " + shape_str(out[o].tensor.strides()) + " that reach one element twice"
                              : " has interleaved strides " + shape_str(out[o].tensor.strides()) + " over more than " +
                                    std::to_string(kMostListed) +
                                    " elements, too many to check that none is reached twice (use a contiguous "
                                    "output)")
                      << ": an output must address each of its elements once");
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
