#pragma once
//! \file Fully connected layer (matmul with bias) on the CPU backend: Eigen GEMMs over row-major
//! maps of the flat tensors, using this rank's threads. On bf16 each output tile is one float
//! GEMM over operand blocks widened to float, rounded once into the output. A forward over 8 rows
//! or fewer (decoding) computes each output as one dot product instead.

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <string>
#include <type_traits>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/backend/cpu/elementwise.hpp"
#include "loom/backend/detail/shape_checks.hpp"
#include "loom/backend/gradient_write.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::matmul {

template <class T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using Matrix = Eigen::Map<RowMajor<T>>;
template <class T>
using ConstMatrix = Eigen::Map<const RowMajor<T>>;

//! The shared check (backend/detail/shape_checks.hpp): `t` seen as a matrix is [rows, cols].
template <class T>
void check_matrix(const Tensor<T>& t, std::int64_t rows, std::int64_t cols, const char* kernel, const char* arg) {
  check_rows(t, rows, cols, kernel, arg);
}

struct Dims {
  std::int64_t rows, in_features, out_features;
};

//! N (rows of `in`), C (its last extent) and OC (rows of `weight`, which must be [OC, C]).
template <class T>
Dims dims(const Tensor<const T>& in, const Tensor<const T>& weight, const char* kernel) {
  if (in.shape().rank() == 0)
    throw Error(std::string(kernel) + ": argument in shape", in.shape(), "expected rank >= 1");
  const std::int64_t N = in.shape().rows(), C = in.shape().cols();
  if (weight.shape().rank() != 2)
    throw Error(std::string(kernel) + ": argument weight shape", weight.shape(),
                "expected [OC, C = " + detail::to_text(C) + "]");
  check_shape(weight, Shape{weight.extent(0), C}, kernel, "weight");
  return {N, C, weight.extent(0)};
}

//! Columns per task of the bias-gradient sum: every column is summed over all rows by one
//! thread in row order, so the result does not depend on the thread count.
inline constexpr std::int64_t bias_block = 64;

//! Rows and columns of an output tile of the staged (bf16) GEMMs. Each tile is one float GEMM
//! over the whole inner extent, so every output element is rounded once; the tiles, not Eigen's
//! blocking, split the work between threads, so the result is the same bits for any thread count.
inline constexpr std::int64_t tile = 128;
//! Below this many multiply-adds a staged GEMM, or a few-rows product, stays on the calling
//! thread.
inline constexpr std::int64_t parallel_min_products = std::int64_t{1} << 18;

//! `m` or its transpose, as an Eigen expression.
template <bool Transposed, class M>
auto op(const M& m) {
  if constexpr (Transposed)
    return m.transpose();
  else
    return m;
}

//! c[M, N] = init + op(a) · op(b) for narrow storage (bf16), c row-major with rows N apart; op(a)
//! is [M, K] and op(b) is [K, N], `a` and `b` row-major with rows `lda` and `ldb` apart (a
//! transposed operand is stored [K, M] or [N, K]). init is c itself (`accumulate`), else `bias`
//! [N] on every row, else 0. Per tile: the blocks of op(a) and op(b) widened to float, one Eigen
//! float GEMM, one rounding per element. `c` and `bias` are of T, or of float (U = the accumulate
//! type: fp32 gradient sums, which take the float result unrounded).
template <bool TransA, bool TransB, class T, GradientOf<T> U = T>
void staged_gemm(const cpu& be, U* c, std::int64_t M, std::int64_t N, std::int64_t K, const T* a,
                 std::int64_t lda, const T* b, std::int64_t ldb, const std::type_identity_t<U>* bias,
                 bool accumulate) {
  using A = accumulate_t<T>;
  const std::int64_t col_tiles = (N + tile - 1) / tile, tiles = (M + tile - 1) / tile * col_tiles;
  Staging<T> scratch(be.threads(), 2 * tile * K + tile * tile);
#pragma omp parallel num_threads(be.threads()) if (tiles > 1 && M * N * K >= parallel_min_products)
  {
    serial_gemm_in_this_task();
    A* a_block = scratch.at(thread_index());
    A* b_block = a_block + tile * K;
    A* c_block = b_block + tile * K;
    std::int64_t staged_row_tile = -1;  // consecutive tiles of a thread share op(a)'s block
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < tiles; ++t) {
      const std::int64_t i0 = t / col_tiles * tile, j0 = t % col_tiles * tile;
      const std::int64_t rows = std::min(tile, M - i0), cols = std::min(tile, N - j0);
      if (t / col_tiles != staged_row_tile) {
        if constexpr (TransA)
          widen_block(a, lda, 0, K, i0, rows, a_block);
        else
          widen_block(a, lda, i0, rows, 0, K, a_block);
        staged_row_tile = t / col_tiles;
      }
      if constexpr (TransB)
        widen_block(b, ldb, j0, cols, 0, K, b_block);
      else
        widen_block(b, ldb, 0, K, j0, cols, b_block);
      Matrix<A> out(c_block, rows, cols);
      if (accumulate)
        widen_block(c, N, i0, rows, j0, cols, c_block);
      else if (bias != nullptr)
        for (std::int64_t r = 0; r < rows; ++r) widen_into(bias + j0, c_block + r * cols, cols);
      else
        out.setZero();
      if (K > 0)
        out.noalias() += op<TransA>(ConstMatrix<A>(a_block, TransA ? K : rows, TransA ? rows : K)) *
                         op<TransB>(ConstMatrix<A>(b_block, TransB ? cols : K, TransB ? K : cols));
      narrow_block(c_block, cols, c + i0 * N + j0, N, rows, cols);
    }
  }
}

