#pragma once
//! \file What gpt2::Model and bert::Model share above the kernels: the config, this rank's share of
//! Megatron's tensor-parallel split, the parameter layout and where each block's parameters lie in
//! it, the public queries over them, and the helpers their layers call. Both models derive from
//! `Slice<Config>` for their own Config; their layers stay in their own headers.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loom/backend/attention_mask.hpp"
#include "loom/backend/concepts.hpp"
#include "loom/backend/gradient_write.hpp"
#include "loom/comm/ref.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/models/attention_storage.hpp"
#include "loom/models/concepts.hpp"
#include "loom/models/detail/transformer.hpp"
#include "loom/models/detail/transformer_config.hpp"

namespace loom::detail::transformer {

//! Where a block's twelve parameters start in the flat layout (block_parameter_spec's names).
struct BlockOffsets {
  std::int64_t ln1_w, ln1_b, qkv_w, qkv_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, fcproj_w, fcproj_b;
};

//! The gradients of a block's four linear layers' weights and biases, or all empty (skipped).
template <class T>
struct BlockLinearGrads {
  Tensor<T> fcproj_w, fcproj_b, fc_w, fc_b, proj_w, proj_b, qkv_w, qkv_b;
};

//! A transformer of `Config` (gpt2::Config, bert::Config) on one rank of its tensor-parallel group:
//! attention split by heads, the MLP column-then-row, the vocabulary by rows of wte, and with
//! Config::sequence_parallel the rows between the layers too. The models derive from it; it holds
//! no tensor and runs no kernel of its own.
template <class Config>
class Slice {
 public:
  const Config& config() const noexcept { return config_; }
  //! What the blocks keep for their attention's backward.
  AttentionStorage attention() const noexcept { return attention_; }
  //! Where every parameter of this rank lives in the flat buffers (local shapes under tensor
  //! parallelism; each spec's Shard maps it to the global tensor).
  const ParameterLayout& layout() const noexcept { return layout_; }
  //! Ranks the model is split over, and this rank's place among them.
  std::int64_t tensor_parallel_size() const noexcept { return tensor_parallel_size_; }
  std::int64_t tensor_parallel_rank() const noexcept { return tensor_parallel_rank_; }
  //! The rows of the (padded) vocabulary this rank holds: [vocab_begin, vocab_begin + rows).
  std::int64_t vocab_begin() const noexcept { return vocab_begin_; }
  std::int64_t vocab_rows() const noexcept { return vocab_rows_; }
  //! Whether the hidden state between layers is split by rows over the tensor-parallel group
  //! (Config::sequence_parallel with more than one rank).
  bool sequence_parallel() const noexcept { return split_.split(); }
  //! Embedding, L blocks, head.
  int num_layers() const noexcept { return static_cast<int>(config_.num_layers) + 2; }

  //! The layout ranges `layer` reads: its own parameters, and for the head also the tied `wte`
  //! (owned by the embedding, layer 0).
  std::vector<ElementRange> layer_parameters(int layer) const {
    return layer_ranges(layout_, layer, layer == head_layer(config_) ? "wte" : "");
  }

  //! The layout ranges whose gradients `layer` adds into BackwardArgs::fp32_grads when given
  //! (FusesFp32Gradients): all it reads, layernorms included, so that under
  //! TrainerOptions::fp32_gradient_fusion no bf16 gradient is written, drained or even allocated.
  std::vector<ElementRange> fp32_gradient_parameters(int layer) const { return layer_parameters(layer); }

  //! Elements of the hidden state passed between layers on this rank: [B, T, C], or under
  //! sequence parallelism this rank's B·T/tp rows of it (rows r·B·T/tp onwards of [B·T, C]).
  std::int64_t hidden_elements(MicroBatchShape s) const noexcept { return split_.rows(s).local * config_.channels; }

