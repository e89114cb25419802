#include <algorithm>
#include <cstring>
#include <future>
#include <limits>

#include "test_util.h"

using namespace swapopt;

TEST_CASE("device allocator counts current and peak bytes") {
  Allocator& alloc = device_allocator(Device::cpu());
  alloc.reset_peak();
  const MemoryStats s0 = alloc.stats();
  void* a = alloc.allocate(1000, nullptr);
  void* b = alloc.allocate(3000, nullptr);
  CHECK(reinterpret_cast<uintptr_t>(a) % 512 == 0);
  CHECK(alloc.stats().current_bytes == s0.current_bytes + 4000);
  alloc.deallocate(b, 3000, nullptr);
  void* c = alloc.allocate(500, nullptr);
  const MemoryStats s1 = alloc.stats();
  CHECK(s1.current_bytes == s0.current_bytes + 1500);
  CHECK(s1.peak_bytes == s0.current_bytes + 4000);
  CHECK(s1.allocations == s0.allocations + 3);
  CHECK(s1.frees == s0.frees + 1);
  alloc.deallocate(a, 1000, nullptr);
  alloc.deallocate(c, 500, nullptr);
  alloc.reset_peak();
  CHECK(alloc.stats().peak_bytes == s0.current_bytes);
}

TEST_CASE("pinned host memory is counted apart from device memory") {
  const MemoryStats device_before = memory_stats(Device::cpu());
  Allocator& pinned = pinned_host_allocator();
  const MemoryStats pinned_before = pinned.stats();
  {
    Storage s(1 << 20, Device::cpu(), pinned);
    CHECK(pinned.stats().current_bytes == pinned_before.current_bytes + (1 << 20));
    CHECK(memory_stats(Device::cpu()).current_bytes == device_before.current_bytes);
  }
  CHECK(pinned.stats().current_bytes == pinned_before.current_bytes);
}

TEST_CASE("zero-byte allocations are free") {
  Tensor empty = Tensor::zeros({0, 5}, DType::f32, Device::cpu());
  CHECK(empty.numel() == 0);
  CHECK(empty.nbytes() == 0);
  CHECK_FALSE(empty.is_released());
}

TEST_CASE("retain_freed: a freed block of 1 MiB or more is handed out again, uncounted while kept") {
  Allocator& alloc = device_allocator(Device::cpu());
  alloc.retain_freed(size_t(8) << 20);
  const MemoryStats s0 = alloc.stats();
  const size_t bytes = (size_t(3) << 20) + 123;
  auto* first = static_cast<unsigned char*>(alloc.allocate(bytes, nullptr));
  std::memset(first, 0xab, 64);
  alloc.deallocate(first, bytes, nullptr);
  CHECK(alloc.stats().current_bytes == s0.current_bytes);  // the kept block is not counted
  auto* again = static_cast<unsigned char*>(alloc.allocate(bytes, nullptr));
  // The same block with its bytes: free() would have written its bookkeeping over the first bytes
  // of a heap block, and a block mapped afresh comes zeroed.
  CHECK(again == first);
  CHECK(std::all_of(again, again + 64, [](unsigned char b) { return b == 0xab; }));
  CHECK(alloc.stats().current_bytes == s0.current_bytes + bytes);
  alloc.deallocate(again, bytes, nullptr);
}

TEST_CASE("a CPU release without a stream gives the bytes back only after the work queued on every CPU stream") {
  device_allocator(Device::cpu()).retain_freed(size_t(8) << 20);  // a freed block would be handed out again
  const int64_t n = int64_t(1) << 20;                             // 4 MiB of f32
  const Tensor source = Tensor::from_floats(std::vector<float>(size_t(n), 1.f), {n});
  Stream stream(Device::cpu()), other(Device::cpu());
  for (bool made_on_stream : {false, true}) {
    CAPTURE(made_on_stream);
    const Tensor target = Tensor::empty({n}, DType::f32, Device::cpu(), made_on_stream ? &stream : nullptr);
    const MemoryStats before = memory_stats(Device::cpu());
    std::promise<void> open;
    std::shared_future<void> opened = open.get_future().share();
    stream.enqueue([opened] { opened.wait(); });
    ops::copy(stream, source, target);  // queued: it writes target's bytes once the stream runs
    other.enqueue([opened] { opened.wait(); });
    target.storage()->release();
    // Not given back while the copy is queued: a new tensor gets other bytes, the copy cannot
    // write into it.
    CHECK(memory_stats(Device::cpu()).current_bytes == before.current_bytes);
    const Tensor fresh = Tensor::zeros({n}, DType::f32, Device::cpu());
    open.set_value();
    stream.synchronize();
    other.synchronize();
    const std::vector<float> values = fresh.to_float_vector();
    CHECK(std::all_of(values.begin(), values.end(), [](float v) { return v == 0.f; }));
    CHECK(memory_stats(Device::cpu()).current_bytes == before.current_bytes);  // target's bytes back, fresh's taken
  }
  // With every stream idle the bytes go back at once.
  const Tensor idle = Tensor::empty({n}, DType::f32, Device::cpu());
  const MemoryStats before = memory_stats(Device::cpu());
  idle.storage()->release();
  CHECK(memory_stats(Device::cpu()).current_bytes == before.current_bytes - size_t(n) * 4);
}

TEST_CASE("a host allocation too large to round up is refused, not handed a tiny block") {
  // Rounding SIZE_MAX up to a block once wrapped to a few bytes, which a Storage then took for
  // SIZE_MAX bytes.
  Allocator& allocator = device_allocator(Device::cpu());
  const MemoryStats before = allocator.stats();
  for (const size_t nbytes : {std::numeric_limits<size_t>::max(), std::numeric_limits<size_t>::max() - 100,
                              std::numeric_limits<size_t>::max() - (size_t(1) << 20) + 1}) {
    CAPTURE(nbytes);
    CHECK_THROWS_WITH_AS(
        Storage(nbytes, Device::cpu(), allocator),
        (std::string("[allocator] out of host memory allocating ") + std::to_string(nbytes) + " bytes").c_str(), Error);
  }
  CHECK(allocator.stats().allocations == before.allocations);
  CHECK(allocator.stats().current_bytes == before.current_bytes);
}
