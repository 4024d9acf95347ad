#pragma once
//! \file Causal multi-head self-attention (GPT-2) on the CUDA backend: cuBLAS strided-batched
//! GEMMs (fp32 data with TF32 products where the backend allows them, or bf16 data; fp32
//! accumulation, as in matmul.cuh) over the
//! heads of one batch element, reading q, k and v in place inside the packed qkv activations,
//! and one-warp-per-row kernels for the causal softmax and its backward. This first version
//! computes the whole T x T score matrix and zeroes its upper triangle; a flash-style tiled
//! kernel that skips it (and never stores att) comes later.

#include <cublas_api.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/backend/cuda/matmul.cuh"
#include "loom/backend/detail/attention_checks.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/memory.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_attention {

using cuda_matmul::Gemm;

//! `batch` column-major cuBLAS GEMMs of one shape `gemm`; the i-th reads A + i stride_a and
//! B + i stride_b and writes C + i stride_c (strides in elements).
struct BatchedGemm {
  Gemm gemm;
  std::int64_t stride_a, stride_b, stride_c, batch;
  friend bool operator==(const BatchedGemm&, const BatchedGemm&) = default;
};

// The GEMM plans, one batch element at a time, one GEMM per head. In row-major terms, for
// batch element b and head h (hs = head_size, C = channels, T = tokens):
//   q_h, k_h, v_h  [T, hs], rows 3C apart, at qkv_b + h hs (+ C for k, + 2C for v);
//   out_h, dout_h  [T, hs], rows C apart, at out_b + h hs;
//   att_h, datt    [T, T], contiguous, at att_b + h T T.
// cuBLAS reads a row-major [rows, cols] matrix with leading dimension ld as the column-major
// [cols, rows] transpose, so each plan computes the transpose of its row-major product.
// The heads of one batch element are one strided batch: head h + 1 starts hs elements after
// head h inside the qkv and out rows, and T T after it in att. Across batch elements the
// offsets are T 3C (qkv) but only hs apart between heads, which no single stride covers, so we
// loop over b: B calls of NH GEMMs each. (cublasGemmBatchedEx could take all B NH GEMMs at once,
// but needs device arrays of pointers built and copied for every call.) The C matrices of the
// heads interleave (columns of the same rows) without sharing an element, and cuBLAS writes
// only the m x n elements of each C, so the heads of a batch never write the same memory.

//! att_h = q_h k_h^T (raw scores, unscaled), i.e. att_h^T = k_h q_h^T: A = k (op T), B = q.
inline BatchedGemm scores_gemm(const attention::Dims& d) {
  const std::int64_t T = d.tokens, C = d.channels, hs = d.head_size;
  return {{CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, 3 * C, 3 * C, T}, hs, hs, T * T, d.heads};
}
//! out_h = att_h v_h, i.e. out_h^T = v_h^T att_h^T: A = v, B = att.
inline BatchedGemm context_gemm(const attention::Dims& d) {
  const std::int64_t T = d.tokens, C = d.channels, hs = d.head_size;
  return {{CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 3 * C, T, C}, hs, T * T, hs, d.heads};
}
//! datt_h = dout_h v_h^T, i.e. datt_h^T = v_h dout_h^T: A = v (op T), B = dout.
inline BatchedGemm att_grad_gemm(const attention::Dims& d) {
  const std::int64_t T = d.tokens, C = d.channels, hs = d.head_size;
  return {{CUBLAS_OP_T, CUBLAS_OP_N, T, T, hs, 3 * C, C, T}, hs, hs, T * T, d.heads};
}
//! dv_h += att_h^T dout_h, i.e. dv_h^T += dout_h^T att_h: A = dout, B = att (op T).
inline BatchedGemm value_grad_gemm(const attention::Dims& d) {
  const std::int64_t T = d.tokens, C = d.channels, hs = d.head_size;
  return {{CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, C, T, 3 * C}, hs, T * T, hs, d.heads};
}
//! dq_h += dpre_h k_h, i.e. dq_h^T += k_h^T dpre_h^T: A = k, B = dpre.
inline BatchedGemm query_grad_gemm(const attention::Dims& d) {
  const std::int64_t T = d.tokens, C = d.channels, hs = d.head_size;
  return {{CUBLAS_OP_N, CUBLAS_OP_N, hs, T, T, 3 * C, T, 3 * C}, hs, T * T, hs, d.heads};
}
//! dk_h += dpre_h^T q_h, i.e. dk_h^T += q_h^T dpre_h: A = q, B = dpre (op T).
inline BatchedGemm key_grad_gemm(const attention::Dims& d) {
  const std::int64_t T = d.tokens, C = d.channels, hs = d.head_size;
  return {{CUBLAS_OP_N, CUBLAS_OP_T, hs, T, T, 3 * C, T, 3 * C}, hs, T * T, hs, d.heads};
}

