#pragma once
//! \file Fused softmax + cross-entropy over a (possibly padded) vocabulary on the CPU backend.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/sum.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cross_entropy {

//! Rows and padded row length of `logits`: all leading axes are rows ([N,Vp] or [B,T,Vp]).
struct Dims {
  std::int64_t rows, padded_vocab;
};

using loom::detail::sum_as_double;

template <class T>
Dims check(const Tensor<T>& logits, const Tensor<const std::int32_t>& targets, std::int64_t vocab,
           const char* kernel, const char* logits_name) {
  if (logits.shape().rank() < 1)
    throw Error(std::string(kernel) + ": argument " + logits_name + " shape", logits.shape(),
                "expected [N, Vp] (rank >= 1)");
  const Dims d{logits.shape().rows(), logits.shape().cols()};
  if (vocab < 1 || vocab > d.padded_vocab)
    throw Error(std::string(kernel) + ": argument vocab", vocab,
                "must be in [1, Vp] with Vp = " + detail::to_text(d.padded_vocab));
  check_numel(targets, d.rows, kernel, "targets");
  // Checked up front: an exception cannot leave an OpenMP region.
  for (std::int64_t n = 0; n < d.rows; ++n)
    if (targets[n] >= vocab) [[unlikely]]
      throw Error(std::string(kernel) + ": targets[" + detail::to_text(n) + "]", targets[n],
                  "must be < vocab (" + detail::to_text(vocab) + "), or negative to ignore the row");
  return d;
}

}  // namespace loom::detail::cross_entropy

namespace loom::inline kernels {

//! Softmax + cross-entropy forward. `logits` [N,Vp] (any leading axes count as rows); only the
//! first `vocab` columns are real. Writes `probs` [N,Vp] = softmax over the real columns with
//! padded columns 0 (`probs` may alias `logits`), and `losses` [N] = -log probs[n, targets[n]],
//! 0 where targets[n] < 0. Throws loom::Error naming the row and value of a target >= vocab.
template <class T>
void softmax_cross_entropy_forward(const cpu& be, Tensor<T> losses, Tensor<T> probs,
                                   Tensor<const T> logits, Tensor<const std::int32_t> targets,
                                   std::int64_t vocab) {
  static_assert(!is_narrow_storage<T>, "loom: softmax_cross_entropy_forward takes float or double; for bf16 use "
                                       "the vocab_parallel_cross_entropy kernels (one slice for the whole vocabulary)");
  namespace ce = detail::cross_entropy;
  constexpr const char* kernel = "softmax_cross_entropy_forward";
  const auto d = ce::check(logits, targets, vocab, kernel, "logits");
  check_shape(probs, logits.shape(), kernel, "probs");
  check_numel(losses, d.rows, kernel, "losses");
  const std::int64_t Vp = d.padded_vocab;
  const T* logits_data = logits.data();
  T* probs_data = probs.data();
  T* losses_data = losses.data();
  const std::int32_t* target_data = targets.data();

#pragma omp parallel for num_threads(be.threads()) schedule(static)
  for (std::int64_t n = 0; n < d.rows; ++n) {
    const T* x = logits_data + n * Vp;
    T* p = probs_data + n * Vp;  // may be x: each element is read before it is written
    const std::int32_t target = target_data[n];
    const Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>> row(x, vocab);
    Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>> prob(p, vocab);
    const T max = row.maxCoeff();
    // Read before p overwrites it; the loss is log(sum) - (x_target - max), in double, so that
    // it stays exact where the probability underflows.
    const double shifted_target = target >= 0 ? static_cast<double>(x[target]) - max : 0.0;
    prob = (row - max).exp();  // element-wise, so p == x is fine
    const double sum = ce::sum_as_double(p, vocab);
    prob *= static_cast<T>(1.0 / sum);
    std::fill(p + vocab, p + Vp, T(0));
    losses_data[n] = target >= 0 ? static_cast<T>(std::log(sum) - shifted_target) : T(0);
  }
}

//! Softmax + cross-entropy backward: WRITES (does not accumulate) `dlogits` [N,Vp] =
//! scale * (probs - onehot(target)) on the real columns, 0 on padded columns and on rows whose
//! target is negative. `dlogits` may alias `probs`. `scale` is d(total loss)/d(per-row loss).
template <class T>
void softmax_cross_entropy_backward(const cpu& be, Tensor<T> dlogits, Tensor<const T> probs,
                                    Tensor<const std::int32_t> targets, std::int64_t vocab,
                                    T scale) {
  static_assert(!is_narrow_storage<T>, "loom: softmax_cross_entropy_backward takes float or double; for bf16 use "
                                       "vocab_parallel_cross_entropy_backward");
  namespace ce = detail::cross_entropy;
  constexpr const char* kernel = "softmax_cross_entropy_backward";
  const auto d = ce::check(probs, targets, vocab, kernel, "probs");
  check_shape(dlogits, probs.shape(), kernel, "dlogits");
  const std::int64_t Vp = d.padded_vocab;
  const T* probs_data = probs.data();
  T* dlogits_data = dlogits.data();
  const std::int32_t* target_data = targets.data();

#pragma omp parallel for num_threads(be.threads()) schedule(static)
  for (std::int64_t n = 0; n < d.rows; ++n) {
    const T* p = probs_data + n * Vp;
    T* g = dlogits_data + n * Vp;  // may be p
    const std::int32_t target = target_data[n];
    if (target < 0) {
      std::fill(g, g + Vp, T(0));
      continue;
    }
    const T target_prob = p[target];  // read before g (maybe p) is written
    for (std::int64_t i = 0; i < vocab; ++i) g[i] = scale * p[i];
    g[target] = scale * (target_prob - T(1));
    std::fill(g + vocab, g + Vp, T(0));
  }
}

}  // namespace loom::inline kernels
