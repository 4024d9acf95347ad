#pragma once
//! \file GPT-2 (pre-LayerNorm, tied input/output embeddings) as a loom Model: layer 0 embeds,
//! layers 1..L are transformer blocks, layer L+1 is the head (final norm, unembedding through
//! wte, cross-entropy). Forward and backward are written out per layer, as in llm.c; the
//! backward also splits into an input-gradient and a weight-gradient pass (SplitBackwardModel,
//! for zero-bubble pipeline schedules).
//! Under tensor parallelism (Megatron's split, docs/tensor_parallel.md) each rank holds its
//! slice of the weights and computes its slice of the work; the collectives that join the
//! slices happen inside forward and backward, over the model's tensor-parallel group. With
//! Config::sequence_parallel the hidden state between the layers is split by rows over the group
//! too (Megatron's sequence parallelism): all-gathers and reduce-scatters replace the all-reduces.
//! A batch of padded sequences (ForwardArgs::lengths) masks the padding out of attention: query t
//! sees keys s <= t below its sequence's length.

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <type_traits>
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
#include "loom/models/concepts.hpp"
#include "loom/models/detail/transformer.hpp"
#include "loom/models/detail/transformer_slice.hpp"
#include "loom/models/gpt2/config.hpp"
#include "loom/nn/tensor_parallel.hpp"

namespace loom::gpt2 {

//! What a block keeps of its attention for the backward (loom::AttentionStorage).
using Attention = AttentionStorage;
using loom::name;

//! One of several sequences that Model::decode runs at once (DecodeArgs::sequences): where its
//! new positions start, and a block's cache of its earlier ones.
template <class T>
struct DecodeSequence {
  std::int64_t past = 0;  //!< positions before the new ones (their keys and values are cached)
  Tensor<T> keys{}, values{};  //!< a block's cache, [max_seq_len, C] each, as DecodeArgs::keys and values
};

//! What Model::decode reads and writes: `rows` new positions [past, past + rows) of one
//! sequence, run through one layer with the keys and values of the earlier positions kept; or
//! the new positions of several sequences at once (`sequences`).
template <class T>
struct DecodeArgs {
  std::int64_t past = 0;               //!< positions before the new ones (their keys and values are cached)
  Tensor<const std::int32_t> tokens{};  //!< [rows] the new positions' tokens: the embedding's input
  Tensor<const T> input{};              //!< [rows, C] a block's input: the last layer's output
  Tensor<T> output{};                   //!< [rows, C] for the next layer
  //! A block's cache, [max_seq_len, C] each: rows [0, past) hold the earlier positions' keys and
  //! values; the block writes the new positions' into rows [past, past + rows).
  Tensor<T> keys{}, values{};
  //! Several sequences in one call, in place of `past`, `keys` and `values`: the rows split
  //! evenly, sequence s's being rows [s·r, (s+1)·r) of tokens, input and output (r = rows / S),
  //! so that each GEMM reads the weights once for all S. Empty: the one sequence above.
  std::span<const DecodeSequence<T>> sequences{};
};

//! GPT-2 on backend `B` with scalar `T`: float to train, double for gradient checks, bf16 for
//! mixed precision as llm.c trains (bf16 parameters, gradients and activations; arithmetic,
//! per-row statistics and losses in float, `accumulate_t<T>`, kept inside the bf16 ranges).
//! The kernels for `B` must be visible (e.g. include "loom/backend/cpu/kernels.hpp").
template <Backend B, class T = float>
class Model : public detail::transformer::Slice<Config> {
 public:
  using loom_model = void;
  using backend_type = B;
  using scalar_type = T;
  //! Every layer's backward writes its input gradient (loom::writes_input_grad).
  static constexpr bool writes_input_grad = true;

  //! The whole model on one rank (a tensor-parallel group of one).
  explicit Model(Config config, Attention attention = Attention::stored)
      : Model(config, CommunicatorRef{}, attention) {}

  //! This rank's slice of the model, split over `tensor_parallel` (which must outlive the
  //! model; every rank of it constructs its Model with the same config): attention by heads,
  //! the MLP column-then-row, the vocabulary by rows of wte. layout() is this rank's local
  //! layout. `attention` chooses what the blocks keep for their attention's backward. Throws
  //! loom::Error, before any work, when `config` does not split over the group
  //! (Config::validate_tensor_parallel), or asks for attention dropout on a backend whose
  //! attention kernels cannot apply it (supports_attention_dropout).
  Model(Config config, CommunicatorRef tensor_parallel, Attention attention = Attention::stored)
      : Slice(config, tensor_parallel, attention, "gpt2"),
        lnf_weight_(offset("ln_f.weight")),
        lnf_bias_(offset("ln_f.bias")) {
    detail::transformer::check_attention_dropout<B>(config_.attention_dropout, "gpt2");
  }

  //! Forward FLOPs per token of `layer` at full context on this rank (for pipeline
  //! balancing): a tensor-parallel rank does 1/tp of the matmuls and of the attention.
  double layer_cost(int layer) const noexcept {
    if (layer == embedding_layer) return static_cast<double>(config_.channels);
    if (layer == head_layer(config_))
      return 2.0 * static_cast<double>(vocab_rows_) * static_cast<double>(config_.channels);
    return block_cost();
  }

  //! Training FLOPs per token of the whole model, 6·N + 12·l·h·s (DESIGN.md; N the published
  //! parameter count), whatever the tensor-parallel split.
  double flops_per_token(std::int64_t seq) const noexcept {
    return 6.0 * static_cast<double>(config_.parameter_count()) +
           12.0 * static_cast<double>(config_.num_layers * config_.channels * seq);
  }

