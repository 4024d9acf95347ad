#pragma once
//! \file The Strategy concept: how parameters, gradients and optimizer state are held and
//! reduced across the data-parallel group.

#include <concepts>
#include <cstdint>

#include "loom/comm/ref.hpp"
#include "loom/core/parameters.hpp"

namespace loom {

//! What a strategy's engine is built from: the rank's backend, its data-parallel group, the
//! parameter layout, the optimizer's state slots per parameter and the initialisation seed.
template <class B>
struct EngineContext {
  B& backend;
  CommunicatorRef data_parallel;  //!< the ranks that hold replicas (or shards) of the model
  const ParameterLayout& layout;
  int state_slots = 0;
  std::uint64_t seed = 0;
};

//! A Strategy is a type (`SingleRank`, `DataParallel`, later `Zero<N>`) whose value carries its
//! run-time settings (bucket bytes, ...) and whose nested `Engine<B, T>`, constructed from
//! `(const Strategy&, EngineContext<B>)`, owns the rank's flat parameter, gradient and
//! optimizer-state buffers and is driven by the Trainer through the hooks checked by
//! StrategyEngine. Opt in with `using loom_strategy = void;`.
template <class S>
concept Strategy = requires { typename S::loom_strategy; } && std::copyable<S>;

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
