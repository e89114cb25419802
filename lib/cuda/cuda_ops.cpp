// CUDA ops: GEMM and SYRK on cuBLAS (f32 accumulation), the rest as kernels/ launches.
#include <algorithm>
#include <vector>

#include "../../kernels/kernels.h"
#include "../core/matrix_layout.h"
#include "cuda_backend.h"
#include "cuda_check.h"
#include "cuda_stream.h"

namespace swapopt::cuda {

namespace {

CudaStream& cuda_stream(Stream& stream) { return static_cast<CudaStream&>(stream.impl()); }

/** Every op launches with its stream's device current (kernels and cuBLAS run on the current
 *  device), restoring the caller's afterwards. */
#define SWAPOPT_ON_STREAM_DEVICE(stream) DeviceGuard device_guard_(cuda_stream(stream).index())

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    case DType::f16: return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

int code(DType t) { return int(t); }

/** A column-major leading dimension cuBLAS takes: at least max(1, rows stored). */
int leading_dim(int64_t ld, int64_t stored_rows) { return int(std::max<int64_t>({ld, stored_rows, 1})); }

}  // namespace

// Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T, and a row-major matrix read
// column-major is its transpose: so B goes first, and each trans flag carries over unchanged.
void gemm(Stream& stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha,
          float beta) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  const MatrixLayout la = matrix_layout(a, "gemm"), lb = matrix_layout(b, "gemm"), lc = matrix_layout(c, "gemm");
  const int64_t k = trans_a ? la.rows : la.cols;
  // cuBLAS refuses a leading dimension below max(1, the stored rows), which a matrix without
  // columns (k == 0: C = beta C) has; nothing of it is read then.
  const int ldb = leading_dim(lb.ld, trans_b ? k : lc.cols), lda = leading_dim(la.ld, trans_a ? lc.rows : k);
  CudaStream& s = cuda_stream(stream);
  SWAPOPT_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      s.cublas(), trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, int(lc.cols), int(lc.rows),
      int(k), &alpha, b.data_ptr(), cuda_type(b.dtype()), ldb, lb.batch_stride, a.data_ptr(), cuda_type(a.dtype()), lda,
      la.batch_stride, &beta, c.data_ptr(), cuda_type(c.dtype()), int(lc.ld), lc.batch_stride, int(lc.batch),
      CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

// f32: cublasSsyrk fills one triangle (column-major upper = row-major lower), mirrored by a kernel.
// bf16 and f16: cuBLAS has no real SYRK for them. A Gram matrix of side >= kBlockedSyrkSide is
// cut into 2 x 2 blocks and only the three on and below the diagonal are GEMMs (3/4 of the full
// product's flops), then mirrored; a smaller one is one full GEMM, since there NS waits for the
// host's launches rather than for the flops (docs/benchmarks.md).
constexpr int64_t kBlockedSyrkSide = 4096;

void syrk(Stream& stream, const Tensor& a, bool trans_a, const Tensor& c, float alpha, float beta) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  const MatrixLayout la = matrix_layout(a, "syrk"), lc = matrix_layout(c, "syrk");
  CudaStream& s = cuda_stream(stream);
  if (a.dtype() != DType::f32 || c.dtype() != DType::f32) {
    if (lc.rows < kBlockedSyrkSide) {
      gemm(stream, a, trans_a, a, !trans_a, c, alpha, beta);
      return;
    }
    // Block (i, j), i >= j: rows i of op(a) times rows j of op(a), transposed. A diagonal block is
    // a full GEMM too (with beta it reads c's block whole, which is symmetric by the contract);
    // the mirror then copies its lower triangle over its upper one, so c comes out exactly symmetric.
    const int64_t row_dim = c.dim() - 2, col_dim = c.dim() - 1;
    const int64_t a_dim = trans_a ? a.dim() - 1 : a.dim() - 2;  // op(a)'s rows are a's columns when trans_a
    const int64_t half = (lc.rows / 2 + 63) / 64 * 64;        // the first block's side, 128-byte aligned rows
    const int64_t starts[2] = {0, half}, sizes[2] = {half, lc.rows - half};
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j <= i; ++j)
        gemm(stream, a.narrow(a_dim, starts[i], sizes[i]), trans_a, a.narrow(a_dim, starts[j], sizes[j]), !trans_a,
             c.narrow(row_dim, starts[i], sizes[i]).narrow(col_dim, starts[j], sizes[j]), alpha, beta);
  } else {
    for (int64_t batch = 0; batch < lc.batch; ++batch) {
      const float* ap = a.data<float>() + batch * la.batch_stride;
      float* cp = c.data<float>() + batch * lc.batch_stride;
      // Read column-major, a is a^T: a @ a^T is (a^T)^T (a^T) (OP_T), a^T @ a is (a^T)(a^T)^T (OP_N).
      const int64_t k = trans_a ? la.rows : la.cols;
      SWAPOPT_CUBLAS_CHECK(cublasSsyrk(s.cublas(), CUBLAS_FILL_MODE_UPPER, trans_a ? CUBLAS_OP_N : CUBLAS_OP_T,
                                       int(lc.rows), int(k), &alpha, ap, leading_dim(la.ld, trans_a ? lc.rows : k),
                                       &beta, cp, int(lc.ld)));
    }
  }
  kernels::mirror_lower(s.stream(), lc.batch, lc.rows, lc.ld, lc.batch_stride, c.data_ptr(), code(c.dtype()));
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

void axpby(Stream& stream, float alpha, const Tensor& x, float beta, const Tensor& y) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  kernels::axpby(cuda_stream(stream).stream(), x.numel(), alpha, x.data_ptr(), code(x.dtype()), beta, y.data_ptr(),
                 code(y.dtype()));
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

