#pragma once
/** A trainable parameter as the optimizers see it: its values, its gradient, its layout. */

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "swapopt/core/dtensor.h"
#include "swapopt/core/tensor.h"

namespace swapopt {

/** The trainer owns the values and sets `grad` before each step (undefined: no gradient, the
 *  parameter is skipped and gets no state). For a distributed parameter, `data` is the local shard
 *  and `layout` its DTensor (mesh, placements, logical shape). */
struct Param {
  /** Non-empty, valid UTF-8, unique within an optimizer and fixed once added to one: checkpoints
   *  name and check state by it (a save or load after a rename throws, naming both names). */
  std::string name;
  /** The values (a distributed param: this rank's shard); defined, contiguous and on the
   *  optimizer's device. step() updates it in place. */
  Tensor data;
  /** The gradient: data's shape, contiguous, on its device, any dtype; undefined: none. */
  Tensor grad;
  /** The DTensor of a distributed param (its shard is `data`); unset for a local one. */
  std::optional<DTensor> layout;

  /** The full shape: the DTensor's logical shape, or data's shape. */
  const Shape& logical_shape() const { return layout ? layout->logical_shape() : data.shape(); }
  /** Whether grad is defined: the param takes part in the next step. */
  bool has_grad() const { return grad.defined(); }
};

/** How optimizers hold params: shared with the trainer, which sets the grads through it. */
using ParamPtr = std::shared_ptr<Param>;

/** A named parameter holding `data` (no gradient yet). */
inline ParamPtr make_param(std::string name, Tensor data) {
  auto p = std::make_shared<Param>();
  p->name = std::move(name);
  p->data = std::move(data);
  return p;
}

namespace detail {
/** The bytes [begin, end) of one of a param's tensors (internal: the optimizers keep their params'
 *  data sorted by address for the step's memory-sharing checks). */
struct ParamBytes {
  uintptr_t begin = 0;           ///< The first byte.
  uintptr_t end = 0;             ///< One past the last byte.
  const Param* param = nullptr;  ///< The param whose tensor they are.
};
}  // namespace detail

}  // namespace swapopt
