// CPU ops on Eigen. GEMMs run in f32 (bf16 inputs are widened first, outputs rounded on store), one
// matrix at a time with Eigen's own threads, so a batched call and a loop of single calls give the
// same bits.
#include "cpu_ops.h"

#include <Eigen/Core>
#include <array>
#include <memory>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <vector>

#include "../core/matrix_layout.h"

namespace swapopt::cpu {

namespace {

using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstMatrixMap = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
using MatrixMap = Eigen::Map<RowMatrix, 0, Eigen::OuterStride<>>;

/** One matrix of a batch as f32: a direct pointer for f32 storage, else widened into `scratch`. */
struct F32Matrix {
  const float* data;
  int64_t ld;
};

/** A tensor's address and layout, taken when the op is enqueued (as a CUDA launch takes its
 *  arguments): later host-side changes to the storage (release, bind) cannot affect queued work. */
struct MatrixArg {
  void* data;
  DType dtype;
  MatrixLayout layout;
};

MatrixArg matrix_arg(const Tensor& t, const char* op) { return {t.data_ptr(), t.dtype(), matrix_layout(t, op)}; }

F32Matrix widen(const MatrixArg& t, int64_t b, std::vector<float>& scratch) {
  const MatrixLayout& l = t.layout;
  const int64_t first = b * l.batch_stride;
  if (t.dtype == DType::f32) return {static_cast<const float*>(t.data) + first, l.ld};
  scratch.resize(size_t(l.rows * l.cols));
  for (int64_t i = 0; i < l.rows; ++i)
    for (int64_t j = 0; j < l.cols; ++j)
      scratch[size_t(i * l.cols + j)] = load_as_float(t.data, size_t(first + i * l.ld + j), t.dtype);
  return {scratch.data(), l.cols};
}

/** Output matrix b as f32: in place for f32 storage, else through `scratch` (loaded when beta != 0). */
float* output_f32(const MatrixArg& c, int64_t b, float beta, std::vector<float>& scratch) {
  const MatrixLayout& l = c.layout;
  if (c.dtype == DType::f32) return static_cast<float*>(c.data) + b * l.batch_stride;
  scratch.resize(size_t(l.rows * l.cols));
  if (beta != 0.f) {
    for (int64_t i = 0; i < l.rows * l.cols; ++i) scratch[size_t(i)] = load_as_float(c.data, size_t(b * l.batch_stride + i), c.dtype);
  }
  return scratch.data();
}

void store_output(const MatrixArg& c, int64_t b, const float* values) {
  if (c.dtype == DType::f32) return;
  const MatrixLayout& l = c.layout;
  for (int64_t i = 0; i < l.rows * l.cols; ++i) store_from_float(c.data, size_t(b * l.batch_stride + i), c.dtype, values[size_t(i)]);
}

/** c = alpha * lhs * rhs when beta == 0, else c += alpha * lhs * rhs (c already scaled by beta). */
template <typename Out, typename LhsExpr, typename RhsExpr>
void multiply_into(Out&& c, const LhsExpr& lhs, const RhsExpr& rhs, float alpha, float beta) {
  if (beta == 0.f) {
    c.noalias() = alpha * lhs * rhs;
  } else {
    c.noalias() += alpha * lhs * rhs;
  }
}

void gemm_now(const MatrixArg& a, bool trans_a, const MatrixArg& b, bool trans_b, const MatrixArg& c, float alpha, float beta) {
  const MatrixLayout &la = a.layout, &lb = b.layout, &lc = c.layout;
  std::vector<float> a_scratch, b_scratch, c_scratch;
  for (int64_t batch = 0; batch < lc.batch; ++batch) {
    const F32Matrix fa = widen(a, batch, a_scratch);
    const F32Matrix fb = widen(b, batch, b_scratch);
    ConstMatrixMap ma(fa.data, la.rows, la.cols, Eigen::OuterStride<>(fa.ld));
    ConstMatrixMap mb(fb.data, lb.rows, lb.cols, Eigen::OuterStride<>(fb.ld));
    float* out = output_f32(c, batch, beta, c_scratch);
    MatrixMap mc(out, lc.rows, lc.cols, Eigen::OuterStride<>(c.dtype == DType::f32 ? lc.ld : lc.cols));
    if (beta != 0.f && beta != 1.f) mc *= beta;
    if (!trans_a && !trans_b) multiply_into(mc, ma, mb, alpha, beta);
    if (!trans_a && trans_b) multiply_into(mc, ma, mb.transpose(), alpha, beta);
    if (trans_a && !trans_b) multiply_into(mc, ma.transpose(), mb, alpha, beta);
    if (trans_a && trans_b) multiply_into(mc, ma.transpose(), mb.transpose(), alpha, beta);
    store_output(c, batch, out);
  }
}

/** Elementwise f32 loops at least this long are split over the OpenMP threads (each element is
 *  independent, so the split never changes the bits). */
[[maybe_unused]] constexpr size_t kParallelElements = size_t(1) << 16;  // unread without OpenMP

/** Calls f with `dtype` as a compile-time constant (std::integral_constant<DType, ...>), so that
 *  the loop inside loads and stores without a per-element switch and vectorises. */
template <typename F>
void with_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32: return f(std::integral_constant<DType, DType::f32>{});
    case DType::bf16: return f(std::integral_constant<DType, DType::bf16>{});
    case DType::f16: return f(std::integral_constant<DType, DType::f16>{});
  }
}

