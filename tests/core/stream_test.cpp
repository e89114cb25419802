#include <atomic>
#include <chrono>
#include <future>
#include <mutex>
#include <thread>

#include "test_util.h"

using namespace swapopt;

TEST_CASE("a CPU stream runs its queue in order on its own thread") {
  Stream s(Device::cpu());
  std::vector<int> order;
  std::thread::id worker;
  for (int i = 0; i < 100; ++i) s.enqueue([&order, &worker, i] {
      order.push_back(i);
      worker = std::this_thread::get_id();
    });
  s.synchronize();
  REQUIRE(order.size() == 100);
  for (int i = 0; i < 100; ++i) CHECK(order[size_t(i)] == i);
  CHECK(worker != std::this_thread::get_id());
}

TEST_CASE("wait(event) orders a second stream after the first, as in CUDA") {
  Stream producer(Device::cpu()), consumer(Device::cpu());
  Event ready(Device::cpu());
  std::atomic<int> value{0};
  int seen = -1;
  producer.enqueue([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    value = 42;
  });
  ready.record(producer);
  consumer.wait(ready);
  consumer.enqueue([&] { seen = value.load(); });
  consumer.synchronize();
  CHECK(seen == 42);
  CHECK(ready.query());
}

TEST_CASE("many events across four streams keep a global order") {
  // Step i runs on stream i % 4 and waits for step i-1's event: a strict chain across streams.
  std::vector<Stream> streams;
  for (int i = 0; i < 4; ++i) streams.emplace_back(Device::cpu());
  std::vector<Event> events;
  for (int i = 0; i < 400; ++i) events.emplace_back(Device::cpu());
  std::mutex mutex;
  std::vector<int> order;
  for (int i = 0; i < 400; ++i) {
    Stream& s = streams[size_t(i % 4)];
    if (i > 0) s.wait(events[size_t(i - 1)]);
    s.enqueue([&, i] {
      std::lock_guard<std::mutex> lock(mutex);
      order.push_back(i);
    });
    events[size_t(i)].record(s);
  }
  events.back().synchronize();
  for (Stream& s : streams) s.synchronize();
  REQUIRE(order.size() == 400);
  for (int i = 0; i < 400; ++i) CHECK(order[size_t(i)] == i);
}

TEST_CASE("a re-recorded event: waits taken earlier keep the earlier point") {
  Stream a(Device::cpu()), b(Device::cpu());
  Event e(Device::cpu());
  std::atomic<bool> gate{false};
  std::atomic<int> stage{0};
  a.enqueue([&] { stage = 1; });
  e.record(a);
  b.wait(e);  // refers to stage 1 only
  int seen = -1;
  b.enqueue([&] { seen = stage.load(); });
  b.synchronize();
  a.enqueue([&] {
    while (!gate) std::this_thread::yield();
    stage = 2;
  });
  e.record(a);  // new point, not yet reached
  CHECK_FALSE(e.query());
  gate = true;
  e.synchronize();
  CHECK(seen == 1);
  CHECK(stage == 2);
}

TEST_CASE("waiting on a never-recorded event does not block") {
  Stream s(Device::cpu());
  Event never(Device::cpu());
  CHECK(never.query());
  s.wait(never);
  bool ran = false;
  s.enqueue([&] { ran = true; });
  s.synchronize();
  CHECK(ran);
}

TEST_CASE("an error in stream work is reported by synchronize, later work is skipped, events still fire") {
  Stream s(Device::cpu()), other(Device::cpu());
  Event e(Device::cpu());
  bool later_ran = false;
  s.enqueue([] { throw Error("boom"); });
  s.enqueue([&] { later_ran = true; });
  e.record(s);
  other.wait(e);  // must not hang although the stream failed
  other.synchronize();
  CHECK_THROWS_WITH_AS(s.synchronize(), "boom", Error);
  CHECK_FALSE(later_ran);
  s.enqueue([&] { later_ran = true; });  // the error was reported: the stream runs again
  s.synchronize();
  CHECK(later_ran);
}

TEST_CASE("a task that waits for its own stream fails by name instead of waiting forever") {
  const std::string want =
      "[Stream::synchronize] called from a task of the same stream, which would wait for itself forever (clone() "
      "and to() synchronise the default stream, so they cannot run in one of its tasks)";
  Stream s(Device::cpu());
  s.enqueue([&] { s.synchronize(); });
  CHECK(test::error_of([&] { s.synchronize(); }) == want);
  // A copy on the default stream, from a task of the default stream.
  Stream& defaults = default_stream(Device::cpu());
  const Tensor t = Tensor::from_floats({1.f, 2.f, 3.f, 4.f}, {2, 2});
  Tensor copied;
  defaults.enqueue([&] { copied = t.transpose(0, 1).clone(); });
  CHECK(test::error_of([&] { defaults.synchronize(); }) == want);
  CHECK_FALSE(copied.defined());
  // Another stream's task may wait for it.
  defaults.enqueue([&] { s.synchronize(); });
  CHECK_NOTHROW(defaults.synchronize());
}

TEST_CASE("stream and event creation is counted") {
  const HandleStats before = handle_stats();
  { Stream s(Device::cpu()); Event e(Device::cpu()); }
  const HandleStats after = handle_stats();
  CHECK(after.streams_created == before.streams_created + 1);
  CHECK(after.events_created == before.events_created + 1);
}

