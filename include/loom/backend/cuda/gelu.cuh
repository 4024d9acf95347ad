#pragma once
//! \file GELU (the tanh approximation GPT-2 uses) on the CUDA backend, element-wise, 16 bytes
//! per load where the buffers are aligned (detail/map.cuh). The per-element formulas are
//! host/device functions, so the host tests check them directly. bf16 elements are loaded as
//! float and each result rounded once.

#include <cmath>
#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/detail/map.cuh"
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

// The three element-wise forms, as ops of cuda_kernels::map (16 bytes per load where aligned).

//! out = GELU(a).
struct Forward {
  static constexpr bool reads_out = false;
  __device__ float operator()(float, float a, float) const { return gelu(a); }
};

//! out += b * GELU'(a): the input gradient, accumulated (a = the input, b = dout).
struct Backward {
  static constexpr bool reads_out = true;
  __device__ float operator()(float out, float a, float b) const { return out + b * gelu_derivative(a); }
};

//! out *= GELU'(a), in place: the unfused half of gelu_matmul_backward (a = the pre-activation).
struct ScaleByDerivative {
  static constexpr bool reads_out = true;
  __device__ float operator()(float out, float a, float) const { return out * gelu_derivative(a); }
};

//! d = d * GELU'(pre) over n elements, in place.
template <class T>
void scale_by_derivative(const cuda& be, T* d, const T* pre, std::int64_t n) {
  cuda_kernels::map(be, d, pre, static_cast<const T*>(nullptr), n, ScaleByDerivative{},
                    "gelu_matmul_backward scale_by_derivative");
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
  k::map(be, out.data(), in.data(), static_cast<const T*>(nullptr), n, detail::cuda_gelu::Forward{}, "gelu_forward");
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
  k::map(be, din.data(), in.data(), dout.data(), n, detail::cuda_gelu::Backward{}, "gelu_backward");
}

}  // namespace loom::inline kernels
