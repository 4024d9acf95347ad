#pragma once
//! \file apply_optimizer: runs an optimizer over a contiguous range of the flat buffers, cut at
//! parameter boundaries (each parameter has its own weight decay). The range may be the whole
//! layout (SingleRank, DataParallel) or one rank's shard of it (ZeRO).

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/memory.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/core/tensor.hpp"
#include "loom/core/whole_index.hpp"
#include "loom/optim/concepts.hpp"

namespace loom::detail {

//! Moves the bf16 gradients of the layout elements `ranges`, where `part` stores them, into the
//! fp32 sums `sum` stores (sum += part, part = 0; TrainerOptions::fp32_gradients): what the
//! strategies do with the ranges a layer reads after its backward.
template <class B, class T>
void drain_ranges(B& backend, const std::vector<ElementRange>& ranges, const ParameterView<T>& part,
                  const ParameterView<accumulate_t<T>>& sum) {
  for (const ElementRange& r : ranges)
    drain_into<T>(backend, Tensor<accumulate_t<T>>(sum.at(r.begin, r.size()), Shape{r.size()}),
                  Tensor<T>(part.at(r.begin, r.size()), Shape{r.size()}));
}

//! The elements [begin, end) of the flat layout, and where they live on this rank: element
//! `begin + i` is `params[i]`, `grads[i]` (or `fp32_grads[i]`, where the gradients of bf16
//! parameters are kept in fp32: TrainerOptions::fp32_gradients), `master[i]` (fp32 master
//! weights, where T is bf16) and `state[k * state_stride + i]` for slot k.
template <class T>
struct FlatRange {
  std::int64_t begin = 0, end = 0;
  T* params = nullptr;
  const T* grads = nullptr;
  const accumulate_t<T>* fp32_grads = nullptr;  //!< used instead of `grads` where set
  accumulate_t<T>* state = nullptr;
  std::int64_t state_stride = 0;
  accumulate_t<T>* master = nullptr;
};

//! Training-state arrays are numbered 0 (the parameters) and 1..slots (the optimizer's state
//! slots); `array` must be one of them.
inline void check_state_array(int array, int slots) {
  LOOM_CHECK(array >= 0 && array <= slots, "training state: array", array,
             "must be in [0, " + std::to_string(slots) + "] (the parameters, then each optimizer state slot)");
}

//! `values` (host memory) as T: rounded once where they are wider (fp32 values for bf16
//! parameters), widened where narrower.
template <class T, class U>
std::vector<T> stored_as(const U* values, std::int64_t n) {
  std::vector<T> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = static_cast<T>(values[i]);
  return out;
}

//! The fp32 master weights of parameters stored in bf16 (mixed precision: the optimizer steps
//! the master copy and rounds it into the parameters, so that updates smaller than a bf16 step
//! are not lost). Holds nothing where T is its own accumulate type (float, double). Counted as
//! optimizer state: DESIGN.md's mixed-precision Adam is 2 + 2 bytes of parameters and
//! gradients and 12 of fp32 master weights and moments per parameter.
template <class B, class T>
class MasterWeights {
 public:
  using A = accumulate_t<T>;
  static constexpr bool held = is_narrow_storage<T>;

  MasterWeights(B& backend, std::int64_t elements)
      : backend_(&backend), buffer_(backend, held ? elements : 0, MemoryCategory::optimizer_state) {}

  //! Element i, or nullptr where nothing is held.
  A* data() noexcept { return held ? buffer_.data() : nullptr; }
  //! Sets `n` elements from `offset` from host values of T (widened) or of the accumulate type.
  template <class U>
  void load(std::int64_t offset, const U* values, std::int64_t n) {
    if constexpr (!held) {
      return;
    } else if constexpr (std::is_same_v<U, A>) {
      backend_->copy_from_host(buffer_.data() + offset, values, sizeof(A) * static_cast<std::size_t>(n));
    } else {
      load(offset, stored_as<A>(values, n).data(), n);
    }
  }
  //! Sets the master weights of the layout elements [begin, end), stored from `offset`, to their
  //! initial values in fp32 (the parameters hold the same values rounded to T).
  void initialize(const ParameterLayout& layout, std::int64_t offset, std::int64_t begin, std::int64_t end,
                  std::uint64_t seed) {
    if constexpr (held) {
      std::vector<A> host(static_cast<std::size_t>(end - begin));
      layout.initialize(host.data(), begin, end, seed);
      load(offset, host.data(), end - begin);
    }
  }

