#pragma once
//! \file A fully connected layer and GELU as one kernel call, on the CUDA backend: with
//! cuda::gemm_epilogues() the GELU (forward) and its gradient (backward) ride in the cuBLASLt
//! GEMM's epilogue, so the [N, F] hidden activations are not read and written again by a
//! separate element-wise pass; otherwise, or where cuBLASLt cannot fuse them, the same
//! operations run as matmul_forward/gelu_forward and matmul_backward plus a scaling kernel.
//! cuBLASLt's GELU epilogues compute the tanh approximation, so only Gelu::tanh fuses: the exact
//! Gelu::erf always takes the unfused path (the GEMM, then loom's element-wise kernel).

#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/elementwise.cuh"
#include "loom/backend/cuda/gelu.cuh"
#include "loom/backend/cuda/matmul.cuh"
#include "loom/backend/gelu.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::inline kernels {

//! pre[N,OC] = in[N,C] · weight[OC,C]^T + bias[OC] and out = GELU(pre) of the form `kind`;
//! `bias` may be empty. The backward needs `pre`; gelu_matmul_backward takes it.
template <class T>
void matmul_gelu_forward(cuda& be, Tensor<T> out, Tensor<T> pre, Tensor<const T> in, Tensor<const T> weight,
                         Tensor<const T> bias, Gelu kind = Gelu::tanh) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_matmul;
  constexpr const char* kernel = "matmul_gelu_forward";
  const d::Dims dims = d::dims(in, weight, kernel);
  const std::int64_t N = dims.rows, C = dims.in_features, OC = dims.out_features;
  detail::cuda_kernels::check_rows(out, N, OC, kernel, "out");
  detail::cuda_kernels::check_rows(pre, N, OC, kernel, "pre");
  if (!bias.empty()) check_shape(bias, Shape{OC}, kernel, "bias");
  if (N == 0 || OC == 0) return;
  check_data(in, kernel, "in");

  detail::cuda_kernels::activate(be);
  // cuBLASLt's GELU epilogue is the tanh form: the erf form runs unfused.
  if (C > 0 && kind == Gelu::tanh && be.gemm_epilogues() &&
      d::lt_gemm(be, d::forward_gemm(N, C, OC), weight.data(), in.data(), out.data(), 0.0f,
                 bias.empty() ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_GELU_AUX_BIAS,
                 {.bias = bias.empty() ? nullptr : bias.data(), .aux = pre.data()}, OC, kernel))
    return;
  matmul_forward<T>(be, pre, in, weight, bias);
  gelu_forward<T>(be, out, Tensor<const T>(pre), kind);
}

//! Backward of matmul_forward(out, in = GELU(pre), weight, bias) through the GELU:
//! dpre = GELU'(pre) ⊙ (dout · weight), written (not accumulated: the derivative applies to the
//! whole sum, and the pre-activation has no other consumer); dweight += dout^T · in and
//! dbias += column sums of dout as matmul_backward computes them (each may be empty: skipped,
//! the input-gradient pass of a split backward). `in` and `pre` are both [N, C]; `kind` is the
//! forward's GELU. `dweight` and `dbias` may be fp32 sums of a bf16 layer's gradients (G, as
//! matmul_backward's).
template <class T, GradientOf<T> G = T>
void gelu_matmul_backward(cuda& be, Tensor<T> dpre, Tensor<G> dweight, Tensor<G> dbias, Tensor<const T> dout,
                          Tensor<const T> in, Tensor<const T> weight, Tensor<const T> pre, Gelu kind = Gelu::tanh) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_matmul;
  constexpr const char* kernel = "gelu_matmul_backward";
  const d::Dims dims = d::dims(in, weight, kernel);
  const std::int64_t N = dims.rows, C = dims.in_features, OC = dims.out_features;
  detail::cuda_kernels::check_rows(dout, N, OC, kernel, "dout");
  detail::cuda_kernels::check_rows(dpre, N, C, kernel, "dpre");
  detail::cuda_kernels::check_rows(pre, N, C, kernel, "pre");
  if (!dweight.empty()) check_shape(dweight, Shape{OC, C}, kernel, "dweight");
  if (!dbias.empty()) check_shape(dbias, Shape{OC}, kernel, "dbias");
  if (N == 0) return;
  // Everything matmul_backward would reject, rejected before the first launch.
  if (!dweight.empty()) check_data(in, kernel, "in");
  if (!dbias.empty()) detail::cuda_kernels::check_column_sum_rows(N, kernel);

  detail::cuda_kernels::activate(be);
  // cuBLASLt's DGELU epilogue is the tanh form's derivative: the erf form runs unfused.
  const bool fused = C > 0 && OC > 0 && kind == Gelu::tanh && be.gemm_epilogues() &&
                     d::lt_gemm(be, d::input_grad_gemm(N, C, OC), weight.data(), dout.data(), dpre.data(), 0.0f,
                                CUBLASLT_EPILOGUE_DGELU, {.aux = pre.data()}, C, kernel);
  if (!fused) {
    zero<T>(be, dpre);
    matmul_backward<T>(be, dpre, Tensor<T>{}, Tensor<T>{}, dout, in, weight);
    detail::cuda_gelu::scale_by_derivative(be, dpre.data(), pre.data(), dpre.numel(), kind);
  }
  if (!dweight.empty() || !dbias.empty()) matmul_backward<T, G>(be, Tensor<T>{}, dweight, dbias, dout, in, weight);
}

}  // namespace loom::inline kernels
