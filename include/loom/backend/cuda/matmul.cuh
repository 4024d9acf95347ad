#pragma once
//! \file Fully connected layer (matmul with bias) on the CUDA backend: cuBLAS GEMMs (fp32 data with
//! TF32 tensor-core products, or bf16 data with bf16 products; fp32 accumulation either way) on
//! the backend's stream, bias kernels beside.

#include <cublas_api.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/column_sums.cuh"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/detail/lt_gemms.hpp"
#include "loom/backend/cuda/elementwise.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/backend/gradient_write.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/bf16.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_matmul {

//! The GEMMs' products for fp32 data: TF32 (10-bit mantissa inputs, fp32 accumulation) on tensor
//! cores where the backend allows it (the default): about 8x the fp32 rate on an H100, at a
//! relative error near 1e-3 of sum |a_i b_i| instead of 1e-7. Full fp32 products otherwise
//! (cuda::set_tf32). bf16 data always computes in fp32 (CUBLAS_COMPUTE_32F): bf16 products are
//! exact in fp32, the sums accumulate in fp32, and the result is rounded to bf16 once.
template <class T = float>
cublasComputeType_t compute_type(const cuda& be) noexcept {
  if constexpr (std::is_same_v<T, bf16>)
    return CUBLAS_COMPUTE_32F;
  else
    return be.tf32() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
}

//! cuBLAS's name for the element type T (float or bf16).
template <class T>
constexpr cudaDataType_t data_type() noexcept {
  if constexpr (std::is_same_v<T, bf16>)
    return CUDA_R_16BF;
  else
    return CUDA_R_32F;
}

//! One column-major cuBLAS GEMM, C = alpha op(A) op(B) + beta C with C m x n and k the inner
//! extent. The row-major tensors are handed to cuBLAS as their column-major transposes.
struct Gemm {
  cublasOperation_t op_a, op_b;
  std::int64_t m, n, k, lda, ldb, ldc;
  friend bool operator==(const Gemm&, const Gemm&) = default;
};

//! out[N,OC] = in[N,C] weight[OC,C]^T, i.e. out^T = weight · in^T: A = weight, B = in, C = out.
inline Gemm forward_gemm(std::int64_t N, std::int64_t C, std::int64_t OC) {
  return {CUBLAS_OP_T, CUBLAS_OP_N, OC, N, C, C, C, OC};
}
//! din[N,C] += dout[N,OC] weight[OC,C], i.e. din^T += weight^T · dout^T: A = weight, B = dout,
//! C = din.
inline Gemm input_grad_gemm(std::int64_t N, std::int64_t C, std::int64_t OC) {
  return {CUBLAS_OP_N, CUBLAS_OP_N, C, N, OC, C, OC, C};
}
//! dweight[OC,C] += dout^T in, i.e. dweight^T += in^T · dout: A = in, B = dout, C = dweight.
inline Gemm weight_grad_gemm(std::int64_t N, std::int64_t C, std::int64_t OC) {
  return {CUBLAS_OP_N, CUBLAS_OP_T, C, OC, N, C, OC, C};
}


//! Runs `g` on the backend's stream: C = A B (beta 0) or C += A B (beta 1), T in and U out (fp32
//! scalars and accumulation; U is T, or float for fp32 gradient sums of bf16 operands, which
//! cuBLAS supports under CUBLAS_COMPUTE_32F). With bf16 C, cuBLAS may round A B to bf16 before it
//! adds beta C (seen on an H100, CUDA 13: a gradient accumulated into bf16 is off by up to
//! 2^-8 |A B|, not 2^-8 of the sum); an fp32 C takes the fp32 sum.
template <class T, GradientOf<T> U = T>
void gemm(const cuda& be, const Gemm& g, const T* a, const T* b, U* c, float beta, const char* kernel) {
  const float alpha = 1.0f;
  constexpr cudaDataType_t type = data_type<T>();
  const cublasStatus_t status =
      cublasGemmEx_64(be.cublas(), g.op_a, g.op_b, g.m, g.n, g.k, &alpha, a, type, g.lda, b, type, g.ldb, &beta, c,
                      data_type<U>(), g.ldc, compute_type<T>(be), CUBLAS_GEMM_DEFAULT);
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    cublas_check(status, (std::string(kernel) + ": cublasGemmEx_64(m = " + to_text(g.m) +
                          ", n = " + to_text(g.n) + ", k = " + to_text(g.k) + ")")
                             .c_str());
}

