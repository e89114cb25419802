#pragma once
// Check macros for CUDA runtime and cuBLAS calls (internal; includes CUDA headers).

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "swapopt/core/error.h"

/** Throws swapopt::Error with the call text, file:line and CUDA's own error string. A failed call
 *  also leaves its error as the thread's last one, which the runtime reports again at the next
 *  cudaGetLastError() (after an unrelated launch, swapopt's or the trainer's): it is taken out here,
 *  once reported. A sticky error (the context is lost) stays whatever is done. */
#define SWAPOPT_CUDA_CHECK(call)                                                               \
  do {                                                                                         \
    const cudaError_t swapopt_cuda_status_ = (call);                                           \
    if (swapopt_cuda_status_ != cudaSuccess) {                                                 \
      (void)cudaGetLastError();                                                                \
      SWAPOPT_FAIL("[cuda] " #call " failed at " << __FILE__ << ":" << __LINE__ << ": "        \
                                                 << cudaGetErrorString(swapopt_cuda_status_)); \
    }                                                                                          \
  } while (0)

/** Throws swapopt::Error with the call text, file:line and cuBLAS's status string. */
#define SWAPOPT_CUBLAS_CHECK(call)                                                                             \
  do {                                                                                                         \
    const cublasStatus_t swapopt_cublas_status_ = (call);                                                      \
    SWAPOPT_CHECK(swapopt_cublas_status_ == CUBLAS_STATUS_SUCCESS,                                             \
                  "[cublas] " #call " failed at " << __FILE__ << ":" << __LINE__ << ": "                       \
                                                  << cublasGetStatusString(swapopt_cublas_status_));           \
  } while (0)

/** For destructors: report and continue, never throw. */
#define SWAPOPT_CUDA_WARN(call)                                                                          \
  do {                                                                                                   \
    const cudaError_t swapopt_cuda_status_ = (call);                                                     \
    if (swapopt_cuda_status_ != cudaSuccess) {                                                           \
      (void)cudaGetLastError(); /* reported here: not again at an unrelated launch */                    \
      std::fprintf(stderr, "swapopt: %s failed: %s\n", #call, cudaGetErrorString(swapopt_cuda_status_)); \
    }                                                                                                    \
  } while (0)
