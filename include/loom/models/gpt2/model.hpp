#pragma once
//! \file GPT-2 (pre-LayerNorm, tied input/output embeddings) as a loom Model: layer 0 embeds,
//! layers 1..L are transformer blocks, layer L+1 is the head (final norm, unembedding through
//! wte, cross-entropy). Forward and backward are written out per layer, as in llm.c.

#include <cstdint>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/models/concepts.hpp"
#include "loom/models/gpt2/config.hpp"

namespace loom::gpt2 {

//! GPT-2 on backend `B` with scalar `T` (float to train, double for gradient checks).
//! The kernels for `B` must be visible (e.g. include "loom/backend/cpu/kernels.hpp").
template <Backend B, class T = float>
class Model {
 public:
  using loom_model = void;
  using backend_type = B;
  using scalar_type = T;

  explicit Model(Config config) : config_(config), layout_(parameter_specs(config)) {
    const auto offset = [&](const std::string& name) { return layout_.find(name).offset; };
    wte_ = offset("wte");
    wpe_ = offset("wpe");
    for (std::int64_t l = 0; l < config_.num_layers; ++l) {
      const auto at = [&](std::string_view what) { return offset(block_param(l, what)); };
      blocks_.push_back({at("ln_1.weight"), at("ln_1.bias"), at("attn.qkv.weight"),
                         at("attn.qkv.bias"), at("attn.proj.weight"), at("attn.proj.bias"),
                         at("ln_2.weight"), at("ln_2.bias"), at("mlp.fc.weight"),
                         at("mlp.fc.bias"), at("mlp.proj.weight"), at("mlp.proj.bias")});
    }
    lnf_weight_ = offset("ln_f.weight");
    lnf_bias_ = offset("ln_f.bias");
  }

  const Config& config() const noexcept { return config_; }
  //! Where every parameter lives in the flat buffers.
  const ParameterLayout& layout() const noexcept { return layout_; }
  //! Embedding, L blocks, head.
  int num_layers() const noexcept { return static_cast<int>(config_.num_layers) + 2; }

  //! Forward FLOPs per token of `layer` at full context (for pipeline balancing).
  double layer_cost(int layer) const noexcept {
    const double C = static_cast<double>(config_.channels);
    if (layer == embedding_layer) return C;
    if (layer == head_layer(config_)) return 2.0 * static_cast<double>(config_.padded_vocab_size) * C;
    return 24.0 * C * C + 4.0 * static_cast<double>(config_.max_seq_len) * C;
  }

  //! The layout ranges `layer` reads: its own parameters, and for the head also the tied `wte`
  //! (owned by the embedding, layer 0).
  std::vector<ElementRange> layer_parameters(int layer) const {
    std::vector<ElementRange> ranges;
    std::int64_t begin = -1, end = -1;
    for (const auto& e : layout_.entries())
      if (e.spec.layer == layer) {
        if (begin < 0) begin = e.offset;
        end = e.offset + e.numel();
      }
    if (begin >= 0) ranges.push_back({begin, end});
    if (layer == head_layer(config_)) {
      const auto& wte = layout_.find("wte");
      ranges.push_back({wte.offset, wte.offset + wte.numel()});
    }
    return ranges;
  }

  //! Training FLOPs per token, 6·N + 12·l·h·s (DESIGN.md; N the published parameter count).
  double flops_per_token(std::int64_t seq) const noexcept {
    return 6.0 * static_cast<double>(config_.parameter_count()) +
           12.0 * static_cast<double>(config_.num_layers * config_.channels * seq);
  }

  //! Elements of one [B, T, C] hidden state passed between layers.
  std::int64_t hidden_elements(MicroBatchShape s) const noexcept {
    return s.batch * s.seq * config_.channels;
  }

  //! Elements a layer keeps from forward to backward for one micro-batch.
  std::int64_t activation_elements(int layer, MicroBatchShape s) const noexcept {
    const std::int64_t N = s.batch * s.seq, C = config_.channels;
    if (layer == embedding_layer) return 0;
    if (layer == head_layer(config_)) return N * C + 3 * N + N * config_.padded_vocab_size;
    // ln1, qkv, att, atty, res2, ln2, fch, fch_gelu and four row statistics.
    return N * C * 15 + 4 * N + s.batch * config_.num_heads * s.seq * s.seq;
  }

