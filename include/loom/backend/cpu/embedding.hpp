#pragma once
//! \file Token plus position embedding (GPT-2) on the CPU backend. The backward parallelises
//! over blocks of channels, so that no two threads ever touch one gradient element and every
//! element sums its contributions in (b, t) order whatever the thread count.

#include <algorithm>
#include <cstdint>
#include <string>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/embedding_grad.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::embedding {

//! Below this many elements a kernel stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 14;

//! Checks tokens [B, T] against the vocabulary (wte rows) and the position table (wpe rows);
//! a bad token names its position, its value and the rule.
inline void check_tokens(const Tensor<const std::int32_t>& tokens, std::int64_t vocab,
                         std::int64_t max_positions, const char* kernel) {
  if (tokens.shape().rank() != 2)
    throw Error(std::string(kernel) + ": argument tokens shape", tokens.shape(),
                "expected [B, T] (rank 2)");
  const std::int64_t B = tokens.extent(0), T = tokens.extent(1);
  if (T > max_positions)
    throw Error(std::string(kernel) + ": argument tokens sequence length T", T,
                "must be <= the rows of wpe (" + detail::to_text(max_positions) + ")");
  const std::int32_t* ids = tokens.data();
  for (std::int64_t i = 0; i < B * T; ++i)
    if (ids[i] < 0 || ids[i] >= vocab) [[unlikely]]
      throw Error(std::string(kernel) + ": token at tokens[" + detail::to_text(i / T) + ", " +
                      detail::to_text(i % T) + "]",
                  ids[i],
                  "token ids must be in [0, " + detail::to_text(vocab) + ") (the rows of wte)");
}

template <class T>
void check_table(const Tensor<T>& table, const char* kernel, const char* arg) {
  if (table.shape().rank() != 2)
    throw Error(std::string(kernel) + ": argument " + arg + " shape", table.shape(),
                "expected a [rows, C] table (rank 2)");
}

}  // namespace loom::detail::embedding

namespace loom::detail::embedding {

struct Dims {
  std::int64_t batch, seq, channels;
};

//! The checks both directions share: token table [V, C], position table [maxT, C], tokens
//! [B, T] valid for both, and the hidden tensor (`out` or `dout`) [B, T, C].
template <class H, class E>
Dims check_arguments(const Tensor<H>& hidden, const Tensor<const std::int32_t>& tokens,
                     const Tensor<E>& tokens_table, const Tensor<E>& positions_table,
                     const char* kernel, const char* hidden_name, const char* tokens_table_name,
                     const char* positions_table_name) {
  check_table(tokens_table, kernel, tokens_table_name);
  check_table(positions_table, kernel, positions_table_name);
  const std::int64_t C = tokens_table.extent(1);
  check_shape(positions_table, Shape{positions_table.extent(0), C}, kernel, positions_table_name);
  check_tokens(tokens, tokens_table.extent(0), positions_table.extent(0), kernel);
  const std::int64_t B = tokens.extent(0), Tn = tokens.extent(1);
  check_shape(hidden, Shape{B, Tn, C}, kernel, hidden_name);
  return {B, Tn, C};
}

}  // namespace loom::detail::embedding

namespace loom::inline kernels {

//! out[b,t,:] = wte[tokens[b,t], :] + wpe[t, :]. `tokens` [B,T] holds ids in [0, wte rows);
//! wte [V,C], wpe [maxT,C] with T <= maxT, out [B,T,C]. A bad token throws loom::Error.
template <class T>
void embedding_forward(const cpu& be, Tensor<T> out, Tensor<const std::int32_t> tokens,
                       Tensor<const T> wte, Tensor<const T> wpe) {
  namespace d = detail::embedding;
  // Plain variables, not structured bindings: OpenMP regions below must capture them.
  const d::Dims dims = d::check_arguments(out, tokens, wte, wpe, "embedding_forward", "out", "wte", "wpe");
  const std::int64_t B = dims.batch, Tn = dims.seq, C = dims.channels;

  const std::int32_t* ids = tokens.data();
  const T* te = wte.data();
  const T* pe = wpe.data();
  T* o_all = out.data();
  const std::int64_t rows = B * Tn;
#pragma omp parallel for num_threads(be.threads()) schedule(static) \
    if (rows * C >= d::parallel_min_elements)
  for (std::int64_t bt = 0; bt < rows; ++bt) {
    const T* token_row = te + static_cast<std::int64_t>(ids[bt]) * C;
    const T* position_row = pe + (bt % Tn) * C;
    T* o = o_all + bt * C;
    for (std::int64_t i = 0; i < C; ++i)
      o[i] = static_cast<T>(to_accumulate(token_row[i]) + to_accumulate(position_row[i]));
  }
}

//! Backward of embedding_forward, accumulating: dwte[tokens[b,t]] += dout[b,t],
//! dwpe[t] += sum over b of dout[b,t]. Deterministic for any thread count.
template <class T>
void embedding_backward(const cpu& be, Tensor<T> dwte, Tensor<T> dwpe, Tensor<const T> dout,
                        Tensor<const std::int32_t> tokens) {
  namespace d = detail::embedding;
  // Plain variables, not structured bindings: OpenMP regions below must capture them.
  const d::Dims dims = d::check_arguments(dout, tokens, dwte, dwpe, "embedding_backward", "dout", "dwte", "dwpe");
  const std::int64_t B = dims.batch, Tn = dims.seq, C = dims.channels;

  detail::embedding_grad::accumulate(be, dwte.data(), 0, dwte.extent(0), dwpe.data(), dout.data(), tokens.data(),
                                     B, Tn, C);
}

}  // namespace loom::inline kernels
