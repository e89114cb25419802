// CUDA backend against the CPU backend. Skipped (with the reason printed by main) without a device.
#include "test_util.h"

using namespace swapopt;
using test::compare;

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
}
