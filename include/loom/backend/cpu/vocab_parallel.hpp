#pragma once
//! \file Vocabulary-parallel embedding and cross-entropy on the CPU backend (Megatron's split of
//! the vocabulary across a tensor-parallel group). Each kernel sees one rank's slice of the
//! vocabulary, rows [vocab_begin, vocab_begin + slice rows) of the global (padded) table; the
//! collectives between the steps are the caller's (docs/tensor_parallel.md). Columns or rows
//! whose global id is >= the real vocabulary are padding: they never reach the max, the sums or
//! the gradients, whichever rank holds them.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/embedding_grad.hpp"
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/backend/cpu/detail/sum.hpp"
#include "loom/backend/cpu/reduction.hpp"
#include "loom/backend/detail/vocab_parallel_checks.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::vocab_parallel {

//! Below this many elements a kernel stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 14;

//! Token ids must be >= 0 (read on the host, so checked here, not in the shared shape checks).
inline void check_token_values(const Tensor<const std::int32_t>& tokens, const char* kernel) {
  const std::int64_t Tn = tokens.extent(1), count = tokens.numel();
  const std::int32_t* ids = tokens.data();
  for (std::int64_t i = 0; i < count; ++i)
    if (ids[i] < 0) [[unlikely]]
      throw Error(std::string(kernel) + ": token at tokens[" + detail::to_text(i / Tn) + ", " +
                      detail::to_text(i % Tn) + "]",
                  ids[i], "token ids must be >= 0");
}

//! tokens [B, T] with ids >= 0, slice [rows, C], optional positions [maxT >= T, C], hidden [B, T, C].
template <class H, class E>
EmbeddingDims check_embedding(const Tensor<H>& hidden, const Tensor<const std::int32_t>& tokens,
                              const Tensor<E>& slice, std::int64_t vocab_begin, const Tensor<E>& positions,
                              const char* kernel, const char* hidden_name, const char* slice_name,
                              const char* positions_name) {
  const EmbeddingDims dims = embedding_dims(tokens, slice, vocab_begin, positions, kernel, slice_name, positions_name);
  check_token_values(tokens, kernel);
  check_shape(hidden, Shape{dims.batch, dims.seq, dims.channels}, kernel, hidden_name);
  return dims;
}

//! Each of the N targets < vocab (negative = ignored row); checked before any work, since an
//! exception cannot leave an OpenMP region. The count is checked with the shapes.
inline void check_target_values(const Tensor<const std::int32_t>& targets, std::int64_t vocab, const char* kernel) {
  for (std::int64_t n = 0; n < targets.numel(); ++n)
    if (targets[n] >= vocab) [[unlikely]]
      throw Error(std::string(kernel) + ": targets[" + detail::to_text(n) + "]", targets[n],
                  "must be < vocab (" + detail::to_text(vocab) + "), or negative to ignore the row");
}

//! The largest of x[0, n), n > 0, in the accumulate type (exact: a max does not round).
template <class T>
accumulate_t<T> row_max(const T* x, std::int64_t n) {
  if constexpr (is_narrow_storage<T>) {
    accumulate_t<T> largest = to_accumulate(x[0]);
    for (std::int64_t j = 1; j < n; ++j) largest = std::max(largest, to_accumulate(x[j]));
    return largest;
  } else {
    return Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>(x, n).maxCoeff();
  }
}

//! Per-thread rows of `columns` elements of A, each starting on a 64-byte boundary: Eigen peels
//! scalar iterations up to the destination's alignment, and scalar and vector exp may differ in
//! the last bit, so a row's exps must not depend on which thread's scratch holds them.
template <class A>
class AlignedRows {
 public:
  AlignedRows(int threads, std::int64_t columns)
      : stride_((columns + per_line - 1) / per_line * per_line),
        data_(static_cast<std::size_t>(threads * stride_ + per_line)) {}
  A* at(int thread) noexcept {
    const auto address = reinterpret_cast<std::uintptr_t>(data_.data());
    const std::size_t skip = (line - address % line) % line / sizeof(A);
    return data_.data() + skip + thread * stride_;
  }

