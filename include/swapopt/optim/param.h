#pragma once
/** A trainable parameter as the optimizers see it: its values, its gradient, its layout. */

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
  std::string name;
  Tensor data;
  Tensor grad;
  std::optional<DTensor> layout;

  /** The full shape: the DTensor's logical shape, or data's shape. */
  const Shape& logical_shape() const { return layout ? layout->logical_shape() : data.shape(); }
  bool has_grad() const { return grad.defined(); }
};

using ParamPtr = std::shared_ptr<Param>;

/** A named parameter holding `data` (no gradient yet). */
inline ParamPtr make_param(std::string name, Tensor data) {
  auto p = std::make_shared<Param>();
  p->name = std::move(name);
  p->data = std::move(data);
  return p;
}

}  // namespace swapopt
