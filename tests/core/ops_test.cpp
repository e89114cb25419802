#include <algorithm>
#include <array>
#include <limits>
#include <numeric>
#include <random>

#include "test_util.h"

using namespace swapopt;
using test::compare;

namespace {

struct GemmCase {
  int64_t batch, m, n, k;
  bool ta, tb;
};

// f32 accumulation over k terms of |x| < 1: allow k * 2^-22 absolute error.
double gemm_tolerance(int64_t k) { return double(k) * 2.5e-7 + 1e-6; }

/** Matrix b of a batch of matrices of `size` elements each, stored one after the other. */
std::vector<float> matrix_of(const std::vector<float>& batch, int64_t b, int64_t size) {
  return {batch.begin() + b * size, batch.begin() + (b + 1) * size};
}

/** Copies the lower triangle of each m x m matrix of `batch` onto its upper one. */
void symmetrize(std::vector<float>& batch, int64_t m) {
  for (size_t first = 0; first < batch.size(); first += size_t(m * m))
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = i + 1; j < m; ++j) batch[first + size_t(i * m + j)] = batch[first + size_t(j * m + i)];
}

}  // namespace

TEST_CASE("gemm matches a naive f64 reference on odd shapes, transposes and batches") {
  Stream s(Device::cpu());
  const GemmCase cases[] = {{1, 1, 1, 1, false, false}, {1, 3, 517, 7, false, false}, {1, 3, 517, 7, true, false},
                            {1, 5, 9, 33, false, true},  {1, 64, 65, 63, true, true},   {4, 17, 3, 29, false, true},
                            {3, 130, 70, 257, false, false}};
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const GemmCase& g : cases) {
      const int64_t ar = g.ta ? g.k : g.m, ac = g.ta ? g.m : g.k, br = g.tb ? g.n : g.k, bc = g.tb ? g.k : g.n;
      Tensor a = test::random_tensor({g.batch, ar, ac}, dt, 1);
      Tensor b = test::random_tensor({g.batch, br, bc}, dt, 2);
      Tensor c = test::random_tensor({g.batch, g.m, g.n}, DType::f32, 3);
      const std::vector<float> c0 = c.to_float_vector();
      ops::gemm(s, a, g.ta, b, g.tb, c, 0.5f, 2.f);
      s.synchronize();
      const std::vector<float> av = a.to_float_vector(), bv = b.to_float_vector(), cv = c.to_float_vector();
      for (int64_t i = 0; i < g.batch; ++i) {
        auto slice = [](const std::vector<float>& v, int64_t i, int64_t n) {
          return std::vector<float>(v.begin() + i * n, v.begin() + (i + 1) * n);
        };
        const auto want = test::naive_gemm(slice(av, i, ar * ac), ar, ac, g.ta, slice(bv, i, br * bc), br, bc, g.tb,
                                           slice(c0, i, g.m * g.n), 0.5f, 2.f);
        const auto report = compare(std::string("gemm ") + dtype_name(dt) + " " + std::to_string(g.m) + "x" +
                                        std::to_string(g.n) + "x" + std::to_string(g.k),
                                    slice(cv, i, g.m * g.n), want);
        CHECK(report.max_abs <= gemm_tolerance(g.k) * 4);
      }
    }
  }
}

TEST_CASE("gemm into a bf16 output rounds the f32 result once") {
  Stream s(Device::cpu());
  Tensor a = test::random_tensor({7, 13}, DType::bf16, 4);
  Tensor b = test::random_tensor({13, 5}, DType::bf16, 5);
  Tensor c32 = Tensor::zeros({7, 5}, DType::f32, Device::cpu());
  Tensor c16 = Tensor::zeros({7, 5}, DType::bf16, Device::cpu());
  ops::gemm(s, a, false, b, false, c32);
  ops::gemm(s, a, false, b, false, c16);
  s.synchronize();
  CHECK(test::rounded(c32.to_float_vector(), DType::bf16) == c16.to_float_vector());
}

TEST_CASE("gemm reads matrices with a row stride larger than their width") {
  Stream s(Device::cpu());
  Tensor wide = test::random_tensor({6, 20}, DType::f32, 6);
  Tensor a = wide.narrow(1, 3, 9);  // 6 x 9, ld 20
  Tensor b = test::random_tensor({9, 4}, DType::f32, 7);
  Tensor c = Tensor::zeros({6, 4}, DType::f32, Device::cpu());
  ops::gemm(s, a, false, b, false, c);
  s.synchronize();
  const auto want = test::naive_gemm(a.to(Device::cpu()).to_float_vector(), 6, 9, false, b.to_float_vector(), 9, 4, false, {}, 1.f, 0.f);
  CHECK(compare("gemm strided a", c.to_float_vector(), want).max_abs < 1e-5);
}

