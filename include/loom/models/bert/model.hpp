#pragma once
//! \file BERT (post-LayerNorm encoder, bidirectional attention, masked-LM head tied to the input
//! embeddings) as a loom Model: layer 0 embeds (token and position embeddings, then a
//! layernorm), layers 1..L are encoder blocks, layer L+1 is the masked-LM head (dense, GELU,
//! layernorm, unembedding through wte plus an output bias, cross-entropy over the positions whose
//! target is >= 0, computed at those positions alone). Like gpt2::Model it splits over a
//! tensor-parallel group (Megatron's split: heads, MLP column-then-row, vocabulary rows) and its
//! backward splits into an input-gradient and a weight-gradient pass (SplitBackwardModel).
//!
//! The block, after Devlin et al. 2019 (and Vaswani et al. 2017):
//!   r1 = x + Attention(x);  h = LN1(r1);  r2 = h + MLP(h);  out = LN2(r2).
//! The pre-training objective is RoBERTa's (Liu et al. 2019): masked-LM only; there is no
//! next-sentence head and no token-type embedding. Padded sequences (ForwardArgs::lengths) are
//! masked in attention: no query sees a padded key (see docs/bert.md).

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "loom/backend/attention_mask.hpp"
#include "loom/backend/concepts.hpp"
#include "loom/backend/gradient_write.hpp"
#include "loom/comm/ref.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/models/attention_storage.hpp"
#include "loom/models/bert/config.hpp"
#include "loom/models/concepts.hpp"
#include "loom/models/detail/transformer.hpp"
#include "loom/models/detail/transformer_slice.hpp"
#include "loom/nn/tensor_parallel.hpp"

namespace loom::bert {

//! What a block keeps of its attention for the backward (loom::AttentionStorage).
using Attention = AttentionStorage;
using loom::name;

//! BERT on backend `B` with scalar `T` (float, double for gradient checks, bf16 for mixed
//! precision as gpt2::Model). The kernels for `B` must be visible (e.g. include
//! "loom/backend/cpu/kernels.hpp").
template <Backend B, class T = float>
class Model : public detail::transformer::Slice<Config> {
 public:
  using loom_model = void;
  using backend_type = B;
  using scalar_type = T;
  //! Every layer's backward writes its input gradient (loom::writes_input_grad).
  static constexpr bool writes_input_grad = true;

  //! The whole model on one rank.
  explicit Model(Config config, Attention attention = Attention::stored)
      : Model(config, CommunicatorRef{}, attention) {}

  //! This rank's slice of the model, split over `tensor_parallel` (which must outlive the model;
  //! every rank of it constructs its Model with the same config). Throws loom::Error, before any
  //! work, when `config` does not split over the group (Config::validate_tensor_parallel), or asks
  //! for attention dropout on a backend whose attention kernels cannot apply it
  //! (supports_attention_dropout).
  Model(Config config, CommunicatorRef tensor_parallel, Attention attention = Attention::stored)
      : Slice(config, tensor_parallel, attention, "bert"),
        lne_weight_(offset("ln_e.weight")),
        lne_bias_(offset("ln_e.bias")),
        dense_weight_(offset("mlm.dense.weight")),
        dense_bias_(offset("mlm.dense.bias")),
        lnm_weight_(offset("mlm.ln.weight")),
        lnm_bias_(offset("mlm.ln.bias")),
        output_bias_(offset("mlm.bias")) {
    detail::transformer::check_attention_dropout<B>(config_.attention_dropout, "bert");
  }

  //! Forward FLOPs per token of `layer` at full context on this rank (for pipeline balancing).
  double layer_cost(int layer) const noexcept {
    const double C = static_cast<double>(config_.channels);
    if (layer == embedding_layer) return C;
    if (layer == head_layer(config_))
      return head_share() * (2.0 * static_cast<double>(vocab_rows_) * C + 2.0 * C * C);
    return block_cost();
  }

  //! Training FLOPs per token of the whole model, 6·N + 12·l·h·s (the attention term counts
  //! every key, which a bidirectional mask does compute), less the head's GEMMs (the transform,
  //! h² + h, and the unembedding, v·h + v) at the positions it skips: it computes them at
  //! head_share() of the positions.
  double flops_per_token(std::int64_t seq) const noexcept {
    const double h = static_cast<double>(config_.channels), v = static_cast<double>(config_.vocab_size);
    return 6.0 * static_cast<double>(config_.parameter_count()) +
           12.0 * static_cast<double>(config_.num_layers * config_.channels * seq) -
           6.0 * (1.0 - head_share()) * (h * h + h + v * h + v);
  }
  //! The share of positions at which the head runs: 1 with Config::logits_at_every_position, else
  //! 0.15, the share of positions masked-LM predicts (io::MaskedLmConfig::select_probability's
  //! default, from Devlin et al.). An expectation, for FLOP counts and pipeline balancing: the
  //! head runs on the rows whose target is >= 0, however many they are.
  double head_share() const noexcept { return config_.logits_at_every_position ? 1.0 : 0.15; }

  //! Elements of T a layer keeps from forward to backward for one micro-batch, on this rank:
  //! N·(C + 2) for the embedding (the sum before its layernorm and the layernorm's statistics);
  //! for a block N·(3·C + 12·C/tp + 4) + B·(H/tp)·T² (r1, h, r2, this rank's qkv, attention
  //! output, MLP hidden units before and after GELU, the probabilities, four row statistics), or
  //! + B·(H/tp)·T (the rows' log-sum-exp) with Attention::recompute; N·(3·C + 3 + V/tp) and 3
  //! doubles a row for the head and one more (without the V/tp and the one with
  //! Config::logits_chunk_rows), and 2·N int32 for the rows it predicts (unless
  //! Config::logits_at_every_position); with
  //! Config::max_predictions_per_seq = P the head's N is B·min(P, T), whatever the targets. Under
  //! sequence parallelism the embedding's and the blocks' row-wise tensors (sum; r1, h, r2) and their
  //! statistics are this rank's N/tp rows. For bf16 each float statistic takes two elements (as in
  //! gpt2::Model).
  std::int64_t activation_elements(int layer, MicroBatchShape s) const noexcept {
    Carver counter{};
    if (layer == embedding_layer) embedding_saved(counter, s);
    else if (layer == head_layer(config_)) head_saved(counter, s);
    else block_saved(counter, s);
    return counter.elements();
  }

