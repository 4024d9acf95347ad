#pragma once
//! \file Multi-head self-attention on the CPU backend, causal (GPT-2) or bidirectional (BERT;
//! loom::AttentionMask), over full-length or padded sequences (loom::AttentionKeys): Eigen GEMMs
//! per (batch, head) over strided views of the packed qkv activations, in blocks of query rows, so
//! that with the causal mask only the lower triangle of the score matrix is computed (the
//! bidirectional one computes all of it) and no key past a sequence's length. Two pairs of kernels:
//! attention_forward/attention_backward keep the probabilities [B,NH,T,T] for the backward;
//! attention_forward_lse/attention_backward_lse keep only the row log-sum-exp [B,NH,T] and
//! recompute the probabilities block by block (FlashAttention's contract). Each takes an optional
//! AttentionDropout: out = dropout(P) V, with P (what att and lse keep) the undropped softmax,
//! and the backward given the forward's AttentionDropout draws the same mask again.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "loom/backend/attention_mask.hpp"
#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/array_map.hpp"
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/backend/cpu/detail/sum.hpp"
#include "loom/backend/cpu/dropout.hpp"
#include "loom/backend/detail/attention_checks.hpp"
#include "loom/backend/gradient_write.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::attention {

//! Query rows per GEMM block. With the causal mask each block of rows [i0, i1) multiplies against
//! keys [0, i1), so a block wastes at most half a block of the upper triangle; 64 keeps the GEMMs
//! large enough for Eigen's kernels while computing ~(T/2 + 32)/T of the full score matrix.
//! Bidirectional blocks multiply against all keys [0, T).
inline constexpr std::int64_t block_rows = 64;

template <class T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
//! A row-major [rows, cols] slice whose rows are `stride` elements apart.
template <class T>
using Strided = Eigen::Map<RowMajor<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using ConstStrided = Eigen::Map<const RowMajor<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

using loom::detail::serial_gemm_in_this_task;

using loom::detail::sum_as_double;