//! The forward's steps in order, over all batch elements: `run_gemm(plan, a, b, c, float beta)` runs a
//! BatchedGemm, `run_softmax(att, rows)` turns `rows` rows of raw scores into probabilities.
//! Plain host code, so that the host test runs this very sequence with cuBLAS emulated.
template <class T, class RunGemm, class RunSoftmax>
void forward_steps(const attention::Dims& d, T* out, T* att, const T* qkv, RunGemm&& run_gemm,
                   RunSoftmax&& run_softmax) {
  const std::int64_t B = d.batch, Tn = d.tokens, C = d.channels, NH = d.heads;
  const BatchedGemm scores = scores_gemm(d), context = context_gemm(d);
  for (std::int64_t b = 0; b < B; ++b) {
    const T* q = qkv + b * Tn * 3 * C;  // q of head 0 of batch element b; k at + C, v at + 2C
    run_gemm(scores, q + C, q, att + b * NH * Tn * Tn, 0.0f);
  }
  run_softmax(att, B * NH * Tn);  // every row of every head at once
  for (std::int64_t b = 0; b < B; ++b) {
    const T* q = qkv + b * Tn * 3 * C;
    run_gemm(context, q + 2 * C, att + b * NH * Tn * Tn, out + b * Tn * C, 0.0f);
  }
}

//! The backward's steps in order: per batch element, datt into `dpre` ([NH,T,T] scratch), dv,
//! `run_softmax_grad(dpre, att_b, rows)` turning datt into the score gradient in place, dq, dk.
template <class T, class RunGemm, class RunSoftmaxGrad>
void backward_steps(const attention::Dims& d, T* dqkv, const T* dout, const T* qkv, const T* att, T* dpre,
                    RunGemm&& run_gemm, RunSoftmaxGrad&& run_softmax_grad) {
  const std::int64_t B = d.batch, Tn = d.tokens, C = d.channels, NH = d.heads;
  const BatchedGemm att_grad = att_grad_gemm(d), value_grad = value_grad_gemm(d),
                    query_grad = query_grad_gemm(d), key_grad = key_grad_gemm(d);
  for (std::int64_t b = 0; b < B; ++b) {
    // Head 0 of batch element b; the plans step from head to head.
    const T* q = qkv + b * Tn * 3 * C;
    const T *k = q + C, *v = q + 2 * C;
    T* dq = dqkv + b * Tn * 3 * C;
    T *dk = dq + C, *dv = dq + 2 * C;
    const T* g = dout + b * Tn * C;
    const T* a = att + b * NH * Tn * Tn;
    run_gemm(att_grad, v, g, dpre, 0.0f);  // datt, the whole T x T of each head
    run_gemm(value_grad, g, a, dv, 1.0f);
    run_softmax_grad(dpre, a, NH * Tn);  // datt -> dpre, in place
    run_gemm(query_grad, k, dpre, dq, 1.0f);
    run_gemm(key_grad, q, dpre, dk, 1.0f);
  }
}