//! Rows at or below which matmul_forward computes each output element as one dot product of an
//! input row and a weight row (few_rows_forward) instead of a GEMM. Decoding passes one row per
//! text: there Eigen's GEMV runs on one thread, and its GEMM (2 to 8 rows) copies every weight
//! into its packed layout first, which costs more than the products.
inline constexpr std::int64_t few_rows_max = 8;
//! Partial sums of each of few_rows_forward's dot products: product k of the whole chunks of 8
//! goes to lane k % 8, the products past the last whole chunk to a tail sum; the lanes are added
//! in a fixed tree, then the tail. Fixed here rather than by the vector width, so that every
//! instruction set sums in the same order.
inline constexpr int dot_lanes = 8;
//! Output columns per task of few_rows_forward (a multiple of every block of weight rows below).
inline constexpr std::int64_t few_rows_task = 64;

//! `p[0 .. dot_lanes)` in the accumulate type: `p` itself where T is its own, else widened into
//! `staged`.
template <class T>
const accumulate_t<T>* lanes_at(const T* p, accumulate_t<T>* staged) noexcept {
  if constexpr (is_narrow_storage<T>) {
    for (int j = 0; j < dot_lanes; ++j) staged[j] = to_accumulate(p[j]);
    return staged;
  } else {
    return p;
  }
}

//! out[n, o] for the NR rows n of `in` and the OB outputs o0 .. o0 + OB - 1: bias[o] (if any) plus
//! the dot product of in row n and weight row o, summed in dot_lanes lanes and rounded once. The
//! OB weight rows are read once for all NR input rows. The lanes are fixed-size Eigen arrays, which
//! the compiler keeps in vector registers (a plain array of partial sums went through the stack
//! at every product, seen in g++ 12's code).
template <int NR, int OB, class T>
void few_rows_outputs(T* out, const T* in, const T* weight, const T* bias, std::int64_t C, std::int64_t OC,
                      std::int64_t o0) noexcept {
  using A = accumulate_t<T>;
  constexpr int L = dot_lanes;
  using Lanes = Eigen::Array<A, L, 1>;
  using ConstLanes = Eigen::Map<const Lanes>;
  const std::int64_t whole = C / L * L;
  Lanes sums[OB][NR];
  for (auto& per_output : sums)
    for (Lanes& lanes : per_output) lanes.setZero();
  A staged[NR + 1][L];  // bf16: this chunk of the input rows and of one weight row, widened
  for (std::int64_t c = 0; c < whole; c += L) {
    const A* x[NR];
    for (int n = 0; n < NR; ++n) x[n] = lanes_at(in + n * C + c, staged[n]);
    for (int b = 0; b < OB; ++b) {
      const ConstLanes w(lanes_at(weight + (o0 + b) * C + c, staged[NR]));
      for (int n = 0; n < NR; ++n) sums[b][n] += ConstLanes(x[n]) * w;
    }
  }
  for (int b = 0; b < OB; ++b)
    for (int n = 0; n < NR; ++n) {
      const std::int64_t o = o0 + b;
      A lane[L];
      Eigen::Map<Lanes>{lane} = sums[b][n];
      for (int width = L / 2; width > 0; width /= 2)
        for (int j = 0; j < width; ++j) lane[j] += lane[j + width];
      A tail = 0;
      for (std::int64_t k = whole; k < C; ++k) tail += to_accumulate(in[n * C + k]) * to_accumulate(weight[o * C + k]);
      const A dot = lane[0] + tail;
      out[n * OC + o] = static_cast<T>(bias == nullptr ? dot : to_accumulate(bias[o]) + dot);
    }
}

