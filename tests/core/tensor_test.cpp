#include <limits>
#include <sstream>

#include "test_util.h"

using namespace swapopt;

TEST_CASE("contiguous tensors: shape, strides, views share storage") {
  Tensor t = Tensor::zeros({3, 4}, DType::f32, Device::cpu());
  CHECK(t.strides() == Shape{4, 1});
  CHECK(t.is_contiguous());
  CHECK(t.nbytes() == 48);
  Tensor v = t.view({2, -1});
  CHECK(v.shape() == Shape{2, 6});
  v.data<float>()[5] = 7.f;
  CHECK(t.data<float>()[5] == 7.f);
  CHECK_THROWS_WITH_AS(t.view({5, -1}), "[Tensor::view] cannot view Tensor(f32, [3, 4], cpu) as [5, -1]", Error);
}

TEST_CASE("transpose, narrow, block and select make strided views") {
  Tensor t = Tensor::from_floats({0, 1, 2, 3, 4, 5}, {2, 3});
  Tensor tt = t.transpose(0, 1);
  CHECK(tt.shape() == Shape{3, 2});
  CHECK(tt.strides() == Shape{1, 3});
  CHECK_FALSE(tt.is_contiguous());
  CHECK(tt.to_float_vector() == std::vector<float>{0, 3, 1, 4, 2, 5});
  Tensor col = t.narrow(1, 1, 2);
  CHECK(col.offset() == 1);
  CHECK(col.to_float_vector() == std::vector<float>{1, 2, 4, 5});
  Tensor row = t.select(0, 1);
  CHECK(row.shape() == Shape{3});
  CHECK(row.to_float_vector() == std::vector<float>{3, 4, 5});
  CHECK_THROWS_WITH_AS(tt.view({6}), "[Tensor::view] Tensor(f32, [3, 2], cpu) is not contiguous", Error);
  CHECK_THROWS_WITH_AS(Tensor().view({1}), "[Tensor::view] undefined tensor", Error);  // it gave an undefined view
  CHECK_THROWS_WITH_AS(t.narrow(1, 2, 2), "[Tensor::narrow] range [2, 4) out of dim 1 of Tensor(f32, [2, 3], cpu)", Error);
  CHECK_THROWS_WITH_AS(t.select(2, 0), "[Tensor::select] dim 2 out of range for 2-D tensor", Error);
  Tensor corner = t.block({1, 1}, {1, 2});
  CHECK(corner.offset() == 4);
  CHECK(corner.to_float_vector() == std::vector<float>{4, 5});
  CHECK_THROWS_WITH_AS(t.block({0}, {1}), "[Tensor::block] offset [0] and shape [1] for Tensor(f32, [2, 3], cpu)", Error);
}