  //! Scratch a layer's backward needs, on this rank: N·C for the embedding (the gradient before
  //! its layernorm), N·(3·C + 8·C/tp) for a block, N·2·C for the head; with hidden dropout N·C
  //! more for the embedding and a block (an output gradient through the mask). Under sequence
  //! parallelism the row-wise ones are N/tp rows, and whole [N, C] buffers for what is gathered
  //! and for partial sums come on top (embedding_workspace, block_workspace, head_workspace).
  std::int64_t workspace_elements(int layer, MicroBatchShape s) const noexcept {
    Carver counter{};
    if (layer == embedding_layer) embedding_workspace(counter, s);
    else if (layer == head_layer(config_)) head_workspace(counter, s);
    else block_workspace(counter, s);
    return counter.elements();
  }

  //! Checks a batch on the host (the Trainer calls this before it copies the batch to a device):
  //! tokens [B, T] in [0, vocab_size), targets of the same shape below vocab_size; a negative
  //! target is not predicted (masked-LM: only the masked positions carry a target); with
  //! Config::max_predictions_per_seq, at most that many targets a sequence.
  void check_batch(Tensor<const std::int32_t> tokens, Tensor<const std::int32_t> targets) const {
    detail::transformer::check_batch(tokens, targets, config_.vocab_size, "bert");
    const std::int64_t cap = config_.max_predictions_per_seq;
    if (cap == 0) return;
    const std::int64_t rows = targets.extent(0), seq = targets.extent(1);
    for (std::int64_t r = 0; r < rows; ++r) {
      std::int64_t count = 0;
      for (std::int64_t t = 0; t < seq; ++t) count += targets[r * seq + t] >= 0 ? 1 : 0;
      LOOM_CHECK(count <= cap, "bert batch: targets in sequence " + detail::to_text(r), count,
                 "must be <= max_predictions_per_seq (" + detail::to_text(cap) +
                     "); cap the data's selection to match (io::MaskedLmConfig::max_predictions, bert_train "
                     "--max-predictions)");
    }
  }

  //! Runs `layer` forward; returns the sum of per-token losses for the head, 0 otherwise.
  double forward(B& be, int layer, ParameterView<const T> params, const ForwardArgs<T>& a) const {
    const MicroBatchShape s = shape_of(a.tokens);
    if (layer == embedding_layer) return embedding_forward(be, params, a, s);
    if (layer == head_layer(config_)) return head_forward(be, params, a, s);
    block_forward(be, layer, blocks_[layer - 1], params, a, s);
    return 0.0;
  }

  //! Runs `layer` backward: parameter gradients into `grads` (+=), input gradient (+=).
  void backward(B& be, int layer, ParameterView<const T> params, ParameterView<T> grads,
                const BackwardArgs<T>& a) const {
    const MicroBatchShape s = shape_of(a.tokens);
    if (layer == embedding_layer)
      return with_fused_grads(grads, a, [&](auto fused) { embedding_backward(be, params, fused, a, s); });
    if (layer == head_layer(config_))
      return with_fused_grads(grads, a, [&](auto fused) { head_backward(be, params, fused, a, s, true); });
    block_backward(be, layer, blocks_[layer - 1], params, grads, a, s);
  }

  //! Elements `layer` keeps per micro-batch from backward_input to backward_weight, on this rank:
  //! 0 for the embedding and the head (its weight pass reads the dlogits left in `saved`);
  //! N·(2·C + 7·C/tp) for a block: the output gradients of its four linear layers (r2 for
  //! mlp.proj and r1 for attn.proj, whole; this rank's MLP hidden units and qkv). Under sequence
  //! parallelism also the block's input and h gathered whole (2·N·C), which the weight GEMMs read
  //! and the weight pass may not gather.
  std::int64_t stash_elements(int layer, MicroBatchShape s) const noexcept {
    if (layer == embedding_layer || layer == head_layer(config_)) return 0;
    Carver counter{};
    block_stash(counter, s);
    return counter.elements();
  }

  //! The input-gradient pass of `layer`'s backward (SplitBackwardModel): everything but the
  //! weight and bias gradients of the blocks' linear layers and of the unembedding (wte and the
  //! output bias), which backward_weight adds from `stash` and `saved`.
  void backward_input(B& be, int layer, ParameterView<const T> params, ParameterView<T> grads,
                      const BackwardArgs<T>& a, Tensor<T> stash) const {
    const MicroBatchShape s = shape_of(a.tokens);
    check_stash(stash, stash_elements(layer, s), "bert backward_input");
    if (layer == embedding_layer) return backward(be, layer, params, grads, a);
    // With chunked logits the input pass adds the unembedding's gradients too, from the chunks
    // it computes anyway.
    if (layer == head_layer(config_))
      return with_fused_grads(grads, a, [&](auto fused) { head_backward(be, params, fused, a, s, chunked_logits()); });
    block_backward_input(be, layer, blocks_[layer - 1], params, grads, a, s, stash);
  }

  //! The weight-gradient pass of `layer`'s backward, after its backward_input. Reads neither
  //! `a.output_grad`, `a.input_grad` nor `a.workspace`, and communicates nothing.
  void backward_weight(B& be, int layer, ParameterView<const T> params, ParameterView<T> grads,
                       const BackwardArgs<T>& a, Tensor<T> stash) const {
    const MicroBatchShape s = shape_of(a.tokens);
    check_stash(stash, stash_elements(layer, s), "bert backward_weight");
    if (layer == embedding_layer) return;
    if (layer == head_layer(config_)) {
      if (chunked_logits()) return;  // backward_input did it
      const PredictedRows predicted = predicted_rows(be, a.saved, a.targets, s);
      if (predicted.count > 0)
        with_fused_grads(grads, a, [&](auto fused) { unembedding_weight_grads(be, params, fused, predicted.saved); });
      return;
    }
    block_backward_weight(be, blocks_[layer - 1], params, grads, a, s, stash);
  }

 private:
  using BlockOffsets = detail::transformer::BlockOffsets;

