// CPU ops on Eigen. GEMMs run in f32 (bf16 inputs are widened first, outputs rounded on store), one
// matrix at a time with Eigen's own threads, so a batched call and a loop of single calls give the
// same bits.
#include "cpu_ops.h"

#include <Eigen/Core>
#include <cmath>
#include <cstring>
#include <vector>

#include "../core/matrix_layout.h"

namespace swapopt::cpu {

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrixMap = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
using MatrixMap = Eigen::Map<RowMatrix, 0, Eigen::OuterStride<>>;

/** One matrix of a batch as f32: a direct pointer for f32 storage, else widened into `scratch`. */
struct F32Matrix {
  const float* data;
  int64_t ld;
};

F32Matrix widen(const Tensor& t, const MatrixLayout& l, int64_t b, std::vector<float>& scratch) {
  const int64_t first = b * l.batch_stride;
  if (t.dtype() == DType::f32) return {t.data<float>() + first, l.ld};
  scratch.resize(size_t(l.rows * l.cols));
  const void* base = t.data_ptr();
  for (int64_t i = 0; i < l.rows; ++i)
    for (int64_t j = 0; j < l.cols; ++j)
      scratch[size_t(i * l.cols + j)] = load_as_float(base, size_t(first + i * l.ld + j), t.dtype());
  return {scratch.data(), l.cols};
}

/** Output matrix b as f32: in place for f32 storage, else through `scratch` (loaded when beta != 0). */
float* output_f32(const Tensor& c, const MatrixLayout& l, int64_t b, float beta, std::vector<float>& scratch) {
  if (c.dtype() == DType::f32) return c.data<float>() + b * l.batch_stride;
  scratch.resize(size_t(l.rows * l.cols));
  if (beta != 0.f) {
    const void* base = c.data_ptr();
    for (int64_t i = 0; i < l.rows * l.cols; ++i)
      scratch[size_t(i)] = load_as_float(base, size_t(b * l.batch_stride + i), c.dtype());
  }
  return scratch.data();
}

void store_output(const Tensor& c, const MatrixLayout& l, int64_t b, const float* values) {
  if (c.dtype() == DType::f32) return;
  void* base = c.data_ptr();
  for (int64_t i = 0; i < l.rows * l.cols; ++i) store_from_float(base, size_t(b * l.batch_stride + i), c.dtype(), values[size_t(i)]);
}

/** c = alpha * lhs * rhs when beta == 0, else c += alpha * lhs * rhs (c already scaled by beta). */
template <typename Out, typename LhsExpr, typename RhsExpr>
void multiply_into(Out&& c, const LhsExpr& lhs, const RhsExpr& rhs, float alpha, float beta) {
  if (beta == 0.f) {
    c.noalias() = alpha * lhs * rhs;
  } else {
    c.noalias() += alpha * lhs * rhs;
  }
}

void gemm_now(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha, float beta) {
  const MatrixLayout la = matrix_layout(a, "gemm"), lb = matrix_layout(b, "gemm"), lc = matrix_layout(c, "gemm");
  std::vector<float> a_scratch, b_scratch, c_scratch;
  for (int64_t batch = 0; batch < lc.batch; ++batch) {
    const F32Matrix fa = widen(a, la, batch, a_scratch);
    const F32Matrix fb = widen(b, lb, batch, b_scratch);
    ConstMatrixMap ma(fa.data, la.rows, la.cols, Eigen::OuterStride<>(fa.ld));
    ConstMatrixMap mb(fb.data, lb.rows, lb.cols, Eigen::OuterStride<>(fb.ld));
    float* out = output_f32(c, lc, batch, beta, c_scratch);
    MatrixMap mc(out, lc.rows, lc.cols, Eigen::OuterStride<>(c.dtype() == DType::f32 ? lc.ld : lc.cols));
    if (beta != 0.f && beta != 1.f) mc *= beta;
    if (!trans_a && !trans_b) multiply_into(mc, ma, mb, alpha, beta);
    if (!trans_a && trans_b) multiply_into(mc, ma, mb.transpose(), alpha, beta);
    if (trans_a && !trans_b) multiply_into(mc, ma.transpose(), mb, alpha, beta);
    if (trans_a && trans_b) multiply_into(mc, ma.transpose(), mb.transpose(), alpha, beta);
    store_output(c, lc, batch, out);
  }
}

/** Row-block size of the symmetric product: block row i computes only columns [0, (i+1)*kSyrkBlock). */
constexpr int64_t kSyrkBlock = 128;

void syrk_now(const Tensor& a, bool trans_a, const Tensor& c, float alpha, float beta) {
  const MatrixLayout la = matrix_layout(a, "syrk"), lc = matrix_layout(c, "syrk");
  std::vector<float> a_scratch, c_scratch;
  const int64_t m = lc.rows;
  for (int64_t batch = 0; batch < lc.batch; ++batch) {
    const F32Matrix fa = widen(a, la, batch, a_scratch);
    ConstMatrixMap ma(fa.data, la.rows, la.cols, Eigen::OuterStride<>(fa.ld));
    float* out = output_f32(c, lc, batch, beta, c_scratch);
    MatrixMap mc(out, m, m, Eigen::OuterStride<>(c.dtype() == DType::f32 ? lc.ld : lc.cols));
    // Lower triangle by row blocks (each a GEMM on Eigen's threads), then mirror it: about half
    // the flops of the full product.
    for (int64_t r0 = 0; r0 < m; r0 += kSyrkBlock) {
      const int64_t rows = std::min(kSyrkBlock, m - r0), cols = r0 + rows;
      auto block = mc.block(r0, 0, rows, cols);
      if (beta != 0.f && beta != 1.f) block *= beta;
      if (trans_a) {
        multiply_into(block, ma.middleCols(r0, rows).transpose(), ma.leftCols(cols), alpha, beta);
      } else {
        multiply_into(block, ma.middleRows(r0, rows), ma.topRows(cols).transpose(), alpha, beta);
      }
    }
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = i + 1; j < m; ++j) mc(i, j) = mc(j, i);
    store_output(c, lc, batch, out);
  }
}

