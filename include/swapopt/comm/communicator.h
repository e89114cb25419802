#pragma once
/** Collectives over a group of ranks, asynchronous with work handles. NCCL on CUDA, Gloo on the CPU. */

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "swapopt/core/device.h"
#include "swapopt/core/tensor.h"

namespace swapopt {

class Stream;

/** A collective in flight. wait() blocks until it completed and rethrows its error;
 *  finish_before() orders a stream after it without blocking the host. */
class Work {
 public:
  virtual ~Work() = default;
  /** Blocks the host until the collective has completed (NCCL: on the device); throws
   *  swapopt::Error when it failed or timed out. May be called more than once. */
  virtual void wait() = 0;
  /** Work enqueued on `consumer` after this call starts only once the collective has completed,
   *  without blocking the host where the backend can order streams: NCCL makes `consumer` (a CUDA
   *  stream of the communicator's device) wait on the collective's event, Gloo queues the wait on
   *  `consumer` (a CPU stream). Errors and timeouts surface in wait() (Gloo: also in `consumer`'s
   *  synchronize()), so call wait() for every work ordered this way, also after another one
   *  failed, before synchronising `consumer`: on NCCL that wait's timeout is what aborts a stuck
   *  communicator and so releases the streams waiting on it. NCCL throws when the collective
   *  already failed (after ordering the stream: an aborted collective still ends). This default
   *  waits on the host. */
  virtual void finish_before(Stream& consumer) {
    (void)consumer;
    wait();
  }
};
/** Shared handle to a collective in flight, as every collective returns it. */
using WorkPtr = std::shared_ptr<Work>;

/** Waits for every work in order, each one even after another failed (on NCCL a stuck
 *  collective is aborted only by its own wait's timeout), then rethrows the first error. */
void wait_every(const std::vector<WorkPtr>& works);

/** Ranks 0..size()-1 of one group. Every rank must issue the same collectives in the same order;
 *  each collective fails with "[comm] <collective> on rank R: ..." when a peer is gone or the
 *  timeout passes, never hangs. Tensors are contiguous and written before the collective is issued
 *  (or on a stream passed to start_after() first). They stay allocated until it completed: until
 *  wait(), or (CUDA) freed in order on a stream passed to Work::finish_before(); Gloo holds its
 *  tensors itself until its collective ran. One thread at a time issues a communicator's
 *  collectives and start_after() (NCCL: they share the communicator's stream and its start
 *  event); a work's wait() may run on any thread. */
class Communicator {
 public:
  virtual ~Communicator() = default;
  /** This rank's index in the group, in [0, size()). */
  virtual int rank() const = 0;
  /** Number of ranks in the group. */
  virtual int size() const = 0;
  /** "gloo" or "nccl". */
  virtual std::string backend() const = 0;

