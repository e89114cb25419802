// Stand-in for the CUDA backend in builds without CUDA: queries answer "none", everything else
// throws a named error.
#include "cuda_backend.h"

#include "swapopt/core/error.h"

namespace swapopt::cuda {

namespace {
[[noreturn]] void not_built(const char* what) {
  SWAPOPT_FAIL("[cuda] " << what << ": swapopt was built without CUDA (reconfigure with -Dcuda=enabled)");
}
}  // namespace

bool built() { return false; }
int device_count() { return 0; }
Allocator& device_allocator(int) { not_built("device_allocator"); }
Allocator& pinned_allocator() { not_built("pinned_allocator"); }
void set_process_device(int) { not_built("use_device"); }
std::shared_ptr<StreamImpl> make_stream(int) { not_built("Stream"); }
std::shared_ptr<StreamImpl> borrow_stream(void*, int) { not_built("Stream::borrow"); }
std::shared_ptr<EventImpl> make_event(int, bool) { not_built("Event"); }
void memset_sync(void*, size_t, int) { not_built("memset"); }
void gemm(Stream&, const Tensor&, bool, const Tensor&, bool, const Tensor&, float, float) { not_built("gemm"); }
void syrk(Stream&, const Tensor&, bool, const Tensor&, float, float) { not_built("syrk"); }
void axpby(Stream&, float, const Tensor&, float, const Tensor&) { not_built("axpby"); }
void lerp(Stream&, const Tensor&, const Tensor&, float) { not_built("lerp"); }
void frobenius_norm(Stream&, const Tensor&, const Tensor&) { not_built("frobenius_norm"); }
int64_t frobenius_norm_scratch_bytes(int64_t, int64_t) { return 0; }  // no CUDA device can exist
void scale_by_inverse_norm(Stream&, const Tensor&, const Tensor&, float) { not_built("scale_by_inverse_norm"); }
void flag_nonfinite(Stream&, const Tensor&, const Tensor&) { not_built("flag_nonfinite"); }
void cast(Stream&, const Tensor&, const Tensor&) { not_built("cast"); }
void copy(Stream&, const Tensor&, const Tensor&) { not_built("copy"); }
void fill_zero(Stream&, const Tensor&) { not_built("fill_zero"); }
void muon_momentum(Stream&, const Tensor&, const Tensor&, const Tensor&, float, float, bool) { not_built("muon_momentum"); }
void adamw_update(Stream&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const ops::AdamWScalars&) {
  not_built("adamw_update");
}
void adamw_update_many(Stream&, std::span<const ops::AdamWUpdate>) { not_built("adamw_update_many"); }
}  // namespace swapopt::cuda
