#pragma once
//! \file Causal multi-head self-attention (GPT-2) on the CPU backend: Eigen GEMMs per
//! (batch, head) over strided views of the packed qkv activations, in blocks of query rows so
//! that only the lower (causal) triangle of the score matrix is computed.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/array_map.hpp"
#include "loom/backend/cpu/detail/sum.hpp"
#include "loom/backend/detail/attention_checks.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace loom::detail::attention {

//! Query rows per GEMM block. Each block of rows [i0, i1) multiplies against keys [0, i1), so
//! a block wastes at most half a block of the upper triangle; 64 keeps the GEMMs large enough
//! for Eigen's kernels while computing ~(T/2 + 32)/T of the full score matrix.
inline constexpr std::int64_t block_rows = 64;

template <class T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
//! A row-major [rows, cols] slice whose rows are `stride` elements apart.
template <class T>
using Strided = Eigen::Map<RowMajor<T>, Eigen::Unaligned, Eigen::OuterStride<>>;
template <class T>
using ConstStrided = Eigen::Map<const RowMajor<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

//! Keeps Eigen single-threaded inside a kernel's parallel loop. Eigen already stays serial when
//! the team has more than one thread; for a one-thread team it would read omp_get_max_threads()
//! and could open a nested region. The setting is per OpenMP task, so it ends with the region.
inline void serial_gemm_in_this_task() noexcept {
#if defined(_OPENMP)
  omp_set_num_threads(1);
#endif
}

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

inline int thread_index() noexcept {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

}  // namespace loom::detail::attention

namespace loom::inline kernels {

//! Causal multi-head self-attention forward (GPT-2). `qkv` [B,T,3C] packs per token q, k, v
//! (each C wide; head h owns channels [h*hs, (h+1)*hs), hs = C/num_heads). Writes `att`
//! [B,NH,T,T], the softmax of q·k/sqrt(hs) over keys s <= t (entries s > t are 0), and `out`
//! [B,T,C], per head sum_s att[b,h,t,s] v[b,s], heads concatenated. Throws loom::Error on
//! shapes that do not match or a num_heads that does not divide C.
template <class T>
void attention_forward(const cpu& be, Tensor<T> out, Tensor<T> att, Tensor<const T> qkv,
                       int num_heads) {
  namespace ad = detail::attention;
  const ad::Dims d = ad::check_forward(out, att, qkv, num_heads);
  const std::int64_t B = d.batch, Tn = d.tokens, C = d.channels, NH = d.heads, hs = d.head_size;
  if (B == 0 || Tn == 0 || C == 0) return;

  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const T* qkv_data = qkv.data();
  T* att_data = att.data();
  T* out_data = out.data();

#pragma omp parallel num_threads(be.threads())
  {
    ad::serial_gemm_in_this_task();
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < B * NH; ++bh) {
      const std::int64_t b = bh / NH, h = bh % NH;
      const T* q_ptr = qkv_data + b * Tn * 3 * C + h * hs;
      const ad::ConstStrided<T> Q(q_ptr, Tn, hs, Eigen::OuterStride<>(3 * C));
      const ad::ConstStrided<T> K(q_ptr + C, Tn, hs, Eigen::OuterStride<>(3 * C));
      const ad::ConstStrided<T> V(q_ptr + 2 * C, Tn, hs, Eigen::OuterStride<>(3 * C));
      T* A = att_data + bh * Tn * Tn;
      ad::Strided<T> Att(A, Tn, Tn, Eigen::OuterStride<>(Tn));
      ad::Strided<T> O(out_data + b * Tn * C + h * hs, Tn, hs, Eigen::OuterStride<>(C));

      for (std::int64_t i0 = 0; i0 < Tn; i0 += ad::block_rows) {
        const std::int64_t i1 = std::min(Tn, i0 + ad::block_rows), n = i1 - i0;
        auto scores = Att.block(i0, 0, n, i1);
        scores.noalias() = Q.middleRows(i0, n) * K.topRows(i1).transpose();
        // Row softmax over s <= t, in place; scale > 0, so the raw max is the scaled max.
        for (std::int64_t t = i0; t < i1; ++t) {
          ad::ArrayMap<T> row(A + t * Tn, t + 1);
          const T max = row.maxCoeff();
          row = ((row - max) * scale).exp();  // Eigen's vectorised exp
          row *= static_cast<T>(1.0 / ad::sum_as_double(row.data(), t + 1));
          std::fill(A + t * Tn + t + 1, A + (t + 1) * Tn, T(0));
        }
        O.middleRows(i0, n).noalias() = scores * V.topRows(i1);
      }
    }
  }
}