//! sum_i x[i] * y[i] accumulated in double, in a fixed order.
template <class T>
double dot_as_double(const T* x, const T* y, std::int64_t n) noexcept {
  double acc[4] = {0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) acc[k] += static_cast<double>(x[i + k]) * y[i + k];
  for (; i < n; ++i) acc[0] += static_cast<double>(x[i]) * y[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

using loom::detail::ArrayMap;
using loom::detail::ConstArrayMap;

using loom::detail::thread_index;

//! x[i] = f(x[i]) for i in [0, n), where f is an element-wise Eigen expression of a chunk (an
//! exp), evaluated in an aligned 16-element buffer. Every element then takes the same vectorised
//! path wherever it lies in memory: Eigen's own loop over an unaligned row does its head and tail
//! in scalar code, whose exp can differ in the last bit, which would tie results to addresses
//! (att rows versus a per-thread block, one thread's block versus another's).
template <class A, class F>
void transform_in_chunks(A* x, std::int64_t n, F&& f) {
  constexpr std::int64_t chunk = 16;  // a multiple of every packet size, AVX-512 included
  using Chunk = Eigen::Array<A, chunk, 1>;
  Chunk buffer;  // aligned by Eigen
  std::int64_t i = 0;
  for (; i + chunk <= n; i += chunk) {
    Eigen::Map<Chunk> at(x + i);
    buffer = at;  // copies are exact, aligned or not
    buffer = f(buffer);
    at = buffer;
  }
  if (i < n) {
    const std::int64_t m = n - i;
    std::copy_n(x + i, m, buffer.data());
    std::fill(buffer.data() + m, buffer.data() + chunk, A(0));
    buffer = f(buffer);
    std::copy_n(buffer.data(), m, x + i);
  }
}

//! scores[n, keys] (rows `Tn` apart) = Q[i0, i1) K[0, keys)^T, unscaled: the score block of query
//! rows [i0, i1) against the keys they meet (block_keys).
template <class A>
void score_block(const ConstStrided<A>& Q, const ConstStrided<A>& K, std::int64_t i0, std::int64_t i1,
                 std::int64_t keys, A* scores, std::int64_t Tn) {
  Strided<A> S(scores, i1 - i0, keys, Eigen::OuterStride<>(Tn));
  S.noalias() = Q.middleRows(i0, i1 - i0) * K.topRows(keys).transpose();
}

//! The keys [0, block_keys) that some query row of the block [i0, i1) sees: [0, i1) with the
//! causal mask, all of [0, T) without; none at or past the sequence's `length`.
inline std::int64_t block_keys(AttentionMask mask, std::int64_t i1, std::int64_t Tn, std::int64_t length) noexcept {
  return std::min(mask == AttentionMask::causal ? i1 : Tn, length);
}

//! The keys [0, row_keys) that real query t (t < the sequence's `length`) sees: [0, t] with the
//! causal mask, all of [0, T) without; none at or past `length` (AttentionKeys).
inline std::int64_t row_keys(AttentionMask mask, std::int64_t t, std::int64_t Tn, std::int64_t length) noexcept {
  return std::min(mask == AttentionMask::causal ? t + 1 : Tn, length);
}

//! The dropped probabilities of query rows [i0, i1): row t of `dropped` (rows T apart) is row t
//! of `probs` (rows T apart) through `drop` at global elements origin + t·T + s, zero from the
//! row's keys up to `keys`. Returns `dropped`.
template <class A>
const A* drop_block(const DropoutMask& drop, std::uint64_t origin, const A* probs, A* dropped, std::int64_t i0,
                    std::int64_t i1, std::int64_t keys, std::int64_t Tn, AttentionMask mask,
                    std::int64_t length) {
  for (std::int64_t t = i0; t < i1; ++t) {
    const std::int64_t seen = row_keys(mask, t, Tn, length), r = t - i0;
    dropout_row(drop, origin + static_cast<std::uint64_t>(t * Tn), probs + r * Tn, dropped + r * Tn, seen);
    std::fill(dropped + r * Tn + seen, dropped + r * Tn + keys, A(0));
  }
  return dropped;
}

//! One (batch, head) of the forward in the accumulate type A: q, k, v [T, hs] with rows
//! `qkv_stride` apart, out [T, hs] with rows `out_stride` apart. The probabilities go to att
//! [T, T] (contiguous; with the causal mask 0 above the diagonal); where att is null, each block
//! of query rows goes in turn to `block` ([min(T, 64), T] scratch) and lse[t] = log Σ_s exp(scale
//! q_t·k_s) over the keys s that t sees is kept instead. Either way out comes from the same
//! arithmetic. With an active `drop`, out = dropout(P) V (the mask of element (t, s) is that of
//! global element origin + t·T + s), the dropped block going to `dropped` ([min(T, 64), T]
//! scratch); att and lse are the softmax's, undropped. Padding (rows and keys at or past
//! `length`, the sequence's real tokens: AttentionKeys) takes no part: no real query sees a padded
//! key, a padded query's out and att rows are 0 and its lse 0, and neither is ever multiplied.
template <class A>
void head_forward(const A* q, const A* k, const A* v, std::int64_t qkv_stride, A* att, A* lse, A* block,
                  A* out, std::int64_t out_stride, std::int64_t Tn, std::int64_t hs, A scale, AttentionMask mask,
                  std::int64_t length, const DropoutMask& drop, std::uint64_t origin, A* dropped) {
  const Eigen::OuterStride<> qkv_outer(qkv_stride);
  const ConstStrided<A> Q(q, Tn, hs, qkv_outer), K(k, Tn, hs, qkv_outer), V(v, Tn, hs, qkv_outer);
  Strided<A> O(out, Tn, hs, Eigen::OuterStride<>(out_stride));
  // att rows are T wide and zero past the row's keys; a block row only needs its block's keys.
  // The blocks cover the real queries [0, length); padded ones attend to nothing.
  for (std::int64_t i0 = 0; i0 < length; i0 += block_rows) {
    const std::int64_t i1 = std::min(length, i0 + block_rows), n = i1 - i0, keys = block_keys(mask, i1, Tn, length);
    A* probs = att != nullptr ? att + i0 * Tn : block;
    score_block(Q, K, i0, i1, keys, probs, Tn);
    // Row softmax over the keys t sees, in place; scale > 0, so the raw max is the scaled max.
    for (std::int64_t t = i0; t < i1; ++t) {
      A* row = probs + (t - i0) * Tn;
      const std::int64_t seen = row_keys(mask, t, Tn, length);
      const A max = ConstArrayMap<A>(row, seen).maxCoeff();
      transform_in_chunks(row, seen, [&](const auto& x) { return ((x - max) * scale).exp(); });
      const double sum = sum_as_double(row, seen);
      ArrayMap<A>(row, seen) *= static_cast<A>(1.0 / sum);
      if (lse != nullptr) lse[t] = static_cast<A>(static_cast<double>(max) * scale + std::log(sum));
      std::fill(row + seen, row + (att != nullptr ? Tn : keys), A(0));
    }
    const A* weights = drop.active() ? drop_block(drop, origin, probs, dropped, i0, i1, keys, Tn, mask, length) : probs;
    O.middleRows(i0, n).noalias() = ConstStrided<A>(weights, n, keys, Eigen::OuterStride<>(Tn)) * V.topRows(keys);
  }
  if (length < Tn) {
    O.bottomRows(Tn - length).setZero();
    if (att != nullptr) std::fill(att + length * Tn, att + Tn * Tn, A(0));
    if (lse != nullptr) std::fill(lse + length, lse + Tn, A(0));
  }
}

//! One (batch, head) of the backward in the accumulate type A: dq, dk, dv += the gradients of
//! q, k, v (all [T, hs], rows `qkv_stride` apart) from dout [T, hs] (rows `dout_stride` apart).
//! The probabilities come from att [T, T]; where att is null, each block of query rows [i0, i1)
//! is recomputed into `block` from one score GEMM and lse [T]: P = exp(scale q_t·k_s - lse[t])
//! over the keys s that t sees, and each row's sum_s P dP (the softmax backward's shift) is
//! dout_t·out_t from the forward's out [T, hs] (rows `dout_stride` apart), as the GPU's tiled
//! kernel forms it. `work` and `block` are [min(T, block_rows), T] scratch (block and out unused
//! with att). With an active `drop` (the forward's): dV from the dropped probabilities (into
//! `dropped`, [min(T, 64), T] scratch), dP through the mask, and the rest on the undropped P
//! (sum_s P dP is still dout_t·out_t: out is the dropped probabilities times V).
template <class A>
void head_backward(const A* q, const A* k, const A* v, A* dq, A* dk, A* dv, std::int64_t qkv_stride,
                   const A* dout, const A* out, std::int64_t dout_stride, const A* att, const A* lse, A* block,
                   A* work, std::int64_t Tn, std::int64_t hs, A scale, AttentionMask mask, std::int64_t length,
                   const DropoutMask& drop, std::uint64_t origin, A* dropped) {
  const Eigen::OuterStride<> qkv_outer(qkv_stride);
  const ConstStrided<A> Q(q, Tn, hs, qkv_outer), K(k, Tn, hs, qkv_outer), V(v, Tn, hs, qkv_outer);
  Strided<A> dQ(dq, Tn, hs, qkv_outer), dK(dk, Tn, hs, qkv_outer), dV(dv, Tn, hs, qkv_outer);
  const ConstStrided<A> dO(dout, Tn, hs, Eigen::OuterStride<>(dout_stride));
  Strided<A> W(work, std::min(Tn, block_rows), Tn, Eigen::OuterStride<>(Tn));
  // Padded queries (rows [length, T)) attended to nothing: they pass no gradient.
  for (std::int64_t i0 = 0; i0 < length; i0 += block_rows) {
    const std::int64_t i1 = std::min(length, i0 + block_rows), n = i1 - i0, keys = block_keys(mask, i1, Tn, length);
    // P: rows [i0, i1), Tn apart, over the block's keys [0, keys) (0 past each row's own keys).
    const A* probs = att != nullptr ? att + i0 * Tn : block;
    if (att == nullptr) {
      score_block(Q, K, i0, i1, keys, block, Tn);
      for (std::int64_t t = i0; t < i1; ++t) {
        A* row = block + (t - i0) * Tn;
        const A shift = lse[t];
        const std::int64_t seen = row_keys(mask, t, Tn, length);
        transform_in_chunks(row, seen, [&](const auto& x) { return (x * scale - shift).exp(); });
        std::fill(row + seen, row + keys, A(0));
      }
    }
    const A* weights = drop.active() ? drop_block(drop, origin, probs, dropped, i0, i1, keys, Tn, mask, length) : probs;
    const ConstStrided<A> P(weights, n, keys, Eigen::OuterStride<>(Tn));
    const auto dO_block = dO.middleRows(i0, n);
    // dV += P^T dO (P is 0 past each row's keys, so the block's masked part adds nothing).
    dV.topRows(keys).noalias() += P.transpose() * dO_block;
    // dP = dO V^T, then dS = P ∘ (dP - rowsum(dP ∘ P)) in place (rowsum(dP ∘ P) = dO·O).
    auto dS = W.topLeftCorner(n, keys);
    dS.noalias() = dO_block * V.topRows(keys).transpose();
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t t = i0 + r, seen = row_keys(mask, t, Tn, length);
      const ConstArrayMap<A> p(probs + r * Tn, seen);
      ArrayMap<A> g(work + r * Tn, seen);
      if (drop.active()) dropout_row(drop, origin + static_cast<std::uint64_t>(t * Tn), g.data(), g.data(), seen);
      const A shift = static_cast<A>(att != nullptr ? dot_as_double(g.data(), p.data(), seen)
                                                    : dot_as_double(dout + t * dout_stride, out + t * dout_stride, hs));
      g = p * (g - shift);
      std::fill(g.data() + seen, g.data() + keys, A(0));  // row r spans keys [0, keys)
    }
    // Scores were q·k * scale: dQ += scale dS K, dK += scale dS^T Q.
    dQ.middleRows(i0, n).noalias() += scale * (dS * K.topRows(keys));
    dK.topRows(keys).noalias() += scale * (dS.transpose() * Q.middleRows(i0, n));
  }
}

//! The softmax scale 1/sqrt(hs), in the accumulate type.
template <class A>
A softmax_scale(std::int64_t head_size) {
  return A(1) / std::sqrt(static_cast<A>(head_size));
}

//! attention_forward (att not null: the probabilities [B,NH,T,T] are kept) and
//! attention_forward_lse (att null: lse [B,NH,T] is kept and each thread reuses one block) on
//! checked arguments (the mask in `d`): one task per (batch, head). On bf16 each head's q, k, v
//! are widened to float, the head runs in float, and out (and att) are rounded once.
template <class T>
void forward_heads(const cpu& be, const Dims& d, T* out, T* att, accumulate_t<T>* lse, const T* qkv,
                   const AttentionDropout& drop) {
  using A = accumulate_t<T>;
  const std::int64_t B = d.batch, Tn = d.tokens, C = d.channels, NH = d.heads, hs = d.head_size;
  const A scale = softmax_scale<A>(hs);
  const std::int64_t rows = std::min(Tn, block_rows);
  // Allocated here, not in the parallel region, so that a failed allocation throws normally.
  // Per thread a block of recomputed probabilities without att, and one of dropped ones.
  const std::int64_t per_thread = ((att != nullptr ? 0 : 1) + (drop.mask.active() ? 1 : 0)) * rows * Tn;
  std::vector<A> blocks(static_cast<std::size_t>(be.threads() * per_thread));
  // bf16: per thread q, k, v and out [T, hs] in float, and att [T, T] where it is kept.
  Staging<T> staging(be.threads(), 4 * Tn * hs + (att != nullptr ? Tn * Tn : 0));

#pragma omp parallel num_threads(be.threads())
  {
    serial_gemm_in_this_task();
    const int thread = thread_index();
    A* stage = staging.at(thread);
    A* block = att != nullptr ? nullptr : blocks.data() + thread * per_thread;
    A* dropped = drop.mask.active() ? blocks.data() + thread * per_thread + (att != nullptr ? 0 : rows * Tn) : nullptr;
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < B * NH; ++bh) {
      const std::int64_t b = bh / NH, h = bh % NH;
      const T* q = qkv + b * Tn * 3 * C + h * hs;
      T* att_head = att != nullptr ? att + bh * Tn * Tn : nullptr;
      A* lse_head = lse != nullptr ? lse + bh * Tn : nullptr;
      T* out_head = out + b * Tn * C + h * hs;
      const std::uint64_t origin = drop.head_origin(b, h, Tn);
      const std::int64_t length = d.length(b);
      if constexpr (is_narrow_storage<T>) {
        // q, k, v: three [T, hs] blocks C apart in qkv; then out and att.
        for (int i = 0; i < 3; ++i) widen_block(q + i * C, 3 * C, 0, Tn, 0, hs, stage + i * Tn * hs);
        A* so = stage + 3 * Tn * hs;
        A* sa = att != nullptr ? so + Tn * hs : nullptr;
        head_forward<A>(stage, stage + Tn * hs, stage + 2 * Tn * hs, hs, sa, lse_head, block, so, hs, Tn, hs, scale,
                        d.mask, length, drop.mask, origin, dropped);
        if (att != nullptr) narrow_into(sa, att_head, Tn * Tn);
        narrow_block(so, hs, out_head, C, Tn, hs);
      } else {
        head_forward<A>(q, q + C, q + 2 * C, 3 * C, att_head, lse_head, block, out_head, C, Tn, hs, scale, d.mask,
                        length, drop.mask, origin, dropped);
      }
    }
  }
}