  //! The type of per-row statistics and losses (float for bf16).
  using A = accumulate_t<T>;
  using Carver = detail::transformer::Carver<T>;

  A eps() const noexcept { return static_cast<A>(config_.layernorm_eps); }
  //! Where a layernorm's weight or bias gradient at `offset` accumulates in this pass: in `g` (of
  //! T, or fp32 sums: G = float), or under sequence parallelism in piece `piece` of `norm_grads`
  //! (RowSplit::norm_grad).
  template <class G>
  Tensor<G> norm_grad(ParameterView<G> g, std::int64_t offset, Tensor<G> norm_grads, int piece) const {
    return split_.norm_grad(grad(g, offset, {C()}), norm_grads, piece);
  }

  // ---------------------------------------------------------------------------------------------
  // Embedding: e = wte[tokens] + wpe[positions]; out = LN_e(e).

  struct EmbeddingSaved {
    Tensor<A> mean, rstd;
    Tensor<T> sum;
  };
  //! The sum and the layernorm's statistics are this rank's rows.
  EmbeddingSaved embedding_saved(Carver& c, MicroBatchShape s) const {
    const std::int64_t n = split_.rows(s).local;
    EmbeddingSaved e;
    e.mean = c.template take<A>({n});
    e.rstd = c.template take<A>({n});
    e.sum = c.take({n, C()});
    return e;
  }
  EmbeddingSaved carve_embedding(Tensor<T> saved, MicroBatchShape s) const {
    check_numel(saved, activation_elements(embedding_layer, s), "bert embedding", "saved");
    Carver c{saved.data()};
    return embedding_saved(c, s);
  }
  //! The embedding's backward scratch: the gradient before its layernorm (this rank's rows), and
  //! through the dropout mask (hidden dropout); under sequence parallelism first the whole [N, C]
  //! the sum's gradient is gathered into (the forward sums the partial embeddings there), and last
  //! the layernorm's partial weight and bias gradients [2·C].
  struct EmbeddingWorkspace {
    Tensor<T> gathered, dsum, dropped;
    Tensor<A> norm_grads;  // wide enough for fp32 sums (RowSplit::norm_scratch)
  };
  EmbeddingWorkspace embedding_workspace(Carver& c, MicroBatchShape s) const {
    const auto r = split_.rows(s);
    EmbeddingWorkspace w;
    if (split_.split()) w.gathered = c.take({r.total, C()});
    w.dsum = c.take({r.local, C()});
    if (config_.hidden_dropout > 0) w.dropped = c.take({r.local, C()});
    if (split_.split()) w.norm_grads = c.template take<A>({2 * C()});
    return w;
  }

  double embedding_forward(B& be, ParameterView<const T> p, const ForwardArgs<T>& a, MicroBatchShape s) const {
    // The host can read the tokens only where they are in host memory; a device batch was checked
    // before its copy (check_batch, called by the Trainer).
    if constexpr (host_addressable<B>) check_tokens(a.tokens);
    const EmbeddingSaved e = carve_embedding(a.saved, s);
    // Vocab-parallel: each rank looks up the tokens of its rows, the first adds the positions, and
    // the sum over the group is the embedding (this rank's rows of it under sequence parallelism,
    // summed whole in scratch first); the layernorm then runs on the rank's rows.
    Buffer<T, B> own;
    const Tensor<T> sums = split_.split() ? detail::transformer::forward_scratch(be, a.workspace, own,
                                                                                {s.batch, s.seq, C()}, "bert embedding")
                                          : e.sum;
    vocab_parallel_embedding_forward<T>(be, sums.reshape({s.batch, s.seq, C()}), a.tokens,
                                        param(p, wte_, {vocab_rows_, C()}), vocab_begin_,
                                        first_rank() ? param(p, wpe_, {config_.max_seq_len, C()}) : Tensor<const T>{});
    split_.reduce(sums, e.sum);
    const Tensor<T> output = split_.local(a.output, s);
    layernorm_forward<T>(be, output, e.mean, e.rstd, e.sum, param(p, lne_weight_, {C()}), param(p, lne_bias_, {C()}),
                         eps());
    split_.drop(be, output, a.dropout, embedding_layer, detail::transformer::hidden_site, config_.hidden_dropout, s);
    return 0.0;
  }

  //! The embedding's backward, its parameter gradients into `g` (of T, or fp32 sums: G = float).
  template <class G>
  void embedding_backward(B& be, ParameterView<const T> p, ParameterView<G> g, const BackwardArgs<T>& a,
                          MicroBatchShape s) const {
    const EmbeddingSaved e = carve_embedding(a.saved, s);
    check_numel(a.workspace, workspace_elements(embedding_layer, s), "bert embedding backward", "workspace");
    Carver c{a.workspace.data()};
    const EmbeddingWorkspace w = embedding_workspace(c, s);
    const Tensor<G> norm_grads = split_.template norm_scratch<G>(be, w.norm_grads);
    zero<T>(be, w.dsum);
    // The output gradient (through the dropout mask) of this rank's rows: whole on every rank
    // without sequence parallelism, so the layernorm's gradients are too; with it they are partial
    // sums, summed over the group.
    const Tensor<const T> doutput = split_.through_drop(be, a, embedding_layer, detail::transformer::hidden_site,
                                                        config_.hidden_dropout, w.dropped, s);
    layernorm_backward<T, G>(be, w.dsum, norm_grad(g, lne_weight_, norm_grads, 0),
                             norm_grad(g, lne_bias_, norm_grads, 1), doutput, e.sum, param(p, lne_weight_, {C()}),
                             e.mean, e.rstd);
    split_.sum_norm_grads(be, norm_grads, {grad(g, lne_weight_, {C()}), grad(g, lne_bias_, {C()})});
    // Every rank accumulates its wte rows and the whole wpe gradient from the whole sum's gradient.
    const Tensor<const T> dsum = split_.gather(w.dsum, w.gathered);
    vocab_parallel_embedding_backward<T>(be, grad(g, wte_, {vocab_rows_, C()}), vocab_begin_,
                                         grad(g, wpe_, {config_.max_seq_len, C()}), dsum.reshape({s.batch, s.seq, C()}),
                                         a.tokens);
  }

