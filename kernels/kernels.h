#pragma once
// Launchers of swapopt's CUDA kernels (host-callable; defined in kernels/*.cu). Pointers are device
// pointers; dtype codes are swapopt::DType values; every launch is asynchronous on `stream`.

#include <cstdint>
#include <cuda_runtime.h>

#include "swapopt/core/elementwise_formulas.h"

namespace swapopt::kernels {

/** y = alpha * x + beta * y (y not read when beta == 0), elementwise over n values. */
void axpby(cudaStream_t stream, int64_t n, float alpha, const void* x, int x_dtype, float beta, void* y, int y_dtype);
/** a = lerp(a, b, weight) with torch's formula. */
void lerp(cudaStream_t stream, int64_t n, void* a, int a_dtype, const void* b, int b_dtype, float weight);
/** dst = src converted. */
void cast(cudaStream_t stream, int64_t n, const void* src, int src_dtype, void* dst, int dst_dtype);
/** Partial sums the norm of one matrix of `per` elements takes: frobenius_norm's `partials` holds
 *  count * norm_slices(per) floats. */
int64_t norm_slices(int64_t per);
/** norms[m] = sqrt(sum of squares of x[m*per .. (m+1)*per)) for m < count, in a fixed order (the
 *  same bits on every run); `partials` is device scratch of count * norm_slices(per) floats. */
void frobenius_norm(cudaStream_t stream, int64_t count, int64_t per, const void* x, int x_dtype, float* partials, float* norms);
/** x[m*per + i] /= norms[m] + eps. */
void scale_by_inverse_norm(cudaStream_t stream, int64_t count, int64_t per, void* x, int x_dtype, const float* norms,
                           float eps);
/** *flag = 1 if any of the n values of x is NaN or infinite (else *flag is not written). */
void flag_nonfinite(cudaStream_t stream, int64_t n, const void* x, int x_dtype, float* flag);
/** Copies the lower triangle of each n x n matrix (batch of `count`, rows `ld` elements apart)
 *  onto its upper triangle. */
void mirror_lower(cudaStream_t stream, int64_t count, int64_t n, int64_t ld, int64_t batch_stride, void* c, int c_dtype);

}  // namespace swapopt::kernels

namespace swapopt::kernels {

/** Muon momentum (see swapopt/optim/optim_ops.h). */
void muon_momentum(cudaStream_t stream, int64_t n, const void* grad, int grad_dtype, void* buf, int buf_dtype, void* update,
                   int update_dtype, float m1, float m2, bool nesterov);

/** AdamW step (see swapopt/optim/optim_ops.h); max_exp_avg_sq may be null. */
void adamw_update(cudaStream_t stream, int64_t n, void* param, int param_dtype, const void* grad, int grad_dtype,
                  float* exp_avg, float* exp_avg_sq, float* max_exp_avg_sq, formula::AdamWScalars args);

/** One tensor's adamw_update arguments. */
struct AdamWTensor {
  int64_t n;
  void* param;
  int param_dtype;
  const void* grad;
  int grad_dtype;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // null without amsgrad
  formula::AdamWScalars args;
};

/** adamw_update on each of `count` tensors, with the same bits, in a few launches: the tensors of
 *  one (param dtype, grad dtype, amsgrad) kind go together, their lists passed by value as kernel
 *  arguments (no copy to the device) of up to 24 tensors, one block per 8192-element chunk. */
void adamw_update_many(cudaStream_t stream, const AdamWTensor* tensors, size_t count);

}  // namespace swapopt::kernels