TEST_CASE("syrk equals a @ a^T in both triangles") {
  Stream s(Device::cpu());
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const Shape& shape : {Shape{1, 1}, Shape{3, 517}, Shape{2, 200, 31}, Shape{300, 40}}) {
      Tensor a = test::random_tensor(shape, dt, 8);
      const int64_t m = a.size(-2), k = a.size(-1), batch = a.dim() == 3 ? a.size(0) : 1;
      Shape out_shape = shape;
      out_shape.back() = m;
      // beta != 0 reads only the lower triangle of c, so the starting c must be symmetric.
      std::vector<float> c0 = test::random_values(size_t(shape_numel(out_shape)), 9);
      symmetrize(c0, m);
      Tensor c = Tensor::from_floats(c0, out_shape);
      ops::syrk(s, a, false, c, 2.f, 0.5f);
      s.synchronize();
      const std::vector<float> av = a.to_float_vector(), cv = c.to_float_vector();
      for (int64_t i = 0; i < batch; ++i) {
        const std::vector<float> ai = matrix_of(av, i, m * k), ci = matrix_of(c0, i, m * m),
                                 got = matrix_of(cv, i, m * m);
        const auto want = test::naive_gemm(ai, m, k, false, ai, m, k, true, ci, 2.f, 0.5f);
        CHECK(compare(std::string("syrk ") + dtype_name(dt) + " " + shape_str(shape), got, want).max_abs <= gemm_tolerance(k) * 8);
      }
    }
  }
}

TEST_CASE("syrk with trans_a equals a^T @ a") {
  Stream s(Device::cpu());
  for (const Shape& shape : {Shape{517, 3}, Shape{2, 31, 200}}) {
    Tensor a = test::random_tensor(shape, DType::f32, 14);
    const int64_t r = a.size(-2), m = a.size(-1), batch = a.dim() == 3 ? a.size(0) : 1;
    Shape out_shape = shape;
    out_shape[out_shape.size() - 2] = m;
    Tensor c = Tensor::zeros(out_shape, DType::f32, Device::cpu());
    ops::syrk(s, a, true, c);
    s.synchronize();
    const std::vector<float> av = a.to_float_vector(), cv = c.to_float_vector();
    for (int64_t i = 0; i < batch; ++i) {
      const std::vector<float> ai = matrix_of(av, i, r * m), got = matrix_of(cv, i, m * m);
      const auto want = test::naive_gemm(ai, r, m, true, ai, r, m, false, {}, 1.f, 0.f);
      CHECK(compare("syrk^T " + shape_str(shape), got, want).max_abs <= gemm_tolerance(r) * 8);
    }
  }
}

TEST_CASE(
    "syrk on random shapes: a @ a^T within tolerance, exactly symmetric, a batch the same bits as its matrices one by "
    "one") {
  // Sides across the tiling's edges (one tile below 128, then tiles of about 256, uneven ones and
  // sides that are not a multiple of the 8 x 8 mirror blocks), depths from 0, both transposes,
  // bf16 and f32 inputs, beta 0 over NaN, 1 and neither.
  Stream s(Device::cpu());
  std::mt19937 rng(20261208);
  const int64_t sides[] = {1, 2, 7, 8, 9, 63, 64, 127, 128, 129, 200, 255, 256, 257, 300, 513, 520};
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t m = sides[rng() % std::size(sides)], k = int64_t(rng() % 4 == 0 ? 250 + rng() % 100 : rng() % 70),
                  batch = 1 + int64_t(rng() % 2);
    const bool trans_a = rng() % 2 == 1;
    const DType dt = rng() % 3 == 0 ? DType::bf16 : DType::f32;
    const float alpha = std::array{1.f, -0.5f, 2.f}[rng() % 3], beta = std::array{0.f, 1.f, 0.25f}[rng() % 3];
    CAPTURE(m);
    CAPTURE(k);
    CAPTURE(batch);
    CAPTURE(trans_a);
    CAPTURE(dtype_name(dt));
    CAPTURE(alpha);
    CAPTURE(beta);
    const Tensor a = test::random_tensor(trans_a ? Shape{batch, k, m} : Shape{batch, m, k}, dt, uint32_t(trial));
    // The starting c: symmetric values for beta != 0 (syrk reads the lower triangle), NaN for beta 0.
    std::vector<float> c0(size_t(batch * m * m), std::numeric_limits<float>::quiet_NaN());
    if (beta != 0.f) {
      c0 = test::random_values(c0.size(), uint32_t(1000 + trial));
      symmetrize(c0, m);
    }
    const Tensor c = Tensor::from_floats(c0, {batch, m, m});
    ops::syrk(s, a, trans_a, c, alpha, beta);
    s.synchronize();
    const std::vector<float> av = a.to_float_vector(), cv = c.to_float_vector();
    for (int64_t b = 0; b < batch; ++b) {
      const std::vector<float> ab = matrix_of(av, b, m * k), cb = matrix_of(c0, b, m * m),
                               got = matrix_of(cv, b, m * m);
      const int64_t rows = trans_a ? k : m, cols = trans_a ? m : k;
      const auto want = test::naive_gemm(ab, rows, cols, trans_a, ab, rows, cols, !trans_a, cb, alpha, beta);
      CHECK(compare("syrk", got, want).max_abs <= gemm_tolerance(k) * 8);
      bool symmetric = true;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < i; ++j) symmetric = symmetric && got[size_t(i * m + j)] == got[size_t(j * m + i)];
      CHECK(symmetric);
      // The same matrix alone gives the same bits.
      const Tensor one = Tensor::from_floats(cb, {m, m});
      ops::syrk(s, a.select(0, b), trans_a, one, alpha, beta);
      s.synchronize();
      CHECK(one.to_float_vector() == got);
    }
  }
}