  // ---------------------------------------------------------------------------------------------
  // Encoder block: r1 = x + attn(x); h = LN1(r1); r2 = h + mlp(h); out = LN2(r2).

  //! What a block keeps; the statistics (and the log-sum-exp) first, in the accumulate type. Of
  //! `att` (Attention::stored) and `lse` (recompute) one is empty.
  struct BlockSaved {
    Tensor<A> ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, lse;
    Tensor<T> qkv, att, atty, r1, h, fch, fch_gelu, r2;
  };
  //! r1, h, r2 and the layernorms' statistics are this rank's rows.
  BlockSaved block_saved(Carver& c, MicroBatchShape s) const {
    const std::int64_t Bn = s.batch, Tn = s.seq, Ca = attention_channels_, F = mlp_channels_,
                       n = split_.rows(s).local;
    BlockSaved b;
    b.ln1_mean = c.template take<A>({n});
    b.ln1_rstd = c.template take<A>({n});
    b.ln2_mean = c.template take<A>({n});
    b.ln2_rstd = c.template take<A>({n});
    if (attention_ == Attention::recompute) b.lse = c.template take<A>({Bn, heads_, Tn});
    b.qkv = c.take({Bn, Tn, 3 * Ca});
    if (attention_ == Attention::stored) b.att = c.take({Bn, heads_, Tn, Tn});
    b.atty = c.take({Bn, Tn, Ca});
    b.r1 = c.take({n, C()});
    b.h = c.take({n, C()});
    b.fch = c.take({Bn, Tn, F});
    b.fch_gelu = c.take({Bn, Tn, F});
    b.r2 = c.take({n, C()});
    return b;
  }
  BlockSaved carve_block(Tensor<T> saved, MicroBatchShape s) const {
    check_numel(saved, activation_elements(block_layer(0), s), "bert block", "saved");
    Carver c{saved.data()};
    return block_saved(c, s);
  }

  //! The keys a block's queries see: the bidirectional mask, less each sequence's padding.
  template <class Args>
  static AttentionKeys attention_keys(const Args& a) noexcept {
    return {AttentionMask::bidirectional, a.lengths};
  }

  void block_forward(B& be, int layer, const BlockOffsets& o, ParameterView<const T> p, const ForwardArgs<T>& a,
                     MicroBatchShape s) const {
    namespace tr = detail::transformer;
    const std::int64_t C = config_.channels, Ca = attention_channels_, F = mlp_channels_;
    const BlockSaved b = carve_block(a.saved, s);
    const AttentionDropout drop = attention_dropout(a.dropout, layer);
    const Tensor<const T> input = split_.local(a.input, s);
    // Under sequence parallelism the column-parallel layers' inputs (the block's input, h) are
    // gathered whole into `whole`, and the row-parallel layers' partial sums are computed there
    // and reduce-scattered back to this rank's rows.
    Buffer<T, B> own;
    const Tensor<T> whole = split_.split()
                                ? tr::forward_scratch(be, a.workspace, own, {split_.rows(s).total, C}, "bert block")
                                : Tensor<T>{};
    // Column-parallel qkv (f: the input goes in whole): this rank's heads.
    matmul_forward<T>(be, b.qkv, split_.gather(input, whole), param(p, o.qkv_w, {3 * Ca, C}),
                      param(p, o.qkv_b, {3 * Ca}));
    block_attention_forward<T>(be, b, attention_keys(a), drop);
    // Row-parallel projection (g: sum the partial sums; the bias rides on the first rank).
    split_.project_add(be, b.r1, whole, b.atty, param(p, o.proj_w, {C, Ca}), row_bias(p, o.proj_b), input,
                       a.dropout, layer, tr::hidden_site, config_.hidden_dropout, s);
    layernorm_forward<T>(be, b.h, b.ln1_mean, b.ln1_rstd, b.r1, param(p, o.ln1_w, {C}), param(p, o.ln1_b, {C}),
                         eps());
    // MLP: column-parallel fc with GELU, then row-parallel proj.
    matmul_gelu_forward<T>(be, b.fch_gelu, b.fch, split_.gather(b.h, whole), param(p, o.fc_w, {F, C}),
                           param(p, o.fc_b, {F}), config_.gelu);
    split_.project_add(be, b.r2, whole, b.fch_gelu, param(p, o.fcproj_w, {C, F}), row_bias(p, o.fcproj_b),
                       b.h, a.dropout, layer, tr::mlp_site, config_.hidden_dropout, s);
    layernorm_forward<T>(be, split_.local(a.output, s), b.ln2_mean, b.ln2_rstd, b.r2, param(p, o.ln2_w, {C}),
                         param(p, o.ln2_b, {C}), eps());
  }

  //! A block's backward scratch: the gradients w.r.t. r2, the MLP's hidden units before GELU, h,
  //! r1, the attention output, qkv, and (with hidden dropout) the MLP branch's output gradient
  //! through the mask (`mlp_out`). `h` is reused for the input's attention-branch gradient once
  //! r1's is known. Under sequence parallelism r2, h, r1 and mlp_out are this rank's rows, and
  //! there are three more pieces: `gathered` [N, C] for what the linear layers need whole (an
  //! output gradient gathered, the block's input or h gathered again), `partial` [N, C] for the
  //! column-parallel layers' partial input gradients, and `norm_grads` [4·C] for the layernorms'
  //! partial weight and bias gradients (ln2 then ln1). The `*_whole` tensors say where the chain
  //! gathers each (all `gathered`, or the stash under backward_input).
  struct BlockGrads {
    Tensor<T> r2, fch, h, r1, atty, qkv, mlp_out, gathered, partial;
    Tensor<A> norm_grads;  // wide enough for fp32 sums (RowSplit::norm_scratch)
    Tensor<T> mlp_whole, h_whole, r1_whole, input_whole;
  };
  BlockGrads block_workspace(Carver& w, MicroBatchShape s) const {
    const std::int64_t Bn = s.batch, Tn = s.seq;
    const auto r = split_.rows(s);
    BlockGrads d;
    d.r2 = w.take({r.local, C()});
    d.fch = w.take({Bn, Tn, mlp_channels_});
    d.h = w.take({r.local, C()});
    d.r1 = w.take({r.local, C()});
    d.atty = w.take({Bn, Tn, attention_channels_});
    d.qkv = w.take({Bn, Tn, 3 * attention_channels_});
    if (config_.hidden_dropout > 0) d.mlp_out = w.take({r.local, C()});
    if (split_.split()) {
      d.gathered = w.take({r.total, C()});
      d.partial = w.take({r.total, C()});
      d.norm_grads = w.template take<A>({4 * C()});
      d.mlp_whole = d.h_whole = d.r1_whole = d.input_whole = d.gathered;
    }
    return d;
  }
  BlockGrads carve_block_workspace(Tensor<T> workspace, MicroBatchShape s, const char* kernel) const {
    check_numel(workspace, workspace_elements(1, s), kernel, "workspace");
    Carver w{workspace.data()};
    return block_workspace(w, s);
  }

