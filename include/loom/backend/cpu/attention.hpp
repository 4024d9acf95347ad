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
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/backend/cpu/detail/sum.hpp"
#include "loom/backend/detail/attention_checks.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

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

//! One (batch, head) of the forward in the accumulate type A: q, k, v [T, hs] with rows
//! `qkv_stride` apart, att [T, T] contiguous, out [T, hs] with rows `out_stride` apart.
template <class A>
void head_forward(const A* q, const A* k, const A* v, std::int64_t qkv_stride, A* att, A* out,
                  std::int64_t out_stride, std::int64_t Tn, std::int64_t hs, A scale) {
  const ConstStrided<A> Q(q, Tn, hs, Eigen::OuterStride<>(qkv_stride));
  const ConstStrided<A> K(k, Tn, hs, Eigen::OuterStride<>(qkv_stride));
  const ConstStrided<A> V(v, Tn, hs, Eigen::OuterStride<>(qkv_stride));
  Strided<A> Att(att, Tn, Tn, Eigen::OuterStride<>(Tn));
  Strided<A> O(out, Tn, hs, Eigen::OuterStride<>(out_stride));
  for (std::int64_t i0 = 0; i0 < Tn; i0 += block_rows) {
    const std::int64_t i1 = std::min(Tn, i0 + block_rows), n = i1 - i0;
    auto scores = Att.block(i0, 0, n, i1);
    scores.noalias() = Q.middleRows(i0, n) * K.topRows(i1).transpose();
    // Row softmax over s <= t, in place; scale > 0, so the raw max is the scaled max.
    for (std::int64_t t = i0; t < i1; ++t) {
      ArrayMap<A> row(att + t * Tn, t + 1);
      const A max = row.maxCoeff();
      row = ((row - max) * scale).exp();  // Eigen's vectorised exp
      row *= static_cast<A>(1.0 / sum_as_double(row.data(), t + 1));
      std::fill(att + t * Tn + t + 1, att + (t + 1) * Tn, A(0));
    }
    O.middleRows(i0, n).noalias() = scores * V.topRows(i1);
  }
}

//! One (batch, head) of the backward in the accumulate type A: dq, dk, dv += the gradients of
//! q, k, v (all [T, hs], rows `qkv_stride` apart) from dout [T, hs] (rows `dout_stride` apart)
//! and att [T, T]; `work` is [min(T, block_rows), T] scratch.
template <class A>
void head_backward(const A* q, const A* k, const A* v, A* dq, A* dk, A* dv, std::int64_t qkv_stride,
                   const A* dout, std::int64_t dout_stride, const A* att, A* work, std::int64_t Tn,
                   std::int64_t hs, A scale) {
  const Eigen::OuterStride<> qkv_outer(qkv_stride);
  const ConstStrided<A> Q(q, Tn, hs, qkv_outer), K(k, Tn, hs, qkv_outer), V(v, Tn, hs, qkv_outer);
  Strided<A> dQ(dq, Tn, hs, qkv_outer), dK(dk, Tn, hs, qkv_outer), dV(dv, Tn, hs, qkv_outer);
  const ConstStrided<A> dO(dout, Tn, hs, Eigen::OuterStride<>(dout_stride));
  const ConstStrided<A> Att(att, Tn, Tn, Eigen::OuterStride<>(Tn));
  Strided<A> W(work, std::min(Tn, block_rows), Tn, Eigen::OuterStride<>(Tn));
  for (std::int64_t i0 = 0; i0 < Tn; i0 += block_rows) {
    const std::int64_t i1 = std::min(Tn, i0 + block_rows), n = i1 - i0;
    const auto att_block = Att.block(i0, 0, n, i1);
    const auto dO_block = dO.middleRows(i0, n);
    // dV += att^T dO (att is 0 above the diagonal, so the block's upper part adds nothing).
    dV.topRows(i1).noalias() += att_block.transpose() * dO_block;
    // dAtt = dO V^T, then dS = att ∘ (dAtt - rowsum(dAtt ∘ att)) in place.
    auto dS = W.topLeftCorner(n, i1);
    dS.noalias() = dO_block * V.topRows(i1).transpose();
    for (std::int64_t r = 0; r < n; ++r) {
      const std::int64_t t = i0 + r;
      const ConstArrayMap<A> a(att + t * Tn, t + 1);
      ArrayMap<A> g(work + r * Tn, t + 1);
      const A shift = static_cast<A>(dot_as_double(g.data(), a.data(), t + 1));
      g = a * (g - shift);
      std::fill(g.data() + t + 1, g.data() + i1, A(0));  // row r spans keys [0, i1)
    }
    // Scores were q·k * scale: dQ += scale dS K, dK += scale dS^T Q.
    dQ.middleRows(i0, n).noalias() += scale * (dS * K.topRows(i1));
    dK.topRows(i1).noalias() += scale * (dS.transpose() * Q.middleRows(i0, n));
  }
}