 private:
  static constexpr std::size_t line = 64;
  static constexpr std::int64_t per_line = static_cast<std::int64_t>(line / sizeof(A));
  std::int64_t stride_;
  std::vector<A> data_;
};

//! exps[0, n) = exp(x[i] - shift) in the accumulate type, for a row `x` of T (widened into `exps`
//! first where T is narrow). The statistics and the backward both call it on AlignedRows, so
//! their exps have the same bits.
template <class T>
void shifted_exps(const T* x, accumulate_t<T> shift, accumulate_t<T>* exps, std::int64_t n) {
  using A = accumulate_t<T>;
  using Row = Eigen::Array<A, Eigen::Dynamic, 1>;
  if (n == 0) return;
  if constexpr (is_narrow_storage<T>) {
    widen_into(x, exps, n);
    Eigen::Map<Row>(exps, n) = (Eigen::Map<const Row>(exps, n) - shift).exp();
  } else {
    Eigen::Map<Row>(exps, n) = (Eigen::Map<const Row>(x, n) - shift).exp();
  }
}

//! A row's statistics over its `real` first columns: the largest value as double (the lowest
//! double where there are none) and the sum of exp(x - largest) in double, the exps left in `exps`
//! (AlignedRows), where the backward from the logits takes them again.
struct RowStatistics {
  double max, sum;
};
template <class T>
RowStatistics row_statistics(const T* x, std::int64_t real, accumulate_t<T>* exps) {
  if (real == 0) return {std::numeric_limits<double>::lowest(), 0.0};
  const accumulate_t<T> largest = row_max(x, real);
  shifted_exps(x, largest, exps, real);
  return {static_cast<double>(largest), detail::sum_as_double(exps, real)};
}

//! The probabilities of a row from its `exps` (shifted_exps by the row's max) and their `sum`:
//! p(i) = exps[i] · (1 / sum), the factor rounded once to the accumulate type and each p once to
//! T (and widened back), as the backward from the logits computes them.
template <class T>
auto logit_probabilities(const accumulate_t<T>* exps, double sum) {
  using A = accumulate_t<T>;
  const A factor = static_cast<A>(1.0 / sum);
  return [exps, factor](std::int64_t i) { return to_accumulate(static_cast<T>(exps[i] * factor)); };
}

}  // namespace loom::detail::vocab_parallel

namespace loom::inline kernels {

//! Vocabulary-parallel embedding forward: out[b,t,:] = wte_slice[tokens[b,t] - vocab_begin, :]
//! where the token lies in this slice [vocab_begin, vocab_begin + rows), else 0; plus wpe[t,:]
//! when `wpe` is non-empty (one rank of the group adds it, the all-reduce sums the slices).
//! Tokens must be >= 0; out [B,T,C], wte_slice [rows,C], wpe [maxT >= T, C].
template <class T>
void vocab_parallel_embedding_forward(const cpu& be, Tensor<T> out, Tensor<const std::int32_t> tokens,
                                      Tensor<const T> wte_slice, std::int64_t vocab_begin, Tensor<const T> wpe) {
  namespace d = detail::vocab_parallel;
  const d::EmbeddingDims dims = d::check_embedding(out, tokens, wte_slice, vocab_begin, wpe,
                                                   "vocab_parallel_embedding_forward", "out", "wte_slice", "wpe");
  const std::int64_t Tn = dims.seq, C = dims.channels, rows = dims.batch * dims.seq;
  const std::int64_t slice_rows = wte_slice.extent(0);
  const std::int32_t* ids = tokens.data();
  const T* te = wte_slice.data();
  const T* pe = wpe.data();  // nullptr when empty
  T* o_all = out.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) \
    if (rows * C >= d::parallel_min_elements)
  for (std::int64_t bt = 0; bt < rows; ++bt) {
    const std::int64_t local = static_cast<std::int64_t>(ids[bt]) - vocab_begin;
    const T* token_row = local >= 0 && local < slice_rows ? te + local * C : nullptr;
    const T* position_row = pe != nullptr ? pe + (bt % Tn) * C : nullptr;
    T* o = o_all + bt * C;
    // The same expression as embedding_forward where both rows are present, so that the
    // owning rank reproduces its sums bit for bit.
    if (token_row && position_row)
      for (std::int64_t i = 0; i < C; ++i)
        o[i] = static_cast<T>(to_accumulate(token_row[i]) + to_accumulate(position_row[i]));
    else if (token_row)
      std::copy(token_row, token_row + C, o);
    else if (position_row)
      std::copy(position_row, position_row + C, o);
    else
      std::fill(o, o + C, T(0));
  }
}

