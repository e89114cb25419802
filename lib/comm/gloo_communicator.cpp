// Gloo over TCP: rendezvous through a FileStore (one host or a shared filesystem) or a RedisStore
// (many hosts). Collectives run in issue order on one worker thread per communicator, so a Work
// handle is asynchronous while every rank still sees the same order.
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/redis_store.h>
#include <gloo/transport/tcp/device.h>
#include <hiredis/hiredis.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#include "../cpu/cpu_stream.h"
#include "collective_args.h"
#include "swapopt/comm/communicator.h"
#include "swapopt/core/error.h"
#include "swapopt/core/stream.h"

namespace swapopt {

namespace {

/** Runs a Gloo collective on `opts`. After a transport error (a dead peer, a timeout) Gloo's loop
 *  thread may still signal the options' buffers (tcp::UnboundBuffer::signalException racing their
 *  destructor, seen by ThreadSanitizer), so those options are kept, never destroyed: the
 *  communicator is unusable after such an error, and the kept objects stay reachable. */
template <typename Options, typename Collective>
void run_collective(std::unique_ptr<Options> opts, Collective collective) {
  try {
    collective(*opts);
  } catch (...) {
    static std::mutex mutex;
    static auto* kept = new std::vector<std::shared_ptr<void>>();
    std::lock_guard<std::mutex> lock(mutex);
    kept->push_back(std::shared_ptr<Options>(std::move(opts)));
    throw;
  }
}

/** One group's view of the job's store: its keys under "<run id>/<group name>/", and every wait
 *  bounded by the rendezvous timeout (Gloo's rendezvous waits with the store's fixed 30 s default,
 *  whatever the context's timeout). */
class GroupStore final : public gloo::rendezvous::Store {
 public:
  GroupStore(gloo::rendezvous::Store& store, std::string prefix, std::chrono::milliseconds timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override { store_.set(prefix_ + key, data); }
  std::vector<char> get(const std::string& key) override {
    wait({key});
    return store_.get(prefix_ + key);
  }
  void wait(const std::vector<std::string>& keys) override {
    std::vector<std::string> prefixed;
    for (const std::string& key : keys) prefixed.push_back(prefix_ + key);
    store_.wait(prefixed, timeout_);
  }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override { wait(keys); }

 private:
  gloo::rendezvous::Store& store_;
  const std::string prefix_;
  const std::chrono::milliseconds timeout_;
};

/** The shared pieces every group of one job uses: the store and the TCP device, and where they
 *  are, for errors that say where. */
struct GlooWorld {
  std::shared_ptr<gloo::rendezvous::Store> store;
  std::shared_ptr<gloo::transport::Device> device;
  std::chrono::milliseconds timeout;             // each collective's
  std::chrono::milliseconds rendezvous_timeout;  // each group's connection of all its ranks
  std::string run_id;  // SWAPOPT_RUN_ID: every key of this attempt under it
  int world_rank = 0;
  std::string store_address;  // "Redis at host:port" or "the FileStore in dir"
  std::string hostname;       // this rank's address for the TCP transport
};

/** "[0, 1, 2]": the world ranks of a group's members. */
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i > 0) out += ", ";
    out += std::to_string(ranks[i]);
  }
  return out + "]";
}

/** The error crosses threads as its message: wait() throws a fresh Error on the waiting thread,
 *  so no exception object is shared between the worker and the caller. */
class GlooWork final : public Work, public std::enable_shared_from_this<GlooWork> {
 public:
  void finish(std::string error) {
    error_ = std::move(error);
    mark_.signal();
  }
  void wait() override {
    mark_.wait();
    if (!error_.empty()) throw Error(error_);
  }
  /** A task on `consumer` waits for the collective; its failure fails that stream too. */
  void finish_before(Stream& consumer) override {
    SWAPOPT_CHECK(consumer.device().is_cpu(),
                  "[comm] a gloo collective orders CPU streams, got one on " << consumer.device().str());
    consumer.enqueue([self = shared_from_this()] { self->wait(); });
  }

 private:
  cpu::CompletionMark mark_;
  std::string error_;  // empty: success
};

