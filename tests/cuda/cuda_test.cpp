// CUDA backend against the CPU backend. Skipped (with the reason printed by main) without a device.
#include <array>
#include <limits>

#include "test_util.h"

#if SWAPOPT_TEST_CUDA_RUNTIME
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <thread>
#endif

using namespace swapopt;
using test::compare;

namespace {

/** Three steps of a bare Muon on `bare_stream` and a swapped one on `swap_stream` (same device),
 *  from the same weights and grads: whether the weights end bitwise equal. */
bool swapped_muon_equals_bare(Stream bare_stream, Stream swap_stream, const Shape& shape, uint32_t seed) {
  const Device dev = bare_stream.device();
  auto bare_params = std::vector<ParamPtr>{make_param("w", test::random_tensor(shape, DType::f32, seed).to(dev))};
  auto swap_params = std::vector<ParamPtr>{make_param("w", test::random_tensor(shape, DType::f32, seed).to(dev))};
  Muon bare(bare_stream), inner(swap_stream);
  bare.add_param_group(bare_params);
  inner.add_param_group(swap_params);
  SwapConfig config;
  config.min_numel = 1;
  auto swapped = swap_muon(inner, config);
  for (uint32_t step = 1; step <= 3; ++step) {
    const Tensor g = test::random_tensor(shape, DType::f32, seed * 100 + step);
    bare_params[0]->grad = g.to(dev);
    swap_params[0]->grad = g.to(dev);
    bare.step();
    swapped->step();
  }
  bare_stream.synchronize();
  swap_stream.synchronize();
  return test::same_bits(bare_params[0]->data.to(Device::cpu()), swap_params[0]->data.to(Device::cpu()));
}

}  // namespace

