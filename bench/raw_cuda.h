// The baselines of `swapopt-bench ops` on CUDA: the runtime and cuBLAS called directly, without
// swapopt's layers (checks, device guard, dispatch), on the same stream. Built only with the CUDA
// backend (SWAPOPT_BENCH_RAW_CUDA).
#pragma once

#include <cstddef>

namespace swapopt::bench {

/** cudaMemsetAsync(ptr, 0, bytes, stream): what ops::fill_zero makes of its call. */
void raw_memset(void* stream, void* ptr, size_t bytes);

/** A cuBLAS handle of its own bound to `stream` (a cudaStream_t), as each swapopt stream has. */
class RawCublas {
 public:
  explicit RawCublas(void* stream);
  ~RawCublas();
  RawCublas(const RawCublas&) = delete;
  RawCublas& operator=(const RawCublas&) = delete;

  /** Row-major bf16 c[m, n] = a[m, k] @ b[k, n] with f32 accumulation: the call ops::gemm makes. */
  void gemm_bf16(const void* a, const void* b, void* c, int m, int n, int k);

 private:
  void* handle_ = nullptr;  // cublasHandle_t
};

}  // namespace swapopt::bench