//! Outputs [o_begin, o_end) of all NR rows: OB weight rows at a time (NR·OB lane vectors live at
//! once), then one at a time.
template <int NR, class T>
void few_rows_range(T* out, const T* in, const T* weight, const T* bias, std::int64_t C, std::int64_t OC,
                    std::int64_t o_begin, std::int64_t o_end) noexcept {
  constexpr int OB = NR == 1 ? 8 : NR == 2 ? 4 : NR <= 4 ? 2 : 1;
  std::int64_t o = o_begin;
  for (; o + OB <= o_end; o += OB) few_rows_outputs<NR, OB>(out, in, weight, bias, C, OC, o);
  for (; o < o_end; ++o) few_rows_outputs<NR, 1>(out, in, weight, bias, C, OC, o);
}

//! out[N, OC] = in[N, C] · weight[OC, C]^T (+ bias) for N <= few_rows_max: every output element
//! is one dot product in a fixed order (dot_lanes), so a row gets the same bits whatever N is and
//! however many threads share the outputs. Threads take tasks of few_rows_task output columns,
//! each reading its weight rows once for all N rows.
template <class T>
void few_rows_forward(const cpu& be, T* out, const T* in, const T* weight, const T* bias, std::int64_t N,
                      std::int64_t C, std::int64_t OC) {
  const std::int64_t tasks = (OC + few_rows_task - 1) / few_rows_task;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (tasks > 1 && N * OC * C >= parallel_min_products)
  for (std::int64_t t = 0; t < tasks; ++t) {
    const std::int64_t begin = t * few_rows_task, end = std::min(OC, begin + few_rows_task);
    switch (N) {
      case 1: few_rows_range<1>(out, in, weight, bias, C, OC, begin, end); break;
      case 2: few_rows_range<2>(out, in, weight, bias, C, OC, begin, end); break;
      case 3: few_rows_range<3>(out, in, weight, bias, C, OC, begin, end); break;
      case 4: few_rows_range<4>(out, in, weight, bias, C, OC, begin, end); break;
      case 5: few_rows_range<5>(out, in, weight, bias, C, OC, begin, end); break;
      case 6: few_rows_range<6>(out, in, weight, bias, C, OC, begin, end); break;
      case 7: few_rows_range<7>(out, in, weight, bias, C, OC, begin, end); break;
      default: few_rows_range<8>(out, in, weight, bias, C, OC, begin, end); break;
    }
  }
}

//! out = in · weight^T (+ bias) for float and double: one Eigen GEMM on this rank's threads.
template <class T>
void forward_in_place(const cpu& be, T* out, const T* in, const T* weight, const T* b, std::int64_t N,
                      std::int64_t C, std::int64_t OC) {
  Matrix<T> o(out, N, OC);
  be.bind_gemm_threads();
  if (b == nullptr) {
    if (C == 0) {
      o.setZero();
      return;
    }
    // No bias: the GEMM writes the output directly (no zero-fill pass over N·OC elements).
    o.noalias() = ConstMatrix<T>(in, N, C) * ConstMatrix<T>(weight, OC, C).transpose();
    return;
  }
  // The bias rows are written by all threads, then the GEMM accumulates onto them.
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * OC >= (1 << 16))
  for (std::int64_t n = 0; n < N; ++n) std::copy(b, b + OC, out + n * OC);
  if (C == 0) return;
  o.noalias() += ConstMatrix<T>(in, N, C) * ConstMatrix<T>(weight, OC, C).transpose();
}

}  // namespace loom::detail::matmul