 protected:
  //! This rank's slice of the model `model` ("gpt2", "bert": it names the model in errors), split
  //! over `tensor_parallel` (which must outlive the model); throws loom::Error when `config` does
  //! not split over it (Config::validate_tensor_parallel, through its parameter_specs).
  Slice(Config config, CommunicatorRef tensor_parallel, AttentionStorage attention, std::string_view model)
      : config_(config),
        attention_(attention),
        model_(model),
        tensor_parallel_(tensor_parallel),
        tensor_parallel_size_(tensor_parallel.size()),
        tensor_parallel_rank_(tensor_parallel.rank()),
        layout_(parameter_specs(config, tensor_parallel_size_, tensor_parallel_rank_)),
        heads_(config.num_heads / tensor_parallel_size_),
        attention_channels_(config.channels / tensor_parallel_size_),
        mlp_channels_(4 * config.channels / tensor_parallel_size_),
        vocab_rows_(config.padded_vocab_size / tensor_parallel_size_),
        vocab_begin_(tensor_parallel_rank_ * vocab_rows_),
        split_(tensor_parallel, config.sequence_parallel, config.channels),
        wte_(offset("wte")),
        wpe_(offset("wpe")) {
    for (std::int64_t l = 0; l < config_.num_layers; ++l) {
      const auto at = [&](std::string_view what) { return offset(block_param(l, what)); };
      blocks_.push_back({at("ln_1.weight"), at("ln_1.bias"), at("attn.qkv.weight"), at("attn.qkv.bias"),
                         at("attn.proj.weight"), at("attn.proj.bias"), at("ln_2.weight"), at("ln_2.bias"),
                         at("mlp.fc.weight"), at("mlp.fc.bias"), at("mlp.proj.weight"), at("mlp.proj.bias")});
    }
  }

  //! Where the parameter `name` starts in the layout.
  std::int64_t offset(std::string_view name) const { return layout_.find(std::string(name)).offset; }

  std::int64_t C() const noexcept { return config_.channels; }

  //! The rank that adds replicated terms (row-parallel biases, positions) to partial sums, so
  //! that the sum over the group counts them once.
  bool first_rank() const noexcept { return tensor_parallel_rank_ == 0; }

  //! Forward FLOPs per token of a block at full context on this rank (for pipeline balancing): a
  //! tensor-parallel rank does 1/tp of the matmuls and of the attention.
  double block_cost() const noexcept {
    const double C = static_cast<double>(config_.channels);
    return (24.0 * C * C + 4.0 * static_cast<double>(config_.max_seq_len) * C) /
           static_cast<double>(tensor_parallel_size_);
  }

  //! The shape of a micro-batch's [batch, seq] tokens, checked against max_seq_len and the
  //! sequence-parallel split.
  MicroBatchShape shape_of(Tensor<const std::int32_t> tokens) const {
    const MicroBatchShape s = micro_batch_shape(tokens, config_.max_seq_len, model_);
    split_.check(s, model_);
    return s;
  }
  //! Tokens must be real vocabulary entries (read on the host).
  void check_tokens(Tensor<const std::int32_t> tokens) const {
    transformer::check_tokens(tokens, config_.vocab_size, model_);
  }
  //! A stash must hold `elements` (stash_elements(layer, shape)); one of 0 may be an empty tensor.
  template <class T>
  static void check_stash(Tensor<T> stash, std::int64_t elements, const char* kernel) {
    if (elements > 0 || !stash.empty()) check_numel(stash, elements, kernel, "stash");
  }

  //! Whether the head computes its logits in chunks of rows and recomputes them in the backward.
  bool chunked_logits() const noexcept { return config_.logits_chunk_rows > 0; }

  template <class T>
  static Tensor<const T> param(ParameterView<const T> params, std::int64_t offset, Shape shape) {
    return transformer::param(params, offset, shape);
  }
  template <class T>
  static Tensor<T> grad(ParameterView<T> grads, std::int64_t offset, Shape shape) {
    return transformer::grad(grads, offset, shape);
  }
  //! A row-parallel linear layer's bias: on the first rank only (its partial sum carries it).
  template <class T>
  Tensor<const T> row_bias(ParameterView<const T> p, std::int64_t offset) const {
    return first_rank() ? param(p, offset, {config_.channels}) : Tensor<const T>{};
  }
  //! Calls `f(view)` with where a layer's parameter gradients go: the fp32 sums `a.fp32_grads`
  //! where the caller gave them (a bf16 model under TrainerOptions::fp32_gradient_fusion), else
  //! `grads`. `f` is instantiated for both.
  template <class T, class F>
  static void with_fused_grads(ParameterView<T> grads, const BackwardArgs<T>& a, F&& f) {
    if constexpr (is_narrow_storage<T>)
      if (!a.fp32_grads.empty()) return f(a.fp32_grads);
    f(grads);
  }

