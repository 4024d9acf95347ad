#pragma once
//! \file Multi-head self-attention on the CUDA backend, causal (GPT-2) or bidirectional (BERT;
//! loom::AttentionMask): cuBLAS strided-batched GEMMs (fp32 data with TF32 products where the
//! backend allows them, or bf16 data; fp32 accumulation, as in matmul.cuh) over the heads of one
//! batch element, reading q, k and v in place inside the packed qkv activations, and
//! one-warp-per-row kernels for the masked softmax and its backward. Two contracts:
//! attention_forward/backward save the probabilities att [B,NH,T,T] for the backward;
//! attention_forward_lse/backward_lse save only each row's log-sum-exp lse [B,NH,T] and the
//! backward recomputes the probabilities from the scores (FlashAttention's contract), so their
//! T x T blocks are workspace of one batch element. Both compute the whole T x T score matrix
//! for either mask; the causal row kernels zero its upper triangle. For bf16 with head size 32,
//! 64 or 128, unless cuda::set_flash_attention(false), the lse pair runs instead the SRAM-tiled
//! tensor-core kernels of detail/flash_attention.cuh (both masks, padded or not, with or without
//! attention dropout), which never form a T x T block, where the program holds them for the GPU
//! (sm_80 or newer; docs/cuda.md).

#include <cublas_api.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include "loom/backend/attention_mask.hpp"
#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/flash_attention.cuh"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/elementwise.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/backend/cuda/matmul.cuh"
#include "loom/backend/detail/attention_checks.hpp"
#include "loom/backend/gradient_write.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/dropout.hpp"
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

// The steps below are plain host code taking the GEMM and row kernels as callables, so that the
// host test runs these very sequences with cuBLAS emulated. `run_gemm(plan, a, b, c, float beta)`
// runs a BatchedGemm; the row callables take a [rows, T] block of T x T matrices in place, the
// index of the block's first sequence and its rows (and apply d.mask and d.lengths: the GEMMs are
// the same for every mask, and compute a padded sequence's masked scores too). `drop` is the dropout on the
// probabilities: `drop.probabilities(att_b, b)` gives the dropped probabilities of batch element
// b (what multiplies V, and what dV is formed from), `drop.gradient(dpre, b)` passes their
// gradient through the same mask in place; the softmax and its backward see the undropped ones.

//! The steps' `drop` without dropout.
struct NoDropout {
  template <class T>
  const T* probabilities(const T* att_b, std::int64_t) const {
    return att_b;
  }
  template <class T>
  void gradient(T*, std::int64_t) const {}
};

//! Raw scores of every head of batch element b into `att_b` ([NH,T,T]).
template <class T, class RunGemm>
void scores_step(const attention::Dims& d, std::int64_t b, const T* qkv, T* att_b, RunGemm&& run_gemm) {
  const T* q = qkv + b * d.tokens * 3 * d.channels;  // q of head 0; k at + C, v at + 2C
  run_gemm(scores_gemm(d), q + d.channels, q, att_b, 0.0f);
}

//! out of batch element b from its probabilities `att_b` ([NH,T,T]).
template <class T, class RunGemm>
void context_step(const attention::Dims& d, std::int64_t b, T* out, const T* att_b, const T* qkv,
                  RunGemm&& run_gemm) {
  const T* q = qkv + b * d.tokens * 3 * d.channels;
  run_gemm(context_gemm(d), q + 2 * d.channels, att_b, out + b * d.tokens * d.channels, 0.0f);
}

//! The backward of batch element b from its probabilities `att_b` ([NH,T,T]): datt into `dpre`
//! ([NH,T,T] scratch), dv, `run_softmax_grad(dpre, att_b, b, rows)` turning datt into the score
//! gradient in place, dq, dk. With dropout, dv comes from the dropped probabilities and datt
//! passes through the mask before the softmax's backward. `write` = overwrite runs the dq, dk
//! and dv GEMMs with beta 0 (each is written by one GEMM; padded positions come out 0).
template <class T, class RunGemm, class RunSoftmaxGrad, class Drop = NoDropout>
void backward_element(const attention::Dims& d, std::int64_t b, T* dqkv, const T* dout, const T* qkv,
                      const T* att_b, T* dpre, RunGemm&& run_gemm, RunSoftmaxGrad&& run_softmax_grad,
                      const Drop& drop = {}, GradientWrite write = GradientWrite::accumulate) {
  const std::int64_t Tn = d.tokens, C = d.channels;
  // Head 0 of batch element b; the plans step from head to head.
  const T* q = qkv + b * Tn * 3 * C;
  const T *k = q + C, *v = q + 2 * C;
  T* dq = dqkv + b * Tn * 3 * C;
  T *dk = dq + C, *dv = dq + 2 * C;
  const T* g = dout + b * Tn * C;
  const float beta = write == GradientWrite::accumulate ? 1.0f : 0.0f;
  run_gemm(att_grad_gemm(d), v, g, dpre, 0.0f);  // datt, the whole T x T of each head
  run_gemm(value_grad_gemm(d), g, drop.probabilities(att_b, b), dv, beta);
  drop.gradient(dpre, b);
  run_softmax_grad(dpre, att_b, b, d.heads * Tn);  // datt -> dpre, in place
  run_gemm(query_grad_gemm(d), k, dpre, dq, beta);
  run_gemm(key_grad_gemm(d), q, dpre, dk, beta);
}