namespace loom::inline kernels {

//! out[N,OC] = in[N,C] · weight[OC,C]^T + bias[OC] + residual[N,OC] with N = in's rows, C = in's
//! last extent; `in`, `out` and `residual` may carry leading axes ([B,T,C] → [B,T,OC]). An empty
//! `bias` means no bias, an empty `residual` no residual (which must not be `out`). The residual
//! is added after the product's rounding (add_to), so the bits are those of matmul_forward
//! followed by add_to; the CUDA backend may add it before its one rounding instead.
template <class T>
void matmul_forward(const cpu& be, Tensor<T> out, Tensor<const T> in, Tensor<const T> weight, Tensor<const T> bias,
                    Tensor<const T> residual = {}) {
  namespace d = detail::matmul;
  constexpr const char* kernel = "matmul_forward";
  // Plain variables, not structured bindings: OpenMP regions below must capture them.
  const d::Dims dims = d::dims(in, weight, kernel);
  const std::int64_t N = dims.rows, C = dims.in_features, OC = dims.out_features;
  d::check_matrix(out, N, OC, kernel, "out");
  if (!bias.empty()) check_shape(bias, Shape{OC}, kernel, "bias");
  if (!residual.empty()) detail::check_residual(residual, out, N, OC, kernel);
  if (N == 0 || OC == 0) return;

  if (N <= d::few_rows_max) {
    d::few_rows_forward(be, out.data(), in.data(), weight.data(), bias.empty() ? nullptr : bias.data(), N, C, OC);
  } else if constexpr (is_narrow_storage<T>) {
    d::staged_gemm<false, true>(be, out.data(), N, OC, C, in.data(), C, weight.data(), C,
                                bias.empty() ? nullptr : bias.data(), false);
  } else {
    d::forward_in_place(be, out.data(), in.data(), weight.data(), bias.empty() ? nullptr : bias.data(), N, C, OC);
  }
  if (!residual.empty()) add_to<T>(be, out, residual);
}

//! Backward of matmul_forward, accumulating: din[N,C] += dout·weight, dweight[OC,C] +=
//! dout^T·in, dbias[OC] += column sums of dout. `din`, `dweight` and `dbias` may each be empty
//! (skipped): an empty `dweight` and `dbias` give the input-gradient pass of a split backward, an
//! empty `din` its weight-gradient pass; the two calls together compute the same bits as one.
//! `din_write` = GradientWrite::overwrite writes din = dout·weight instead, never reading din:
//! the bits of accumulating into zeros. dweight and dbias always accumulate.
//!
//! `dweight` and `dbias` are of T, or for bf16 of float (G = accumulate_t<T>): fp32 gradient sums
//! the products are added to before any rounding (Megatron-LM's gradient-accumulation fusion;
//! TrainerOptions::fp32_gradient_fusion).
template <class T, GradientOf<T> G = T>
void matmul_backward(const cpu& be, Tensor<T> din, Tensor<G> dweight, Tensor<G> dbias,
                     Tensor<const T> dout, Tensor<const T> in, Tensor<const T> weight,
                     GradientWrite din_write = GradientWrite::accumulate) {
  namespace d = detail::matmul;
  constexpr const char* kernel = "matmul_backward";
  // Plain variables, not structured bindings: OpenMP regions below must capture them.
  const d::Dims dims = d::dims(in, weight, kernel);
  const std::int64_t N = dims.rows, C = dims.in_features, OC = dims.out_features;
  d::check_matrix(dout, N, OC, kernel, "dout");
  if (!dweight.empty()) check_shape(dweight, Shape{OC, C}, kernel, "dweight");
  if (!din.empty()) d::check_matrix(din, N, C, kernel, "din");
  if (!dbias.empty()) check_shape(dbias, Shape{OC}, kernel, "dbias");
  const bool accumulate_din = din_write == GradientWrite::accumulate;
  if (N == 0 || OC == 0) return;

  if (C > 0) {
    if constexpr (is_narrow_storage<T>) {
      if (!din.empty())
        d::staged_gemm<false, false>(be, din.data(), N, C, OC, dout.data(), OC, weight.data(), C, nullptr,
                                     accumulate_din);
      if (!dweight.empty())
        d::staged_gemm<true, false>(be, dweight.data(), OC, C, N, dout.data(), OC, in.data(), C, nullptr, true);
    } else {
      be.bind_gemm_threads();
      const d::ConstMatrix<T> g(dout.data(), N, OC), x(in.data(), N, C), w(weight.data(), OC, C);
      if (!din.empty()) {
        d::Matrix<T> dx(din.data(), N, C);
        // Eigen evaluates both alike (coefficient-wise below its size threshold, else the GEMM
        // into zeros or into dx), so overwriting gives the bits of accumulating into zeros.
        if (accumulate_din)
          dx.noalias() += g * w;
        else
          dx.noalias() = g * w;
      }
      if (!dweight.empty()) d::Matrix<T>(dweight.data(), OC, C).noalias() += g.transpose() * x;
    }
  }
  if (!dbias.empty()) {
    // Each column summed from its old value in the accumulate type, in row order, rounded once.
    using A = accumulate_t<T>;
    const T* gd = dout.data();
    G* db = dbias.data();
    const std::int64_t blocks = (OC + d::bias_block - 1) / d::bias_block;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (blocks > 1 && N * OC >= (1 << 15))
    for (std::int64_t blk = 0; blk < blocks; ++blk) {
      const std::int64_t j0 = blk * d::bias_block, width = std::min(OC, j0 + d::bias_block) - j0;
      A sum[d::bias_block];
      detail::widen_into(db + j0, sum, width);
      for (std::int64_t n = 0; n < N; ++n) {
        const T* row = gd + n * OC + j0;
        for (std::int64_t j = 0; j < width; ++j) sum[j] += to_accumulate(row[j]);
      }
      detail::narrow_into(sum, db + j0, width);
    }
  }
}

}  // namespace loom::inline kernels