//! Causal multi-head self-attention backward: `dqkv` [B,T,3C] += the gradient w.r.t. `qkv`
//! given `dout` [B,T,C] and the probabilities `att` [B,NH,T,T] saved by attention_forward.
//! Scratch is one [64, T] block per thread; nothing of size [B,NH,T,T] is allocated.
template <class T>
void attention_backward(const cpu& be, Tensor<T> dqkv, Tensor<const T> dout,
                        Tensor<const T> qkv, Tensor<const T> att, int num_heads) {
  namespace ad = detail::attention;
  const ad::Dims d = ad::check_backward(dqkv, dout, qkv, att, num_heads);
  const std::int64_t B = d.batch, Tn = d.tokens, C = d.channels, NH = d.heads, hs = d.head_size;
  if (B == 0 || Tn == 0 || C == 0) return;

  const T scale = T(1) / std::sqrt(static_cast<T>(hs));
  const std::int64_t rows = std::min(Tn, ad::block_rows);
  // Allocated here, not in the parallel region, so that a failed allocation throws normally.
  std::vector<T> scratch(static_cast<std::size_t>(be.threads() * rows * Tn));
  const T* qkv_data = qkv.data();
  const T* att_data = att.data();
  const T* dout_data = dout.data();
  T* dqkv_data = dqkv.data();

#pragma omp parallel num_threads(be.threads())
  {
    ad::serial_gemm_in_this_task();
    ad::Strided<T> work(scratch.data() + ad::thread_index() * rows * Tn, rows, Tn,
                        Eigen::OuterStride<>(Tn));
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < B * NH; ++bh) {
      const std::int64_t b = bh / NH, h = bh % NH;
      const std::int64_t offset = b * Tn * 3 * C + h * hs;
      const Eigen::OuterStride<> qkv_stride(3 * C);
      const ad::ConstStrided<T> Q(qkv_data + offset, Tn, hs, qkv_stride);
      const ad::ConstStrided<T> K(qkv_data + offset + C, Tn, hs, qkv_stride);
      const ad::ConstStrided<T> V(qkv_data + offset + 2 * C, Tn, hs, qkv_stride);
      ad::Strided<T> dQ(dqkv_data + offset, Tn, hs, qkv_stride);
      ad::Strided<T> dK(dqkv_data + offset + C, Tn, hs, qkv_stride);
      ad::Strided<T> dV(dqkv_data + offset + 2 * C, Tn, hs, qkv_stride);
      const ad::ConstStrided<T> dO(dout_data + b * Tn * C + h * hs, Tn, hs,
                                   Eigen::OuterStride<>(C));
      const T* A = att_data + bh * Tn * Tn;
      const ad::ConstStrided<T> Att(A, Tn, Tn, Eigen::OuterStride<>(Tn));

      for (std::int64_t i0 = 0; i0 < Tn; i0 += ad::block_rows) {
        const std::int64_t i1 = std::min(Tn, i0 + ad::block_rows), n = i1 - i0;
        const auto att_block = Att.block(i0, 0, n, i1);
        const auto dO_block = dO.middleRows(i0, n);
        // dV += att^T dO (att is 0 above the diagonal, so the block's upper part adds nothing).
        dV.topRows(i1).noalias() += att_block.transpose() * dO_block;
        // dAtt = dO V^T, then dS = att ∘ (dAtt - rowsum(dAtt ∘ att)) in place.
        auto dS = work.topLeftCorner(n, i1);
        dS.noalias() = dO_block * V.topRows(i1).transpose();
        for (std::int64_t r = 0; r < n; ++r) {
          const std::int64_t t = i0 + r;
          const ad::ConstArrayMap<T> a(A + t * Tn, t + 1);
          ad::ArrayMap<T> g(work.data() + r * Tn, t + 1);
          const T shift = static_cast<T>(ad::dot_as_double(g.data(), a.data(), t + 1));
          g = a * (g - shift);
          std::fill(g.data() + t + 1, g.data() + i1, T(0));  // row r spans keys [0, i1)
        }
        // Scores were q·k * scale: dQ += scale dS K, dK += scale dS^T Q.
        dQ.middleRows(i0, n).noalias() += scale * (dS * K.topRows(i1));
        dK.topRows(i1).noalias() += scale * (dS.transpose() * Q.middleRows(i0, n));
      }
    }
  }
}

}  // namespace loom::inline kernels