//! The alignment every one of `pointers` (nulls ignored) has: the largest of 16, 8, 4 and 2
//! bytes that divides each address.
inline std::uint32_t common_alignment(std::initializer_list<const void*> pointers) noexcept {
  std::uintptr_t bits = 16;
  for (const void* p : pointers)
    if (p != nullptr) bits |= reinterpret_cast<std::uintptr_t>(p);
  std::uint32_t alignment = 16;
  while (alignment > 2 && bits % alignment != 0) alignment /= 2;
  return alignment;
}

//! Runs `g` (C = op(A) op(B) + beta C, beta 0 or 1) through cuBLASLt with `epilogue` fused, on
//! the backend's stream: BIAS adds `operands.bias` (one value per row of the column-major C,
//! i.e. per output feature); GELU_AUX(_BIAS) writes GELU of the result and the result itself
//! into the matrix `operands.aux` (leading dimension `aux_ld`); DGELU multiplies the result by
//! GELU'(aux); BGRADB writes the sums of op(B) over k (one per column of C) to `operands.bias`.
//! Returns false, having launched nothing, when cuBLASLt cannot fuse it (an auxiliary leading
//! dimension not a multiple of 8, or no algorithm): the caller then runs the unfused kernels.
//! C (and the bias vector) are of U: T, or float for fp32 gradient sums of bf16 operands.
template <class T, GradientOf<T> U = T>
bool lt_gemm(cuda& be, const Gemm& g, const T* a, const T* b, U* c, float beta, cublasLtEpilogue_t epilogue,
             LtEpilogueOperands operands, std::int64_t aux_ld, const char* kernel) {
  LtGemms& lt = be.lt_gemms();
  if (operands.aux != nullptr && aux_ld % 8 != 0) {
    ++lt.counts().unfused;
    return false;
  }
  const LtGemmKey key{.op_a = g.op_a,
                      .op_b = g.op_b,
                      .m = g.m,
                      .n = g.n,
                      .k = g.k,
                      .lda = g.lda,
                      .ldb = g.ldb,
                      .ldc = g.ldc,
                      .data_type = data_type<T>(),
                      .output_type = data_type<U>(),
                      .compute_type = compute_type<T>(be),
                      .epilogue = epilogue,
                      .aux_ld = aux_ld,
                      .alignment = common_alignment({a, b, c, operands.bias, operands.aux, operands.addend})};
  LtGemmPlan& plan = lt.plan(key, operands);
  if (!plan.found()) {
    ++lt.counts().unfused;
    return false;
  }
  // Stream-ordered reuse of the cached block makes a per-call workspace free after the first.
  const Buffer<std::byte, cuda> workspace(be, static_cast<std::int64_t>(plan.workspace_bytes()),
                                           MemoryCategory::workspace);
  plan.run(lt.handle(), a, b, c, beta, operands, workspace.data(), be.stream(), kernel);
  ++lt.counts().fused;
  return true;
}

struct Dims {
  std::int64_t rows, in_features, out_features;
};

//! N (rows of `in`), C (its last extent) and OC (rows of `weight`, which must be [OC, C]).
template <class T>
Dims dims(const Tensor<const T>& in, const Tensor<const T>& weight, const char* kernel) {
  cuda_kernels::check_has_rows(in, kernel);
  const std::int64_t N = in.shape().rows(), C = in.shape().cols();
  if (weight.shape().rank() != 2)
    throw Error(std::string(kernel) + ": argument weight shape", to_text(weight.shape()),
                "expected [OC, C = " + to_text(C) + "]");
  check_shape(weight, Shape{weight.extent(0), C}, kernel, "weight");
  return {N, C, weight.extent(0)};
}

//! out[n, j] = bias[j]: x covers columns, y strides over rows. The GEMM then accumulates onto
//! the bias (beta 1), as the CPU kernel does, so that a bf16 output is rounded once.
template <class T>
__global__ void fill_bias_kernel(T* out, const T* bias, std::int64_t rows, std::int64_t cols) {
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= cols) return;
  const T b = bias[j];
  for (std::int64_t n = blockIdx.y; n < rows; n += gridDim.y) out[n * cols + j] = b;
}

