// Multi-process tests: each case launches swapopt-mp-worker once per rank on loopback.
#include <cstdlib>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "mp/launcher.h"
#include "test_util.h"

using namespace swapopt;

namespace {

/** The worker program next to this test binary. */
std::string worker() { return test::test_path(SWAPOPT_MP_WORKER, "swapopt-mp-worker"); }

void expect_all_ok(const test::LaunchResult& r) {
  CHECK_FALSE(r.timed_out);
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    CAPTURE(i);
    CAPTURE(r.ranks[i].output);
    CHECK(r.ranks[i].exit_code == 0);
  }
}

}  // namespace

TEST_SUITE("mp") {
  TEST_CASE("gloo collectives on 2 and 4 ranks (FileStore rendezvous), sub-groups of a 2x2 mesh") {
    for (int n : {2, 4}) {
      CAPTURE(n);
      const std::string dir = test::make_temp_dir("swapopt_rdzv_");
      expect_all_ok(test::launch_ranks(n, {worker(), "collectives"}, {{"SWAPOPT_RENDEZVOUS", dir}},
                                       std::chrono::seconds(60)));
      std::system(("rm -rf " + dir).c_str());
    }
  }

  // Each rank checks: equal to single-process Muon bitwise, swapped equal to bare bitwise, only
  // owners keep momentum, the full-copy checkpoint helper, and a resumed run (see worker.cpp).
  TEST_CASE("HSDP Muon on meshes 1x2, 2x1, 2x2 and 4x1 (replicated, sharded and both)") {
    for (const auto& [replicas, shards] : std::vector<std::pair<int, int>>{{1, 2}, {2, 1}, {2, 2}, {4, 1}}) {
      CAPTURE(replicas);
      CAPTURE(shards);
      const std::string dir = test::make_temp_dir("swapopt_rdzv_");
      expect_all_ok(test::launch_ranks(replicas * shards,
                                       {worker(), "hsdp", std::to_string(replicas), std::to_string(shards), "0"},
                                       {{"SWAPOPT_RENDEZVOUS", dir}}, std::chrono::seconds(120)));
      std::system(("rm -rf " + dir).c_str());
    }
  }

  TEST_CASE("hsdp_replica_count: blocks of 2 of 4 replicas, blocks of 1 on a 2x2 mesh; 3 of 4 is a named error") {
    for (const auto& [replicas, shards, count] : std::vector<std::tuple<int, int, int>>{{4, 1, 2}, {2, 2, 1}}) {
      CAPTURE(replicas);
      CAPTURE(count);
      const std::string dir = test::make_temp_dir("swapopt_rdzv_");
      expect_all_ok(test::launch_ranks(
          replicas * shards, {worker(), "hsdp", std::to_string(replicas), std::to_string(shards), std::to_string(count)},
          {{"SWAPOPT_RENDEZVOUS", dir}}, std::chrono::seconds(120)));
      std::system(("rm -rf " + dir).c_str());
    }
  }

  TEST_CASE("sharded HSDP: a grad missing on one rank of a shard group is a named error on every rank") {
    const std::string dir = test::make_temp_dir("swapopt_rdzv_");
    expect_all_ok(test::launch_ranks(2, {worker(), "hsdp_grad_mismatch"}, {{"SWAPOPT_RENDEZVOUS", dir}},
                                     std::chrono::seconds(60)));
    std::system(("rm -rf " + dir).c_str());
  }

  // Rank 0 has w0's grad but not w1's, rank 1 the reverse: the counts agree, the fingerprint of
  // which params does not. A short collective timeout bounds the run should the check miss it.
  TEST_CASE("sharded HSDP: ranks stepping as many but different params is a named error on every rank") {
    const std::string dir = test::make_temp_dir("swapopt_rdzv_");
    expect_all_ok(test::launch_ranks(2, {worker(), "hsdp_grad_mismatch", "same_count"},
                                     {{"SWAPOPT_RENDEZVOUS", dir}, {"SWAPOPT_TIMEOUT_MS", "5000"}}, std::chrono::seconds(30)));
    std::system(("rm -rf " + dir).c_str());
  }

  TEST_CASE("a dead rank: the others fail with the named error within the timeout") {
    const std::string dir = test::make_temp_dir("swapopt_rdzv_");
    const auto r = test::launch_ranks(3, {worker(), "dead_rank"},
                                      {{"SWAPOPT_RENDEZVOUS", dir}, {"SWAPOPT_TIMEOUT_MS", "3000"}}, std::chrono::seconds(30));
    CHECK_FALSE(r.timed_out);
    CHECK(r.seconds < 20.0);
    for (int i = 0; i < 2; ++i) {
      CAPTURE(r.ranks[size_t(i)].output);
      CHECK(r.ranks[size_t(i)].exit_code == 0);  // it saw the named error
      const std::string named = "named error: [comm] all_reduce on rank " + std::to_string(i) + " of group 'world' (world rank " +
                                std::to_string(i) + "; the group is world ranks [0, 1, 2]): ";
      CHECK(r.ranks[size_t(i)].output.find(named) != std::string::npos);
    }
    CHECK(r.ranks[2].exit_code == 3);
    std::system(("rm -rf " + dir).c_str());
  }

  TEST_CASE("an HSDP step with a dead rank: a named error on the others, and their later work runs") {
    const std::string dir = test::make_temp_dir("swapopt_rdzv_");
    const auto r =
        test::launch_ranks(3, {worker(), "hsdp_dead_rank"},
                           {{"SWAPOPT_RENDEZVOUS", dir}, {"SWAPOPT_TIMEOUT_MS", "3000"}}, std::chrono::seconds(30));
    CHECK_FALSE(r.timed_out);
    for (int i = 0; i < 2; ++i) {
      CAPTURE(r.ranks[size_t(i)].output);
      CHECK(r.ranks[size_t(i)].exit_code == 0);
    }
    CHECK(r.ranks[2].exit_code == 3);
    std::system(("rm -rf " + dir).c_str());
  }

  TEST_CASE("two Gloo ranks as threads of one process step HSDP Muon without waiting for each other") {
    const std::string dir = test::make_temp_dir("swapopt_rdzv_");
    const auto r = test::launch_ranks(1, {worker(), "thread_ranks", dir}, {}, std::chrono::seconds(60));
    CHECK_FALSE(r.timed_out);
    CAPTURE(r.ranks[0].output);
    CHECK(r.ranks[0].exit_code == 0);
    std::system(("rm -rf " + dir).c_str());
  }

  TEST_CASE("a dead rank in a sub-group: the error names the group, its world ranks and the caller's") {
    const std::string dir = test::make_temp_dir("swapopt_rdzv_");
    const auto r = test::launch_ranks(3, {worker(), "dead_rank_in_group"},
                                      {{"SWAPOPT_RENDEZVOUS", dir}, {"SWAPOPT_TIMEOUT_MS", "3000"}}, std::chrono::seconds(30));
    CHECK_FALSE(r.timed_out);
    CAPTURE(r.ranks[1].output);
    CHECK(r.ranks[0].exit_code == 0);
    CHECK(r.ranks[1].exit_code == 0);
    CHECK(r.ranks[1].output.find("named error: [comm] all_reduce on rank 0 of group 'pair' (world rank 1; the group is world "
                                 "ranks [1, 2]): ") != std::string::npos);
    CHECK(r.ranks[2].exit_code == 3);
    std::system(("rm -rf " + dir).c_str());
  }

  TEST_CASE("Redis unreachable at rendezvous: a named error with the address tried") {
    LaunchEnv env;
    env.redis = "127.0.0.1:1";  // port 1: nothing listens
    env.rendezvous_timeout = std::chrono::milliseconds(1000);
    const auto t0 = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(make_gloo_communicator(env),
                         doctest::Contains("[comm] gloo setup on world rank 0 (Redis at 127.0.0.1:1, this rank at 127.0.0.1): "),
                         Error);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CHECK(seconds > 0.5);  // retried while the timeout lasted
    CHECK(seconds < 3.0);
    env.redis = "127.0.0.1:x";
    CHECK_THROWS_WITH_AS(make_gloo_communicator(env), "[comm] SWAPOPT_REDIS must be host:port, got '127.0.0.1:x'", Error);
  }

  TEST_CASE("rendezvous through a real Redis server on loopback" * doctest::skip(std::system("command -v redis-server >/dev/null 2>&1") != 0)) {
    const int port = 16379 + int(::getpid() % 1000);
    const std::string dir = test::make_temp_dir("swapopt_redis_");
    const std::string start = "redis-server --port " + std::to_string(port) + " --bind 127.0.0.1 --save '' --appendonly no --daemonize yes --dir " +
                              dir + " --pidfile " + dir + "/redis.pid --logfile " + dir + "/redis.log";
    REQUIRE(std::system(start.c_str()) == 0);
    for (int i = 0; i < 100 && std::system(("redis-cli -p " + std::to_string(port) + " ping >/dev/null 2>&1").c_str()) != 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    expect_all_ok(test::launch_ranks(2, {worker(), "collectives"}, {{"SWAPOPT_REDIS", "127.0.0.1:" + std::to_string(port)}},
                                     std::chrono::seconds(60)));
    std::system(("redis-cli -p " + std::to_string(port) + " shutdown nosave >/dev/null 2>&1").c_str());
    std::system(("rm -rf " + dir).c_str());
  }

  TEST_CASE("the launch environment: every variable read, errors named") {
    ::unsetenv("RANK");
    CHECK_THROWS_WITH_AS(LaunchEnv::from_environment(), "[comm] environment variable RANK is not set", Error);
    ::setenv("RANK", "x", 1);
    ::setenv("WORLD_SIZE", "2", 1);
    CHECK_THROWS_WITH_AS(LaunchEnv::from_environment(), "[comm] environment variable RANK='x' is not a non-negative integer", Error);
    ::setenv("RANK", "1", 1);
    ::unsetenv("SWAPOPT_RENDEZVOUS");
    ::unsetenv("SWAPOPT_REDIS");
    CHECK_THROWS_WITH_AS(LaunchEnv::from_environment(),
                         "[comm] set SWAPOPT_RENDEZVOUS (a shared directory) or SWAPOPT_REDIS (host:port) for the rendezvous", Error);
    ::setenv("SWAPOPT_RENDEZVOUS", "/tmp/rdzv", 1);
    ::setenv("SWAPOPT_HOSTNAME", "10.0.0.5", 1);
    ::setenv("SWAPOPT_TIMEOUT_MS", "1234", 1);
    CHECK(LaunchEnv::from_environment().rendezvous_timeout == std::chrono::milliseconds(0));  // the default then
    CHECK(LaunchEnv::from_environment().run_id.empty());
    ::setenv("SWAPOPT_RENDEZVOUS_TIMEOUT_MS", "60000", 1);
    ::setenv("SWAPOPT_RUN_ID", "job7.2", 1);
    const LaunchEnv env = LaunchEnv::from_environment();
    CHECK(env.rank == 1);
    CHECK(env.world_size == 2);
    CHECK(env.local_rank == 1);  // defaults to RANK
    CHECK(env.rendezvous_dir == "/tmp/rdzv");
    CHECK(env.hostname == "10.0.0.5");
    CHECK(env.timeout == std::chrono::milliseconds(1234));
    CHECK(env.rendezvous_timeout == std::chrono::milliseconds(60000));
    CHECK(env.run_id == "job7.2");
    // Digits only, within the range each takes; a timeout of 0 would fail every collective at once.
    const std::vector<std::pair<std::string, std::string>> bad = {
        {"+1", "is not a non-negative integer"},       {" 1", "is not a non-negative integer"},
        {"1 ", "is not a non-negative integer"},       {"-0", "is not a non-negative integer"},
        {"99999999999", "is outside [0, 1073741823]"}, {"1073741824", "is outside [0, 1073741823]"}};
    for (const auto& [text, says] : bad) {
      ::setenv("LOCAL_RANK", text.c_str(), 1);
      CHECK(test::error_of([] { LaunchEnv::from_environment(); }) ==
            "[comm] environment variable LOCAL_RANK='" + text + "' " + says);
    }
    ::setenv("LOCAL_RANK", "1073741823", 1);
    CHECK(LaunchEnv::from_environment().local_rank == 1073741823);
    ::setenv("SWAPOPT_TIMEOUT_MS", "0", 1);
    CHECK(test::error_of([] { LaunchEnv::from_environment(); }) ==
          "[comm] environment variable SWAPOPT_TIMEOUT_MS='0' is outside [1, 1073741823]");
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "SWAPOPT_RENDEZVOUS", "SWAPOPT_HOSTNAME",
                             "SWAPOPT_TIMEOUT_MS", "SWAPOPT_RENDEZVOUS_TIMEOUT_MS", "SWAPOPT_RUN_ID"})
      ::unsetenv(name);
  }

  TEST_CASE("make_gloo_communicator refuses a zero timeout and a missing rendezvous directory before any rendezvous") {
    LaunchEnv env;
    env.rendezvous_dir = "/nonexistent/rdzv";
    CHECK(test::error_of([&] { make_gloo_communicator(env); }) ==
          "[comm] the rendezvous directory '/nonexistent/rdzv' (SWAPOPT_RENDEZVOUS) is not a directory: create it, "
          "empty, on a filesystem every rank sees, before the ranks start");
    env.rendezvous_dir = test::make_temp_dir("swapopt_rdzv_");
    env.timeout = std::chrono::milliseconds(0);
    CHECK(test::error_of([&] { make_gloo_communicator(env); }) ==
          "[comm] the collective timeout must be > 0 ms, got 0");
    env.timeout = std::chrono::milliseconds(1000);
    env.rendezvous_timeout = std::chrono::milliseconds(-1);
    CHECK(test::error_of([&] { make_gloo_communicator(env); }) ==
          "[comm] the rendezvous timeout must be >= 0 ms (0: the default), got -1");
    env.rendezvous_timeout = std::chrono::milliseconds(0);
    env.rank = 1;
    CHECK(test::error_of([&] { make_gloo_communicator(env); }) == "[comm] rank 1 is outside a world of 1");
    env.rank = 0;
    CHECK(make_gloo_communicator(env)->size() == 1);  // a world of one meets itself
    std::filesystem::remove_all(env.rendezvous_dir);
  }

  TEST_CASE("gloo refuses undefined, released and overlapping tensors before it issues, and stays usable") {
    LaunchEnv env;
    env.rendezvous_dir = test::make_temp_dir("swapopt_rdzv_");
    std::shared_ptr<Communicator> comm = make_gloo_communicator(env);
    Tensor x = test::random_tensor({8}, DType::f32, 3);
    CHECK(test::error_of([&] { comm->all_reduce(Tensor()); }) == "[comm] all_reduce: undefined tensor");
    Tensor released = Tensor::zeros({4}, DType::f32, Device::cpu());
    released.storage()->release();
    CHECK(test::error_of([&] { comm->broadcast(released, 0); }) ==
          "[comm] broadcast: released storage: Tensor(f32, [4], cpu)");
    CHECK(test::error_of([&] { comm->all_gather(x.narrow(0, 0, 4), x.narrow(0, 2, 4)); }) ==
          "[comm] all_gather: in Tensor(f32, [4], cpu) and out Tensor(f32, [4], cpu) share memory");
    CHECK(test::error_of([&] { comm->reduce_scatter(x, x); }) ==
          "[comm] reduce_scatter: in Tensor(f32, [8], cpu) and out Tensor(f32, [8], cpu) share memory");
    // Overlap found whatever the order: the third tensor straddles the first two.
    CHECK(test::error_of([&] {
            comm->broadcast_many({x.narrow(0, 0, 2), x.narrow(0, 4, 2), x.narrow(0, 1, 2)}, {0, 0, 0});
          }) ==
          "[comm] broadcast_many: tensor 0 Tensor(f32, [2], cpu) and tensor 2 Tensor(f32, [2], cpu) share memory");
    // Adjacent views and empty ones share nothing, and the communicator still runs collectives.
    comm->broadcast_many({x.narrow(0, 0, 4), x.narrow(0, 4, 4), x.narrow(0, 4, 0)}, {0, 0, 0})->wait();
    Tensor gathered = Tensor::zeros({8}, DType::f32, Device::cpu());
    comm->all_gather(x, gathered)->wait();
    CHECK(test::same_bits(gathered, x));
    // Tensors without elements take no memory (a memcpy of nulls is undefined: UBSan in CI).
    const Tensor none = Tensor::zeros({0}, DType::f32, Device::cpu());
    comm->reduce_scatter(none, Tensor::zeros({0}, DType::f32, Device::cpu()))->wait();
    comm->all_gather(none, Tensor::zeros({0}, DType::f32, Device::cpu()))->wait();
    comm->all_reduce(Tensor::zeros({0}, DType::f32, Device::cpu()))->wait();
    std::filesystem::remove_all(env.rendezvous_dir);
  }

  TEST_CASE("a rendezvous directory an earlier run used: the error says to give each run its own") {
    LaunchEnv env;
    env.rendezvous_dir = test::make_temp_dir("swapopt_rdzv_");
    env.timeout = env.rendezvous_timeout = std::chrono::milliseconds(2000);
    make_gloo_communicator(env);
    const std::string error = test::error_of([&] { make_gloo_communicator(env); });
    CAPTURE(error);
    CHECK(error.find("[comm] rendezvous on rank 0 of group 'world' (world rank 0; ") == 0);
    CHECK(error.find("(the directory holds the keys of an earlier run: give each run an empty directory or its own "
                     "SWAPOPT_RUN_ID)") != std::string::npos);
    env.run_id = "attempt.2";
    CHECK(make_gloo_communicator(env)->size() == 1);
    std::filesystem::remove_all(env.rendezvous_dir);
  }

  // A restarted job: its ranks come back at different times, later than a collective may take.
  TEST_CASE("a rank later than the collective timeout: the rendezvous timeout waits for it") {
    const std::string dir = test::make_temp_dir("swapopt_rdzv_"), other = test::make_temp_dir("swapopt_rdzv_");
    const auto waited = test::launch_ranks(3, {worker(), "late_rank"},
                                           // Collectives bounded by 2.5 s (ample under a sanitizer on a busy
                                           // machine), the late rank 4 s late: only the rendezvous limit waits.
                                           {{"SWAPOPT_RENDEZVOUS", dir}, {"SWAPOPT_TIMEOUT_MS", "2500"},
                                            {"SWAPOPT_RENDEZVOUS_TIMEOUT_MS", "20000"}},
                                           std::chrono::seconds(60));
    expect_all_ok(waited);
    // A rendezvous limit shorter than the late rank's delay: the early ranks give up.
    const auto alone = test::launch_ranks(3, {worker(), "late_rank"},
                                          {{"SWAPOPT_RENDEZVOUS", other}, {"SWAPOPT_TIMEOUT_MS", "20000"},
                                           {"SWAPOPT_RENDEZVOUS_TIMEOUT_MS", "1000"}},
                                          std::chrono::seconds(60));
    CAPTURE(alone.ranks[0].output);
    CHECK(alone.ranks[0].exit_code == 1);
    CHECK(alone.ranks[0].output.find("rank error: [comm] rendezvous on rank 0 of group 'world' (world rank 0; ") != std::string::npos);
    std::system(("rm -rf " + dir + " " + other).c_str());
  }

  // Each attempt of a restarted job under its own run id: the keys an earlier attempt left in the
  // store (the addresses of ranks now gone) are never read.
  TEST_CASE("run ids: a second attempt in a store the first one left keys in") {
    const std::string dir = test::make_temp_dir("swapopt_rdzv_");
    for (const char* id : {"job.1", "job.2", "job.3"})
      expect_all_ok(test::launch_ranks(3, {worker(), "collectives"}, {{"SWAPOPT_RENDEZVOUS", dir}, {"SWAPOPT_RUN_ID", id},
                                                                       {"SWAPOPT_TIMEOUT_MS", "5000"}},
                                       std::chrono::seconds(60)));
    std::system(("rm -rf " + dir).c_str());
  }
}
