// AsyncReplicateBroadcaster on thread ranks: every receiver ends with each owner's params bitwise,
// whatever the sizes, dtypes and buffer splits (a slot read or written at another in-bounds offset
// shows up as another param's values).
#include <thread>

#include "optim/thread_communicator.h"
#include "test_util.h"

using namespace swapopt;

TEST_CASE(
    "replicate broadcast: each rank's params equal their owner's bitwise across buffers, dtypes and odd sizes; a param "
    "without a grad keeps each rank's own") {
  const std::vector<std::pair<Shape, DType>> specs = {
      {{1}, DType::f32},      {{3, 5}, DType::f32},  {{130}, DType::bf16}, {{2, 129}, DType::f32}, {{7}, DType::f16},
      {{256}, DType::f32},    {{300}, DType::bf16},  {{1}, DType::bf16},   {{64, 4}, DType::f32},  {{33}, DType::f16},
  };
  const int ranks = 3;
  auto values = [&](size_t i, int rank) {
    return test::random_tensor(specs[i].first, specs[i].second, uint32_t(1000 * rank + int(i)));
  };
  for (int64_t buffer_bytes : {int64_t(1) << 20, int64_t(1024), int64_t(1)}) {  // one buffer per dtype; several; one per param
    CAPTURE(buffer_bytes);
    auto world = std::make_shared<test::ThreadWorld>();
    std::vector<std::string> errors(ranks);
    std::vector<int> same(ranks, 0);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < ranks; ++rank)
      threads.emplace_back([&, rank] {
        try {
          std::vector<ParamPtr> params;
          HsdpAssignment a;
          a.replicas = std::make_shared<test::ThreadCommunicator>(world, "replicas", rank, ranks);
          a.local_coordinate = rank;
          for (size_t i = 0; i < specs.size(); ++i) {
            params.push_back(make_param(std::to_string(i), values(i, rank)));
            if (i % 4 != 3) params.back()->grad = Tensor::zeros(specs[i].first, DType::f32, Device::cpu());
            a.params.push_back(params.back().get());
            a.owners.push_back(int64_t((i * 7 + 1) % ranks));  // owners interleaved, not in order
          }
          Stream stream(Device::cpu());
          {
            AsyncReplicateBroadcaster broadcaster(stream, buffer_bytes);
            WorkPtr broadcasts = broadcaster.flush(a);
            broadcaster.finish();
            REQUIRE(broadcasts != nullptr);
            broadcasts->wait();
          }
          stream.synchronize();
          bool all = true;
          for (size_t i = 0; i < specs.size(); ++i)
            all = all && test::same_bits(params[i]->data, values(i, i % 4 != 3 ? int(a.owners[i]) : rank));
          same[size_t(rank)] = all ? 1 : 0;
        } catch (const std::exception& e) {
          errors[size_t(rank)] = e.what();
        }
      });
    for (std::thread& t : threads) t.join();
    for (int rank = 0; rank < ranks; ++rank) {
      CAPTURE(rank);
      CHECK(errors[size_t(rank)] == "");
      CHECK(same[size_t(rank)] == 1);
    }
  }
}

TEST_CASE("Communicator defaults: broadcast_many from several roots, start_after and finish_before wait on the host") {
  const int ranks = 2;
  auto world = std::make_shared<test::ThreadWorld>();
  std::vector<int> ok(ranks, 0);
  const std::vector<std::string> errors = test::run_on_thread_ranks(ranks, [&](int rank) {
    test::ThreadCommunicator comm(world, "group", rank, ranks);
    Stream producer(Device::cpu()), consumer(Device::cpu());
    const Tensor a = Tensor::zeros({5}, DType::f32, Device::cpu()), b = Tensor::zeros({3}, DType::bf16, Device::cpu());
    producer.enqueue([] { std::this_thread::sleep_for(std::chrono::milliseconds(50)); });  // start_after must wait
    ops::copy(producer, test::random_tensor({5}, DType::f32, uint32_t(10 + rank)), a);
    ops::copy(producer, test::random_tensor({3}, DType::bf16, uint32_t(20 + rank)), b);
    comm.start_after(producer);
    WorkPtr work = comm.broadcast_many({a, b}, {1, 0});
    const Tensor got = Tensor::zeros({5}, DType::f32, Device::cpu());
    work->finish_before(consumer);
    ops::copy(consumer, a, got);
    consumer.synchronize();
    work->wait();
    bool same = test::same_bits(got, test::random_tensor({5}, DType::f32, 11)) &&
                test::same_bits(b, test::random_tensor({3}, DType::bf16, 20));
    try {
      comm.broadcast_many({a, b}, {0});
      same = false;
    } catch (const Error& e) {
      same = same && std::string(e.what()) == "[comm] broadcast_many: 2 tensors and 1 roots";
    }
    ok[size_t(rank)] = same ? 1 : 0;
  });
  for (int rank = 0; rank < ranks; ++rank) {
    CAPTURE(rank);
    CHECK(errors[size_t(rank)] == "");
    CHECK(ok[size_t(rank)] == 1);
  }
}

TEST_CASE("wait_every waits for every work in order, also after failures, and rethrows the first error") {
  struct Scripted final : Work {
    Scripted(std::vector<int>& order, int id, const char* error) : order(order), id(id), error(error) {}
    void wait() override {
      order.push_back(id);
      if (error != nullptr) throw Error(error);
    }
    std::vector<int>& order;
    int id;
    const char* error;
  };
  std::vector<int> order;
  const std::vector<WorkPtr> works = {std::make_shared<Scripted>(order, 0, nullptr),
                                      std::make_shared<Scripted>(order, 1, "first"),
                                      std::make_shared<Scripted>(order, 2, nullptr),
                                      std::make_shared<Scripted>(order, 3, "second")};
  CHECK_THROWS_WITH_AS(wait_every(works), "first", Error);
  CHECK(order == std::vector<int>{0, 1, 2, 3});
  order.clear();
  CHECK_NOTHROW(wait_every({works[0], works[2]}));
  CHECK(order == std::vector<int>{0, 2});
}