//! Launches fill_bias_kernel over out[rows, cols].
template <class T>
void fill_bias(const cuda& be, T* out, const T* bias, std::int64_t rows, std::int64_t cols) {
  constexpr int threads = cuda_kernels::elementwise_threads;
  const dim3 grid(static_cast<unsigned>((cols + threads - 1) / threads),
                  static_cast<unsigned>(std::min<std::int64_t>(rows, 1024)));
  fill_bias_kernel<<<grid, threads, 0, be.stream()>>>(out, bias, rows, cols);
  cuda_check_launch("matmul fill_bias_kernel");
}

//! Row n's term of column j of the bias gradient: dout[n, j].
template <class T>
struct BiasGradTerm {
  const T* dout;
  std::int64_t cols;
  __device__ void operator()(std::int64_t n, std::int64_t j, accumulate_t<T> (&add)[1]) const {
    add[0] += to_accumulate(dout[n * cols + j]);
  }
};

//! dweight[OC,C] += dout^T in as matmul_backward's GEMM, with dbias[OC] += column sums of dout
//! from the same GEMM's BGRADB epilogue (summed in fp32, rounded to G into scratch, then added
//! by add_to). G is T, or float for fp32 gradient sums. False, having launched nothing, where
//! cuBLASLt cannot fuse it.
template <class T, GradientOf<T> G>
bool weight_and_bias_grad(cuda& be, G* dweight, G* dbias, const T* dout, const T* in, std::int64_t N, std::int64_t C,
                          std::int64_t OC, const char* kernel) {
  const Buffer<G, cuda> sums(be, OC, MemoryCategory::workspace);
  if (!lt_gemm(be, weight_grad_gemm(N, C, OC), in, dout, dweight, 1.0f, CUBLASLT_EPILOGUE_BGRADB,
               {.bias = sums.data()}, 0, kernel))
    return false;
  add_to<G>(be, Tensor<G>(dbias, Shape{OC}), Tensor<const G>(sums.data(), Shape{OC}));
  return true;
}

//! dbias[cols] += column sums of dout[rows, cols], in a fixed order (cuda_kernels::add_column_sums),
//! in fp32 and rounded once into a bf16 dbias (G = T), or added unrounded to fp32 sums (G = float).
template <class T, GradientOf<T> G>
void bias_grad(cuda& be, G* dbias, const T* dout, std::int64_t rows, std::int64_t cols) {
  cuda_kernels::add_column_sums<1>(be, cuda_kernels::ColumnOutputs<G, 1>{{dbias}}, rows, cols,
                                   BiasGradTerm<T>{dout, cols}, "matmul_backward bias gradient");
}

}  // namespace loom::detail::cuda_matmul

namespace loom::inline kernels {

//! out[N,OC] = in[N,C] · weight[OC,C]^T + bias[OC] + residual[N,OC] with N = in's rows, C = in's
//! last extent; `in`, `out` and `residual` may carry leading axes ([B,T,C] → [B,T,OC]). An empty
//! `bias` means no bias, an empty `residual` no residual (which must not be `out`). The bias rows
//! written by a kernel, then one cuBLAS GEMM accumulating onto them (TF32 products for float, bf16
//! products for bf16, fp32 accumulation), then the residual added (add_to); with
//! cuda::gemm_epilogues(), one cuBLASLt GEMM that adds the bias and the residual (its C) in fp32
//! before its one rounding, so the residual costs one read instead of add_to's pass.
template <class T>
void matmul_forward(cuda& be, Tensor<T> out, Tensor<const T> in, Tensor<const T> weight, Tensor<const T> bias,
                    Tensor<const T> residual = {}) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_matmul;
  constexpr const char* kernel = "matmul_forward";
  const d::Dims dims = d::dims(in, weight, kernel);
  const std::int64_t N = dims.rows, C = dims.in_features, OC = dims.out_features;
  detail::cuda_kernels::check_rows(out, N, OC, kernel, "out");
  if (!bias.empty()) check_shape(bias, Shape{OC}, kernel, "bias");
  if (!residual.empty()) detail::check_residual(residual, out, N, OC, kernel);
  if (N == 0 || OC == 0) return;
  check_data(in, kernel, "in");

