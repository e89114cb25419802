// Per-matrix Frobenius norms and the Newton-Schulz normalisation x /= norm + eps.
//
// The norm runs in two passes, both in a fixed order (the same bits on every run): a 2-D grid of
// partial sums, x = the slice of a matrix (norm_slices(per) of them, a function of the matrix
// size alone), y = the matrix (matrices gridDim.y apart share a block, so any count launches);
// then per matrix one thread adds its slices' partial sums in slice order. One large matrix thus
// spreads over many blocks instead of one, and many small ones over one block each.
#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kSliceElements = int64_t(kThreads) * kVec * 4;  // each thread adds ~4 vectors per slice
constexpr int64_t kMaxSlices = 1024;
constexpr int64_t kSlicesByThread = 16;  // up to this many partials a matrix, one thread adds them

template <int D>
__global__ void norm_partials_kernel(int64_t count, int64_t per, int64_t slice, const void* __restrict__ x, float* __restrict__ partials,
                                     bool vectors) {
  __shared__ float sums[kThreads];
  const int64_t slices = gridDim.x;
  const int64_t begin = blockIdx.x * slice, end = begin + slice < per ? begin + slice : per;
  for (int64_t m = blockIdx.y; m < count; m += gridDim.y) {
    const int64_t first = m * per;
    // Thread t adds the groups of kVec elements t, t + kThreads, ... of the slice, each group in
    // element order: the same order whether it reads them as one vector or one by one (a zero
    // added past the end changes no sum), so alignment does not change the bits.
    float sum = 0.f;
    for (int64_t j = begin + int64_t(threadIdx.x) * kVec; j < end; j += int64_t(kThreads) * kVec) {
      float e[kVec];
      if (vectors) {  // per and slice are multiples of kVec and x is aligned: whole vectors
        load_vec<D>(x, (first + j) / kVec, e);
      } else {
#pragma unroll
        for (int k = 0; k < kVec; ++k) e[k] = j + k < end ? load_f32<D>(x, first + j + k) : 0.f;
      }
#pragma unroll
      for (int k = 0; k < kVec; ++k) sum = __fadd_rn(sum, __fmul_rn(e[k], e[k]));
    }
    sums[threadIdx.x] = sum;
    __syncthreads();
    for (int stride = kThreads / 2; stride > 0; stride >>= 1) {
      if (threadIdx.x < stride) sums[threadIdx.x] = __fadd_rn(sums[threadIdx.x], sums[threadIdx.x + stride]);
      __syncthreads();
    }
    if (threadIdx.x == 0) partials[m * slices + blockIdx.x] = sums[0];
    __syncthreads();  // sums is reused for the next matrix
  }
}

// Few slices: one thread per matrix adds its partials in slice order.
__global__ void norm_finish_by_thread_kernel(int64_t count, int64_t slices, const float* __restrict__ partials,
                                             float* __restrict__ norms) {
  for (int64_t m = first_index(); m < count; m += grid_stride()) {
    float sum = 0.f;
    for (int64_t s = 0; s < slices; ++s) sum = __fadd_rn(sum, partials[m * slices + s]);
    norms[m] = __fsqrt_rn(sum);
  }
}

// Many slices (a large matrix): one block per matrix reads its partials into shared memory
// together, then one thread adds them in the same slice order.
__global__ void norm_finish_by_block_kernel(int64_t count, int64_t slices, const float* __restrict__ partials, float* __restrict__ norms) {
  __shared__ float staged[kMaxSlices];
  for (int64_t m = blockIdx.x; m < count; m += gridDim.x) {
    for (int64_t s = threadIdx.x; s < slices; s += kThreads) staged[s] = partials[m * slices + s];
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.f;
      for (int64_t s = 0; s < slices; ++s) sum = __fadd_rn(sum, staged[s]);
      norms[m] = __fsqrt_rn(sum);
    }
    __syncthreads();  // staged is refilled for the next matrix
  }
}