//! Backward of vocab_parallel_embedding_forward, accumulating: dwte_slice[tokens[b,t] -
//! vocab_begin] += dout[b,t] for tokens in this slice (others are another rank's rows), and
//! dwpe[t] += sum over b of dout[b,t] when `dwpe` is non-empty (every rank holds wpe whole and
//! gets its whole gradient). Deterministic for any thread count. `dwte_slice` and `dwpe` are of
//! T, or for bf16 fp32 gradient sums (G = accumulate_t<T>; TrainerOptions::fp32_gradient_fusion).
template <class T, GradientOf<T> G = T>
void vocab_parallel_embedding_backward(const cpu& be, Tensor<G> dwte_slice, std::int64_t vocab_begin,
                                       Tensor<G> dwpe, Tensor<const T> dout,
                                       Tensor<const std::int32_t> tokens) {
  namespace d = detail::vocab_parallel;
  const d::EmbeddingDims dims = d::check_embedding(dout, tokens, dwte_slice, vocab_begin, dwpe,
                                                   "vocab_parallel_embedding_backward", "dout", "dwte_slice", "dwpe");
  detail::embedding_grad::accumulate(be, dwte_slice.data(), vocab_begin, dwte_slice.extent(0), dwpe.data(),
                                     dout.data(), tokens.data(), dims.batch, dims.seq, dims.channels);
}

//! Vocabulary-parallel cross-entropy, step 1: the statistics of this slice's `logits` [N, Vs] in
//! one pass that writes nothing over them. row_max[n] = the largest logit of row n over the
//! slice's real columns (vocab_begin + j < vocab; the lowest double where there are none);
//! partials[n] = the sum of exp(logit - row_max[n]) over them (float exps for bf16 and float,
//! summed in double); partials[N + n] = the target's logit where this slice holds row n's target,
//! else 0. `slice_max` [N], unless empty, gets row_max too. With one slice these are the row's
//! statistics. A group all-reduces row_max with max, rescales its sums to that max
//! (vocab_parallel_cross_entropy_rebase, which reads slice_max), then all-reduces partials with
//! sum (docs/tensor_parallel.md).
template <class T>
void vocab_parallel_cross_entropy_statistics(const cpu& be, Tensor<double> row_max, Tensor<double> partials,
                                             Tensor<const T> logits, Tensor<const std::int32_t> targets,
                                             std::int64_t vocab_begin, std::int64_t vocab,
                                             Tensor<double> slice_max = {}) {
  namespace d = detail::vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_statistics";
  const d::CrossEntropyDims dims =
      d::check_statistics(row_max, partials, logits, targets, vocab_begin, vocab, slice_max, kernel);
  d::check_target_values(targets, vocab, kernel);
  using A = accumulate_t<T>;
  const std::int64_t N = dims.rows, Vs = dims.slice_columns, real = dims.real_columns;
  const T* x_all = logits.data();
  double* m = row_max.data();
  double* sums = partials.data();
  double* target_logits = partials.data() + N;
  double* copy = slice_max.data();  // nullptr when empty
  const std::int32_t* target_data = targets.data();
  // Each row is read from memory once: its exps go to scratch that stays in cache.
  d::AlignedRows<A> scratch(be.threads(), real);
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * Vs >= d::parallel_min_elements)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* x = x_all + n * Vs;
    const std::int64_t local_target = static_cast<std::int64_t>(target_data[n]) - vocab_begin;
    target_logits[n] = target_data[n] >= 0 && local_target >= 0 && local_target < real
                           ? static_cast<double>(to_accumulate(x[local_target]))
                           : 0.0;
    const d::RowStatistics r = d::row_statistics(x, real, scratch.at(detail::thread_index()));
    m[n] = r.max;
    sums[n] = r.sum;
    if (copy != nullptr) copy[n] = m[n];
  }
}

