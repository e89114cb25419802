// Argument checks shared by both backends, then dispatch on the stream's device.
#include "swapopt/core/ops.h"

#include <algorithm>
#include <functional>
#include <utility>

#include "../cpu/cpu_ops.h"
#include "../cuda/cuda_backend.h"
#include "matrix_layout.h"
#include "operand_overlap.h"
#include "ops_between_allocations.h"
#include "swapopt/core/error.h"

namespace swapopt {

MatrixLayout matrix_layout(const Tensor& t, const char* op) {
  SWAPOPT_CHECK(t.dim() == 2 || t.dim() == 3, "[" << op << "] expected a 2-D or 3-D tensor, got " << t.str());
  MatrixLayout m;
  const int64_t r = t.dim() - 2;
  m.batch = t.dim() == 3 ? t.size(0) : 1;
  m.rows = t.size(r);
  m.cols = t.size(r + 1);
  if (t.numel() == 0) {  // no element is read or written: whatever strides a view of nothing has
    m.ld = m.cols;
    m.batch_stride = m.rows * m.cols;
    return m;
  }
  SWAPOPT_CHECK(t.strides()[size_t(r + 1)] == 1 || m.cols <= 1,
                "[" << op << "] matrices need unit stride in the last dim, got strides " << shape_str(t.strides()));
  m.ld = m.rows <= 1 ? m.cols : t.strides()[size_t(r)];
  SWAPOPT_CHECK(m.ld >= m.cols, "[" << op << "] row stride " << m.ld << " is smaller than " << m.cols << " columns");
  m.batch_stride = t.dim() == 3 ? t.strides()[0] : 0;
  return m;
}

namespace ops {

namespace {

void check_on_stream(const Stream& stream, const Tensor& t, const char* op, const char* name) {
  SWAPOPT_CHECK(t.defined(), "[" << op << "] " << name << " is undefined");
  SWAPOPT_CHECK(t.device() == stream.device(),
                "[" << op << "] " << name << " is on " << t.device().str() << " but the stream is on " << stream.device().str());
  SWAPOPT_CHECK(!t.is_released(), "[" << op << "] " << name << " " << t.str() << " has released storage");
}

/** x and y on the stream, of one shape, contiguous; the errors call them `x_name` and `y_name`. */
void check_elementwise(const Stream& stream, const Tensor& x, const Tensor& y, const char* op, const char* x_name = "x",
                       const char* y_name = "y") {
  check_on_stream(stream, x, op, x_name);
  check_on_stream(stream, y, op, y_name);
  SWAPOPT_CHECK(x.shape() == y.shape(), "[" << op << "] shape mismatch " << shape_str(x.shape()) << " vs " << shape_str(y.shape()));
  SWAPOPT_CHECK(x.is_contiguous() && y.is_contiguous(), "[" << op << "] needs contiguous tensors, got " << x.str() << " and " << y.str());
}

void check_matmul_dtypes(const Tensor& a, const Tensor& b, const Tensor& c, const char* op) {
  SWAPOPT_CHECK(a.dtype() == b.dtype(), "[" << op << "] dtype mismatch: a is " << dtype_name(a.dtype()) << ", b is "
                                            << dtype_name(b.dtype()));
  SWAPOPT_CHECK(a.dtype() != DType::f16 && c.dtype() != DType::f16,
                "[" << op << "] supports f32 and bf16, got " << dtype_name(a.dtype()) << " -> " << dtype_name(c.dtype()));
  // What cuBLAS computes with CUBLAS_COMPUTE_32F, so both backends accept the same combinations.
  SWAPOPT_CHECK(a.dtype() == DType::bf16 || c.dtype() == DType::f32,
                "[" << op << "] f32 inputs need an f32 output (no f32 x f32 -> " << dtype_name(c.dtype()) << " product in cuBLAS)");
  SWAPOPT_CHECK(c.is_contiguous(), "[" << op << "] output " << c.str() << " must be contiguous");
}

/** A product writes its output while it reads its inputs: they must not share memory. */
void check_output_apart(const Tensor& out, const Tensor& in, const char* op, const char* name) {
  SWAPOPT_CHECK(!spans_overlap(out, in), "[" << op << "] out_c shares memory with " << name
                                             << " (a product writes its output while it reads its inputs)");
}

/** The product of the leading dims (1 for a matrix or fewer dims): also for matrices of 0 rows or
 *  columns, which hold no elements. */
/** The matrices of x (the product of its leading dims), or a named error of `op` for a count past
 *  int64 (possible only for a shape with a 0 among its matrix dims). */
int64_t matrices_in(const Tensor& x, const char* op) {
  int64_t count = 1;
  for (int64_t d = 0; d + 2 < x.dim(); ++d)
    SWAPOPT_CHECK(!__builtin_mul_overflow(count, x.size(d), &count),
                  "[" << op << "] x " << x.str() << " holds more matrices than an int64 counts");
  return count;
}

}  // namespace

void gemm(Stream& stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& out_c, float alpha,
          float beta) {
  const char* op = "gemm";
  check_on_stream(stream, a, op, "a");
  check_on_stream(stream, b, op, "b");
  check_on_stream(stream, out_c, op, "c");
  check_matmul_dtypes(a, b, out_c, op);
  check_output_apart(out_c, a, op, "a");
  check_output_apart(out_c, b, op, "b");
  const MatrixLayout la = matrix_layout(a, op), lb = matrix_layout(b, op), lc = matrix_layout(out_c, op);
  const int64_t m = trans_a ? la.cols : la.rows, k = trans_a ? la.rows : la.cols;
  const int64_t kb = trans_b ? lb.cols : lb.rows, n = trans_b ? lb.rows : lb.cols;
  SWAPOPT_CHECK(k == kb && lc.rows == m && lc.cols == n && la.batch == lb.batch && lb.batch == lc.batch,
                "[gemm] shapes do not match: a " << shape_str(a.shape()) << (trans_a ? "^T" : "") << " @ b "
                                                 << shape_str(b.shape()) << (trans_b ? "^T" : "") << " -> c "
                                                 << shape_str(out_c.shape()));
  if (out_c.numel() == 0) return;  // no output element: nothing to compute, on either backend
  if (stream.device().is_cpu()) {
    cpu::gemm(stream, a, trans_a, b, trans_b, out_c, alpha, beta);
  } else {
    cuda::gemm(stream, a, trans_a, b, trans_b, out_c, alpha, beta);
  }
}

void syrk(Stream& stream, const Tensor& a, bool trans_a, const Tensor& out_c, float alpha, float beta) {
  const char* op = "syrk";
  check_on_stream(stream, a, op, "a");
  check_on_stream(stream, out_c, op, "c");
  check_matmul_dtypes(a, a, out_c, op);
  check_output_apart(out_c, a, op, "a");
  const MatrixLayout la = matrix_layout(a, op), lc = matrix_layout(out_c, op);
  const int64_t m = trans_a ? la.cols : la.rows;
  SWAPOPT_CHECK(lc.rows == m && lc.cols == m && la.batch == lc.batch,
                "[syrk] shapes do not match: a " << shape_str(a.shape()) << (trans_a ? "^T" : "") << " @ its transpose -> c "
                                                 << shape_str(out_c.shape()));
  if (out_c.numel() == 0) return;  // no output element: nothing to compute, on either backend
  if (stream.device().is_cpu()) {
    cpu::syrk(stream, a, trans_a, out_c, alpha, beta);
  } else {
    cuda::syrk(stream, a, trans_a, out_c, alpha, beta);
  }
}

void scale(Stream& stream, const Tensor& x, float alpha) {
  check_elementwise(stream, x, x, "scale");  // its errors named as the caller wrote it
  axpby(stream, alpha, x, 0.f, x);
}

void axpby(Stream& stream, float alpha, const Tensor& x, float beta, const Tensor& out_y) {
  check_elementwise(stream, x, out_y, "axpby");
  check_operands_apart("axpby", {{out_y, "y"}}, {{x, "x"}});
  if (stream.device().is_cpu()) {
    cpu::axpby(stream, alpha, x, beta, out_y);
  } else {
    cuda::axpby(stream, alpha, x, beta, out_y);
  }
}

void lerp(Stream& stream, const Tensor& out_a, const Tensor& b, float weight) {
  check_elementwise(stream, out_a, b, "lerp", "a", "b");
  check_operands_apart("lerp", {{out_a, "a"}}, {{b, "b"}});
  if (stream.device().is_cpu()) {
    cpu::lerp(stream, out_a, b, weight);
  } else {
    cuda::lerp(stream, out_a, b, weight);
  }
}

void frobenius_norm(Stream& stream, const Tensor& x, const Tensor& out_norms) {
  check_on_stream(stream, x, "frobenius_norm", "x");
  check_on_stream(stream, out_norms, "frobenius_norm", "norms");
  SWAPOPT_CHECK(x.is_contiguous(), "[frobenius_norm] x " << x.str() << " must be contiguous");
  const int64_t matrices = matrices_in(x, "frobenius_norm");
  SWAPOPT_CHECK(
      out_norms.dtype() == DType::f32 && out_norms.is_contiguous() && out_norms.numel() == matrices,
      "[frobenius_norm] norms must be contiguous f32 with " << matrices << " elements, got " << out_norms.str());
  check_operands_apart("frobenius_norm", {{out_norms, "norms"}}, {{x, "x"}});
  if (x.numel() == 0) {  // matrices without elements (or none): norms of 0
    fill_zero(stream, out_norms);
    return;
  }
  if (stream.device().is_cpu()) {
    cpu::frobenius_norm(stream, x, out_norms);
  } else {
    cuda::frobenius_norm(stream, x, out_norms);
  }
}

int64_t frobenius_norm_scratch_bytes(Device device, int64_t count, int64_t per) {
  return device.is_cpu() ? 0 : cuda::frobenius_norm_scratch_bytes(count, per);
}

void flag_nonfinite(Stream& stream, const Tensor& x, const Tensor& out_flag) {
  check_on_stream(stream, x, "flag_nonfinite", "x");
  check_on_stream(stream, out_flag, "flag_nonfinite", "flag");
  SWAPOPT_CHECK(x.is_contiguous(), "[flag_nonfinite] x " << x.str() << " must be contiguous");
  SWAPOPT_CHECK(out_flag.dtype() == DType::f32 && out_flag.numel() == 1,
                "[flag_nonfinite] flag must be one f32 element, got " << out_flag.str());
  check_operands_apart("flag_nonfinite", {{out_flag, "flag"}}, {{x, "x"}});
  if (x.numel() == 0) return;
  if (stream.device().is_cpu()) {
    cpu::flag_nonfinite(stream, x, out_flag);
  } else {
    cuda::flag_nonfinite(stream, x, out_flag);
  }
}

void scale_by_inverse_norm(Stream& stream, const Tensor& x, const Tensor& norms, float eps) {
  check_on_stream(stream, x, "scale_by_inverse_norm", "x");
  check_on_stream(stream, norms, "scale_by_inverse_norm", "norms");
  SWAPOPT_CHECK(x.is_contiguous(), "[scale_by_inverse_norm] x " << x.str() << " must be contiguous");
  const int64_t matrices = matrices_in(x, "scale_by_inverse_norm");
  SWAPOPT_CHECK(
      norms.dtype() == DType::f32 && norms.is_contiguous() && norms.numel() == matrices,
      "[scale_by_inverse_norm] norms must be contiguous f32 with " << matrices << " elements, got " << norms.str());
  check_operands_apart("scale_by_inverse_norm", {{x, "x"}}, {{norms, "norms"}});
  if (x.numel() == 0) return;
  if (stream.device().is_cpu()) {
    cpu::scale_by_inverse_norm(stream, x, norms, eps);
  } else {
    cuda::scale_by_inverse_norm(stream, x, norms, eps);
  }
}

void cast(Stream& stream, const Tensor& src, const Tensor& out_dst) {
  check_elementwise(stream, src, out_dst, "cast", "src", "dst");
  check_operands_apart("cast", {{out_dst, "dst"}}, {{src, "src"}});
  if (stream.device().is_cpu()) {
    cpu::cast(stream, src, out_dst);
  } else {
    cuda::cast(stream, src, out_dst);
  }
}

namespace {
/** ops::copy (`check_apart`) or copy_between_allocations. */
void copy_checked(Stream& stream, const Tensor& src, const Tensor& out_dst, bool check_apart);
}  // namespace

void copy(Stream& stream, const Tensor& src, const Tensor& out_dst) { copy_checked(stream, src, out_dst, true); }

void copy_between_allocations(Stream& stream, const Tensor& src, const Tensor& out_dst) {
  copy_checked(stream, src, out_dst, false);
}

namespace {
void copy_checked(Stream& stream, const Tensor& src, const Tensor& out_dst, bool check_apart) {
  SWAPOPT_CHECK(src.defined() && out_dst.defined(), "[copy] undefined tensor");
  SWAPOPT_CHECK(!src.is_released() && !out_dst.is_released(), "[copy] released storage: " << src.str() << " -> " << out_dst.str());
  SWAPOPT_CHECK(src.shape() == out_dst.shape() && src.dtype() == out_dst.dtype(),
                "[copy] " << src.str() << " -> " << out_dst.str() << ": shape and dtype must match");
  if (check_apart) check_operands_apart("copy", {{out_dst, "dst"}}, {{src, "src"}});
  // The same view (what check_operands_apart lets through): nothing to copy, and memcpy's
  // buffers must not overlap.
  const bool same_view = src.data_ptr() == out_dst.data_ptr();
  const bool on_cuda = src.device().is_cuda() || out_dst.device().is_cuda();
  if (!on_cuda) {
    SWAPOPT_CHECK(stream.device().is_cpu(), "[copy] a host-to-host copy needs a CPU stream, got " << stream.device().str());
    if (!same_view) cpu::copy(stream, src, out_dst);
    return;
  }
  const Device cuda_side = src.device().is_cuda() ? src.device() : out_dst.device();
  SWAPOPT_CHECK(stream.device() == cuda_side, "[copy] " << src.str() << " -> " << out_dst.str() << " must run on a stream of "
                                                        << cuda_side.str() << ", got " << stream.device().str());
  if (src.device() != out_dst.device()) {
    SWAPOPT_CHECK(src.is_contiguous() && out_dst.is_contiguous(),
                  "[copy] copies to or from a CUDA device need contiguous tensors: " << src.str() << " -> " << out_dst.str());
  } else if (!src.is_contiguous() || !out_dst.is_contiguous()) {
    SWAPOPT_CHECK(src.dim() >= 2 && src.strides().back() == 1 && out_dst.strides().back() == 1,
                  "[copy] strided copies on a CUDA device need unit stride in the last of at least 2 dims: "
                      << src.str() << " -> " << out_dst.str());
  }
  if (!same_view) cuda::copy(stream, src, out_dst);
}
}  // namespace

void fill_zero(Stream& stream, const Tensor& out_x) {
  check_on_stream(stream, out_x, "fill_zero", "x");
  SWAPOPT_CHECK(out_x.is_contiguous(), "[fill_zero] " << out_x.str() << " must be contiguous");
  if (stream.device().is_cpu()) {
    cpu::fill_zero(stream, out_x);
  } else {
    cuda::fill_zero(stream, out_x);
  }
}

}  // namespace ops
}  // namespace swapopt