/** Elementwise ops take an f32 fast path when both tensors are f32. */
bool all_f32(const Tensor& x, const Tensor& y) { return x.dtype() == DType::f32 && y.dtype() == DType::f32; }

/** torch.lerp's formula, exact at both ends. */
inline float lerp_value(float a, float b, float w) { return w < 0.5f ? a + w * (b - a) : b - (b - a) * (1.f - w); }

void strided_copy(const Tensor& src, const Tensor& dst) {
  const int64_t n = src.numel(), nd = src.dim();
  const size_t es = src.element_size();
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  std::vector<int64_t> index(size_t(nd), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t so = 0, dof = 0;
    for (int64_t k = 0; k < nd; ++k) {
      so += index[size_t(k)] * src.strides()[size_t(k)];
      dof += index[size_t(k)] * dst.strides()[size_t(k)];
    }
    std::memcpy(d + dof * int64_t(es), s + so * int64_t(es), es);
    for (int64_t k = nd - 1; k >= 0; --k) {
      if (++index[size_t(k)] < src.shape()[size_t(k)]) break;
      index[size_t(k)] = 0;
    }
  }
}

}  // namespace

void gemm(Stream& stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha,
          float beta) {
  stream.enqueue([=] { gemm_now(a, trans_a, b, trans_b, c, alpha, beta); });
}

void syrk(Stream& stream, const Tensor& a, bool trans_a, const Tensor& c, float alpha, float beta) {
  stream.enqueue([=] { syrk_now(a, trans_a, c, alpha, beta); });
}

void axpby(Stream& stream, float alpha, const Tensor& x, float beta, const Tensor& y) {
  stream.enqueue([=] {
    const size_t n = size_t(x.numel());
    if (all_f32(x, y)) {
      const float* xv = x.data<float>();
      float* yv = y.data<float>();
      if (beta == 0.f) {
        for (size_t i = 0; i < n; ++i) yv[i] = alpha * xv[i];
      } else {
        for (size_t i = 0; i < n; ++i) yv[i] = alpha * xv[i] + beta * yv[i];
      }
      return;
    }
    const void* xb = x.data_ptr();
    void* yb = y.data_ptr();
    for (size_t i = 0; i < n; ++i) {
      const float xv = load_as_float(xb, i, x.dtype());
      const float yv = beta == 0.f ? alpha * xv : alpha * xv + beta * load_as_float(yb, i, y.dtype());
      store_from_float(yb, i, y.dtype(), yv);
    }
  });
}

void lerp(Stream& stream, const Tensor& a, const Tensor& b, float weight) {
  stream.enqueue([=] {
    const size_t n = size_t(a.numel());
    if (all_f32(a, b)) {
      float* av = a.data<float>();
      const float* bv = b.data<float>();
      for (size_t i = 0; i < n; ++i) av[i] = lerp_value(av[i], bv[i], weight);
      return;
    }
    void* ab = a.data_ptr();
    const void* bb = b.data_ptr();
    for (size_t i = 0; i < n; ++i) {
      store_from_float(ab, i, a.dtype(), lerp_value(load_as_float(ab, i, a.dtype()), load_as_float(bb, i, b.dtype()), weight));
    }
  });
}

void frobenius_norm(Stream& stream, const Tensor& x, const Tensor& norms) {
  stream.enqueue([=] {
    const int64_t count = norms.numel();
    const int64_t per = count == 0 ? 0 : x.numel() / count;
    const void* base = x.data_ptr();
    float* out = norms.data<float>();
    for (int64_t m = 0; m < count; ++m) {
      double sum = 0.0;
      for (int64_t i = 0; i < per; ++i) {
        const double v = load_as_float(base, size_t(m * per + i), x.dtype());
        sum += v * v;
      }
      out[m] = float(std::sqrt(sum));
    }
  });
}

void scale_by_inverse_norm(Stream& stream, const Tensor& x, const Tensor& norms, float eps) {
  stream.enqueue([=] {
    const int64_t count = norms.numel();
    const int64_t per = count == 0 ? 0 : x.numel() / count;
    void* base = x.data_ptr();
    const float* nv = norms.data<float>();
    for (int64_t m = 0; m < count; ++m) {
      const float denom = nv[m] + eps;
      for (int64_t i = 0; i < per; ++i) {
        const size_t at = size_t(m * per + i);
        store_from_float(base, at, x.dtype(), load_as_float(base, at, x.dtype()) / denom);
      }
    }
  });
}

void cast(Stream& stream, const Tensor& src, const Tensor& dst) {
  stream.enqueue([=] {
    const size_t n = size_t(src.numel());
    const void* sb = n ? src.data_ptr() : nullptr;
    void* db = n ? dst.data_ptr() : nullptr;
    for (size_t i = 0; i < n; ++i) store_from_float(db, i, dst.dtype(), load_as_float(sb, i, src.dtype()));
  });
}

void copy(Stream& stream, const Tensor& src, const Tensor& dst) {
  stream.enqueue([=] {
    if (src.numel() == 0) return;
    if (src.is_contiguous() && dst.is_contiguous()) {
      std::memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes());
    } else {
      strided_copy(src, dst);
    }
  });
}

void fill_zero(Stream& stream, const Tensor& x) {
  stream.enqueue([=] {
    if (x.numel() > 0) std::memset(x.data_ptr(), 0, x.nbytes());
  });
}

}  // namespace swapopt::cpu
