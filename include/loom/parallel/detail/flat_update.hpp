#pragma once
//! \file apply_optimizer: runs an optimizer over a contiguous range of the flat buffers, cut at
//! parameter boundaries (each parameter has its own weight decay). The range may be the whole
//! layout (SingleRank, DataParallel) or one rank's shard of it (ZeRO).

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "loom/core/parameters.hpp"
#include "loom/core/tensor.hpp"
#include "loom/optim/concepts.hpp"

namespace loom::detail {

//! The elements [begin, end) of the flat layout, and where they live on this rank: element
//! `begin + i` is `params[i]`, `grads[i]`, and `state[k * state_stride + i]` for slot k.
template <class T>
struct FlatRange {
  std::int64_t begin = 0, end = 0;
  T* params = nullptr;
  const T* grads = nullptr;
  T* state = nullptr;
  std::int64_t state_stride = 0;
};

//! Applies `optimizer` at learning rate `lr` for step `step` to every parameter element of
//! `range` (elements past the layout's total, padding, are left alone).
template <class O, class B, class T>
void apply_optimizer(const O& optimizer, B& backend, const ParameterLayout& layout,
                     const FlatRange<T>& range, double lr, std::int64_t step) {
  for (const auto& e : layout.entries()) {
    const std::int64_t first = std::max(range.begin, e.offset);
    const std::int64_t last = std::min(range.end, e.offset + e.numel());
    if (first >= last) continue;
    const std::int64_t local = first - range.begin, n = last - first;
    OptimizerSegment<T> s;
    s.params = {range.params + local, Shape{n}};
    s.grads = {range.grads + local, Shape{n}};
    for (int k = 0; k < O::state_slots; ++k)
      s.state[k] = {range.state + k * range.state_stride + local, Shape{n}};
    s.weight_decay = e.spec.weight_decay;
    optimizer.update(backend, s, lr, step);
  }
}

//! The sum of squares of the gradients of `range` (parameter elements only), skipping the
//! parameters replicated over the tensor-parallel group unless `count_replicated`: the ranks
//! of a TP group hold identical copies of those, and the group's norm must count them once.
//! Tied copies (ParameterSpec::tied_copy) are always skipped: their owner stage counts them.
template <class B, class T>
double gradient_sum_of_squares(B& backend, const ParameterLayout& layout, const FlatRange<T>& range,
                               bool count_replicated) {
  // One call over all the ranges: a device backend waits for its stream once, not per parameter.
  std::vector<Tensor<const T>> parts;
  parts.reserve(layout.entries().size());
  for (const auto& e : layout.entries()) {
    if (e.spec.tied_copy || (!count_replicated && e.spec.replicated_over_tensor_parallel())) continue;
    const std::int64_t first = std::max(range.begin, e.offset);
    const std::int64_t last = std::min(range.end, e.offset + e.numel());
    if (first >= last) continue;
    parts.emplace_back(range.grads + (first - range.begin), Shape{last - first});
  }
  return sum_of_squares<T>(backend, std::span<const Tensor<const T>>(parts));
}

}  // namespace loom::detail