  /** tensor on every rank = tensor on `root`. */
  virtual WorkPtr broadcast(const Tensor& tensor, int root) = 0;
  /** tensors[i] on every rank = tensors[i] on roots[i], as one operation: NCCL issues them as one
   *  group (ncclGroupStart/End), Gloo as one task. Every rank passes the same roots and sizes in
   *  the same order; the tensors must not overlap. NCCL and Gloo check all before issuing any;
   *  this default issues one broadcast after another. */
  virtual WorkPtr broadcast_many(const std::vector<Tensor>& tensors, const std::vector<int>& roots);
  /** out = concat over ranks of `in` (out has size() * in.numel() elements; in and out share no
   *  memory). Every collective refuses an undefined or released tensor before it issues anything. */
  virtual WorkPtr all_gather(const Tensor& in, const Tensor& out) = 0;
  /** out = this rank's chunk of the elementwise sum of `in` over ranks (in has size() * out.numel();
   *  in and out share no memory). */
  virtual WorkPtr reduce_scatter(const Tensor& in, const Tensor& out) = 0;
  /** tensor = elementwise sum over ranks. */
  virtual WorkPtr all_reduce(const Tensor& tensor) = 0;
  /** Returns when every rank has reached it. */
  virtual void barrier() = 0;
  /** Collectives issued after this call start only once the work enqueued on `producer` so far
   *  has completed, without blocking the host where the backend can order streams (NCCL: its
   *  stream waits on an event of `producer`, a CUDA stream of the same device, which orders every
   *  communicator sharing that stream, sub-groups included; Gloo: its worker waits on a CPU
   *  stream). This default synchronizes `producer` on the host. */
  virtual void start_after(Stream& producer);
  /** A communicator over `ranks` (ranks of this group, ascending, this rank among them); every rank
   *  of `ranks` must call it with the same list, `name` unique per group. */
  virtual std::unique_ptr<Communicator> sub_group(const std::vector<int>& ranks, const std::string& name) = 0;
};

/** How ranks find each other, like torchrun: RANK, WORLD_SIZE, LOCAL_RANK, plus either
 *  SWAPOPT_RENDEZVOUS (a directory on a filesystem every rank sees) or SWAPOPT_REDIS ("host:port");
 *  SWAPOPT_HOSTNAME is the address the other ranks reach this one at (set it across hosts),
 *  SWAPOPT_TIMEOUT_MS the limit on every collective. */
struct LaunchEnv {
  int rank = 0;        ///< RANK (required): this process's rank among all ranks.
  int world_size = 1;  ///< WORLD_SIZE (required): the number of ranks.
  int local_rank = 0;  ///< LOCAL_RANK (default: RANK): the GPU device() picks on this host.
  std::string rendezvous_dir{};        ///< SWAPOPT_RENDEZVOUS: Gloo's FileStore directory
  std::string redis{};                 ///< SWAPOPT_REDIS, "host:port"; takes precedence over rendezvous_dir
  std::string hostname = "127.0.0.1";  ///< SWAPOPT_HOSTNAME: this rank's address for the TCP transport
  /** SWAPOPT_TIMEOUT_MS (default 30 s): the limit on each collective of make_gloo_communicator's
   *  communicator and its sub-groups (NCCL takes its own `timeout`). */
  std::chrono::milliseconds timeout{30000};
  /** SWAPOPT_RENDEZVOUS_TIMEOUT_MS (0, the default: the longer of `timeout` and 30 s): how long
   *  each wait of a group's rendezvous waits for all its ranks (and the first connection to Redis
   *  is retried). A restarted job wants it longer than a collective's limit: its ranks come back
   *  at different times. */
  std::chrono::milliseconds rendezvous_timeout{0};
  /** SWAPOPT_RUN_ID (default empty): a prefix of every rendezvous key. Each attempt of a restarted
   *  job takes a new one (scripts/swapopt-launch sets "<job>.<attempt>"), so that it never meets
   *  the keys a failed attempt left in the store. */
  std::string run_id{};

  /** Reads the variables above; throws naming a missing or bad one. */
  static LaunchEnv from_environment();
  /** This rank's device: cuda:LOCAL_RANK when CUDA devices are visible (throws when LOCAL_RANK is
   *  not one of them), else the CPU. Pass it to use_device() and to the streams. */
  Device device() const;
};

/** The Gloo (TCP) communicator of all ranks of `env`. */
std::unique_ptr<Communicator> make_gloo_communicator(const LaunchEnv& env);

/** True when swapopt was built with the NCCL communicator. */
bool nccl_built();

/** An NCCL communicator over the ranks of `bootstrap` (a Gloo communicator of the same ranks, used
 *  to exchange NCCL ids, here and for sub-groups), running its collectives on `stream` (a CUDA
 *  stream of this rank's device; its sub-groups share it). Tensors live on that device.
 *  Work::wait() polls for completion and for NCCL's asynchronous errors and aborts the
 *  communicator once the collective has run `timeout` without completing, counted from when the
 *  stream reached it (the host may enqueue a whole step ahead of the device), or when the stream
 *  has not reached it 4 x `timeout` after the wait began (something outside the waits holds the
 *  stream: wait for every earlier collective on it first, in issue order). */
std::unique_ptr<Communicator> make_nccl_communicator(std::shared_ptr<Communicator> bootstrap, const Stream& stream,
                                                     std::chrono::milliseconds timeout);

}  // namespace swapopt
