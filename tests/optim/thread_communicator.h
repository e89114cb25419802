#pragma once
// An in-process Communicator whose ranks are threads: collectives copy between the ranks' tensors
// directly (on any one device), so sharded HSDP runs in one process, on the CPU or on one GPU.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "swapopt/swapopt.h"

namespace swapopt::test {

/** The rendezvous of one group of threads: every collective is deposit, barrier, read, barrier. */
class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), slots_(size_t(size)) {}
  /** Publishes `mine` as rank `rank`'s tensor, runs `read` once every rank has published (it may
   *  read all of them), and returns once every rank has finished reading. */
  void exchange(int rank, const Tensor* mine, const std::function<void(const std::vector<const Tensor*>&)>& read) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slots_[size_t(rank)] = mine;
    }
    barrier();
    read(slots_);
    barrier();
  }

 private:
  /** Throws after a minute, so that a rank that failed never hangs the others. */
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return generation_ != generation; })) {
      throw Error("[threads] a rank did not reach the barrier within 60 s");
    }
  }

  int size_;
  std::vector<const Tensor*> slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

/** Groups by name, shared by every rank of one in-process job. */
struct ThreadWorld {
  std::mutex mutex;
  std::map<std::string, std::shared_ptr<ThreadGroup>> groups;

  std::shared_ptr<ThreadGroup> group(const std::string& name, int size) {
    std::lock_guard<std::mutex> lock(mutex);
    auto& g = groups[name];
    if (!g) g = std::make_shared<ThreadGroup>(size);
    return g;
  }
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadWorld> world, const std::string& name, int rank, int size)
      : world_(std::move(world)), group_(world_->group(name, size)), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "threads"; }

  WorkPtr broadcast(const Tensor& tensor, int root) override {
    group_->exchange(rank_, &tensor, [&](const std::vector<const Tensor*>& all) {
      if (rank_ != root) copy(*all[size_t(root)], tensor);
    });
    return done();
  }
  WorkPtr all_gather(const Tensor& in, const Tensor& out) override {
    const int64_t n = in.numel();
    group_->exchange(rank_, &in, [&](const std::vector<const Tensor*>& all) {
      for (int r = 0; r < size_; ++r) copy(all[size_t(r)]->view({n}), out.view({n * size_}).narrow(0, r * n, n));
    });
    return done();
  }
  WorkPtr all_reduce(const Tensor& tensor) override {
    const Tensor sum = summed(tensor);
    copy(sum, tensor);  // after every rank has read the inputs
    return done();
  }
  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out) override {
    const Tensor sum = summed(in);
    copy(sum.view({in.numel()}).narrow(0, rank_ * out.numel(), out.numel()), out.view({out.numel()}));
    return done();
  }
  void barrier() override {
    group_->exchange(rank_, nullptr, [](const std::vector<const Tensor*>&) {});
  }
  std::unique_ptr<Communicator> sub_group(const std::vector<int>& ranks, const std::string& name) override {
    const int sub_rank = int(std::find(ranks.begin(), ranks.end(), rank_) - ranks.begin());
    return std::make_unique<ThreadCommunicator>(world_, name, sub_rank, int(ranks.size()));
  }

 private:
  struct Done final : Work {
    void wait() override {}
  };
  static WorkPtr done() { return std::make_shared<Done>(); }

  static void copy(const Tensor& src, const Tensor& dst) {
    Stream s(dst.device());
    ops::copy(s, src, dst);
    s.synchronize();
  }
  /** The elementwise sum of every rank's `tensor` (f32), in a new tensor of this rank. */
  Tensor summed(const Tensor& tensor) {
    const Tensor sum = Tensor::zeros(tensor.shape(), DType::f32, tensor.device());
    group_->exchange(rank_, &tensor, [&](const std::vector<const Tensor*>& all) {
      Stream s(tensor.device());
      for (const Tensor* t : all) ops::axpby(s, 1.f, *t, 1.f, sum);
      s.synchronize();
    });
    return sum;
  }

  std::shared_ptr<ThreadWorld> world_;
  std::shared_ptr<ThreadGroup> group_;
  int rank_, size_;
};

/** Runs fn(rank) on `ranks` threads at once; returns each rank's error text ("" when it returned). */
inline std::vector<std::string> run_on_thread_ranks(int ranks, const std::function<void(int rank)>& fn) {
  std::vector<std::string> errors(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < ranks; ++rank)
    threads.emplace_back([&, rank] {
      try {
        fn(rank);
      } catch (const std::exception& e) {
        errors[size_t(rank)] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  return errors;
}

/** What a RecordingCommunicator saw, shared by a communicator and its sub-groups. */
struct CallLog {
  std::vector<std::string> calls;  ///< "start_after", "issue", "finish_before", "wait"
  int issued = 0;                  ///< collectives issued so far
  int fail_issue = -1;             ///< the wait of the collective issued as number fail_issue throws
  int fail_order = -1;             ///< the finish_before of the collective issued as number fail_order throws
};

/** Wraps a communicator (and its sub-groups) and logs what the optimizer asks: "start_after",
 *  "issue" (each collective), "finish_before" and "wait" (the host waits on a collective). One
 *  collective's wait can be made to fail (CallLog::fail_issue). */
class RecordingCommunicator final : public Communicator {
 public:
  RecordingCommunicator(std::shared_ptr<Communicator> inner, std::shared_ptr<CallLog> log)
      : inner_(std::move(inner)), log_(std::move(log)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  WorkPtr broadcast(const Tensor& tensor, int root) override { return issued(inner_->broadcast(tensor, root)); }
  WorkPtr broadcast_many(const std::vector<Tensor>& tensors, const std::vector<int>& roots) override {
    return issued(inner_->broadcast_many(tensors, roots));
  }
  WorkPtr all_gather(const Tensor& in, const Tensor& out) override { return issued(inner_->all_gather(in, out)); }
  WorkPtr reduce_scatter(const Tensor& in, const Tensor& out) override {
    return issued(inner_->reduce_scatter(in, out));
  }
  WorkPtr all_reduce(const Tensor& tensor) override { return issued(inner_->all_reduce(tensor)); }
  void barrier() override { inner_->barrier(); }
  void start_after(Stream& producer) override {
    log_->calls.push_back("start_after");
    inner_->start_after(producer);
  }
  std::unique_ptr<Communicator> sub_group(const std::vector<int>& ranks, const std::string& name) override {
    return std::make_unique<RecordingCommunicator>(inner_->sub_group(ranks, name), log_);
  }

 private:
  struct Recorded final : Work {
    Recorded(WorkPtr inner, std::shared_ptr<CallLog> log, bool fail, bool fail_order)
        : inner(std::move(inner)), log(std::move(log)), fail(fail), fail_order(fail_order) {}
    void wait() override {
      log->calls.push_back("wait");
      inner->wait();
      if (fail) throw Error("[test] injected collective failure");
    }
    void finish_before(Stream& consumer) override {
      log->calls.push_back("finish_before");
      if (fail_order) throw Error("[test] injected failure to order a stream");
      inner->finish_before(consumer);
    }
    WorkPtr inner;
    std::shared_ptr<CallLog> log;
    bool fail, fail_order;
  };
  WorkPtr issued(WorkPtr work) {
    log_->calls.push_back("issue");
    const int index = log_->issued++;
    return std::make_shared<Recorded>(std::move(work), log_, index == log_->fail_issue, index == log_->fail_order);
  }

  std::shared_ptr<Communicator> inner_;
  std::shared_ptr<CallLog> log_;
};

}  // namespace swapopt::test