template <int D>
__global__ void scale_by_inverse_norm_kernel(int64_t total, int64_t per, void* x, const float* norms, float eps,
                                             bool vectors) {
  const int64_t head = vector_part(total, vectors);
  for (int64_t v = first_index(); v < head / kVec; v += grid_stride()) {
    // per is a multiple of kVec when vectors are used: a vector lies in one matrix.
    const float norm = norms[v * kVec / per];
    float e[kVec];
    load_vec<D>(x, v, e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) e[k] = formula::scale_by_inverse_norm(e[k], norm, eps);
    store_vec<D>(x, v, e);
  }
  for (int64_t i = head + first_index(); i < total; i += grid_stride())
    store_f32<D>(x, i, formula::scale_by_inverse_norm(load_f32<D>(x, i), norms[i / per], eps));
}

// Every thread that finds one writes the same value: no ordering needed.
template <int D>
__global__ void flag_nonfinite_kernel(int64_t n, const void* x, float* flag, bool vectors) {
  const int64_t head = vector_part(n, vectors);
  bool found = false;
  for (int64_t v = first_index(); v < head / kVec; v += grid_stride()) {
    float e[kVec];
    load_vec<D>(x, v, e);
#pragma unroll
    for (int k = 0; k < kVec; ++k) found = found || !isfinite(e[k]);
  }
  for (int64_t i = head + first_index(); i < n; i += grid_stride()) found = found || !isfinite(load_f32<D>(x, i));
  if (found) *flag = 1.f;
}

/** Elements of a matrix each block of the partial pass adds: a multiple of kVec. */
int64_t slice_elements(int64_t per) {
  const int64_t slices = (per + kSliceElements - 1) / kSliceElements;
  const int64_t capped = slices < kMaxSlices ? slices : kMaxSlices;
  const int64_t slice = (per + capped - 1) / capped;
  return (slice + kVec - 1) / kVec * kVec;
}

}  // namespace

int64_t norm_slices(int64_t per) {
  if (per <= 0) return 1;
  const int64_t slice = slice_elements(per);
  return (per + slice - 1) / slice;
}

void flag_nonfinite(cudaStream_t stream, int64_t n, const void* x, int xd, float* flag) {
  if (n == 0) return;
  const bool vectors = vector_aligned(x);
  with_dtype(xd, [&](auto X) {
    flag_nonfinite_kernel<decltype(X)::value><<<blocks_for(n, vectors, kThreads), kThreads, 0, stream>>>(n, x, flag, vectors);
  });
}

void frobenius_norm(cudaStream_t stream, int64_t count, int64_t per, const void* x, int xd, float* partials, float* norms) {
  if (count == 0) return;
  const int64_t slices = norm_slices(per), slice = per > 0 ? slice_elements(per) : 0;
  const bool vectors = vector_aligned(x) && per % kVec == 0;
  const dim3 grid(unsigned(slices), unsigned(count < 65535 ? count : 65535));
  with_dtype(xd, [&](auto X) {
    norm_partials_kernel<decltype(X)::value><<<grid, kThreads, 0, stream>>>(count, per, slice, x, partials, vectors);
  });
  if (slices <= kSlicesByThread) {
    norm_finish_by_thread_kernel<<<grid_for(count, kThreads), kThreads, 0, stream>>>(count, slices, partials, norms);
  } else {
    norm_finish_by_block_kernel<<<unsigned(count < 65535 * 16 ? count : 65535 * 16), kThreads, 0, stream>>>(count, slices, partials,
                                                                                                          norms);
  }
}

void scale_by_inverse_norm(cudaStream_t stream, int64_t count, int64_t per, void* x, int xd, const float* norms, float eps) {
  if (count == 0 || per == 0) return;
  const bool vectors = vector_aligned(x) && per % kVec == 0;
  with_dtype(xd, [&](auto X) {
    scale_by_inverse_norm_kernel<decltype(X)::value>
        <<<blocks_for(count * per, vectors, kThreads), kThreads, 0, stream>>>(count * per, per, x, norms, eps, vectors);
  });
}

}  // namespace swapopt::kernels