//! Vocabulary-parallel cross-entropy, step 2 for a group of slices, once `row_max` [N] holds the
//! group's max: rescales this slice's sums to it, partials[n] *= exp(slice_max[n] - row_max[n]),
//! where `slice_max` [N] is the slice's own max that step 1 copied. partials[N + n] (the target's
//! logit) is left as it is. The group then all-reduces `partials` with sum.
inline void vocab_parallel_cross_entropy_rebase(const cpu&, Tensor<double> partials, Tensor<const double> slice_max,
                                                Tensor<const double> row_max) {
  const std::int64_t N =
      detail::vocab_parallel::check_rebase(partials, slice_max, row_max, "vocab_parallel_cross_entropy_rebase");
  for (std::int64_t n = 0; n < N; ++n) partials.data()[n] *= std::exp(slice_max.data()[n] - row_max.data()[n]);
}

//! Vocabulary-parallel cross-entropy losses from the row statistics: losses[n] = log(sum[n]) -
//! (target logit[n] - row_max[n]), computed in double so that a loss stays exact where its
//! probability underflows, 0 where targets[n] < 0, in the accumulate type (float for bf16).
//! `row_max` [N] and `partials` [2, N] are the group's (step 1, or steps 1 to 2 and the
//! all-reduces); every rank of the group computes the same losses.
template <class T>
void vocab_parallel_cross_entropy_losses(const cpu&, Tensor<accumulate_t<T>> losses, Tensor<const double> row_max,
                                         Tensor<const double> partials, Tensor<const std::int32_t> targets) {
  using A = accumulate_t<T>;
  const std::int64_t N = detail::vocab_parallel::check_losses(losses, row_max, partials, targets,
                                                              "vocab_parallel_cross_entropy_losses");
  const double* sums = partials.data();
  const double* target_logits = partials.data() + N;
  for (std::int64_t n = 0; n < N; ++n)
    losses.data()[n] =
        targets.data()[n] >= 0 ? static_cast<A>(std::log(sums[n]) - (target_logits[n] - row_max.data()[n])) : A(0);
}

}  // namespace loom::inline kernels

namespace loom::detail::vocab_parallel {

//! One row of the backward: g [Vs] = scale (p - onehot) on the `real` columns (the one-hot where
//! `local_target` is one of them), 0 on padding; all 0 where `ignored` (a negative target). `p(i)`
//! reads what it needs of the row before g (which may be the row) is written.
template <class T, class Probability>
void gradient_row(T* g, std::int64_t Vs, std::int64_t real, std::int64_t local_target, bool ignored,
                  accumulate_t<T> scale, const Probability& p) {
  using A = accumulate_t<T>;
  if (ignored) {
    std::fill(g, g + Vs, T(0));
    return;
  }
  const bool owns_target = local_target >= 0 && local_target < real;
  const A target_prob = owns_target ? p(local_target) : A(0);
  for (std::int64_t i = 0; i < real; ++i) g[i] = static_cast<T>(scale * p(i));
  if (owns_target) g[local_target] = static_cast<T>(scale * (target_prob - A(1)));
  std::fill(g + real, g + Vs, T(0));
}

//! The backward of both vocab_parallel_cross_entropy_backward overloads, row by row: dlogits =
//! scale (p - onehot) on the real columns, 0 on padding and on rows whose target is negative. The
//! row's probabilities come from `probability(n, x)`, which returns p(i) in the accumulate type
//! for the row's x of `in` (called on the thread that writes the row).
template <class T, class Probability>
void cross_entropy_backward_rows(const cpu& be, T* g_all, const T* in_all, const std::int32_t* target_data,
                                 const CrossEntropyDims& dims, std::int64_t vocab_begin, accumulate_t<T> scale,
                                 Probability probability) {
  using A = accumulate_t<T>;
  const std::int64_t N = dims.rows, Vs = dims.slice_columns, real = dims.real_columns;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * Vs >= parallel_min_elements)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* x = in_all + n * Vs;
    T* g = g_all + n * Vs;  // may be x
    if (target_data[n] < 0) {
      gradient_row(g, Vs, real, -1, true, scale, [](std::int64_t) { return A(0); });
      continue;
    }
    // Everything `p` reads of x is read here, before g (maybe x) is written.
    const auto p = probability(n, x);
    gradient_row(g, Vs, real, static_cast<std::int64_t>(target_data[n]) - vocab_begin, false, scale, p);
  }
}

}  // namespace loom::detail::vocab_parallel

