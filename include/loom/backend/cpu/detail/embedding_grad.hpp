#pragma once
//! \file The embedding backward both CPU embedding kernels share (the whole vocabulary, or one
//! rank's slice of it): threads take blocks of channels; within a block each gradient row sums
//! its contributions from its old value in (b, t) order in the accumulate type and is rounded
//! once. No two threads touch one element, so the result is the same bits for any thread count.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/core/accumulate.hpp"

namespace loom::detail::embedding_grad {

//! Channels per task.
inline constexpr std::int64_t column_block = 64;
//! Below this many elements the backward stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 14;

//! dte[ids[bt] - vocab_begin] += dout[bt] for the ids in [vocab_begin, vocab_begin + slice_rows),
//! and dpe[t] += sum over b of dout[b, t] where `dpe` is not null; dout is [B * Tn, C]. The
//! gradients are of T, or fp32 sums of a bf16 layer's (G = float: the sums stored unrounded).
template <class T, GradientOf<T> G>
void accumulate(const cpu& be, G* dte, std::int64_t vocab_begin, std::int64_t slice_rows, G* dpe,
                const T* dout, const std::int32_t* ids, std::int64_t B, std::int64_t Tn, std::int64_t C) {
  using A = accumulate_t<T>;
  const std::int64_t rows = B * Tn;
  // The (b, t) rows of the slice's tokens, grouped by token and in (b, t) order within a token.
  std::vector<std::int64_t> order;
  for (std::int64_t bt = 0; bt < rows; ++bt) {
    const std::int64_t local = static_cast<std::int64_t>(ids[bt]) - vocab_begin;
    if (local >= 0 && local < slice_rows) order.push_back(bt);
  }
  std::stable_sort(order.begin(), order.end(), [ids](std::int64_t x, std::int64_t y) { return ids[x] < ids[y]; });
  const auto count = static_cast<std::int64_t>(order.size());
  const std::int64_t* sorted = order.data();
  const std::int64_t blocks = (C + column_block - 1) / column_block;
#pragma omp parallel for num_threads(be.threads()) schedule(static) \
    if (blocks > 1 && rows * C >= parallel_min_elements)
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    const std::int64_t j0 = blk * column_block, width = std::min(C, j0 + column_block) - j0;
    A sum[column_block];
    for (std::int64_t start = 0, end = 0; start < count; start = end) {
      const std::int32_t id = ids[sorted[start]];
      G* row = dte + (static_cast<std::int64_t>(id) - vocab_begin) * C + j0;
      widen_into(row, sum, width);
      for (end = start; end < count && ids[sorted[end]] == id; ++end) {
        const T* g = dout + sorted[end] * C + j0;
        for (std::int64_t j = 0; j < width; ++j) sum[j] += to_accumulate(g[j]);
      }
      narrow_into(sum, row, width);
    }
    if (dpe == nullptr) continue;
    for (std::int64_t t = 0; t < Tn; ++t) {
      G* row = dpe + t * C + j0;
      widen_into(row, sum, width);
      for (std::int64_t b = 0; b < B; ++b) {
        const T* g = dout + (b * Tn + t) * C + j0;
        for (std::int64_t j = 0; j < width; ++j) sum[j] += to_accumulate(g[j]);
      }
      narrow_into(sum, row, width);
    }
  }
}

}  // namespace loom::detail::embedding_grad