TEST_CASE("syrk with beta 0 ignores what c held (NaN included), in every tile of both triangles") {
  Stream s(Device::cpu());
  for (const bool trans_a : {false, true}) {
    CAPTURE(trans_a);
    const Tensor a = test::random_tensor(trans_a ? Shape{40, 300} : Shape{300, 40}, DType::f32, 15);
    Tensor c = Tensor::from_floats(std::vector<float>(300 * 300, std::numeric_limits<float>::quiet_NaN()), {300, 300});
    ops::syrk(s, a, trans_a, c, 1.5f, 0.f);
    s.synchronize();
    const auto want = test::naive_gemm(a.to_float_vector(), a.size(0), a.size(1), trans_a, a.to_float_vector(),
                                       a.size(0), a.size(1), !trans_a, {}, 1.5f, 0.f);
    CHECK(compare("syrk beta 0", c.to_float_vector(), want).max_abs <= gemm_tolerance(40) * 8);
  }
}

TEST_CASE("gemm and syrk with k == 0 give beta C (0 for beta 0, whatever C held); without output elements, nothing") {
  Stream s(Device::cpu());
  const Tensor a = Tensor::zeros({2, 5, 0}, DType::f32, Device::cpu()),
               b = Tensor::zeros({2, 0, 7}, DType::f32, Device::cpu());
  for (const float beta : {0.f, 0.5f}) {
    CAPTURE(beta);
    Tensor c = test::random_tensor({2, 5, 7}, DType::f32, 3), g = test::random_tensor({2, 5, 5}, DType::f32, 4);
    for (int64_t m = 0; m < 2; ++m)  // symmetric, as syrk's beta needs
      for (int64_t i = 0; i < 5; ++i)
        for (int64_t j = 0; j < i; ++j) g.data<float>()[m * 25 + j * 5 + i] = g.data<float>()[m * 25 + i * 5 + j];
    const std::vector<float> c0 = c.to_float_vector(), g0 = g.to_float_vector();
    c.data<float>()[1] = std::numeric_limits<float>::quiet_NaN();  // not read with beta 0
    ops::gemm(s, a, false, b, false, c, 1.f, beta);
    ops::syrk(s, a, false, g, 1.f, beta);
    s.synchronize();
    const std::vector<float> cv = c.to_float_vector(), gv = g.to_float_vector();
    for (size_t i = 0; i < cv.size(); ++i)
      if (!(beta != 0.f && i == 1)) CHECK(cv[i] == beta * c0[i]);
    for (size_t i = 0; i < gv.size(); ++i) CHECK(gv[i] == beta * g0[i]);
  }
  Tensor none = Tensor::zeros({2, 0, 3}, DType::f32, Device::cpu());
  ops::gemm(s, Tensor::zeros({2, 0, 4}, DType::f32, Device::cpu()), false,
            test::random_tensor({2, 4, 3}, DType::f32, 5), false, none);
  ops::syrk(s, Tensor::zeros({2, 0, 4}, DType::f32, Device::cpu()), false,
            Tensor::zeros({2, 0, 0}, DType::f32, Device::cpu()));
  s.synchronize();
}

TEST_CASE("syrk with k == 0 gives beta C on every side, tiled or not, both transposes") {
  // Eigen's rank update divides by the depth once a side reaches 48: a depth of 0 crashed there.
  Stream s(Device::cpu());
  for (const int64_t m : {5, 47, 48, 64, 127, 128, 191, 300}) {
    for (const bool trans_a : {false, true}) {
      for (const float beta : {0.f, 0.5f}) {
        CAPTURE(m);
        CAPTURE(trans_a);
        CAPTURE(beta);
        std::vector<float> c0 = test::random_values(size_t(m * m), uint32_t(m));
        symmetrize(c0, m);
        Tensor c = Tensor::from_floats(
            beta == 0.f ? std::vector<float>(c0.size(), std::numeric_limits<float>::quiet_NaN()) : c0, {m, m});
        ops::syrk(s, Tensor::zeros(trans_a ? Shape{0, m} : Shape{m, 0}, DType::f32, Device::cpu()), trans_a, c, 2.f,
                  beta);
        s.synchronize();
        std::vector<float> want(c0.size(), 0.f);
        for (size_t i = 0; i < want.size(); ++i) want[i] = beta * c0[i];
        CHECK(c.to_float_vector() == want);
      }
    }
  }
}