//! attention_forward's steps in order, over all batch elements: the scores of every batch
//! element into att, `run_softmax(att, 0, rows)` over all of them at once, then out.
template <class T, class RunGemm, class RunSoftmax, class Drop = NoDropout>
void forward_steps(const attention::Dims& d, T* out, T* att, const T* qkv, RunGemm&& run_gemm,
                   RunSoftmax&& run_softmax, const Drop& drop = {}) {
  const std::int64_t B = d.batch, Tn = d.tokens, NH = d.heads;
  for (std::int64_t b = 0; b < B; ++b) scores_step(d, b, qkv, att + b * NH * Tn * Tn, run_gemm);
  run_softmax(att, std::int64_t{0}, B * NH * Tn);  // every row of every head at once
  for (std::int64_t b = 0; b < B; ++b)
    context_step(d, b, out, drop.probabilities(static_cast<const T*>(att + b * NH * Tn * Tn), b), qkv, run_gemm);
}

//! attention_backward's steps in order: backward_element for each batch element, reading att.
template <class T, class RunGemm, class RunSoftmaxGrad, class Drop = NoDropout>
void backward_steps(const attention::Dims& d, T* dqkv, const T* dout, const T* qkv, const T* att, T* dpre,
                    RunGemm&& run_gemm, RunSoftmaxGrad&& run_softmax_grad, const Drop& drop = {},
                    GradientWrite write = GradientWrite::accumulate) {
  const std::int64_t NH = d.heads, Tn = d.tokens;
  for (std::int64_t b = 0; b < d.batch; ++b)
    backward_element(d, b, dqkv, dout, qkv, att + b * NH * Tn * Tn, dpre, run_gemm, run_softmax_grad, drop, write);
}

//! attention_forward_lse's steps in order, one batch element at a time through `att_b` ([NH,T,T]
//! scratch): scores, `run_softmax_lse(att_b, lse_b, b, rows)` turning them into probabilities and
//! writing each row's log-sum-exp, out.
template <class T, class A, class RunGemm, class RunSoftmaxLse, class Drop = NoDropout>
void forward_lse_steps(const attention::Dims& d, T* out, A* lse, const T* qkv, T* att_b, RunGemm&& run_gemm,
                       RunSoftmaxLse&& run_softmax_lse, const Drop& drop = {}) {
  const std::int64_t rows = d.heads * d.tokens;  // of one batch element
  for (std::int64_t b = 0; b < d.batch; ++b) {
    scores_step(d, b, qkv, att_b, run_gemm);
    run_softmax_lse(att_b, lse + b * rows, b, rows);
    context_step(d, b, out, drop.probabilities(static_cast<const T*>(att_b), b), qkv, run_gemm);
  }
}