TEST_SUITE("cuda" * doctest::skip(test::no_gpu())) {
  TEST_CASE("H2D and D2H copies on a stream round-trip bitwise, pinned and pageable") {
    Stream s(Device::cuda(0));
    Tensor host = test::random_tensor({1000, 37}, DType::f32, 1);
    Tensor dev = Tensor::empty_like(host.to(Device::cuda(0)));
    Storage pinned_storage(host.nbytes(), Device::cpu(), pinned_host_allocator());
    Tensor pinned = Tensor::on_storage(std::shared_ptr<Storage>(&pinned_storage, [](Storage*) {}), 0, host.shape(), DType::f32);
    ops::copy(s, host, dev);
    ops::copy(s, dev, pinned);
    s.synchronize();
    CHECK(test::same_bits(host, pinned));
  }

  TEST_CASE("strided copies on the device (a column block of a batch) match the CPU's bitwise") {
    Stream s(Device::cuda(0));
    const Tensor host = test::random_tensor({3, 20, 12}, DType::f32, 2);
    const Tensor dev = host.to(Device::cuda(0));
    Tensor block = Tensor::empty({3, 20, 5}, DType::f32, Device::cuda(0));
    ops::copy(s, dev.narrow(2, 6, 5), block);  // strided source
    Tensor back = Tensor::zeros({3, 20, 12}, DType::f32, Device::cuda(0));
    ops::copy(s, block, back.narrow(2, 6, 5));  // strided destination
    s.synchronize();
    Tensor expected = Tensor::zeros({3, 20, 12}, DType::f32, Device::cpu());
    Stream cpu(Device::cpu());
    ops::copy(cpu, host.narrow(2, 6, 5), expected.narrow(2, 6, 5));
    cpu.synchronize();
    CHECK(test::same_bits(back.to(Device::cpu()), expected));
    // to() across devices takes strided views both ways (made contiguous on their own device first).
    CHECK(test::same_bits(dev.narrow(2, 6, 5).to(Device::cpu()), host.narrow(2, 6, 5).clone()));
    CHECK(test::same_bits(host.narrow(1, 3, 9).to(Device::cuda(0)).to(Device::cpu()), host.narrow(1, 3, 9).clone()));
    CHECK_THROWS_WITH_AS(ops::copy(s, dev.transpose(1, 2), Tensor::empty({3, 12, 20}, DType::f32, Device::cuda(0))),
                         doctest::Contains("need unit stride in the last of at least 2 dims"), Error);
  }

  TEST_CASE("gemm, syrk and elementwise ops match the CPU backend") {
    Stream gs(Device::cuda(0)), cs(Device::cpu());
    for (DType dt : {DType::f32, DType::bf16}) {
      Tensor a = test::random_tensor({3, 130, 257}, dt, 2), b = test::random_tensor({3, 257, 70}, dt, 3);
      Tensor c_cpu = Tensor::zeros({3, 130, 70}, DType::f32, Device::cpu());
      Tensor c_gpu = Tensor::zeros({3, 130, 70}, DType::f32, Device::cuda(0));
      ops::gemm(cs, a, false, b, false, c_cpu);
      ops::gemm(gs, a.to(Device::cuda(0)), false, b.to(Device::cuda(0)), false, c_gpu);
      Tensor s_cpu = Tensor::zeros({3, 130, 130}, DType::f32, Device::cpu());
      Tensor s_gpu = Tensor::zeros({3, 130, 130}, DType::f32, Device::cuda(0));
      ops::syrk(cs, a, false, s_cpu);
      ops::syrk(gs, a.to(Device::cuda(0)), false, s_gpu);
      Tensor t_cpu = Tensor::zeros({3, 257, 257}, DType::f32, Device::cpu());
      Tensor t_gpu = Tensor::zeros({3, 257, 257}, DType::f32, Device::cuda(0));
      ops::syrk(cs, a, true, t_cpu);
      ops::syrk(gs, a.to(Device::cuda(0)), true, t_gpu);
      cs.synchronize();
      gs.synchronize();
      CHECK(compare(std::string("cuda gemm ") + dtype_name(dt), c_gpu.to_float_vector(), c_cpu.to_float_vector()).max_abs < 1e-3);
      CHECK(compare(std::string("cuda syrk ") + dtype_name(dt), s_gpu.to_float_vector(), s_cpu.to_float_vector()).max_abs < 1e-3);
      CHECK(compare(std::string("cuda syrk^T ") + dtype_name(dt), t_gpu.to_float_vector(), t_cpu.to_float_vector()).max_abs < 1e-3);
    }
    Tensor x = test::random_tensor({4, 33, 65}, DType::bf16, 4);
    Tensor y = test::random_tensor({4, 33, 65}, DType::f32, 5);
    Tensor xg = x.to(Device::cuda(0)), yg = y.to(Device::cuda(0));
    ops::axpby(cs, 0.5f, x, 0.25f, y);
    ops::axpby(gs, 0.5f, xg, 0.25f, yg);
    ops::lerp(cs, y, x, 0.3f);
    ops::lerp(gs, yg, xg, 0.3f);
    Tensor n_cpu = Tensor::zeros({4}, DType::f32, Device::cpu()), n_gpu = Tensor::zeros({4}, DType::f32, Device::cuda(0));
    ops::frobenius_norm(cs, y, n_cpu);
    ops::frobenius_norm(gs, yg, n_gpu);
    ops::scale_by_inverse_norm(cs, y, n_cpu, 1e-7f);
    ops::scale_by_inverse_norm(gs, yg, n_gpu, 1e-7f);
    Tensor cast_cpu = Tensor::zeros({4, 33, 65}, DType::bf16, Device::cpu());
    Tensor cast_gpu = Tensor::zeros({4, 33, 65}, DType::bf16, Device::cuda(0));
    ops::cast(cs, y, cast_cpu);
    ops::cast(gs, yg, cast_gpu);
    cs.synchronize();
    gs.synchronize();
    CHECK(compare("cuda axpby+lerp+normalise", yg.to_float_vector(), y.to_float_vector()).max_abs < 1e-5);
    CHECK(compare("cuda norms", n_gpu.to_float_vector(), n_cpu.to_float_vector()).max_rel < 1e-5);
    CHECK(compare("cuda cast", cast_gpu.to_float_vector(), cast_cpu.to_float_vector()).max_abs < 1e-2);
  }

  TEST_CASE(
      "gemm and syrk with k == 0 or no output element on CUDA: as on the CPU (cuBLAS refuses a leading dim of 0)") {
    Stream gs(Device::cuda(0)), cs(Device::cpu());
    for (DType dt : {DType::f32, DType::bf16})
      for (const float beta : {0.f, 0.5f}) {
        CAPTURE(beta);
        const Tensor a = Tensor::zeros({2, 5, 0}, dt, Device::cpu()), b = Tensor::zeros({2, 0, 7}, dt, Device::cpu());
        Tensor c = test::random_tensor({2, 5, 7}, DType::f32, 3), g = test::random_tensor({5, 5}, DType::f32, 4);
        ops::syrk(cs, test::random_tensor({5, 3}, DType::f32, 5), false, g);  // symmetric, as syrk's beta needs
        cs.synchronize();
        const Tensor cg = c.to(Device::cuda(0)), gg = g.to(Device::cuda(0));
        ops::gemm(cs, a, false, b, false, c, 1.f, beta);
        ops::gemm(gs, a.to(Device::cuda(0)), false, b.to(Device::cuda(0)), false, cg, 1.f, beta);
        ops::syrk(cs, a.select(0, 0), false, g, 1.f, beta);
        ops::syrk(gs, a.select(0, 0).to(Device::cuda(0)), false, gg, 1.f, beta);
        ops::syrk(gs, a.select(0, 0).to(Device::cuda(0)), true, Tensor::zeros({0, 0}, DType::f32, Device::cuda(0)));
        ops::gemm(gs, Tensor::zeros({2, 0, 4}, dt, Device::cuda(0)), false,
                  test::random_tensor({2, 4, 3}, dt, 6).to(Device::cuda(0)), false,
                  Tensor::zeros({2, 0, 3}, DType::f32, Device::cuda(0)));
        cs.synchronize();
        gs.synchronize();
        CHECK(compare("k == 0 gemm", cg.to_float_vector(), c.to_float_vector()).max_abs == 0.0);
        CHECK(compare("k == 0 syrk", gg.to_float_vector(), g.to_float_vector()).max_abs == 0.0);
      }
  }

  TEST_CASE("a failed CUDA call is reported once: the next op does not throw its error again") {
    Stream gs(Device::cuda(0));
    // More than any GPU holds: cudaMallocAsync fails (a non-sticky error).
    CHECK_THROWS_AS(Tensor::empty({int64_t(1) << 50}, DType::f32, Device::cuda(0), &gs), Error);
    const Tensor x = test::random_tensor({1024}, DType::f32, 6).to(Device::cuda(0));
    CHECK_NOTHROW(ops::scale(gs, x, 0.5f));
    CHECK_NOTHROW(gs.synchronize());
  }

  TEST_CASE("syrk on CUDA: a bf16 Gram matrix of side >= 4096 as 2 x 2 blocks, close to the CPU and exactly symmetric") {
    Stream gs(Device::cuda(0)), cs(Device::cpu());
    // 4100: blocks of 2048 and 2052 rows; both orientations; with alpha and beta (c symmetric).
    for (bool trans : {false, true}) {
      CAPTURE(trans);
      const Tensor a = test::random_tensor(trans ? Shape{2, 48, 4100} : Shape{2, 4100, 48}, DType::bf16, 6);
      Tensor c0 = Tensor::zeros({2, 4100, 4100}, DType::f32, Device::cpu());
      ops::syrk(cs, test::random_tensor({2, 4100, 8}, DType::f32, 7), false, c0);  // a symmetric start for beta
      cs.synchronize();
      Tensor c_cpu = c0.clone(), c_gpu = c0.to(Device::cuda(0));
      ops::syrk(cs, a, trans, c_cpu, 0.5f, 0.25f);
      ops::syrk(gs, a.to(Device::cuda(0)), trans, c_gpu, 0.5f, 0.25f);
      Tensor c_bf16 = Tensor::zeros({2, 4100, 4100}, DType::bf16, Device::cuda(0));
      ops::syrk(gs, a.to(Device::cuda(0)), trans, c_bf16);
      cs.synchronize();
      gs.synchronize();
      CHECK(compare("cuda blocked syrk bf16", c_gpu.to_float_vector(), c_cpu.to_float_vector()).max_abs < 1e-3);
      const Tensor host = c_bf16.to(Device::cpu());
      CHECK(test::same_bits(host, host.transpose(1, 2).clone()));
    }
  }

  TEST_CASE("the CUDA allocator counts and release/restore frees device bytes") {
    const MemoryStats before = memory_stats(Device::cuda(0));
    Tensor t = Tensor::zeros({1 << 20}, DType::f32, Device::cuda(0));
    CHECK(memory_stats(Device::cuda(0)).current_bytes == before.current_bytes + (4u << 20));
    t.storage()->release();
    CHECK(memory_stats(Device::cuda(0)).current_bytes == before.current_bytes);
    t.storage()->restore();
    CHECK(memory_stats(Device::cuda(0)).current_bytes == before.current_bytes + (4u << 20));
  }

  TEST_CASE("events order a copy stream after a compute stream") {
    Stream compute(Device::cuda(0)), copy(Device::cuda(0));
    Event done(Device::cuda(0));
    Tensor a = test::random_tensor({512, 512}, DType::f32, 6).to(Device::cuda(0));
    Tensor c = Tensor::zeros({512, 512}, DType::f32, Device::cuda(0));
    Tensor host = Tensor::zeros({512, 512}, DType::f32, Device::cpu());
    ops::gemm(compute, a, false, a, false, c);
    done.record(compute);
    copy.wait(done);
    ops::copy(copy, c, host);
    copy.synchronize();
    Tensor want = Tensor::zeros({512, 512}, DType::f32, Device::cpu());
    Stream cs(Device::cpu());
    ops::gemm(cs, a.to(Device::cpu()), false, a.to(Device::cpu()), false, want);
    cs.synchronize();
    CHECK(compare("cuda ordered copy", host.to_float_vector(), want.to_float_vector()).max_abs < 1e-3);
  }

  TEST_CASE("every elementwise and fused op: CUDA equals the CPU bitwise (all dtypes, NaN, inf, subnormals)") {
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    const int64_t n = 100003;  // odd: a partial last block
    std::vector<float> a = test::random_values(size_t(n), 11), b = test::random_values(size_t(n), 12);
    const float special[] = {nan, inf, -inf, 0.f, -0.f, 1e-40f, -1e-40f, 65504.f, 70000.f, 3.3895e38f, 1e-7f};
    for (size_t i = 0; i < 11; ++i) a[i] = special[i], b[5 * i] = special[i];
    std::vector<float> abs_a = a;  // second moments are never negative
    for (float& v : abs_a) v = std::fabs(v);
    Stream cs(Device::cpu()), gs(Device::cuda(0));
    auto both = [&](auto&& op, std::vector<Tensor> cpu) {  // runs op on CPU tensors and on their copies on the GPU
      std::vector<Tensor> gpu;
      for (const Tensor& t : cpu) gpu.push_back(t.to(Device::cuda(0)));
      op(cs, cpu);
      op(gs, gpu);
      cs.synchronize();
      gs.synchronize();
      bool same = true;
      for (size_t i = 0; i < cpu.size(); ++i) same = same && test::same_bits_or_both_nan(cpu[i], gpu[i].to(Device::cpu()));
      return same;
    };
    for (DType xd : {DType::f32, DType::bf16, DType::f16})
      for (DType yd : {DType::f32, DType::bf16, DType::f16}) {
        CAPTURE(dtype_name(xd));
        CAPTURE(dtype_name(yd));
        const Tensor x = Tensor::from_floats(a, {n}, xd), y = Tensor::from_floats(b, {n}, yd);
        CHECK(both([](Stream& s, std::vector<Tensor>& t) { ops::axpby(s, 0.75f, t[0], -1.5f, t[1]); }, {x, y.clone()}));
        CHECK(both([](Stream& s, std::vector<Tensor>& t) { ops::axpby(s, 0.75f, t[0], 0.f, t[1]); }, {x, y.clone()}));
        CHECK(both([](Stream& s, std::vector<Tensor>& t) { ops::lerp(s, t[1], t[0], 0.3f); }, {x, y.clone()}));
        CHECK(both([](Stream& s, std::vector<Tensor>& t) { ops::lerp(s, t[1], t[0], 0.7f); }, {x, y.clone()}));
        CHECK(both([](Stream& s, std::vector<Tensor>& t) { ops::cast(s, t[0], t[1]); }, {x, y.clone()}));
        // Muon momentum: grad xd, buffer and update yd.
        CHECK(both([](Stream& s, std::vector<Tensor>& t) { ops::muon_momentum(s, t[0], t[1], t[2], 0.95f, 0.9f, true); },
                   {x, y.clone(), Tensor::zeros({n}, yd, Device::cpu())}));
        // AdamW: param yd, grad xd, f32 state, with and without amsgrad.
        ops::AdamWScalars k;
        k.decay = 0.999f;
        k.bias_correction2_sqrt = 0.3f;
        k.neg_step_size = -0.01f;
        for (bool amsgrad : {false, true})
          CHECK(both([&](Stream& s, std::vector<Tensor>& t) { ops::adamw_update(s, t[0], t[1], t[2], t[3], amsgrad ? t[4] : Tensor(), k); },
                     {y.clone(), x, Tensor::from_floats(b, {n}), Tensor::from_floats(abs_a, {n}), Tensor::from_floats(abs_a, {n})}));
      }
    // 7 matrices of 6 x 2381 (6 * 2381 = n / 7), one norm each.
  const Tensor x = Tensor::from_floats(std::vector<float>(a.begin(), a.begin() + 7 * (n / 7)), {7, 6, n / 42}, DType::f32);
    Tensor norms = Tensor::from_floats({1.f, 2.f, nan, 0.f, 1e-30f, inf, 3.f}, {7});
    CHECK(both([](Stream& s, std::vector<Tensor>& t) { ops::scale_by_inverse_norm(s, t[0], t[1], 1e-7f); }, {x.clone(), norms}));
  }

  TEST_CASE("adamw_update_many on CUDA equals the CPU bitwise: 96 tensors of every kind, lists and chunks overflowing") {
    // More tensors of one kind than a launch's list holds (24) and more chunks than its blocks
    // (320 of 16384 elements), sizes around the chunk and the vector width; every fifth tensor's
    // buffers are views one element off 16-byte alignment (the kernel's one-at-a-time path), and
    // some tensors have only their grad or only max_exp_avg_sq off (each buffer decides).
    const int64_t sizes[] = {1, 7, 8, 9, 16383, 16384, 16385, 100003, 2000000};
    Stream cs(Device::cpu()), gs(Device::cuda(0));
    auto on_gpu = [&](const Tensor& cpu, bool misaligned) {
      if (!misaligned) return cpu.to(Device::cuda(0));
      const Tensor big = Tensor::zeros({cpu.numel() + 1}, cpu.dtype(), Device::cuda(0));
      const Tensor view = big.narrow(0, 1, cpu.numel()).view(cpu.shape());
      ops::copy(gs, cpu.to(Device::cuda(0)), view);
      return view;
    };
    std::vector<ops::AdamWUpdate> cpu, gpu;
    const std::array dtypes{DType::f32, DType::bf16, DType::f16};
    for (int i = 0; i < 96; ++i) {
      const int64_t n = sizes[size_t(i) % 9];
      // The first 60 of one kind (f32 param and grad, no amsgrad: three lists, six 2M-element
      // tensors of 123 chunks each), the last 36 over all eighteen kinds, twice.
      const int kind = i < 60 ? 0 : i % 18;
      const DType pd = dtypes[size_t(kind % 3)], gd = dtypes[size_t(kind / 3 % 3)];
      const bool amsgrad = kind >= 9, misaligned = i % 5 == 0;
      ops::AdamWUpdate c;
      c.param = test::random_tensor({n}, pd, uint32_t(5 * i + 1));
      c.grad = test::random_tensor({n}, gd, uint32_t(5 * i + 2));
      c.exp_avg = test::random_tensor({n}, DType::f32, uint32_t(5 * i + 3));
      c.exp_avg_sq = test::random_tensor({n}, DType::f32, uint32_t(5 * i + 4));
      for (int64_t e = 0; e < n; ++e) c.exp_avg_sq.data<float>()[e] = std::fabs(c.exp_avg_sq.data<float>()[e]);
      if (amsgrad) c.max_exp_avg_sq = c.exp_avg_sq.clone();
      c.scalars.decay = 1.f - 1e-4f * float(i);
      c.scalars.bias_correction2_sqrt = 0.3f;
      c.scalars.neg_step_size = -0.01f / float(1 + i);
      ops::AdamWUpdate g = c;
      for (Tensor* t : {&g.param, &g.grad, &g.exp_avg, &g.exp_avg_sq, &g.max_exp_avg_sq})
        if (t->defined()) *t = on_gpu(*t, misaligned);
      if (i % 5 == 1) g.grad = on_gpu(c.grad, true);  // only the grad off alignment
      if (i % 5 == 2 && amsgrad) g.max_exp_avg_sq = on_gpu(c.max_exp_avg_sq, true);
      cpu.push_back(c);
      gpu.push_back(g);
    }
    gs.synchronize();
    ops::adamw_update_many(cs, cpu);
    ops::adamw_update_many(gs, gpu);
    cs.synchronize();
    gs.synchronize();
    size_t differ = 0;
    for (size_t i = 0; i < cpu.size(); ++i)
      for (auto member : {&ops::AdamWUpdate::param, &ops::AdamWUpdate::exp_avg, &ops::AdamWUpdate::exp_avg_sq,
                          &ops::AdamWUpdate::max_exp_avg_sq})
        if ((cpu[i].*member).defined() && !test::same_bits_or_both_nan(cpu[i].*member, (gpu[i].*member).to(Device::cpu()))) ++differ;
    CHECK(differ == 0);
  }

  TEST_CASE("vector and one-at-a-time kernels give the same bits: every op on views one element off 16-byte alignment") {
    // The kernels take 8 elements at a time when every buffer is 16-byte aligned and one at a
    // time otherwise; a view that starts one element into its buffer takes the second path.
    Stream gs(Device::cuda(0));
    const int64_t rows = 5, cols = 1609, n = rows * cols;  // 8045: 1005 vectors and a tail of 5
    auto aligned = [&](const Tensor& cpu) { return cpu.to(Device::cuda(0)); };
    auto misaligned = [&](const Tensor& cpu) {
      const Tensor big = Tensor::zeros({cpu.numel() + 1}, cpu.dtype(), Device::cuda(0));
      const Tensor view = big.narrow(0, 1, cpu.numel()).view(cpu.shape());
      ops::copy(gs, cpu.to(Device::cuda(0)), view);
      return view;
    };
    auto run = [&](auto&& op, const std::vector<Tensor>& cpu, auto&& place) {
      std::vector<Tensor> t;
      for (const Tensor& c : cpu) t.push_back(place(c));
      op(gs, t);
      gs.synchronize();
      std::vector<Tensor> out;
      for (const Tensor& g : t) out.push_back(g.to(Device::cpu()));
      return out;
    };
    auto same = [&](auto&& op, const std::vector<Tensor>& cpu) {
      const std::vector<Tensor> a = run(op, cpu, aligned), b = run(op, cpu, misaligned);
      bool equal = true;
      for (size_t i = 0; i < a.size(); ++i) equal = equal && test::same_bits_or_both_nan(a[i], b[i]);
      return equal;
    };
    for (DType xd : {DType::f32, DType::bf16, DType::f16})
      for (DType yd : {DType::f32, DType::bf16, DType::f16}) {
        CAPTURE(dtype_name(xd));
        CAPTURE(dtype_name(yd));
        const Tensor x = test::random_tensor({rows, cols}, xd, 21), y = test::random_tensor({rows, cols}, yd, 22);
        const Tensor f1 = test::random_tensor({rows, cols}, DType::f32, 23), f2 = test::random_tensor({rows, cols}, DType::f32, 24);
        Tensor v = f2.clone();
        for (int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::fabs(v.data<float>()[i]);  // second moments
        CHECK(same([](Stream& s, std::vector<Tensor>& t) { ops::axpby(s, 0.5f, t[0], -2.f, t[1]); }, {x, y}));
        CHECK(same([](Stream& s, std::vector<Tensor>& t) { ops::lerp(s, t[1], t[0], 0.3f); }, {x, y}));
        CHECK(same([](Stream& s, std::vector<Tensor>& t) { ops::cast(s, t[0], t[1]); }, {x, y}));
        CHECK(same([](Stream& s, std::vector<Tensor>& t) { ops::muon_momentum(s, t[0], t[1], t[2], 0.95f, 0.9f, true); },
                   {x, y, Tensor::zeros({rows, cols}, xd, Device::cpu())}));
        ops::AdamWScalars k;
        k.decay = 0.999f;
        k.bias_correction2_sqrt = 0.3f;
        k.neg_step_size = -0.01f;
        for (bool amsgrad : {false, true})
          CHECK(same([&](Stream& s, std::vector<Tensor>& t) { ops::adamw_update(s, t[0], t[1], t[2], t[3], amsgrad ? t[4] : Tensor(), k); },
                     {y, x, f1, v, v}));
      }
    // Norms over several slices of a matrix: 16800 elements (a multiple of 8, so the aligned
    // launch reads vectors) and 16867 (never vectors, the last group padded with zeros).
    for (DType xd : {DType::f32, DType::bf16, DType::f16})
      for (const Shape& shape : {Shape{3, 100, 168}, Shape{3, 101, 167}}) {
        CAPTURE(dtype_name(xd));
        CAPTURE(shape_str(shape));
        const Tensor x = test::random_tensor(shape, xd, 25);
        CHECK(same([&](Stream& s, std::vector<Tensor>& t) { ops::frobenius_norm(s, t[0], t[1]); },
                   {x, Tensor::zeros({3}, DType::f32, Device::cpu())}));
        CHECK(same([&](Stream& s, std::vector<Tensor>& t) { ops::scale_by_inverse_norm(s, t[0], t[1], 1e-7f); },
                   {x, Tensor::from_floats({1.f, 2.f, 0.5f}, {3})}));
      }
    for (DType xd : {DType::f32, DType::bf16, DType::f16}) {
      CAPTURE(dtype_name(xd));
      const Tensor x = test::random_tensor({rows, cols}, xd, 25);
      CHECK(same([&](Stream& s, std::vector<Tensor>& t) { ops::flag_nonfinite(s, t[0], t[1]); },
                 {x, Tensor::zeros({1}, DType::f32, Device::cpu())}));
    }
  }

  TEST_CASE("the norm of one 4096x4096 matrix (spread over many blocks): close to the CPU's, the same bits every run") {
    Stream cs(Device::cpu()), gs(Device::cuda(0));
    const Tensor x = test::random_tensor({1, 4096, 4096}, DType::bf16, 26), xg = x.to(Device::cuda(0));
    Tensor n_cpu = Tensor::zeros({1}, DType::f32, Device::cpu());
    Tensor first = Tensor::zeros({1}, DType::f32, Device::cuda(0)), second = Tensor::zeros({1}, DType::f32, Device::cuda(0));
    ops::frobenius_norm(cs, x, n_cpu);
    ops::frobenius_norm(gs, xg, first);
    ops::frobenius_norm(gs, xg, second);
    cs.synchronize();
    gs.synchronize();
    CHECK(test::same_bits(first.to(Device::cpu()), second.to(Device::cpu())));
    CHECK(compare("cuda norm of 4096x4096", first.to_float_vector(), n_cpu.to_float_vector()).max_rel < 1e-5);
  }

  TEST_CASE("launch shapes: more matrices than the norm kernel's blocks (each block loops over several)") {
    Stream cs(Device::cpu()), gs(Device::cuda(0));
    const int64_t count = 1100000;  // > 1048560 blocks
    const Tensor x = test::random_tensor({count, 1, 2}, DType::f32, 14);
    Tensor n_cpu = Tensor::zeros({count}, DType::f32, Device::cpu()), n_gpu = Tensor::zeros({count}, DType::f32, Device::cuda(0));
    ops::frobenius_norm(cs, x, n_cpu);
    ops::frobenius_norm(gs, x.to(Device::cuda(0)), n_gpu);
    cs.synchronize();
    gs.synchronize();
    CHECK(compare("cuda norms of 1.1M matrices", n_gpu.to_float_vector(), n_cpu.to_float_vector()).max_rel < 1e-6);
  }

  TEST_CASE("launch shapes: more than 65535 matrices (norms, normalisation, SYRK mirror)") {
    Stream cs(Device::cpu()), gs(Device::cuda(0));
    const int64_t count = 70000;
    const Tensor x = test::random_tensor({count, 3, 4}, DType::f32, 13);
    Tensor n_cpu = Tensor::zeros({count}, DType::f32, Device::cpu()), n_gpu = Tensor::zeros({count}, DType::f32, Device::cuda(0));
    ops::frobenius_norm(cs, x, n_cpu);
    const Tensor xg = x.to(Device::cuda(0));
    ops::frobenius_norm(gs, xg, n_gpu);
    cs.synchronize();  // n_cpu is read below
    Tensor y = x.clone(), yg = x.to(Device::cuda(0));
    ops::scale_by_inverse_norm(cs, y, n_cpu, 1e-7f);
    ops::scale_by_inverse_norm(gs, yg, n_cpu.to(Device::cuda(0)), 1e-7f);
    Tensor s_cpu = Tensor::zeros({count, 3, 3}, DType::f32, Device::cpu()), s_gpu = Tensor::zeros({count, 3, 3}, DType::f32, Device::cuda(0));
    ops::syrk(cs, x, false, s_cpu);
    ops::syrk(gs, xg, false, s_gpu);
    cs.synchronize();
    gs.synchronize();
    CHECK(compare("cuda norms of 70000 matrices", n_gpu.to_float_vector(), n_cpu.to_float_vector()).max_rel < 1e-5);
    CHECK(test::same_bits(yg.to(Device::cpu()), y));  // same norms in: the same bits out
    const std::vector<float> sg = s_gpu.to_float_vector();
    size_t asymmetric = 0;
    for (int64_t m = 0; m < count; ++m)
      for (int64_t i = 0; i < 3; ++i)
        for (int64_t j = 0; j < 3; ++j) asymmetric += sg[size_t(m * 9 + i * 3 + j)] != sg[size_t(m * 9 + j * 3 + i)];
    CHECK(asymmetric == 0);
    CHECK(compare("cuda syrk of 70000 matrices", sg, s_cpu.to_float_vector()).max_abs < 1e-5);
  }

  TEST_CASE("a borrowed cudaStream_t: ops run on it, and dropping the wrapper leaves the owner's stream usable") {
    Stream owner(Device::cuda(0));
    const Tensor a = test::random_tensor({64, 64}, DType::f32, 21);
    Tensor c = Tensor::zeros({64, 64}, DType::f32, Device::cuda(0));
    {
      Stream borrowed = Stream::borrow(owner.native_handle(), Device::cuda(0));
      CHECK(borrowed.native_handle() == owner.native_handle());
      ops::gemm(borrowed, a.to(Device::cuda(0)), false, a.to(Device::cuda(0)), true, c);
    }
    ops::scale(owner, c, 2.f);  // ordered after the borrowed stream's GEMM: the same queue
    owner.synchronize();
    Tensor want = Tensor::zeros({64, 64}, DType::f32, Device::cpu());
    Stream cs(Device::cpu());
    ops::gemm(cs, a, false, a, true, want, 2.f);
    cs.synchronize();
    CHECK(compare("borrowed stream gemm", c.to_float_vector(), want.to_float_vector()).max_abs < 1e-3);
  }

  TEST_CASE("flag_nonfinite on CUDA agrees with the CPU: NaN and inf anywhere in 3M values, every dtype") {
    Stream cs(Device::cpu()), gs(Device::cuda(0));
    for (DType dtype : {DType::f32, DType::bf16, DType::f16})
      for (int64_t bad_at : {int64_t(-1), int64_t(0), int64_t(1234567), int64_t(2999999)}) {
        CAPTURE(dtype_name(dtype));
        CAPTURE(bad_at);
        std::vector<float> v = test::random_values(3000000, 61);
        if (bad_at >= 0) v[size_t(bad_at)] = bad_at % 2 ? std::nanf("") : -std::numeric_limits<float>::infinity();
        const Tensor x = Tensor::from_floats(v, {3000000}, dtype);
        const Tensor cpu_flag = Tensor::zeros({1}, DType::f32, Device::cpu());
        const Tensor gpu_flag = Tensor::zeros({1}, DType::f32, Device::cuda(0));
        ops::flag_nonfinite(cs, x, cpu_flag);
        ops::flag_nonfinite(gs, x.to(Device::cuda(0)), gpu_flag);
        cs.synchronize();
        gs.synchronize();
        CHECK(gpu_flag.to_float_vector()[0] == cpu_flag.to_float_vector()[0]);
        CHECK(cpu_flag.to_float_vector()[0] == (bad_at >= 0 ? 1.f : 0.f));
      }
  }

#if SWAPOPT_TEST_CUDA_RUNTIME
  TEST_CASE("a borrowed non-blocking cudaStream_t (as PyTorch makes them): a swapped step on it equals the bare one") {
    cudaStream_t raw = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking) == cudaSuccess);
    {
      Stream trainer = Stream::borrow(raw, Device::cuda(0));
      CHECK(swapped_muon_equals_bare(Stream(Device::cuda(0)), trainer, {80, 48}, 31));
    }
    REQUIRE(cudaStreamDestroy(raw) == cudaSuccess);
  }

  TEST_CASE("a set's members on two borrow() wrappers of one cudaStream_t share its queue: the set takes them") {
    cudaStream_t raw = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking) == cudaSuccess);
    {
      std::vector<ParamPtr> params = test::muon_adamw_model();
      for (ParamPtr& p : params) p->data = p->data.to(Device::cuda(0));
      Muon muon(Stream::borrow(raw, Device::cuda(0)));
      AdamW adamw(Stream::borrow(raw, Device::cuda(0)));
      muon.add_param_group({params[1], params[3]});
      adamw.add_param_group({params[0], params[2]});
      std::vector<std::pair<std::string, std::unique_ptr<SwapOptimizer>>> members;
      members.emplace_back("muon", swap_muon(muon));
      members.emplace_back("adamw", swap_adamw(adamw));
      CHECK_NOTHROW(SwapOptimizerSet(std::move(members)));
    }
    REQUIRE(cudaStreamDestroy(raw) == cudaSuccess);
  }

  TEST_CASE("a thread with no CUDA context keeps none after swapopt's ops, and its selected device is untouched") {
    void* get_current = nullptr;
    cudaDriverEntryPointQueryResult found{};
    REQUIRE(cudaGetDriverEntryPointByVersion("cuCtxGetCurrent", &get_current, 12000, cudaEnableDefault, &found) == cudaSuccess);
    REQUIRE(found == cudaDriverEntryPointSuccess);
    const auto ctx_get_current = reinterpret_cast<PFN_cuCtxGetCurrent_v4000>(get_current);
    Stream s(Device::cuda(0));
    const Tensor x = test::random_tensor({64, 64}, DType::f32, 41).to(Device::cuda(0));
    CUcontext before = reinterpret_cast<CUcontext>(1), after = reinterpret_cast<CUcontext>(1);
    std::thread fresh([&] {  // a new thread has no current context
      (void)ctx_get_current(&before);
      {
        Tensor y = Tensor::empty({64, 64}, DType::f32, Device::cuda(0), &s);
        ops::copy(s, x, y);
        ops::scale(s, y, 0.5f);
        s.synchronize();
      }  // and the free
      (void)ctx_get_current(&after);
    });
    fresh.join();
    CHECK(before == nullptr);
    CHECK(after == nullptr);
  }