  //! Block `o`'s linear layers' weight and bias gradients in `g` (this rank's slices).
  template <class T>
  BlockLinearGrads<T> block_linear_grads(ParameterView<T> g, const BlockOffsets& o) const {
    const std::int64_t C = config_.channels, Ca = attention_channels_, F = mlp_channels_;
    return {grad(g, o.fcproj_w, {C, F}), grad(g, o.fcproj_b, {C}), grad(g, o.fc_w, {F, C}), grad(g, o.fc_b, {F}),
            grad(g, o.proj_w, {C, Ca}),  grad(g, o.proj_b, {C}),   grad(g, o.qkv_w, {3 * Ca, C}),
            grad(g, o.qkv_b, {3 * Ca})};
  }

  //! The attention-probability dropout of block `layer` in a pass with `key`.
  AttentionDropout attention_dropout(const DropoutKey& key, int layer) const {
    return transformer::attention_dropout(key, layer, config_.attention_dropout, config_.num_heads, heads_,
                                          tensor_parallel_rank_);
  }
  //! A block's attention over this rank's heads, from `b.qkv` into `b.atty`, keeping what
  //! attention() says for the backward: the probabilities `b.att`, or the rows' log-sum-exp `b.lse`
  //! (`b` is the model's saved tensors of the block).
  template <class T, Backend B, class Saved>
  void block_attention_forward(B& be, const Saved& b, AttentionKeys keys, const AttentionDropout& drop) const {
    if (attention_ == AttentionStorage::stored)
      attention_forward<T>(be, b.atty, b.att, b.qkv, static_cast<int>(heads_), keys, drop);
    else
      attention_forward_lse<T>(be, b.atty, b.lse, b.qkv, static_cast<int>(heads_), keys, drop);
  }
  //! block_attention_forward's backward: `dqkv` written (GradientWrite::overwrite) from `datty`.
  template <class T, Backend B, class Saved>
  void block_attention_backward(B& be, Tensor<T> dqkv, Tensor<const T> datty, const Saved& b, AttentionKeys keys,
                                const AttentionDropout& drop) const {
    if (attention_ == AttentionStorage::stored)
      attention_backward<T>(be, dqkv, datty, b.qkv, b.att, static_cast<int>(heads_), keys, drop,
                            GradientWrite::overwrite);
    else
      attention_backward_lse<T>(be, dqkv, datty, b.qkv, b.atty, b.lse, static_cast<int>(heads_), keys, drop,
                                GradientWrite::overwrite);
  }

  Config config_;
  AttentionStorage attention_ = AttentionStorage::stored;
  std::string_view model_;  //!< the model's name in errors (a literal)
  // Collectives are not const; the model's forward and backward are (they change no member).
  mutable CommunicatorRef tensor_parallel_;
  std::int64_t tensor_parallel_size_ = 1, tensor_parallel_rank_ = 0;
  ParameterLayout layout_;
  std::int64_t heads_ = 0;               //!< attention heads on this rank
  std::int64_t attention_channels_ = 0;  //!< channels of this rank's heads (C / tp)
  std::int64_t mlp_channels_ = 0;        //!< this rank's MLP hidden units (4C / tp)
  std::int64_t vocab_rows_ = 0;          //!< rows of wte on this rank (padded vocabulary / tp)
  std::int64_t vocab_begin_ = 0;         //!< global id of this rank's first wte row
  //! Whether the rows between layers are split over the group (Config::sequence_parallel).
  RowSplit split_;
  std::int64_t wte_ = 0, wpe_ = 0;  //!< the embeddings' offsets
  std::vector<BlockOffsets> blocks_;  //!< block l's parameters: blocks_[l]
};

}  // namespace loom::detail::transformer
