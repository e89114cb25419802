// The NCCL communicator's lifecycle (lib/comm/nccl_lifecycle.h) with the NCCL calls faked: init
// against a deadline, abort once, destroy once and never after an abort, errors named.
#include <atomic>
#include <thread>

#include "../../lib/comm/nccl_lifecycle.h"
#include "test_util.h"

using namespace swapopt;
using test::error_of;
using nccl::Status;

namespace {

/** Scripted async states and a record of every call. */
struct FakeApi final : nccl::Api {
  std::vector<Status> script;  // what async_error answers, one per poll; then `rest`
  Status rest = Status::success;
  std::string error = "remote process exited";
  std::atomic<int> polls{0}, aborts{0}, destroys{0};
  void* aborted_handle = nullptr;

  Status async_error(void* comm, std::string& message) override {
    CHECK(comm != nullptr);
    const size_t i = size_t(polls++);
    const Status s = i < script.size() ? script[i] : rest;
    if (s == Status::error) message = error;
    return s;
  }
  void abort(void* comm) override {
    ++aborts;
    aborted_handle = comm;
  }
  void destroy(void*) override { ++destroys; }
};

int g_comm = 0;  // a fake handle
auto start_in_progress = [](void** comm) {
  *comm = &g_comm;
  return Status::in_progress;
};


}  // namespace

TEST_SUITE("nccl lifecycle") {
  TEST_CASE("init completes after a few polls; the communicator is destroyed exactly once, never aborted") {
    auto api = std::make_shared<FakeApi>();
    api->script = {Status::in_progress, Status::in_progress};
    {
      nccl::CommState state(api, "[comm] NCCL rank 0 of 2");
      state.init(start_in_progress, nccl::Clock::now() + std::chrono::seconds(5), std::chrono::milliseconds(5000));
      CHECK(api->polls == 3);
      CHECK(state.call([](void* comm) { return comm == &g_comm ? Status::success : Status::error; }) == Status::success);
    }
    CHECK(api->destroys == 1);
    CHECK(api->aborts == 0);
  }

  TEST_CASE("a peer that never joins: a named error within the timeout, aborted once, never destroyed") {
    auto api = std::make_shared<FakeApi>();
    api->rest = Status::in_progress;
    const auto started = nccl::Clock::now();
    {
      nccl::CommState state(api, "[comm] NCCL rank 1 of 4");
      CHECK(error_of([&] { state.init(start_in_progress, nccl::Clock::now() + std::chrono::milliseconds(200), std::chrono::milliseconds(200)); }) ==
            "[comm] NCCL rank 1 of 4: init (waiting for every rank to join) did not complete within 200 ms (the communicator was "
            "aborted)");
      const double seconds = std::chrono::duration<double>(nccl::Clock::now() - started).count();
      CHECK(seconds >= 0.2);
      CHECK(seconds < 2.0);
      CHECK(state.aborted());
      CHECK(error_of([&] { state.call([](void*) { return Status::success; }); }) ==
            "[comm] NCCL rank 1 of 4 was aborted after an earlier error or timeout: create a new communicator");
    }
    CHECK(api->aborts == 1);
    CHECK(api->aborted_handle == &g_comm);
    CHECK(api->destroys == 0);  // ncclCommAbort freed it: destroying it again would free twice
  }

  TEST_CASE("an asynchronous error during init or a later wait: aborted with NCCL's message; abort is idempotent") {
    auto api = std::make_shared<FakeApi>();
    api->script = {Status::in_progress, Status::error};
    {
      nccl::CommState state(api, "[comm] NCCL rank 0 of 2");
      CHECK(error_of([&] { state.init(start_in_progress, nccl::Clock::now() + std::chrono::seconds(5), std::chrono::milliseconds(5000)); }) ==
            "[comm] NCCL rank 0 of 2: init (waiting for every rank to join) failed: remote process exited (the communicator was "
            "aborted)");
      state.abort();
      state.abort();
    }
    CHECK(api->aborts == 1);
    CHECK(api->destroys == 0);

    auto later = std::make_shared<FakeApi>();
    {
      nccl::CommState state(later, "[comm] NCCL rank 1 of 2");
      state.init(start_in_progress, nccl::Clock::now() + std::chrono::seconds(5), std::chrono::milliseconds(5000));
      later->rest = Status::error;
      CHECK(error_of([&] { state.check("broadcast"); }) ==
            "[comm] NCCL rank 1 of 2: broadcast failed: remote process exited (the communicator was aborted)");
      // A wait after the abort (e.g. a broadcaster's destructor) fails at once instead of polling a freed handle.
      CHECK(error_of([&] { state.check("all_gather"); }) ==
            "[comm] NCCL rank 1 of 2 was aborted after an earlier error or timeout: create a new communicator");
    }
    CHECK(later->aborts == 1);
    CHECK(later->destroys == 0);
  }

  TEST_CASE("a collective still being enqueued (non-blocking) is settled before its event; a timeout aborts") {
    auto api = std::make_shared<FakeApi>();
    nccl::CommState state(api, "[comm] NCCL rank 0 of 2");
    state.init(start_in_progress, nccl::Clock::now() + std::chrono::seconds(5), std::chrono::milliseconds(5000));
    const int before = api->polls;
    api->script.assign(size_t(before), Status::success);
    api->script.insert(api->script.end(), {Status::in_progress, Status::in_progress});
    state.settle(Status::in_progress, "broadcast", nccl::Clock::now() + std::chrono::seconds(5), std::chrono::milliseconds(5000));
    CHECK(api->polls == before + 3);
    CHECK(error_of([&] { state.expire("all_reduce", std::chrono::milliseconds(30000)); }) ==
          "[comm] NCCL rank 0 of 2: all_reduce did not complete within 30000 ms (the communicator was aborted)");
    CHECK(api->aborts == 1);
  }

  TEST_CASE("a failed start names the failure and leaves nothing to destroy") {
    auto api = std::make_shared<FakeApi>();
    {
      nccl::CommState state(api, "[comm] NCCL rank 0 of 2");
      CHECK(error_of([&] {
              state.init([](void**) { return Status::error; }, nccl::Clock::now() + std::chrono::seconds(1), std::chrono::milliseconds(1000));
            }) == "[comm] NCCL rank 0 of 2: init failed");
    }
    CHECK(api->destroys == 0);
    CHECK(api->aborts == 0);
  }
}
