// Fused optimizer updates: one pass over the elements, the math of swapopt/core/elementwise_formulas.h.
// Dtypes are template parameters; with every buffer 16-byte aligned a thread takes kVec elements
// at a time (each state element is read once and written once), the remainder one at a time.
#include <algorithm>
#include <vector>

#include "dtype_access.cuh"
#include "kernels.h"

namespace swapopt::kernels {

namespace {

constexpr int kThreads = 256;

template <int GD, int BD, int UD>
__global__ void muon_momentum_kernel(int64_t n, const void* grad, void* buf, void* update, float m1, float m2,
                                     bool nesterov, bool vectors) {
  const int64_t head = vector_part(n, vectors);
  for (int64_t v = first_index(); v < head / kVec; v += grid_stride()) {
    float g[kVec], b[kVec], u[kVec];
    load_vec<GD>(grad, v, g);
    load_vec<BD>(buf, v, b);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const formula::MomentumOut out = formula::muon_momentum(g[k], b[k], m1, m2, nesterov);
      b[k] = out.buf;
      u[k] = out.update;
    }
    store_vec<BD>(buf, v, b);
    store_vec<UD>(update, v, u);
  }
  for (int64_t i = head + first_index(); i < n; i += grid_stride()) {
    const formula::MomentumOut out = formula::muon_momentum(load_f32<GD>(grad, i), load_f32<BD>(buf, i), m1, m2, nesterov);
    store_f32<BD>(buf, i, out.buf);
    store_f32<UD>(update, i, out.update);
  }
}

// exp_avg, exp_avg_sq and max_exp_avg_sq are f32 (the state dtype); AMSGrad is a template
// parameter so that the plain update carries no null checks.

/** AdamW on elements [w * kVec, w * kVec + kVec) of 16-byte aligned buffers. */
template <int PD, int GD, bool kAmsgrad>
__device__ __forceinline__ void adamw_vector(void* param, const void* grad, float* m, float* v, float* vmax, int64_t w,
                                             const formula::AdamWScalars& k) {
  float p[kVec], g[kVec], mm[kVec], vv[kVec], vm[kVec];
  load_vec<PD>(param, w, p);
  load_vec<GD>(grad, w, g);
  load_vec<kF32>(m, w, mm);
  load_vec<kF32>(v, w, vv);
  if constexpr (kAmsgrad) load_vec<kF32>(vmax, w, vm);
#pragma unroll
  for (int e = 0; e < kVec; ++e) p[e] = formula::adamw(p[e], g[e], mm[e], vv[e], kAmsgrad ? &vm[e] : nullptr, k);
  store_vec<PD>(param, w, p);
  store_vec<kF32>(m, w, mm);
  store_vec<kF32>(v, w, vv);
  if constexpr (kAmsgrad) store_vec<kF32>(vmax, w, vm);
}

/** AdamW on element i. */
template <int PD, int GD, bool kAmsgrad>
__device__ __forceinline__ void adamw_element(void* param, const void* grad, float* m, float* v, float* vmax, int64_t i,
                                              const formula::AdamWScalars& k) {
  store_f32<PD>(param, i, formula::adamw(load_f32<PD>(param, i), load_f32<GD>(grad, i), m[i], v[i], kAmsgrad ? vmax + i : nullptr, k));
}

template <int PD, int GD, bool kAmsgrad>
__global__ void adamw_kernel(int64_t n, void* param, const void* grad, float* m, float* v, float* vmax,
                             formula::AdamWScalars k, bool vectors) {
  const int64_t head = vector_part(n, vectors);
  for (int64_t w = first_index(); w < head / kVec; w += grid_stride()) adamw_vector<PD, GD, kAmsgrad>(param, grad, m, v, vmax, w, k);
  for (int64_t i = head + first_index(); i < n; i += grid_stride()) adamw_element<PD, GD, kAmsgrad>(param, grad, m, v, vmax, i, k);
}

// The list kernel: block b updates chunk b of the launch, which belongs to the last tensor whose
// first chunk is <= b. Every block of a launch is busy (a grid of all the list's chunks), so one
// launch fills the device however the elements are spread over its tensors. The list is a kernel
// argument (copied at launch, so the host may reuse it at once), kept under the 4096 bytes every
// CUDA version accepts.
constexpr int kListTensors = 24;
constexpr int64_t kChunk = 8192;               // a multiple of kVec: vectors within a chunk stay aligned
constexpr int64_t kLaunchChunks = int64_t(1) << 20;  // grid x is limited to 2^31 - 1 blocks

struct AdamWList {
  int tensors = 0;
  void* param[kListTensors];
  const void* grad[kListTensors];
  float* m[kListTensors];
  float* v[kListTensors];
  float* vmax[kListTensors];
  int64_t n[kListTensors];
  int64_t first_element[kListTensors];    // where this launch starts in the tensor (a multiple of kChunk)
  int64_t first_chunk[kListTensors + 1];  // the launch's chunk index of the entry's first chunk; [tensors]: the total
  formula::AdamWScalars k[kListTensors];
  bool vectors[kListTensors];
};
static_assert(sizeof(AdamWList) <= 4096, "kernel arguments are limited to 4096 bytes before CUDA 12.1");
static_assert(kChunk % kVec == 0);

template <int PD, int GD, bool kAmsgrad>
__global__ void adamw_list_kernel(const AdamWList list) {
  const int64_t c = blockIdx.x;
  int t = 0;  // the same in the whole block: at most kListTensors uniform steps
  while (t + 1 < list.tensors && list.first_chunk[t + 1] <= c) ++t;
  const int64_t begin = list.first_element[t] + (c - list.first_chunk[t]) * kChunk;
  const int64_t end = begin + kChunk < list.n[t] ? begin + kChunk : list.n[t];
  void* param = list.param[t];
  const void* grad = list.grad[t];
  float *m = list.m[t], *v = list.v[t], *vmax = list.vmax[t];
  const formula::AdamWScalars k = list.k[t];
  const int64_t head = list.vectors[t] ? begin + (end - begin) / kVec * kVec : begin;
  for (int64_t w = begin / kVec + threadIdx.x; w < head / kVec; w += blockDim.x) adamw_vector<PD, GD, kAmsgrad>(param, grad, m, v, vmax, w, k);
  for (int64_t i = head + threadIdx.x; i < end; i += blockDim.x) adamw_element<PD, GD, kAmsgrad>(param, grad, m, v, vmax, i, k);
}

/** Launches the list kernel over `group` (tensors of one kind): one launch per kListTensors
 *  tensors, a tensor split over two launches only past kLaunchChunks chunks. */
template <int PD, int GD, bool kAmsgrad>
void launch_adamw_lists(cudaStream_t stream, const std::vector<const AdamWTensor*>& group) {
  AdamWList list{};
  int64_t chunks = 0;
  const auto flush = [&] {
    list.first_chunk[list.tensors] = chunks;
    if (chunks > 0) adamw_list_kernel<PD, GD, kAmsgrad><<<unsigned(chunks), kThreads, 0, stream>>>(list);
    list.tensors = 0;
    chunks = 0;
  };
  for (const AdamWTensor* a : group) {
    const bool vectors = vector_aligned(a->param) && vector_aligned(a->grad) && vector_aligned(a->exp_avg) &&
                         vector_aligned(a->exp_avg_sq) && (!kAmsgrad || vector_aligned(a->max_exp_avg_sq));
    for (int64_t done = 0, count = (a->n + kChunk - 1) / kChunk; done < count;) {
      if (list.tensors == kListTensors || chunks == kLaunchChunks) flush();
      const int t = list.tensors++;
      const int64_t take = std::min(count - done, kLaunchChunks - chunks);
      list.param[t] = a->param;
      list.grad[t] = a->grad;
      list.m[t] = a->exp_avg;
      list.v[t] = a->exp_avg_sq;
      list.vmax[t] = a->max_exp_avg_sq;
      list.n[t] = a->n;
      list.first_element[t] = done * kChunk;
      list.first_chunk[t] = chunks;
      list.k[t] = a->args;
      list.vectors[t] = vectors;
      chunks += take;
      done += take;
    }
  }
  flush();
}

}  // namespace