//! The softmax scale 1/sqrt(hs), in the accumulate type.
template <class A>
A softmax_scale(std::int64_t head_size) {
  return A(1) / std::sqrt(static_cast<A>(head_size));
}

}  // namespace loom::detail::attention

namespace loom::inline kernels {

//! Causal multi-head self-attention forward (GPT-2). `qkv` [B,T,3C] packs per token q, k, v
//! (each C wide; head h owns channels [h*hs, (h+1)*hs), hs = C/num_heads). Writes `att`
//! [B,NH,T,T], the softmax of q·k/sqrt(hs) over keys s <= t (entries s > t are 0), and `out`
//! [B,T,C], per head sum_s att[b,h,t,s] v[b,s], heads concatenated. Throws loom::Error on
//! shapes that do not match or a num_heads that does not divide C. On bf16 each head's q, k, v
//! are widened to float, the head runs in float, and att and out are rounded once.
template <class T>
void attention_forward(const cpu& be, Tensor<T> out, Tensor<T> att, Tensor<const T> qkv,
                       int num_heads) {
  namespace ad = detail::attention;
  using A = accumulate_t<T>;
  const ad::Dims d = ad::check_forward(out, att, qkv, num_heads);
  const std::int64_t B = d.batch, Tn = d.tokens, C = d.channels, NH = d.heads, hs = d.head_size;
  if (B == 0 || Tn == 0 || C == 0) return;

  const A scale = ad::softmax_scale<A>(hs);
  const T* qkv_data = qkv.data();
  T* att_data = att.data();
  T* out_data = out.data();
  // bf16: per thread q, k, v and out [T, hs] and att [T, T] in float.
  detail::Staging<T> staging(be.threads(), 4 * Tn * hs + Tn * Tn);

#pragma omp parallel num_threads(be.threads())
  {
    ad::serial_gemm_in_this_task();
    A* stage = staging.at(ad::thread_index());
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < B * NH; ++bh) {
      const std::int64_t b = bh / NH, h = bh % NH;
      const T* q = qkv_data + b * Tn * 3 * C + h * hs;
      T* att_head = att_data + bh * Tn * Tn;
      T* out_head = out_data + b * Tn * C + h * hs;
      if constexpr (is_narrow_storage<T>) {
        // q, k, v: three [T, hs] blocks C apart in qkv; then out and att.
        for (int i = 0; i < 3; ++i) detail::widen_block(q + i * C, 3 * C, 0, Tn, 0, hs, stage + i * Tn * hs);
        A* so = stage + 3 * Tn * hs;
        A* sa = so + Tn * hs;
        ad::head_forward<A>(stage, stage + Tn * hs, stage + 2 * Tn * hs, hs, sa, so, hs, Tn, hs, scale);
        detail::narrow_into(sa, att_head, Tn * Tn);
        detail::narrow_block(so, hs, out_head, C, Tn, hs);
      } else {
        ad::head_forward<A>(q, q + C, q + 2 * C, 3 * C, att_head, out_head, C, Tn, hs, scale);
      }
    }
  }
}