  //! Elements of T a layer keeps from forward to backward for one micro-batch, on this rank:
  //! what carve_head / carve_block take (counted by carving no range). For float and double,
  //! N·(C + 3 + V/tp), 3 doubles a row and one more for the head (N·(C + 3) and the doubles a row
  //! with Config::logits_chunk_rows) and, for a block, N·(3·C + 12·C/tp + 4) + B·(H/tp)·T² (its
  //! replicated ln1, res2, ln2, this rank's qkv, atty, fch, fch_gelu, its heads' attention
  //! probabilities and four row statistics), or + B·(H/tp)·T (the rows' log-sum-exp) in place
  //! of the probabilities with Attention::recompute. Under sequence parallelism the layernorms'
  //! inputs and outputs and their statistics (ln1, res2, ln2; ln_f's statistics) are this rank's
  //! N/tp rows: 3·C/tp in place of 3·C a token in a block. For bf16 each float statistic takes two
  //! elements and the count is rounded up to even, so that ranges laid end to end keep their
  //! statistics 4-byte aligned (the Trainer starts each range 16-byte aligned, for the doubles).
  std::int64_t activation_elements(int layer, MicroBatchShape s) const noexcept {
    if (layer == embedding_layer) return 0;
    Carver counter{};
    if (layer == head_layer(config_)) head_saved(counter, s);
    else block_saved(counter, s);
    return counter.elements();
  }

  //! Scratch a layer's backward needs (not kept between calls), on this rank.
  std::int64_t workspace_elements(int layer, MicroBatchShape s) const noexcept {
    Carver counter{};
    if (layer == embedding_layer) embedding_workspace(counter, s);
    else if (layer == head_layer(config_)) head_workspace(counter, s);
    else block_workspace(counter, s);
    return counter.elements();
  }

  //! Checks a batch on the host before it reaches the kernels (the Trainer calls this before it
  //! copies the batch to a device): tokens [B, T] in [0, vocab_size), targets of the same
  //! shape below vocab_size (a negative target is ignored). Throws loom::Error naming the first
  //! bad position and its value.
  void check_batch(Tensor<const std::int32_t> tokens, Tensor<const std::int32_t> targets) const {
    detail::transformer::check_batch(tokens, targets, config_.vocab_size, "gpt2");
  }

  //! Runs `layer` forward; returns the sum of per-token losses for the head, 0 otherwise.
  double forward(B& be, int layer, ParameterView<const T> params, const ForwardArgs<T>& a) const {
    const MicroBatchShape s = shape_of(a.tokens);
    if (layer == embedding_layer) {
      // The host can read the tokens only where they are in host memory; a device batch was
      // checked before its copy (check_batch, called by the Trainer).
      if constexpr (host_addressable<B>) check_tokens(a.tokens);
      // Vocab-parallel: each rank looks up the tokens of its rows (zero for the others), the
      // first rank adds the positions, and the sum over the group is the embedding (this rank's
      // rows of it under sequence parallelism: the sum is computed whole in scratch first).
      Buffer<T, B> own;
      const Tensor<T> output = split_.local(a.output, s);
      const Tensor<T> sums = split_.split() ? detail::transformer::forward_scratch(
                                                      be, a.workspace, own, {s.batch, s.seq, C()}, "gpt2 embedding")
                                                : output;
      vocab_parallel_embedding_forward<T>(be, sums.reshape({s.batch, s.seq, C()}), a.tokens,
                                          param(params, wte_, {vocab_rows_, C()}), vocab_begin_,
                                          first_rank() ? param(params, wpe_, {config_.max_seq_len, C()})
                                                       : Tensor<const T>{});
      split_.reduce(sums, output);
      split_.drop(be, output, a.dropout, layer, detail::transformer::hidden_site, config_.hidden_dropout, s);
      return 0.0;
    }
    if (layer == head_layer(config_)) return head_forward(be, params, a, s);
    block_forward(be, layer, blocks_[layer - 1], params, a, s);
    return 0.0;
  }

  //! The next-token logits of `hidden`'s rows, the head's input [n, C] (what the last block
  //! outputs): ln_f, then the tied unembedding, into `logits` [n, vocab_rows()], as the head's
  //! forward computes them but without a loss, for any rows (sampling needs the last token's
  //! alone; gpt2/generate.hpp). The whole model only: one rank, no tensor parallelism.
  void head_logits(B& be, ParameterView<const T> params, Tensor<const T> hidden, Tensor<T> logits) const {
    LOOM_CHECK(tensor_parallel_size_ == 1, "gpt2 head_logits: tensor-parallel ranks", tensor_parallel_size_,
               "must be 1: gather the whole model onto one rank first");
    const std::int64_t C = config_.channels;
    LOOM_CHECK(hidden.shape().rank() == 2 && hidden.extent(1) == C, "gpt2 head_logits: hidden", hidden.shape(),
               "must be [rows, " + detail::to_text(C) + "]");
    const std::int64_t n = hidden.extent(0);
    LOOM_CHECK(logits.shape().rank() == 2 && logits.extent(0) == n && logits.extent(1) == vocab_rows_,
               "gpt2 head_logits: logits", logits.shape(),
               "must be [" + detail::to_text(n) + ", " + detail::to_text(vocab_rows_) + "] (the hidden rows x the padded vocabulary)");
    Buffer<T, B> lnf(be, n * C, MemoryCategory::workspace);
    Buffer<A, B> stats(be, 2 * n, MemoryCategory::workspace);
    const Tensor<T> normed{lnf.data(), Shape{n, C}};
    layernorm_forward<T>(be, normed, Tensor<A>{stats.data(), Shape{n}}, Tensor<A>{stats.data() + n, Shape{n}}, hidden,
                         param(params, lnf_weight_, {C}), param(params, lnf_bias_, {C}));
    matmul_forward<T>(be, logits, Tensor<const T>(normed), param(params, wte_, {vocab_rows_, C}), Tensor<const T>{});
  }

