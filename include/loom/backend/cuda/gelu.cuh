#pragma once
//! \file GELU on the CUDA backend, either form (loom::Gelu: GPT-2's tanh approximation with
//! tanhf, or the exact erf with erff and expf), element-wise, 16 bytes per load where the buffers
//! are aligned (detail/map.cuh). The per-element formulas are the host/device functions of
//! loom/backend/gelu.hpp, so the host tests check them directly. bf16 elements are loaded as float
//! and each result rounded once.

#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/detail/map.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/backend/gelu.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_gelu {

// The three element-wise forms of the GELU `kind` (the formulas of loom/backend/gelu.hpp, in
// float), as ops of cuda_kernels::map (16 bytes per load where aligned). The form is a template
// argument, so that the kernels carry no per-element branch.

//! out = GELU(a).
template <Gelu kind>
struct Forward {
  static constexpr bool reads_out = false;
  __device__ float operator()(float, float a, float) const { return gelu::value<kind>(a); }
};

//! out += b * GELU'(a): the input gradient, accumulated (a = the input, b = dout).
template <Gelu kind>
struct Backward {
  static constexpr bool reads_out = true;
  __device__ float operator()(float out, float a, float b) const { return out + b * gelu::derivative<kind>(a); }
};

//! out *= GELU'(a), in place: the unfused half of gelu_matmul_backward (a = the pre-activation).
template <Gelu kind>
struct ScaleByDerivative {
  static constexpr bool reads_out = true;
  __device__ float operator()(float out, float a, float) const { return out * gelu::derivative<kind>(a); }
};

//! map(be, out, a, b, n, Op<kind>{}, kernel) with the run-time `kind` as the op's template argument.
template <template <Gelu> class Op, class T>
void map_for(Gelu kind, const cuda& be, T* out, const T* a, const T* b, std::int64_t n, const char* kernel) {
  if (kind == Gelu::erf)
    cuda_kernels::map(be, out, a, b, n, Op<Gelu::erf>{}, kernel);
  else
    cuda_kernels::map(be, out, a, b, n, Op<Gelu::tanh>{}, kernel);
}

//! d = d * GELU'(pre) over n elements, in place.
template <class T>
void scale_by_derivative(const cuda& be, T* d, const T* pre, std::int64_t n, Gelu kind = Gelu::tanh) {
  map_for<ScaleByDerivative>(kind, be, d, pre, static_cast<const T*>(nullptr), n,
                             "gelu_matmul_backward scale_by_derivative");
}

}  // namespace loom::detail::cuda_gelu

namespace loom::inline kernels {

//! out = GELU(in) element-wise (equal element counts), of the form `kind`: GPT-2's
//! 0.5 in (1 + tanh(sqrt(2/pi) (in + 0.044715 in^3))) or the exact 0.5 in (1 + erf(in / sqrt(2))).
template <class T>
void gelu_forward(const cuda& be, Tensor<T> out, Tensor<const T> in, Gelu kind = Gelu::tanh) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  check_numel(out, in.numel(), "gelu_forward", "out");
  check_data(in, "gelu_forward", "in");
  const std::int64_t n = in.numel();
  if (n == 0) return;
  k::activate(be);
  namespace g = detail::cuda_gelu;
  g::map_for<g::Forward>(kind, be, out.data(), in.data(), static_cast<const T*>(nullptr), n, "gelu_forward");
}

//! din += dout * GELU'(in) element-wise (equal element counts), of the form `kind`.
template <class T>
void gelu_backward(const cuda& be, Tensor<T> din, Tensor<const T> in, Tensor<const T> dout, Gelu kind = Gelu::tanh) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  check_numel(din, in.numel(), "gelu_backward", "din");
  check_numel(dout, in.numel(), "gelu_backward", "dout");
  check_data(in, "gelu_backward", "in");
  const std::int64_t n = in.numel();
  if (n == 0) return;
  k::activate(be);
  namespace g = detail::cuda_gelu;
  g::map_for<g::Backward>(kind, be, din.data(), in.data(), dout.data(), n, "gelu_backward");
}

}  // namespace loom::inline kernels
