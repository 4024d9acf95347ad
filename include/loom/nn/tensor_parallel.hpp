#pragma once
//! \file The conjugate operators of Megatron-style tensor parallelism (Megatron's f and g), as
//! named in-place operations on a tensor-parallel group. A column-parallel linear layer splits
//! its output features: its input is replicated (f: identity forward) and each rank's input
//! gradient is a partial sum (f: all-reduce backward). A row-parallel linear layer splits its
//! input features: each rank's output is a partial sum (g: all-reduce forward) and the output
//! gradient is replicated (g: identity backward). The identities need no call; the two
//! all-reduces are these functions. A group of one rank makes them no-ops.

#include <cstddef>
#include <span>

#include "loom/comm/concepts.hpp"
#include "loom/comm/ref.hpp"
#include "loom/core/tensor.hpp"

namespace loom::nn {

//! Sums `partial` over `group` in place, so that every rank holds the full value; a group of one
//! rank leaves it as it is.
template <CommScalar T>
void sum_over_tensor_parallel(CommunicatorRef& group, Tensor<T> partial) {
  if (group.size() > 1 && partial.numel() > 0)
    group.all_reduce(std::span<T>(partial.data(), static_cast<std::size_t>(partial.numel())), ReduceOp::sum);
}

//! g forward: the output of a row-parallel linear layer (partial sums over its input-feature
//! slice) becomes the full output on every rank.
template <CommScalar T>
void row_parallel_output(CommunicatorRef& group, Tensor<T> partial_output) {
  sum_over_tensor_parallel(group, partial_output);
}

//! f backward: the input gradient of a column-parallel linear layer (partial sums over its
//! output-feature slice) becomes the full input gradient on every rank.
template <CommScalar T>
void column_parallel_input_grad(CommunicatorRef& group, Tensor<T> partial_input_grad) {
  sum_over_tensor_parallel(group, partial_input_grad);
}

}  // namespace loom::nn
