#pragma once
//! \file LayerNorm over the last axis on the CPU backend: rows in parallel, row statistics in one
//! shifted pass accumulated in double.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/detail/shape_checks.hpp"
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
//! eps), out = (in - mean) * rstd * weight + bias. `mean` and `rstd` hold N elements (any shape).
template <class T>
void layernorm_forward(const cpu& be, Tensor<T> out, Tensor<T> mean, Tensor<T> rstd,
                       Tensor<const T> in, Tensor<const T> weight, Tensor<const T> bias,
                       T eps = T(1e-5)) {
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
  T* mean_all = mean.data();
  T* rstd_all = rstd.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * C >= d::parallel_min_elements)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* x = x_all + n * C;
    // One pass: sums of (x - x[0]) and its square. The shift keeps E[d^2] - E[d]^2 free of
    // cancellation when the mean is large against the spread.
    const double shift = static_cast<double>(x[0]);
    double sum = 0, sum_sq = 0;
#pragma omp simd reduction(+ : sum, sum_sq)
    for (std::int64_t i = 0; i < C; ++i) {
      const double dx = static_cast<double>(x[i]) - shift;
      sum += dx;
      sum_sq += dx * dx;
    }
    const double mean_shifted = sum / static_cast<double>(C);
    const double var = std::max(0.0, sum_sq / static_cast<double>(C) - mean_shifted * mean_shifted);
    const T m = static_cast<T>(shift + mean_shifted);
    const T r = static_cast<T>(1.0 / std::sqrt(var + static_cast<double>(eps)));
    mean_all[n] = m;
    rstd_all[n] = r;
    T* o = o_all + n * C;
    for (std::int64_t i = 0; i < C; ++i) o[i] = (x[i] - m) * r * w[i] + b[i];
  }
}

//! Backward of layernorm_forward from its saved `mean` and `rstd`, accumulating: din += d in,
//! dweight += sum over rows of dout * normalized in, dbias += sum over rows of dout.
template <class T>
void layernorm_backward(const cpu& be, Tensor<T> din, Tensor<T> dweight, Tensor<T> dbias,
                        Tensor<const T> dout, Tensor<const T> in, Tensor<const T> weight,
                        Tensor<const T> mean, Tensor<const T> rstd) {
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
  if (N == 0 || C == 0) return;

  const T* x_all = in.data();
  const T* g_all = dout.data();
  const T* w = weight.data();
  const T* mean_all = mean.data();
  const T* rstd_all = rstd.data();
  [[maybe_unused]] const bool parallel = N * C >= d::parallel_min_elements;

  // Input gradient, row by row: din += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd
  // with norm = (x - mean) * rstd and dnorm = weight * dout.
  T* dx_all = din.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (parallel)
  for (std::int64_t n = 0; n < N; ++n) {
    const T* x = x_all + n * C;
    const T* g = g_all + n * C;
    const T m = mean_all[n], r = rstd_all[n];
    double sum_dnorm = 0, sum_dnorm_norm = 0;
#pragma omp simd reduction(+ : sum_dnorm, sum_dnorm_norm)
    for (std::int64_t i = 0; i < C; ++i) {
      const T dnorm = w[i] * g[i];
      sum_dnorm += static_cast<double>(dnorm);
      sum_dnorm_norm += static_cast<double>(dnorm * ((x[i] - m) * r));
    }
    const T a = static_cast<T>(sum_dnorm / static_cast<double>(C));
    const T c = static_cast<T>(sum_dnorm_norm / static_cast<double>(C));
    T* dx = dx_all + n * C;
    for (std::int64_t i = 0; i < C; ++i) dx[i] += (w[i] * g[i] - a - (x[i] - m) * r * c) * r;
  }

  // Parameter gradients, by blocks of columns (no two threads on one element).
  T* dw = dweight.data();
  T* db = dbias.data();
  const std::int64_t blocks = (C + d::column_block - 1) / d::column_block;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (parallel && blocks > 1)
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    const std::int64_t j0 = blk * d::column_block, j1 = std::min(C, j0 + d::column_block);
    for (std::int64_t n = 0; n < N; ++n) {
      const T* x = x_all + n * C;
      const T* g = g_all + n * C;
      const T m = mean_all[n], r = rstd_all[n];
      for (std::int64_t j = j0; j < j1; ++j) {
        dw[j] += (x[j] - m) * r * g[j];
        db[j] += g[j];
      }
    }
  }
}

}  // namespace loom::inline kernels