//! Causal multi-head self-attention backward: `dqkv` [B,T,3C] += the gradient w.r.t. `qkv`
//! given `dout` [B,T,C] and the probabilities `att` [B,NH,T,T] saved by attention_forward.
//! Scratch is one [64, T] block per thread; nothing of size [B,NH,T,T] is allocated. On bf16 each
//! head's operands (and its slice of dqkv) are widened to float, and dqkv rounded once.
template <class T>
void attention_backward(const cpu& be, Tensor<T> dqkv, Tensor<const T> dout,
                        Tensor<const T> qkv, Tensor<const T> att, int num_heads) {
  namespace ad = detail::attention;
  using A = accumulate_t<T>;
  const ad::Dims d = ad::check_backward(dqkv, dout, qkv, att, num_heads);
  const std::int64_t B = d.batch, Tn = d.tokens, C = d.channels, NH = d.heads, hs = d.head_size;
  if (B == 0 || Tn == 0 || C == 0) return;

  const A scale = ad::softmax_scale<A>(hs);
  const std::int64_t rows = std::min(Tn, ad::block_rows);
  // Allocated here, not in the parallel region, so that a failed allocation throws normally.
  std::vector<A> scratch(static_cast<std::size_t>(be.threads() * rows * Tn));
  // bf16: per thread q, k, v, dq, dk, dv, dout [T, hs] and att [T, T] in float.
  detail::Staging<T> staging(be.threads(), 7 * Tn * hs + Tn * Tn);
  const T* qkv_data = qkv.data();
  const T* att_data = att.data();
  const T* dout_data = dout.data();
  T* dqkv_data = dqkv.data();

#pragma omp parallel num_threads(be.threads())
  {
    ad::serial_gemm_in_this_task();
    A* work = scratch.data() + ad::thread_index() * rows * Tn;
    A* stage = staging.at(ad::thread_index());
#pragma omp for schedule(static)
    for (std::int64_t bh = 0; bh < B * NH; ++bh) {
      const std::int64_t b = bh / NH, h = bh % NH;
      const std::int64_t offset = b * Tn * 3 * C + h * hs;
      const T* q = qkv_data + offset;
      T* dq = dqkv_data + offset;
      const T* g = dout_data + b * Tn * C + h * hs;
      const T* a = att_data + bh * Tn * Tn;
      if constexpr (is_narrow_storage<T>) {
        // q, k, v, dq, dk, dv: six [T, hs] blocks at C apart in qkv and dqkv; then dout, att.
        A* blocks = stage;
        for (int i = 0; i < 3; ++i) {
          detail::widen_block(q + i * C, 3 * C, 0, Tn, 0, hs, blocks + i * Tn * hs);
          detail::widen_block(dq + i * C, 3 * C, 0, Tn, 0, hs, blocks + (3 + i) * Tn * hs);
        }
        A* sg = blocks + 6 * Tn * hs;
        A* sa = sg + Tn * hs;
        detail::widen_block(g, C, 0, Tn, 0, hs, sg);
        detail::widen_into(a, sa, Tn * Tn);
        ad::head_backward<A>(blocks, blocks + Tn * hs, blocks + 2 * Tn * hs, blocks + 3 * Tn * hs,
                             blocks + 4 * Tn * hs, blocks + 5 * Tn * hs, hs, sg, hs, sa, work, Tn, hs, scale);
        for (int i = 0; i < 3; ++i) detail::narrow_block(blocks + (3 + i) * Tn * hs, hs, dq + i * C, 3 * C, Tn, hs);
      } else {
        ad::head_backward<A>(q, q + C, q + 2 * C, dq, dq + C, dq + 2 * C, 3 * C, g, C, a, work, Tn, hs, scale);
      }
    }
  }
}

}  // namespace loom::inline kernels
