#pragma once
//! \file A fully connected layer and GELU as one kernel call, on the CPU backend: the matmul and
//! GELU kernels in turn. The CUDA backend fuses the tanh GELU into its GEMM (cuda::gemm_epilogues);
//! a model that calls these runs the same code on both.

#include <cstdint>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/elementwise.hpp"
#include "loom/backend/cpu/gelu.hpp"
#include "loom/backend/cpu/matmul.hpp"
#include "loom/backend/gelu.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::inline kernels {

//! pre[N,OC] = in[N,C] · weight[OC,C]^T + bias[OC] and out = GELU(pre) of the form `kind`;
//! `bias` may be empty. The backward needs `pre`; gelu_matmul_backward takes it.
template <class T>
void matmul_gelu_forward(const cpu& be, Tensor<T> out, Tensor<T> pre, Tensor<const T> in, Tensor<const T> weight,
                         Tensor<const T> bias, Gelu kind = Gelu::tanh) {
  namespace d = detail::matmul;
  constexpr const char* kernel = "matmul_gelu_forward";
  const d::Dims dims = d::dims(in, weight, kernel);
  d::check_matrix(out, dims.rows, dims.out_features, kernel, "out");
  d::check_matrix(pre, dims.rows, dims.out_features, kernel, "pre");
  matmul_forward<T>(be, pre, in, weight, bias);
  gelu_forward<T>(be, out, Tensor<const T>(pre), kind);
}

//! Backward of matmul_forward(out, in = GELU(pre), weight, bias) through the GELU:
//! dpre = GELU'(pre) ⊙ (dout · weight), written (not accumulated: the derivative applies to the
//! whole sum, which is how the CUDA backend's fused epilogue computes it, and the pre-activation
//! has no other consumer); dweight += dout^T · in and dbias += column sums of dout, as
//! matmul_backward computes them (each may be empty: skipped, the input-gradient pass of a split
//! backward). `in` and `pre` are both [N, C]; `kind` is the forward's GELU. `dweight` and `dbias`
//! may be fp32 sums of a bf16 layer's gradients (G, as matmul_backward's).
template <class T, GradientOf<T> G = T>
void gelu_matmul_backward(const cpu& be, Tensor<T> dpre, Tensor<G> dweight, Tensor<G> dbias, Tensor<const T> dout,
                          Tensor<const T> in, Tensor<const T> weight, Tensor<const T> pre, Gelu kind = Gelu::tanh) {
  namespace d = detail::matmul;
  constexpr const char* kernel = "gelu_matmul_backward";
  const d::Dims dims = d::dims(in, weight, kernel);
  d::check_matrix(dpre, dims.rows, dims.in_features, kernel, "dpre");
  d::check_matrix(pre, dims.rows, dims.in_features, kernel, "pre");
  zero<T>(be, dpre);
  matmul_backward<T, G>(be, dpre, dweight, dbias, dout, in, weight);
  detail::gelu::scale_by_derivative(be, dpre.data(), pre.data(), dpre.numel(), kind);
}

}  // namespace loom::inline kernels