  //! Text generation's incremental forward (gpt2/generate.hpp): `layer`, the embedding or a
  //! block (the head's is head_logits), on new positions [a.past, a.past + rows) of one sequence,
  //! whose earlier positions' keys and values each block keeps in a.keys and a.values (it adds the
  //! new ones). A position's output is what forward gives at that position of the whole sequence,
  //! up to rounding, without the earlier positions' work: attention_decode in place of the
  //! attention over the whole context. No dropout, no padding; the whole model only (one rank,
  //! no tensor parallelism), on a backend the host can address.
  void decode(B& be, int layer, ParameterView<const T> params, const DecodeArgs<T>& a) const
    requires host_addressable<B>
  {
    LOOM_CHECK(tensor_parallel_size_ == 1, "gpt2 decode: tensor-parallel ranks", tensor_parallel_size_,
               "must be 1: gather the whole model onto one rank first");
    LOOM_CHECK(layer >= embedding_layer && layer < head_layer(config_), "gpt2 decode: layer", layer,
               "must be the embedding (0) or a block (1.." + detail::to_text(config_.num_layers) +
                   "); the head's logits come from head_logits");
    const std::int64_t C = config_.channels;
    if (layer != embedding_layer)
      LOOM_CHECK(a.input.shape().rank() == 2, "gpt2 decode: input", a.input.shape(), "must be [rows, C]");
    const std::int64_t n = layer == embedding_layer ? a.tokens.numel() : a.input.extent(0);
    const DecodeSequence<T> one{.past = a.past, .keys = a.keys, .values = a.values};
    const std::span<const DecodeSequence<T>> sequences = a.sequences.empty() ? std::span(&one, 1) : a.sequences;
    const auto S = static_cast<std::int64_t>(sequences.size());
    LOOM_CHECK(n % S == 0, "gpt2 decode: rows", n,
               "must split evenly over the " + detail::to_text(S) + " sequences (the same new positions each)");
    const std::int64_t r = n / S;
    for (std::int64_t s = 0; s < S; ++s) {
      const std::int64_t past = sequences[static_cast<std::size_t>(s)].past;
      LOOM_CHECK(past >= 0 && past + r <= config_.max_seq_len,
                 S == 1 ? std::string("gpt2 decode: past") : "gpt2 decode: past of sequence " + detail::to_text(s), past,
                 "must be >= 0 and leave room for the " + detail::to_text(r) + " new positions in max_seq_len = " +
                     detail::to_text(config_.max_seq_len));
    }
    check_shape(a.output, Shape{n, C}, "gpt2 decode", "output");
    if (layer == embedding_layer) {
      check_tokens(Tensor<const std::int32_t>{a.tokens.data(), Shape{1, n}});
      for (std::int64_t s = 0; s < S; ++s) {
        // Row t's position is past + t: the position table from row `past` on.
        const std::int64_t past = sequences[static_cast<std::size_t>(s)].past;
        vocab_parallel_embedding_forward<T>(
            be, Tensor<T>{a.output.data() + s * r * C, Shape{1, r, C}},
            Tensor<const std::int32_t>{a.tokens.data() + s * r, Shape{1, r}}, param(params, wte_, {vocab_rows_, C}),
            vocab_begin_, param(params, wpe_ + past * C, {config_.max_seq_len - past, C}));
      }
      return;
    }
    check_shape(a.input, Shape{n, C}, "gpt2 decode", "input");
    for (const DecodeSequence<T>& sequence : sequences) {
      check_shape(sequence.keys, Shape{config_.max_seq_len, C}, "gpt2 decode", "keys");
      check_shape(sequence.values, Shape{config_.max_seq_len, C}, "gpt2 decode", "values");
    }
    block_decode(be, blocks_[static_cast<std::size_t>(layer - 1)], params, a.input, a.output, sequences, n);
  }

  //! Runs `layer` backward: parameter gradients into `grads` (+=), input gradient (+=).
  void backward(B& be, int layer, ParameterView<const T> params, ParameterView<T> grads,
                const BackwardArgs<T>& a) const {
    const MicroBatchShape s = shape_of(a.tokens);
    if (layer == embedding_layer) {
      // The output gradient is whole on every rank (gathered under sequence parallelism): each
      // accumulates its own wte rows, and every rank the whole (replicated) wpe gradient.
      const EmbeddingWorkspace w = carve_embedding_workspace(a.workspace, s);
      const Tensor<const T> dropped =
          through_hidden_dropout(be, layer, a, detail::transformer::hidden_site, w.dropped, s);
      const Tensor<const T> dout = split_.gather(dropped, w.gathered);
      with_fused_grads(grads, a, [&](auto fused) {
        vocab_parallel_embedding_backward<T>(be, grad(fused, wte_, {vocab_rows_, C()}), vocab_begin_,
                                             grad(fused, wpe_, {config_.max_seq_len, C()}),
                                             dout.reshape({s.batch, s.seq, C()}), a.tokens);
      });
      return;
    }
    if (layer == head_layer(config_))
      return with_fused_grads(grads, a, [&](auto fused) { head_backward(be, params, fused, a, s, true); });
    block_backward(be, layer, blocks_[layer - 1], params, grads, a, s);
  }

  //! Elements `layer` keeps per micro-batch from backward_input to backward_weight
  //! (SplitBackwardModel), on this rank: 0 for the embedding (no weight pass) and the head (its
  //! weight pass reads dlogits and lnf from `saved`); N·(2·C + 7·C/tp) for a block, N = B·T: the
  //! output gradients of its four linear layers, which their weight GEMMs read: the block's
  //! output gradient (mlp.proj) and dres2 (attn.proj), both whole, and this rank's dfch (mlp.fc,
  //! 4·C/tp) and dqkv (attn.qkv, 3·C/tp). Under sequence parallelism also ln1 and ln2 gathered
  //! whole (2·N·C), which the weight GEMMs read and the weight pass may not gather.
  std::int64_t stash_elements(int layer, MicroBatchShape s) const noexcept {
    if (layer == embedding_layer || layer == head_layer(config_)) return 0;
    Carver counter{};
    block_stash(counter, s);
    return counter.elements();
  }

  //! The input-gradient pass of `layer`'s backward (SplitBackwardModel): the input gradient
  //! (+=), the layernorm gradients and every tensor-parallel collective, with the linear layers'
  //! weight GEMMs left to backward_weight; fills `stash` (stash_elements(layer, shape); may be
  //! empty when that is 0). The embedding has no input gradient: its whole backward runs here.
  void backward_input(B& be, int layer, ParameterView<const T> params, ParameterView<T> grads,
                      const BackwardArgs<T>& a, Tensor<T> stash) const {
    const MicroBatchShape s = shape_of(a.tokens);
    check_stash(stash, stash_elements(layer, s), "gpt2 backward_input");
    if (layer == embedding_layer) return backward(be, layer, params, grads, a);
    // The head's input pass is its backward without the tied-embedding gradient (dwte), unless
    // it recomputes its logits: then dwte too, from the chunks it computes anyway.
    if (layer == head_layer(config_))
      return with_fused_grads(grads, a, [&](auto fused) { head_backward(be, params, fused, a, s, chunked_logits()); });
    block_backward_input(be, layer, blocks_[layer - 1], params, grads, a, s, stash);
  }

