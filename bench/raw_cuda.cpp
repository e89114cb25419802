#include "raw_cuda.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace swapopt::bench {

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + ": cuBLAS status " + std::to_string(int(s)));
}

}  // namespace

void raw_memset(void* stream, void* ptr, size_t bytes) {
  check(cudaMemsetAsync(ptr, 0, bytes, static_cast<cudaStream_t>(stream)), "cudaMemsetAsync");
}

RawCublas::RawCublas(void* stream) {
  cublasHandle_t h = nullptr;
  check(cublasCreate(&h), "cublasCreate");
  handle_ = h;
  check(cublasSetStream(h, static_cast<cudaStream_t>(stream)), "cublasSetStream");
}

RawCublas::~RawCublas() { cublasDestroy(static_cast<cublasHandle_t>(handle_)); }

void RawCublas::gemm_bf16(const void* a, const void* b, void* c, int m, int n, int k) {
  // Row-major c = a b is column-major c^T = b^T a^T: b goes first (as in lib/cuda/cuda_ops.cpp).
  const float alpha = 1.f, beta = 0.f;
  check(cublasGemmStridedBatchedEx(static_cast<cublasHandle_t>(handle_), CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &alpha, b,
                                   CUDA_R_16BF, n, int64_t(k) * n, a, CUDA_R_16BF, k, int64_t(m) * k, &beta, c,
                                   CUDA_R_16BF, n, int64_t(m) * n, 1, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx");
}

}  // namespace swapopt::bench
