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
#include <cstdint>
#include <limits>
#include <string>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/embedding_grad.hpp"
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/backend/cpu/detail/sum.hpp"
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
//! gets its whole gradient). Deterministic for any thread count.
template <class T>
void vocab_parallel_embedding_backward(const cpu& be, Tensor<T> dwte_slice, std::int64_t vocab_begin,
                                       Tensor<T> dwpe, Tensor<const T> dout,
                                       Tensor<const std::int32_t> tokens) {
  namespace d = detail::vocab_parallel;
  const d::EmbeddingDims dims = d::check_embedding(dout, tokens, dwte_slice, vocab_begin, dwpe,
                                                   "vocab_parallel_embedding_backward", "dout", "dwte_slice", "dwpe");
  detail::embedding_grad::accumulate(be, dwte_slice.data(), vocab_begin, dwte_slice.extent(0), dwpe.data(),
                                     dout.data(), tokens.data(), dims.batch, dims.seq, dims.channels);
}

//! Vocabulary-parallel cross-entropy, step 1 of 3: row_max[n] = the largest logits[n, j] over
//! this slice's real columns (vocab_begin + j < vocab), or the lowest double where the slice
//! has none (all padding). The caller then all-reduces `row_max` [N] with max over the group.
template <class T>
void vocab_parallel_cross_entropy_max(const cpu& be, Tensor<double> row_max, Tensor<const T> logits,
                                      std::int64_t vocab_begin, std::int64_t vocab) {
  namespace d = detail::vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_max";
  const d::CrossEntropyDims dims = d::check_max(row_max, logits, vocab_begin, vocab, kernel);
  const std::int64_t Vs = dims.slice_columns, real = dims.real_columns;
  const T* x_all = logits.data();
  double* m = row_max.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (dims.rows * Vs >= d::parallel_min_elements)
  for (std::int64_t n = 0; n < dims.rows; ++n)
    m[n] = real > 0 ? static_cast<double>(d::row_max(x_all + n * Vs, real)) : std::numeric_limits<double>::lowest();
}

//! Vocabulary-parallel cross-entropy, step 2 of 3, given the global `row_max` [N]: writes
//! exps[n,j] = exp(logits[n,j] - row_max[n]) on the real columns and 0 on padding (`exps` may
//! alias `logits`), and `partials` [2, N]: row 0 the slice's sum of exps (in double), row 1
//! logits[n, target - vocab_begin] - row_max[n] where this slice holds row n's target, else 0.
//! The caller then all-reduces `partials` with sum over the group.
template <class T>
void vocab_parallel_cross_entropy_partials(const cpu& be, Tensor<T> exps, Tensor<double> partials,
                                           Tensor<const T> logits, Tensor<const double> row_max,
                                           Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                           std::int64_t vocab) {
  namespace d = detail::vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_partials";
  const d::CrossEntropyDims dims =
      d::check_partials(exps, partials, logits, row_max, targets, vocab_begin, vocab, kernel);
  d::check_target_values(targets, vocab, kernel);
  using A = accumulate_t<T>;
  const std::int64_t N = dims.rows, Vs = dims.slice_columns, real = dims.real_columns;
  const T* x_all = logits.data();
  T* e_all = exps.data();
  const double* m = row_max.data();
  double* sums = partials.data();
  double* shifted_targets = partials.data() + N;
  const std::int32_t* target_data = targets.data();
  // bf16: each row's logits widened to float, their exps computed and summed in float before
  // the one rounding.
  detail::Staging<T> staging(be.threads(), real);
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * Vs >= d::parallel_min_elements)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* x = x_all + n * Vs;
    T* e = e_all + n * Vs;  // may be x: each element is read before it is written
    const std::int64_t local_target = static_cast<std::int64_t>(target_data[n]) - vocab_begin;
    // As softmax_cross_entropy_forward: the target logit is read before e may overwrite it, and
    // shifted in double, so that the loss stays exact where its probability underflows.
    shifted_targets[n] = target_data[n] >= 0 && local_target >= 0 && local_target < real
                             ? static_cast<double>(to_accumulate(x[local_target])) - m[n]
                             : 0.0;
    A* stage = staging.at(detail::thread_index());
    const A* xs = detail::load(x, stage, real);
    A* es = detail::output(e, stage);  // in place: each element is read before it is written
    if (real > 0) {
      const A max = static_cast<A>(m[n]);  // exact: the global max is one of the logits
      Eigen::Map<Eigen::Array<A, Eigen::Dynamic, 1>>(es, real) =
          (Eigen::Map<const Eigen::Array<A, Eigen::Dynamic, 1>>(xs, real) - max).exp();
    }
    sums[n] = detail::sum_as_double(es, real);
    detail::store(e, es, real);
    std::fill(e + real, e + Vs, T(0));
  }
}

//! Vocabulary-parallel cross-entropy, step 3 of 3 without the probabilities: the `losses` [N] of
//! vocab_parallel_cross_entropy_finish from the group's summed `partials` [2, N] alone. A head
//! that leaves step 2's exps in place for the backward (vocab_parallel_cross_entropy_backward
//! from the exps) spares finish's pass over [N, Vs].
template <class T>
void vocab_parallel_cross_entropy_losses(const cpu&, Tensor<accumulate_t<T>> losses, Tensor<const double> partials,
                                         Tensor<const std::int32_t> targets) {
  using A = accumulate_t<T>;
  const std::int64_t N =
      detail::vocab_parallel::check_losses(losses, partials, targets, "vocab_parallel_cross_entropy_losses");
  const double* sums = partials.data();
  const double* shifted_targets = partials.data() + N;
  for (std::int64_t n = 0; n < N; ++n)
    losses.data()[n] = targets.data()[n] >= 0 ? static_cast<A>(std::log(sums[n]) - shifted_targets[n]) : A(0);
}

