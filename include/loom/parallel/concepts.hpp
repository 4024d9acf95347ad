#pragma once
//! \file The Strategy concept: how parameters, gradients and optimizer state are held and
//! reduced across the data-parallel group.

#include <concepts>
#include <cstdint>
#include <vector>

#include "loom/comm/ref.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"

namespace loom {

//! Whether layers write gradients of the parameters' type `T`: always, unless `fp32_gradients`
//! keeps fp32 sums of bf16 gradients and `drained` (per layer, what is drained after its
//! backward) is empty for every layer, each adding all it reads to the sums itself.
template <class T>
bool layers_write_gradients(bool fp32_gradients, const std::vector<std::vector<ElementRange>>& drained) noexcept {
  if constexpr (!is_narrow_storage<T>) {
    return true;  // float gradients are the fp32 sums
  } else {
    if (!fp32_gradients) return true;
    for (const std::vector<ElementRange>& ranges : drained)
      if (!ranges.empty()) return true;
    return false;
  }
}

//! What a strategy's engine is built from: the rank's backend, its data-parallel group, the
//! parameter layout, the optimizer's state slots per parameter and the initialisation seed.
template <class B>
struct EngineContext {
  B& backend;
  CommunicatorRef data_parallel;  //!< the ranks that hold replicas (or shards) of the model
  const ParameterLayout& layout;
  int state_slots = 0;
  std::uint64_t seed = 0;
  //! Per layer, the layout ranges it reads (Model::layer_parameters), for strategies that
  //! gather parameters per layer.
  const std::vector<std::vector<ElementRange>>& layer_parameters;
  //! Accumulate and reduce the gradients of bf16 parameters in fp32 (TrainerOptions::fp32_gradients).
  bool fp32_gradients = false;
  //! With fp32 gradients, per layer the layout ranges whose bf16 gradients the engine drains into
  //! the fp32 sums after the layer's backward: layer_parameters less what the layer adds to the
  //! sums itself (TrainerOptions::fp32_gradient_fusion). Null: all of layer_parameters.
  const std::vector<std::vector<ElementRange>>* layer_drained = nullptr;
  //! The layout ranges of tied parameters (PipelineStage::tied(): held by several pipeline
  //! stages), whose gradients the Trainer sums across those stages after the step's last
  //! backward, before it reports local layer 0's last backward. An engine that reduces
  //! gradients in every micro-batch (ZeRO-2 and 3) keeps them whole until that report. Empty
  //! without pipeline stages.
  std::vector<ElementRange> tied;

  //! What the engine drains after `layer`'s backward (layer_drained, else layer_parameters).
  const std::vector<std::vector<ElementRange>>& drained() const noexcept {
    return layer_drained != nullptr ? *layer_drained : layer_parameters;
  }
  //! Whether the layers write gradients of the parameters' type `T` at all
  //! (loom::layers_write_gradients). Where they do not, engines allocate no such gradient buffer
  //! (Megatron-LM's gradient-accumulation fusion keeps only main_grad too) and hand the layers
  //! empty views.
  template <class T>
  bool layers_write_gradients() const noexcept {
    return loom::layers_write_gradients<T>(fp32_gradients, drained());
  }
};

//! A Strategy is a type (`SingleRank`, `DataParallel`, later `Zero<N>`) whose value carries its
//! run-time settings (bucket bytes, ...) and whose nested `Engine<B, T>`, constructed from
//! `(const Strategy&, EngineContext<B>)`, owns the rank's flat parameter, gradient and
//! optimizer-state buffers and is driven by the Trainer through the hooks checked by
//! StrategyEngine. Opt in with `using loom_strategy = void;`.
template <class S>
concept Strategy = requires { typename S::loom_strategy; } && std::copyable<S>;

//! Whether strategy `S` runs under pipeline schedules: true unless its type opts out with
//! `static constexpr bool supports_pipeline = false` (every strategy of loom's runs under them).
template <class S>
inline constexpr bool supports_pipeline = !requires { requires !S::supports_pipeline; };

//! The hooks a strategy's engine offers the Trainer, in the order of a step:
//! begin_step → (forward_params / after_forward around each layer's forward; backward_params /
//! backward_grads before and on_backward after each layer's backward) →
//! finish_gradients → grad_sum_of_squares / global_sum → update.
//! The views a layer's forward and backward get come from the engine, which may gather them
//! first (ZeRO-3) and free them after (after_forward, on_backward).
template <class E, class T>
concept StrategyEngine = requires(E& e, int layer, bool last, double x) {
  { e.forward_params(layer) } -> std::same_as<ParameterView<const T>>;
  e.after_forward(layer);
  { e.backward_params(layer) } -> std::same_as<ParameterView<const T>>;
  { e.backward_grads(layer) } -> std::same_as<ParameterView<T>>;
  e.begin_step();
  e.on_backward(layer, last);
  e.finish_gradients();
  { e.global_sum(x) } -> std::convertible_to<double>;
  { e.grad_sum_of_squares(last) } -> std::convertible_to<double>;  // count TP-replicated ones?
};

}  // namespace loom
