#pragma once
//! \file What GPT-2 and BERT share below the layer level: carving a layer's activations out of
//! its flat range, tensors over parameter views, the batch checks, and the layout ranges a layer
//! reads.

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/backend/gradient_write.hpp"
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

  //! A tensor of `shape` with elements of U. An element of U narrower than T (int32 indices in a
  //! double model) shares T's elements: the range takes numel·sizeof(U) bytes rounded up to whole
  //! elements of T.
  template <class U = T>
  Tensor<U> take(Shape shape) {
    static_assert(std::is_trivially_copyable_v<U>, "loom: a carved tensor's elements must be trivially copyable");
    static_assert(sizeof(U) % sizeof(T) == 0 || sizeof(T) % sizeof(U) == 0,
                  "loom: a carved tensor's element must be a multiple or a divisor of T's size");
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
    const auto bytes = shape.numel() * static_cast<std::int64_t>(sizeof(U));
    used += (bytes + static_cast<std::int64_t>(sizeof(T)) - 1) / static_cast<std::int64_t>(sizeof(T));
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

//! Dropout of `layer`'s `site` on a hidden state or its slice: `x` holds the micro-batch's
//! elements [first_element, + x.numel()), each sequence `sequence_elements` long, and draws those
//! elements of the global mask, which starts at key.first_sequence · sequence_elements (every
//! tensor-parallel rank draws the same mask for its copy, and a sequence-parallel rank its rows of
//! it). The forward applies it to the branch, the backward to the branch's gradient. Nothing
//! happens unless dropping(key, rate). Models reach it through RowSplit::drop.
template <class T, Backend B>
void hidden_dropout(B& be, Tensor<T> x, const DropoutKey& key, int layer, DropoutSite site, double rate,
                    std::int64_t sequence_elements, std::int64_t first_element) {
  if (!dropping(key, rate)) return;
  dropout<T>(be, x, DropoutMask(key, layer, site, rate), key.first_sequence * sequence_elements + first_element);
}

//! The output gradient `a.output_grad` of `layer`'s hidden dropout `site` (elements as in
//! hidden_dropout), through the mask: copied into `scratch` (as large) and dropped there when the
//! pass drops anything at `rate`, else a.output_grad itself.
template <class T, Backend B>
Tensor<const T> through_hidden_dropout(B& be, const BackwardArgs<T>& a, int layer, DropoutSite site, double rate,
                                       Tensor<T> scratch, std::int64_t sequence_elements,
                                       std::int64_t first_element) {
  if (!dropping(a.dropout, rate)) return a.output_grad;
  check_numel(scratch, a.output_grad.numel(), "model backward", "dropout scratch");
  const Tensor<T> dropped{scratch.data(), a.output_grad.shape()};
  copy<T>(be, dropped, a.output_grad);
  hidden_dropout<T>(be, dropped, a.dropout, layer, site, rate, sequence_elements, first_element);
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

//! What a head keeps of its logits per row for the backward: the row statistics of
//! vocab_parallel_cross_entropy_statistics over the whole vocabulary, `row_max` [N] and `partials`
//! (2·N values: [2, N], or with Config::logits_chunk_rows chunk after chunk each chunk's [2, k]:
//! the sums of exp(logit - row max) and the targets' logits), in double; and where the head keeps
//! its logits whole, `gradient_scale` [1]: 0 where they are still the logits, else the scale of
//! the gradient the forward wrote over them (vocab_parallel_loss with a backward scale).
struct LogitStatistics {
  Tensor<double> row_max, partials, gradient_scale;
};

//! Where a group of several ranks keeps each rank's own row maxima for `rows` rows while
//! vocab_parallel_softmax_loss runs (8 bytes a row, workspace); nothing for a group of one.
template <Backend B>
Buffer<double, B> slice_max_scratch(B& be, const CommunicatorRef& tensor_parallel, std::int64_t rows) {
  return tensor_parallel.size() > 1 ? Buffer<double, B>(be, rows, MemoryCategory::workspace) : Buffer<double, B>{};
}

//! The vocabulary-parallel softmax cross-entropy of n rows whose slice of the logits (vocabulary
//! rows [vocab_begin, ...) of a group `tensor_parallel`) is `logits` [n, vocab rows], against
//! `targets` [n] (< 0: ignored): writes the per-token `losses` [n], and the rows' statistics over
//! the whole vocabulary to `row_max` [n] and `partials` [2, n] (backend memory). One pass over the
//! logits, which it leaves as they are; only per-row statistics cross the group. A group of
//! several ranks keeps each rank's own maxima in `slice_max` (at least n doubles,
//! slice_max_scratch), to rescale its sums once the group's max is known. The backward takes the
//! probabilities from the logits and these statistics (vocab_parallel_cross_entropy_backward from
//! the logits).
template <class T, Backend B>
void vocab_parallel_softmax_loss(B& be, CommunicatorRef& tensor_parallel, Tensor<accumulate_t<T>> losses,
                                 Tensor<const T> logits, Tensor<double> row_max, Tensor<double> partials,
                                 Tensor<const std::int32_t> targets, std::int64_t vocab_begin, std::int64_t vocab_size,
                                 double* slice_max) {
  if (tensor_parallel.size() == 1) {
    vocab_parallel_cross_entropy_statistics<T>(be, row_max, partials, logits, targets, vocab_begin, vocab_size);
  } else {
    const std::int64_t n = row_max.numel();
    const Tensor<double> own_max(slice_max, {n});
    vocab_parallel_cross_entropy_statistics<T>(be, row_max, partials, logits, targets, vocab_begin, vocab_size,
                                               own_max);
    tensor_parallel.all_reduce(std::span<double>(row_max.data(), static_cast<std::size_t>(n)), ReduceOp::max);
    vocab_parallel_cross_entropy_rebase(be, partials, Tensor<const double>(own_max), Tensor<const double>(row_max));
    nn::sum_over_tensor_parallel(tensor_parallel, partials);
  }
  vocab_parallel_cross_entropy_losses<T>(be, losses, row_max, partials, targets);
}

//! The cross-entropy of this rank's slice of the logits, [N, vocab rows] in `logits`, against
//! `targets` [N]: vocab_parallel_softmax_loss, its statistics (24 bytes a token) in `stats`, which
//! the backward needs. Returns the sum of the losses. The full logits never exist.
//!
//! `backward_scale` is the loss scale of the backward that follows (ForwardArgs::loss_scale), or 0
//! where none does. With a backward to come and a group of one rank, whose slice is the whole
//! vocabulary, the gradient needs no other rank's statistics: cross_entropy_forward_backward
//! writes it over the logits as it computes the loss, from one read of them instead of two (the
//! same bits), and stats.gradient_scale says so to vocab_parallel_loss_backward.
template <class T, Backend B>
double vocab_parallel_loss(B& be, CommunicatorRef& tensor_parallel, Tensor<accumulate_t<T>> losses, Tensor<T> logits,
                           const LogitStatistics& stats, Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                           std::int64_t vocab_size, accumulate_t<T> backward_scale) {
  const std::int64_t N = targets.numel();
  const bool flagged = !stats.gradient_scale.empty();
  if (flagged && backward_scale != accumulate_t<T>(0) && tensor_parallel.size() == 1) {
    cross_entropy_forward_backward<T>(be, losses, stats.row_max.reshape({N}), stats.partials.reshape({2, N}), logits,
                                      targets, vocab_size, backward_scale, stats.gradient_scale);
  } else {
    if (flagged) be.fill_zero(stats.gradient_scale.data(), sizeof(double));
    const Buffer<double, B> slice_max = slice_max_scratch(be, tensor_parallel, N);
    vocab_parallel_softmax_loss<T>(be, tensor_parallel, losses, logits, stats.row_max.reshape({N}),
                                   stats.partials.reshape({2, N}), targets, vocab_begin, vocab_size,
                                   slice_max.data());
  }
  return sum_elements<accumulate_t<T>>(be, Tensor<const accumulate_t<T>>(losses));
}

//! The backward of vocab_parallel_loss: dlogits, scaled by `loss_scale`, into `logits` in place
//! (where the forward wrote them already, left as they are).
template <class T, Backend B>
void vocab_parallel_loss_backward(B& be, Tensor<T> logits, const LogitStatistics& stats,
                                  Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                  std::int64_t vocab_size, accumulate_t<T> loss_scale) {
  const std::int64_t N = targets.numel();
  vocab_parallel_cross_entropy_backward<T>(be, logits, Tensor<const T>(logits),
                                           Tensor<const double>(stats.row_max.reshape({N})),
                                           Tensor<const double>(stats.partials.reshape({2, N})), targets, vocab_begin,
                                           vocab_size, loss_scale, Tensor<const double>(stats.gradient_scale));
}

//! Rows [first, first + count) of a tensor whose first dimension is rows.
template <class U>
Tensor<U> rows(Tensor<U> t, std::int64_t first, std::int64_t count) {
  const std::int64_t width = t.numel() / t.extent(0);
  return t.shape().rank() == 1 ? Tensor<U>(t.data() + first, {count})
                               : Tensor<U>(t.data() + first * width, {count, width});
}

//! out [M, C] = the rows `rows` [M] of `whole` [N, C], in order. The vocabulary-parallel embedding
//! lookup is this gather (the row indices are its ids, `whole` its one slice), on every backend.
template <class T, Backend B>
void gather_rows(B& be, Tensor<T> out, Tensor<const T> whole, Tensor<const std::int32_t> rows) {
  const std::int64_t M = rows.numel(), C = whole.extent(1);
  vocab_parallel_embedding_forward<T>(be, out.reshape({1, M, C}), rows.reshape({1, M}), whole, 0, Tensor<const T>{});
}
//! whole [N, C] row rows[i] += part [M, C] row i: the backward of gather_rows (the embedding
//! backward; distinct rows, so each row of `whole` gets at most one add, in a fixed order).
template <class T, Backend B>
void scatter_add_rows(B& be, Tensor<T> whole, Tensor<const T> part, Tensor<const std::int32_t> rows) {
  const std::int64_t M = rows.numel(), C = whole.extent(1);
  vocab_parallel_embedding_backward<T>(be, whole, 0, Tensor<T>{}, part.reshape({1, M, C}), rows.reshape({1, M}));
}

//! The chunked head's scratch: one chunk's logits [chunk, vocab rows].
template <class T>
struct LogitScratch {
  Tensor<T> logits;
};
//! Carves a LogitScratch for chunks of `chunk` rows of `vocab_rows` columns.
template <class T>
LogitScratch<T> carve_logit_scratch(Carver<T>& c, std::int64_t chunk, std::int64_t vocab_rows) {
  LogitScratch<T> s;
  s.logits = c.take({chunk, vocab_rows});
  return s;
}

//! How a tensor-parallel model holds the rows of a micro-batch's hidden state [B·T, C] between its
//! layers: whole on every rank, or split over the group (sequence parallelism: rank r holds rows
//! [r·N/tp, (r+1)·N/tp)), and the collectives between the two forms (Megatron's f and g, as
//! all-reduces or as all-gathers and reduce-scatters). A group of one never splits.
class RowSplit {
 public:
  //! The rows this rank holds: all `total`, or `local` = total / tp from row `first`.
  struct Rows {
    std::int64_t total = 0, local = 0, first = 0;
  };

  RowSplit() = default;
  //! Rows of `channels` elements, split over `group` when `split` and the group has several ranks.
  RowSplit(CommunicatorRef group, bool split, std::int64_t channels)
      : group_(group), split_(split && group.size() > 1), channels_(channels) {}

  //! Whether the rows are split.
  bool split() const noexcept { return split_; }
  Rows rows(MicroBatchShape s) const noexcept {
    const std::int64_t N = s.batch * s.seq;
    if (!split_) return {N, N, 0};
    const std::int64_t n = N / group_.size();
    return {N, n, group_.rank() * n};
  }
  //! Throws loom::Error unless the micro-batch's tokens split into equal shares (`model` names
  //! the model).
  void check(MicroBatchShape s, std::string_view model) const {
    LOOM_CHECK(!split_ || s.batch * s.seq % group_.size() == 0,
               std::string(model) + " sequence parallelism: tokens of the micro-batch", s.batch * s.seq,
               "must be a multiple of the tensor-parallel size (" + detail::to_text(group_.size()) +
                   "): each rank holds an equal share of the rows");
  }
  //! A hidden state as the Trainer passes it (its shape is the Trainer's) as this rank's rows [n, C].
  template <class U>
  Tensor<U> local(Tensor<U> hidden, MicroBatchShape s) const {
    return hidden.reshape({rows(s).local, channels_});
  }
  //! f forward (and g backward): `local` itself when the rows are whole, else every rank's rows
  //! gathered into `whole` [N, C].
  template <class T>
  Tensor<const T> gather(std::type_identity_t<Tensor<const T>> local, Tensor<T> whole) const {
    if (!split_) return local;
    nn::gather_sequence(group_, local, whole);
    return whole;
  }
  //! g forward (and f backward): partial sums over the group become this rank's rows of the sum:
  //! all-reduced in place when the rows are whole (`local` is `partial`), else reduce-scattered
  //! from `partial` [N, C] into `local` [n, C] (which may be its slice of `partial`).
  template <class T>
  void reduce(Tensor<T> partial, Tensor<T> local) const {
    if (!split_) return nn::sum_over_tensor_parallel(group_, partial);
    nn::reduce_scatter_sequence(group_, Tensor<const T>(partial), local);
  }
  //! Hidden dropout of `layer`'s `site` at `rate` on this rank's rows `x` (the whole state's mask,
  //! so that every split drops the same elements).
  template <class T, Backend B>
  void drop(B& be, Tensor<T> x, const DropoutKey& key, int layer, DropoutSite site, double rate,
            MicroBatchShape s) const {
    hidden_dropout<T>(be, x, key, layer, site, rate, s.seq * channels_, rows(s).first * channels_);
  }
  //! A row-parallel linear layer and the residual connection after it: this rank's rows `out` =
  //! `residual` + drop(g(in · weight^T + bias)), the partial sums in `whole` [N, C] when the rows
  //! are split (else in `out`). With nothing between the product and the sum (a group of one, no
  //! hidden dropout at `site`), the residual goes into matmul_forward: the CUDA backend's GEMM then
  //! adds it in its epilogue, which saves add_to's pass over three [N, C] tensors.
  template <class T, Backend B>
  void project_add(B& be, Tensor<T> out, Tensor<T> whole, std::type_identity_t<Tensor<const T>> in,
                   std::type_identity_t<Tensor<const T>> weight, std::type_identity_t<Tensor<const T>> bias,
                   std::type_identity_t<Tensor<const T>> residual, const DropoutKey& key, int layer, DropoutSite site,
                   double rate, MicroBatchShape s) const {
    if (group_.size() == 1 && !dropping(key, rate)) return matmul_forward<T>(be, out, in, weight, bias, residual);
    const Tensor<T> sums = split_ ? whole : out;
    matmul_forward<T>(be, sums, in, weight, bias);
    reduce(sums, out);
    drop(be, out, key, layer, site, rate, s);
    add_to<T>(be, out, residual);
  }
  //! The output gradient of `layer`'s hidden dropout `site`, this rank's rows, through the mask
  //! (in `scratch` when the pass drops).
  template <class T, Backend B>
  Tensor<const T> through_drop(B& be, const BackwardArgs<T>& a, int layer, DropoutSite site, double rate,
                               Tensor<T> scratch, MicroBatchShape s) const {
    return local(through_hidden_dropout<T>(be, a, layer, site, rate, scratch, s.seq * channels_,
                                           rows(s).first * channels_),
                 s);
  }
  //! The scratch of norm_grad and sum_norm_grads for gradients of G (the parameters' type, or
  //! fp32 sums under TrainerOptions::fp32_gradient_fusion), zeroed: `scratch`, carved in the
  //! accumulate type A, whose elements are as wide as either's, viewed as G (empty when the rows
  //! are whole).
  template <class G, Backend B, class A>
  Tensor<G> norm_scratch(B& be, Tensor<A> scratch) const {
    static_assert(sizeof(G) <= sizeof(A) && alignof(G) <= alignof(A), "loom: norm_scratch narrows, never widens");
    const Tensor<G> out{reinterpret_cast<G*>(scratch.data()), scratch.shape()};
    if (split_) zero<G>(be, out);
    return out;
  }
  //! Split rows give each rank a partial sum of a layernorm's weight and bias gradients, so the
  //! backward accumulates them in `scratch` (zeroed; empty when the rows are whole) and
  //! sum_norm_grads finishes them. Where the backward accumulates gradient `grad`: `grad` itself,
  //! or piece `piece` (of grad's size) of `scratch`. Both are of the gradients' type (norm_scratch).
  template <class T>
  Tensor<T> norm_grad(Tensor<T> grad, Tensor<T> scratch, int piece) const {
    if (!split_) return grad;
    return {scratch.data() + piece * grad.numel(), grad.shape()};
  }
  //! Sums `scratch` (see norm_grad) over the group and adds its pieces to the gradients `into`, in
  //! order; nothing when the rows are whole.
  template <class T, Backend B>
  void sum_norm_grads(B& be, Tensor<T> scratch, std::initializer_list<Tensor<T>> into) const {
    if (!split_) return;
    nn::sum_over_tensor_parallel(group_, scratch);
    std::int64_t at = 0;
    for (const Tensor<T>& g : into) {
      add_to<T>(be, g, Tensor<const T>{scratch.data() + at, g.shape()});
      at += g.numel();
    }
  }

 private:
  // Collectives are not const; the models' forward and backward are.
  mutable CommunicatorRef group_;
  bool split_ = false;
  std::int64_t channels_ = 0;
};

//! Scratch of `shape` for a layer's forward: the start of `workspace` (the layer's) when the
//! caller gave one, else `own`, allocated here. `what` names the layer for the error.
template <class T, Backend B>
Tensor<T> forward_scratch(B& be, Tensor<T> workspace, Buffer<T, B>& own, Shape shape, const char* what) {
  if (workspace.empty()) {
    own = Buffer<T, B>(be, shape.numel(), MemoryCategory::workspace);
    return {own.data(), shape};
  }
  LOOM_CHECK(workspace.numel() >= shape.numel(), std::string(what) + " forward: workspace elements",
             workspace.numel(), "must hold " + detail::to_text(shape.numel()));
  return {workspace.data(), shape};
}

//! Where a chunked head's forward computes a chunk's logits [chunk, vocab rows]: in `workspace`
//! (the layer's, which starts with the backward's LogitScratch) when the caller gave one, else in
//! `own`, allocated here.
template <class T, Backend B>
Tensor<T> forward_logits_scratch(B& be, Tensor<T> workspace, Buffer<T, B>& own, std::int64_t chunk,
                                 std::int64_t vocab_rows) {
  if (workspace.empty()) return forward_scratch(be, workspace, own, {chunk, vocab_rows}, "chunked head");
  Carver<T> counter{};
  carve_logit_scratch(counter, chunk, vocab_rows);
  LOOM_CHECK(workspace.numel() >= counter.elements(), "chunked head forward: workspace elements", workspace.numel(),
             "must hold one chunk's logits (" + detail::to_text(counter.elements()) + " elements)");
  Carver<T> c{workspace.data()};
  return carve_logit_scratch(c, chunk, vocab_rows).logits;
}

//! The unembedding and loss of a head, `chunk` rows at a time: each chunk's slice of the logits
//! `x` [N, C] · `w`ᵀ (+ `bias`, may be empty) goes into `logits` [chunk, vocab rows] (scratch),
//! through vocab_parallel_softmax_loss into its rows of `losses` and `stats`. Returns the sum of
//! the losses. The [N, vocab rows] logits never exist; the backward computes each chunk again.
template <class T, Backend B>
double chunked_unembedding_loss(B& be, CommunicatorRef& tensor_parallel, Tensor<accumulate_t<T>> losses,
                                const LogitStatistics& stats, Tensor<T> logits, Tensor<const T> x, Tensor<const T> w,
                                Tensor<const T> bias, Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                std::int64_t vocab_size, std::int64_t chunk) {
  const std::int64_t N = targets.numel(), V = w.extent(0);
  const Buffer<double, B> slice_max = slice_max_scratch(be, tensor_parallel, std::min(chunk, N));
  for (std::int64_t first = 0; first < N; first += chunk) {
    const std::int64_t k = std::min(chunk, N - first);
    const Tensor<T> slice(logits.data(), {k, V});
    matmul_forward<T>(be, slice, rows(x, first, k), w, bias);
    vocab_parallel_softmax_loss<T>(be, tensor_parallel, rows(losses, first, k), slice, rows(stats.row_max, first, k),
                                   Tensor<double>(stats.partials.data() + 2 * first, {2, k}), rows(targets, first, k),
                                   vocab_begin, vocab_size, slice_max.data());
  }
  return sum_elements<accumulate_t<T>>(be, Tensor<const accumulate_t<T>>(losses));
}

//! The backward of chunked_unembedding_loss: per chunk, the logits again, dlogits from them and
//! the forward's `stats` (scaled by `loss_scale`), then `dx` [N, C] = dlogits · w (written, not
//! read: each chunk writes its own rows), and `dw` += dlogitsᵀ · x and `dbias` += its column sums
//! where they are not empty (of T, or fp32 sums: G = float). Communicates nothing: the caller
//! sums dx over the group.
template <class T, GradientOf<T> G = T, Backend B>
void chunked_unembedding_loss_backward(B& be, Tensor<T> dx, Tensor<G> dw, Tensor<G> dbias,
                                       const LogitScratch<T>& scratch, const LogitStatistics& stats, Tensor<const T> x,
                                       Tensor<const T> w, Tensor<const T> bias, Tensor<const std::int32_t> targets,
                                       std::int64_t vocab_begin, std::int64_t vocab_size, accumulate_t<T> loss_scale,
                                       std::int64_t chunk) {
  const std::int64_t N = targets.numel(), V = w.extent(0);
  for (std::int64_t first = 0; first < N; first += chunk) {
    const std::int64_t k = std::min(chunk, N - first);
    const Tensor<T> logits(scratch.logits.data(), {k, V});
    matmul_forward<T>(be, logits, rows(x, first, k), w, bias);
    vocab_parallel_cross_entropy_backward<T>(be, logits, Tensor<const T>(logits),
                                             Tensor<const double>(rows(stats.row_max, first, k)),
                                             Tensor<const double>(stats.partials.data() + 2 * first, {2, k}),
                                             rows(targets, first, k), vocab_begin, vocab_size, loss_scale);
    matmul_backward<T>(be, rows(dx, first, k), dw, dbias, logits, rows(x, first, k), w, GradientWrite::overwrite);
  }
}

}  // namespace loom::detail::transformer
