#pragma once
/** Fused elementwise optimizer updates, on both backends, asynchronous on a stream (see core/ops.h
 *  for the conventions). Math in f32 with each step rounded as written below: both backends call
 *  the functions of core/elementwise_formulas.h, so their results are bitwise equal. */

#include <span>

#include "swapopt/core/elementwise_formulas.h"
#include "swapopt/core/stream.h"
#include "swapopt/core/tensor.h"

namespace swapopt::ops {

/** Muon momentum, SGD form: u = g + m1*buf; buf = m2*buf + g; with nesterov u = m1*u + g.
 *  Writes out_buf in place and out_update (any dtype: the Newton-Schulz input). All tensors
 *  contiguous and of one shape. */
void muon_momentum(Stream& stream, const Tensor& grad, const Tensor& out_buf, const Tensor& out_update, float m1, float m2,
                   bool nesterov);

/** Per-step scalars of AdamW (see core/elementwise_formulas.h). */
using AdamWScalars = formula::AdamWScalars;

/** torch.optim.AdamW's single-tensor update, in its order:
 *  p *= decay; m = lerp(m, g, 1-b1); v = v*b2 + ((1-b2)*g)*g; [vmax = max(vmax, v); use vmax];
 *  p += (neg_step_size * m) / (sqrt(v)/bc2_sqrt + eps). out_max_exp_avg_sq may be undefined
 *  (no amsgrad). State tensors f32; param and grad any dtype. */
void adamw_update(Stream& stream, const Tensor& out_param, const Tensor& grad, const Tensor& out_exp_avg,
                  const Tensor& out_exp_avg_sq, const Tensor& out_max_exp_avg_sq, const AdamWScalars& scalars);

/** The arguments of one adamw_update. */
struct AdamWUpdate {
  Tensor param;           ///< Updated in place.
  Tensor grad;            ///< The param's shape, any dtype.
  Tensor exp_avg;         ///< f32, updated in place.
  Tensor exp_avg_sq;      ///< f32, updated in place.
  Tensor max_exp_avg_sq;  ///< f32, updated in place; undefined without amsgrad.
  AdamWScalars scalars;   ///< This tensor's step's scalars.
};

/** adamw_update on each tensor of `updates`, with the same bits. Every update's arguments are
 *  checked before any work is queued. The updates run concurrently: no two may write the same
 *  memory, and no grad may be another update's param or state (one grad read by several is
 *  fine; optimizers reject params that share memory). On the CPU backend
 *  the whole list is one task whose elements are split over the OpenMP threads, so that many
 *  small params (norms, biases, expert vectors) share them, where a single small update runs on
 *  one thread; on CUDA the tensors of one kind (param dtype, grad dtype, amsgrad) go to one
 *  kernel launch per 24 tensors (a block per 8192-element chunk), where adamw_update is a launch
 *  per tensor. */
void adamw_update_many(Stream& stream, std::span<const AdamWUpdate> updates);

}  // namespace swapopt::ops