//! attention_backward_lse's steps in order, one batch element at a time: scores into `att_b`
//! ([NH,T,T] scratch), `run_probabilities(att_b, lse_b, b, rows)` recomputing the probabilities in
//! place, then backward_element from them with `dpre` ([NH,T,T] scratch).
template <class T, class A, class RunGemm, class RunProbabilities, class RunSoftmaxGrad, class Drop = NoDropout>
void backward_lse_steps(const attention::Dims& d, T* dqkv, const T* dout, const T* qkv, const A* lse, T* att_b,
                        T* dpre, RunGemm&& run_gemm, RunProbabilities&& run_probabilities,
                        RunSoftmaxGrad&& run_softmax_grad, const Drop& drop = {},
                        GradientWrite write = GradientWrite::accumulate) {
  const std::int64_t rows = d.heads * d.tokens;
  for (std::int64_t b = 0; b < d.batch; ++b) {
    scores_step(d, b, qkv, att_b, run_gemm);
    run_probabilities(att_b, lse + b * rows, b, rows);
    backward_element(d, b, dqkv, dout, qkv, att_b, dpre, run_gemm, run_softmax_grad, drop, write);
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

//! Which keys the rows of a row kernel's [rows, tokens] block see: the mask, and for padded
//! sequences their lengths (device memory, [B]); row r is query r % tokens of sequence
//! first_sequence + r / rows_per_sequence (rows_per_sequence = NH·T).
struct RowKeys {
  AttentionMask mask = AttentionMask::causal;
  const std::int32_t* lengths = nullptr;  //!< null: every sequence is `tokens` long
  std::int64_t first_sequence = 0, rows_per_sequence = 1;
};

//! In a one-warp-per-row kernel over [rows, tokens]: this thread's lane, its warp's row (>= rows
//! for the warps past the end), the query t = row % tokens of that row and the keys [0, keys) it
//! sees: t + 1 with the causal mask, all tokens with the bidirectional one, none at or past its
//! sequence's length, and none at all for a padded query (the length is read only for rows <
//! rows).
struct WarpRow {
  int lane;
  std::int64_t row, t, tokens, keys;
  __device__ WarpRow(std::int64_t rows, std::int64_t tokens_, const RowKeys& k)
      : lane(static_cast<int>(threadIdx.x % 32)),
        row(static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32),
        t(row % tokens_),
        tokens(tokens_),
        keys(k.mask == AttentionMask::causal ? t + 1 : tokens_) {
    if (k.lengths != nullptr && row < rows) {
      const std::int64_t length = k.lengths[k.first_sequence + row / k.rows_per_sequence];
      keys = t >= length ? 0 : keys < length ? keys : length;
    }
  }
};

//! The keys s >= keys of the warp's row `a` become 0 (the causal mask's upper triangle and a
//! padded sequence's padding; nothing else with the bidirectional mask).
template <class T>
__device__ inline void zero_past_keys(T* a, const WarpRow& w) {
  for (std::int64_t s = w.keys + w.lane; s < w.tokens; s += 32) a[s] = T(0.0f);
}

//! One warp per row of att, in place: the raw scores x[0..keys) that query t sees become
//! softmax((x - max) * scale), the other keys (s > t, causal) become 0 (the CPU kernel's formula;
//! scale > 0, so the raw max is the scaled max). Row r of [rows, tokens] is query t = r % tokens.
//! Where `lse` is not null, lse[r] = max * scale + log sum_s exp((x_s - max) * scale), the row's
//! log-sum-exp. In float; the exps are computed twice (for the sum, then for the result) so that a
//! bf16 probability is rounded once. Each lane reads back only the elements it wrote, so no
//! barrier is needed.
template <class T>
__global__ void softmax_forward_kernel(T* att, float* lse, std::int64_t rows, std::int64_t tokens, float scale,
                                       RowKeys keys) {
  const WarpRow w(rows, tokens, keys);
  if (w.row >= rows) return;  // the whole warp leaves together
  T* a = att + w.row * tokens;
  float max = to_accumulate(a[0]);  // key 0 is visible to every real query
  for (std::int64_t s = w.lane; s < w.keys; s += 32) max = fmaxf(max, to_accumulate(a[s]));
  max = warp_max(max);
  float sum = 0;
  for (std::int64_t s = w.lane; s < w.keys; s += 32) sum += expf((to_accumulate(a[s]) - max) * scale);
  sum = cuda_kernels::warp_sum(sum);  // >= 1 (the max term is exp(0)), or 0 for a padded query
  if (lse != nullptr && w.lane == 0) lse[w.row] = w.keys > 0 ? max * scale + logf(sum) : 0.0f;
  const float inverse = w.keys > 0 ? 1.0f / sum : 0.0f;
  for (std::int64_t s = w.lane; s < w.keys; s += 32)
    a[s] = static_cast<T>(expf((to_accumulate(a[s]) - max) * scale) * inverse);
  zero_past_keys(a, w);
}

//! One warp per row of att, in place: the raw scores x[0..keys) that query t sees become the
//! probabilities exp(x * scale - lse[r]) that softmax_forward_kernel computed, the other keys
//! become 0. The fused multiply-add rounds x * scale - lse once, so a probability keeps float's
//! relative accuracy however large the scores are.
template <class T>
__global__ void probabilities_kernel(T* att, const float* lse, std::int64_t rows, std::int64_t tokens, float scale,
                                     RowKeys keys) {
  const WarpRow w(rows, tokens, keys);
  if (w.row >= rows) return;  // the whole warp leaves together
  T* a = att + w.row * tokens;
  const float shift = lse[w.row];
  for (std::int64_t s = w.lane; s < w.keys; s += 32)
    a[s] = static_cast<T>(expf(fmaf(to_accumulate(a[s]), scale, -shift)));
  zero_past_keys(a, w);
}

//! One warp per row, in place: the gradient g = datt of row t becomes the gradient of the raw
//! scores, att * (g - sum_s att g) * scale over the keys s that t sees, and 0 elsewhere.
template <class T>
__global__ void softmax_backward_kernel(T* grad, const T* att, std::int64_t rows, std::int64_t tokens, float scale,
                                        RowKeys keys) {
  const WarpRow w(rows, tokens, keys);
  if (w.row >= rows) return;  // the whole warp leaves together
  T* g = grad + w.row * tokens;
  const T* a = att + w.row * tokens;
  float dot = 0;
  for (std::int64_t s = w.lane; s < w.keys; s += 32) dot += to_accumulate(a[s]) * to_accumulate(g[s]);
  const float shift = cuda_kernels::warp_sum(dot);
  for (std::int64_t s = w.lane; s < w.keys; s += 32)
    g[s] = static_cast<T>(to_accumulate(a[s]) * (to_accumulate(g[s]) - shift) * scale);
  zero_past_keys(g, w);
}

// The same two kernels reading and writing a row 16 bytes at a time, where tokens is a multiple
// of the vector's elements and the buffers are 16-byte aligned. The scalar kernels wait for each
// load in turn (a store to the row may alias the next load): on an H100 the backward moved 1 TB/s,
// a third of the card's bandwidth, and the pair took 9 of a bf16 GPT-2 small step's 50 ms of
// kernels. Lane l takes vectors l, l + 32, ... of the row in every pass, so it reads back only
// what it wrote, as in the scalar kernels.

//! softmax_forward_kernel, a vector at a time.
template <class T>
__global__ void softmax_forward_vector_kernel(T* att, float* lse, std::int64_t rows, std::int64_t tokens,
                                              float scale, RowKeys keys) {
  using V = cuda_kernels::Vector16<T>;
  constexpr int E = V::elements;
  const WarpRow w(rows, tokens, keys);
  if (w.row >= rows) return;  // the whole warp leaves together
  V* a = reinterpret_cast<V*>(att + w.row * tokens);
  // used: the vectors holding keys [0, keys) (t / E + 1 for the causal mask).
  const std::int64_t used = (w.keys + E - 1) / E, vectors = tokens / E;
  float max = to_accumulate(a[0].value[0]);  // key 0 is visible to every real query
  for (std::int64_t v = w.lane; v < used; v += 32) {
    const V x = a[v];
    for (int e = 0; e < E; ++e)
      if (v * E + e < w.keys) max = fmaxf(max, to_accumulate(x.value[e]));
  }
  max = warp_max(max);
  float sum = 0;
  for (std::int64_t v = w.lane; v < used; v += 32) {
    const V x = a[v];
    for (int e = 0; e < E; ++e)
      if (v * E + e < w.keys) sum += expf((to_accumulate(x.value[e]) - max) * scale);
  }
  sum = cuda_kernels::warp_sum(sum);  // >= 1 (the max term is exp(0)), or 0 for a padded query
  if (lse != nullptr && w.lane == 0) lse[w.row] = w.keys > 0 ? max * scale + logf(sum) : 0.0f;
  const float inverse = w.keys > 0 ? 1.0f / sum : 0.0f;
  for (std::int64_t v = w.lane; v < vectors; v += 32) {
    V x = v < used ? a[v] : V{};  // every element is written below: keys past the row's become 0
    for (int e = 0; e < E; ++e)
      x.value[e] = v * E + e < w.keys ? static_cast<T>(expf((to_accumulate(x.value[e]) - max) * scale) * inverse)
                                      : T(0.0f);
    a[v] = x;
  }
}

//! softmax_backward_kernel, a vector at a time.
template <class T>
__global__ void softmax_backward_vector_kernel(T* grad, const T* att, std::int64_t rows, std::int64_t tokens,
                                               float scale, RowKeys keys) {
  using V = cuda_kernels::Vector16<T>;
  constexpr int E = V::elements;
  const WarpRow w(rows, tokens, keys);
  if (w.row >= rows) return;  // the whole warp leaves together
  V* g = reinterpret_cast<V*>(grad + w.row * tokens);
  const V* a = reinterpret_cast<const V*>(att + w.row * tokens);
  const std::int64_t used = (w.keys + E - 1) / E, vectors = tokens / E;
  float dot = 0;
  for (std::int64_t v = w.lane; v < used; v += 32) {
    const V x = a[v], y = g[v];
    for (int e = 0; e < E; ++e)
      if (v * E + e < w.keys) dot += to_accumulate(x.value[e]) * to_accumulate(y.value[e]);
  }
  const float shift = cuda_kernels::warp_sum(dot);
  for (std::int64_t v = w.lane; v < vectors; v += 32) {
    V y;
    if (v < used) {
      const V x = a[v];
      y = g[v];
      for (int e = 0; e < E; ++e)
        y.value[e] = v * E + e < w.keys
                         ? static_cast<T>(to_accumulate(x.value[e]) * (to_accumulate(y.value[e]) - shift) * scale)
                         : T(0.0f);
    } else {
      for (int e = 0; e < E; ++e) y.value[e] = T(0.0f);
    }
    g[v] = y;
  }
}

// The launchers: one warp per row of [rows, tokens] (rows, tokens > 0); `kernel` names the
// public kernel in a launch error.

//! Launches softmax_forward_kernel (writing lse where it is not null).
template <class T>
void softmax_forward(const cuda& be, T* att, float* lse, std::int64_t rows, std::int64_t tokens, float scale,
                     const RowKeys& keys, const char* kernel) {
  namespace k = cuda_kernels;
  const auto kernel_function =
      cuda_kernels::vector_rows<T>(tokens, att) ? softmax_forward_vector_kernel<T> : softmax_forward_kernel<T>;
  kernel_function<<<k::row_blocks(rows), 32 * k::warps_per_block, 0, be.stream()>>>(att, lse, rows, tokens, scale,
                                                                                    keys);
  cuda_check_launch((std::string(kernel) + " softmax_forward_kernel").c_str());
}

//! Launches probabilities_kernel.
template <class T>
void probabilities(const cuda& be, T* att, const float* lse, std::int64_t rows, std::int64_t tokens, float scale,
                   const RowKeys& keys, const char* kernel) {
  namespace k = cuda_kernels;
  probabilities_kernel<<<k::row_blocks(rows), 32 * k::warps_per_block, 0, be.stream()>>>(att, lse, rows, tokens,
                                                                                        scale, keys);
  cuda_check_launch((std::string(kernel) + " probabilities_kernel").c_str());
}

//! Launches softmax_backward_kernel over grad and att.
template <class T>
void softmax_backward(const cuda& be, T* grad, const T* att, std::int64_t rows, std::int64_t tokens, float scale,
                      const RowKeys& keys, const char* kernel) {
  namespace k = cuda_kernels;
  const auto kernel_function =
      cuda_kernels::vector_rows<T>(tokens, grad, att) ? softmax_backward_vector_kernel<T> : softmax_backward_kernel<T>;
  kernel_function<<<k::row_blocks(rows), 32 * k::warps_per_block, 0, be.stream()>>>(grad, att, rows, tokens, scale,
                                                                                    keys);
  cuda_check_launch((std::string(kernel) + " softmax_backward_kernel").c_str());
}

//! What every attention kernel does after its shape checks: false where there is nothing to do
//! (B, T or C is 0; nothing is read), else checks that qkv has data and makes the backend's
//! device current.
template <class T>
bool ready_to_run(const cuda& be, const attention::Dims& d, const Tensor<const T>& qkv, const char* kernel) {
  if (d.empty()) return false;
  check_data(qkv, kernel, "qkv");
  cuda_kernels::activate(be);
  return true;
}

//! The steps' `drop` on the device: the dropout kernel (the CPU's mask) on batch element b's
//! [NH,T,T] block, whose elements are the global tensor's from head_origin(b, 0, T) on (a rank's
//! heads are consecutive). The dropped probabilities go to `dropped` ([NH,T,T] of workspace).
template <class T>
struct DeviceDropout {
  const cuda* be;
  AttentionDropout dropout;
  std::int64_t tokens, block;  // T, and NH·T·T
  T* dropped;

  std::int64_t first(std::int64_t b) const { return static_cast<std::int64_t>(dropout.head_origin(b, 0, tokens)); }
  const T* probabilities(const T* att_b, std::int64_t b) const {
    be->copy(dropped, att_b, sizeof(T) * static_cast<std::size_t>(block));
    kernels::dropout<T>(*be, Tensor<T>(dropped, Shape{block}), dropout.mask, first(b));
    return dropped;
  }
  void gradient(T* dpre, std::int64_t b) const {
    kernels::dropout<T>(*be, Tensor<T>(dpre, Shape{block}), dropout.mask, first(b));
  }
};

//! Calls f(drop) with the steps' `drop` for `dropout`: NoDropout where it is inactive, else a
//! DeviceDropout over one [NH,T,T] block of workspace from the caching allocator (returned when f
//! returns, while the stream may still use it: safe, as for the kernels' other scratch).
template <class T, class F>
void with_dropout(cuda& be, const attention::Dims& d, const AttentionDropout& dropout, F&& f) {
  if (!dropout.mask.active()) return f(NoDropout{});
  const std::int64_t block = d.heads * d.tokens * d.tokens;
  const Buffer<T, cuda> dropped(be, block, MemoryCategory::workspace);
  f(DeviceDropout<T>{&be, dropout, d.tokens, block, dropped.data()});
}

//! The softmax scale 1/sqrt(hs) in float, the CPU kernel's value.
inline float softmax_scale(const attention::Dims& d) {
  return 1.0f / std::sqrt(static_cast<float>(d.head_size));
}

//! d::gemm on the backend's stream as the steps' `run_gemm`, naming `kernel` in a cuBLAS error.
template <class T>
auto gemm_runner(const cuda& be, const char* kernel) {
  return [&be, kernel](const BatchedGemm& g, const T* a, const T* b, T* c, float beta) {
    gemm(be, g, a, b, c, beta, kernel);
  };
}

//! The RowKeys of d's rows from sequence `first_sequence` on: d's mask and (device) lengths.
inline RowKeys row_keys(const attention::Dims& d, std::int64_t first_sequence) {
  return {d.mask, d.lengths, first_sequence, d.heads * d.tokens};
}

//! The steps' `run_softmax_grad`: softmax_backward_kernel on the backend's stream, with d's mask
//! and lengths.
template <class T>
auto softmax_grad_runner(const cuda& be, const attention::Dims& d, const char* kernel) {
  return [&be, d, scale = softmax_scale(d), kernel](T* grad, const T* att, std::int64_t first_sequence,
                                                    std::int64_t rows) {
    softmax_backward(be, grad, att, rows, d.tokens, scale, row_keys(d, first_sequence), kernel);
  };
}

// The SRAM-tiled path (detail/flash_attention.cuh).

//! `answer()` for the backend's device, computed once per device and per `Question` (a type of
//! its own for each use: each instantiation keeps its own answers).
template <class Question>
bool once_per_device(const cuda& be, Question&& answer) {
  static std::mutex mutex;
  static std::map<int, bool> known;  // by device
  const std::lock_guard lock(mutex);
  if (const auto it = known.find(be.device()); it != known.end()) return it->second;
  const bool value = answer();
  known.emplace(be.device(), value);
  return value;
}

//! Whether this program's tiled kernels run on the backend's (current) device: compiled, as
//! SASS or PTX, for sm_80 or newer, where bf16 mma.sync exists. Built only for older architectures
//! (CMake's default CUDA architecture is one) they are empty, and are never launched.
inline bool flash_built_for(const cuda& be) {
  return once_per_device(be, [] {
    cudaFuncAttributes attributes{};
    const cudaError_t status = cudaFuncGetAttributes(&attributes, flash::forward_kernel<64>);
    if (status != cudaSuccess) (void)cudaGetLastError();  // no image for this device: not usable
    return status == cudaSuccess && attributes.ptxVersion >= flash::minimum_architecture &&
           attributes.binaryVersion >= flash::minimum_architecture;
  });
}

//! Whether this program holds the GroupTiles (wgmma) kernels for the backend's device: built
//! for sm_90a, which a probe kernel says (an sm_90 or PTX image has the same attributes).
inline bool group_built_for(const cuda& be) {
  return once_per_device(be, [&be] {
    if (!flash_built_for(be)) return false;
    int* flag = nullptr;
    LOOM_CUDA_CHECK(cudaMalloc(&flag, sizeof(int)));
    flash::group_probe_kernel<<<1, 1, 0, be.stream()>>>(flag);
    int host = 0;
    cudaError_t status = cudaGetLastError();
    if (status == cudaSuccess)
      status = cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, be.stream());
    if (status == cudaSuccess) status = cudaStreamSynchronize(be.stream());
    LOOM_CUDA_CHECK(cudaFree(flag));
    cuda_check(status, "flash::group_probe_kernel (whether the wgmma attention kernels are built for this GPU)");
    return host == 1;
  });
}

//! Whether the tiled kernels for `d` take the warpgroup's products: the backend's switch on, head
//! size 64 and the kernels built for the device.
inline bool use_group(const cuda& be, const attention::Dims& d) {
  return be.warpgroup_attention() && d.head_size == flash::group_head_size && group_built_for(be);
}

//! Whether the lse pair of T on `be` runs the tiled kernels for `d`: bf16 (padded or not), a head
//! size they are built for, the backend's switch on, at most 65535 tiles of 64 tokens (the grid's
//! y), and the kernels compiled for the device's architecture.
template <class T>
bool use_flash(const cuda& be, const attention::Dims& d) {
  return std::is_same_v<T, bf16> && be.flash_attention() &&
         flash::supported_head_size(d.head_size) && flash::tiles(d.tokens) <= 65535 && flash_built_for(be);
}

//! Calls `f.template operator()<HS>()` with the compile-time head size HS = d.head_size (one of
//! flash::supported_head_size's).
template <class F>
void with_head_size(const attention::Dims& d, F&& f) {
  switch (d.head_size) {
    case 32: f.template operator()<32>(); break;
    case 64: f.template operator()<64>(); break;
    case 128: f.template operator()<128>(); break;
    default: throw Error("attention: flash head size", d.head_size, "expected 32, 64 or 128");
  }
}

inline flash::Shape flash_shape(const attention::Dims& d) {
  return {d.tokens, d.channels, static_cast<int>(d.heads), softmax_scale(d), d.mask, d.lengths};
}

//! The grid of a tiled kernel whose warps own m blocks of 16 rows: x = b NH + h, y = the tile of
//! 64 m tokens.
inline dim3 flash_grid(const attention::Dims& d, int m) {
  return dim3(static_cast<unsigned>(d.batch * d.heads), static_cast<unsigned>(flash::row_tiles(d.tokens, m)), 1);
}

//! Lets `kernel` take `bytes` of dynamic shared memory (above the default 48 KiB), then launches
//! it on the backend's stream with flash::threads per block.
template <class... Params, class... Args>
void launch_tiled(const cuda& be, void (*kernel)(Params...), dim3 grid, std::size_t bytes, const char* name,
                  const char* what, Args&&... args) {
  LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  kernel<<<grid, flash::threads, bytes, be.stream()>>>(std::forward<Args>(args)...);
  cuda_check_launch((std::string(name) + " " + what).c_str());
}

//! attention_forward_lse on the tiled kernel: one block per 64 flash::row_blocks.forward query
//! rows of each (b, h); with an active `dropout`, its build that draws the mask.
inline void flash_forward(const cuda& be, const attention::Dims& d, bf16* out, float* lse, const bf16* qkv,
                          const AttentionDropout& dropout, const char* name) {
  const flash::ForwardArgs args{flash_shape(d), qkv, out, lse};
  if (use_group(be, d)) {
    const bool drop = dropout.mask.active();
    launch_tiled(be, drop ? flash::forward_group_kernel<true> : flash::forward_group_kernel<false>, flash_grid(d, 1),
                 flash::ForwardSmem<flash::group_head_size, flash::GroupTiles>::total, name,
                 drop ? "flash::forward_group_kernel<dropout>" : "flash::forward_group_kernel", args, dropout);
    return;
  }
  const dim3 grid = flash_grid(d, flash::row_blocks.forward);
  with_head_size(d, [&]<int HS>() {
    if (dropout.mask.active())
      launch_tiled(be, flash::forward_dropout_kernel<HS>, grid, flash::ForwardSmem<HS>::total, name,
                   "flash::forward_dropout_kernel", args, dropout);
    else
      launch_tiled(be, flash::forward_kernel<HS>, grid, flash::ForwardSmem<HS>::total, name, "flash::forward_kernel",
                   args);
  });
}

//! attention_backward_lse on the tiled kernels: delta = rowsum(dout * out) into [B,NH,T] floats
//! of workspace (out is the dropped one, so delta needs no mask), then dk and dv (a block per 64
//! flash::row_blocks.key_value_grad keys), then dq (a block per 64 row_blocks.query_grad queries);
//! with an active `dropout`, the builds of the last two that draw the forward's mask again.
//! `write` = overwrite: dqkv written, padded rows 0, never read.
inline void flash_backward(cuda& be, const attention::Dims& d, bf16* dqkv, const bf16* dout, const bf16* qkv,
                           const bf16* out, const float* lse, const AttentionDropout& dropout, GradientWrite write,
                           const char* name) {
  const std::int64_t rows = d.batch * d.heads * d.tokens;
  // Returned to the cache while the stream may still use it: safe, as in attention_backward.
  const Buffer<float, cuda> delta(be, rows, MemoryCategory::workspace);
  const bool accumulate = write == GradientWrite::accumulate;
  const flash::BackwardArgs args{flash_shape(d), qkv, dout, lse, delta.data(), dqkv, accumulate};
  if (!accumulate && args.shape.lengths != nullptr)
    launch_tiled(be, flash::zero_padding_kernel<>, dim3(static_cast<unsigned>(d.batch * d.tokens)), 0, name,
                 "flash::zero_padding_kernel", args);
  with_head_size(d, [&]<int HS>() {
    launch_tiled(be, flash::delta_kernel<HS>, dim3(flash::delta_blocks<HS>(rows)), 0, name, "flash::delta_kernel",
                 out, dout, delta.data(), args.shape, rows);
    if (use_group(be, d)) {
      const bool drop = dropout.mask.active();
      const dim3 grid = flash_grid(d, 1);
      launch_tiled(be, drop ? flash::key_value_grad_group_kernel<true> : flash::key_value_grad_group_kernel<false>,
                   grid, flash::KeyValueGradSmem<flash::group_head_size, flash::GroupTiles>::total, name,
                   drop ? "flash::key_value_grad_group_kernel<dropout>" : "flash::key_value_grad_group_kernel", args,
                   dropout);
      launch_tiled(be, drop ? flash::query_grad_group_kernel<true> : flash::query_grad_group_kernel<false>, grid,
                   flash::QueryGradSmem<flash::group_head_size, flash::GroupTiles>::total, name,
                   drop ? "flash::query_grad_group_kernel<dropout>" : "flash::query_grad_group_kernel", args, dropout);
      return;
    }
    const dim3 key_grid = flash_grid(d, flash::row_blocks.key_value_grad);
    const dim3 query_grid = flash_grid(d, flash::row_blocks.query_grad);
    if (dropout.mask.active()) {
      launch_tiled(be, flash::key_value_grad_dropout_kernel<HS>, key_grid, flash::KeyValueGradSmem<HS>::total, name,
                   "flash::key_value_grad_dropout_kernel", args, dropout);
      launch_tiled(be, flash::query_grad_dropout_kernel<HS>, query_grid, flash::QueryGradSmem<HS>::total, name,
                   "flash::query_grad_dropout_kernel", args, dropout);
    } else {
      launch_tiled(be, flash::key_value_grad_kernel<HS>, key_grid, flash::KeyValueGradSmem<HS>::total, name,
                   "flash::key_value_grad_kernel", args);
      launch_tiled(be, flash::query_grad_kernel<HS>, query_grid, flash::QueryGradSmem<HS>::total, name,
                   "flash::query_grad_kernel", args);
    }
  });
}

}  // namespace loom::detail::cuda_attention