//! Runs `g` on the backend's stream: C = A B (beta 0, C is not read) or C += A B (beta 1); T in
//! and out, fp32 scalars and accumulation.
template <class T>
void gemm(const cuda& be, const BatchedGemm& g, const T* a, const T* b, T* c, float beta, const char* kernel) {
  const float alpha = 1.0f;
  const Gemm& s = g.gemm;
  constexpr cudaDataType_t type = cuda_matmul::data_type<T>();
  const cublasStatus_t status = cublasGemmStridedBatchedEx_64(
      be.cublas(), s.op_a, s.op_b, s.m, s.n, s.k, &alpha, a, type, s.lda, g.stride_a, b, type, s.ldb, g.stride_b,
      &beta, c, type, s.ldc, g.stride_c, g.batch, cuda_matmul::compute_type<T>(be), CUBLAS_GEMM_DEFAULT);
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    cublas_check(status, (std::string(kernel) + ": cublasGemmStridedBatchedEx_64(m = " + to_text(s.m) +
                          ", n = " + to_text(s.n) + ", k = " + to_text(s.k) + ", batch = " +
                          to_text(g.batch) + ")")
                             .c_str());
}

//! Maximum over the 32 lanes of a warp (butterfly: every lane gets the same value).
template <class T>
__device__ inline T warp_max(T value) {
  for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
  return value;
}

//! One warp per row of att, in place: the raw scores x[0..t] of query t become
//! softmax((x - max) * scale), the keys s > t become 0 (the CPU kernel's formula; scale > 0, so
//! the raw max is the scaled max). Row r of [rows = B NH T, tokens] is query t = r % tokens.
//! In float; the exps are computed twice (for the sum, then for the result) so that a bf16
//! probability is rounded once. Each lane reads back only the elements it wrote, so no barrier
//! is needed.
template <class T>
__global__ void softmax_forward_kernel(T* att, std::int64_t rows, std::int64_t tokens, float scale) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp leaves together
  const std::int64_t t = row % tokens;
  T* a = att + row * tokens;
  float max = to_accumulate(a[0]);  // key 0 is visible to every query
  for (std::int64_t s = lane; s <= t; s += 32) max = fmaxf(max, to_accumulate(a[s]));
  max = warp_max(max);
  float sum = 0;
  for (std::int64_t s = lane; s <= t; s += 32) sum += expf((to_accumulate(a[s]) - max) * scale);
  const float inverse = 1.0f / cuda_kernels::warp_sum(sum);  // sum >= 1: the max term is exp(0)
  for (std::int64_t s = lane; s <= t; s += 32)
    a[s] = static_cast<T>(expf((to_accumulate(a[s]) - max) * scale) * inverse);
  for (std::int64_t s = t + 1 + lane; s < tokens; s += 32) a[s] = T(0.0f);
}

//! One warp per row, in place: the gradient g = datt of row t becomes the gradient of the raw
//! scores, att * (g - sum_s att g) * scale over s <= t and 0 above the diagonal.
template <class T>
__global__ void softmax_backward_kernel(T* grad, const T* att, std::int64_t rows, std::int64_t tokens, float scale) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp leaves together
  const std::int64_t t = row % tokens;
  T* g = grad + row * tokens;
  const T* a = att + row * tokens;
  float dot = 0;
  for (std::int64_t s = lane; s <= t; s += 32) dot += to_accumulate(a[s]) * to_accumulate(g[s]);
  const float shift = cuda_kernels::warp_sum(dot);
  for (std::int64_t s = lane; s <= t; s += 32)
    g[s] = static_cast<T>(to_accumulate(a[s]) * (to_accumulate(g[s]) - shift) * scale);
  for (std::int64_t s = t + 1 + lane; s < tokens; s += 32) g[s] = T(0.0f);
}

//! Launches softmax_forward_kernel over att[rows, tokens] (rows, tokens > 0).
template <class T>
void softmax_forward(const cuda& be, T* att, std::int64_t rows, std::int64_t tokens, float scale) {
  namespace k = cuda_kernels;
  softmax_forward_kernel<<<k::row_blocks(rows), 32 * k::warps_per_block, 0, be.stream()>>>(att, rows, tokens,
                                                                                          scale);
  cuda_check_launch("attention_forward softmax_forward_kernel");
}

