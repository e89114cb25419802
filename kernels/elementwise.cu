// Elementwise kernels: grid-stride loops (64-bit indices, 1-D grids sized to the device), the math
// of swapopt/core/elementwise_formulas.h in f32. Each dtype is a template parameter; when every
// buffer is 16-byte aligned the loop takes kVec elements at a time, and the remainder (or a
// misaligned launch) one at a time: the same formula per element either way, so the same bits.
#include <array>
#include <atomic>

#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 256;

template <int XD, int YD>
// No __restrict__ on an op's inputs and outputs, here and in the other kernels: an output may be
// the very view of an input (ops::scale passes x == y; check_operands_apart lets any op run in
// place). Each element is read by the thread that writes it, before it writes it, so the exact
// overlap is safe; a restrict promise would not be.
__global__ void axpby_kernel(int64_t n, float alpha, const void* x, float beta, void* y, bool vectors) {
  const int64_t head = vector_part(n, vectors);
  for (int64_t v = first_index(); v < head / kVec; v += grid_stride()) {
    float a[kVec], b[kVec] = {};
    load_vec<XD>(x, v, a);
    if (beta != 0.f) load_vec<YD>(y, v, b);  // y is not read when beta == 0 (a NaN there must not propagate)
#pragma unroll
    for (int k = 0; k < kVec; ++k) b[k] = formula::axpby(alpha, a[k], beta, b[k]);
    store_vec<YD>(y, v, b);
  }
  for (int64_t i = head + first_index(); i < n; i += grid_stride())
    store_f32<YD>(y, i, formula::axpby(alpha, load_f32<XD>(x, i), beta, beta == 0.f ? 0.f : load_f32<YD>(y, i)));
}

template <int AD, int BD>
__global__ void lerp_kernel(int64_t n, void* a, const void* b, float w, bool vectors) {
  const int64_t head = vector_part(n, vectors);
  for (int64_t v = first_index(); v < head / kVec; v += grid_stride()) {
    float x[kVec], y[kVec];
    load_vec<AD>(a, v, x);
    load_vec<BD>(b, v, y);
#pragma unroll
    for (int k = 0; k < kVec; ++k) x[k] = formula::lerp(x[k], y[k], w);
    store_vec<AD>(a, v, x);
  }
  for (int64_t i = head + first_index(); i < n; i += grid_stride())
    store_f32<AD>(a, i, formula::lerp(load_f32<AD>(a, i), load_f32<BD>(b, i), w));
}

template <int SD, int DD>
__global__ void cast_kernel(int64_t n, const void* src, void* dst, bool vectors) {
  const int64_t head = vector_part(n, vectors);
  for (int64_t v = first_index(); v < head / kVec; v += grid_stride()) {
    float x[kVec];
    load_vec<SD>(src, v, x);
    store_vec<DD>(dst, v, x);
  }
  for (int64_t i = head + first_index(); i < n; i += grid_stride()) store_f32<DD>(dst, i, load_f32<SD>(src, i));
}

// The lower triangle of each n x n matrix copied onto its upper triangle, bits as they are (a copy
// needs no conversion), through a shared tile so that both the reads and the writes of a warp are
// along rows. Block (t, m): tile t of the lower triangle of tiles (ti >= tj) of matrices m,
// m + gridDim.y, ...: it reads tile (ti, tj) and writes its transpose into tile (tj, ti). Only
// elements strictly above the diagonal are written and no block reads those, so blocks never race.
constexpr int kTile = 32;
constexpr int kTileRows = 8;  // threads per block: kTile x kTileRows, each thread kTile / kTileRows rows

template <typename T>
__global__ void mirror_lower_kernel(int64_t count, int64_t n, int64_t ld, int64_t batch_stride, T* __restrict__ c) {
  __shared__ T tile[kTile][kTile + 1];  // +1: the transposed read does not hit one bank 32 times
  // Tile t -> (ti, tj) with tj <= ti, row by row: t = ti * (ti + 1) / 2 + tj.
  const int64_t t = blockIdx.x;
  int64_t ti = int64_t((sqrt(8.0 * double(t) + 1.0) - 1.0) / 2.0);
  while (ti * (ti + 1) / 2 > t) --ti;
  while ((ti + 1) * (ti + 2) / 2 <= t) ++ti;
  const int64_t tj = t - ti * (ti + 1) / 2;
  const int64_t row0 = ti * kTile, col0 = tj * kTile;
  for (int64_t m = blockIdx.y; m < count; m += gridDim.y) {
    T* base = c + m * batch_stride;
    for (int r = threadIdx.y; r < kTile; r += kTileRows) {
      const int64_t i = row0 + r, j = col0 + threadIdx.x;
      if (i < n && j < n) tile[r][threadIdx.x] = base[i * ld + j];
    }
    __syncthreads();
    for (int r = threadIdx.y; r < kTile; r += kTileRows) {
      // Destination (col0 + r, row0 + x) takes source (row0 + x, col0 + r): strictly lower only.
      const int64_t i = row0 + threadIdx.x, j = col0 + r;
      if (i < n && j < n && i > j) base[j * ld + i] = tile[threadIdx.x][r];
    }
    __syncthreads();  // the tile is refilled for the next matrix
  }
}

}  // namespace