namespace loom::inline kernels {

//! Whether attention_forward_lse/backward_lse on bf16 can take the SRAM-tiled kernels on `be`'s
//! GPU: this program holds them compiled for sm_80 or newer (CMAKE_CUDA_ARCHITECTURES, e.g. 90)
//! and the GPU is one. Where false they take the cuBLAS path whatever be.flash_attention() says.
inline bool flash_attention_available(const cuda& be) {
  detail::cuda_kernels::activate(be);
  return detail::cuda_attention::flash_built_for(be);
}

//! Whether the tiled attention at head size 64 can multiply with wgmma on `be`'s GPU (when
//! be.warpgroup_attention() is on): this program holds those kernels, built for sm_90a
//! (CMAKE_CUDA_ARCHITECTURES=90a; an H100 or H200).
inline bool warpgroup_attention_available(const cuda& be) {
  detail::cuda_kernels::activate(be);
  return detail::cuda_attention::group_built_for(be);
}

//! Whether bf16 attention of heads `head_size` wide can take the tiled kernels on `be`'s GPU:
//! flash_attention_available(be) and a head size they are built for (32, 64 or 128).
inline bool flash_attention_available(const cuda& be, std::int64_t head_size) {
  return detail::flash::supported_head_size(head_size) && flash_attention_available(be);
}

//! Multi-head self-attention forward, causal (GPT-2, the default) or bidirectional (BERT), the
//! contract of the CPU kernel: `qkv` [B,T,3C] packs per token q, k, v (each C wide; head h owns
//! channels [h*hs, (h+1)*hs), hs = C/num_heads). Writes `att` [B,NH,T,T], the softmax of
//! q·k/sqrt(hs) over the keys s that query t sees (`mask`: s <= t, entries s > t exactly 0; or
//! every s < T), and `out` [B,T,C], per head att·v, heads concatenated. Throws loom::Error, before
//! any CUDA call, on shapes that do not match, a num_heads that does not divide C or a mask that is
//! not an AttentionMask value. Per batch element two cuBLAS calls (the full T x T scores for
//! either mask); one softmax launch for the whole batch. With an active `dropout` (each of the four
//! kernels takes one, the CPU kernels' contract and mask) out = dropout(att)·v and att stays the
//! softmax: per batch element a copy of its probabilities goes through the dropout kernel into
//! [NH,T,T] of workspace, and the backward passes datt through the same mask. With `keys.lengths`
//! ([B] in device memory, each in [1, T]; the values are the caller's to check, as the Trainer
//! does on the host) keys at or past a sequence's length get probability exactly 0 and a padded
//! query's att row and out are 0, as on the CPU; the GEMMs still compute the padding.
template <class T>
void attention_forward(cuda& be, Tensor<T> out, Tensor<T> att, Tensor<const T> qkv, int num_heads,
                       AttentionKeys keys = AttentionMask::causal, const AttentionDropout& dropout = {}) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_attention;
  constexpr const char* kernel = "attention_forward";
  const detail::attention::Dims dims = detail::attention::check_forward(out, att, qkv, num_heads, keys);
  if (!d::ready_to_run(be, dims, qkv, kernel)) return;
  const float scale = d::softmax_scale(dims);
  d::with_dropout<T>(be, dims, dropout, [&](const auto& drop) {
    d::forward_steps(
        dims, out.data(), att.data(), qkv.data(), d::gemm_runner<T>(be, kernel),
        [&](T* scores, std::int64_t first_sequence, std::int64_t rows) {
          d::softmax_forward(be, scores, static_cast<float*>(nullptr), rows, dims.tokens, scale,
                             d::row_keys(dims, first_sequence), kernel);
        },
        drop);
  });
}