#endif

  TEST_CASE("a device other than 0 (two GPUs visible): ops, swap and the caller's current device" *
            doctest::skip(cuda_device_count() < 2)) {
    use_device(Device::cuda(1));
    CHECK(swapped_muon_equals_bare(Stream(Device::cuda(1)), Stream(Device::cuda(1)), {96, 64}, 22));
    use_device(Device::cuda(0));
    // to() from one GPU to the other, contiguous and strided (it runs on the source's stream).
    const Tensor host = test::random_tensor({20, 12}, DType::f32, 23);
    const Tensor on_0 = host.to(Device::cuda(0));
    CHECK(test::same_bits(on_0.to(Device::cuda(1)).to(Device::cpu()), host));
    CHECK(test::same_bits(on_0.narrow(1, 2, 7).to(Device::cuda(1)).to(Device::cpu()), host.narrow(1, 2, 7).clone()));
  }

  TEST_CASE("swapped equals bare bitwise on CUDA (packed, unpacked, prefetch_early, chunked units), and the same run twice gives the same bits") {
    const Device gpu = Device::cuda(0);
    // Eight Muon matrices of distinct shapes (eight units) and one AdamW param (the last): at
    // swap_times 5 the packed ring reuses an arena and the unpacked load waits for an offload.
    const std::vector<Shape> shapes = {{256, 192}, {192, 256}, {4, 128, 96}, {320, 192},
                                       {96, 512},  {128, 128}, {512, 64},    {200, 300}, {64, 64}};
    for (int times : {2, 5}) {
      CAPTURE(times);
      auto make_params = [&] {
        std::vector<ParamPtr> out;
        for (size_t i = 0; i < shapes.size(); ++i)
          out.push_back(make_param(std::to_string(i), test::random_tensor(shapes[i], DType::f32, 40 + uint32_t(i), gpu)));
        return out;
      };
      // Runs 4 steps (a grad missing at step 3) and returns every param's and state tensor's bytes.
      // 0 bare, 1 packed, 2 unpacked, 3 packed with prefetch_early; 4 packed and 5 unpacked with
      // prefetch_early under device budgets that chunk the largest units.
      auto run = [&](int mode) {
        std::vector<ParamPtr> params = make_params();
        Muon muon{Stream(gpu)};
        muon.add_param_group(std::vector<ParamPtr>(params.begin(), params.end() - 1));
        AdamW adamw{muon.stream()};
        adamw.add_param_group({params.back()});
        SwapConfig config;
        config.swap_times = times;
        config.min_numel = 1;
        config.packed = mode != 2 && mode != 5;
        SwapConfig adamw_config = config;
        if (mode >= 4) {
          int64_t workspace = 0;
          for (const UpdateUnit& u : MuonSwapAdapter(muon).plan_units(true)) workspace = std::max(workspace, u.workspace_bytes);
          config.device_budget_bytes = size_t(workspace) + 64 * 1024;  // below a 256x192 f32 momentum (192 KiB)
          adamw_config.device_budget_bytes = 8 * 1024;                  // below its 32 KiB of moments
        }
        std::unique_ptr<SwapOptimizer> sm = mode ? swap_muon(muon, config) : nullptr;
        std::unique_ptr<SwapOptimizer> sa = mode ? swap_adamw(adamw, adamw_config) : nullptr;
        for (int step = 1; step <= 4; ++step) {
          if (mode == 3 || mode == 5) sm->prefetch_early();
          for (size_t i = 0; i < params.size(); ++i) {
            const uint32_t seed = 500 + uint32_t(10 * step + int(i));
            params[i]->grad = (step == 3 && i == 0) ? Tensor() : test::random_tensor(shapes[i], DType::f32, seed, gpu);
          }
          if (mode) {
            sm->step();
            sa->step();
          } else {
            muon.step();
            adamw.step();
          }
        }
        if (mode == 1 || mode == 2) {
          sm->synchronize();
          CHECK(sm->last_report().batches == std::min(times, 8));
        }
        std::string bytes;
        for (const ParamPtr& p : params) {
          const Tensor h = p->data.to(Device::cpu());
          bytes.append(static_cast<const char*>(h.data_ptr()), h.nbytes());
        }
        bytes += serialize_state_dict(mode ? sm->state_dict() : muon.state_dict());
        bytes += serialize_state_dict(mode ? sa->state_dict() : adamw.state_dict());
        return bytes;
      };
      const std::string bare = run(0);
      CHECK(run(0) == bare);  // deterministic: the same bits twice
      for (int mode : {1, 2, 3, 4, 5}) {
        CAPTURE(mode);
        CHECK(run(mode) == bare);
      }
    }
  }
}