// The elementwise loops, one instantiation per dtype: their arguments are the function's own (a
// lambda's captures are read through its closure, and GCC then does not vectorise the loop).

template <DType A, DType B>
void lerp_loop(void* a, const void* b, size_t n, float weight) {
#pragma omp parallel for simd if (n >= kParallelElements)
  for (size_t i = 0; i < n; ++i) store_from_float(a, i, A, formula::lerp(load_as_float(a, i, A), load_as_float(b, i, B), weight));
}

template <DType X>
void scale_loop(void* x, size_t first, size_t n, float norm, float eps) {
#pragma omp parallel for simd if (n >= kParallelElements)
  for (size_t i = first; i < first + n; ++i)
    store_from_float(x, i, X, formula::scale_by_inverse_norm(load_as_float(x, i, X), norm, eps));
}

template <DType S, DType D>
void cast_loop(const void* src, void* dst, size_t n) {
#pragma omp parallel for simd if (n >= kParallelElements)
  for (size_t i = 0; i < n; ++i) store_from_float(dst, i, D, load_as_float(src, i, S));
}

/** Tiles per side of the symmetric product's lower triangle: a function of the side m only, never
 *  of the thread count, so every element is computed by the same kernel on every machine. Tiles
 *  of about 256 (at least 4 per side from 128, to spread the work over the threads); 2 per side
 *  from 64, one below. */
int64_t syrk_tiles(int64_t m) {
  if (m < 64) return 1;
  return m < 128 ? 2 : std::max<int64_t>(4, (m + 255) / 256);
}

/** Copies the rows x cols block of `c` at (r0, c0), below the diagonal, to its mirror at (c0, r0);
 *  for a diagonal tile (r0 == c0) its strictly lower triangle to its upper one. In 8 x 8 blocks,
 *  which Eigen transposes in registers: element by element, each write reads a column, 6x slower
 *  for a 256 x 256 tile (/tmp harness). */
constexpr int64_t kMirrorBlock = 8;

void mirror_block(MatrixMap& c, int64_t r0, int64_t c0, int64_t rows, int64_t cols) {
  constexpr int64_t B = kMirrorBlock;
  const bool diagonal = r0 == c0;
  for (int64_t i = 0; i < rows; i += B)
    for (int64_t j = 0; j < (diagonal ? i + 1 : cols); j += B) {
      const int64_t h = std::min(B, rows - i), w = std::min(B, cols - j);
      if (h == B && w == B && !(diagonal && i == j)) {
        c.block<B, B>(c0 + j, r0 + i) = c.block<B, B>(r0 + i, c0 + j).transpose();
        continue;
      }
      for (int64_t ii = 0; ii < h; ++ii)
        for (int64_t jj = 0; jj < w; ++jj)
          if (!diagonal || i + ii > j + jj) c(c0 + j + jj, r0 + i + ii) = c(r0 + i + ii, c0 + j + jj);
    }
}