//! Multi-head self-attention backward: `dqkv` [B,T,3C] += the gradient w.r.t. `qkv` given `dout`
//! [B,T,C] and the probabilities `att` [B,NH,T,T] saved by attention_forward with the same
//! `mask`. Scratch: the score gradient of one batch element, [NH,T,T] elements of T from the
//! backend's caching allocator (category workspace), reused for every batch element and returned
//! before this ends. Per batch element four cuBLAS calls and one launch; no atomics, so the result
//! is the same bits on every run. `dqkv_write` = GradientWrite::overwrite writes dqkv (beta 0)
//! instead of adding into it, as on the CPU.
template <class T>
void attention_backward(cuda& be, Tensor<T> dqkv, Tensor<const T> dout, Tensor<const T> qkv,
                        Tensor<const T> att, int num_heads, AttentionKeys keys = AttentionMask::causal,
                        const AttentionDropout& dropout = {}, GradientWrite dqkv_write = GradientWrite::accumulate) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_attention;
  constexpr const char* kernel = "attention_backward";
  const detail::attention::Dims dims = detail::attention::check_backward(dqkv, dout, qkv, att, num_heads, keys);
  if (!d::ready_to_run(be, dims, qkv, kernel)) return;
  // Freed (into the cache) when this returns, while the stream may still be using it: the
  // allocator hands a block out again only to work on the same stream, which runs after ours.
  const Buffer<T, cuda> scratch(be, dims.heads * dims.tokens * dims.tokens, MemoryCategory::workspace);
  d::with_dropout<T>(be, dims, dropout, [&](const auto& drop) {
    d::backward_steps(dims, dqkv.data(), dout.data(), qkv.data(), att.data(), scratch.data(),
                      d::gemm_runner<T>(be, kernel), d::softmax_grad_runner<T>(be, dims, kernel), drop, dqkv_write);
  });
}