  //! The weight-gradient pass of `layer`'s backward, after its backward_input (other
  //! micro-batches' work may run in between): the weight and bias gradients (+=) of the linear
  //! layers from `saved` and `stash` as backward_input left them. Reads neither
  //! `a.output_grad`, `a.input_grad` nor `a.workspace` (they may be empty), and communicates
  //! nothing.
  void backward_weight(B& be, int layer, ParameterView<const T> params, ParameterView<T> grads,
                       const BackwardArgs<T>& a, Tensor<T> stash) const {
    const MicroBatchShape s = shape_of(a.tokens);
    check_stash(stash, stash_elements(layer, s), "gpt2 backward_weight");
    if (layer == embedding_layer) return;
    if (layer == head_layer(config_)) {
      if (chunked_logits()) return;  // backward_input did it
      // dwte += dlogits^T · lnf: the dlogits backward_input left in place of the logits.
      const std::int64_t C = config_.channels;
      const HeadSaved h = carve_head(a.saved, s);
      with_fused_grads(grads, a, [&](auto fused) {
        const auto dwte = grad(fused, wte_, {vocab_rows_, C});
        matmul_backward<T>(be, Tensor<T>{}, dwte, decltype(dwte){}, h.logits, h.lnf, param(params, wte_, {vocab_rows_, C}));
      });
      return;
    }
    block_backward_weight(be, blocks_[layer - 1], params, grads, a, s, stash);
  }

 private:
  using BlockOffsets = detail::transformer::BlockOffsets;

  //! The type of per-row statistics and losses (float for bf16).
  using A = accumulate_t<T>;
  using Carver = detail::transformer::Carver<T>;

  //! The activations a block keeps; the layernorm statistics and the attention's log-sum-exp in
  //! the accumulate type. Of `att` (Attention::stored) and `lse` (recompute) one is empty.
  struct BlockSaved {
    Tensor<A> ln1_mean, ln1_rstd, ln2_mean, ln2_rstd, lse;
    Tensor<T> ln1, qkv, att, atty, res2, ln2, fch, fch_gelu;
  };
  //! The statistics come first: at the (aligned) start of the range they need no padding.
  //! ln1, res2, ln2 and their statistics are this rank's rows (all of them without sequence
  //! parallelism).
  BlockSaved block_saved(Carver& c, MicroBatchShape s) const {
    const std::int64_t Bn = s.batch, Tn = s.seq, C = config_.channels, Ca = attention_channels_,
                       F = mlp_channels_, n = split_.rows(s).local;
    BlockSaved b;
    b.ln1_mean = c.template take<A>({n});
    b.ln1_rstd = c.template take<A>({n});
    b.ln2_mean = c.template take<A>({n});
    b.ln2_rstd = c.template take<A>({n});
    if (attention_ == Attention::recompute) b.lse = c.template take<A>({Bn, heads_, Tn});
    b.ln1 = c.take({n, C});
    b.qkv = c.take({Bn, Tn, 3 * Ca});
    if (attention_ == Attention::stored) b.att = c.take({Bn, heads_, Tn, Tn});
    b.atty = c.take({Bn, Tn, Ca});
    b.res2 = c.take({n, C});
    b.ln2 = c.take({n, C});
    b.fch = c.take({Bn, Tn, F});
    b.fch_gelu = c.take({Bn, Tn, F});
    return b;
  }
  BlockSaved carve_block(Tensor<T> saved, MicroBatchShape s) const {
    check_numel(saved, activation_elements(block_layer(0), s), "gpt2 block", "saved");
    Carver c{saved.data()};
    return block_saved(c, s);
  }

  //! This rank's rows of a.output_grad through `layer`'s hidden dropout `site` (in `scratch` when
  //! this pass drops).
  Tensor<const T> through_hidden_dropout(B& be, int layer, const BackwardArgs<T>& a,
                                         detail::transformer::DropoutSite site, Tensor<T> scratch,
                                         MicroBatchShape s) const {
    return split_.through_drop(be, a, layer, site, config_.hidden_dropout, scratch, s);
  }

  //! The embedding's backward scratch: its output gradient gathered whole (sequence parallelism;
  //! the forward sums its partial embeddings there) and through the dropout mask (hidden dropout).
  struct EmbeddingWorkspace {
    Tensor<T> gathered, dropped;
  };
  EmbeddingWorkspace embedding_workspace(Carver& c, MicroBatchShape s) const {
    const auto r = split_.rows(s);
    EmbeddingWorkspace w;
    if (split_.split()) w.gathered = c.take({r.total, C()});
    if (config_.hidden_dropout > 0) w.dropped = c.take({r.local, C()});
    return w;
  }
  EmbeddingWorkspace carve_embedding_workspace(Tensor<T> workspace, MicroBatchShape s) const {
    check_numel(workspace, workspace_elements(embedding_layer, s), "gpt2 embedding backward", "workspace");
    Carver c{workspace.data()};
    return embedding_workspace(c, s);
  }

  //! The keys a block's queries see: the causal mask, less each sequence's padding.
  template <class Args>
  static AttentionKeys attention_keys(const Args& a) noexcept {
    return {AttentionMask::causal, a.lengths};
  }