class GlooCommunicator final : public Communicator {
 public:
  /** Rank `rank` of the group `name` whose members are `world_ranks` (in group order). */
  GlooCommunicator(std::shared_ptr<GlooWorld> world, int rank, std::vector<int> world_ranks, const std::string& name)
      : world_(std::move(world)), rank_(rank), size_(int(world_ranks.size())), world_ranks_(std::move(world_ranks)) {
    // Every error of this group says where: "on rank 1 of group 'shard.0' (world rank 3; the group
    // is world ranks [2, 3])" (a collective's error then names the collective before it).
    where_ = " on rank " + std::to_string(rank_) + " of group '" + name + "' (world rank " + std::to_string(world_->world_rank) +
             "; the group is world ranks " + rank_list(world_ranks_) + ")";
    context_ = std::make_shared<gloo::rendezvous::Context>(rank, size_);
    context_->setTimeout(world_->rendezvous_timeout);
    GroupStore store(*world_->store, (world_->run_id.empty() ? "" : world_->run_id + "/") + name + "/",
                     world_->rendezvous_timeout);
    try {
      context_->connectFullMesh(store, world_->device);
      // The context's default from now on (its TCP pairs keep the rendezvous timeout for their
      // own connects); every collective below passes the collective timeout itself.
      context_->setTimeout(world_->timeout);
    } catch (const std::exception& e) {
      // A FileStore refuses to write a key twice: the directory holds an earlier run's keys.
      const bool stale = std::string_view(e.what()).find("File already exists") != std::string_view::npos;
      SWAPOPT_FAIL("[comm] rendezvous" << where_ << " through " << world_->store_address << ", this rank at "
                                       << world_->hostname << ": " << e.what()
                                       << (stale ? " (the directory holds the keys of an earlier run: give each run an "
                                                   "empty directory or its own SWAPOPT_RUN_ID)"
                                                 : ""));
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "gloo"; }

  WorkPtr broadcast(const Tensor& tensor, int root) override {
    check(tensor, "broadcast");
    SWAPOPT_CHECK(root >= 0 && root < size_, "[comm] broadcast root " << root << " outside group of " << size_);
    return submit("broadcast", [this, tensor, root] { run_broadcast(tensor, root); });
  }

  /** Every tensor checked before anything is issued, then one task running the broadcasts in
   *  order (each rank's worker runs the same sequence). */
  WorkPtr broadcast_many(const std::vector<Tensor>& tensors, const std::vector<int>& roots) override {
    SWAPOPT_CHECK(tensors.size() == roots.size(),
                  "[comm] broadcast_many: " << tensors.size() << " tensors and " << roots.size() << " roots");
    for (size_t i = 0; i < tensors.size(); ++i) {
      check(tensors[i], "broadcast_many");
      SWAPOPT_CHECK(roots[i] >= 0 && roots[i] < size_,
                    "[comm] broadcast_many root " << roots[i] << " outside group of " << size_);
    }
    comm_args::check_apart(tensors, "broadcast_many");
    return submit("broadcast_many", [this, tensors, roots] {
      for (size_t i = 0; i < tensors.size(); ++i) run_broadcast(tensors[i], roots[i]);
    });
  }

  WorkPtr all_gather(const Tensor& in, const Tensor& out) override {
    check(in, "all_gather");
    check(out, "all_gather");
    SWAPOPT_CHECK(out.nbytes() == in.nbytes() * size_t(size_) && in.dtype() == out.dtype(),
                  "[comm] all_gather output " << out.str() << " must hold " << size_ << " x " << in.str());
    comm_args::check_in_out_apart(in, out, "all_gather");
    return submit("all_gather", [this, in, out] {
      auto opts = std::make_unique<gloo::AllgatherOptions>(context_);
      opts->setInput(static_cast<uint8_t*>(in.data_ptr()), in.nbytes());
      opts->setOutput(static_cast<uint8_t*>(out.data_ptr()), out.nbytes());
      opts->setTag(next_tag());
      opts->setTimeout(world_->timeout);
      run_collective(std::move(opts), &gloo::allgather);
    });
  }

  WorkPtr all_reduce(const Tensor& tensor) override {
    check(tensor, "all_reduce");
    SWAPOPT_CHECK(tensor.dtype() == DType::f32, "[comm] all_reduce sums f32 tensors, got " << tensor.str());
    return submit("all_reduce", [this, tensor] { sum_in_place(tensor.data<float>(), size_t(tensor.numel())); });
  }

  // Gloo's reduce-scatter algorithms take per-rank counts and buffers; an all-reduce into a
  // scratch copy, keeping this rank's chunk, is simpler and moves 2x the bytes (fine on the CPU).
  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out) override {
    check(in, "reduce_scatter");
    check(out, "reduce_scatter");
    SWAPOPT_CHECK(in.dtype() == DType::f32 && out.dtype() == DType::f32 && in.numel() == out.numel() * size_,
                  "[comm] reduce_scatter: f32 input of " << size_ << " x the output's elements, got " << in.str() << " -> "
                                                         << out.str());
    comm_args::check_in_out_apart(in, out, "reduce_scatter");
    return submit("reduce_scatter", [this, in, out] {
      const float* src = in.data<float>();
      float* dst = out.data<float>();
      const size_t chunk = size_t(out.numel());
      std::vector<float> scratch(src, src + chunk * size_t(size_));
      sum_in_place(scratch.data(), scratch.size());
      if (chunk > 0) std::memcpy(dst, scratch.data() + chunk * size_t(rank_), chunk * sizeof(float));
    });
  }