  detail::cuda_kernels::activate(be);
  const bool adds = !bias.empty() || !residual.empty();
  if (adds && C > 0 && be.gemm_epilogues() &&
      d::lt_gemm(be, d::forward_gemm(N, C, OC), weight.data(), in.data(), out.data(), residual.empty() ? 0.0f : 1.0f,
                 bias.empty() ? CUBLASLT_EPILOGUE_DEFAULT : CUBLASLT_EPILOGUE_BIAS,
                 {.bias = bias.empty() ? nullptr : bias.data(), .addend = residual.empty() ? nullptr : residual.data()},
                 0, kernel))
    return;
  if (!bias.empty())
    d::fill_bias(be, out.data(), bias.data(), N, OC);
  else if (C == 0)  // unreachable today (a zero last extent leaves no rows), kept for the contract
    be.fill_zero(out.data(), sizeof(T) * static_cast<std::size_t>(N * OC));
  if (C > 0)
    d::gemm(be, d::forward_gemm(N, C, OC), weight.data(), in.data(), out.data(), bias.empty() ? 0.0f : 1.0f, kernel);
  if (!residual.empty()) add_to<T>(be, out, residual);
}

//! Backward of matmul_forward, accumulating: din[N,C] += dout·weight, dweight[OC,C] +=
//! dout^T·in, dbias[OC] += column sums of dout (with cuda::gemm_epilogues() and dweight, from
//! the dweight GEMM's epilogue). `din`, `dweight` and `dbias` may each be empty
//! (skipped): an empty `dweight` and `dbias` give the input-gradient pass of a split backward, an
//! empty `din` its weight-gradient pass; the two calls together compute the same bits as one.
//! `din_write` = GradientWrite::overwrite writes din = dout·weight (beta 0: din is not read).
//! `dweight` and `dbias` are of T, or for bf16 of float (G = accumulate_t<T>): fp32 gradient sums
//! the GEMM adds its fp32 products to (cuBLAS with fp32 C; Megatron-LM's gradient-accumulation
//! fusion, TrainerOptions::fp32_gradient_fusion).
template <class T, GradientOf<T> G = T>
void matmul_backward(cuda& be, Tensor<T> din, Tensor<G> dweight, Tensor<G> dbias,
                     Tensor<const T> dout, Tensor<const T> in, Tensor<const T> weight,
                     GradientWrite din_write = GradientWrite::accumulate) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_matmul;
  constexpr const char* kernel = "matmul_backward";
  const d::Dims dims = d::dims(in, weight, kernel);
  const std::int64_t N = dims.rows, C = dims.in_features, OC = dims.out_features;
  detail::cuda_kernels::check_rows(dout, N, OC, kernel, "dout");
  if (!dweight.empty()) check_shape(dweight, Shape{OC, C}, kernel, "dweight");
  if (!din.empty()) detail::cuda_kernels::check_rows(din, N, C, kernel, "din");
  if (!dbias.empty()) check_shape(dbias, Shape{OC}, kernel, "dbias");
  const bool accumulate_din = din_write == GradientWrite::accumulate;
  if (N == 0 || OC == 0) return;
  if (!dweight.empty()) check_data(in, kernel, "in");
  if (!dbias.empty()) detail::cuda_kernels::check_column_sum_rows(N, kernel);

  detail::cuda_kernels::activate(be);
  bool bias_done = false;
  if (C > 0) {
    if (!din.empty())
      d::gemm(be, d::input_grad_gemm(N, C, OC), weight.data(), dout.data(), din.data(), accumulate_din ? 1.0f : 0.0f,
              kernel);
    if (!dweight.empty()) {
      if (!dbias.empty() && be.gemm_epilogues())
        bias_done = d::weight_and_bias_grad(be, dweight.data(), dbias.data(), dout.data(), in.data(), N, C, OC, kernel);
      if (!bias_done)
        d::gemm(be, d::weight_grad_gemm(N, C, OC), in.data(), dout.data(), dweight.data(), 1.0f, kernel);
    }
  }
  if (!dbias.empty() && !bias_done) d::bias_grad(be, dbias.data(), dout.data(), N, OC);
}

}  // namespace loom::inline kernels