namespace loom::inline kernels {

//! Vocabulary-parallel cross-entropy backward from probabilities: WRITES (does not accumulate)
//! `dlogits` [N, Vs] = scale * (probs - onehot(target)) on this slice's real columns (the one-hot
//! only on the rank whose slice holds the target), 0 on padding and on rows whose target is
//! negative. `dlogits` may alias `probs`. `scale` is d(total loss)/d(per-row loss).
template <class T>
void vocab_parallel_cross_entropy_backward(const cpu& be, Tensor<T> dlogits, Tensor<const T> probs,
                                           Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                           std::int64_t vocab, accumulate_t<T> scale) {
  namespace d = detail::vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_backward";
  const d::CrossEntropyDims dims = d::check_backward(dlogits, probs, targets, vocab_begin, vocab, kernel);
  d::check_target_values(targets, vocab, kernel);
  d::cross_entropy_backward_rows(be, dlogits.data(), probs.data(), targets.data(), dims, vocab_begin, scale,
                                 [](std::int64_t, const T* x) {
                                   return [x](std::int64_t i) { return to_accumulate(x[i]); };
                                 });
}

//! Vocabulary-parallel cross-entropy backward from the `logits` [N, Vs] and the group's row
//! statistics, `row_max` [N] and `partials` [2, N] (vocab_parallel_cross_entropy_statistics): the
//! probabilities p = exp(logit - row_max) · (1 / sum), the exps as step 1 computed them and the
//! factor rounded once to the accumulate type, each p rounded once to T, then the backward above
//! on them, in one pass over [N, Vs]. `dlogits` may alias `logits`.
//!
//! `gradient_scale` [1] (or empty) says what `logits` hold: 0, the logits; s != 0, already the
//! gradient at scale s (cross_entropy_forward_backward wrote it), which then needs `dlogits` to be
//! `logits` and is left as it is where s == scale, else multiplied by scale / s.
template <class T>
void vocab_parallel_cross_entropy_backward(const cpu& be, Tensor<T> dlogits, Tensor<const T> logits,
                                           Tensor<const double> row_max, Tensor<const double> partials,
                                           Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                           std::int64_t vocab, accumulate_t<T> scale,
                                           Tensor<const double> gradient_scale = {}) {
  namespace d = detail::vocab_parallel;
  using A = accumulate_t<T>;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_backward";
  const d::CrossEntropyDims dims =
      d::check_backward_from_logits(dlogits, logits, row_max, partials, targets, vocab_begin, vocab, kernel);
  d::check_gradient_scale(gradient_scale, dlogits, logits, kernel);
  d::check_target_values(targets, vocab, kernel);
  if (!gradient_scale.empty() && gradient_scale[0] != 0.0) {
    if (static_cast<double>(scale) != gradient_scale[0])
      kernels::scale<T>(be, dlogits, static_cast<double>(scale) / gradient_scale[0]);
    return;
  }
  const std::int64_t real = dims.real_columns;
  const double* m = row_max.data();
  const double* sums = partials.data();
  d::AlignedRows<A> scratch(be.threads(), real);
  d::cross_entropy_backward_rows(be, dlogits.data(), logits.data(), targets.data(), dims, vocab_begin, scale,
                                 [&](std::int64_t n, const T* x) {
                                   A* exps = scratch.at(detail::thread_index());
                                   d::shifted_exps(x, static_cast<A>(m[n]), exps, real);
                                   return d::logit_probabilities<T>(exps, sums[n]);
                                 });
}

//! Cross-entropy over one slice that holds the whole vocabulary (a group of one: vocab_begin 0),
//! with its gradient, for a forward whose backward follows: per row, the statistics of
//! vocab_parallel_cross_entropy_statistics into `row_max` [N] and `partials` [2, N], the loss of
//! vocab_parallel_cross_entropy_losses into `losses` [N], and dlogits = scale (p - onehot(target))
//! of vocab_parallel_cross_entropy_backward from the logits, written over `logits` [N, V] (0 on
//! padding and on ignored rows). The same bits as those three kernels, from one read of each row
//! (in cache for the gradient) and one evaluation of its exps instead of two. `gradient_scale` [1]
//! gets `scale`: the backward from the logits then leaves the gradient as it is.
template <class T>
void cross_entropy_forward_backward(const cpu& be, Tensor<accumulate_t<T>> losses, Tensor<double> row_max,
                                    Tensor<double> partials, Tensor<T> logits, Tensor<const std::int32_t> targets,
                                    std::int64_t vocab, accumulate_t<T> scale, Tensor<double> gradient_scale) {
  namespace d = detail::vocab_parallel;
  using A = accumulate_t<T>;
  constexpr const char* kernel = "cross_entropy_forward_backward";
  const d::CrossEntropyDims dims = d::check_forward_backward(losses, row_max, partials, logits, targets, vocab,
                                                             scale, gradient_scale, kernel);
  d::check_target_values(targets, vocab, kernel);
  const std::int64_t N = dims.rows, V = dims.slice_columns, real = dims.real_columns;
  const std::int32_t* target_data = targets.data();
  d::AlignedRows<A> scratch(be.threads(), real);
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * V >= d::parallel_min_elements)
  for (std::int64_t n = 0; n < N; ++n) {
    T* x = logits.data() + n * V;
    const std::int32_t target = target_data[n];
    // The statistics' and the losses' expressions, in their order.
    const double target_logit = target >= 0 && target < real ? static_cast<double>(to_accumulate(x[target])) : 0.0;
    partials.data()[N + n] = target_logit;
    A* exps = scratch.at(detail::thread_index());
    const d::RowStatistics r = d::row_statistics(x, real, exps);
    row_max.data()[n] = r.max;
    partials.data()[n] = r.sum;
    losses.data()[n] = target >= 0 ? static_cast<A>(std::log(r.sum) - (target_logit - r.max)) : A(0);
    // The backward's, from the same exps (none where the row is ignored).
    d::gradient_row(x, V, real, target, target < 0, scale, d::logit_probabilities<T>(exps, r.sum));
  }
  gradient_scale[0] = static_cast<double>(scale);
}

//! The rows a loss predicts, for a head that computes only those (bert::Config::
//! logits_at_every_position false): rows[0, M) = the indices n of `targets` [N] with
//! targets[n] >= 0, in increasing order, and row_targets[0, M) = their targets. Returns M, on the
//! host. `rows` and `row_targets` have room for R rows each (R = rows.numel()); where M > R only
//! the first R are written (the caller compares the count with its room); those from M on are
//! left as they were.
inline std::int64_t select_target_rows(const cpu& be, Tensor<std::int32_t> rows, Tensor<std::int32_t> row_targets,
                                       Tensor<const std::int32_t> targets) {
  const std::int64_t N = targets.numel(), room = rows.numel();
  check_numel(row_targets, room, "select_target_rows", "row_targets");
  std::int64_t count = 0;
  for (std::int64_t n = 0; n < N; ++n) {
    if (targets.data()[n] < 0) continue;
    if (count < room) {
      rows.data()[count] = static_cast<std::int32_t>(n);
      row_targets.data()[count] = targets.data()[n];
    }
    ++count;
  }
  return count;
}

}  // namespace loom::inline kernels