//! attention_backward (from att [B,NH,T,T]) and attention_backward_lse (att null: from lse
//! [B,NH,T] and out [B,T,C], recomputing the probabilities block by block) on checked arguments
//! (the mask in `d`): one task per (batch, head), dqkv += (or with GradientWrite::overwrite, the
//! head's slice of dqkv zeroed first, never read: the bits of accumulating into zeros). On bf16
//! each head's operands (and its slice of dqkv) are widened to float, and dqkv rounded once.
template <class T>
void backward_heads(const cpu& be, const Dims& d, T* dqkv, const T* dout, const T* qkv, const T* att,
                    const T* out, const accumulate_t<T>* lse, const AttentionDropout& drop, GradientWrite write) {
  using A = accumulate_t<T>;
  const std::int64_t B = d.batch, Tn = d.tokens, C = d.channels, NH = d.heads, hs = d.head_size;
  const A scale = softmax_scale<A>(hs);
  const std::int64_t rows = std::min(Tn, block_rows);
  // Per thread one [rows, T] block for dS, and one for the recomputed probabilities without att;
  // allocated here, not in the parallel region, so that a failed allocation throws normally.
  // And one for the dropped probabilities with dropout.
  const std::int64_t per_thread = ((att != nullptr ? 1 : 2) + (drop.mask.active() ? 1 : 0)) * rows * Tn;
  std::vector<A> scratch(static_cast<std::size_t>(be.threads() * per_thread));
  // bf16: per thread q, k, v, dq, dk, dv, dout [T, hs] in float, and att [T, T] where given, else
  // out [T, hs].
  Staging<T> staging(be.threads(), 7 * Tn * hs + (att != nullptr ? Tn * Tn : Tn * hs));

#pragma omp parallel num_threads(be.threads())
  {
    serial_gemm_in_this_task();
    const int thread = thread_index();
    A* work = scratch.data() + thread * per_thread;
    A* block = att != nullptr ? nullptr : work + rows * Tn;
    A* dropped = drop.mask.active() ? work + (att != nullptr ? 1 : 2) * rows * Tn : nullptr;
    A* stage = staging.at(thread);
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < B * NH; ++bh) {
      const std::int64_t b = bh / NH, h = bh % NH;
      const std::int64_t offset = b * Tn * 3 * C + h * hs;
      const T* q = qkv + offset;
      T* dq = dqkv + offset;
      const T* g = dout + b * Tn * C + h * hs;
      const T* o = out != nullptr ? out + b * Tn * C + h * hs : nullptr;
      const T* a = att != nullptr ? att + bh * Tn * Tn : nullptr;
      const A* l = lse != nullptr ? lse + bh * Tn : nullptr;
      const std::uint64_t origin = drop.head_origin(b, h, Tn);
      const std::int64_t length = d.length(b);
      if constexpr (is_narrow_storage<T>) {
        // q, k, v, dq, dk, dv: six [T, hs] blocks at C apart in qkv and dqkv; then dout, and att
        // or out.
        A* blocks = stage;
        for (int i = 0; i < 3; ++i) {
          widen_block(q + i * C, 3 * C, 0, Tn, 0, hs, blocks + i * Tn * hs);
          if (write == GradientWrite::accumulate)
            widen_block(dq + i * C, 3 * C, 0, Tn, 0, hs, blocks + (3 + i) * Tn * hs);
          else
            std::fill_n(blocks + (3 + i) * Tn * hs, Tn * hs, A(0));
        }
        A* sg = blocks + 6 * Tn * hs;
        A* sa = a != nullptr ? sg + Tn * hs : nullptr;
        A* so = a != nullptr ? nullptr : sg + Tn * hs;
        widen_block(g, C, 0, Tn, 0, hs, sg);
        if (a != nullptr) widen_into(a, sa, Tn * Tn);
        else widen_block(o, C, 0, Tn, 0, hs, so);
        head_backward<A>(blocks, blocks + Tn * hs, blocks + 2 * Tn * hs, blocks + 3 * Tn * hs, blocks + 4 * Tn * hs,
                         blocks + 5 * Tn * hs, hs, sg, so, hs, sa, l, block, work, Tn, hs, scale, d.mask, length,
                         drop.mask, origin, dropped);
        for (int i = 0; i < 3; ++i) narrow_block(blocks + (3 + i) * Tn * hs, hs, dq + i * C, 3 * C, Tn, hs);
      } else {
        if (write == GradientWrite::overwrite)
          for (std::int64_t t = 0; t < Tn; ++t)
            for (int i = 0; i < 3; ++i) std::fill_n(dq + t * 3 * C + i * C, hs, T(0));
        head_backward<A>(q, q + C, q + 2 * C, dq, dq + C, dq + 2 * C, 3 * C, g, o, C, a, l, block, work, Tn, hs,
                         scale, d.mask, length, drop.mask, origin, dropped);
      }
    }
  }
}

}  // namespace loom::detail::attention