//! Multi-head self-attention forward (causal or bidirectional, `mask`) that saves only the row
//! log-sum-exp (the FlashAttention contract; Megatron's selective recomputation): `out` [B,T,C] as
//! attention_forward, and `lse` [B,NH,T] = log sum_s exp(q_t·k_s/sqrt(hs)) over the keys s that t
//! sees, computed as max·scale + log sum exp((x - max)·scale), in float for T = float and bf16. The
//! probabilities of one batch element at a time live in [NH,T,T] elements of T of workspace from
//! the backend's caching allocator (instead of B·NH·T² saved per layer), returned before this
//! ends. Throws loom::Error, before any CUDA call, as attention_forward. Per batch element two
//! cuBLAS calls and one launch. bf16 with head size 32, 64 or 128 (and be.flash_attention()) takes
//! the SRAM-tiled kernel instead, for either mask, padded or not, with or without dropout (drawn in
//! the kernel, the same mask): one launch, no workspace, lse = m + log l of the online softmax.
template <class T>
void attention_forward_lse(cuda& be, Tensor<T> out, Tensor<accumulate_t<T>> lse, Tensor<const T> qkv,
                           int num_heads, AttentionKeys keys = AttentionMask::causal,
                           const AttentionDropout& dropout = {}) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_attention;
  constexpr const char* kernel = "attention_forward_lse";
  const detail::attention::Dims dims = detail::attention::check_forward_lse(out, lse, qkv, num_heads, keys);
  if (!d::ready_to_run(be, dims, qkv, kernel)) return;
  if constexpr (std::is_same_v<T, bf16>) {
    if (d::use_flash<T>(be, dims)) {
      d::flash_forward(be, dims, out.data(), lse.data(), qkv.data(), dropout, kernel);
      return;
    }
  }
  const float scale = d::softmax_scale(dims);
  // Returned to the cache while the stream may still use it: safe, as in attention_backward.
  const Buffer<T, cuda> scratch(be, dims.heads * dims.tokens * dims.tokens, MemoryCategory::workspace);
  d::with_dropout<T>(be, dims, dropout, [&](const auto& drop) {
    d::forward_lse_steps(
        dims, out.data(), lse.data(), qkv.data(), scratch.data(), d::gemm_runner<T>(be, kernel),
        [&](T* scores, float* lse_b, std::int64_t b, std::int64_t rows) {
          d::softmax_forward(be, scores, lse_b, rows, dims.tokens, scale, d::row_keys(dims, b), kernel);
        },
        drop);
  });
}

