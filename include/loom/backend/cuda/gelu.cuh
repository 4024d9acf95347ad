#pragma once
//! \file GELU (the tanh approximation GPT-2 uses) on the CUDA backend, element-wise. The
//! per-element formulas are host/device functions, so the host tests check them directly. bf16
//! elements are loaded as float and each result rounded once.

#include <cmath>
#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/hd.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_gelu {

//! sqrt(2 / pi) and the cubic coefficient of GPT-2's GELU (the CPU kernel's constants).
inline constexpr float scaling = 0.7978845608028654f;
inline constexpr float cubic = 0.044715f;

//! 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
LOOM_HD inline float gelu(float x) {
  return 0.5f * x * (1.0f + tanhf(scaling * (x + cubic * x * x * x)));
}

//! d gelu / dx = 0.5 (1 + th) + 0.5 x (1 - th^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
LOOM_HD inline float gelu_derivative(float x) {
  const float th = tanhf(scaling * (x + cubic * x * x * x));
  return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * scaling * (1.0f + 3.0f * cubic * x * x);
}

template <class T>
__global__ void forward_kernel(T* out, const T* in, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride())
    out[i] = static_cast<T>(gelu(to_accumulate(in[i])));
}

template <class T>
__global__ void backward_kernel(T* din, const T* in, const T* dout, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride())
    din[i] = static_cast<T>(to_accumulate(din[i]) + to_accumulate(dout[i]) * gelu_derivative(to_accumulate(in[i])));
}

//! d = d * GELU'(pre), in place: the unfused half of gelu_matmul_backward.
template <class T>
__global__ void scale_by_derivative_kernel(T* d, const T* pre, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride())
    d[i] = static_cast<T>(to_accumulate(d[i]) * gelu_derivative(to_accumulate(pre[i])));
}

//! Launches scale_by_derivative_kernel over n elements.
template <class T>
void scale_by_derivative(const cuda& be, T* d, const T* pre, std::int64_t n) {
  namespace k = cuda_kernels;
  if (n == 0) return;
  scale_by_derivative_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(d, pre, n);
  cuda_check_launch("gelu_matmul_backward scale_by_derivative_kernel");
}

}  // namespace loom::detail::cuda_gelu

namespace loom::inline kernels {

//! out = 0.5 in (1 + tanh(sqrt(2/pi) (in + 0.044715 in^3))) element-wise (equal element counts).
template <class T>
void gelu_forward(const cuda& be, Tensor<T> out, Tensor<const T> in) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  check_numel(out, in.numel(), "gelu_forward", "out");
  check_data(in, "gelu_forward", "in");
  const std::int64_t n = in.numel();
  if (n == 0) return;
  k::activate(be);
  detail::cuda_gelu::forward_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
      out.data(), in.data(), n);
  detail::cuda_check_launch("gelu_forward");
}

//! din += dout * GELU'(in) element-wise (equal element counts).
template <class T>
void gelu_backward(const cuda& be, Tensor<T> din, Tensor<const T> in, Tensor<const T> dout) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  check_numel(din, in.numel(), "gelu_backward", "din");
  check_numel(dout, in.numel(), "gelu_backward", "dout");
  check_data(in, "gelu_backward", "in");
  const std::int64_t n = in.numel();
  if (n == 0) return;
  k::activate(be);
  detail::cuda_gelu::backward_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
      din.data(), in.data(), dout.data(), n);
  detail::cuda_check_launch("gelu_backward");
}

}  // namespace loom::inline kernels