TEST_CASE("sizes that overflow an int64 are named errors, never a view outside its storage") {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const MemoryStats before = memory_stats(Device::cpu());
  CHECK_THROWS_WITH_AS(Tensor::empty({kMax / 2, 4}, DType::f32, Device::cpu()),
                       "[Tensor::empty] shape [4611686018427387903, 4] of f32 is too large", Error);
  CHECK_THROWS_WITH_AS(Tensor::empty({kMax / 2 + 1}, DType::bf16, Device::cpu()),
                       "[Tensor::empty] shape [4611686018427387904] of bf16 is too large", Error);
  CHECK(memory_stats(Device::cpu()).current_bytes == before.current_bytes);
  const Tensor t = Tensor::zeros({2, 4}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(
      t.narrow(0, kMax, 1),
      "[Tensor::narrow] range [9223372036854775807, beyond int64) out of dim 0 of Tensor(f32, [2, 4], cpu)", Error);
  CHECK_THROWS_WITH_AS(t.narrow(1, 1, kMax),
                       "[Tensor::narrow] range [1, beyond int64) out of dim 1 of Tensor(f32, [2, 4], cpu)", Error);
  CHECK(t.narrow(1, 4, 0).numel() == 0);  // an empty range at the end is fine
  CHECK_THROWS_WITH_AS(t.view({kMax, 2, 0}),
                       "[Tensor::view] cannot view Tensor(f32, [2, 4], cpu) as [9223372036854775807, 2, 0]", Error);
  float one = 0.f;
  CHECK_THROWS_WITH_AS(Tensor::from_blob(&one, {2, 2}, {kMax / 2, 1}, DType::f32, Device::cpu()),
                       "[Tensor::from_blob] strides [4611686018427387903, 1] for shape [2, 2] are too large", Error);
  // Strides past int64 (built before any check, so they must not overflow; UBSan sees it).
  CHECK_THROWS_WITH_AS(Tensor::from_blob(&one, {kMax / 2, kMax / 2}, DType::f32, Device::cpu()),
                       "[Tensor::from_blob] shape [4611686018427387903, 4611686018427387903] of f32 is too large",
                       Error);
  const Shape no_elements{0, int64_t(1) << 40, int64_t(1) << 40};
  CHECK(contiguous_strides(no_elements) == Shape{kMax, int64_t(1) << 40, 1});
  const Tensor none = Tensor::empty(no_elements, DType::f32, Device::cpu());
  CHECK((none.numel() == 0 && none.is_contiguous()));
  CHECK(Tensor::zeros({3, 0}, DType::f32, Device::cpu()).transpose(0, 1).is_contiguous());  // no elements: as torch
  // An empty range past a size-1 dim of any stride leaves the offset where it was (the product
  // start x stride would overflow; UBSan sees it).
  float four[4] = {1.f, 2.f, 3.f, 4.f};
  const Tensor row = Tensor::from_blob(four, {1, 4}, {kMax, 1}, DType::f32, Device::cpu());
  const Tensor past = row.narrow(0, 1, 0);
  CHECK((past.numel() == 0 && past.offset() == 0 && past.data_ptr() == static_cast<void*>(four)));
  CHECK(past.clone().numel() == 0);
  CHECK(test::error_of([] { Tensor().block({}, {}); }) == "[Tensor::block] undefined tensor");
  CHECK(test::error_of([] { Tensor::empty_like(Tensor()); }) ==
        "[Tensor::empty_like] undefined tensor: it has no shape, dtype or device to copy");
  CHECK(test::error_of([] { Tensor::zeros_like(Tensor()); }) ==
        "[Tensor::zeros_like] undefined tensor: it has no shape, dtype or device to copy");
}

TEST_CASE("a device that cannot exist, or a stream of another device, is a named error") {
  CHECK_THROWS_WITH_AS(Tensor::empty({2, 3}, DType::f32, Device{DeviceType::cpu, 1}),
                       "[Tensor] no device cpu index 1 (the CPU is Device::cpu(), index 0)", Error);
  float blob[4] = {};
  CHECK_THROWS_WITH_AS(Tensor::from_blob(blob, {4}, DType::f32, Device{DeviceType::cuda, -1}),
                       "[Tensor] no device cuda index -1", Error);
  // A GPU's stream-ordered memory comes from its stream's device (a CPU stream's handle is no
  // cudaStream_t): refused before any allocator is asked, with or without a GPU.
  Stream cpu_stream(Device::cpu());
  CHECK_THROWS_WITH_AS(
      Tensor::empty({4}, DType::f32, Device::cuda(0), &cpu_stream),
      "[Tensor::empty] memory on cuda:0 ordered on a stream of cpu: give a stream of the same device, or none", Error);
}

TEST_CASE("release and restore are seen by every view of a storage") {
  const MemoryStats before = memory_stats(Device::cpu());
  Tensor t = Tensor::zeros({1024}, DType::f32, Device::cpu());
  Tensor view = t.view({32, 32});
  CHECK(memory_stats(Device::cpu()).current_bytes == before.current_bytes + 4096);
  t.storage()->release();
  CHECK(t.is_released());
  CHECK(view.is_released());
  CHECK(view.nbytes() == 4096);  // a shell keeps its metadata
  CHECK(memory_stats(Device::cpu()).current_bytes == before.current_bytes);
  CHECK_THROWS_WITH_AS(view.data_ptr(), "[Tensor::data_ptr] storage of Tensor(f32, [32, 32], cpu) is released", Error);
  view.storage()->restore();
  CHECK_FALSE(t.is_released());
  CHECK(t.data_ptr() == view.data_ptr());
  CHECK(memory_stats(Device::cpu()).current_bytes == before.current_bytes + 4096);
}

TEST_CASE("from_blob wraps trainer memory without owning it") {
  std::vector<float> owned(12, 1.5f);
  const MemoryStats before = memory_stats(Device::cpu());
  {
    Tensor t = Tensor::from_blob(owned.data(), {3, 4}, DType::f32, Device::cpu());
    CHECK(t.data<float>() == owned.data());
    CHECK_FALSE(t.storage()->owned());
    t.data<float>()[0] = 2.f;
    CHECK_THROWS_WITH_AS(t.storage()->release(),
                         "[Storage::release] cannot release memory swapopt does not own (from_blob)", Error);
    Tensor strided = Tensor::from_blob(owned.data(), {2, 2}, {4, 2}, DType::f32, Device::cpu());
    CHECK(strided.strides() == Shape{4, 2});
    CHECK(memory_stats(Device::cpu()).allocations == before.allocations);
  }
  // Dropping the tensors freed nothing and allocated nothing: the memory is still the caller's.
  CHECK(owned[0] == 2.f);
  CHECK(memory_stats(Device::cpu()).current_bytes == before.current_bytes);
  CHECK(memory_stats(Device::cpu()).frees == before.frees);
  Tensor strided = Tensor::from_blob(owned.data(), {2, 2}, {4, 2}, DType::f32, Device::cpu());
  CHECK(strided.to_float_vector() == std::vector<float>{2.f, 1.5f, 1.5f, 1.5f});
}

TEST_CASE("memory not aligned to its dtype is refused by from_blob and on_storage, which wrap nothing") {
  // The ops load whole elements, on CUDA in 2- to 16-byte accesses that fault when misaligned.
  alignas(16) unsigned char bytes[64] = {};
  void* const odd = bytes + 1;
  std::ostringstream at;
  at << odd;
  CHECK(test::error_of([&] { Tensor::from_blob(odd, {8}, DType::f32, Device::cpu()); }) ==
        "[Tensor::from_blob] pointer " + at.str() + " is not aligned to the 4 bytes of a f32 element");
  CHECK(test::error_of([&] {
          Tensor::from_blob(bytes + 2, {2, 2}, {1, 2}, DType::f32, Device::cpu());
        }).find("is not aligned to the 4 bytes of a f32 element") != std::string::npos);
  CHECK(test::error_of([&] {
          Tensor::from_blob(odd, {8}, DType::bf16, Device::cpu());
        }).find("is not aligned to the 2 bytes of a bf16 element") != std::string::npos);
  CHECK(Tensor::from_blob(bytes + 2, {8}, DType::bf16, Device::cpu()).data_ptr() == bytes + 2);  // aligned for bf16
  const auto storage = std::make_shared<Storage>(odd, 32, Device::cpu());
  CHECK(test::error_of([&] { Tensor::on_storage(storage, 0, {4}, DType::f32); }) ==
        "[Tensor::on_storage] storage at " + at.str() + " is not aligned to the 4 bytes of a f32 element");
}

TEST_CASE("to, clone and from_floats copy values between dtypes and layouts") {
  Tensor t = Tensor::from_floats({1.f, 2.5f, -3.f, 1e-3f}, {2, 2}, DType::bf16);
  CHECK(t.dtype() == DType::bf16);
  Tensor c = t.clone();
  CHECK(c.data_ptr() != t.data_ptr());
  CHECK(test::same_bits(c, t));
  Tensor tt = Tensor::from_floats({0, 1, 2, 3, 4, 5}, {2, 3}).transpose(0, 1).to(Device::cpu());
  CHECK(tt.is_contiguous());
  CHECK(tt.to_float_vector() == std::vector<float>{0, 3, 1, 4, 2, 5});
  CHECK_THROWS_WITH_AS(Tensor::from_floats({1.f}, {2}), "[Tensor::from_floats] 1 values for shape [2]", Error);
  CHECK_THROWS_WITH_AS(Tensor::empty({2, -1}, DType::f32, Device::cpu()), "[Tensor::empty] negative dim in shape [2, -1]", Error);
}

TEST_CASE("CUDA tensors fail with a named error in a build or machine without CUDA" * doctest::skip(!test::no_gpu())) {
  if (!cuda_built()) {
    CHECK_THROWS_WITH_AS(Tensor::empty({4}, DType::f32, Device::cuda(0)),
                         "[cuda] device_allocator: swapopt was built without CUDA (reconfigure with -Dcuda=enabled)", Error);
  } else {
    CHECK_THROWS_WITH_AS(Tensor::empty({4}, DType::f32, Device::cuda(0)), "[cuda] device_allocator: no CUDA device 0 (0 visible)",
                         Error);
  }
}

TEST_CASE("element counts and storage offsets that do not fit are named errors") {
  const int64_t big = int64_t(1) << 32;
  CHECK_THROWS_WITH_AS(shape_numel({big, big}),
                       "[shape] [4294967296, 4294967296] has more elements than an int64 counts", Error);
  CHECK(shape_numel({int64_t(1) << 62, int64_t(1) << 62, 0}) == 0);
  CHECK_THROWS_WITH_AS(Tensor::from_floats({}, {big, big}),
                       "[shape] [4294967296, 4294967296] has more elements than an int64 counts", Error);
  const Tensor t = Tensor::zeros({16}, DType::f32, Device::cpu());
  CHECK_THROWS_WITH_AS(Tensor::on_storage(t.storage(), -1, {1}, DType::f32),
                       "[Tensor::on_storage] offset -1 is negative", Error);
  CHECK_THROWS_WITH_AS(Tensor::on_storage(t.storage(), 17, {1}, DType::f32),
                       "[Tensor::on_storage] offset 17 is past the end of a storage of 16 f32 elements", Error);
  CHECK_THROWS_WITH_AS(Tensor::on_storage(t.storage(), 8, {9}, DType::f32),
                       "[Tensor::on_storage] view [9] at offset 8 needs 68 bytes, storage has 64", Error);
  CHECK(Tensor::on_storage(t.storage(), 16, {0}, DType::f32).numel() == 0);
}

TEST_CASE("a dtype value outside the enum is a named error, not a size of 2 bytes") {
  const auto bad = static_cast<DType>(7);
  float x[4] = {};
  CHECK(test::error_of([&] { Tensor::empty({4}, bad, Device::cpu()); }) ==
        "[Tensor::empty] unknown dtype 7 (f32, bf16 or f16)");
  CHECK(test::error_of([&] { Tensor::from_blob(x, {4}, bad, Device::cpu()); }) ==
        "[Tensor::from_blob] unknown dtype 7 (f32, bf16 or f16)");
  CHECK(test::error_of([&] { parse_state_dict(nullptr, 100); }) == "[checkpoint] null data of 100 bytes");
}