/** Tile (i, j), j <= i, of c = beta c + alpha a a^T and its mirror (j, i), where `rows_of(r0,
 *  count)` gives rows [r0, r0 + count) of a. A diagonal tile is a SYRK (Eigen's rankUpdate, half
 *  the flops of its GEMM), the others GEMMs: every tile, mirror included, belongs to one task. */
template <typename RowsOf>
void syrk_tile(MatrixMap& c, const RowsOf& rows_of, int64_t m, int64_t tiles, int64_t i, int64_t j, float alpha,
               float beta) {
  const auto edge = [&](int64_t t) { return m * t / tiles; };
  const int64_t r0 = edge(i), rows = edge(i + 1) - r0, c0 = edge(j), cols = edge(j + 1) - c0;
  auto tile = c.block(r0, c0, rows, cols);
  if (i != j) {
    if (beta != 0.f && beta != 1.f) tile *= beta;
    multiply_into(tile, rows_of(r0, rows), rows_of(c0, cols).transpose(), alpha, beta);
    mirror_block(c, r0, c0, rows, cols);
    return;
  }
  if (beta == 0.f) {
    tile.template triangularView<Eigen::Lower>().setZero();  // c's old values ignored, NaN included
  } else if (beta != 1.f) {
    tile.template triangularView<Eigen::Lower>() *= beta;
  }
  // Eigen's rank update divides by its depth when it sizes its blocks (from side 48): skipped at 0.
  if (rows_of(r0, rows).cols() > 0) tile.template selfadjointView<Eigen::Lower>().rankUpdate(rows_of(r0, rows), alpha);
  mirror_block(c, r0, r0, rows, rows);
}

void syrk_now(const MatrixArg& a, bool trans_a, const MatrixArg& c, float alpha, float beta) {
  const MatrixLayout &la = a.layout, &lc = c.layout;
  std::vector<float> a_scratch, c_scratch;
  const int64_t m = lc.rows, tiles = syrk_tiles(m);
  // The lower triangle's tiles, the GEMMs (twice a diagonal tile's work) first, so that the
  // dynamic schedule ends on short tasks.
  std::vector<std::array<int64_t, 2>> tasks;
  for (int64_t i = 0; i < tiles; ++i)
    for (int64_t j = 0; j < i; ++j) tasks.push_back({i, j});
  for (int64_t i = 0; i < tiles; ++i) tasks.push_back({i, i});
  for (int64_t batch = 0; batch < lc.batch; ++batch) {
    const F32Matrix fa = widen(a, batch, a_scratch);
    ConstMatrixMap ma(fa.data, la.rows, la.cols, Eigen::OuterStride<>(fa.ld));
    float* out = output_f32(c, batch, beta, c_scratch);
    MatrixMap mc(out, m, m, Eigen::OuterStride<>(c.dtype == DType::f32 ? lc.ld : lc.cols));
    // Each tile single-threaded (Eigen does not nest its own threads inside a parallel region),
    // the tiles spread over the OpenMP threads; a matrix of one tile opens no thread team (a team
    // per small matrix of a batch took milliseconds each on a loaded machine).
    const int64_t count = int64_t(tasks.size());
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
    for (int64_t t = 0; t < count; ++t) {
      const auto [i, j] = tasks[size_t(t)];
      if (trans_a) {
        syrk_tile(
            mc, [&](int64_t r0, int64_t n) { return ma.middleCols(r0, n).transpose(); }, m, tiles, i, j, alpha, beta);
      } else {
        syrk_tile(
            mc, [&](int64_t r0, int64_t n) { return ma.middleRows(r0, n); }, m, tiles, i, j, alpha, beta);
      }
    }
    store_output(c, batch, out);
  }
}

/** memcpy of large buffers split over the OpenMP threads in 256 KiB pieces: one thread copies at
 *  well below the memory bus's rate (9-10 GB/s against 16 on a 2-core AMD EPYC with AVX2), and
 *  the swap's copies of a bandwidth-bound update wait for the bus. */