//! Vocabulary-parallel cross-entropy, step 3 of 3, given the group's summed `partials` [2, N]:
//! probs[n, :] = exps[n, :] / sum[n] in place (`probs` holds the exps of step 2), and
//! losses[n] = log(sum[n]) - shifted_target[n], 0 where targets[n] < 0, in the accumulate type
//! (float for bf16 probabilities; vocab_parallel_cross_entropy_losses). Every rank of the group
//! computes the same losses.
template <class T>
void vocab_parallel_cross_entropy_finish(const cpu& be, Tensor<accumulate_t<T>> losses, Tensor<T> probs,
                                         Tensor<const double> partials, Tensor<const std::int32_t> targets) {
  using A = accumulate_t<T>;
  namespace d = detail::vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_finish";
  const d::FinishDims dims = d::check_finish(losses, probs, partials, targets, kernel);
  const std::int64_t N = dims.rows, Vs = dims.columns;
  T* p_all = probs.data();
  const double* sums = partials.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * Vs >= d::parallel_min_elements)
  for (std::int64_t n = 0; n < N; ++n) {
    const A factor = static_cast<A>(1.0 / sums[n]);
    T* p = p_all + n * Vs;
    for (std::int64_t j = 0; j < Vs; ++j) p[j] = static_cast<T>(to_accumulate(p[j]) * factor);
  }
  vocab_parallel_cross_entropy_losses<T>(be, losses, partials, targets);
}

}  // namespace loom::inline kernels

namespace loom::detail::vocab_parallel {

//! The backward of both vocab_parallel_cross_entropy_backward overloads: dlogits = scale (p -
//! onehot) with p = T(x · factor) for the row's x of `in` (factor = 1 / sum where `sums` is given,
//! else 1: then p = x exactly).
template <class T>
void cross_entropy_backward_rows(const cpu& be, T* g_all, const T* in_all, const double* sums,
                                 const std::int32_t* target_data, const CrossEntropyDims& dims,
                                 std::int64_t vocab_begin, accumulate_t<T> scale) {
  using A = accumulate_t<T>;
  const std::int64_t N = dims.rows, Vs = dims.slice_columns, real = dims.real_columns;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * Vs >= parallel_min_elements)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* x = in_all + n * Vs;
    T* g = g_all + n * Vs;  // may be x
    if (target_data[n] < 0) {
      std::fill(g, g + Vs, T(0));
      continue;
    }
    // finish's factor and rounding: the probabilities it would have stored.
    const A factor = sums != nullptr ? static_cast<A>(1.0 / sums[n]) : A(1);
    const auto probability = [&](std::int64_t i) { return to_accumulate(static_cast<T>(to_accumulate(x[i]) * factor)); };
    const std::int64_t local_target = static_cast<std::int64_t>(target_data[n]) - vocab_begin;
    const bool owns_target = local_target >= 0 && local_target < real;
    const A target_prob = owns_target ? probability(local_target) : A(0);  // read before g (maybe x) is written
    for (std::int64_t i = 0; i < real; ++i) g[i] = static_cast<T>(scale * probability(i));
    if (owns_target) g[local_target] = static_cast<T>(scale * (target_prob - A(1)));
    std::fill(g + real, g + Vs, T(0));
  }
}

}  // namespace loom::detail::vocab_parallel

namespace loom::inline kernels {

//! Vocabulary-parallel cross-entropy backward: WRITES (does not accumulate) `dlogits` [N, Vs] =
//! scale * (probs - onehot(target)) on this slice's real columns (the one-hot only on the rank
//! whose slice holds the target), 0 on padding and on rows whose target is negative.
//! `dlogits` may alias `probs`. `scale` is d(total loss)/d(per-row loss).
template <class T>
void vocab_parallel_cross_entropy_backward(const cpu& be, Tensor<T> dlogits, Tensor<const T> probs,
                                           Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                           std::int64_t vocab, accumulate_t<T> scale) {
  namespace d = detail::vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_backward";
  const d::CrossEntropyDims dims = d::check_backward(dlogits, probs, targets, vocab_begin, vocab, kernel);
  d::check_target_values(targets, vocab, kernel);
  d::cross_entropy_backward_rows(be, dlogits.data(), probs.data(), nullptr, targets.data(), dims, vocab_begin, scale);
}

//! Vocabulary-parallel cross-entropy backward from step 2's `exps` [N, Vs] and the group's summed
//! `partials` [2, N] (vocab_parallel_cross_entropy_losses in the forward, not finish): the
//! probabilities finish would have written, exps · (1 / sum) rounded to T, then the backward above
//! on them: the same bits as finish then the backward, one pass over [N, Vs] instead of two.
//! `dlogits` may alias `exps`.
template <class T>
void vocab_parallel_cross_entropy_backward(const cpu& be, Tensor<T> dlogits, Tensor<const T> exps,
                                           Tensor<const double> partials, Tensor<const std::int32_t> targets,
                                           std::int64_t vocab_begin, std::int64_t vocab, accumulate_t<T> scale) {
  namespace d = detail::vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_backward";
  const d::CrossEntropyDims dims = d::check_backward(dlogits, exps, targets, vocab_begin, vocab, kernel, "exps");
  check_numel(partials, 2 * dims.rows, kernel, "partials");
  d::check_target_values(targets, vocab, kernel);
  d::cross_entropy_backward_rows(be, dlogits.data(), exps.data(), partials.data(), targets.data(), dims,
                                 vocab_begin, scale);
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
