#pragma once
//! \file The Model and SplitBackwardModel concepts and the arguments a layer's forward and
//! backward receive.

#include <concepts>
#include <cstdint>

#include <vector>

#include "loom/core/accumulate.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/core/tensor.hpp"

namespace loom {

//! The shape of one micro-batch: sequences and tokens per sequence.
struct MicroBatchShape {
  std::int64_t batch = 1;
  std::int64_t seq = 1;
  friend bool operator==(const MicroBatchShape&, const MicroBatchShape&) = default;
};

//! What one layer's forward reads and writes. Storage belongs to the caller (the schedule
//! decides how many micro-batches of it are alive: DESIGN.md invariant 5).
template <class T>
struct ForwardArgs {
  Tensor<const std::int32_t> tokens;   //!< [B, T] input tokens of the micro-batch
  Tensor<const std::int32_t> targets;  //!< [B, T] next tokens; < 0 = ignored
  Tensor<const T> input;               //!< [B, T, C] from the previous layer (empty for the first)
  Tensor<T> output;                    //!< [B, T, C] for the next layer (empty for the last)
  Tensor<T> saved;                     //!< activation_elements(layer, shape): kept for backward
  DropoutKey dropout{};                //!< keys the layer's dropout masks; default: no dropout
  //! Scratch the forward may use, workspace_elements(layer, shape) elements (the backward's),
  //! or empty: a layer whose forward needs scratch then allocates it.
  Tensor<T> workspace{};
  //! [B] real tokens of each sequence, the rest padding that no query attends to
  //! (AttentionKeys), where the kernels read it; empty: every sequence is T tokens.
  Tensor<const std::int32_t> lengths{};
  //! The loss_scale of the backward that follows (BackwardArgs::loss_scale), or 0 where none does
  //! (evaluation). A hint: a layer may start its backward's work now (GPT-2's and BERT's heads on
  //! one rank write the gradient of their logits as they compute the loss), and it must still give
  //! the right gradients whatever scale its backward is given.
  accumulate_t<T> loss_scale = accumulate_t<T>(0);
};

//! What one layer's backward reads and writes. Gradients accumulate (+=).
template <class T>
struct BackwardArgs {
  Tensor<const std::int32_t> tokens;
  Tensor<const std::int32_t> targets;
  Tensor<const T> input;        //!< the forward's input, still alive
  Tensor<const T> output_grad;  //!< d loss / d output (empty for the last layer)
  //! d loss / d input (empty for the first layer): added (+=), or written (=) by a Model that
  //! writes_input_grad, whose caller then leaves its contents unspecified.
  Tensor<T> input_grad;
  Tensor<T> saved;              //!< what forward kept (backward may overwrite it)
  Tensor<T> workspace;          //!< workspace_elements(layer, shape) of scratch
  //! d total loss / d per-token loss (1 / tokens of the global batch), in the accumulate type:
  //! float for bf16, where 1 / tokens would lose all but 8 bits.
  accumulate_t<T> loss_scale = accumulate_t<T>(1);
  DropoutKey dropout{};  //!< the forward's key: the backward draws the same masks
  Tensor<const std::int32_t> lengths{};  //!< the forward's sequence lengths (ForwardArgs::lengths)
  //! Empty, or the fp32 sums of a bf16 model's gradients over the layer's parameters, by layout
  //! offset as `grads` (TrainerOptions::fp32_gradient_fusion, for a model that
  //! FusesFp32Gradients): the layer adds the gradients of its fp32_gradient_parameters(layer)
  //! there, unrounded, and leaves their elements in `grads` as they are.
  ParameterView<accumulate_t<T>> fp32_grads{};
};

//! A Model is an ordered list of layers over named parameters in one flat layout, each layer
//! with an explicit forward and backward (no tape) and a cost estimate for pipeline balancing.
//! A layer reaches its parameters and gradients through ParameterViews (by flat offset), and
//! says which layout ranges it reads (`layer_parameters`), so that a strategy may hold them
//! anywhere (gathered per layer under ZeRO-3). Opt in with `using loom_model = void;`.
template <class M>
concept Model =
    requires { typename M::loom_model; typename M::backend_type; typename M::scalar_type; } &&
    requires(const M& m, typename M::backend_type& be, int layer, MicroBatchShape shape,
             ParameterView<const typename M::scalar_type> params,
             ParameterView<typename M::scalar_type> grads,
             const ForwardArgs<typename M::scalar_type>& fwd,
             const BackwardArgs<typename M::scalar_type>& bwd) {
      { m.layout() } -> std::same_as<const ParameterLayout&>;
      { m.num_layers() } -> std::convertible_to<int>;
      { m.layer_cost(layer) } -> std::convertible_to<double>;
      { m.layer_parameters(layer) } -> std::same_as<std::vector<ElementRange>>;
      { m.hidden_elements(shape) } -> std::convertible_to<std::int64_t>;
      { m.activation_elements(layer, shape) } -> std::convertible_to<std::int64_t>;
      { m.workspace_elements(layer, shape) } -> std::convertible_to<std::int64_t>;
      { m.forward(be, layer, params, fwd) } -> std::convertible_to<double>;
      m.backward(be, layer, params, grads, bwd);
      { m.flops_per_token(shape.seq) } -> std::convertible_to<double>;
    };

//! Whether Model M's backward and backward_input write BackwardArgs::input_grad (=) instead of
//! adding to it (+=); a model says so with `static constexpr bool writes_input_grad = true;`. Its
//! caller then need not zero input_grad first (the Trainer's holds an earlier layer's gradient
//! on entry), which spares a pass over the hidden state per layer and the layer's read of the
//! zeros. Without it the Trainer zeroes input_grad before each layer's backward.
template <class M>
inline constexpr bool writes_input_grad = requires { requires M::writes_input_grad; };

//! A Model whose backward also splits into an input-gradient pass and a weight-gradient pass,
//! for zero-bubble pipeline schedules (ZeroBubbleH1: I on the critical path, W deferred).
//!
//! - `stash_elements(layer, shape)`: elements the caller keeps per micro-batch from a layer's
//!   `backward_input` until its `backward_weight` (0 where the layer keeps nothing).
//! - `backward_input(be, layer, params, grads, args, stash)`: the same BackwardArgs as
//!   `backward`. Gives `input_grad` completely (+=, or = where writes_input_grad), may also
//!   accumulate cheap parameter gradients (layernorm weights and biases), does every
//!   tensor-parallel collective the backward needs, and fills `stash` with what the weight pass
//!   needs. It may overwrite `saved`, as `backward` may.
//! - `backward_weight(be, layer, params, grads, args, stash)`: runs later, possibly after other
//!   micro-batches' work has reused the caller's buffers. It reads `args.input`, `args.saved`
//!   (as `backward_input` left it), `args.tokens`, `args.targets` and `stash`, and accumulates
//!   the remaining parameter gradients (+=). It never reads `args.output_grad`,
//!   `args.input_grad` (the caller passes them empty) or what the I pass left in
//!   `args.workspace`, and it communicates nothing.
//!
//! Contract: `backward_input` then `backward_weight` accumulate the same parameter gradients
//! and input gradient as `backward` (the same kernel calls on the same operands, so the same
//! bits on a deterministic backend).
template <class M>
concept SplitBackwardModel =
    Model<M> &&
    requires(const M& m, typename M::backend_type& be, int layer, MicroBatchShape shape,
             ParameterView<const typename M::scalar_type> params, ParameterView<typename M::scalar_type> grads,
             const BackwardArgs<typename M::scalar_type>& bwd, Tensor<typename M::scalar_type> stash) {
      { m.stash_elements(layer, shape) } -> std::convertible_to<std::int64_t>;
      m.backward_input(be, layer, params, grads, bwd, stash);
      m.backward_weight(be, layer, params, grads, bwd, stash);
    };

//! A Model some of whose layers add parameter gradients straight into fp32 sums when the caller
//! gives them (BackwardArgs::fp32_grads): Megatron-LM's gradient-accumulation fusion, where a
//! bf16 layer's weight-gradient GEMM accumulates into the fp32 gradient in its own fp32
//! arithmetic instead of writing a bf16 gradient that the strategy then adds in (drains).
//! `fp32_gradient_parameters(layer)` are the layout ranges (within layer_parameters(layer))
//! whose gradients `layer` adds there, whatever pass of its backward makes them; the strategy
//! drains the rest. Where that leaves nothing for any layer, the strategy keeps no gradient
//! buffer of T, and the layers' `grads` views are empty.
template <class M>
concept FusesFp32Gradients = Model<M> && requires(const M& m, int layer) {
  { m.fp32_gradient_parameters(layer) } -> std::same_as<std::vector<ElementRange>>;
};

}  // namespace loom
