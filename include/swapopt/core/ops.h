#pragma once
/** The tensor operations the optimizers need, on both backends, each asynchronous on a stream.
 *
 * Conventions: every op enqueues on `stream`, whose device must match the tensors'; inputs are
 * read and outputs written when the stream runs the op, so the caller keeps them alive and orders
 * other streams with events. Arguments named out_* are written; all others are only read.
 * Math runs in f32 whatever the storage dtype; results are rounded to nearest even on store.
 * Errors in arguments (shapes, dtypes, devices, layouts) throw swapopt::Error at the call.
 * The elementwise and fused ops may write an input in place only as the very same view (same
 * address, dtype, shape and strides); any other memory an output shares with another argument
 * throws ("[axpby] y and x share memory without being the same view ..."). A copy onto its own
 * view does nothing.
 * Results are the same every run on one machine; on the CPU a GEMM's bits may depend on the
 * OpenMP thread count (Eigen's blocking), so compare runs across processes at one thread count.
 */

#include "swapopt/core/stream.h"
#include "swapopt/core/tensor.h"

namespace swapopt::ops {

/** out_c = alpha * op(a) @ op(b) + beta * out_c, op(x) = x^T when trans_x.
 *  2-D, or 3-D with an equal leading batch dim (strided batched). a and b: f32 or bf16, the same;
 *  out_c: f32 (any inputs) or bf16 (bf16 inputs), contiguous, sharing no memory with a or b. Each
 *  matrix of a and b has unit stride in its last dim. */
void gemm(Stream& stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& out_c,
          float alpha = 1.f, float beta = 0.f);

/** out_c = alpha * op(a) @ op(a)^T + beta * out_c, op(a) = a^T when trans_a; both triangles
 *  written (symmetric rank-k update). Same layouts as gemm; op(a) [.., m, k], out_c [.., m, m].
 *  With beta != 0 only the lower triangle of out_c is read, so out_c must hold a symmetric matrix. */
void syrk(Stream& stream, const Tensor& a, bool trans_a, const Tensor& out_c, float alpha = 1.f, float beta = 0.f);

/** x *= alpha. Elementwise ops take contiguous tensors of one shape; dtypes may differ. */
void scale(Stream& stream, const Tensor& x, float alpha);

/** out_y = alpha * x + beta * out_y. */
void axpby(Stream& stream, float alpha, const Tensor& x, float beta, const Tensor& out_y);

/** out_a = out_a + weight * (b - out_a). */
void lerp(Stream& stream, const Tensor& out_a, const Tensor& b, float weight);

/** out_norms[i] = ||x[i]||_F over the last two dims of x (a 2-D x is a batch of one); out_norms is
 *  f32 with one element per matrix. Sums of squares accumulate in f64 on the CPU. */
void frobenius_norm(Stream& stream, const Tensor& x, const Tensor& out_norms);
/** Device bytes frobenius_norm allocates for its partial sums over `count` matrices of `per`
 *  elements on `device` (stream-ordered, freed after the op): 0 on the CPU. */
int64_t frobenius_norm_scratch_bytes(Device device, int64_t count, int64_t per);

/** Sets out_flag[0] (f32) to 1 if any element of x is NaN or infinite; otherwise leaves it (zero it
 *  first; several tensors can then share one flag). */
void flag_nonfinite(Stream& stream, const Tensor& x, const Tensor& out_flag);

/** x[i] = x[i] / (norms[i] + eps) for each matrix i (the Newton-Schulz normalisation). */
void scale_by_inverse_norm(Stream& stream, const Tensor& x, const Tensor& norms, float eps);

/** out_dst = src converted to out_dst's dtype; same shape, same device. */
void cast(Stream& stream, const Tensor& src, const Tensor& out_dst);

/** out_dst = src; same shape and dtype; any pair of devices (H2D, D2H, D2D). Device-crossing copies
 *  need contiguous tensors; copies within one device may be strided (on CUDA with unit stride in
 *  the last of at least 2 dims). `stream` is the CUDA stream when either side is on a CUDA device. */
void copy(Stream& stream, const Tensor& src, const Tensor& out_dst);

/** out_x = 0. */
void fill_zero(Stream& stream, const Tensor& out_x);

}  // namespace swapopt::ops