  //! What a block's backward_input keeps for its backward_weight: the gradients w.r.t. the outputs
  //! of its four linear layers (mlp.proj: r2, attn.proj: r1, mlp.fc: fch, attn.qkv: qkv); under
  //! sequence parallelism r2's and r1's gathered whole, and the block's input and h gathered
  //! whole too.
  struct BlockStash {
    Tensor<T> r2, r1, fch, qkv, h, input;
  };
  BlockStash block_stash(Carver& c, MicroBatchShape s) const {
    const std::int64_t Bn = s.batch, Tn = s.seq;
    BlockStash st;
    st.r2 = c.take({Bn * Tn, C()});
    st.r1 = c.take({Bn * Tn, C()});
    st.fch = c.take({Bn, Tn, mlp_channels_});
    st.qkv = c.take({Bn, Tn, 3 * attention_channels_});
    if (split_.split()) {
      st.h = c.take({Bn * Tn, C()});
      st.input = c.take({Bn * Tn, C()});
    }
    return st;
  }
  BlockStash carve_block_stash(Tensor<T> stash, MicroBatchShape s) const {
    Carver c{stash.data()};
    return block_stash(c, s);
  }

  void block_backward(B& be, int layer, const BlockOffsets& o, ParameterView<const T> p, ParameterView<T> g,
                      const BackwardArgs<T>& a, MicroBatchShape s) const {
    const BlockSaved b = carve_block(a.saved, s);
    const BlockGrads d = carve_block_workspace(a.workspace, s, "bert block backward");
    with_fused_grads(g, a, [&](auto fused) { block_backward_chain(be, layer, o, p, fused, a, s, b, d, true); });
  }

  //! The input pass computes the gradients the weight GEMMs read straight into the stash, and
  //! skips those GEMMs; block_backward_weight runs them on the same operands. With hidden
  //! dropout mlp.proj's is r2's gradient through the mask, while the residual takes r2's own: the
  //! stash gets the former and r2's stays in the workspace.
  void block_backward_input(B& be, int layer, const BlockOffsets& o, ParameterView<const T> p, ParameterView<T> g,
                            const BackwardArgs<T>& a, MicroBatchShape s, Tensor<T> stash) const {
    const BlockSaved b = carve_block(a.saved, s);
    BlockGrads d = carve_block_workspace(a.workspace, s, "bert block backward_input");
    const BlockStash st = carve_block_stash(stash, s);
    if (split_.split()) {
      // The chain gathers the weight GEMMs' whole operands into the stash.
      d.mlp_whole = st.r2;
      d.r1_whole = st.r1;
      d.h_whole = st.h;
      d.input_whole = st.input;
    } else {
      if (detail::transformer::dropping(a.dropout, config_.hidden_dropout)) d.mlp_out = st.r2;
      else d.r2 = st.r2;
      d.r1 = st.r1;
    }
    d.fch = st.fch;
    d.qkv = st.qkv;
    with_fused_grads(g, a, [&](auto fused) { block_backward_chain(be, layer, o, p, fused, a, s, b, d, false); });
  }

  void block_backward_weight(B& be, const BlockOffsets& o, ParameterView<const T> p, ParameterView<T> g,
                             const BackwardArgs<T>& a, MicroBatchShape s, Tensor<T> stash) const {
    const std::int64_t C = config_.channels, Ca = attention_channels_, F = mlp_channels_;
    const BlockSaved b = carve_block(a.saved, s);
    const BlockStash st = carve_block_stash(stash, s);
    const Tensor<T> no_input_grad{};
    // h and the input whole: kept (replicated), or gathered into the stash by the I pass.
    const Tensor<const T> h = split_.split() ? st.h : b.h, input = split_.split() ? st.input : a.input;
    with_fused_grads(g, a, [&](auto fused) {
      const auto w = block_linear_grads(fused, o);
      matmul_backward<T>(be, no_input_grad, w.fcproj_w, w.fcproj_b, st.r2, b.fch_gelu, param(p, o.fcproj_w, {C, F}));
      matmul_backward<T>(be, no_input_grad, w.fc_w, w.fc_b, st.fch, h, param(p, o.fc_w, {F, C}));
      matmul_backward<T>(be, no_input_grad, w.proj_w, w.proj_b, st.r1, b.atty, param(p, o.proj_w, {C, Ca}));
      matmul_backward<T>(be, no_input_grad, w.qkv_w, w.qkv_b, st.qkv, input, param(p, o.qkv_w, {3 * Ca, C}));
    });
  }