  //! Scratch a layer's backward needs (not kept between calls).
  std::int64_t workspace_elements(int layer, MicroBatchShape s) const noexcept {
    const std::int64_t N = s.batch * s.seq, C = config_.channels;
    if (layer == embedding_layer) return 0;
    if (layer == head_layer(config_)) return N * C;
    return N * C * 15;
  }

  //! Runs `layer` forward; returns the sum of per-token losses for the head, 0 otherwise.
  double forward(B& be, int layer, ParameterView<const T> params, const ForwardArgs<T>& a) const {
    const MicroBatchShape s = shape_of(a.tokens);
    if (layer == embedding_layer) {
      check_tokens(a.tokens);
      embedding_forward<T>(be, a.output, a.tokens, param(params, wte_, {config_.padded_vocab_size, C()}),
                                    param(params, wpe_, {config_.max_seq_len, C()}));
      return 0.0;
    }
    if (layer == head_layer(config_)) return head_forward(be, params, a, s);
    block_forward(be, blocks_[layer - 1], params, a, s);
    return 0.0;
  }

  //! Runs `layer` backward: parameter gradients into `grads` (+=), input gradient (+=).
  void backward(B& be, int layer, ParameterView<const T> params, ParameterView<T> grads,
                const BackwardArgs<T>& a) const {
    const MicroBatchShape s = shape_of(a.tokens);
    if (layer == embedding_layer) {
      embedding_backward<T>(be, grad(grads, wte_, {config_.padded_vocab_size, C()}),
                                     grad(grads, wpe_, {config_.max_seq_len, C()}), a.output_grad,
                                     a.tokens);
      return;
    }
    if (layer == head_layer(config_)) return head_backward(be, params, grads, a, s);
    block_backward(be, blocks_[layer - 1], params, grads, a, s);
  }

 private:
  struct BlockOffsets {
    std::int64_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w,
        fcproj_b;
  };

  //! Carves consecutive tensors out of one flat range.
  struct Carver {
    T* next;
    Tensor<T> take(Shape shape) {
      Tensor<T> t(next, shape);
      next += shape.numel();
      return t;
    }
  };

  std::int64_t C() const noexcept { return config_.channels; }

  MicroBatchShape shape_of(Tensor<const std::int32_t> tokens) const {
    LOOM_CHECK(tokens.shape().rank() == 2, "gpt2 forward: tokens rank", tokens.shape(),
               "tokens must be [batch, seq]");
    const MicroBatchShape s{tokens.extent(0), tokens.extent(1)};
    LOOM_CHECK(s.seq >= 1 && s.seq <= config_.max_seq_len, "gpt2 forward: sequence length", s.seq,
               "must be in [1, max_seq_len = " + detail::to_text(config_.max_seq_len) + "]");
    return s;
  }

  //! Tokens must be real vocabulary entries (padded rows exist only for the logits).
  void check_tokens(Tensor<const std::int32_t> tokens) const {
    for (std::int64_t i = 0; i < tokens.numel(); ++i)
      if (tokens[i] < 0 || tokens[i] >= config_.vocab_size) [[unlikely]]
        throw Error("gpt2 forward: token at position " + detail::to_text(i), tokens[i],
                    "tokens must be in [0, vocab_size = " + detail::to_text(config_.vocab_size) + ")");
  }

  static Tensor<const T> param(ParameterView<const T> params, std::int64_t offset, Shape shape) {
    return {params.at(offset, shape.numel()), shape};
  }
  static Tensor<T> grad(ParameterView<T> grads, std::int64_t offset, Shape shape) {
    return {grads.at(offset, shape.numel()), shape};
  }