void lerp(Stream& stream, const Tensor& a, const Tensor& b, float weight) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  kernels::lerp(cuda_stream(stream).stream(), a.numel(), a.data_ptr(), code(a.dtype()), b.data_ptr(), code(b.dtype()), weight);
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

int64_t frobenius_norm_scratch_bytes(int64_t count, int64_t per) { return count * kernels::norm_slices(per) * 4; }

void frobenius_norm(Stream& stream, const Tensor& x, const Tensor& norms) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  const int64_t count = norms.numel(), per = count ? x.numel() / count : 0;
  // Scratch for the partial sums, stream-ordered: freed after the kernels that use it.
  const Tensor partials = Tensor::empty({frobenius_norm_scratch_bytes(count, per) / 4}, DType::f32, x.device(), &stream);
  kernels::frobenius_norm(cuda_stream(stream).stream(), count, per, x.data_ptr(), code(x.dtype()), partials.data<float>(),
                          norms.data<float>());
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

void flag_nonfinite(Stream& stream, const Tensor& x, const Tensor& flag) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  kernels::flag_nonfinite(cuda_stream(stream).stream(), x.numel(), x.data_ptr(), code(x.dtype()), flag.data<float>());
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

void scale_by_inverse_norm(Stream& stream, const Tensor& x, const Tensor& norms, float eps) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  const int64_t count = norms.numel();
  kernels::scale_by_inverse_norm(cuda_stream(stream).stream(), count, count ? x.numel() / count : 0, x.data_ptr(),
                                 code(x.dtype()), norms.data<float>(), eps);
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

void cast(Stream& stream, const Tensor& src, const Tensor& dst) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  kernels::cast(cuda_stream(stream).stream(), src.numel(), src.data_ptr(), code(src.dtype()), dst.data_ptr(), code(dst.dtype()));
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

void copy(Stream& stream, const Tensor& src, const Tensor& dst) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  if (src.numel() == 0) return;
  cudaStream_t s = cuda_stream(stream).stream();
  if (src.is_contiguous() && dst.is_contiguous()) {
    SWAPOPT_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDefault, s));
    return;
  }
  // Strided on one device: the last two dims of each matrix are one pitched 2-D copy.
  const int64_t n = src.dim(), rows = src.shape()[size_t(n - 2)], es = int64_t(src.element_size());
  const int64_t matrices = rows == 0 ? 0 : src.numel() / (rows * src.shape().back());
  for (int64_t m = 0; m < matrices; ++m) {
    int64_t rest = m, src_off = 0, dst_off = 0;
    for (int64_t d = n - 3; d >= 0; --d) {
      const int64_t i = rest % src.shape()[size_t(d)];
      rest /= src.shape()[size_t(d)];
      src_off += i * src.strides()[size_t(d)];
      dst_off += i * dst.strides()[size_t(d)];
    }
    SWAPOPT_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(dst.data_ptr()) + dst_off * es,
                                         size_t(dst.strides()[size_t(n - 2)] * es),
                                         static_cast<const char*>(src.data_ptr()) + src_off * es,
                                         size_t(src.strides()[size_t(n - 2)] * es), size_t(src.shape().back() * es),
                                         size_t(rows), cudaMemcpyDeviceToDevice, s));
  }
}

void fill_zero(Stream& stream, const Tensor& x) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  if (x.numel() == 0) return;
  SWAPOPT_CUDA_CHECK(cudaMemsetAsync(x.data_ptr(), 0, x.nbytes(), cuda_stream(stream).stream()));
}

}  // namespace swapopt::cuda

namespace swapopt::cuda {

void muon_momentum(Stream& stream, const Tensor& grad, const Tensor& buf, const Tensor& update, float m1, float m2,
                   bool nesterov) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  kernels::muon_momentum(static_cast<CudaStream&>(stream.impl()).stream(), grad.numel(), grad.data_ptr(), int(grad.dtype()),
                         buf.data_ptr(), int(buf.dtype()), update.data_ptr(), int(update.dtype()), m1, m2, nesterov);
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

void adamw_update(Stream& stream, const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const Tensor& max_exp_avg_sq, const ops::AdamWScalars& k) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  kernels::adamw_update(static_cast<CudaStream&>(stream.impl()).stream(), param.numel(), param.data_ptr(), int(param.dtype()),
                        grad.data_ptr(), int(grad.dtype()), exp_avg.data<float>(), exp_avg_sq.data<float>(),
                        max_exp_avg_sq.defined() ? max_exp_avg_sq.data<float>() : nullptr, k);
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

void adamw_update_many(Stream& stream, std::span<const ops::AdamWUpdate> updates) {
  SWAPOPT_ON_STREAM_DEVICE(stream);
  std::vector<kernels::AdamWTensor> tensors;
  tensors.reserve(updates.size());
  for (const ops::AdamWUpdate& u : updates)
    tensors.push_back({u.param.numel(), u.param.data_ptr(), int(u.param.dtype()), u.grad.data_ptr(), int(u.grad.dtype()),
                       u.exp_avg.data<float>(), u.exp_avg_sq.data<float>(),
                       u.max_exp_avg_sq.defined() ? u.max_exp_avg_sq.data<float>() : nullptr, u.scalars});
  kernels::adamw_update_many(static_cast<CudaStream&>(stream.impl()).stream(), tensors.data(), tensors.size());
  SWAPOPT_CUDA_CHECK(cudaGetLastError());
}

}  // namespace swapopt::cuda