//! Launches softmax_backward_kernel over grad and att [rows, tokens] (rows, tokens > 0).
template <class T>
void softmax_backward(const cuda& be, T* grad, const T* att, std::int64_t rows, std::int64_t tokens, float scale) {
  namespace k = cuda_kernels;
  softmax_backward_kernel<<<k::row_blocks(rows), 32 * k::warps_per_block, 0, be.stream()>>>(grad, att, rows,
                                                                                           tokens, scale);
  cuda_check_launch("attention_backward softmax_backward_kernel");
}

}  // namespace loom::detail::cuda_attention

namespace loom::inline kernels {

//! Causal multi-head self-attention forward (GPT-2), the contract of the CPU kernel: `qkv`
//! [B,T,3C] packs per token q, k, v (each C wide; head h owns channels [h*hs, (h+1)*hs),
//! hs = C/num_heads). Writes `att` [B,NH,T,T], the softmax of q·k/sqrt(hs) over keys s <= t
//! (entries s > t are exactly 0), and `out` [B,T,C], per head att·v, heads concatenated.
//! Throws loom::Error, before any CUDA call, on shapes that do not match or a num_heads that
//! does not divide C. Per batch element two cuBLAS calls; one softmax launch for the whole batch.
template <class T>
void attention_forward(const cuda& be, Tensor<T> out, Tensor<T> att, Tensor<const T> qkv, int num_heads) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_attention;
  constexpr const char* kernel = "attention_forward";
  const detail::attention::Dims dims = detail::attention::check_forward(out, att, qkv, num_heads);
  if (dims.batch == 0 || dims.tokens == 0 || dims.channels == 0) return;
  check_data(qkv, kernel, "qkv");

  detail::cuda_kernels::activate(be);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dims.head_size));  // the CPU kernel's value
  d::forward_steps(
      dims, out.data(), att.data(), qkv.data(),
      [&](const d::BatchedGemm& g, const T* x, const T* y, T* z, float beta) { d::gemm(be, g, x, y, z, beta, kernel); },
      [&](T* scores, std::int64_t rows) { d::softmax_forward(be, scores, rows, dims.tokens, scale); });
}

//! Causal multi-head self-attention backward: `dqkv` [B,T,3C] += the gradient w.r.t. `qkv`
//! given `dout` [B,T,C] and the probabilities `att` [B,NH,T,T] saved by attention_forward.
//! Scratch: the score gradient of one batch element, [NH,T,T] floats from the backend's caching
//! allocator (category workspace), reused for every batch element and returned before this
//! ends. Per batch element four cuBLAS calls and one launch; no atomics, so the result is the
//! same bits on every run.
template <class T>
void attention_backward(cuda& be, Tensor<T> dqkv, Tensor<const T> dout, Tensor<const T> qkv,
                        Tensor<const T> att, int num_heads) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_attention;
  constexpr const char* kernel = "attention_backward";
  const detail::attention::Dims dims = detail::attention::check_backward(dqkv, dout, qkv, att, num_heads);
  if (dims.batch == 0 || dims.tokens == 0 || dims.channels == 0) return;
  check_data(qkv, kernel, "qkv");

  detail::cuda_kernels::activate(be);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dims.head_size));
  // Freed (into the cache) when this returns, while the stream may still be using it: the
  // allocator hands a block out again only to work on the same stream, which runs after ours.
  const Buffer<T, cuda> scratch(be, dims.heads * dims.tokens * dims.tokens, MemoryCategory::workspace);
  d::backward_steps(
      dims, dqkv.data(), dout.data(), qkv.data(), att.data(), scratch.data(),
      [&](const d::BatchedGemm& g, const T* x, const T* y, T* z, float beta) { d::gemm(be, g, x, y, z, beta, kernel); },
      [&](T* grad, const T* probabilities, std::int64_t rows) {
        d::softmax_backward(be, grad, probabilities, rows, dims.tokens, scale);
      });
}

}  // namespace loom::inline kernels
