#pragma once
// Backend interface behind Stream and Event (internal).

#include <functional>
#include <memory>

#include "swapopt/core/device.h"

namespace swapopt {

class EventImpl;

class StreamImpl {
 public:
  virtual ~StreamImpl() = default;
  virtual Device device() const = 0;
  virtual void wait(EventImpl& event) = 0;
  virtual void synchronize() = 0;
  virtual void* native_handle() const = 0;
  virtual void enqueue(std::function<void()> fn) = 0;
};

class EventImpl {
 public:
  virtual ~EventImpl() = default;
  virtual void record(StreamImpl& stream) = 0;
  virtual bool query() const = 0;
  virtual void synchronize() const = 0;
  virtual void* native_handle() const = 0;
  virtual double elapsed_ms_since(const EventImpl& start) const = 0;
};

}  // namespace swapopt
