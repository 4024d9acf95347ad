#pragma once
//! \file Shape checks of the vocabulary-parallel embedding and cross-entropy kernels (host code
//! only, no Eigen), shared by the CPU and CUDA backends so that both reject a bad argument with
//! the same words. They never read token or target ids: on the CUDA backend those live in device
//! memory. The CPU kernels check the id values as well (backend/cpu/vocab_parallel.hpp).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::vocab_parallel {

struct EmbeddingDims {
  std::int64_t batch, seq, channels;
};

//! tokens [B, T], slice [rows, C], optional positions [maxT >= T, C], 0 <= vocab_begin; the
//! hidden tensor [B, T, C] is the caller's next check (check_embedding_shapes).
template <class E>
EmbeddingDims embedding_dims(const Tensor<const std::int32_t>& tokens, const Tensor<E>& slice,
                             std::int64_t vocab_begin, const Tensor<E>& positions, const char* kernel,
                             const char* slice_name, const char* positions_name) {
  if (tokens.shape().rank() != 2)
    throw Error(std::string(kernel) + ": argument tokens shape", tokens.shape(), "expected [B, T] (rank 2)");
  if (slice.shape().rank() != 2)
    throw Error(std::string(kernel) + ": argument " + slice_name + " shape", slice.shape(),
                "expected a [rows, C] slice of the token table (rank 2)");
  if (vocab_begin < 0)
    throw Error(std::string(kernel) + ": argument vocab_begin", vocab_begin, "must be >= 0");
  const std::int64_t B = tokens.extent(0), Tn = tokens.extent(1), C = slice.extent(1);
  if (!positions.empty()) {
    check_shape(positions, Shape{positions.extent(0), C}, kernel, positions_name);
    if (Tn > positions.extent(0))
      throw Error(std::string(kernel) + ": argument tokens sequence length T", Tn,
                  "must be <= the rows of " + std::string(positions_name) + " (" +
                      detail::to_text(positions.extent(0)) + ")");
  }
  return {B, Tn, C};
}

//! Every shape check of the embedding kernels: embedding_dims, then hidden [B, T, C].
template <class H, class E>
EmbeddingDims check_embedding_shapes(const Tensor<H>& hidden, const Tensor<const std::int32_t>& tokens,
                                     const Tensor<E>& slice, std::int64_t vocab_begin, const Tensor<E>& positions,
                                     const char* kernel, const char* hidden_name, const char* slice_name,
                                     const char* positions_name) {
  const EmbeddingDims dims = embedding_dims(tokens, slice, vocab_begin, positions, kernel, slice_name, positions_name);
  check_shape(hidden, Shape{dims.batch, dims.seq, dims.channels}, kernel, hidden_name);
  return dims;
}

struct CrossEntropyDims {
  std::int64_t rows, slice_columns, real_columns;  //!< real_columns: those with global id < vocab
};

//! logits [N, Vs] (leading axes are rows), 0 <= vocab_begin, 1 <= vocab; the slice's real
//! columns are those with vocab_begin + j < vocab (possibly none).
template <class T>
CrossEntropyDims check_slice(const Tensor<T>& logits, std::int64_t vocab_begin, std::int64_t vocab,
                             const char* kernel, const char* logits_name) {
  if (logits.shape().rank() < 1)
    throw Error(std::string(kernel) + ": argument " + logits_name + " shape", logits.shape(),
                "expected [N, Vs] (rank >= 1)");
  if (vocab_begin < 0)
    throw Error(std::string(kernel) + ": argument vocab_begin", vocab_begin, "must be >= 0");
  if (vocab < 1) throw Error(std::string(kernel) + ": argument vocab", vocab, "must be >= 1");
  const std::int64_t rows = logits.shape().rows(), columns = logits.shape().cols();
  return {rows, columns, std::clamp<std::int64_t>(vocab - vocab_begin, 0, columns)};
}

//! vocab_parallel_cross_entropy_statistics: the slice, row_max [N], partials [2, N], N targets
//! (their values are the backend's to check, or not), and slice_max [N] or empty.
template <class T>
CrossEntropyDims check_statistics(const Tensor<double>& row_max, const Tensor<double>& partials,
                                  const Tensor<const T>& logits, const Tensor<const std::int32_t>& targets,
                                  std::int64_t vocab_begin, std::int64_t vocab, const Tensor<double>& slice_max,
                                  const char* kernel) {
  const CrossEntropyDims dims = check_slice(logits, vocab_begin, vocab, kernel, "logits");
  check_numel(row_max, dims.rows, kernel, "row_max");
  check_numel(partials, 2 * dims.rows, kernel, "partials");
  check_numel(targets, dims.rows, kernel, "targets");
  if (!slice_max.empty()) check_numel(slice_max, dims.rows, kernel, "slice_max");
  return dims;
}