  //! A block's backward from the output gradient to the input gradient, through the gradients
  //! `d`, whose contents on entry do not matter: each kernel overwrites its output there
  //! (GradientWrite::overwrite), which spares zeroing them and reading the zeros back. The
  //! parameter gradients go to `g` (of T, or fp32 sums: G = float), the linear layers' weight
  //! gradients in the same calls as their input gradients, unless `linear_grads` is false
  //! (backward_input leaves them to backward_weight).
  template <class G>
  void block_backward_chain(B& be, int layer, const BlockOffsets& o, ParameterView<const T> p, ParameterView<G> g,
                            const BackwardArgs<T>& a, MicroBatchShape s, const BlockSaved& b, const BlockGrads& d,
                            bool linear_grads) const {
    namespace tr = detail::transformer;
    const std::int64_t C = config_.channels, Ca = attention_channels_, F = mlp_channels_;
    const bool split = split_.split();
    const Tensor<T> input_grad = split_.local(a.input_grad, s);
    const Tensor<const T> input = split_.local(a.input, s);
    constexpr GradientWrite overwrite = GradientWrite::overwrite;
    const auto w = linear_grads ? block_linear_grads(g, o) : tr::BlockLinearGrads<G>{};
    const Tensor<G> norm_grads = split_.template norm_scratch<G>(be, d.norm_grads);
    // out = LN2(r2): the output gradient is whole on every rank (or this rank's rows: then the
    // layernorms' gradients are partial sums, summed over the group at the end).
    layernorm_backward<T, G>(be, d.r2, norm_grad(g, o.ln2_w, norm_grads, 0), norm_grad(g, o.ln2_b, norm_grads, 1),
                          split_.local(a.output_grad, s), b.r2, param(p, o.ln2_w, {C}), b.ln2_mean, b.ln2_rstd, {},
                          overwrite);
    // r2 = h + dropout(mlp(h)): the MLP branch gets r2's gradient through the mask. g backward:
    // whole on every rank (gathered under sequence parallelism), so each rank's row-parallel
    // bias gradient is already the whole one.
    Tensor<const T> mlp_out = d.r2;
    if (tr::dropping(a.dropout, config_.hidden_dropout)) {
      copy<T>(be, d.mlp_out, d.r2);
      split_.drop(be, d.mlp_out, a.dropout, layer, tr::mlp_site, config_.hidden_dropout, s);
      mlp_out = d.mlp_out;
    }
    gelu_matmul_backward<T>(be, d.fch, w.fcproj_w, w.fcproj_b, split_.gather(mlp_out, d.mlp_whole), b.fch_gelu,
                            param(p, o.fcproj_w, {C, F}), b.fch, config_.gelu);
    // f backward: the ranks' shares of the MLP branch sum to its whole gradient (this rank's rows
    // of it under sequence parallelism); then the residual's.
    const Tensor<T> dh = split ? d.partial : d.h;
    matmul_backward<T>(be, dh, w.fc_w, w.fc_b, d.fch, split_.gather(b.h, d.h_whole), param(p, o.fc_w, {F, C}),
                       overwrite);
    split_.reduce(dh, d.h);
    add_to<T>(be, d.h, d.r2);
    // h = LN1(r1); r1 = x + attn(x).
    layernorm_backward<T, G>(be, d.r1, norm_grad(g, o.ln1_w, norm_grads, 2), norm_grad(g, o.ln1_b, norm_grads, 3),
                          d.h, b.r1, param(p, o.ln1_w, {C}), b.ln1_mean, b.ln1_rstd, {}, overwrite);
    copy<T>(be, input_grad, d.r1);
    // r1 = x + dropout(attn(x)): the branch's gradient through the mask, in place once the
    // residual has it (under backward_input without sequence parallelism d.r1 is the stash
    // attn.proj's weight GEMM reads).
    split_.drop(be, d.r1, a.dropout, layer, tr::hidden_site, config_.hidden_dropout, s);
    matmul_backward<T>(be, d.atty, w.proj_w, w.proj_b, split_.gather(d.r1, d.r1_whole), b.atty,
                       param(p, o.proj_w, {C, Ca}), overwrite);
    const AttentionDropout drop = attention_dropout(a.dropout, layer);
    block_attention_backward<T>(be, d.qkv, d.atty, b, attention_keys(a), drop);
    // The input's attention-branch gradient, summed over the group, lands in d.h (no longer read).
    const Tensor<T> dx_attention = split ? d.partial : d.h;
    matmul_backward<T>(be, dx_attention, w.qkv_w, w.qkv_b, d.qkv, split_.gather(input, d.input_whole),
                       param(p, o.qkv_w, {3 * Ca, C}), overwrite);
    split_.reduce(dx_attention, d.h);
    add_to<T>(be, input_grad, d.h);
    split_.sum_norm_grads(be, norm_grads, {grad(g, o.ln2_w, {C}), grad(g, o.ln2_b, {C}), grad(g, o.ln1_w, {C}),
                                           grad(g, o.ln1_b, {C})});
  }

  // ---------------------------------------------------------------------------------------------
  // Masked-LM head: pre = x W_d^T + b_d; t = LN_m(GELU(pre)); logits = t wte^T + b_out;
  // cross-entropy over the positions whose target is >= 0.

  //! What the head keeps; the statistics and losses in the accumulate type, first, then each row's
  //! logit statistics in double; then, unless Config::logits_chunk_rows, this rank's slice of the
  //! logits (from which, with the statistics, the backward computes the probabilities, unless the
  //! forward wrote their gradient there already); then, unless Config::logits_at_every_position,
  //! the predicted rows' indices and targets; last, unless chunked, the scale of the gradient in
  //! the logits in double (0: not written). Every per-row
  //! tensor has room for head_rows() rows (N, or B·max_predictions_per_seq); the head uses the
  //! first M, the rows it predicts.
  struct HeadSaved {
    Tensor<A> mean, rstd, losses;
    detail::transformer::LogitStatistics stats;
    Tensor<T> pre, act, t, logits;
    Tensor<std::int32_t> row_ids, row_targets;  //!< the predicted rows and their targets

