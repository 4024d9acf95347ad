#pragma once
//! \file LayerNorm over the last axis on the CUDA backend: one warp per row, row statistics in
//! two fp32 passes (mean, then the mean square of x - mean), parameter gradients as column sums
//! in a fixed order. bf16 elements are loaded as float; mean and rstd are stored in float
//! (accumulate_t) and every other result is rounded once.

#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_layernorm {

//! One warp per row: mean, rstd = 1/sqrt(biased variance + eps) and out. The variance is the
//! mean of (x - mean)^2 (a second pass over the row, which is in L1), so there is no
//! cancellation when the mean is large against the spread.
template <class T, class A = accumulate_t<T>>
__global__ void forward_kernel(T* out, A* mean, A* rstd, const T* in, const T* weight, const T* bias,
                               std::int64_t rows, std::int64_t cols, A eps) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t row =
      static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp leaves together
  const T* x = in + row * cols;
  A sum = 0;
  for (std::int64_t i = lane; i < cols; i += 32) sum += to_accumulate(x[i]);
  const A m = cuda_kernels::warp_sum(sum) / static_cast<A>(cols);
  A sum_sq = 0;
  for (std::int64_t i = lane; i < cols; i += 32) {
    const A d = to_accumulate(x[i]) - m;
    sum_sq += d * d;
  }
  const A var = cuda_kernels::warp_sum(sum_sq) / static_cast<A>(cols);
  const A r = A(1) / sqrtf(var + eps);
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
  T* o = out + row * cols;
  for (std::int64_t i = lane; i < cols; i += 32)
    o[i] = static_cast<T>((to_accumulate(x[i]) - m) * r * to_accumulate(weight[i]) + to_accumulate(bias[i]));
}

//! One warp per row: din += (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd with
//! norm = (x - mean) * rstd and dnorm = weight * dout.
template <class T, class A = accumulate_t<T>>
__global__ void input_grad_kernel(T* din, const T* dout, const T* in, const T* weight, const A* mean,
                                  const A* rstd, std::int64_t rows, std::int64_t cols) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t row =
      static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const T* x = in + row * cols;
  const T* g = dout + row * cols;
  const A m = mean[row], r = rstd[row];
  A sum_dnorm = 0, sum_dnorm_norm = 0;
  for (std::int64_t i = lane; i < cols; i += 32) {
    const A dnorm = to_accumulate(weight[i]) * to_accumulate(g[i]);
    sum_dnorm += dnorm;
    sum_dnorm_norm += dnorm * ((to_accumulate(x[i]) - m) * r);
  }
  const A a = cuda_kernels::warp_sum(sum_dnorm) / static_cast<A>(cols);
  const A c = cuda_kernels::warp_sum(sum_dnorm_norm) / static_cast<A>(cols);
  T* dx = din + row * cols;
  for (std::int64_t i = lane; i < cols; i += 32) {
    const A norm = (to_accumulate(x[i]) - m) * r;
    dx[i] = static_cast<T>(to_accumulate(dx[i]) + (to_accumulate(weight[i]) * to_accumulate(g[i]) - a - norm * c) * r);
  }
}

//! dweight[j] += sum over rows of (x - mean) * rstd * dout, dbias[j] += sum over rows of dout:
//! thread (x, y) takes rows y, y + 32, ... of column j, then the partials are added in order.
template <class T, class A = accumulate_t<T>>
__global__ void param_grad_kernel(T* dweight, T* dbias, const T* dout, const T* in, const A* mean,
                                  const A* rstd, std::int64_t rows, std::int64_t cols) {
  using cuda_kernels::column_row_threads;
  using cuda_kernels::column_tile;
  __shared__ A partial_w[column_row_threads][column_tile];
  __shared__ A partial_b[column_row_threads][column_tile];
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * column_tile + threadIdx.x;
  A sum_w = 0, sum_b = 0;
  if (j < cols)
    for (std::int64_t n = threadIdx.y; n < rows; n += column_row_threads) {
      const A g = to_accumulate(dout[n * cols + j]);
      sum_w += (to_accumulate(in[n * cols + j]) - mean[n]) * rstd[n] * g;
      sum_b += g;
    }
  partial_w[threadIdx.y][threadIdx.x] = sum_w;
  partial_b[threadIdx.y][threadIdx.x] = sum_b;
  __syncthreads();
  if (threadIdx.y != 0 || j >= cols) return;
  A total_w = 0, total_b = 0;
  for (int k = 0; k < column_row_threads; ++k) {
    total_w += partial_w[k][threadIdx.x];
    total_b += partial_b[k][threadIdx.x];
  }
  dweight[j] = static_cast<T>(to_accumulate(dweight[j]) + total_w);
  dbias[j] = static_cast<T>(to_accumulate(dbias[j]) + total_b);
}

}  // namespace loom::detail::cuda_layernorm