  void barrier() override {
    submit("barrier", [this] {
      auto opts = std::make_unique<gloo::BarrierOptions>(context_);
      opts->setTag(next_tag());
      opts->setTimeout(world_->timeout);
      run_collective(std::move(opts), &gloo::barrier);
    })->wait();
  }

  /** The worker, which runs the collectives in issue order, waits for `producer`'s point first. */
  void start_after(Stream& producer) override {
    SWAPOPT_CHECK(producer.device().is_cpu(),
                  "[comm] a gloo collective starts after CPU streams, got one on " << producer.device().str());
    producer_point_.record(producer);
    worker_.wait(producer_point_.impl());
  }

  std::unique_ptr<Communicator> sub_group(const std::vector<int>& ranks, const std::string& name) override {
    int sub_rank = -1;
    for (size_t i = 0; i < ranks.size(); ++i) {
      SWAPOPT_CHECK(ranks[i] >= 0 && ranks[i] < size_ && (i == 0 || ranks[i] > ranks[i - 1]),
                    "[comm] sub_group '" << name << "' needs ascending ranks of a group of " << size_);
      if (ranks[i] == rank_) sub_rank = int(i);
    }
    SWAPOPT_CHECK(sub_rank >= 0, "[comm] rank " << rank_ << " is not in sub_group '" << name << "'");
    std::vector<int> members;
    for (int r : ranks) members.push_back(world_ranks_[size_t(r)]);
    return std::make_unique<GlooCommunicator>(world_, sub_rank, std::move(members), name);
  }

 private:
  void check(const Tensor& t, const char* op) const {
    comm_args::check_usable(t, op);
    SWAPOPT_CHECK(t.device().is_cpu() && t.is_contiguous(),
                  "[comm] " << op << " on gloo needs contiguous CPU tensors, got " << t.str());
  }

  /** One broadcast, run on the worker (broadcast and broadcast_many). */
  void run_broadcast(const Tensor& tensor, int root) {
    auto opts = std::make_unique<gloo::BroadcastOptions>(context_);
    opts->setOutput(static_cast<uint8_t*>(tensor.data_ptr()), tensor.nbytes());
    opts->setRoot(root);
    opts->setTag(next_tag());
    opts->setTimeout(world_->timeout);
    run_collective(std::move(opts), &gloo::broadcast);
  }

  void sum_in_place(float* data, size_t n) {
    auto opts = std::make_unique<gloo::AllreduceOptions>(context_);
    opts->setOutput(data, n);
    opts->setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<float>));
    opts->setTag(next_tag());
    opts->setTimeout(world_->timeout);
    run_collective(std::move(opts), &gloo::allreduce);
  }

  uint32_t next_tag() { return tag_++; }

  /** Runs `fn` on the worker in issue order; its failure names the collective, this rank and its
   *  group, and Gloo's own text (which names the peer's address when a connection failed). */
  WorkPtr submit(const char* collective, std::function<void()> fn) {
    auto work = std::make_shared<GlooWork>();
    worker_.push(
        [work, fn = std::move(fn), collective, where = where_] {
          try {
            fn();
            work->finish({});
          } catch (const std::exception& e) {
            work->finish(std::string("[comm] ") + collective + where + ": " + e.what());
          }
        },
        true);
    return work;
  }

  std::shared_ptr<GlooWorld> world_;
  int rank_;
  int size_;
  std::vector<int> world_ranks_;  // the members' world ranks, in group order
  std::string where_;             // " on rank R of group 'name' (world rank W; ...)"
  std::shared_ptr<gloo::rendezvous::Context> context_;
  uint32_t tag_ = 0;  // only the worker thread touches it
  Event producer_point_{Device::cpu()};  // start_after's mark, captured by the worker's wait
  cpu::CpuStream worker_;  // last: joined first on destruction, while the context still exists
};

}  // namespace

