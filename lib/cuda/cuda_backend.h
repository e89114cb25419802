#pragma once
// The CUDA backend as seen by the backend-neutral core (internal). No CUDA header here: built with
// -Dcuda=enabled these are implemented in lib/cuda/*.cpp, otherwise by cuda_stub.cpp, which throws
// "swapopt was built without CUDA".

#include <cstddef>
#include <memory>

#include "swapopt/core/allocator.h"
#include "swapopt/core/stream.h"
#include "swapopt/core/tensor.h"

namespace swapopt {
class StreamImpl;
class EventImpl;
class Stream;
}  // namespace swapopt

namespace swapopt::cuda {

bool built();
int device_count();

Allocator& device_allocator(int index);
/** cudaHostAlloc-backed allocator; valid only when device_count() > 0. */
Allocator& pinned_allocator();

/** See swapopt::use_device. */
void set_process_device(int index);

std::shared_ptr<StreamImpl> make_stream(int index);
/** A StreamImpl on `native` (a cudaStream_t of device `index` the caller owns and keeps alive). */
std::shared_ptr<StreamImpl> borrow_stream(void* native, int index);
std::shared_ptr<EventImpl> make_event(int index, bool enable_timing);

/** Synchronous memset of device memory. */
void memset_sync(void* ptr, size_t nbytes, int index);

void gemm(Stream& stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha,
          float beta);
void syrk(Stream& stream, const Tensor& a, bool trans_a, const Tensor& c, float alpha, float beta);
void axpby(Stream& stream, float alpha, const Tensor& x, float beta, const Tensor& y);
void lerp(Stream& stream, const Tensor& a, const Tensor& b, float weight);
void frobenius_norm(Stream& stream, const Tensor& x, const Tensor& norms);
/** Bytes of the partial sums frobenius_norm allocates (see ops::frobenius_norm_scratch_bytes). */
int64_t frobenius_norm_scratch_bytes(int64_t count, int64_t per);
void scale_by_inverse_norm(Stream& stream, const Tensor& x, const Tensor& norms, float eps);
void flag_nonfinite(Stream& stream, const Tensor& x, const Tensor& flag);
void cast(Stream& stream, const Tensor& src, const Tensor& dst);
/** Copy where at least one side is on a CUDA device: contiguous, or on one device with unit stride
 *  in the last dim (one 2-D copy per matrix). */
void copy(Stream& stream, const Tensor& src, const Tensor& dst);
void fill_zero(Stream& stream, const Tensor& x);

}  // namespace swapopt::cuda

#include "swapopt/optim/optim_ops.h"

namespace swapopt::cuda {

void muon_momentum(Stream& stream, const Tensor& grad, const Tensor& buf, const Tensor& update, float m1, float m2,
                   bool nesterov);
void adamw_update(Stream& stream, const Tensor& param, const Tensor& grad, const Tensor& exp_avg, const Tensor& exp_avg_sq,
                  const Tensor& max_exp_avg_sq, const ops::AdamWScalars& scalars);
void adamw_update_many(Stream& stream, std::span<const ops::AdamWUpdate> updates);

}  // namespace swapopt::cuda
