#pragma once
//! \file LayerNorm over the last axis on the CPU backend: rows in parallel, row statistics in one
//! shifted pass accumulated in double. On bf16 every element is read as float, the row statistics
//! are stored in float (accumulate_t), and each result is rounded once.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/backend/detail/shape_checks.hpp"
#include "loom/backend/gradient_write.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::layernorm {

using detail::check_rows;  // the shared check (backend/detail/shape_checks.hpp)

//! Columns per task of the weight and bias gradients: each column is summed over the rows in row
//! order by one thread, so the result does not depend on the thread count.
inline constexpr std::int64_t column_block = 64;
//! Below this many elements a kernel stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 14;

}  // namespace loom::detail::layernorm

namespace loom::inline kernels {

//! LayerNorm over the last axis C of `in` (N rows): mean[N], rstd[N] = 1/sqrt(biased variance +
//! eps), out = (in - mean) * rstd * weight + bias. `mean` and `rstd` hold N elements (any shape)
//! in the accumulate type (float for bf16 storage).
template <class T>
void layernorm_forward(const cpu& be, Tensor<T> out, Tensor<accumulate_t<T>> mean,
                       Tensor<accumulate_t<T>> rstd, Tensor<const T> in, Tensor<const T> weight,
                       Tensor<const T> bias, accumulate_t<T> eps = accumulate_t<T>(1e-5)) {
  using A = accumulate_t<T>;
  namespace d = detail::layernorm;
  constexpr const char* kernel = "layernorm_forward";
  if (in.shape().rank() == 0)
    throw Error(std::string(kernel) + ": argument in shape", in.shape(), "expected rank >= 1");
  const std::int64_t N = in.shape().rows(), C = in.shape().cols();
  d::check_rows(out, N, C, kernel, "out");
  check_numel(mean, N, kernel, "mean");
  check_numel(rstd, N, kernel, "rstd");
  check_shape(weight, Shape{C}, kernel, "weight");
  check_shape(bias, Shape{C}, kernel, "bias");
  if (N == 0) return;  // also when C == 0: a shape with a zero extent has no rows

  const T* x_all = in.data();
  const T* w = weight.data();
  const T* b = bias.data();
  T* o_all = out.data();
  A* mean_all = mean.data();
  A* rstd_all = rstd.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * C >= d::parallel_min_elements)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* x = x_all + n * C;
    // One pass: sums of (x - x[0]) and its square. The shift keeps E[d^2] - E[d]^2 free of
    // cancellation when the mean is large against the spread.
    const double shift = static_cast<double>(to_accumulate(x[0]));
    double sum = 0, sum_sq = 0;
#pragma omp simd reduction(+ : sum, sum_sq)
    for (std::int64_t i = 0; i < C; ++i) {
      const double dx = static_cast<double>(to_accumulate(x[i])) - shift;
      sum += dx;
      sum_sq += dx * dx;
    }
    const double mean_shifted = sum / static_cast<double>(C);
    const double var = std::max(0.0, sum_sq / static_cast<double>(C) - mean_shifted * mean_shifted);
    const A m = static_cast<A>(shift + mean_shifted);
    const A r = static_cast<A>(1.0 / std::sqrt(var + static_cast<double>(eps)));
    mean_all[n] = m;
    rstd_all[n] = r;
    T* o = o_all + n * C;
    for (std::int64_t i = 0; i < C; ++i)
      o[i] = static_cast<T>((to_accumulate(x[i]) - m) * r * to_accumulate(w[i]) + to_accumulate(b[i]));
  }
}