TEST_CASE(
    "gemm and syrk take tensors without elements whatever their strides, and a batch of none of any side at once") {
  Stream s(Device::cpu());
  // Views of nothing: a transposed [5, 0, 3] has strides [3, 0, 1], a transposed [3, 0] strides [1, 0].
  const Tensor none_batch = Tensor::zeros({5, 0, 3}, DType::f32, Device::cpu()).transpose(0, 1);
  CHECK_NOTHROW(ops::gemm(s, none_batch, false, Tensor::zeros({0, 3, 4}, DType::f32, Device::cpu()), false,
                          Tensor::zeros({5, 0, 4}, DType::f32, Device::cpu()).transpose(0, 1)));
  CHECK_NOTHROW(ops::syrk(s, none_batch, false, Tensor::zeros({0, 5, 5}, DType::f32, Device::cpu())));
  const Tensor no_rows = Tensor::zeros({3, 0}, DType::f32, Device::cpu()).transpose(0, 1);
  CHECK_NOTHROW(ops::gemm(s, no_rows, false, Tensor::zeros({3, 4}, DType::f32, Device::cpu()), false,
                          Tensor::zeros({0, 4}, DType::f32, Device::cpu())));
  // k == 0 through such a view: C = beta C.
  Tensor c = Tensor::from_floats({1.f, 2.f, 3.f, 4.f}, {2, 2});
  ops::gemm(s, Tensor::zeros({0, 2}, DType::f32, Device::cpu()).transpose(0, 1), false,
            Tensor::zeros({2, 0}, DType::f32, Device::cpu()).transpose(0, 1), false, c, 1.f, 0.5f);
  // A batch of no matrices of side 10^7: nothing to do (it planned the side's tiles first: 12 GB).
  ops::syrk(s, Tensor::zeros({0, 10000000, 5}, DType::f32, Device::cpu()), false,
            Tensor::zeros({0, 10000000, 10000000}, DType::f32, Device::cpu()));
  s.synchronize();
  CHECK(c.to_float_vector() == std::vector<float>{0.5f, 1.f, 1.5f, 2.f});
}

TEST_CASE("elementwise ops: axpby, scale, lerp, cast match their formulas") {
  Stream s(Device::cpu());
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const Shape shape{3, 517};
    Tensor x = test::random_tensor(shape, dt, 10);
    Tensor y = test::random_tensor(shape, DType::f32, 11);
    const auto xv = x.to_float_vector(), y0 = y.to_float_vector();
    ops::axpby(s, 0.75f, x, -1.25f, y);
    s.synchronize();
    std::vector<float> want(y0.size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = 0.75f * xv[i] + -1.25f * y0[i];
    CHECK(y.to_float_vector() == want);

    Tensor z = x.clone();
    ops::scale(s, z, 3.f);
    s.synchronize();
    for (size_t i = 0; i < want.size(); ++i) want[i] = test::round_to(3.f * xv[i], dt);
    CHECK(z.to_float_vector() == want);

    Tensor a = test::random_tensor(shape, dt, 12);
    const auto a0 = a.to_float_vector();
    for (float w : {0.1f, 0.9f}) {
      Tensor l = a.clone();
      ops::lerp(s, l, x, w);
      s.synchronize();
      for (size_t i = 0; i < want.size(); ++i)
        want[i] = test::round_to(w < 0.5f ? a0[i] + w * (xv[i] - a0[i]) : xv[i] - (xv[i] - a0[i]) * (1.f - w), dt);
      CHECK(l.to_float_vector() == want);
    }

    Tensor out = Tensor::zeros(shape, DType::bf16, Device::cpu());
    ops::cast(s, y, out);
    s.synchronize();
    CHECK(out.to_float_vector() == test::rounded(y.to_float_vector(), DType::bf16));
  }
}