void muon_momentum(cudaStream_t stream, int64_t n, const void* grad, int gd, void* buf, int bd, void* update, int ud, float m1,
                   float m2, bool nesterov) {
  if (n == 0) return;
  const bool vectors = vector_aligned(grad) && vector_aligned(buf) && vector_aligned(update);
  with_dtype(gd, [&](auto G) {
    with_dtype(bd, [&](auto B) {
      with_dtype(ud, [&](auto U) {
        muon_momentum_kernel<decltype(G)::value, decltype(B)::value, decltype(U)::value>
            <<<blocks_for(n, vectors, kThreads), kThreads, 0, stream>>>(n, grad, buf, update, m1, m2, nesterov, vectors);
      });
    });
  });
}

void adamw_update(cudaStream_t stream, int64_t n, void* param, int pd, const void* grad, int gd, float* exp_avg,
                  float* exp_avg_sq, float* max_exp_avg_sq, formula::AdamWScalars args) {
  if (n == 0) return;
  const bool vectors = vector_aligned(param) && vector_aligned(grad) && vector_aligned(exp_avg) && vector_aligned(exp_avg_sq) &&
                       (max_exp_avg_sq == nullptr || vector_aligned(max_exp_avg_sq));
  const unsigned blocks = blocks_for(n, vectors, kThreads);
  with_dtype(pd, [&](auto P) {
    with_dtype(gd, [&](auto G) {
      constexpr int kP = decltype(P)::value, kG = decltype(G)::value;
      if (max_exp_avg_sq != nullptr) {
        adamw_kernel<kP, kG, true><<<blocks, kThreads, 0, stream>>>(n, param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, args, vectors);
      } else {
        adamw_kernel<kP, kG, false><<<blocks, kThreads, 0, stream>>>(n, param, grad, exp_avg, exp_avg_sq, nullptr, args, vectors);
      }
    });
  });
}

void adamw_update_many(cudaStream_t stream, const AdamWTensor* tensors, size_t count) {
  // One group per (param dtype, grad dtype, amsgrad): the kernel's template parameters.
  std::vector<const AdamWTensor*> groups[3][3][2];
  for (size_t i = 0; i < count; ++i)
    if (tensors[i].n > 0) groups[tensors[i].param_dtype][tensors[i].grad_dtype][tensors[i].max_exp_avg_sq != nullptr].push_back(&tensors[i]);
  for (int pd = 0; pd < 3; ++pd)
    for (int gd = 0; gd < 3; ++gd)
      with_dtype(pd, [&](auto P) {
        with_dtype(gd, [&](auto G) {
          constexpr int kP = decltype(P)::value, kG = decltype(G)::value;
          launch_adamw_lists<kP, kG, false>(stream, groups[pd][gd][0]);
          launch_adamw_lists<kP, kG, true>(stream, groups[pd][gd][1]);
        });
      });
}

}  // namespace swapopt::kernels