//! vocab_parallel_cross_entropy_rebase: partials [2, N], slice_max [N] and row_max [N]; returns N.
inline std::int64_t check_rebase(const Tensor<double>& partials, const Tensor<const double>& slice_max,
                                 const Tensor<const double>& row_max, const char* kernel) {
  const std::int64_t N = row_max.numel();
  check_numel(partials, 2 * N, kernel, "partials");
  check_numel(slice_max, N, kernel, "slice_max");
  return N;
}

//! vocab_parallel_cross_entropy_losses: losses [N], row_max [N], partials [2, N] for the N
//! targets; returns N.
template <class L>
std::int64_t check_losses(const Tensor<L>& losses, const Tensor<const double>& row_max,
                          const Tensor<const double>& partials, const Tensor<const std::int32_t>& targets,
                          const char* kernel) {
  const std::int64_t N = targets.numel();
  check_numel(losses, N, kernel, "losses");
  check_numel(row_max, N, kernel, "row_max");
  check_numel(partials, 2 * N, kernel, "partials");
  return N;
}

//! vocab_parallel_cross_entropy_backward: the slice (`probs`, or the logits named `probs_name`),
//! dlogits shaped as it, N targets.
template <class T>
CrossEntropyDims check_backward(const Tensor<T>& dlogits, const Tensor<const T>& probs,
                                const Tensor<const std::int32_t>& targets, std::int64_t vocab_begin,
                                std::int64_t vocab, const char* kernel, const char* probs_name = "probs") {
  const CrossEntropyDims dims = check_slice(probs, vocab_begin, vocab, kernel, probs_name);
  check_shape(dlogits, probs.shape(), kernel, "dlogits");
  check_numel(targets, dims.rows, kernel, "targets");
  return dims;
}

//! The backward from the logits: check_backward, and the group's row_max [N] and partials [2, N].
template <class T>
CrossEntropyDims check_backward_from_logits(const Tensor<T>& dlogits, const Tensor<const T>& logits,
                                            const Tensor<const double>& row_max, const Tensor<const double>& partials,
                                            const Tensor<const std::int32_t>& targets, std::int64_t vocab_begin,
                                            std::int64_t vocab, const char* kernel) {
  const CrossEntropyDims dims = check_backward(dlogits, logits, targets, vocab_begin, vocab, kernel, "logits");
  check_numel(row_max, dims.rows, kernel, "row_max");
  check_numel(partials, 2 * dims.rows, kernel, "partials");
  return dims;
}

//! A gradient_scale of the backward from the logits: empty, or [1] with `dlogits` the same
//! memory as `logits` (a gradient already there is rescaled in place).
template <class T>
void check_gradient_scale(const Tensor<const double>& gradient_scale, const Tensor<T>& dlogits,
                          const Tensor<const T>& logits, const char* kernel) {
  if (gradient_scale.empty()) return;
  check_numel(gradient_scale, 1, kernel, "gradient_scale");
  if (static_cast<const void*>(dlogits.data()) != static_cast<const void*>(logits.data()))
    throw Error(std::string(kernel) + ": argument dlogits", "another tensor than logits",
                "with a gradient_scale, dlogits must be logits: a gradient already in the logits is kept in place");
}

//! cross_entropy_forward_backward: the logits [N, V >= vocab] of one slice holding the whole
//! vocabulary, losses [N], row_max [N], partials [2, N], N targets, gradient_scale [1] and a
//! scale that is neither 0 nor NaN.
template <class L, class T>
CrossEntropyDims check_forward_backward(const Tensor<L>& losses, const Tensor<double>& row_max,
                                        const Tensor<double>& partials, const Tensor<T>& logits,
                                        const Tensor<const std::int32_t>& targets, std::int64_t vocab, L scale,
                                        const Tensor<double>& gradient_scale, const char* kernel) {
  const CrossEntropyDims dims = check_slice(logits, 0, vocab, kernel, "logits");
  if (dims.real_columns != vocab)
    throw Error(std::string(kernel) + ": argument logits columns", dims.slice_columns,
                "must hold the whole vocabulary (" + detail::to_text(vocab) +
                    "): the fused kernel is for a group of one slice");
  check_numel(losses, dims.rows, kernel, "losses");
  check_numel(row_max, dims.rows, kernel, "row_max");
  check_numel(partials, 2 * dims.rows, kernel, "partials");
  check_numel(targets, dims.rows, kernel, "targets");
  check_numel(gradient_scale, 1, kernel, "gradient_scale");
  // gradient_scale records it: 0 would say "no gradient here", and NaN equals no scale.
  if (!(scale != L(0)) || std::isnan(static_cast<double>(scale)))
    throw Error(std::string(kernel) + ": argument scale", static_cast<double>(scale),
                "must be nonzero and not NaN (0 says that no backward follows: use the statistics kernel)");
  return dims;
}

}  // namespace loom::detail::vocab_parallel