TEST_CASE("frobenius_norm and scale_by_inverse_norm work per matrix of a batch") {
  Stream s(Device::cpu());
  Tensor x = test::random_tensor({3, 17, 5}, DType::f32, 13);
  Tensor norms = Tensor::zeros({3}, DType::f32, Device::cpu());
  ops::frobenius_norm(s, x, norms);
  s.synchronize();
  const auto xv = x.to_float_vector();
  std::vector<float> want(3);
  for (int m = 0; m < 3; ++m) {
    double sum = 0;
    for (int i = 0; i < 85; ++i) sum += double(xv[size_t(m * 85 + i)]) * xv[size_t(m * 85 + i)];
    want[size_t(m)] = float(std::sqrt(sum));
  }
  CHECK(norms.to_float_vector() == want);
  ops::scale_by_inverse_norm(s, x, norms, 1e-7f);
  ops::frobenius_norm(s, x, norms);
  s.synchronize();
  compare("normalised norms", norms.to_float_vector(), {1.f, 1.f, 1.f});
  for (float n : norms.to_float_vector()) CHECK(n == doctest::Approx(1.0).epsilon(1e-6));
  Tensor bad = Tensor::zeros({2}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(ops::frobenius_norm(s, x, bad),
                       "[frobenius_norm] norms must be contiguous f32 with 3 elements, got Tensor(f32, [2], cpu)", Error);
}

TEST_CASE("copy handles strided sources and checks its arguments") {
  Stream s(Device::cpu());
  Tensor src = Tensor::from_floats({0, 1, 2, 3, 4, 5}, {2, 3}).transpose(0, 1);
  Tensor dst = Tensor::zeros({3, 2}, DType::f32, Device::cpu());
  ops::copy(s, src, dst);
  s.synchronize();
  CHECK(dst.to_float_vector() == std::vector<float>{0, 3, 1, 4, 2, 5});
  Tensor zeros = Tensor::from_floats({1, 2, 3}, {3});
  ops::fill_zero(s, zeros);
  s.synchronize();
  CHECK(zeros.to_float_vector() == std::vector<float>{0, 0, 0});
  CHECK_THROWS_WITH_AS(ops::copy(s, dst, Tensor::zeros({2, 3}, DType::f32, Device::cpu())),
                       "[copy] Tensor(f32, [3, 2], cpu) -> Tensor(f32, [2, 3], cpu): shape and dtype must match", Error);
}

TEST_CASE("elementwise and fused ops refuse outputs overlapping another argument, except the very same view") {
  Stream s(Device::cpu());
  const std::vector<float> start = test::random_tensor({16}, DType::f32, 5).to_float_vector();
  const Tensor t = Tensor::from_floats(start, {16});
  const Tensor head = t.narrow(0, 0, 8), shifted = t.narrow(0, 4, 8), tail = t.narrow(0, 8, 8);
  const std::string partial =
      " share memory without being the same view: an input may be written in place only as "
      "the very same view, and must otherwise be apart from the outputs";
  CHECK_THROWS_WITH_AS(ops::copy(s, head, shifted), ("[copy] dst and src" + partial).c_str(), Error);
  CHECK_THROWS_WITH_AS(ops::axpby(s, 1.f, head, 1.f, shifted), ("[axpby] y and x" + partial).c_str(), Error);
  CHECK_THROWS_WITH_AS(ops::lerp(s, shifted, head, 0.5f), ("[lerp] a and b" + partial).c_str(), Error);
  CHECK_THROWS_WITH_AS(ops::cast(s, head, shifted), ("[cast] dst and src" + partial).c_str(), Error);
  // The bytes of 4 f32 read as 8 bf16: the same address, another view.
  const Tensor as_bf16 = Tensor::on_storage(t.storage(), 0, {8}, DType::bf16);
  CHECK_THROWS_WITH_AS(ops::cast(s, head.narrow(0, 0, 8), as_bf16), ("[cast] dst and src" + partial).c_str(), Error);
  const Tensor norms = Tensor::zeros({1}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(ops::frobenius_norm(s, t.view({4, 4}), t.narrow(0, 3, 1)),
                       ("[frobenius_norm] norms and x" + partial).c_str(), Error);
  CHECK_THROWS_WITH_AS(ops::scale_by_inverse_norm(s, t.view({4, 4}), t.narrow(0, 3, 1), 1e-7f),
                       ("[scale_by_inverse_norm] x and norms" + partial).c_str(), Error);
  const Tensor other = test::random_tensor({8}, DType::f32, 6), m = Tensor::zeros({8}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(ops::muon_momentum(s, other, head, shifted, 0.9f, 0.9f, false),
                       "[muon_momentum] momentum_buffer and update share memory: an op's outputs must not overlap",
                       Error);
  CHECK_THROWS_WITH_AS(ops::muon_momentum(s, shifted, head, m, 0.9f, 0.9f, false),
                       ("[muon_momentum] momentum_buffer and grad" + partial).c_str(), Error);
  const ops::AdamWScalars scalars{};
  CHECK_THROWS_WITH_AS(ops::adamw_update(s, m, other, head, shifted, Tensor(), scalars),
                       "[adamw_update] exp_avg and exp_avg_sq share memory: an op's outputs must not overlap", Error);
  const ops::AdamWUpdate update{tail, shifted, m, Tensor::zeros({8}, DType::f32, Device::cpu()), Tensor(), scalars};
  CHECK_THROWS_WITH_AS(ops::adamw_update_many(s, {&update, 1}),
                       ("[adamw_update_many] param and grad" + partial).c_str(), Error);
  s.synchronize();
  CHECK(t.to_float_vector() == start);  // nothing ran
  // Disjoint views and the very same view (in place) are fine; a copy onto itself does nothing.
  ops::copy(s, head, tail);
  ops::copy(s, t, t);
  ops::axpby(s, 2.f, head, 1.f, head);
  s.synchronize();
  std::vector<float> want = start;
  for (size_t i = 0; i < 8; ++i) want[8 + i] = start[i];
  for (size_t i = 0; i < 8; ++i) want[i] = formula::axpby(2.f, start[i], 1.f, start[i]);
  CHECK(t.to_float_vector() == want);
}

TEST_CASE(
    "adamw_update_many: random lists of views of one buffer, refused exactly when updates clash, else per-update "
    "bits") {
  // A model of the rule, pair by pair: within an update the outputs are apart and the grad is apart
  // from them or the very same view; across updates no write meets another write or a grad.
  auto overlap = [](int64_t x, int64_t y) { return x < y + 8 && y < x + 8; };
  constexpr int64_t kBuffer = 320;
  std::mt19937 rng(2026);
  const std::vector<float> start = [] {
    std::vector<float> v = test::random_tensor({kBuffer}, DType::f32, 21).to_float_vector();
    for (float& x : v) x = std::fabs(x);  // exp_avg_sq from the same bytes must stay >= 0
    return v;
  }();
  int refused = 0, ran = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int count = 1 + int(rng() % 4);
    const bool amsgrad = rng() % 2;
    // offsets[i] = {param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq} of update i, in floats.
    std::vector<std::array<int64_t, 5>> offsets(size_t(count), std::array<int64_t, 5>{});
    std::vector<int64_t> slots(kBuffer / 8);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    size_t next_slot = 0;
    for (int i = 0; i < count; ++i)
      for (int k = 0; k < 5; ++k) {
        const unsigned pick = rng() % 40;
        int64_t& o = offsets[size_t(i)][size_t(k)];
        if (pick == 0)
          o = int64_t(rng() % (kBuffer - 7));  // anywhere: may overlap
        else if (pick == 1 && k == 1)
          o = offsets[size_t(i)][0];  // grad = own param, in place
        else if (pick == 2 && k == 1 && i > 0)
          o = offsets[rng() % size_t(i)][1];  // a grad read twice
        else if (pick == 3 && i > 0)
          o = offsets[rng() % size_t(i)][rng() % 5];  // another update's tensor
        else
          o = slots[next_slot++] * 8;
      }
    bool clash = false;
    const size_t kinds = amsgrad ? 5 : 4;
    auto writes = [&](size_t k) { return k != 1 && k < kinds; };
    for (size_t i = 0; i < size_t(count); ++i)
      for (size_t j = 0; j < size_t(count); ++j)
        for (size_t a = 0; a < kinds; ++a)
          for (size_t b = 0; b < kinds; ++b) {
            if ((i == j && a >= b) || (i > j)) continue;
            if (!overlap(offsets[i][a], offsets[j][b]) || (!writes(a) && !writes(b))) continue;
            const bool in_place = i == j && (a == 1 || b == 1) && offsets[i][a] == offsets[j][b];
            if (!in_place) clash = true;
          }
    Tensor buffer = Tensor::from_floats(start, {kBuffer}), reference = Tensor::from_floats(start, {kBuffer});
    auto list = [&](const Tensor& t) {
      std::vector<ops::AdamWUpdate> updates;
      for (const auto& o : offsets)
        updates.push_back({t.narrow(0, o[0], 8), t.narrow(0, o[1], 8), t.narrow(0, o[2], 8), t.narrow(0, o[3], 8),
                           amsgrad ? t.narrow(0, o[4], 8) : Tensor(), ops::AdamWScalars{}});
      return updates;
    };
    Stream s(Device::cpu());
    const std::vector<ops::AdamWUpdate> updates = list(buffer);
    const std::string error = test::error_of([&] { ops::adamw_update_many(s, updates); });
    s.synchronize();
    CAPTURE(trial);
    CAPTURE(error);
    REQUIRE((error.empty() ? !clash : clash));
    if (clash) {
      ++refused;
      CHECK(error.rfind("[adamw_update_many] ", 0) == 0);
      CHECK(buffer.to_float_vector() == start);  // nothing ran
    } else {
      ++ran;
      for (const ops::AdamWUpdate& u : list(reference))
        ops::adamw_update(s, u.param, u.grad, u.exp_avg, u.exp_avg_sq, u.max_exp_avg_sq, u.scalars);
      s.synchronize();
      CHECK(test::same_bits(buffer, reference));
    }
  }
  CHECK(refused > 40);
  CHECK(ran > 40);
  // The message names both updates' tensors.
  Stream s(Device::cpu());
  const Tensor t = Tensor::zeros({64}, DType::f32, Device::cpu());
  const std::vector<ops::AdamWUpdate> shared_state{
      {t.narrow(0, 0, 8), t.narrow(0, 8, 8), t.narrow(0, 16, 8), t.narrow(0, 24, 8), Tensor(), {}},
      {t.narrow(0, 32, 8), t.narrow(0, 40, 8), t.narrow(0, 20, 8), t.narrow(0, 48, 8), Tensor(), {}}};
  CHECK(test::error_of([&] { ops::adamw_update_many(s, shared_state); }) ==
        "[adamw_update_many] update 0's exp_avg and update 1's exp_avg share memory: the updates run concurrently, so "
        "none may write what another reads or writes");
  const std::vector<ops::AdamWUpdate> grad_is_param{
      {t.narrow(0, 0, 8), t.narrow(0, 8, 8), t.narrow(0, 16, 8), t.narrow(0, 24, 8), Tensor(), {}},
      {t.narrow(0, 32, 8), t.narrow(0, 0, 8), t.narrow(0, 40, 8), t.narrow(0, 48, 8), Tensor(), {}}};
  CHECK(test::error_of([&] { ops::adamw_update_many(s, grad_is_param); }) ==
        "[adamw_update_many] update 1's grad and update 0's param share memory: the updates run concurrently, so "
        "none may write what another reads or writes");
}

TEST_CASE("ops reject bad arguments with the operation and the values") {
  Stream s(Device::cpu());
  Tensor a = Tensor::zeros({3, 4}, DType::f32, Device::cpu());
  Tensor b = Tensor::zeros({5, 6}, DType::f32, Device::cpu());
  Tensor c = Tensor::zeros({3, 6}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(ops::gemm(s, a, false, b, false, c), "[gemm] shapes do not match: a [3, 4] @ b [5, 6] -> c [3, 6]", Error);
  Tensor a16 = Tensor::zeros({3, 4}, DType::bf16, Device::cpu());
  CHECK_THROWS_WITH_AS(ops::gemm(s, a16, false, Tensor::zeros({4, 6}, DType::f32, Device::cpu()), false, c),
                       "[gemm] dtype mismatch: a is bf16, b is f32", Error);
  CHECK_THROWS_WITH_AS(ops::gemm(s, a, false, Tensor::zeros({4, 6}, DType::f32, Device::cpu()), false,
                                 Tensor::zeros({3, 6}, DType::bf16, Device::cpu())),
                       "[gemm] f32 inputs need an f32 output (no f32 x f32 -> bf16 product in cuBLAS)", Error);
  CHECK_THROWS_WITH_AS(ops::syrk(s, a, false, Tensor::zeros({3, 3}, DType::bf16, Device::cpu())),
                       "[syrk] f32 inputs need an f32 output (no f32 x f32 -> bf16 product in cuBLAS)", Error);
  CHECK_THROWS_WITH_AS(ops::axpby(s, 1.f, a, 1.f, c), "[axpby] shape mismatch [3, 4] vs [3, 6]", Error);
  CHECK_THROWS_WITH_AS(ops::gemm(s, Tensor::zeros({4}, DType::f32, Device::cpu()), false, b, false, c),
                       "[gemm] expected a 2-D or 3-D tensor, got Tensor(f32, [4], cpu)", Error);
  // An output over an input's memory: refused, nothing written; disjoint parts of one buffer are fine.
  Tensor square = test::random_tensor({4, 4}, DType::f32, 7);
  const std::vector<float> square_before = square.to_float_vector();
  CHECK_THROWS_WITH_AS(ops::gemm(s, square, false, Tensor::zeros({4, 4}, DType::f32, Device::cpu()), false, square),
                       "[gemm] out_c shares memory with a (a product writes its output while it reads its inputs)",
                       Error);
  CHECK_THROWS_WITH_AS(
      ops::gemm(s, Tensor::zeros({2, 4}, DType::f32, Device::cpu()), false, square, false, square.narrow(0, 2, 2)),
      "[gemm] out_c shares memory with b (a product writes its output while it reads its inputs)", Error);
  CHECK_THROWS_WITH_AS(ops::syrk(s, square, false, square),
                       "[syrk] out_c shares memory with a (a product writes its output while it reads its inputs)",
                       Error);
  s.synchronize();
  CHECK(square.to_float_vector() == square_before);
  Tensor halves = test::random_tensor({2, 2, 2}, DType::f32, 8);  // disjoint matrices of one buffer
  CHECK_NOTHROW(ops::gemm(s, halves.narrow(0, 0, 1), false, halves.narrow(0, 0, 1), false,
                          Tensor::zeros({1, 2, 2}, DType::f32, Device::cpu())));
  CHECK_NOTHROW(ops::syrk(s, halves.narrow(0, 0, 1), false, halves.narrow(0, 1, 1)));
  s.synchronize();
  Tensor shell = Tensor::zeros({3, 4}, DType::f32, Device::cpu());
  shell.storage()->release();
  CHECK_THROWS_WITH_AS(ops::scale(s, shell, 2.f), "[scale] x Tensor(f32, [3, 4], cpu) has released storage", Error);
  // Each op names its operands as its signature does.
  const Tensor fine = Tensor::zeros({3, 4}, DType::f32, Device::cpu());
  CHECK(test::error_of([&] { ops::lerp(s, shell, fine, 0.5f); }) ==
        "[lerp] a Tensor(f32, [3, 4], cpu) has released storage");
  CHECK(test::error_of([&] { ops::lerp(s, fine, Tensor(), 0.5f); }) == "[lerp] b is undefined");
  CHECK(test::error_of([&] { ops::cast(s, Tensor(), fine); }) == "[cast] src is undefined");
  CHECK(test::error_of([&] { ops::cast(s, fine, shell); }) ==
        "[cast] dst Tensor(f32, [3, 4], cpu) has released storage");
  CHECK(test::error_of([&] { ops::axpby(s, 1.f, fine, 1.f, Tensor()); }) == "[axpby] y is undefined");
}

TEST_CASE("an output that addresses an element twice (a dim of stride 0) is refused, changing nothing") {
  Stream s(Device::cpu());
  float one[1] = {7.f};
  const Tensor repeated = Tensor::from_blob(one, {4}, {0}, DType::f32, Device::cpu());
  const Tensor src = Tensor::from_floats({1, 2, 3, 4}, {4});
  const std::string tail = " has a dim of stride 0: an output must address each of its elements once";
  // (the other elementwise ops take contiguous tensors only)
  CHECK(test::error_of([&] { ops::copy(s, src, repeated); }) == "[copy] dst " + repeated.str() + tail);
  s.synchronize();
  CHECK(one[0] == 7.f);
  // As an input, or along a dim of one element, stride 0 is fine.
  float out[4] = {};
  ops::copy(s, repeated, Tensor::from_blob(out, {4}, DType::f32, Device::cpu()));
  ops::copy(s, src.narrow(0, 0, 1), Tensor::from_blob(one, {1}, {0}, DType::f32, Device::cpu()));
  s.synchronize();
  CHECK(out[3] == 7.f);
  CHECK(one[0] == 1.f);
}

TEST_CASE(
    "an output whose strides fold its dims onto each other is refused, changing nothing; interleaved ones that do not "
    "are fine") {
  // Every small layout of 2-3 dims, strides 0-6, against a count of the offsets each element has.
  Stream s(Device::cpu());
  std::vector<float> memory(256, -1.f);
  const std::vector<float> before = memory;
  std::mt19937 gen(5);
  int refused = 0, accepted = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const int dims = 2 + int(gen() % 2);
    Shape shape(static_cast<size_t>(dims)), strides(static_cast<size_t>(dims));
    for (int d = 0; d < dims; ++d) {
      shape[size_t(d)] = 1 + int64_t(gen() % 4);
      strides[size_t(d)] = int64_t(gen() % 7);
    }
    const Tensor dst = Tensor::from_blob(memory.data(), shape, strides, DType::f32, Device::cpu());
    std::vector<int> hits(memory.size(), 0);
    bool twice = false;
    for (int64_t i = 0; i < dst.numel(); ++i) {
      int64_t rest = i, offset = 0;
      for (int d = dims - 1; d >= 0; --d) {
        offset += (rest % shape[size_t(d)]) * strides[size_t(d)];
        rest /= shape[size_t(d)];
      }
      twice = twice || ++hits[size_t(offset)] > 1;
    }
    CAPTURE(shape_str(shape));
    CAPTURE(shape_str(strides));
    const Tensor src = test::random_tensor(shape, DType::f32, uint32_t(trial));
    const std::string error = test::error_of([&] { ops::copy(s, src, dst); });
    s.synchronize();
    if (twice) {
      ++refused;
      const bool zero =
          error.find("has a dim of stride 0: an output must address each of its elements once") != std::string::npos;
      const bool folded =
          error == "[copy] dst " + dst.str() + " has strides " + shape_str(strides) +
                       " that reach one element twice: an output must address each of its elements once";
      CHECK((zero || folded));
      CHECK(memory == before);
    } else {
      ++accepted;
      CHECK(error == "");
      CHECK(dst.to_float_vector() == src.to_float_vector());
      memory = before;
    }
  }
  CHECK(refused > 300);
  CHECK(accepted > 300);
  // Only the interleaved dims are listed: a large dim nesting past them is fine. Interleaved dims
  // over more than 2^20 elements are refused, as too many to list.
  std::vector<float> large(size_t(1) << 21);
  const Tensor nested = Tensor::from_blob(large.data(), {2, 3, 200000}, {3, 2, 8}, DType::f32, Device::cpu());
  CHECK(test::error_of([&] { ops::copy(s, Tensor::zeros(nested.shape(), DType::f32, Device::cpu()), nested); }) == "");
  const Tensor wide = Tensor::from_blob(large.data(), {2, int64_t(1) << 20}, {1, 1}, DType::f32, Device::cpu());
  CHECK(test::error_of([&] { ops::copy(s, Tensor::zeros(wide.shape(), DType::f32, Device::cpu()), wide); }) ==
        "[copy] dst " + wide.str() +
            " has interleaved strides [1, 1] over more than 1048576 elements, too many to check that none is "
            "reached twice (use a contiguous output): an output must address each of its elements once");
  s.synchronize();
}

TEST_CASE("views and norms of tensors without elements but with dims whose products pass int64") {
  // A dim of 0 allows strides past int64 (contiguous_strides saturates): views of such tensors
  // must not compute offsets from them (undefined behaviour, caught by UBSan in CI).
  const int64_t big = int64_t(1) << 40;
  const Tensor t = Tensor::empty({0, big, big}, DType::f32, Device::cpu());
  CHECK(t.narrow(1, big / 2, 1).shape() == Shape{0, 1, big});
  CHECK(t.select(1, big - 1).shape() == Shape{0, big});
  CHECK(t.narrow(2, big - 1, 1).select(2, 0).numel() == 0);
  // 2^80 matrices of 0 x 1: no count of norms fits, and the error says so.
  Stream s(Device::cpu());
  const Tensor x = Tensor::empty({0, big, big, 1}, DType::f32, Device::cpu()).transpose(0, 2);  // [2^40, 2^40, 0, 1]
  const Tensor norms = Tensor::empty({0}, DType::f32, Device::cpu());
  CHECK(test::error_of([&] { ops::frobenius_norm(s, x, norms); }) ==
        "[frobenius_norm] x " + x.str() + " holds more matrices than an int64 counts");
  CHECK(test::error_of([&] { ops::scale_by_inverse_norm(s, x, norms, 1e-7f); }) ==
        "[scale_by_inverse_norm] x " + x.str() + " holds more matrices than an int64 counts");
  s.synchronize();
}