  void block_forward(B& be, int layer, const BlockOffsets& o, ParameterView<const T> p, const ForwardArgs<T>& a,
                     MicroBatchShape s) const {
    namespace tr = detail::transformer;
    const std::int64_t C = config_.channels, Ca = attention_channels_, F = mlp_channels_;
    BlockSaved b = carve_block(a.saved, s);
    const Tensor<const T> input = split_.local(a.input, s);
    const Tensor<T> output = split_.local(a.output, s);
    // Under sequence parallelism the layernorms see this rank's rows only: their outputs are
    // gathered whole into `whole` before the column-parallel layers, and the row-parallel layers'
    // partial sums are computed there and reduce-scattered back to this rank's rows.
    Buffer<T, B> own;
    const Tensor<T> whole = split_.split()
                                ? tr::forward_scratch(be, a.workspace, own, {split_.rows(s).total, C}, "gpt2 block")
                                : Tensor<T>{};
    layernorm_forward<T>(be, b.ln1, b.ln1_mean, b.ln1_rstd, input, param(p, o.ln1_w, {C}), param(p, o.ln1_b, {C}));
    // Column-parallel qkv (f: ln1 goes in whole, replicated or gathered): this rank's heads' q, k, v.
    matmul_forward<T>(be, b.qkv, split_.gather(b.ln1, whole), param(p, o.qkv_w, {3 * Ca, C}),
                      param(p, o.qkv_b, {3 * Ca}));
    const AttentionDropout drop = attention_dropout(a.dropout, layer);
    block_attention_forward<T>(be, b, attention_keys(a), drop);
    // Row-parallel projection (g: sum the partial sums over the group), then the residual. The
    // replicated bias rides on the first rank's partial sum, so the sum adds it once at no extra
    // pass. Dropout acts on the whole branch: each rank drops its rows of the one mask.
    split_.project_add(be, b.res2, whole, b.atty, param(p, o.proj_w, {C, Ca}), row_bias(p, o.proj_b), input,
                       a.dropout, layer, tr::hidden_site, config_.hidden_dropout, s);
    layernorm_forward<T>(be, b.ln2, b.ln2_mean, b.ln2_rstd, b.res2, param(p, o.ln2_w, {C}), param(p, o.ln2_b, {C}));
    // MLP: column-parallel fc, then row-parallel proj.
    matmul_gelu_forward<T>(be, b.fch_gelu, b.fch, split_.gather(b.ln2, whole), param(p, o.fc_w, {F, C}),
                           param(p, o.fc_b, {F}), config_.gelu);
    split_.project_add(be, output, whole, b.fch_gelu, param(p, o.fcproj_w, {C, F}), row_bias(p, o.fcproj_b),
                       b.res2, a.dropout, layer, tr::mlp_site, config_.hidden_dropout, s);
  }

  //! block_forward's arithmetic on `n` new rows of one or more sequences (Model::decode), with
  //! each sequence's attention against its cache; the scratch lives for the call only.
  void block_decode(B& be, const BlockOffsets& o, ParameterView<const T> p, Tensor<const T> input, Tensor<T> output,
                    std::span<const DecodeSequence<T>> sequences, std::int64_t n) const {
    const std::int64_t C = config_.channels, F = mlp_channels_;
    Buffer<T, B> scratch(be, n * (5 * C + 2 * F), MemoryCategory::workspace);
    Buffer<A, B> stats(be, 2 * n, MemoryCategory::workspace);
    T* at = scratch.data();
    const auto take = [&at](std::int64_t columns, std::int64_t rows) {
      const Tensor<T> t{at, Shape{rows, columns}};
      at += rows * columns;
      return t;
    };
    const Tensor<T> ln1 = take(C, n), qkv = take(3 * C, n), res2 = take(C, n), fch = take(F, n), fch_gelu = take(F, n);
    const Tensor<T> atty = ln1, ln2{qkv.data(), Shape{n, C}};  // ln1 and qkv are dead by then
    const Tensor<A> mean{stats.data(), Shape{n}}, rstd{stats.data() + n, Shape{n}};
    layernorm_forward<T>(be, ln1, mean, rstd, input, param(p, o.ln1_w, {C}), param(p, o.ln1_b, {C}));
    matmul_forward<T>(be, qkv, Tensor<const T>(ln1), param(p, o.qkv_w, {3 * C, C}), param(p, o.qkv_b, {3 * C}));
    const std::int64_t r = n / static_cast<std::int64_t>(sequences.size());
    for (std::size_t s = 0; s < sequences.size(); ++s) {
      const auto first = static_cast<std::int64_t>(s) * r;
      attention_decode<T>(be, Tensor<T>{atty.data() + first * C, Shape{r, C}},
                          Tensor<const T>{qkv.data() + first * 3 * C, Shape{r, 3 * C}}, sequences[s].keys,
                          sequences[s].values, sequences[s].past, static_cast<int>(heads_));
    }
    matmul_forward<T>(be, res2, Tensor<const T>(atty), param(p, o.proj_w, {C, C}), param(p, o.proj_b, {C}), input);
    layernorm_forward<T>(be, ln2, mean, rstd, Tensor<const T>(res2), param(p, o.ln2_w, {C}), param(p, o.ln2_b, {C}));
    matmul_gelu_forward<T>(be, fch_gelu, fch, Tensor<const T>(ln2), param(p, o.fc_w, {F, C}), param(p, o.fc_b, {F}),
                           config_.gelu);
    matmul_forward<T>(be, output, Tensor<const T>(fch_gelu), param(p, o.fcproj_w, {C, F}), param(p, o.fcproj_b, {C}),
                      Tensor<const T>(res2));
  }