unsigned grid_for(int64_t n, int threads) {
  // Multiprocessors x threads each holds, per device, read once (0: not read yet). Registers may
  // let fewer blocks be resident than the thread count allows, so the grid is four such waves: a
  // partly filled last wave then costs little.
  static std::array<std::atomic<int>, 64> sm_threads{};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) device = 0;
  int capacity_threads = device >= 0 && device < 64 ? sm_threads[size_t(device)].load(std::memory_order_relaxed) : 0;
  if (capacity_threads == 0) {
    int sms = 0, per_sm = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) == cudaSuccess &&
        cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxThreadsPerMultiProcessor, device) == cudaSuccess) {
      capacity_threads = sms * per_sm;
      if (device >= 0 && device < 64) sm_threads[size_t(device)].store(capacity_threads, std::memory_order_relaxed);
    } else {
      capacity_threads = 132 * 2048;  // not cached: the op's launch check reports the error, if any
    }
  }
  const int64_t capacity = 4 * (capacity_threads / threads > 0 ? capacity_threads / threads : 1);
  const int64_t blocks = (n + threads - 1) / threads;
  return unsigned(blocks < 1 ? 1 : blocks < capacity ? blocks : capacity);
}

void axpby(cudaStream_t stream, int64_t n, float alpha, const void* x, int xd, float beta, void* y, int yd) {
  if (n == 0) return;
  const bool vectors = vector_aligned(x) && vector_aligned(y);
  with_dtype(xd, [&](auto X) {
    with_dtype(yd, [&](auto Y) {
      axpby_kernel<decltype(X)::value, decltype(Y)::value><<<blocks_for(n, vectors, kThreads), kThreads, 0, stream>>>(n, alpha, x, beta, y, vectors);
    });
  });
}

void lerp(cudaStream_t stream, int64_t n, void* a, int ad, const void* b, int bd, float w) {
  if (n == 0) return;
  const bool vectors = vector_aligned(a) && vector_aligned(b);
  with_dtype(ad, [&](auto A) {
    with_dtype(bd, [&](auto B) {
      lerp_kernel<decltype(A)::value, decltype(B)::value><<<blocks_for(n, vectors, kThreads), kThreads, 0, stream>>>(n, a, b, w, vectors);
    });
  });
}

void cast(cudaStream_t stream, int64_t n, const void* src, int sd, void* dst, int dd) {
  if (n == 0) return;
  const bool vectors = vector_aligned(src) && vector_aligned(dst);
  with_dtype(sd, [&](auto S) {
    with_dtype(dd, [&](auto D) {
      cast_kernel<decltype(S)::value, decltype(D)::value><<<blocks_for(n, vectors, kThreads), kThreads, 0, stream>>>(n, src, dst, vectors);
    });
  });
}

void mirror_lower(cudaStream_t stream, int64_t count, int64_t n, int64_t ld, int64_t batch_stride, void* c, int cd) {
  if (count == 0 || n < 2) return;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const int64_t pairs = tiles * (tiles + 1) / 2;  // tiles on and below the diagonal
  // n is a matrix side that cuBLAS took, so the tile count fits the x-limit of 2^31 - 1 by far.
  const dim3 grid(unsigned(pairs), unsigned(count < 65535 ? count : 65535));
  const dim3 block(kTile, kTileRows);
  if (cd == kF32) {
    mirror_lower_kernel<float><<<grid, block, 0, stream>>>(count, n, ld, batch_stride, static_cast<float*>(c));
  } else {
    mirror_lower_kernel<uint16_t><<<grid, block, 0, stream>>>(count, n, ld, batch_stride, static_cast<uint16_t*>(c));
  }
}

}  // namespace swapopt::kernels