namespace loom::inline kernels {

//! LayerNorm over the last axis C of `in` (N rows): mean[N], rstd[N] = 1/sqrt(biased variance +
//! eps), out = (in - mean) * rstd * weight + bias. `mean` and `rstd` hold N elements (any shape)
//! in the accumulate type (float for bf16 storage).
template <class T>
void layernorm_forward(const cuda& be, Tensor<T> out, Tensor<accumulate_t<T>> mean,
                       Tensor<accumulate_t<T>> rstd, Tensor<const T> in, Tensor<const T> weight,
                       Tensor<const T> bias, accumulate_t<T> eps = accumulate_t<T>(1e-5)) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  constexpr const char* kernel = "layernorm_forward";
  k::check_has_rows(in, kernel);
  const std::int64_t N = in.shape().rows(), C = in.shape().cols();
  k::check_rows(out, N, C, kernel, "out");
  check_numel(mean, N, kernel, "mean");
  check_numel(rstd, N, kernel, "rstd");
  check_shape(weight, Shape{C}, kernel, "weight");
  check_shape(bias, Shape{C}, kernel, "bias");
  if (N == 0) return;  // also when C == 0: a shape with a zero extent has no rows
  check_data(in, kernel, "in");

  k::activate(be);
  detail::cuda_layernorm::forward_kernel<<<k::row_blocks(N), 32 * k::warps_per_block, 0, be.stream()>>>(
      out.data(), mean.data(), rstd.data(), in.data(), weight.data(), bias.data(), N, C, eps);
  detail::cuda_check_launch("layernorm_forward");
}

//! Backward of layernorm_forward from its saved `mean` and `rstd`, accumulating: din += d in,
//! dweight += sum over rows of dout * normalized in, dbias += sum over rows of dout.
template <class T>
void layernorm_backward(const cuda& be, Tensor<T> din, Tensor<T> dweight, Tensor<T> dbias,
                        Tensor<const T> dout, Tensor<const T> in, Tensor<const T> weight,
                        Tensor<const accumulate_t<T>> mean, Tensor<const accumulate_t<T>> rstd) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  namespace d = detail::cuda_layernorm;
  constexpr const char* kernel = "layernorm_backward";
  k::check_has_rows(in, kernel);
  const std::int64_t N = in.shape().rows(), C = in.shape().cols();
  k::check_rows(din, N, C, kernel, "din");
  k::check_rows(dout, N, C, kernel, "dout");
  check_shape(dweight, Shape{C}, kernel, "dweight");
  check_shape(dbias, Shape{C}, kernel, "dbias");
  check_shape(weight, Shape{C}, kernel, "weight");
  check_numel(mean, N, kernel, "mean");
  check_numel(rstd, N, kernel, "rstd");
  if (N == 0 || C == 0) return;
  check_data(in, kernel, "in");

  k::activate(be);
  d::input_grad_kernel<<<k::row_blocks(N), 32 * k::warps_per_block, 0, be.stream()>>>(
      din.data(), dout.data(), in.data(), weight.data(), mean.data(), rstd.data(), N, C);
  detail::cuda_check_launch("layernorm_backward input_grad_kernel");
  const dim3 block(k::column_tile, k::column_row_threads);
  d::param_grad_kernel<<<k::column_blocks(C), block, 0, be.stream()>>>(
      dweight.data(), dbias.data(), dout.data(), in.data(), mean.data(), rstd.data(), N, C);
  detail::cuda_check_launch("layernorm_backward param_grad_kernel");
}

}  // namespace loom::inline kernels
