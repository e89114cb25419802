#pragma once
/** Ordered work queues (streams) and completion marks (events), with CUDA's semantics on both backends.
 *
 * CUDA: a Stream is a cudaStream_t created non-blocking (ordered with other streams, the legacy
 * default stream included, only through events), or one borrowed from the trainer, and an Event a
 * timing-free cudaEvent_t.
 * CPU: a Stream is a worker thread running its queue in order; an Event marks the point in a queue
 * where it was recorded; Stream::wait(e) holds the stream until that point completes. Code written
 * against this interface (the swap pipeline) therefore runs with the same orderings on both.
 */

#include <cstdint>
#include <functional>
#include <memory>

#include "swapopt/core/device.h"

namespace swapopt {

class StreamImpl;
class EventImpl;
class Event;

/** A queue of asynchronous work on one device. Copyable handle; the queue lives while a copy does. */
class Stream {
 public:
  /** Creates a new stream on `device` (CUDA: non-blocking; CPU: starts a worker thread). Work on
   *  it is ordered with other streams only through wait(Event). */
  explicit Stream(Device device);
  /** Wraps a stream the caller owns, without owning it: a cudaStream_t of CUDA `device` (any:
   *  blocking, non-blocking, or 0 for the legacy default stream), or (the CPU stand-in, for tests
   *  of the same contract) the native_handle() of a CPU stream. swapopt's work on it is ordered
   *  with the caller's own work there. The caller keeps it alive while any swapopt object uses it
   *  and destroys it itself. A wrapper that runs a GEMM or SYRK makes a cuBLAS handle of its own
   *  (its destruction synchronises the device): keep such a wrapper. */
  static Stream borrow(void* native_handle, Device device);
  /** The device this stream's work runs on. */
  Device device() const;
  /** Work enqueued after this call starts only after the work recorded in `event` has finished.
   *  On the CPU, an event recorded behind a failed task completes all the same: the failure stays
   *  on its own stream (its synchronize() throws it), it does not reach this one. */
  void wait(const Event& event);
  /** Blocks the host until all enqueued work is done; rethrows the first error raised by CPU work
   *  (once). On a CPU stream the work queued after a failed task is skipped until then. Called
   *  from one of the stream's own tasks it throws instead of waiting for itself forever. */
  void synchronize();
  /** cudaStream_t for CUDA streams; for CPU streams the queue (what borrow() takes). */
  void* native_handle() const;
  /** CPU only: runs `fn` on the worker thread after everything enqueued before it (skipped if an
   *  earlier task failed and synchronize() has not reported it yet). `fn` must not synchronise
   *  this stream, nor copy through the default stream (clone(), to()) when this is it. */
  void enqueue(std::function<void()> fn);
  /** The backend object behind the handle, for swapopt's backends (StreamImpl is only declared
   *  in the public headers). */
  StreamImpl& impl() const { return *impl_; }
  /** True when both handles share one backend object: copies of one Stream. Two borrow()
   *  wrappers of one CUDA stream are not equal. */
  bool operator==(const Stream& other) const { return impl_ == other.impl_; }

 private:
  explicit Stream(std::shared_ptr<StreamImpl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<StreamImpl> impl_;
};

/** The process-wide stream used by synchronous helpers (Tensor::to, zeros) on `device`. */
Stream& default_stream(Device device);

/** A completion mark. Record on a stream; others wait on it; the host can synchronize on it. */
class Event {
 public:
  /** With `enable_timing`, elapsed_ms() can measure between two such events. */
  explicit Event(Device device, bool enable_timing = false);
  /** The device given at construction; the event is recorded only on streams of it. */
  Device device() const;
  /** Marks the current end of `stream`'s queue; replaces any earlier record. */
  void record(Stream& stream);
  /** True when the last recorded point has completed (or the event was never recorded). */
  bool query() const;
  /** Blocks the host until the last recorded point has completed. */
  void synchronize() const;
  /** Milliseconds from `start` completing to this event completing; both timing events (else a
   *  named error, on every backend), recorded and complete (synchronize first). */
  double elapsed_ms(const Event& start) const;
  /** The backend object behind the handle, for swapopt's backends (EventImpl is only declared
   *  in the public headers). */
  EventImpl& impl() const { return *impl_; }

 private:
  std::shared_ptr<EventImpl> impl_;
  Device device_;
  bool timing_ = false;
};

/** Counts of stream and event handles created so far, to assert that hot paths create none. */
struct HandleStats {
  uint64_t streams_created = 0;  ///< Streams created by Stream(Device); borrow() wrappers do not count.
  uint64_t events_created = 0;   ///< Events created, timing or not.
};
/** The process-wide counts so far (every thread's). */
HandleStats handle_stats();

}  // namespace swapopt