TEST_CASE("a borrowed CPU stream runs swapopt's work in order with its owner's, and leaves the owner's queue alive") {
  Stream owner(Device::cpu());
  std::vector<ParamPtr> params = {make_param("w", Tensor::from_floats(std::vector<float>(64, 1.f), {64}))};
  std::vector<float> seen;
  {
    Stream borrowed = Stream::borrow(owner.native_handle(), Device::cpu());
    CHECK(borrowed == owner);
    AdamW adamw(borrowed);
    adamw.add_param_group(params);
    params[0]->grad = Tensor::zeros({64}, DType::f32, Device::cpu());
    // The trainer writes the grad on its own stream, the step follows on the same queue, and the
    // trainer's next work there sees the updated param: no host synchronisation in between.
    float* grad = params[0]->grad.data<float>();
    owner.enqueue([grad] { std::fill(grad, grad + 64, 0.5f); });
    adamw.step();
    const float* w = params[0]->data.data<float>();
    owner.enqueue([w, &seen] { seen.assign(w, w + 64); });
  }  // the borrowing optimizer and handle are gone; the owner's queue is not
  owner.synchronize();
  REQUIRE(seen.size() == 64);
  CHECK(seen[0] < 1.f);  // updated by a positive grad before the trainer read it
  bool ran = false;
  owner.enqueue([&ran] { ran = true; });
  owner.synchronize();
  CHECK(ran);
  CHECK_THROWS_WITH_AS(Stream::borrow(nullptr, Device::cpu()), "[Stream::borrow] null stream handle for cpu", Error);
}

TEST_CASE("the process device: LaunchEnv::device() and use_device() without a GPU") {
  LaunchEnv env;
  env.local_rank = 3;
  if (cuda_device_count() == 0) {
    CHECK(env.device() == Device::cpu());
    use_device(Device::cpu());  // nothing to choose
  } else {
    if (cuda_device_count() <= 3)
      CHECK_THROWS_WITH_AS(env.device(), doctest::Contains("[comm] LOCAL_RANK 3 has no GPU"), Error);
  }
}

TEST_CASE("a CPU stream whose last handle is dropped by its own task ends cleanly") {
  // The task holds a copy of its stream and runs only after the caller's copy is gone: when the
  // worker drops the task, it destroys the stream on its own thread, which cannot join itself
  // (this aborted the process with "Resource deadlock avoided").
  for (int i = 0; i < 20; ++i) {
    std::promise<void> owner_gone;
    std::shared_future<void> gate = owner_gone.get_future().share();
    std::atomic<bool> ran{false};
    {
      Stream s(Device::cpu());
      s.enqueue([s, gate, &ran] {
        gate.wait();
        ran = true;
      });
    }
    owner_gone.set_value();
    while (!ran) std::this_thread::yield();
  }
  // Work queued after the task that dropped the last handle still counts as queued: a storage
  // released now gives its bytes back only once that work has run (it may read them).
  {
    std::promise<void> owner_gone, second_may_end;
    std::shared_future<void> gate = owner_gone.get_future().share(), end = second_may_end.get_future().share();
    std::atomic<bool> second_started{false};
    {
      Stream s(Device::cpu());
      s.enqueue([s, gate] { gate.wait(); });
      s.enqueue([end, &second_started] {
        second_started = true;  // the first task, and the stream with it, are gone
        end.wait();
      });
    }
    owner_gone.set_value();
    while (!second_started) std::this_thread::yield();
    Allocator& allocator = device_allocator(Device::cpu());
    Tensor bytes = Tensor::zeros({1024}, DType::f32, Device::cpu());
    const uint64_t frees = allocator.stats().frees;
    bytes.storage()->release();
    CHECK(allocator.stats().frees == frees);  // not yet: the detached worker still runs a task
    second_may_end.set_value();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (allocator.stats().frees == frees && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    CHECK(allocator.stats().frees == frees + 1);
  }
  // The worker finishes on its own; a stream made now works as any other.
  Stream s(Device::cpu());
  std::atomic<int> n{0};
  s.enqueue([&] { ++n; });
  s.synchronize();
  CHECK(n == 1);
}

TEST_CASE("streams and events refuse a CPU index other than 0, and an empty function") {
  for (const int index : {1, 5, -1}) {
    const Device cpu{DeviceType::cpu, index};
    const std::string where =
        std::string("no device cpu index ") + std::to_string(index) + " (the CPU is Device::cpu(), index 0)";
    CHECK(test::error_of([&] { Stream s(cpu); }) == "[Stream] " + where);
    CHECK(test::error_of([&] { Event e(cpu); }) == "[Event] " + where);
    CHECK(test::error_of([&] { default_stream(cpu); }) == "[default_stream] " + where);
  }
  Stream s(Device::cpu());
  CHECK(test::error_of([&] { s.enqueue(nullptr); }) == "[Stream::enqueue] empty function");
  CHECK(test::error_of([&] { s.enqueue(std::function<void()>()); }) == "[Stream::enqueue] empty function");
  s.synchronize();
}

TEST_CASE("elapsed_ms measures between timing events only, on the CPU as on CUDA") {
  Stream s(Device::cpu());
  Event plain(Device::cpu()), start(Device::cpu(), true), end(Device::cpu(), true);
  start.record(s);
  plain.record(s);
  end.record(s);
  s.synchronize();
  CHECK(end.elapsed_ms(start) >= 0.0);
  const std::string want = "[Event::elapsed_ms] both events must be created with enable_timing";
  CHECK(test::error_of([&] { plain.elapsed_ms(start); }) == want);
  CHECK(test::error_of([&] { end.elapsed_ms(plain); }) == want);
}