    //! The first `M` rows of each.
    HeadSaved first(std::int64_t M) const {
      using detail::transformer::rows;
      HeadSaved v = *this;
      v.mean = rows(mean, 0, M);
      v.rstd = rows(rstd, 0, M);
      v.losses = rows(losses, 0, M);
      if (!stats.row_max.empty())
        v.stats = {rows(stats.row_max, 0, M), rows(stats.partials, 0, 2 * M), stats.gradient_scale};
      v.pre = rows(pre, 0, M);
      v.act = rows(act, 0, M);
      v.t = rows(t, 0, M);
      if (!logits.empty()) v.logits = rows(logits, 0, M);
      if (!row_ids.empty()) {
        v.row_ids = rows(row_ids, 0, M);
        v.row_targets = rows(row_targets, 0, M);
      }
      return v;
    }
  };
  //! The rows the head keeps room for: B·min(max_predictions_per_seq, T) with a cap, else N.
  std::int64_t head_rows(MicroBatchShape s) const noexcept {
    const std::int64_t cap = config_.max_predictions_per_seq;
    return s.batch * (cap > 0 ? std::min(cap, s.seq) : s.seq);
  }
  HeadSaved head_saved(Carver& c, MicroBatchShape s) const {
    const std::int64_t N = head_rows(s);
    HeadSaved h;
    h.mean = c.template take<A>({N});
    h.rstd = c.template take<A>({N});
    h.losses = c.template take<A>({N});
    h.stats.row_max = c.template take<double>({N});
    h.stats.partials = c.template take<double>({2 * N});
    h.pre = c.take({N, C()});
    h.act = c.take({N, C()});
    h.t = c.take({N, C()});
    if (!chunked_logits()) h.logits = c.take({N, vocab_rows_});
    if (!config_.logits_at_every_position) {
      h.row_ids = c.template take<std::int32_t>({N});
      h.row_targets = c.template take<std::int32_t>({N});
    }
    if (!chunked_logits()) h.stats.gradient_scale = c.template take<double>({1});
    return h;
  }
  //! The rows the head predicts, M of them: every row, its targets as they are, with
  //! Config::logits_at_every_position; otherwise those whose target is >= 0, selected into the
  //! saved `row_ids` and `row_targets` (on a GPU the count comes to the host: one wait for the
  //! stream). `saved` is the head's saved tensors cut to those M rows.
  struct PredictedRows {
    std::int64_t count = 0;
    HeadSaved saved;
    Tensor<const std::int32_t> targets;  //!< [M]
  };
  PredictedRows predicted_rows(B& be, Tensor<T> saved, Tensor<const std::int32_t> targets, MicroBatchShape s) const {
    const HeadSaved whole = carve_head(saved, s);
    const std::int64_t N = s.batch * s.seq;
    if (config_.logits_at_every_position) return {N, whole.first(N), targets.reshape({N})};
    const std::int64_t M = select_target_rows(be, whole.row_ids, whole.row_targets, targets.reshape({N}));
    LOOM_CHECK(M <= whole.row_ids.numel(), "bert head: targets in the micro-batch", M,
               "must be <= batch x max_predictions_per_seq (" + detail::to_text(whole.row_ids.numel()) +
                   "), the rows the head keeps room for");
    return {M, whole.first(M), Tensor<const std::int32_t>(whole.row_targets.data(), {M})};
  }
  std::int64_t logits_chunk(MicroBatchShape s) const noexcept {
    return std::min(config_.logits_chunk_rows, head_rows(s));
  }
  //! The head's backward scratch: dt and dact, and one chunk's logits and statistics when
  //! chunked; under sequence parallelism also the head's input gathered whole and the whole input
  //! gradient (the transform is replicated: every rank computes it on all rows).
  struct HeadWorkspace {
    Tensor<T> dt, dact, input, input_grad;
    detail::transformer::LogitScratch<T> chunk;
  };
  HeadWorkspace head_workspace(Carver& c, MicroBatchShape s) const {
    HeadWorkspace w;
    if (chunked_logits()) w.chunk = detail::transformer::carve_logit_scratch(c, logits_chunk(s), vocab_rows_);
    w.dt = c.take({head_rows(s), C()});
    w.dact = c.take({head_rows(s), C()});
    if (split_.split()) {
      w.input = c.take({s.batch * s.seq, C()});
      w.input_grad = c.take({s.batch * s.seq, C()});
    }
    return w;
  }
  //! The head's input whole [N, C]: the hidden state as it is, or under sequence parallelism every
  //! rank's rows gathered into `workspace`'s (or, without one, `own`).
  Tensor<const T> head_input(B& be, Tensor<T> workspace, Buffer<T, B>& own, const Tensor<const T>& hidden,
                             MicroBatchShape s) const {
    const std::int64_t N = s.batch * s.seq;
    if (!split_.split()) return hidden.reshape({N, C()});
    Tensor<T> whole;
    if (workspace.empty()) {
      own = Buffer<T, B>(be, N * C(), MemoryCategory::workspace);
      whole = Tensor<T>(own.data(), {N, C()});
    } else {
      check_numel(workspace, workspace_elements(head_layer(config_), s), "bert head", "workspace");
      Carver c{workspace.data()};
      whole = head_workspace(c, s).input;
    }
    return split_.gather(split_.local(hidden, s), whole);
  }
  HeadSaved carve_head(Tensor<T> saved, MicroBatchShape s) const {
    check_numel(saved, activation_elements(head_layer(config_), s), "bert head", "saved");
    Carver c{saved.data()};
    return head_saved(c, s);
  }

  double head_forward(B& be, ParameterView<const T> p, const ForwardArgs<T>& a, MicroBatchShape s) const {
    const std::int64_t C = config_.channels;
    // The transform is replicated: every rank computes it (on the gathered rows under sequence
    // parallelism), and every rank of the group selects the same rows (its targets are the same).
    Buffer<T, B> own_input;
    const Tensor<const T> input = head_input(be, a.workspace, own_input, a.input, s);
    const PredictedRows predicted = predicted_rows(be, a.saved, a.targets, s);
    if (predicted.count == 0) return 0.0;
    const HeadSaved& h = predicted.saved;
    // The predicted rows of the input wait in t, which the layernorm overwrites after the dense
    // GEMM has read them.
    Tensor<const T> x = input;
    if (!config_.logits_at_every_position) {
      detail::transformer::gather_rows<T>(be, h.t, input, h.row_ids);
      x = h.t;
    }
    matmul_gelu_forward<T>(be, h.act, h.pre, x, param(p, dense_weight_, {C, C}), param(p, dense_bias_, {C}),
                           config_.gelu);
    layernorm_forward<T>(be, h.t, h.mean, h.rstd, h.act, param(p, lnm_weight_, {C}), param(p, lnm_bias_, {C}),
                         eps());
    if (chunked_logits()) {
      Buffer<T, B> own;
      const Tensor<T> logits = detail::transformer::forward_logits_scratch(be, a.workspace, own, logits_chunk(s),
                                                                            vocab_rows_);
      return detail::transformer::chunked_unembedding_loss<T>(
          be, tensor_parallel_, h.losses, h.stats, logits, h.t, param(p, wte_, {vocab_rows_, C}),
          param(p, output_bias_, {vocab_rows_}), predicted.targets, vocab_begin_, config_.vocab_size, logits_chunk(s));
    }
    // This rank's slice of the logits (column-parallel over wte's rows and the output bias) lands
    // in `logits`; the vocab-parallel cross-entropy exchanges only per-row statistics.
    matmul_forward<T>(be, h.logits, h.t, param(p, wte_, {vocab_rows_, C}), param(p, output_bias_, {vocab_rows_}));
    return detail::transformer::vocab_parallel_loss<T>(be, tensor_parallel_, h.losses, h.logits, h.stats,
                                                       predicted.targets, vocab_begin_, config_.vocab_size,
                                                       a.loss_scale);
  }

