#pragma once
// Test support: a whole model's forward and backward on one rank, layer by layer, without a
// Trainer (combined or split backward, with or without dropout), and a double-precision gradient
// check of every parameter tensor against central differences.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <vector>

#include "loom/backend/cpu/kernels.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/parameters.hpp"
#include "loom/models/concepts.hpp"
#include "support/gradcheck.hpp"

namespace loom::test {

template <class T>
Tensor<T> flat(std::vector<T>& v) {
  return {v.data(), {static_cast<std::int64_t>(v.size())}};
}

//! The model's initial values plus noise, so that biases and layernorm parameters are not 0 or 1.
template <class T>
std::vector<T> noisy_parameters(const ParameterLayout& layout) {
  std::vector<T> v(static_cast<std::size_t>(layout.total()));
  layout.initialize(v.data(), 5);
  const std::vector<double> noise = random_vector<double>(v.size(), 17, -0.1, 0.1);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] += static_cast<T>(noise[i]);
  return v;
}

//! `n` quiet NaNs of T (float, double or bf16): scratch a model must write before it reads.
template <class T>
std::vector<T> garbage(std::int64_t n) {
  return std::vector<T>(static_cast<std::size_t>(n), static_cast<T>(std::numeric_limits<float>::quiet_NaN()));
}

//! How a whole-model backward runs: combined, or each layer's input pass then its weight pass.
enum class Pass { combined, split };

//! Whether a forward whose backward follows is told that backward's loss scale
//! (ForwardArgs::loss_scale), as the Trainer tells it, or not (a head then leaves its logits for
//! the backward).
enum class Announce { backward, nothing };

//! The mean loss of `batch` (anything with [B, T] tokens_view() and targets_view(); targets < 0
//! ignored) and, when `grads` is non-null, its gradient w.r.t. every parameter, layer by layer on
//! one rank; `dropout` keys the forward's and backward's dropout masks.
template <class M, class Batch>
double loss_and_gradient(const M& model, cpu& be, const std::vector<typename M::scalar_type>& params,
                         const Batch& batch, std::vector<typename M::scalar_type>* grads, Pass pass = Pass::combined,
                         DropoutKey dropout = {}, Announce announce = Announce::backward) {
  using T = typename M::scalar_type;
  const Tensor<const std::int32_t> tokens = batch.tokens_view(), targets = batch.targets_view();
  Tensor<const std::int32_t> lengths{};  // a padded batch's sequence lengths
  if constexpr (requires { batch.lengths_view(); }) lengths = batch.lengths_view();
  const MicroBatchShape s{tokens.extent(0), tokens.extent(1)};
  const int layers = model.num_layers();
  const auto hidden = static_cast<std::size_t>(model.hidden_elements(s));
  const Shape hidden_shape{s.batch, s.seq, static_cast<std::int64_t>(hidden) / (s.batch * s.seq)};
  std::vector<std::vector<T>> saved(static_cast<std::size_t>(layers)), outputs(static_cast<std::size_t>(layers));
  const ParameterView<const T> p(params.data());
  double target_count = 0;
  for (std::int32_t t : targets) target_count += t >= 0;
  const auto loss_scale = static_cast<accumulate_t<T>>(1.0 / target_count);
  double loss = 0;
  for (int l = 0; l < layers; ++l) {
    saved[l].resize(static_cast<std::size_t>(model.activation_elements(l, s)));
    if (l + 1 < layers) outputs[l].resize(hidden);
    const ForwardArgs<T> f{.tokens = tokens, .targets = targets,
                           .input = l == 0 ? Tensor<const T>{} : Tensor<const T>(outputs[l - 1].data(), hidden_shape),
                           .output = l + 1 < layers ? Tensor<T>(outputs[l].data(), hidden_shape) : Tensor<T>{},
                           .saved = flat(saved[l]),
                           .dropout = dropout,
                           .lengths = lengths,
                           .loss_scale = grads != nullptr && announce == Announce::backward ? loss_scale
                                                                                             : accumulate_t<T>(0)};
    loss += model.forward(be, l, p, f);
  }
  if (grads == nullptr) return loss / target_count;
  grads->assign(params.size(), T(0));
  const ParameterView<T> g(grads->data());
  std::vector<T> output_grad, input_grad;
  for (int l = layers - 1; l >= 0; --l) {
    // Zeros for a model that adds to its input gradient; NaN for one that writes it, as the
    // Trainer's buffer then holds an earlier layer's gradient.
    const auto hidden_count = static_cast<std::int64_t>(l == 0 ? 0 : hidden);
    input_grad = writes_input_grad<M> ? garbage<T>(hidden_count) : std::vector<T>(hidden_count, T(0));
    // Scratch starts as NaN, as the Trainer's holds an earlier layer's leftovers: a backward that
    // reads what it has not written shows up.
    std::vector<T> workspace = garbage<T>(model.workspace_elements(l, s));
    const BackwardArgs<T> b{.tokens = tokens, .targets = targets,
                            .input = l == 0 ? Tensor<const T>{} : Tensor<const T>(outputs[l - 1].data(), hidden_shape),
                            .output_grad = l + 1 < layers ? Tensor<const T>(output_grad.data(), hidden_shape)
                                                          : Tensor<const T>{},
                            .input_grad = l == 0 ? Tensor<T>{} : Tensor<T>(input_grad.data(), hidden_shape),
                            .saved = flat(saved[l]),
                            .workspace = flat(workspace),
                            .loss_scale = loss_scale,
                            .dropout = dropout,
                            .lengths = lengths};
    if (pass == Pass::combined) {
      model.backward(be, l, p, g, b);
    } else {
      std::vector<T> stash = garbage<T>(model.stash_elements(l, s));
      model.backward_input(be, l, p, g, b, flat(stash));
      // The weight pass reads neither the output gradient, the input gradient nor the workspace.
      BackwardArgs<T> w = b;
      w.output_grad = {};
      w.input_grad = {};
      w.workspace = {};
      model.backward_weight(be, l, p, g, w, flat(stash));
    }
    output_grad = input_grad;
  }
  return loss / target_count;
}

//! The gradient of a double-precision `model` at `params` against central differences (step
//! 1e-5), at four elements spread over every parameter tensor; `dropout` keys both.
template <class M, class Batch>
void check_model_gradient(const M& model, std::vector<double> params, const Batch& batch, DropoutKey dropout = {}) {
  cpu be(1);
  std::vector<double> grads;
  loss_and_gradient(model, be, params, batch, &grads, Pass::combined, dropout);
  for (const auto& e : model.layout().entries()) {
    CAPTURE(e.spec.name);
    for (std::int64_t k : {std::int64_t{0}, e.numel() / 3, e.numel() / 2, e.numel() - 1}) {
      CAPTURE(k);
      double& x = params[static_cast<std::size_t>(e.offset + k)];
      std::vector<double> one{x};
      const auto numeric = finite_difference(
          [&] {
            x = one[0];
            return loss_and_gradient(model, be, params, batch, nullptr, Pass::combined, dropout);
          },
          std::span<double>(one), 1e-5);
      x = one[0];
      const double analytic = grads[static_cast<std::size_t>(e.offset + k)];
      CHECK(std::abs(analytic - numeric[0]) <= 1e-7 + 1e-6 * std::abs(numeric[0]));
    }
  }
}

}  // namespace loom::test