void parallel_memcpy(char* d, const char* s, size_t nbytes) {
  constexpr size_t kPiece = size_t(256) << 10;
  // Smaller copies stay on one thread (not tuned); unused without OpenMP.
  [[maybe_unused]] constexpr size_t kParallelBytes = size_t(4) << 20;
  const int64_t pieces = int64_t((nbytes + kPiece - 1) / kPiece);
#pragma omp parallel for schedule(static) if (nbytes >= kParallelBytes)
  for (int64_t i = 0; i < pieces; ++i) {
    const size_t at = size_t(i) * kPiece;
    std::memcpy(d + at, s + at, std::min(kPiece, nbytes - at));
  }
}

void strided_copy(const char* s, const Shape& shape, const Shape& src_strides, char* d, const Shape& dst_strides, size_t es) {
  const int64_t n = shape_numel(shape), nd = int64_t(shape.size());
  std::vector<int64_t> index(size_t(nd), 0);
  for (int64_t i = 0; i < n; ++i) {
    int64_t so = 0, dof = 0;
    for (int64_t k = 0; k < nd; ++k) {
      so += index[size_t(k)] * src_strides[size_t(k)];
      dof += index[size_t(k)] * dst_strides[size_t(k)];
    }
    std::memcpy(d + dof * int64_t(es), s + so * int64_t(es), es);
    for (int64_t k = nd - 1; k >= 0; --k) {
      if (++index[size_t(k)] < shape[size_t(k)]) break;
      index[size_t(k)] = 0;
    }
  }
}

}  // namespace

/** Keeps the storages of an op's tensors alive until the op has run. */
inline std::array<std::shared_ptr<Storage>, 3> hold(const Tensor& a, const Tensor& b = Tensor(), const Tensor& c = Tensor()) {
  return {a.storage(), b.storage(), c.storage()};
}

// Every op reads its tensors' addresses now, on the calling thread, and enqueues work on those
// raw pointers (see MatrixArg), holding the storages alive until the work has run. A release
// between enqueue and execution only drops the storage's pointer; the memory itself is freed in
// stream order (see the CPU allocator), after the queued work.

void gemm(Stream& stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c, float alpha,
          float beta) {
  const MatrixArg ma = matrix_arg(a, "gemm"), mb = matrix_arg(b, "gemm"), mc = matrix_arg(c, "gemm");
  stream.enqueue([=, keep = hold(a, b, c)] { gemm_now(ma, trans_a, mb, trans_b, mc, alpha, beta); });
}

void syrk(Stream& stream, const Tensor& a, bool trans_a, const Tensor& c, float alpha, float beta) {
  const MatrixArg ma = matrix_arg(a, "syrk"), mc = matrix_arg(c, "syrk");
  stream.enqueue([=, keep = hold(a, c)] { syrk_now(ma, trans_a, mc, alpha, beta); });
}

void axpby(Stream& stream, float alpha, const Tensor& x, float beta, const Tensor& y) {
  const size_t n = size_t(x.numel());
  if (n == 0) return;
  const void* xb = x.data_ptr();
  void* yb = y.data_ptr();
  const DType xd = x.dtype(), yd = y.dtype();
  stream.enqueue([=, keep = hold(x, y)] {
    if (xd == DType::f32 && yd == DType::f32) {
      const float* xv = static_cast<const float*>(xb);
      float* yv = static_cast<float*>(yb);
      if (beta == 0.f) {  // y is not read
#pragma omp parallel for simd if (n >= kParallelElements)
        for (size_t i = 0; i < n; ++i) yv[i] = formula::axpby(alpha, xv[i], 0.f, 0.f);
      } else {
#pragma omp parallel for simd if (n >= kParallelElements)
        for (size_t i = 0; i < n; ++i) yv[i] = formula::axpby(alpha, xv[i], beta, yv[i]);
      }
      return;
    }
    for (size_t i = 0; i < n; ++i)
      store_from_float(yb, i, yd, formula::axpby(alpha, load_as_float(xb, i, xd), beta, beta == 0.f ? 0.f : load_as_float(yb, i, yd)));
  });
}