  //! wte's and the output bias's gradients from the dlogits that head_backward leaves in place of
  //! the logits (`h`: the saved tensors of the predicted rows), into `g` (of T, or fp32 sums).
  template <class G>
  void unembedding_weight_grads(B& be, ParameterView<const T> p, ParameterView<G> g, const HeadSaved& h) const {
    const std::int64_t C = config_.channels;
    matmul_backward<T>(be, Tensor<T>{}, grad(g, wte_, {vocab_rows_, C}), grad(g, output_bias_, {vocab_rows_}), h.logits,
                       h.t, param(p, wte_, {vocab_rows_, C}));
  }

  //! The head's backward, its parameter gradients into `fused` (of T, or fp32 sums: G = float);
  //! with `unembedding_grads` false it leaves wte's and the output bias's gradients to
  //! backward_weight.
  template <class G>
  void head_backward(B& be, ParameterView<const T> p, ParameterView<G> fused, const BackwardArgs<T>& a,
                     MicroBatchShape s, bool unembedding_grads) const {
    using detail::transformer::rows;
    const std::int64_t C = config_.channels, N = s.batch * s.seq;
    check_numel(a.workspace, workspace_elements(head_layer(config_), s), "bert head backward", "workspace");
    Carver c{a.workspace.data()};
    const HeadWorkspace w = head_workspace(c, s);
    const PredictedRows predicted = predicted_rows(be, a.saved, a.targets, s);
    const std::int64_t M = predicted.count;
    if (M == 0) {
      zero<T>(be, split_.local(a.input_grad, s));  // no prediction, no gradient (written, as every layer's)
      return;
    }
    const HeadSaved& h = predicted.saved;
    const Tensor<T> dt = rows(w.dt, 0, M), dact = rows(w.dact, 0, M);
    // dt is written, not read, by either path; dact by the layernorm's backward.
    if (chunked_logits()) {
      detail::transformer::chunked_unembedding_loss_backward<T>(
          be, dt, unembedding_grads ? grad(fused, wte_, {vocab_rows_, C}) : Tensor<G>{},
          unembedding_grads ? grad(fused, output_bias_, {vocab_rows_}) : Tensor<G>{}, w.chunk, h.stats, h.t,
          param(p, wte_, {vocab_rows_, C}), param(p, output_bias_, {vocab_rows_}), predicted.targets, vocab_begin_,
          config_.vocab_size, a.loss_scale, logits_chunk(s));
    } else {
      // dlogits overwrite the logits they are computed from (this rank's slice).
      detail::transformer::vocab_parallel_loss_backward<T>(be, h.logits, h.stats, predicted.targets, vocab_begin_,
                                                           config_.vocab_size, a.loss_scale);
      if (unembedding_grads) unembedding_weight_grads(be, p, fused, h);
      matmul_backward<T>(be, dt, Tensor<T>{}, Tensor<T>{}, h.logits, h.t, param(p, wte_, {vocab_rows_, C}),
                         GradientWrite::overwrite);
    }
    // f backward of the column-parallel logits: sum the slices' shares of dt.
    nn::column_parallel_input_grad(tensor_parallel_, dt);
    layernorm_backward<T, G>(be, dact, grad(fused, lnm_weight_, {C}), grad(fused, lnm_bias_, {C}), dt, h.act,
                             param(p, lnm_weight_, {C}), h.mean, h.rstd, Tensor<const T>{}, GradientWrite::overwrite);
    // dt is spent: it becomes the gradient w.r.t. pre.
    const Tensor<T> dpre = dt;
    zero<T>(be, dpre);
    gelu_backward<T>(be, dpre, h.pre, dact, config_.gelu);
    // Under sequence parallelism the whole input gradient, the same on every rank, lands in
    // scratch, and this rank adds its rows of it.
    Buffer<T, B> unused;
    const Tensor<const T> input = head_input(be, a.workspace, unused, a.input, s);
    const Tensor<T> dinput = split_.split() ? w.input_grad : a.input_grad.reshape({N, C});
    if (config_.logits_at_every_position) {
      matmul_backward<T>(be, dinput, grad(fused, dense_weight_, {C, C}), grad(fused, dense_bias_, {C}), dpre, input,
                         param(p, dense_weight_, {C, C}), GradientWrite::overwrite);
    } else {
      // dact is spent too: it takes the predicted rows of the input again, and act (which only
      // the layernorm's backward read) their gradient, which goes back to those rows; the other
      // rows' gradient is 0.
      detail::transformer::gather_rows<T>(be, dact, input, h.row_ids);
      matmul_backward<T>(be, h.act, grad(fused, dense_weight_, {C, C}), grad(fused, dense_bias_, {C}), dpre, dact,
                         param(p, dense_weight_, {C, C}), GradientWrite::overwrite);
      zero<T>(be, dinput);
      detail::transformer::scatter_add_rows<T>(be, dinput, h.act, h.row_ids);
    }
    if (split_.split()) {
      const auto r = split_.rows(s);
      copy<T>(be, split_.local(a.input_grad, s), Tensor<const T>{dinput.data() + r.first * C, Shape{r.local, C}});
    }
  }

  std::int64_t lne_weight_ = 0, lne_bias_ = 0;
  std::int64_t dense_weight_ = 0, dense_bias_ = 0, lnm_weight_ = 0, lnm_bias_ = 0, output_bias_ = 0;
};

}  // namespace loom::bert
