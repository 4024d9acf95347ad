#pragma once
//! \file The Optimizer concept: an update rule over flat ranges of (params, grads, state).

#include <array>
#include <concepts>
#include <cstdint>

#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"
#include "loom/core/whole_index.hpp"

namespace loom {

//! The most state slots per parameter an optimizer may keep (Adam: two moments).
inline constexpr int max_optimizer_state_slots = 2;

//! One contiguous range an optimizer updates: part of a parameter tensor (or all of it) with
//! its gradient and its state slots (each slot a range of the optimizer-state buffer). Where the
//! parameters are stored narrower than they compute (bf16), `master` holds their fp32 master
//! copy, which the update steps and rounds into `params`; the state is in the accumulate type.
//! Where the gradients of such parameters are kept in fp32 (TrainerOptions::fp32_gradients),
//! they are in `fp32_grads` and `grads` is empty: an optimizer reads whichever has data.
template <class T>
struct OptimizerSegment {
  Tensor<T> params;
  Tensor<const T> grads;
  Tensor<const accumulate_t<T>> fp32_grads{};  //!< fp32 gradients of bf16 params; empty otherwise
  Tensor<accumulate_t<T>> master{};  //!< fp32 master weights for bf16 params; empty otherwise
  std::array<Tensor<accumulate_t<T>>, max_optimizer_state_slots> state{};
  bool weight_decay = false;  //!< whether the parameter is decayed (AdamW: matrices only)
};

//! An Optimizer knows its state slots per parameter and updates one segment at learning rate
//! `lr` for step `step` (counting from 1). Opt in with `using loom_optimizer = void;`.
template <class O>
concept Optimizer = requires { typename O::loom_optimizer; typename O::Options; } &&
                    requires(const O& o) {
                      { O::state_slots } -> std::convertible_to<int>;
                      requires O::state_slots >= 0 && O::state_slots <= max_optimizer_state_slots;
                      { o.options() } -> std::convertible_to<typename O::Options>;
                    };

//! A segment of one parameter, for optimizers whose update of an element depends on statistics
//! of the whole tensor (Adafactor): the elements, which parameter of the layout they belong to,
//! and where they lie in the whole (tensor-parallel global) tensor.
template <class T>
struct TensorSegment {
  OptimizerSegment<T> elements;
  int parameter = 0;  //!< index into ParameterLayout::entries()
  WholeIndex index{};
};

//! An Optimizer that updates whole tensors rather than independent elements: it keeps state per
//! tensor (`State<B, T>`, built from the backend and the parameter layout, held by the Trainer)
//! and its update reduces statistics over the ranks that share each tensor. Opt in with
//! `static constexpr bool tensorwise = true;`.
template <class O>
concept TensorwiseOptimizer = Optimizer<O> && requires { requires O::tensorwise; };

}  // namespace loom