//! Backward of layernorm_forward from its saved `mean` and `rstd`, accumulating: din += d in,
//! dweight += sum over rows of dout * normalized in, dbias += sum over rows of dout. `residual`
//! (optional, [N, C] in rows as din, and not din itself) is the gradient that reaches the input
//! around the layernorm, through a residual connection: din += residual + d in, summed in the
//! accumulate type and rounded once. `din_write` = GradientWrite::overwrite writes din = d in (+
//! residual) instead, never reading din: a pre-norm block's residual-stream gradient in one pass.
//! `dweight` and `dbias` are of T or, for bf16, fp32 sums (G = float, GradientOf): each column's
//! sum is then stored unrounded (TrainerOptions::fp32_gradient_fusion).
template <class T, GradientOf<T> G = T>
void layernorm_backward(const cpu& be, Tensor<T> din, Tensor<G> dweight, Tensor<G> dbias,
                        Tensor<const T> dout, Tensor<const T> in, Tensor<const T> weight,
                        Tensor<const accumulate_t<T>> mean, Tensor<const accumulate_t<T>> rstd,
                        Tensor<const T> residual = {}, GradientWrite din_write = GradientWrite::accumulate) {
  using A = accumulate_t<T>;
  namespace d = detail::layernorm;
  constexpr const char* kernel = "layernorm_backward";
  if (in.shape().rank() == 0)
    throw Error(std::string(kernel) + ": argument in shape", in.shape(), "expected rank >= 1");
  const std::int64_t N = in.shape().rows(), C = in.shape().cols();
  d::check_rows(din, N, C, kernel, "din");
  d::check_rows(dout, N, C, kernel, "dout");
  check_shape(dweight, Shape{C}, kernel, "dweight");
  check_shape(dbias, Shape{C}, kernel, "dbias");
  check_shape(weight, Shape{C}, kernel, "weight");
  check_numel(mean, N, kernel, "mean");
  check_numel(rstd, N, kernel, "rstd");
  if (!residual.empty()) detail::check_residual(residual, din, N, C, kernel, "din");
  if (N == 0 || C == 0) return;

  const T* x_all = in.data();
  const T* residual_all = residual.empty() ? nullptr : residual.data();
  const bool accumulate = din_write == GradientWrite::accumulate;
  const T* g_all = dout.data();
  const T* w = weight.data();
  const A* mean_all = mean.data();
  const A* rstd_all = rstd.data();
  [[maybe_unused]] const bool parallel = N * C >= d::parallel_min_elements;

  // Input gradient, row by row: din += residual + (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd
  // with norm = (x - mean) * rstd and dnorm = weight * dout; din's old value and the residual
  // where they are taken, added in that order before the change.
  T* dx_all = din.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (parallel)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* x = x_all + n * C;
    const T* g = g_all + n * C;
    const A m = mean_all[n], r = rstd_all[n];
    double sum_dnorm = 0, sum_dnorm_norm = 0;
#pragma omp simd reduction(+ : sum_dnorm, sum_dnorm_norm)
    for (std::int64_t i = 0; i < C; ++i) {
      const A dnorm = to_accumulate(w[i]) * to_accumulate(g[i]);
      sum_dnorm += static_cast<double>(dnorm);
      sum_dnorm_norm += static_cast<double>(dnorm * ((to_accumulate(x[i]) - m) * r));
    }
    const A a = static_cast<A>(sum_dnorm / static_cast<double>(C));
    const A c = static_cast<A>(sum_dnorm_norm / static_cast<double>(C));
    T* dx = dx_all + n * C;
    const T* res = residual_all != nullptr ? residual_all + n * C : nullptr;
    for (std::int64_t i = 0; i < C; ++i) {
      const A norm = (to_accumulate(x[i]) - m) * r;
      A base = accumulate ? to_accumulate(dx[i]) : A(0);
      if (res != nullptr) base = accumulate ? base + to_accumulate(res[i]) : to_accumulate(res[i]);
      dx[i] = static_cast<T>(base + (to_accumulate(w[i]) * to_accumulate(g[i]) - a - norm * c) * r);
    }
  }

  // Parameter gradients, by blocks of columns (no two threads on one element), each column summed
  // in the accumulate type from its old value and rounded once.
  G* dw = dweight.data();
  G* db = dbias.data();
  const std::int64_t blocks = (C + d::column_block - 1) / d::column_block;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (parallel && blocks > 1)
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    const std::int64_t j0 = blk * d::column_block, width = std::min(C, j0 + d::column_block) - j0;
    A sum_w[d::column_block], sum_b[d::column_block];
    detail::widen_into(dw + j0, sum_w, width);
    detail::widen_into(db + j0, sum_b, width);
    for (std::int64_t n = 0; n < N; ++n) {
      const T* x = x_all + n * C + j0;
      const T* g = g_all + n * C + j0;
      const A m = mean_all[n], r = rstd_all[n];
      for (std::int64_t j = 0; j < width; ++j) {
        sum_w[j] += (to_accumulate(x[j]) - m) * r * to_accumulate(g[j]);
        sum_b[j] += to_accumulate(g[j]);
      }
    }
    detail::narrow_into(sum_w, dw + j0, width);
    detail::narrow_into(sum_b, db + j0, width);
  }
}

}  // namespace loom::inline kernels