  //! The activations a block keeps, carved from its `saved` range.
  struct BlockSaved {
    Tensor<T> ln1, ln1_mean, ln1_rstd, qkv, att, atty, res2, ln2, ln2_mean, ln2_rstd, fch, fch_gelu;
  };
  BlockSaved carve_block(Tensor<T> saved, MicroBatchShape s) const {
    const std::int64_t Bn = s.batch, Tn = s.seq, C = config_.channels, NH = config_.num_heads;
    check_numel(saved, activation_elements(1, s), "gpt2 block", "saved");
    Carver c{saved.data()};
    BlockSaved b;
    b.ln1 = c.take({Bn, Tn, C});
    b.ln1_mean = c.take({Bn * Tn});
    b.ln1_rstd = c.take({Bn * Tn});
    b.qkv = c.take({Bn, Tn, 3 * C});
    b.att = c.take({Bn, NH, Tn, Tn});
    b.atty = c.take({Bn, Tn, C});
    b.res2 = c.take({Bn, Tn, C});
    b.ln2 = c.take({Bn, Tn, C});
    b.ln2_mean = c.take({Bn * Tn});
    b.ln2_rstd = c.take({Bn * Tn});
    b.fch = c.take({Bn, Tn, 4 * C});
    b.fch_gelu = c.take({Bn, Tn, 4 * C});
    return b;
  }

  void block_forward(B& be, const BlockOffsets& o, ParameterView<const T> p, const ForwardArgs<T>& a,
                     MicroBatchShape s) const {
    const std::int64_t C = config_.channels;
    BlockSaved b = carve_block(a.saved, s);
    layernorm_forward<T>(be, b.ln1, b.ln1_mean, b.ln1_rstd, a.input, param(p, o.ln1_w, {C}),
                                  param(p, o.ln1_b, {C}));
    matmul_forward<T>(be, b.qkv, b.ln1, param(p, o.qkv_w, {3 * C, C}), param(p, o.qkv_b, {3 * C}));
    attention_forward<T>(be, b.atty, b.att, b.qkv, static_cast<int>(config_.num_heads));
    matmul_forward<T>(be, b.res2, b.atty, param(p, o.proj_w, {C, C}), param(p, o.proj_b, {C}));
    add_to<T>(be, b.res2, a.input);
    layernorm_forward<T>(be, b.ln2, b.ln2_mean, b.ln2_rstd, b.res2, param(p, o.ln2_w, {C}),
                                  param(p, o.ln2_b, {C}));
    matmul_forward<T>(be, b.fch, b.ln2, param(p, o.fc_w, {4 * C, C}), param(p, o.fc_b, {4 * C}));
    gelu_forward<T>(be, b.fch_gelu, b.fch);
    matmul_forward<T>(be, a.output, b.fch_gelu, param(p, o.fcproj_w, {C, 4 * C}),
                               param(p, o.fcproj_b, {C}));
    add_to<T>(be, a.output, b.res2);
  }

  void block_backward(B& be, const BlockOffsets& o, ParameterView<const T> p, ParameterView<T> g,
                      const BackwardArgs<T>& a,
                      MicroBatchShape s) const {
    const std::int64_t Bn = s.batch, Tn = s.seq, C = config_.channels;
    BlockSaved b = carve_block(a.saved, s);
    check_numel(a.workspace, workspace_elements(1, s), "gpt2 block backward", "workspace");
    zero<T>(be, a.workspace);
    Carver w{a.workspace.data()};
    Tensor<T> dres2 = w.take({Bn, Tn, C}), dfch_gelu = w.take({Bn, Tn, 4 * C}),
              dfch = w.take({Bn, Tn, 4 * C}), dln2 = w.take({Bn, Tn, C}),
              datty = w.take({Bn, Tn, C}), dqkv = w.take({Bn, Tn, 3 * C}), dln1 = w.take({Bn, Tn, C});
    // output = res2 + mlp(ln2(res2)): the residual passes the gradient straight through.
    copy<T>(be, dres2, a.output_grad);
    matmul_backward<T>(be, dfch_gelu, grad(g, o.fcproj_w, {C, 4 * C}), grad(g, o.fcproj_b, {C}),
                                a.output_grad, b.fch_gelu, param(p, o.fcproj_w, {C, 4 * C}));
    gelu_backward<T>(be, dfch, b.fch, dfch_gelu);
    matmul_backward<T>(be, dln2, grad(g, o.fc_w, {4 * C, C}), grad(g, o.fc_b, {4 * C}), dfch,
                                b.ln2, param(p, o.fc_w, {4 * C, C}));
    layernorm_backward<T>(be, dres2, grad(g, o.ln2_w, {C}), grad(g, o.ln2_b, {C}), dln2,
                                   b.res2, param(p, o.ln2_w, {C}), b.ln2_mean, b.ln2_rstd);
    // res2 = input + attn(ln1(input)).
    add_to<T>(be, a.input_grad, dres2);
    matmul_backward<T>(be, datty, grad(g, o.proj_w, {C, C}), grad(g, o.proj_b, {C}), dres2,
                                b.atty, param(p, o.proj_w, {C, C}));
    attention_backward<T>(be, dqkv, datty, b.qkv, b.att, static_cast<int>(config_.num_heads));
    matmul_backward<T>(be, dln1, grad(g, o.qkv_w, {3 * C, C}), grad(g, o.qkv_b, {3 * C}), dqkv,
                                b.ln1, param(p, o.qkv_w, {3 * C, C}));
    layernorm_backward<T>(be, a.input_grad, grad(g, o.ln1_w, {C}), grad(g, o.ln1_b, {C}), dln1,
                                   a.input, param(p, o.ln1_w, {C}), b.ln1_mean, b.ln1_rstd);
  }