//! Multi-head self-attention backward from the `out` [B,T,C] and `lse` [B,NH,T] that
//! attention_forward_lse wrote with the same `mask`: `dqkv` [B,T,3C] += the gradient w.r.t. `qkv`
//! given `dout` [B,T,C]. Per batch element the scores are recomputed and turned into the
//! probabilities exp(x·scale - lse) (causal: 0 above the diagonal), then attention_backward's
//! steps run on them. Scratch: [NH,T,T] probabilities and [NH,T,T] score gradients of one batch
//! element (2·NH·T² elements of T, workspace), returned before this ends. Per batch element five
//! cuBLAS calls and two launches; no atomics. bf16 with head size 32, 64 or 128 (and
//! be.flash_attention()) takes the SRAM-tiled kernels instead, for either mask, padded or not,
//! with or without dropout: D = rowsum(dout·out) into B·NH·T floats of workspace, then one launch
//! for dk and dv and one for dq (each drawing the forward's dropout mask again), each gradient
//! element written by one block (the same bits every run). `dqkv_write` as for
//! attention_backward.
template <class T>
void attention_backward_lse(cuda& be, Tensor<T> dqkv, Tensor<const T> dout, Tensor<const T> qkv,
                            Tensor<const T> out, Tensor<const accumulate_t<T>> lse, int num_heads,
                            AttentionKeys keys = AttentionMask::causal, const AttentionDropout& dropout = {},
                            GradientWrite dqkv_write = GradientWrite::accumulate) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace d = detail::cuda_attention;
  constexpr const char* kernel = "attention_backward_lse";
  const detail::attention::Dims dims =
      detail::attention::check_backward_lse(dqkv, dout, qkv, out, lse, num_heads, keys);
  if (!d::ready_to_run(be, dims, qkv, kernel)) return;
  if constexpr (std::is_same_v<T, bf16>) {
    if (d::use_flash<T>(be, dims)) {
      d::flash_backward(be, dims, dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), dropout, dqkv_write,
                        kernel);
      return;
    }
  }
  const float scale = d::softmax_scale(dims);
  const std::int64_t block = dims.heads * dims.tokens * dims.tokens;  // one [NH,T,T]
  const Buffer<T, cuda> scratch(be, 2 * block, MemoryCategory::workspace);
  d::with_dropout<T>(be, dims, dropout, [&](const auto& drop) {
    d::backward_lse_steps(
        dims, dqkv.data(), dout.data(), qkv.data(), lse.data(), scratch.data(), scratch.data() + block,
        d::gemm_runner<T>(be, kernel),
        [&](T* scores, const float* lse_b, std::int64_t b, std::int64_t rows) {
          d::probabilities(be, scores, lse_b, rows, dims.tokens, scale, d::row_keys(dims, b), kernel);
        },
        d::softmax_grad_runner<T>(be, dims, kernel), drop, dqkv_write);
  });
}

}  // namespace loom::inline kernels