 private:
  B* backend_;
  Buffer<A, B> buffer_;
};

//! Calls f(parameter, first, segment) for each parameter of `layout` that `range` holds elements
//! of (padding past the layout's total is left out): the parameter's index in the layout, the
//! flat index in the parameter of the segment's first element, and the segment, with its first
//! `slots` state slots.
template <class T, class F>
void for_each_segment(const ParameterLayout& layout, const FlatRange<T>& range, int slots, F&& f) {
  for (std::size_t p = 0; p < layout.entries().size(); ++p) {
    const auto& e = layout.entries()[p];
    const std::int64_t first = std::max(range.begin, e.offset);
    const std::int64_t last = std::min(range.end, e.offset + e.numel());
    if (first >= last) continue;
    const std::int64_t local = first - range.begin, n = last - first;
    OptimizerSegment<T> s;
    s.params = {range.params + local, Shape{n}};
    if (range.fp32_grads != nullptr)
      s.fp32_grads = {range.fp32_grads + local, Shape{n}};
    else
      s.grads = {range.grads + local, Shape{n}};
    for (int k = 0; k < slots; ++k)
      s.state[k] = {range.state + k * range.state_stride + local, Shape{n}};
    if (range.master != nullptr) s.master = {range.master + local, Shape{n}};
    s.weight_decay = e.spec.weight_decay;
    f(p, first - e.offset, s);
  }
}

//! Applies element-wise `optimizer` at learning rate `lr` for step `step` to every parameter
//! element of `range` (elements past the layout's total, padding, are left alone).
//! An optimizer that has update_segments (AdamW: a few launches on a GPU instead of one per
//! segment) gets them all in one call.
template <class O, class B, class T>
void apply_optimizer(const O& optimizer, B& backend, const ParameterLayout& layout,
                     const FlatRange<T>& range, double lr, std::int64_t step) {
  if constexpr (requires(std::span<const OptimizerSegment<T>> all) {
                  optimizer.update_segments(backend, all, lr, step);
                }) {
    std::vector<OptimizerSegment<T>> all;
    for_each_segment(layout, range, O::state_slots,
                     [&](std::size_t, std::int64_t, const OptimizerSegment<T>& s) { all.push_back(s); });
    optimizer.update_segments(backend, std::span<const OptimizerSegment<T>>(all), lr, step);
  } else {
    for_each_segment(layout, range, O::state_slots, [&](std::size_t, std::int64_t, const OptimizerSegment<T>& s) {
      optimizer.update(backend, s, lr, step);
    });
  }
}

//! The segments of `ranges` as TensorSegments (for a TensorwiseOptimizer), in range order.
template <class T>
std::vector<TensorSegment<T>> tensor_segments(const ParameterLayout& layout, std::span<const FlatRange<T>> ranges) {
  std::vector<TensorSegment<T>> out;
  for (const FlatRange<T>& range : ranges)
    for_each_segment(layout, range, 0, [&](std::size_t p, std::int64_t first, const OptimizerSegment<T>& s) {
      out.push_back(
          {.elements = s, .parameter = static_cast<int>(p), .index = whole_index(layout.entries()[p].spec, first)});
    });
  return out;
}

//! The sum of squares of the gradients of `range` (parameter elements only), skipping the
//! parameters replicated over the tensor-parallel group unless `count_replicated`: the ranks
//! of a TP group hold identical copies of those, and the group's norm must count them once.
//! Tied copies (ParameterSpec::tied_copy) are always skipped: their owner stage counts them.
template <class B, class T>
double gradient_sum_of_squares(B& backend, const ParameterLayout& layout, const FlatRange<T>& range,
                               bool count_replicated) {
  if (range.fp32_grads != nullptr) {
    FlatRange<accumulate_t<T>> wide{.begin = range.begin, .end = range.end, .grads = range.fp32_grads};
    return gradient_sum_of_squares(backend, layout, wide, count_replicated);
  }
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