std::unique_ptr<Communicator> make_gloo_communicator(const LaunchEnv& env) {
  SWAPOPT_CHECK(env.timeout.count() > 0, "[comm] the collective timeout must be > 0 ms, got " << env.timeout.count());
  SWAPOPT_CHECK(
      env.rendezvous_timeout.count() >= 0,
      "[comm] the rendezvous timeout must be >= 0 ms (0: the default), got " << env.rendezvous_timeout.count());
  SWAPOPT_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size,
                "[comm] rank " << env.rank << " is outside a world of " << env.world_size);
  std::error_code unreadable;  // a directory that cannot be looked at is not one to use
  SWAPOPT_CHECK(!env.redis.empty() || std::filesystem::is_directory(env.rendezvous_dir, unreadable),
                "[comm] the rendezvous directory '"
                    << env.rendezvous_dir
                    << "' (SWAPOPT_RENDEZVOUS) is not a directory: create it, empty, on "
                       "a filesystem every rank sees, before the ranks start");
  auto world = std::make_shared<GlooWorld>();
  world->timeout = env.timeout;
  // Unset: never shorter than Gloo's own 30 s, so that a short collective limit does not make the
  // start fail when one host comes up a few seconds late.
  world->rendezvous_timeout = env.rendezvous_timeout.count() > 0
                                  ? env.rendezvous_timeout
                                  : std::max<std::chrono::milliseconds>(env.timeout, std::chrono::seconds(30));
  world->run_id = env.run_id;
  world->world_rank = env.rank;
  world->hostname = env.hostname;
  world->store_address = env.redis.empty() ? "the FileStore in '" + env.rendezvous_dir + "'" : "Redis at " + env.redis;
  try {
    if (!env.redis.empty()) {
      const size_t colon = env.redis.rfind(':');
      const std::string port_text = colon == std::string::npos ? "" : env.redis.substr(colon + 1);
      const bool digits = !port_text.empty() && port_text.size() <= 5 &&
                          std::all_of(port_text.begin(), port_text.end(), ::isdigit);
      const int port = digits ? std::stoi(port_text) : 0;
      SWAPOPT_CHECK(port >= 1 && port <= 65535, "[comm] SWAPOPT_REDIS must be host:port, got '" << env.redis << "'");
      // Redis may not be up yet, or a first SYN may be lost: probe it with a bounded connect until
      // the timeout, then report the last failure (the catch below names the address). The probe
      // also spares Gloo's RedisStore a failed connect, whose constructor then leaks its context.
      const std::string host = env.redis.substr(0, colon);
      const auto deadline = std::chrono::steady_clock::now() + world->rendezvous_timeout;
      for (int attempt = 1;; ++attempt) {
        redisContext* probe = redisConnectWithTimeout(host.c_str(), port, timeval{1, 0});
        const std::string failure = probe == nullptr ? "cannot allocate a Redis context" : probe->err ? probe->errstr : "";
        if (probe != nullptr) redisFree(probe);
        if (failure.empty()) break;
        if (std::chrono::steady_clock::now() + std::chrono::milliseconds(200) >= deadline)
          throw std::runtime_error("Connecting to Redis: " + failure + " (" + std::to_string(attempt) + " attempts in " +
                                   std::to_string(world->rendezvous_timeout.count()) + " ms)");
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
      }
      world->store = std::make_shared<gloo::rendezvous::RedisStore>(host, port);
    } else {
      world->store = std::make_shared<gloo::rendezvous::FileStore>(env.rendezvous_dir);
    }
    gloo::transport::tcp::attr attr;
    attr.hostname = env.hostname;
    world->device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    SWAPOPT_FAIL("[comm] gloo setup on world rank " << env.rank << " (" << world->store_address << ", this rank at "
                                                    << env.hostname << "): " << e.what());
  }
  std::vector<int> everyone(size_t(env.world_size));
  for (int r = 0; r < env.world_size; ++r) everyone[size_t(r)] = r;
  return std::make_unique<GlooCommunicator>(world, env.rank, std::move(everyone), "world");
}

}  // namespace swapopt
