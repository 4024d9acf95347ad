// The CPU backend's bf16 kernels on flat vectors (see bf16_reference.hpp), built by g++.

#include "bf16_reference.hpp"

#include "loom/backend/cpu/kernels.hpp"

namespace loom::cuda_test::cpu_bf16 {

namespace {

const cpu& backend() {
  static const cpu be(2);
  return be;
}

Tensor<bf16> t(Vec& v, Shape s) { return {v.data(), s}; }
Tensor<const bf16> c(const Vec& v, Shape s) { return {v.data(), s}; }

}  // namespace

void matmul_forward(Vec& out, const Vec& in, const Vec& weight, const Vec& bias, std::int64_t N, std::int64_t C,
                    std::int64_t OC) {
  kernels::matmul_forward<bf16>(backend(), t(out, {N, OC}), c(in, {N, C}), c(weight, {OC, C}),
                                bias.empty() ? Tensor<const bf16>{} : c(bias, {OC}));
}

void matmul_backward(Vec& din, Vec& dweight, Vec& dbias, const Vec& dout, const Vec& in, const Vec& weight,
                     std::int64_t N, std::int64_t C, std::int64_t OC) {
  kernels::matmul_backward<bf16>(backend(), t(din, {N, C}), t(dweight, {OC, C}), t(dbias, {OC}), c(dout, {N, OC}),
                                 c(in, {N, C}), c(weight, {OC, C}));
}

void layernorm_forward(Vec& out, Floats& mean, Floats& rstd, const Vec& in, const Vec& weight, const Vec& bias,
                       std::int64_t N, std::int64_t C) {
  kernels::layernorm_forward<bf16>(backend(), t(out, {N, C}), Tensor<float>(mean.data(), {N}),
                                   Tensor<float>(rstd.data(), {N}), c(in, {N, C}), c(weight, {C}), c(bias, {C}));
}

void layernorm_backward(Vec& din, Vec& dweight, Vec& dbias, const Vec& dout, const Vec& in, const Vec& weight,
                        const Floats& mean, const Floats& rstd, std::int64_t N, std::int64_t C) {
  kernels::layernorm_backward<bf16>(backend(), t(din, {N, C}), t(dweight, {C}), t(dbias, {C}), c(dout, {N, C}),
                                    c(in, {N, C}), c(weight, {C}), Tensor<const float>(mean.data(), {N}),
                                    Tensor<const float>(rstd.data(), {N}));
}

void gelu_forward(Vec& out, const Vec& in, Gelu kind) {
  const auto n = static_cast<std::int64_t>(in.size());
  kernels::gelu_forward<bf16>(backend(), t(out, {n}), c(in, {n}), kind);
}

void gelu_backward(Vec& din, const Vec& in, const Vec& dout, Gelu kind) {
  const auto n = static_cast<std::int64_t>(in.size());
  kernels::gelu_backward<bf16>(backend(), t(din, {n}), c(in, {n}), c(dout, {n}), kind);
}

void residual_forward(Vec& out, const Vec& a, const Vec& b) {
  const auto n = static_cast<std::int64_t>(a.size());
  kernels::residual_forward<bf16>(backend(), t(out, {n}), c(a, {n}), c(b, {n}));
}

void residual_backward(Vec& da, Vec& db, const Vec& dout) {
  const auto n = static_cast<std::int64_t>(dout.size());
  kernels::residual_backward<bf16>(backend(), t(da, {n}), t(db, {n}), c(dout, {n}));
}

void attention_forward(Vec& out, Vec& att, const Vec& qkv, std::int64_t B, std::int64_t T, std::int64_t C,
                       int heads) {
  kernels::attention_forward<bf16>(backend(), t(out, {B, T, C}), t(att, {B, heads, T, T}), c(qkv, {B, T, 3 * C}),
                                   heads);
}

void attention_backward(Vec& dqkv, const Vec& dout, const Vec& qkv, const Vec& att, std::int64_t B, std::int64_t T,
                        std::int64_t C, int heads) {
  kernels::attention_backward<bf16>(backend(), t(dqkv, {B, T, 3 * C}), c(dout, {B, T, C}), c(qkv, {B, T, 3 * C}),
                                    c(att, {B, heads, T, T}), heads);
}

void embedding_forward(Vec& out, const Ids& tokens, const Vec& slice, std::int64_t vocab_begin, const Vec& wpe,
                       std::int64_t B, std::int64_t T, std::int64_t C) {
  const auto rows = static_cast<std::int64_t>(slice.size()) / C, max_t = static_cast<std::int64_t>(wpe.size()) / C;
  kernels::vocab_parallel_embedding_forward<bf16>(backend(), t(out, {B, T, C}),
                                                  Tensor<const std::int32_t>(tokens.data(), {B, T}),
                                                  c(slice, {rows, C}), vocab_begin, c(wpe, {max_t, C}));
}

void embedding_backward(Vec& dslice, std::int64_t vocab_begin, Vec& dwpe, const Vec& dout, const Ids& tokens,
                        std::int64_t B, std::int64_t T, std::int64_t C) {
  const auto rows = static_cast<std::int64_t>(dslice.size()) / C, max_t = static_cast<std::int64_t>(dwpe.size()) / C;
  kernels::vocab_parallel_embedding_backward<bf16>(backend(), t(dslice, {rows, C}), vocab_begin, t(dwpe, {max_t, C}),
                                                   c(dout, {B, T, C}),
                                                   Tensor<const std::int32_t>(tokens.data(), {B, T}));
}

void cross_entropy_forward(Floats& losses, std::vector<double>& statistics, const Vec& logits, const Ids& targets,
                           std::int64_t N, std::int64_t Vs, std::int64_t vocab) {
  statistics.assign(static_cast<std::size_t>(3 * N), 0.0);
  const Tensor<double> row_max(statistics.data(), {N}), partials(statistics.data() + N, {2, N});
  const Tensor<const std::int32_t> ids(targets.data(), {N});
  kernels::vocab_parallel_cross_entropy_statistics<bf16>(backend(), row_max, partials, c(logits, {N, Vs}), ids, 0,
                                                         vocab);
  kernels::vocab_parallel_cross_entropy_losses<bf16>(backend(), Tensor<float>(losses.data(), {N}),
                                                     Tensor<const double>(row_max), Tensor<const double>(partials),
                                                     ids);
}

void cross_entropy_backward(Vec& dlogits, const Vec& logits, const std::vector<double>& statistics, const Ids& targets,
                            std::int64_t N, std::int64_t Vs, std::int64_t vocab, float scale) {
  kernels::vocab_parallel_cross_entropy_backward<bf16>(
      backend(), t(dlogits, {N, Vs}), c(logits, {N, Vs}), Tensor<const double>(statistics.data(), {N}),
      Tensor<const double>(statistics.data() + N, {2, N}), Tensor<const std::int32_t>(targets.data(), {N}), 0, vocab,
      scale);
}

void cross_entropy_backward_from_probs(Vec& dlogits, const Vec& probs, const Ids& targets, std::int64_t N,
                                       std::int64_t Vs, std::int64_t vocab, float scale) {
  kernels::vocab_parallel_cross_entropy_backward<bf16>(backend(), t(dlogits, {N, Vs}), c(probs, {N, Vs}),
                                                       Tensor<const std::int32_t>(targets.data(), {N}), 0, vocab,
                                                       scale);
}

void adamw_update(Vec& params, const Vec& grads, Floats& master, Floats& m, Floats& v, const AdamWUpdate& h) {
  const auto n = static_cast<std::int64_t>(params.size());
  kernels::adamw_update<bf16>(backend(), t(params, {n}), c(grads, {n}), Tensor<float>(master.data(), {n}),
                              Tensor<float>(m.data(), {n}), Tensor<float>(v.data(), {n}), h);
}

double sum_of_squares(const Vec& x) {
  return kernels::sum_of_squares<bf16>(backend(), c(x, {static_cast<std::int64_t>(x.size())}));
}

void scale(Vec& x, double factor) {
  kernels::scale<bf16>(backend(), t(x, {static_cast<std::int64_t>(x.size())}), factor);
}

}  // namespace loom::cuda_test::cpu_bf16