  //! A block's backward scratch, carved from its workspace: the gradients w.r.t. res2, the
  //! MLP's hidden units before GELU, ln2, the attention output, qkv and ln1, and (with hidden
  //! dropout) room for the MLP branch's output gradient through the mask. (The gradient w.r.t.
  //! the GELU's output never exists: gelu_matmul_backward goes straight to fch's.) `mlp_out` is
  //! the MLP branch's output gradient the chain reads.
  //!
  //! Under sequence parallelism res2, ln2, ln1 and dropped are this rank's rows, and three more
  //! pieces exist: `gathered` [N, C] for what the linear layers need whole (an output gradient
  //! gathered, a layernorm's output gathered again), `partial` [N, C] for the column-parallel
  //! layers' partial input gradients before their reduce-scatter, and `norm_grads` [4·C] for the
  //! layernorms' partial weight and bias gradients (ln2 then ln1) before their sum over the group.
  //! The `*_whole` tensors say where the chain gathers each of the four (all `gathered`, or the
  //! stash under backward_input, which the weight pass reads).
  struct BlockGrads {
    Tensor<T> res2, fch, ln2, atty, qkv, ln1, dropped, gathered, partial;
    Tensor<A> norm_grads;  // wide enough for fp32 sums (RowSplit::norm_scratch)
    Tensor<T> mlp_whole, ln2_whole, res2_whole, ln1_whole;
    Tensor<const T> mlp_out;
  };
  BlockGrads block_workspace(Carver& w, MicroBatchShape s) const {
    const std::int64_t Bn = s.batch, Tn = s.seq, C = config_.channels, Ca = attention_channels_,
                       F = mlp_channels_;
    const auto r = split_.rows(s);
    BlockGrads d;
    d.res2 = w.take({r.local, C});
    d.fch = w.take({Bn, Tn, F});
    d.ln2 = w.take({r.local, C});
    d.atty = w.take({Bn, Tn, Ca});
    d.qkv = w.take({Bn, Tn, 3 * Ca});
    d.ln1 = w.take({r.local, C});
    if (config_.hidden_dropout > 0) d.dropped = w.take({r.local, C});
    if (split_.split()) {
      d.gathered = w.take({r.total, C});
      d.partial = w.take({r.total, C});
      d.norm_grads = w.template take<A>({4 * C});
      d.mlp_whole = d.ln2_whole = d.res2_whole = d.ln1_whole = d.gathered;
    }
    return d;
  }
  BlockGrads carve_block_workspace(Tensor<T> workspace, MicroBatchShape s, const char* kernel) const {
    check_numel(workspace, workspace_elements(1, s), kernel, "workspace");
    Carver w{workspace.data()};
    return block_workspace(w, s);
  }