void lerp(Stream& stream, const Tensor& a, const Tensor& b, float weight) {
  const size_t n = size_t(a.numel());
  if (n == 0) return;
  void* ab = a.data_ptr();
  const void* bb = b.data_ptr();
  const DType ad = a.dtype(), bd = b.dtype();
  stream.enqueue([=, keep = hold(a, b)] {
    with_dtype(ad, [&](auto a_type) {
      with_dtype(bd, [&](auto b_type) { lerp_loop<a_type(), b_type()>(ab, bb, n, weight); });
    });
  });
}

void frobenius_norm(Stream& stream, const Tensor& x, const Tensor& norms) {
  const int64_t count = norms.numel();
  if (count == 0) return;
  const int64_t per = x.numel() / count;
  const void* base = per ? x.data_ptr() : nullptr;
  float* out = norms.data<float>();
  const DType xd = x.dtype();
  stream.enqueue([=, keep = hold(x, norms)] {
    for (int64_t m = 0; m < count; ++m) {
      double sum = 0.0;
      for (int64_t i = 0; i < per; ++i) {
        const double v = load_as_float(base, size_t(m * per + i), xd);
        sum += v * v;
      }
      out[m] = float(std::sqrt(sum));
    }
  });
}

void flag_nonfinite(Stream& stream, const Tensor& x, const Tensor& flag) {
  const size_t n = size_t(x.numel());
  const void* base = x.data_ptr();
  float* out = flag.data<float>();
  const DType xd = x.dtype();
  stream.enqueue([=, keep = hold(x, flag)] {
    for (size_t i = 0; i < n; ++i)
      if (!std::isfinite(load_as_float(base, i, xd))) {
        *out = 1.f;
        return;
      }
  });
}

void scale_by_inverse_norm(Stream& stream, const Tensor& x, const Tensor& norms, float eps) {
  const int64_t count = norms.numel();
  if (count == 0 || x.numel() == 0) return;
  const int64_t per = x.numel() / count;
  void* base = x.data_ptr();
  const float* nv = norms.data<float>();
  const DType xd = x.dtype();
  stream.enqueue([=, keep = hold(x, norms)] {
    with_dtype(xd, [&](auto x_type) {
      for (int64_t m = 0; m < count; ++m) scale_loop<x_type()>(base, size_t(m * per), size_t(per), nv[m], eps);
    });
  });
}

void cast(Stream& stream, const Tensor& src, const Tensor& dst) {
  const size_t n = size_t(src.numel());
  if (n == 0) return;
  const void* sb = src.data_ptr();
  void* db = dst.data_ptr();
  const DType sd = src.dtype(), dd = dst.dtype();
  stream.enqueue([=, keep = hold(src, dst)] {
    with_dtype(sd, [&](auto s_type) {
      with_dtype(dd, [&](auto d_type) { cast_loop<s_type(), d_type()>(sb, db, n); });
    });
  });
}

void copy(Stream& stream, const Tensor& src, const Tensor& dst) {
  if (src.numel() == 0) return;
  const char* s = static_cast<const char*>(src.data_ptr());
  char* d = static_cast<char*>(dst.data_ptr());
  if (src.is_contiguous() && dst.is_contiguous()) {
    const size_t nbytes = src.nbytes();
    stream.enqueue([=, keep = hold(src, dst)] { parallel_memcpy(d, s, nbytes); });
  } else {
    const Shape shape = src.shape(), ss = src.strides(), ds = dst.strides();
    const size_t es = src.element_size();
    stream.enqueue([=, keep = hold(src, dst)] { strided_copy(s, shape, ss, d, ds, es); });
  }
}

void fill_zero(Stream& stream, const Tensor& x) {
  if (x.numel() == 0) return;
  void* p = x.data_ptr();
  const size_t nbytes = x.nbytes();
  stream.enqueue([=, keep = hold(x)] { std::memset(p, 0, nbytes); });
}

}  // namespace swapopt::cpu