  //! The activations the head keeps.
  struct HeadSaved {
    Tensor<T> lnf, mean, rstd, probs, losses;
  };
  HeadSaved carve_head(Tensor<T> saved, MicroBatchShape s) const {
    const std::int64_t N = s.batch * s.seq;
    check_numel(saved, activation_elements(head_layer(config_), s), "gpt2 head", "saved");
    Carver c{saved.data()};
    HeadSaved h;
    h.lnf = c.take({N, config_.channels});
    h.mean = c.take({N});
    h.rstd = c.take({N});
    h.probs = c.take({N, config_.padded_vocab_size});
    h.losses = c.take({N});
    return h;
  }

  double head_forward(B& be, ParameterView<const T> p, const ForwardArgs<T>& a, MicroBatchShape s) const {
    const std::int64_t C = config_.channels, N = s.batch * s.seq;
    HeadSaved h = carve_head(a.saved, s);
    layernorm_forward<T>(be, h.lnf, h.mean, h.rstd, a.input.reshape({N, C}),
                                  param(p, lnf_weight_, {C}), param(p, lnf_bias_, {C}));
    // Logits land in the probs buffer; the cross-entropy turns them into probabilities in place.
    matmul_forward<T>(be, h.probs, h.lnf, param(p, wte_, {config_.padded_vocab_size, C}),
                               Tensor<const T>{});
    softmax_cross_entropy_forward<T>(be, h.losses, h.probs, h.probs,
                                              a.targets.reshape({N}), config_.vocab_size);
    double sum = 0;
    for (T l : h.losses) sum += static_cast<double>(l);
    return sum;
  }

  void head_backward(B& be, ParameterView<const T> p, ParameterView<T> g, const BackwardArgs<T>& a,
                     MicroBatchShape s) const {
    const std::int64_t C = config_.channels, N = s.batch * s.seq;
    HeadSaved h = carve_head(a.saved, s);
    check_numel(a.workspace, workspace_elements(head_layer(config_), s), "gpt2 head backward", "workspace");
    Tensor<T> dlnf = a.workspace.reshape({N, C});
    zero<T>(be, dlnf);
    // dlogits overwrite the probabilities they are computed from.
    softmax_cross_entropy_backward<T>(be, h.probs, h.probs, a.targets.reshape({N}),
                                               config_.vocab_size, a.loss_scale);
    matmul_backward<T>(be, dlnf, grad(g, wte_, {config_.padded_vocab_size, C}), Tensor<T>{},
                                h.probs, h.lnf, param(p, wte_, {config_.padded_vocab_size, C}));
    layernorm_backward<T>(be, a.input_grad.reshape({N, C}), grad(g, lnf_weight_, {C}),
                                   grad(g, lnf_bias_, {C}), dlnf, a.input.reshape({N, C}),
                                   param(p, lnf_weight_, {C}), h.mean, h.rstd);
  }

  Config config_;
  ParameterLayout layout_;
  std::int64_t wte_ = 0, wpe_ = 0, lnf_weight_ = 0, lnf_bias_ = 0;
  std::vector<BlockOffsets> blocks_;
};

}  // namespace loom::gpt2
