#pragma once
//! \file The conjugate operators of Megatron-style tensor parallelism (Megatron's f and g), as
//! named in-place operations on a tensor-parallel group. A column-parallel linear layer splits
//! its output features: its input is replicated (f: identity forward) and each rank's input
//! gradient is a partial sum (f: all-reduce backward). A row-parallel linear layer splits its
//! input features: each rank's output is a partial sum (g: all-reduce forward) and the output
//! gradient is replicated (g: identity backward). The identities need no call; the two
//! all-reduces are these functions. A group of one rank makes them no-ops.
//!
//! Sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large
//! Transformer Models") splits the rows of the hidden state between the layers over the same
//! group: f becomes an all-gather of the rows forward (its backward a reduce-scatter) and g a
//! reduce-scatter forward (its backward an all-gather), the same bytes on the wire as the two
//! all-reduces, which are each a reduce-scatter plus an all-gather.

#include <cstddef>
#include <span>

#include "loom/comm/concepts.hpp"
#include "loom/comm/ref.hpp"
#include "loom/core/error.hpp"
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

//! Sequence-parallel f forward (and g backward): every rank's `local` rows [n, ...] are gathered
//! into `full` [size·n, ...] in rank order.
template <CommScalar T>
void gather_sequence(CommunicatorRef& group, Tensor<const T> local, Tensor<T> full) {
  LOOM_CHECK(full.numel() == local.numel() * group.size(), "gather_sequence: full tensor elements", full.numel(),
             "must be the group's size (" + detail::to_text(group.size()) + ") times the local rows' " +
                 detail::to_text(local.numel()));
  group.all_gather(std::span<const T>(local.data(), static_cast<std::size_t>(local.numel())),
                   std::span<T>(full.data(), static_cast<std::size_t>(full.numel())));
}

//! Sequence-parallel g forward (and f backward): the partial sums `partial` [size·n, ...] are
//! summed over the group and rank r keeps rows [r·n, (r+1)·n) of the sum in `local` (which may be
//! that slice of `partial`: in place).
template <CommScalar T>
void reduce_scatter_sequence(CommunicatorRef& group, Tensor<const T> partial, Tensor<T> local) {
  LOOM_CHECK(partial.numel() == local.numel() * group.size(), "reduce_scatter_sequence: partial tensor elements",
             partial.numel(),
             "must be the group's size (" + detail::to_text(group.size()) + ") times the local rows' " +
                 detail::to_text(local.numel()));
  group.reduce_scatter(std::span<const T>(partial.data(), static_cast<std::size_t>(partial.numel())),
                       std::span<T>(local.data(), static_cast<std::size_t>(local.numel())), ReduceOp::sum);
}

}  // namespace loom::nn
