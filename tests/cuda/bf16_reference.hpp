#pragma once
// The CPU backend's bf16 kernels, which the CUDA bf16 tests compare with, built by g++ in
// bf16_reference.cpp (the CPU kernels stay out of the nvcc translation unit). Flat vectors in,
// flat vectors out; the shapes as in the kernels' contracts. Two CPU threads.

#include <cstdint>
#include <vector>

#include "loom/backend/gelu.hpp"
#include "loom/core/bf16.hpp"
#include "loom/optim/update_rules.hpp"

namespace loom::cuda_test::cpu_bf16 {

using Vec = std::vector<bf16>;
using Floats = std::vector<float>;
using Ids = std::vector<std::int32_t>;

//! out[N, OC] = in[N, C] weight[OC, C]^T (+ bias[OC] where bias is not empty).
void matmul_forward(Vec& out, const Vec& in, const Vec& weight, const Vec& bias, std::int64_t N, std::int64_t C,
                    std::int64_t OC);
//! din += dout weight, dweight += dout^T in, dbias += column sums of dout.
void matmul_backward(Vec& din, Vec& dweight, Vec& dbias, const Vec& dout, const Vec& in, const Vec& weight,
                     std::int64_t N, std::int64_t C, std::int64_t OC);
void layernorm_forward(Vec& out, Floats& mean, Floats& rstd, const Vec& in, const Vec& weight, const Vec& bias,
                       std::int64_t N, std::int64_t C);
void layernorm_backward(Vec& din, Vec& dweight, Vec& dbias, const Vec& dout, const Vec& in, const Vec& weight,
                        const Floats& mean, const Floats& rstd, std::int64_t N, std::int64_t C);
void gelu_forward(Vec& out, const Vec& in, Gelu kind = Gelu::tanh);
void gelu_backward(Vec& din, const Vec& in, const Vec& dout, Gelu kind = Gelu::tanh);
void residual_forward(Vec& out, const Vec& a, const Vec& b);
void residual_backward(Vec& da, Vec& db, const Vec& dout);
//! qkv [B, T, 3C], att [B, NH, T, T], out [B, T, C].
void attention_forward(Vec& out, Vec& att, const Vec& qkv, std::int64_t B, std::int64_t T, std::int64_t C,
                       int heads);
void attention_backward(Vec& dqkv, const Vec& dout, const Vec& qkv, const Vec& att, std::int64_t B, std::int64_t T,
                        std::int64_t C, int heads);
//! tokens [B, T], slice [rows, C], wpe [max_t, C].
void embedding_forward(Vec& out, const Ids& tokens, const Vec& slice, std::int64_t vocab_begin, const Vec& wpe,
                       std::int64_t B, std::int64_t T, std::int64_t C);
void embedding_backward(Vec& dslice, std::int64_t vocab_begin, Vec& dwpe, const Vec& dout, const Ids& tokens,
                        std::int64_t B, std::int64_t T, std::int64_t C);
//! The vocabulary-parallel cross-entropy over one slice [N, Vs] that holds the whole vocabulary
//! (`vocab` real columns): the row statistics (`statistics` [3N]: row_max [N], then partials
//! [2, N]) and the float losses of the logits.
void cross_entropy_forward(Floats& losses, std::vector<double>& statistics, const Vec& logits, const Ids& targets,
                           std::int64_t N, std::int64_t Vs, std::int64_t vocab);
//! dlogits from the logits and cross_entropy_forward's statistics.
void cross_entropy_backward(Vec& dlogits, const Vec& logits, const std::vector<double>& statistics, const Ids& targets,
                            std::int64_t N, std::int64_t Vs, std::int64_t vocab, float scale);
//! dlogits from probabilities.
void cross_entropy_backward_from_probs(Vec& dlogits, const Vec& probs, const Ids& targets, std::int64_t N,
                                       std::int64_t Vs, std::int64_t vocab, float scale);
void adamw_update(Vec& params, const Vec& grads, Floats& master, Floats& m, Floats& v, const AdamWUpdate& h);
double sum_of_squares(const Vec& x);
void scale(Vec& x, double factor);

}  // namespace loom::cuda_test::cpu_bf16
