#pragma once
//! \file The Strategy concept: how parameters, gradients and optimizer state are held and
//! reduced across the data-parallel group.

#include <concepts>
#include <cstdint>

#include "loom/core/parameters.hpp"

namespace loom {

//! A Strategy is a tag type (`SingleRank`, later `DataParallel`, `Zero<N>`) with a nested
//! `Engine<B, T>` that owns the rank's flat parameter, gradient and optimizer-state buffers and
//! is driven by the Trainer through the hooks checked by StrategyEngine. Opt in with
//! `using loom_strategy = void;`.
template <class S>
concept Strategy = requires { typename S::loom_strategy; };

//! The hooks a strategy's engine offers the Trainer, in the order of a step:
//! begin_step → (forward/backward per micro-batch, on_backward after each layer) →
//! finish_gradients → grad_sum_of_squares / global_sum → update.
template <class E, class T>
concept StrategyEngine = requires(E& e, const E& ce, int layer, bool last, double x) {
  { ce.params() } -> std::same_as<const T*>;   // base of the layout, for layer forward/backward
  { e.grads() } -> std::same_as<T*>;           // base of the layout, gradients accumulate here
  e.begin_step();
  e.on_backward(layer, last);
  e.finish_gradients();
  { e.global_sum(x) } -> std::convertible_to<double>;
  { e.grad_sum_of_squares() } -> std::convertible_to<double>;
};

}  // namespace loom
