#pragma once
//! \file What GPT-2 and BERT share below the layer level: carving a layer's activations out of
//! its flat range, tensors over parameter views, the batch checks, and the layout ranges a layer
//! reads.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/comm/ref.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/core/tensor.hpp"
#include "loom/models/concepts.hpp"
#include "loom/nn/tensor_parallel.hpp"

namespace loom::detail::transformer {

//! Carves consecutive tensors out of one flat range of T; without a range (`base` null) it only
//! counts. A tensor of another element type U (float statistics in a bf16 range) starts at an
//! offset rounded up to U's alignment and takes sizeof(U) / sizeof(T) elements a value;
//! `elements()` rounds the total up to the largest such alignment, so that ranges laid end to end
//! in one aligned buffer stay aligned. For U = T it is plain consecutive carving.
template <class T>
struct Carver {
  T* base = nullptr;
  std::int64_t used = 0;   //!< elements of T taken so far, padding included
  std::int64_t align = 1;  //!< the largest alignment taken, in elements of T

  template <class U = T>
  Tensor<U> take(Shape shape) {
    static_assert(sizeof(U) % sizeof(T) == 0 && std::is_trivially_copyable_v<U>,
                  "loom: a carved tensor's elements must be a whole number of T elements");
    constexpr auto u_align = static_cast<std::int64_t>(alignof(U) > sizeof(T) ? alignof(U) / sizeof(T) : 1);
    align = std::max(align, u_align);
    used = (used + u_align - 1) / u_align * u_align;
    U* at = nullptr;
    if (base != nullptr) {
      at = reinterpret_cast<U*>(base + used);
      LOOM_CHECK(reinterpret_cast<std::uintptr_t>(at) % alignof(U) == 0, "model: activation range address",
                 reinterpret_cast<std::uintptr_t>(base),
                 "must be aligned to " + detail::to_text(alignof(U)) +
                     " bytes (ranges of activation_elements laid end to end from an aligned buffer are)");
    }
    used += shape.numel() * static_cast<std::int64_t>(sizeof(U) / sizeof(T));
    return {at, shape};
  }
  std::int64_t elements() const noexcept { return (used + align - 1) / align * align; }
};

//! The parameter at flat `offset` of `params` as a tensor of `shape`.
template <class T>
Tensor<const T> param(ParameterView<const T> params, std::int64_t offset, Shape shape) {
  return {params.at(offset, shape.numel()), shape};
}
//! The gradient at flat `offset` of `grads` as a tensor of `shape`.
template <class T>
Tensor<T> grad(ParameterView<T> grads, std::int64_t offset, Shape shape) {
  return {grads.at(offset, shape.numel()), shape};
}

//! The micro-batch shape of [batch, seq] `tokens`, seq in [1, max_seq_len]; `model` names the
//! model in the error ("gpt2", "bert").
inline MicroBatchShape micro_batch_shape(Tensor<const std::int32_t> tokens, std::int64_t max_seq_len,
                                         std::string_view model) {
  const std::string what(model);
  LOOM_CHECK(tokens.shape().rank() == 2, what + " forward: tokens rank", tokens.shape(),
             "tokens must be [batch, seq]");
  const MicroBatchShape s{tokens.extent(0), tokens.extent(1)};
  LOOM_CHECK(s.seq >= 1 && s.seq <= max_seq_len, what + " forward: sequence length", s.seq,
             "must be in [1, max_seq_len = " + detail::to_text(max_seq_len) + "]");
  return s;
}

//! Tokens must be real vocabulary entries (padded rows exist only for the logits).
inline void check_tokens(Tensor<const std::int32_t> tokens, std::int64_t vocab_size, std::string_view model) {
  for (std::int64_t i = 0; i < tokens.numel(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab_size) [[unlikely]]
      throw Error(std::string(model) + " forward: token at position " + detail::to_text(i), tokens[i],
                  "tokens must be in [0, vocab_size = " + detail::to_text(vocab_size) + ")");
}

//! The host-side batch check of a language model: tokens as check_tokens, targets of the same
//! shape below vocab_size (a negative target is ignored).
inline void check_batch(Tensor<const std::int32_t> tokens, Tensor<const std::int32_t> targets,
                        std::int64_t vocab_size, std::string_view model) {
  check_tokens(tokens, vocab_size, model);
  const std::string what(model);
  LOOM_CHECK(targets.shape() == tokens.shape(), what + " batch: targets shape", targets.shape(),
             "must equal the tokens' shape " + detail::to_text(tokens.shape()));
  for (std::int64_t i = 0; i < targets.numel(); ++i)
    if (targets[i] >= vocab_size) [[unlikely]]
      throw Error(what + " batch: target at position " + detail::to_text(i), targets[i],
                  "targets must be < vocab_size = " + detail::to_text(vocab_size) +
                      " (negative targets are ignored)");
}

//! The layout ranges `layer` reads: its own parameters (consecutive in the layout), then the
//! parameter named `tied` where that is not empty (an embedding another layer owns).
inline std::vector<ElementRange> layer_ranges(const ParameterLayout& layout, int layer, std::string_view tied = {}) {
  std::vector<ElementRange> ranges;
  std::int64_t begin = -1, end = -1;
  for (const auto& e : layout.entries())
    if (e.spec.layer == layer) {
      if (begin < 0) begin = e.offset;
      end = e.offset + e.numel();
    }
  if (begin >= 0) ranges.push_back({begin, end});
  if (!tied.empty()) {
    const auto& entry = layout.find(std::string(tied));
    ranges.push_back({entry.offset, entry.offset + entry.numel()});
  }
  return ranges;
}

//! Dropout sites of a layer (DropoutMask's `site`).
enum DropoutSite : int {
  hidden_site = 0,     //!< the embedding's output, or a block's attention branch
  mlp_site = 1,        //!< a block's MLP branch
  attention_site = 2,  //!< a block's attention probabilities
};

//! Whether a pass with `key` drops anything at `rate`.
inline bool dropping(const DropoutKey& key, double rate) noexcept { return key.active() && rate > 0.0; }

//! Dropout on a replicated hidden state `x` [B, T, C] of `layer` at `site`: its elements are the
//! global tensor's from key.first_sequence · T · C on (every tensor-parallel rank draws the same
//! mask for its copy). The forward applies it to the branch, the backward to the branch's
//! gradient. Nothing happens unless dropping(key, rate).
template <class T, Backend B>
void hidden_dropout(B& be, Tensor<T> x, const DropoutKey& key, int layer, DropoutSite site, double rate) {
  if (!dropping(key, rate)) return;
  const std::int64_t per_sequence = x.numel() / x.extent(0);
  dropout<T>(be, x, DropoutMask(key, layer, site, rate), key.first_sequence * per_sequence);
}

//! The output gradient `a.output_grad` of `layer`'s hidden dropout `site`, through the mask:
//! copied into `scratch` (as large) and dropped there when the pass drops anything at `rate`,
//! else a.output_grad itself.
template <class T, Backend B>
Tensor<const T> through_hidden_dropout(B& be, const BackwardArgs<T>& a, int layer, DropoutSite site, double rate,
                                       Tensor<T> scratch) {
  if (!dropping(a.dropout, rate)) return a.output_grad;
  check_numel(scratch, a.output_grad.numel(), "model backward", "dropout scratch");
  const Tensor<T> dropped{scratch.data(), a.output_grad.shape()};
  copy<T>(be, dropped, a.output_grad);
  hidden_dropout<T>(be, dropped, a.dropout, layer, site, rate);
  return dropped;
}

//! The attention-probability dropout of `layer` for a pass with `key` (inactive unless
//! dropping(key, rate)): over the global [sequences, heads, T, T], this rank holding `local_heads`
//! heads from tensor_parallel_rank · local_heads.
inline AttentionDropout attention_dropout(const DropoutKey& key, int layer, double rate, std::int64_t heads,
                                          std::int64_t local_heads, std::int64_t tensor_parallel_rank) {
  if (!dropping(key, rate)) return {};
  return {.mask = DropoutMask(key, layer, attention_site, rate),
          .first_sequence = key.first_sequence,
          .heads = heads,
          .first_head = tensor_parallel_rank * local_heads};
}

//! Refuses an attention dropout rate on a backend whose attention kernels cannot apply it
//! (supports_attention_dropout); `model` names the model. (Config::validate has checked the
//! rates themselves.)
template <Backend B>
void check_attention_dropout(double attention, std::string_view model) {
  LOOM_CHECK(attention == 0.0 || supports_attention_dropout<B>, std::string(model) + " config: attention_dropout",
             attention,
             "this backend's attention kernels do not apply dropout to the probabilities yet; use "
             "attention_dropout = 0 on it (hidden_dropout works on every backend)");
}

//! The cross-entropy of this rank's slice of the logits, [N, vocab rows] in `probs` (vocabulary
//! rows [vocab_begin, ...) of a group `tensor_parallel`), against `targets` [N] (< 0: ignored):
//! turns `probs` into this slice's probabilities in place, writes the per-token `losses` [N], and
//! returns their sum. Only per-row statistics cross the group (max, sum of exps, target logit),
//! in double, in backend memory: the full logits never exist.
template <class T, Backend B>
double vocab_parallel_loss(B& be, CommunicatorRef& tensor_parallel, Tensor<accumulate_t<T>> losses, Tensor<T> probs,
                           Tensor<const std::int32_t> targets, std::int64_t vocab_begin, std::int64_t vocab_size) {
  const std::int64_t N = targets.numel();
  const Buffer<double, B> scratch(be, 3 * N, MemoryCategory::workspace);  // 24 bytes a token
  double* statistics = scratch.data();
  Tensor<double> row_max(statistics, {N}), partials(statistics + N, {2, N});
  vocab_parallel_cross_entropy_max<T>(be, row_max, probs, vocab_begin, vocab_size);
  if (tensor_parallel.size() > 1)
    tensor_parallel.all_reduce(std::span<double>(statistics, static_cast<std::size_t>(N)), ReduceOp::max);
  vocab_parallel_cross_entropy_partials<T>(be, probs, partials, probs, row_max, targets, vocab_begin, vocab_size);
  nn::sum_over_tensor_parallel(tensor_parallel, partials);
  vocab_parallel_cross_entropy_finish<T>(be, losses, probs, partials, targets);
  return sum_elements<accumulate_t<T>>(be, Tensor<const accumulate_t<T>>(losses));
}

}  // namespace loom::detail::transformer