  //! What a block's backward_input keeps for its backward_weight: the gradients w.r.t. the
  //! outputs of its four linear layers (mlp.proj: the block output, attn.proj: res2, mlp.fc:
  //! fch, attn.qkv: qkv), carved from its stash.
  //! Under sequence parallelism output and res2 are gathered whole, and ln2 and ln1 (the fc's and
  //! qkv's inputs, gathered whole) are kept too.
  struct BlockStash {
    Tensor<T> output, res2, fch, qkv, ln2, ln1;
  };
  BlockStash block_stash(Carver& c, MicroBatchShape s) const {
    const std::int64_t Bn = s.batch, Tn = s.seq, C = config_.channels;
    BlockStash st;
    st.output = c.take({Bn * Tn, C});
    st.res2 = c.take({Bn * Tn, C});
    st.fch = c.take({Bn, Tn, mlp_channels_});
    st.qkv = c.take({Bn, Tn, 3 * attention_channels_});
    if (split_.split()) {
      st.ln2 = c.take({Bn * Tn, C});
      st.ln1 = c.take({Bn * Tn, C});
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
    BlockGrads d = carve_block_workspace(a.workspace, s, "gpt2 block backward");
    d.mlp_out = through_hidden_dropout(be, layer, a, detail::transformer::mlp_site, d.dropped, s);
    with_fused_grads(g, a, [&](auto fused) { block_backward_chain(be, layer, o, p, fused, a, s, b, d, true); });
  }

  //! The input pass keeps the gradients the weight GEMMs read in the stash instead of the
  //! workspace (the output gradient copied, the others computed there in place), and skips those
  //! GEMMs; block_backward_weight runs them on the same operands.
  void block_backward_input(B& be, int layer, const BlockOffsets& o, ParameterView<const T> p, ParameterView<T> g,
                            const BackwardArgs<T>& a, MicroBatchShape s, Tensor<T> stash) const {
    const BlockSaved b = carve_block(a.saved, s);
    BlockGrads d = carve_block_workspace(a.workspace, s, "gpt2 block backward_input");
    const BlockStash st = carve_block_stash(stash, s);
    d.fch = st.fch;
    d.qkv = st.qkv;
    if (split_.split()) {
      // The chain gathers the four whole operands of the weight GEMMs into the stash.
      d.mlp_out = through_hidden_dropout(be, layer, a, detail::transformer::mlp_site, d.dropped, s);
      d.mlp_whole = st.output;
      d.res2_whole = st.res2;
      d.ln2_whole = st.ln2;
      d.ln1_whole = st.ln1;
    } else {
      // The MLP branch's output gradient (through the dropout mask) and dres2 are what the
      // projections' weight GEMMs read.
      d.res2 = st.res2;
      copy<T>(be, st.output, a.output_grad);
      split_.drop(be, st.output, a.dropout, layer, detail::transformer::mlp_site, config_.hidden_dropout, s);
      d.mlp_out = st.output;
    }
    with_fused_grads(g, a, [&](auto fused) { block_backward_chain(be, layer, o, p, fused, a, s, b, d, false); });
  }

  void block_backward_weight(B& be, const BlockOffsets& o, ParameterView<const T> p, ParameterView<T> g,
                             const BackwardArgs<T>& a, MicroBatchShape s, Tensor<T> stash) const {
    const std::int64_t C = config_.channels, Ca = attention_channels_, F = mlp_channels_;
    const BlockSaved b = carve_block(a.saved, s);
    const BlockStash st = carve_block_stash(stash, s);
    const Tensor<T> no_input_grad{};
    // The layernorms' outputs whole: kept (replicated), or gathered into the stash by the I pass.
    const Tensor<const T> ln2 = split_.split() ? st.ln2 : b.ln2, ln1 = split_.split() ? st.ln1 : b.ln1;
    with_fused_grads(g, a, [&](auto fused) {
      const auto w = block_linear_grads(fused, o);
      matmul_backward<T>(be, no_input_grad, w.fcproj_w, w.fcproj_b, st.output, b.fch_gelu,
                         param(p, o.fcproj_w, {C, F}));
      matmul_backward<T>(be, no_input_grad, w.fc_w, w.fc_b, st.fch, ln2, param(p, o.fc_w, {F, C}));
      matmul_backward<T>(be, no_input_grad, w.proj_w, w.proj_b, st.res2, b.atty, param(p, o.proj_w, {C, Ca}));
      matmul_backward<T>(be, no_input_grad, w.qkv_w, w.qkv_b, st.qkv, ln1, param(p, o.qkv_w, {3 * Ca, C}));
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
    const Tensor<T> input_grad = split_.local(a.input_grad, s);
    const auto w = linear_grads ? block_linear_grads(g, o) : tr::BlockLinearGrads<G>{};
    // The layernorms' weight and bias gradients: straight into `g`, or under sequence parallelism
    // (partial sums over this rank's rows) into d.norm_grads, summed over the group at the end.
    const Tensor<G> norm_grads = split_.template norm_scratch<G>(be, d.norm_grads);
    const auto norm_grad = [&](std::int64_t offset, int piece) {
      return split_.norm_grad(grad(g, offset, {C}), norm_grads, piece);
    };
    // The column-parallel layers' input gradients are partial sums (f backward): summed in place,
    // or under sequence parallelism in d.partial and reduce-scattered into this rank's rows.
    const Tensor<T> dln2 = split_.split() ? d.partial : d.ln2, dln1 = split_.split() ? d.partial : d.ln1;
    constexpr GradientWrite overwrite = GradientWrite::overwrite;
    // output = res2 + dropout(mlp(ln2(res2))): the residual passes the gradient straight
    // through, the MLP branch gets it through the mask (d.mlp_out). g backward: the output
    // gradient whole on every rank (gathered under sequence parallelism), so each rank's
    // (replicated) row-parallel bias gradient is already the whole one.
    gelu_matmul_backward<T>(be, d.fch, w.fcproj_w, w.fcproj_b, split_.gather(d.mlp_out, d.mlp_whole), b.fch_gelu,
                            param(p, o.fcproj_w, {C, F}), b.fch, config_.gelu);
    matmul_backward<T>(be, dln2, w.fc_w, w.fc_b, d.fch, split_.gather(b.ln2, d.ln2_whole), param(p, o.fc_w, {F, C}),
                       overwrite);
    split_.reduce(dln2, d.ln2);
    // dres2 = the output gradient (the residual) + ln2's input gradient, written in one pass.
    layernorm_backward<T, G>(be, d.res2, norm_grad(o.ln2_w, 0), norm_grad(o.ln2_b, 1), d.ln2, b.res2,
                          param(p, o.ln2_w, {C}), b.ln2_mean, b.ln2_rstd, split_.local(a.output_grad, s), overwrite);
    // res2 = input + dropout(attn(ln1(input))): the input gradient gets dres2 (the residual) and
    // ln1's input gradient. The branch gets dres2 through the mask, in place (under backward_input
    // without sequence parallelism d.res2 is the stash attn.proj's weight GEMM reads); where it
    // drops, the residual's share goes to the input gradient first.
    const bool drops = tr::dropping(a.dropout, config_.hidden_dropout);
    if (drops) copy<T>(be, input_grad, d.res2);
    split_.drop(be, d.res2, a.dropout, layer, tr::hidden_site, config_.hidden_dropout, s);
    matmul_backward<T>(be, d.atty, w.proj_w, w.proj_b, split_.gather(d.res2, d.res2_whole), b.atty,
                       param(p, o.proj_w, {C, Ca}), overwrite);
    const AttentionDropout drop = attention_dropout(a.dropout, layer);
    block_attention_backward<T>(be, d.qkv, d.atty, b, attention_keys(a), drop);
    matmul_backward<T>(be, dln1, w.qkv_w, w.qkv_b, d.qkv, split_.gather(b.ln1, d.ln1_whole),
                       param(p, o.qkv_w, {3 * Ca, C}), overwrite);
    split_.reduce(dln1, d.ln1);
    // The input gradient: dres2 + ln1's, written in one pass (or, where the branch dropped, ln1's
    // added to the residual's share copied there above).
    layernorm_backward<T, G>(be, input_grad, norm_grad(o.ln1_w, 2), norm_grad(o.ln1_b, 3), d.ln1, split_.local(a.input, s),
                          param(p, o.ln1_w, {C}), b.ln1_mean, b.ln1_rstd,
                          drops ? Tensor<const T>{} : Tensor<const T>(d.res2),
                          drops ? GradientWrite::accumulate : overwrite);
    split_.sum_norm_grads(be, norm_grads, {grad(g, o.ln2_w, {C}), grad(g, o.ln2_b, {C}), grad(g, o.ln1_w, {C}),
                                           grad(g, o.ln1_b, {C})});
  }

  //! The activations the head keeps; ln_f's statistics and the per-token losses in the
  //! accumulate type, first (see block_saved); then each row's logit statistics in double, and
  //! unless Config::logits_chunk_rows this rank's slice of the logits (from which, with the
  //! statistics, the backward computes the probabilities, unless the forward wrote their gradient
  //! there already) and last, in double, the scale of that gradient (0: not written). ln_f's statistics are this rank's
  //! rows; its output `lnf` is whole (gathered under sequence parallelism), as the unembedding
  //! GEMMs read it.
  struct HeadSaved {
    Tensor<A> mean, rstd, losses;
    detail::transformer::LogitStatistics stats;
    Tensor<T> lnf, logits;
  };
  HeadSaved head_saved(Carver& c, MicroBatchShape s) const {
    const std::int64_t N = s.batch * s.seq, n = split_.rows(s).local;
    HeadSaved h;
    h.mean = c.template take<A>({n});
    h.rstd = c.template take<A>({n});
    h.losses = c.template take<A>({N});
    h.stats.row_max = c.template take<double>({N});
    h.stats.partials = c.template take<double>({2 * N});
    h.lnf = c.take({N, config_.channels});
    if (!chunked_logits()) {
      h.logits = c.take({N, vocab_rows_});
      h.stats.gradient_scale = c.template take<double>({1});
    }
    return h;
  }
  //! Rows of a chunk of the logits for `s`.
  std::int64_t logits_chunk(MicroBatchShape s) const noexcept {
    return std::min(config_.logits_chunk_rows, s.batch * s.seq);
  }
  //! The head's backward scratch: dlnf (whole: partial sums over the group), one chunk's logits
  //! when chunked, and under sequence parallelism ln_f's partial weight and bias
  //! gradients [2·C].
  struct HeadWorkspace {
    Tensor<T> dlnf;
    Tensor<A> norm_grads;  // wide enough for fp32 sums (RowSplit::norm_scratch)
    detail::transformer::LogitScratch<T> chunk;
  };
  HeadWorkspace head_workspace(Carver& c, MicroBatchShape s) const {
    HeadWorkspace w;
    if (chunked_logits()) w.chunk = detail::transformer::carve_logit_scratch(c, logits_chunk(s), vocab_rows_);
    w.dlnf = c.take({s.batch * s.seq, config_.channels});
    if (split_.split()) w.norm_grads = c.template take<A>({2 * config_.channels});
    return w;
  }
  HeadSaved carve_head(Tensor<T> saved, MicroBatchShape s) const {
    check_numel(saved, activation_elements(head_layer(config_), s), "gpt2 head", "saved");
    Carver c{saved.data()};
    return head_saved(c, s);
  }

  double head_forward(B& be, ParameterView<const T> p, const ForwardArgs<T>& a, MicroBatchShape s) const {
    const std::int64_t C = config_.channels, N = s.batch * s.seq;
    HeadSaved h = carve_head(a.saved, s);
    // Under sequence parallelism this rank normalizes its rows into their place in lnf and
    // gathers the others' in place.
    const auto r = split_.rows(s);
    const Tensor<T> lnf_rows{h.lnf.data() + r.first * C, Shape{r.local, C}};
    layernorm_forward<T>(be, lnf_rows, h.mean, h.rstd, split_.local(a.input, s), param(p, lnf_weight_, {C}),
                         param(p, lnf_bias_, {C}));
    if (split_.split()) split_.gather(Tensor<const T>(lnf_rows), h.lnf);
    if (chunked_logits()) {
      Buffer<T, B> own;
      const Tensor<T> logits = detail::transformer::forward_logits_scratch(be, a.workspace, own, logits_chunk(s),
                                                                            vocab_rows_);
      return detail::transformer::chunked_unembedding_loss<T>(
          be, tensor_parallel_, h.losses, h.stats, logits, h.lnf, param(p, wte_, {vocab_rows_, C}),
          Tensor<const T>{}, a.targets.reshape({N}), vocab_begin_, config_.vocab_size, logits_chunk(s));
    }
    // This rank's slice of the logits (a column-parallel use of wte); the vocab-parallel
    // cross-entropy reads it once and exchanges only per-row statistics (max, sum of exps, target
    // logit), from which the backward computes the probabilities: the full logits never exist. On
    // one rank with a backward to come, it writes their gradient over them at once instead.
    matmul_forward<T>(be, h.logits, h.lnf, param(p, wte_, {vocab_rows_, C}), Tensor<const T>{});
    return detail::transformer::vocab_parallel_loss<T>(be, tensor_parallel_, h.losses, h.logits, h.stats,
                                                       a.targets.reshape({N}), vocab_begin_, config_.vocab_size,
                                                       a.loss_scale);
  }

  //! The head's backward, its parameter gradients into `g` (of T, or fp32 sums: G = float); with
  //! `unembedding_grads` false it leaves the tied embedding's (dwte) to backward_weight, which
  //! reads the dlogits left in `saved`.
  template <class G>
  void head_backward(B& be, ParameterView<const T> p, ParameterView<G> g, const BackwardArgs<T>& a,
                     MicroBatchShape s, bool unembedding_grads) const {
    const std::int64_t C = config_.channels, N = s.batch * s.seq;
    const Tensor<G> dwte = unembedding_grads ? grad(g, wte_, {vocab_rows_, C}) : Tensor<G>{};
    HeadSaved h = carve_head(a.saved, s);
    check_numel(a.workspace, workspace_elements(head_layer(config_), s), "gpt2 head backward", "workspace");
    Carver c{a.workspace.data()};
    const HeadWorkspace w = head_workspace(c, s);
    const Tensor<T> dlnf = w.dlnf;  // written, not read, by either path
    if (chunked_logits()) {
      detail::transformer::chunked_unembedding_loss_backward<T>(
          be, dlnf, dwte, Tensor<G>{}, w.chunk, h.stats, h.lnf, param(p, wte_, {vocab_rows_, C}), Tensor<const T>{},
          a.targets.reshape({N}), vocab_begin_, config_.vocab_size, a.loss_scale, logits_chunk(s));
    } else {
      // dlogits overwrite the logits they are computed from (this rank's slice), unless the
      // forward wrote them already.
      detail::transformer::vocab_parallel_loss_backward<T>(be, h.logits, h.stats, a.targets.reshape({N}), vocab_begin_,
                                                           config_.vocab_size, a.loss_scale);
      matmul_backward<T>(be, dlnf, dwte, Tensor<G>{}, h.logits, h.lnf, param(p, wte_, {vocab_rows_, C}),
                         GradientWrite::overwrite);
    }
    // f backward of the column-parallel logits: sum the slices' shares of dlnf (this rank's rows
    // of the sum under sequence parallelism, reduce-scattered in place).
    const auto r = split_.rows(s);
    const Tensor<T> dlnf_rows{dlnf.data() + r.first * C, Shape{r.local, C}};
    split_.reduce(dlnf, dlnf_rows);
    const Tensor<G> dweight = grad(g, lnf_weight_, {C}), dbias = grad(g, lnf_bias_, {C});
    const Tensor<G> norm_grads = split_.template norm_scratch<G>(be, w.norm_grads);
    layernorm_backward<T, G>(be, split_.local(a.input_grad, s), split_.norm_grad(dweight, norm_grads, 0),
                             split_.norm_grad(dbias, norm_grads, 1), dlnf_rows, split_.local(a.input, s),
                             param(p, lnf_weight_, {C}), h.mean, h.rstd, Tensor<const T>{}, GradientWrite::overwrite);
    split_.sum_norm_grads(be, norm_grads, {dweight, dbias});
  }

  std::int64_t lnf_weight_ = 0, lnf_bias_ = 0;
};

}  // namespace loom::gpt2