namespace loom::inline kernels {

//! Multi-head self-attention forward, causal (GPT-2, the default) or bidirectional (BERT). `qkv`
//! [B,T,3C] packs per token q, k, v (each C wide; head h owns channels [h*hs, (h+1)*hs),
//! hs = C/num_heads). Writes `att` [B,NH,T,T], the softmax of q·k/sqrt(hs) over the keys s that
//! query t sees (`keys.mask`: s <= t, entries s > t exactly 0; or every s < T; and with
//! `keys.lengths`, [B] in host memory, only s < lengths[b], entries past it exactly 0, and a
//! padded query t >= lengths[b] sees nothing: its att row and out are 0), and `out` [B,T,C], per
//! head sum_s att[b,h,t,s] v[b,s], heads concatenated. Throws loom::Error on shapes
//! that do not match, a num_heads that does not divide C, a mask that is not an AttentionMask
//! value, or a length outside [1, T]. On
//! bf16 each head's q, k, v are widened to float, the head runs in float, and att and out are
//! rounded once. The causal mask computes about half of each T x T score matrix, the
//! bidirectional one all of it; a padded sequence only its real queries' rows and keys' columns.
template <class T>
void attention_forward(const cpu& be, Tensor<T> out, Tensor<T> att, Tensor<const T> qkv, int num_heads,
                       AttentionKeys keys = AttentionMask::causal, const AttentionDropout& dropout = {}) {
  namespace ad = detail::attention;
  const ad::Dims d = ad::check_forward(out, att, qkv, num_heads, keys);
  if (d.empty()) return;
  ad::check_length_values(d, "attention_forward");
  ad::forward_heads<T>(be, d, out.data(), att.data(), nullptr, qkv.data(), dropout);
}

//! Multi-head self-attention backward: `dqkv` [B,T,3C] += the gradient w.r.t. `qkv` given `dout`
//! [B,T,C] and the probabilities `att` [B,NH,T,T] saved by attention_forward with the same
//! `keys`; with `dqkv_write` = GradientWrite::overwrite, dqkv = the gradient (0 at padded
//! positions), dqkv never read. Scratch is one [64, T] block per thread; nothing of size
//! [B,NH,T,T] is allocated. On bf16 each head's operands (and its slice of dqkv) are widened to
//! float, and dqkv rounded once.
template <class T>
void attention_backward(const cpu& be, Tensor<T> dqkv, Tensor<const T> dout, Tensor<const T> qkv,
                        Tensor<const T> att, int num_heads, AttentionKeys keys = AttentionMask::causal,
                        const AttentionDropout& dropout = {}, GradientWrite dqkv_write = GradientWrite::accumulate) {
  namespace ad = detail::attention;
  const ad::Dims d = ad::check_backward(dqkv, dout, qkv, att, num_heads, keys);
  if (d.empty()) return;
  ad::check_length_values(d, "attention_backward");
  ad::backward_heads<T>(be, d, dqkv.data(), dout.data(), qkv.data(), att.data(), nullptr, nullptr, dropout,
                        dqkv_write);
}

//! Self-attention forward (causal or bidirectional, padded or not: `keys`) that keeps only the row log-sum-exp
//! (FlashAttention's saved state): `out` [B,T,C] as attention_forward writes it (the same
//! arithmetic, the same bits for float and double), and `lse` [B,NH,T], lse[b,h,t] = log Σ_s
//! exp(q_t·k_s/sqrt(hs)) over the keys s that t sees (natural log, row max subtracted; 0 for a
//! padded query, which sees none), in the accumulate type. Scratch is one [64, T] block per
//! thread; nothing of size [B,NH,T,T] is allocated.
template <class T>
void attention_forward_lse(const cpu& be, Tensor<T> out, Tensor<accumulate_t<T>> lse, Tensor<const T> qkv,
                           int num_heads, AttentionKeys keys = AttentionMask::causal,
                           const AttentionDropout& dropout = {}) {
  namespace ad = detail::attention;
  const ad::Dims d = ad::check_forward_lse(out, lse, qkv, num_heads, keys);
  if (d.empty()) return;
  ad::check_length_values(d, "attention_forward_lse");
  ad::forward_heads<T>(be, d, out.data(), nullptr, lse.data(), qkv.data(), dropout);
}

//! Self-attention backward from the `out` [B,T,C] and `lse` [B,NH,T] that attention_forward_lse
//! wrote with the same `keys`: `dqkv` [B,T,3C] += the gradient w.r.t. `qkv` given `dout` [B,T,C].
//! Per block of 64 query rows it recomputes the probabilities from one extra score GEMM,
//! P = exp(q_t·k_s/sqrt(hs) - lse), then runs attention_backward's math with each row's softmax
//! shift sum_s P dP taken as dout_t·out_t (FlashAttention's D; the same on the GPU). Scratch is
//! two [64, T] blocks per thread. `dqkv_write` as for attention_backward.
template <class T>
void attention_backward_lse(const cpu& be, Tensor<T> dqkv, Tensor<const T> dout, Tensor<const T> qkv,
                            Tensor<const T> out, Tensor<const accumulate_t<T>> lse, int num_heads,
                            AttentionKeys keys = AttentionMask::causal, const AttentionDropout& dropout = {},
                            GradientWrite dqkv_write = GradientWrite::accumulate) {
  namespace ad = detail::attention;
  const ad::Dims d = ad::check_backward_lse(dqkv, dout, qkv, out, lse, num_heads, keys);
  if (d.empty()) return;
  ad::check_length_values(d, "attention_backward_lse");
  ad::backward_heads<T>(be, d, dqkv.data(), dout.data(), qkv.data(), nullptr, out.data(), lse.data(), dropout,
                        dqkv_write);
}

}  // namespace loom::inline kernels
