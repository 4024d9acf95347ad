// The CUDA kernels on bf16 tensors against the CPU backend's bf16 kernels (built by g++ in
// bf16_reference.cpp) on the same inputs. Both load bf16 as float, compute and accumulate in
// float and round each stored result once, so they differ by the float sums' order and by the
// last rounding:
//
//   |device - cpu| <= 2^-8 (2 r |cpu| + e sqrt(K) t) + 2^-22 K sqrt(K) t
//
// with 2^-8 the unit roundoff of bf16, r the bf16 roundings of the result on each side (1; 2 for
// the cross-entropy's probabilities: exps, then probabilities), K the reduction length behind
// the result, t the size of one of its terms, and e the intermediate roundings the device takes
// inside the reduction and the CPU does not (0 but for attention, whose scores, score gradients
// and probabilities pass through bf16 between the cuBLAS calls, as in llm.c, and for GEMMs that
// accumulate into bf16, where cuBLAS may round the product before adding). The last part
// allows a few float ulps per term for another summation order. The embedding gives the CPU's
// bits (the same float additions in the same order); sum_of_squares accumulates in double (1e-12).
// Attention with only the row log-sum-exp saved gives the CPU's out and gradient (the CPU's stored
// path) within the same bounds plus its recomputed probabilities' roundings; its float lse is
// checked against a double loop over the bf16 inputs (lse_reference).
//
// Without a GPU the host case runs (the GEMM data types, the CPU reference) and the program exits
// with 77 (ctest: skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "bf16_reference.hpp"
#include "device_check.hpp"
#include "loom/backend/cuda/kernels.cuh"
#include "loom/core/bf16.hpp"
#include "loom/core/buffer.hpp"

using namespace loom::cuda_test;
using loom::bf16;
using loom::Buffer;
using loom::Gelu;
using loom::MemoryCategory;
using loom::Shape;
using loom::Tensor;
namespace ref = loom::cuda_test::cpu_bf16;

namespace {

template <class E>
using Device = DeviceArray<E>;

struct Bound {
  std::int64_t terms = 1;     //!< K
  double term = 1.0;          //!< t
  double roundings = 1.0;     //!< r
  double intermediate = 0.0;  //!< e
};

//! The bound of the file comment, element by element.
void check_bf16(const std::vector<bf16>& got, const std::vector<bf16>& want, const Bound& b, const std::string& what) {
  REQUIRE(got.size() == want.size());
  const double k = static_cast<double>(b.terms), u = 1.0 / 256;
  std::vector<double> expected, bound;
  for (bf16 w : want) {
    const double value = static_cast<float>(w);
    expected.push_back(value);
    bound.push_back(u * (2 * b.roundings * std::abs(value) + b.intermediate * std::sqrt(k) * b.term) +
                    std::ldexp(1.0, -22) * k * std::sqrt(k) * b.term);
  }
  check_close(floats_of(got), expected, bound, 1.0, what, 0.0);
}

//! The row log-sum-exp [B, NH, T] of causal attention over `qkv` [B, T, 3C], in double, and its
//! bound: a score x rounded to bf16 moves lse by up to 2^-8 |x| scale, and the float softmax adds
//! (T + 64) 2^-24 (1 + |max scale|).
struct LseReference {
  std::vector<double> value, bound;
};
LseReference lse_reference(const std::vector<bf16>& qkv, std::int64_t B, std::int64_t T, std::int64_t NH,
                           std::int64_t hs) {
  const std::vector<float> x = floats_of(qkv);
  const std::int64_t C = NH * hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  LseReference r;
  std::vector<double> scores;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < NH; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        scores.clear();
        const float* q = x.data() + (b * T + t) * 3 * C + h * hs;
        for (std::int64_t s = 0; s <= t; ++s) {
          const float* k = x.data() + (b * T + s) * 3 * C + C + h * hs;
          double dot = 0;
          for (std::int64_t i = 0; i < hs; ++i) dot += static_cast<double>(q[i]) * k[i];
          scores.push_back(dot * scale);
        }
        const double max = *std::max_element(scores.begin(), scores.end());
        double sum = 0, largest = 0;
        for (const double score : scores) {
          sum += std::exp(score - max);
          largest = std::max(largest, std::abs(score));
        }
        r.value.push_back(max + std::log(sum));
        r.bound.push_back(largest / 256 + static_cast<double>(T + 64) * std::ldexp(1.0, -24) * (1 + std::abs(max)));
      }
  return r;
}

}  // namespace

TEST_CASE("bf16: the GEMMs take bf16 data; the CPU reference runs (host)") {
  CHECK(loom::detail::cuda_matmul::data_type<bf16>() == CUDA_R_16BF);
  CHECK(loom::detail::cuda_matmul::data_type<float>() == CUDA_R_32F);
  static_assert(loom::detail::cuda_kernels::supported<bf16>);
  std::vector<bf16> out(1), in{bf16(2.0f)}, weight{bf16(3.0f)}, bias{bf16(0.5f)};
  ref::matmul_forward(out, in, weight, bias, 1, 1, 1);
  CHECK(static_cast<float>(out[0]) == 6.5f);
}

TEST_CASE("bf16: matmul forward and backward (bf16 cuBLAS GEMMs, fp32 accumulation)") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  struct Size {
    std::int64_t N, C, OC;
  };
  for (const Size s : {Size{1, 1, 1}, Size{3, 5, 7}, Size{65, 33, 17}, Size{256, 768, 512}}) {
    CAPTURE(s.N);
    CAPTURE(s.C);
    CAPTURE(s.OC);
    const std::int64_t N = s.N, C = s.C, OC = s.OC;
    const auto in = random_bf16(N * C, 1), weight = random_bf16(OC * C, 2), bias = random_bf16(OC, 3),
               dout = random_bf16(N * OC, 4), din0 = random_bf16(N * C, 5), dweight0 = random_bf16(OC * C, 6),
               dbias0 = random_bf16(OC, 7);
    const Device<bf16> d_in(be, in, {N, C}), d_weight(be, weight, {OC, C}), d_bias(be, bias, {OC}),
        d_dout(be, dout, {N, OC});
    for (const bool with_bias : {true, false}) {
      CAPTURE(with_bias);
      std::vector<bf16> out(N * OC);
      ref::matmul_forward(out, in, weight, with_bias ? bias : std::vector<bf16>{}, N, C, OC);
      const Device<bf16> d_out(be, std::vector<bf16>(N * OC, bf16(99.0f)), {N, OC});
      loom::kernels::matmul_forward<bf16>(be, d_out.view(), d_in.cview(), d_weight.cview(),
                                          with_bias ? d_bias.cview() : Tensor<const bf16>{});
      check_bf16(d_out.to_host(be), out, {.terms = C + 1}, "out");
    }
    std::vector<bf16> din = din0, dweight = dweight0, dbias = dbias0;
    ref::matmul_backward(din, dweight, dbias, dout, in, weight, N, C, OC);
    const Device<bf16> d_din(be, din0, {N, C}), d_dweight(be, dweight0, {OC, C}), d_dbias(be, dbias0, {OC});
    loom::kernels::matmul_backward<bf16>(be, d_din.view(), d_dweight.view(), d_dbias.view(), d_dout.cview(),
                                         d_in.cview(), d_weight.cview());
    // Accumulating GEMMs (beta 1): cuBLAS may round the product to bf16 before adding the old
    // gradient (seen on an H100), an intermediate rounding of |A B|, whose standard deviation
    // is sqrt(K) t / 3 for these inputs; e = 2 covers six of them.
    check_bf16(d_din.to_host(be), din, {.terms = OC + 1, .intermediate = 2.0}, "din");
    check_bf16(d_dweight.to_host(be), dweight, {.terms = N + 1, .intermediate = 2.0}, "dweight");
    check_bf16(d_dbias.to_host(be), dbias, {.terms = N + 1}, "dbias");
  }
}

TEST_CASE("bf16: layernorm keeps float statistics and rounds each result once") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  struct Size {
    std::int64_t N, C;
  };
  for (const Size s : {Size{1, 1}, Size{7, 33}, Size{256, 768}}) {
    CAPTURE(s.N);
    CAPTURE(s.C);
    const std::int64_t N = s.N, C = s.C;
    const auto in = random_bf16(N * C, 11, 9.0f, 11.0f), weight = random_bf16(C, 12), bias = random_bf16(C, 13),
               dout = random_bf16(N * C, 14), din0 = random_bf16(N * C, 15), dw0 = random_bf16(C, 16),
               db0 = random_bf16(C, 17);
    std::vector<bf16> out(N * C), din = din0, dw = dw0, db = db0;
    std::vector<float> mean(N), rstd(N);
    ref::layernorm_forward(out, mean, rstd, in, weight, bias, N, C);
    ref::layernorm_backward(din, dw, db, dout, in, weight, mean, rstd, N, C);

    const Device<bf16> d_in(be, in, {N, C}), d_weight(be, weight, {C}), d_bias(be, bias, {C}),
        d_out(be, std::vector<bf16>(N * C), {N, C}), d_dout(be, dout, {N, C}), d_din(be, din0, {N, C}),
        d_dw(be, dw0, {C}), d_db(be, db0, {C});
    const Device<float> d_mean(be, std::vector<float>(N), {N}), d_rstd(be, std::vector<float>(N), {N});
    loom::kernels::layernorm_forward<bf16>(be, d_out.view(), d_mean.view(), d_rstd.view(), d_in.cview(),
                                           d_weight.cview(), d_bias.cview());
    check_close(d_mean.to_host(be), to_double(mean), float_tolerance, "mean");
    check_close(d_rstd.to_host(be), to_double(rstd), float_tolerance, "rstd");
    check_bf16(d_out.to_host(be), out, {.terms = C, .term = 3.0}, "out");
    // The backward from the CPU's statistics, so that only the kernel differs.
    const Device<float> h_mean(be, mean, {N}), h_rstd(be, rstd, {N});
    loom::kernels::layernorm_backward<bf16>(be, d_din.view(), d_dw.view(), d_db.view(), d_dout.cview(), d_in.cview(),
                                            d_weight.cview(), h_mean.cview(), h_rstd.cview());
    check_bf16(d_din.to_host(be), din, {.terms = C, .term = 4.0}, "din");
    check_bf16(d_dw.to_host(be), dw, {.terms = N + 1, .term = 4.0}, "dweight");
    check_bf16(d_db.to_host(be), db, {.terms = N + 1}, "dbias");
    // Weight and bias gradients into fp32 sums (fp32 gradient fusion): the same float totals
    // stored unrounded, which round to the bf16 run's bits; din the same bits.
    const Device<bf16> d_din32(be, din0, {N, C});
    const Device<float> d_dw32(be, floats_of(dw0), {C}), d_db32(be, floats_of(db0), {C});
    loom::kernels::layernorm_backward<bf16, float>(be, d_din32.view(), d_dw32.view(), d_db32.view(), d_dout.cview(),
                                                   d_in.cview(), d_weight.cview(), h_mean.cview(), h_rstd.cview());
    CHECK(floats_of(d_din32.to_host(be)) == floats_of(d_din.to_host(be)));
    CHECK(floats_of(cast_to<bf16>(d_dw32.to_host(be))) == floats_of(d_dw.to_host(be)));
    CHECK(floats_of(cast_to<bf16>(d_db32.to_host(be))) == floats_of(d_db.to_host(be)));
  }
}

TEST_CASE("bf16: gelu, residual, add_to and scale") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{1001}, std::int64_t{1} << 21}) {
    CAPTURE(n);
    const auto x = random_bf16(n, 21, -5.0f, 5.0f), g = random_bf16(n, 22), acc0 = random_bf16(n, 23);
    std::vector<bf16> out(n), din = acc0, db = acc0;
    const Device<bf16> d_x(be, x, {n}), d_g(be, g, {n}), d_out(be, std::vector<bf16>(n), {n}), d_db(be, acc0, {n});

    for (const Gelu kind : {Gelu::tanh, Gelu::erf}) {
      CAPTURE(std::string(loom::gelu_name(kind)));
      ref::gelu_forward(out, x, kind);
      loom::kernels::gelu_forward<bf16>(be, d_out.view(), d_x.cview(), kind);
      check_bf16(d_out.to_host(be), out, {.term = 5.0}, "gelu out");
      din = acc0;
      const Device<bf16> d_din(be, acc0, {n});
      ref::gelu_backward(din, x, g, kind);
      loom::kernels::gelu_backward<bf16>(be, d_din.view(), d_x.cview(), d_g.cview(), kind);
      // Each side's tanh is a few float ulps off (CUDA's tanhf, glibc's tanh), and the derivative
      // multiplies th's error by up to |0.5 - x th sqrt(2/pi) (1 + 0.134 x^2)| ~ 18 at |x| = 5;
      // the erf form's derivative adds erf's few ulps of 1 to a well-conditioned x exp(-x^2 / 2).
      check_bf16(d_din.to_host(be), din, {.term = 40.0}, "gelu din");
    }

    ref::residual_forward(out, x, g);
    loom::kernels::residual_forward<bf16>(be, d_out.view(), d_x.cview(), d_g.cview());
    CHECK(d_out.to_host(be) == out);  // one float addition, one rounding: the same bits
    din = acc0;
    const Device<bf16> d_da(be, acc0, {n});
    ref::residual_backward(din, db, g);
    loom::kernels::residual_backward<bf16>(be, d_da.view(), d_db.view(), d_g.cview());
    CHECK(d_da.to_host(be) == din);
    CHECK(d_db.to_host(be) == db);

    const Device<bf16> d_sum(be, acc0, {n});
    loom::kernels::add_to<bf16>(be, d_sum.view(), d_g.cview());
    CHECK(d_sum.to_host(be) == db);  // acc0 + g, as residual_backward's db

    std::vector<bf16> scaled = x;
    ref::scale(scaled, 0.37);
    loom::kernels::scale<bf16>(be, d_x.view(), 0.37);
    CHECK(d_x.to_host(be) == scaled);

    const double sum = ref::sum_of_squares(g);
    CHECK(std::abs(loom::kernels::sum_of_squares<bf16>(be, d_g.cview()) - sum) <= 1e-12 * sum);
  }
}

TEST_CASE("bf16: attention forward and backward, with att or only the row log-sum-exp (float) saved") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  // The cuBLAS lse path, whose rounding of the scores the bounds below follow; the tiled kernels
  // have their own test (test_cuda_flash_attention).
  be.set_flash_attention(false);
  struct Size {
    std::int64_t B, T, NH, hs;
  };
  for (const Size s : {Size{1, 1, 1, 1}, Size{2, 7, 3, 5}, Size{3, 65, 3, 16}, Size{2, 256, 4, 64}}) {
    CAPTURE(s.B);
    CAPTURE(s.T);
    CAPTURE(s.NH);
    CAPTURE(s.hs);
    const std::int64_t B = s.B, T = s.T, C = s.NH * s.hs;
    const int heads = static_cast<int>(s.NH);
    const auto qkv = random_bf16(B * T * 3 * C, 31), dout = random_bf16(B * T * C, 32),
               dqkv0 = random_bf16(B * T * 3 * C, 33);
    // The device rounds the raw scores to bf16: a probability moves by up to 2^-8 of the largest
    // |scaled score| on each side of the max; |q k| <= hs, scaled by 1/sqrt(hs).
    const double score_roundings = 2.0 * std::sqrt(static_cast<double>(s.hs)) + 1.0;
    std::vector<bf16> out(B * T * C), att(B * s.NH * T * T), dqkv = dqkv0;
    ref::attention_forward(out, att, qkv, B, T, C, heads);
    const Device<bf16> d_qkv(be, qkv, {B, T, 3 * C}), d_out(be, out, {B, T, C}),
        d_att(be, att, {B, s.NH, T, T}), d_dout(be, dout, {B, T, C}), d_dqkv(be, dqkv0, {B, T, 3 * C});
    loom::kernels::attention_forward<bf16>(be, d_out.view(), d_att.view(), d_qkv.cview(), heads);
    check_bf16(d_att.to_host(be), att, {.intermediate = score_roundings}, "att");
    check_bf16(d_out.to_host(be), out, {.terms = T, .intermediate = score_roundings + 1}, "out");
    // The backward from the CPU's probabilities on both sides.
    ref::attention_backward(dqkv, dout, qkv, att, B, T, C, heads);
    const Device<bf16> h_att(be, att, {B, s.NH, T, T});
    loom::kernels::attention_backward<bf16>(be, d_dqkv.view(), d_dout.cview(), d_qkv.cview(), h_att.cview(), heads);
    check_bf16(d_dqkv.to_host(be), dqkv, {.terms = T + s.hs, .intermediate = 3.0}, "dqkv");

    // Only lse saved, the training path: the backward from the device's own lse recomputes the
    // probabilities, which carry the bf16 scores' rounding (score_roundings) into the gradients.
    const LseReference lse = lse_reference(qkv, B, T, s.NH, s.hs);
    const Device<bf16> l_out(be, std::vector<bf16>(B * T * C), {B, T, C}), l_dqkv(be, dqkv0, {B, T, 3 * C});
    const Device<float> l_lse(be, std::vector<float>(B * s.NH * T), {B, s.NH, T});
    loom::kernels::attention_forward_lse<bf16>(be, l_out.view(), l_lse.view(), d_qkv.cview(), heads);
    check_bf16(l_out.to_host(be), out, {.terms = T, .intermediate = score_roundings + 1}, "out (lse)");
    check_close(l_lse.to_host(be), lse.value, lse.bound, 1.0, "lse", 0.0);
    loom::kernels::attention_backward_lse<bf16>(be, l_dqkv.view(), d_dout.cview(), d_qkv.cview(), l_out.cview(),
                                                l_lse.cview(), heads);
    check_bf16(l_dqkv.to_host(be), dqkv, {.terms = T + s.hs, .intermediate = 3.0 + score_roundings}, "dqkv (lse)");
  }
}

TEST_CASE("bf16: vocabulary-parallel embedding gives the CPU's bits") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const std::int64_t B = 3, T = 37, C = 130, V = 50, max_t = 40;
  std::vector<std::int32_t> tokens(B * T);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 13) % V);
  const auto wpe = random_bf16(max_t * C, 41), dout = random_bf16(B * T * C, 42), dwpe0 = random_bf16(max_t * C, 43);
  for (const std::int64_t vocab_begin : {std::int64_t{0}, std::int64_t{20}}) {
    CAPTURE(vocab_begin);
    const std::int64_t rows = std::min<std::int64_t>(25, V - vocab_begin);
    const auto slice = random_bf16(rows * C, 44), dslice0 = random_bf16(rows * C, 45);
    std::vector<bf16> out(B * T * C), dslice = dslice0, dwpe = dwpe0;
    ref::embedding_forward(out, tokens, slice, vocab_begin, wpe, B, T, C);
    ref::embedding_backward(dslice, vocab_begin, dwpe, dout, tokens, B, T, C);
    const Device<std::int32_t> d_tokens(be, tokens, {B, T});
    const Device<bf16> d_slice(be, slice, {rows, C}), d_wpe(be, wpe, {max_t, C}), d_out(be, out, {B, T, C}),
        d_dout(be, dout, {B, T, C}), d_dslice(be, dslice0, {rows, C}), d_dwpe(be, dwpe0, {max_t, C});
    loom::kernels::vocab_parallel_embedding_forward<bf16>(be, d_out.view(), d_tokens.cview(), d_slice.cview(),
                                                          vocab_begin, d_wpe.cview());
    CHECK(d_out.to_host(be) == out);
    loom::kernels::vocab_parallel_embedding_backward<bf16>(be, d_dslice.view(), vocab_begin, d_dwpe.view(),
                                                           d_dout.cview(), d_tokens.cview());
    CHECK(d_dslice.to_host(be) == dslice);
    CHECK(d_dwpe.to_host(be) == dwpe);
  }
}

TEST_CASE("bf16: vocabulary-parallel cross-entropy with float losses") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  // 1024 columns run the 16-byte kernels, 1006 (not a multiple of 8) element by element.
  for (const std::int64_t Vs : {std::int64_t{1024}, std::int64_t{1006}}) {
    CAPTURE(Vs);
    const std::int64_t N = 37, vocab = 1000;
    std::vector<std::int32_t> targets(N);
    for (std::int64_t n = 0; n < N; ++n) targets[n] = n == 3 ? -1 : static_cast<std::int32_t>((n * 97) % vocab);
    const auto logits = random_bf16(N * Vs, 51, -4.0f, 4.0f);
    std::vector<bf16> dlogits(N * Vs);
    std::vector<float> losses(N);
    std::vector<double> statistics;
    ref::cross_entropy_forward(losses, statistics, logits, targets, N, Vs, vocab);
    ref::cross_entropy_backward(dlogits, logits, statistics, targets, N, Vs, vocab, 1.0f / N);

    const Device<std::int32_t> d_targets(be, targets, {N});
    const Device<bf16> d_logits(be, logits, {N, Vs});
    const Device<double> d_stats(be, std::vector<double>(3 * N), {3 * N});
    const Device<float> d_losses(be, std::vector<float>(N), {N});
    const Tensor<double> row_max(d_stats.buffer.data(), {N}), partials(d_stats.buffer.data() + N, {2, N});
    loom::kernels::vocab_parallel_cross_entropy_statistics<bf16>(be, row_max, partials, d_logits.cview(),
                                                                 d_targets.cview(), 0, vocab);
    loom::kernels::vocab_parallel_cross_entropy_losses<bf16>(be, d_losses.view(), Tensor<const double>(row_max),
                                                             Tensor<const double>(partials), d_targets.cview());
    check_close(d_losses.to_host(be), to_double(losses), float_tolerance, "losses");
    const std::vector<double> stats = d_stats.to_host(be);
    CHECK(std::equal(stats.begin(), stats.begin() + N, statistics.begin()));  // a max is exact
    CHECK(std::equal(stats.begin() + 2 * N, stats.end(), statistics.begin() + 2 * N));  // so is a target's logit
    std::int64_t far = 0;  // sums of float exps in double, in another order and under other maxima
    for (std::int64_t n = N; n < 2 * N; ++n) far += std::abs(stats[n] - statistics[n]) > 1e-6 * statistics[n];
    CHECK(far == 0);
    // The models' path: dlogits in place of the logits; the probabilities and the gradient each
    // rounded once to bf16 (expf and the online sum differ from the CPU's in the last bits).
    loom::kernels::vocab_parallel_cross_entropy_backward<bf16>(
        be, d_logits.view(), d_logits.cview(), Tensor<const double>(row_max), Tensor<const double>(partials),
        d_targets.cview(), 0, vocab, 1.0f / N);
    check_bf16(d_logits.to_host(be), dlogits, {.roundings = 2.0}, "dlogits");
    // From probabilities (the CPU's): one float product, one rounding, the same bits.
    std::vector<bf16> probs(N * Vs, bf16(0.0f)), from_probs(N * Vs);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t j = 0; j < vocab; ++j) {
        const double x = static_cast<float>(logits[n * Vs + j]);
        probs[n * Vs + j] = bf16(static_cast<float>(std::exp(x - statistics[n]) / statistics[N + n]));
      }
    ref::cross_entropy_backward_from_probs(from_probs, probs, targets, N, Vs, vocab, 1.0f / N);
    const Device<bf16> d_dlogits(be, probs, {N, Vs});
    loom::kernels::vocab_parallel_cross_entropy_backward<bf16>(be, d_dlogits.view(), d_dlogits.cview(),
                                                               d_targets.cview(), 0, vocab, 1.0f / N);
    CHECK(d_dlogits.to_host(be) == from_probs);
  }
}

TEST_CASE("bf16: AdamW with fp32 master weights") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const std::int64_t n = 100003;
  const auto initial = random_bf16(n, 61);
  std::vector<bf16> params = initial;
  std::vector<float> master = floats_of(initial), m(n, 0.0f), v(n, 0.0f);
  const Device<bf16> d_params(be, initial, {n});
  const Device<float> d_master(be, master, {n}), d_m(be, m, {n}), d_v(be, v, {n});
  for (int step = 1; step <= 3; ++step) {
    const loom::AdamWUpdate h{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step};
    const auto grads = random_bf16(n, 70 + step, -2.0f, 2.0f);
    ref::adamw_update(params, grads, master, m, v, h);
    const Device<bf16> d_grads(be, grads, {n});
    loom::kernels::adamw_update<bf16>(be, d_params.view(), d_grads.cview(), d_master.view(), d_m.view(), d_v.view(), h);
  }
  // The device may fuse multiply-adds, so float-level agreement, not bits.
  const std::vector<float> got_master = d_master.to_host(be);
  check_close(got_master, to_double(master), float_tolerance, "master");
  check_close(d_m.to_host(be), to_double(m), float_tolerance, "m");
  check_close(d_v.to_host(be), to_double(v), float_tolerance, "v");
  std::vector<bf16> rounded;
  for (float x : got_master) rounded.push_back(bf16(x));
  CHECK(d_params.to_host(be) == rounded);  // params = bf16(master), on the device too
}

TEST_CASE("bf16: fp32 gradients: drain_into, then AdamW from the fp32 sums") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const std::int64_t n = 70001;  // odd: the grid-stride loop's tail
  std::vector<float> sums(n, 0.0f);
  const Device<float> d_sums(be, sums, {n});
  for (int micro_batch = 0; micro_batch < 3; ++micro_batch) {
    const auto part = random_bf16(n, 90 + micro_batch);
    for (std::int64_t i = 0; i < n; ++i) sums[i] += static_cast<float>(part[i]);
    const Device<bf16> d_part(be, part, {n});
    loom::kernels::drain_into<bf16>(be, d_sums.view(), d_part.view());
    CHECK(d_part.to_host(be) == std::vector<bf16>(n, bf16(0.0f)));
  }
  CHECK(d_sums.to_host(be) == sums);  // the same float additions in the same order
  // AdamW from fp32 gradients that bf16 holds exactly gives the bits of AdamW from them in bf16.
  const auto initial = random_bf16(n, 99);
  const auto grads = random_bf16(n, 98, -2.0f, 2.0f);
  const std::vector<float> zeros(n, 0.0f);
  const Device<bf16> p1(be, initial, {n}), p2(be, initial, {n}), g16(be, grads, {n});
  const Device<float> g32(be, floats_of(grads), {n}), master1(be, floats_of(initial), {n}),
      master2(be, floats_of(initial), {n}), m1(be, zeros, {n}), v1(be, zeros, {n}), m2(be, zeros, {n}),
      v2(be, zeros, {n});
  const loom::AdamWUpdate h{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 2};
  loom::kernels::adamw_update<bf16>(be, p1.view(), g16.cview(), master1.view(), m1.view(), v1.view(), h);
  loom::kernels::adamw_update<bf16>(be, p2.view(), g32.cview(), master2.view(), m2.view(), v2.view(), h);
  CHECK(master2.to_host(be) == master1.to_host(be));
  CHECK(v2.to_host(be) == v1.to_host(be));
  CHECK(p2.to_host(be) == p1.to_host(be));
  CHECK(master1.to_host(be) != floats_of(initial));
}

TEST_CASE("bf16: AdamW over many segments in a few launches gives each segment's own update") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  // 97 segments (three launches of up to 40) of one flat range: sizes inside a block, on its
  // edge, one past it, empty; every third segment not decayed. Both gradient kinds (bf16, and
  // the fp32 sums of --fp32-gradients), against adamw_update on each segment.
  constexpr std::int64_t block = loom::detail::cuda_optimizer_updates::segment_block_elements;
  const std::int64_t pattern[] = {1, block, 0, block + 1, 767, 3 * block - 5, 2304};
  std::vector<std::int64_t> offsets{0};
  for (int i = 0; i < 97; ++i) offsets.push_back(offsets.back() + pattern[i % 7]);
  const std::int64_t n = offsets.back();
  const auto initial = random_bf16(n, 120);
  const auto grads = random_bf16(n, 121, -2.0f, 2.0f);
  const auto m0 = floats_of(random_bf16(n, 122, -0.1f, 0.1f));
  const auto v0 = floats_of(random_bf16(n, 123, 0.0f, 0.1f));
  for (const bool fp32_grads : {false, true}) {
    CAPTURE(fp32_grads);
    const loom::AdamWUpdate h{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 3};
    const Device<bf16> p1(be, initial, {n}), p2(be, initial, {n}), g16(be, grads, {n});
    const Device<float> g32(be, floats_of(grads), {n}), master1(be, floats_of(initial), {n}),
        master2(be, floats_of(initial), {n}), state1(be, m0, {n}), state2(be, m0, {n}), second1(be, v0, {n}),
        second2(be, v0, {n});
    std::vector<loom::OptimizerSegment<bf16>> segments;
    for (std::size_t i = 0; i + 1 < offsets.size(); ++i) {
      const std::int64_t at = offsets[i], count = offsets[i + 1] - at;
      const bool decayed = i % 3 != 0;
      loom::AdamWUpdate own = h;
      own.weight_decay = decayed ? h.weight_decay : 0.0;
      const auto part = [&]<class E>(const Device<E>& d) { return loom::Tensor<E>(d.buffer.data() + at, {count}); };
      if (fp32_grads)
        loom::kernels::adamw_update<bf16>(be, part(p1), loom::Tensor<const float>(part(g32)), part(master1),
                                          part(state1), part(second1), own);
      else
        loom::kernels::adamw_update<bf16>(be, part(p1), loom::Tensor<const bf16>(part(g16)), part(master1),
                                          part(state1), part(second1), own);
      loom::OptimizerSegment<bf16> s;
      s.params = part(p2);
      if (fp32_grads)
        s.fp32_grads = part(g32);
      else
        s.grads = part(g16);
      s.master = part(master2);
      s.state[0] = part(state2);
      s.state[1] = part(second2);
      s.weight_decay = decayed;
      segments.push_back(s);
    }
    loom::kernels::adamw_update_segments<bf16>(be, std::span<const loom::OptimizerSegment<bf16>>(segments), h);
    // m and v: the same bits. The parameter update's multiply-adds may be contracted otherwise by
    // ptxas in the two kernels (seen on an H200: a last-bit difference), so master agrees to float
    // rounding, and params are master rounded once.
    CHECK(state2.to_host(be) == state1.to_host(be));
    CHECK(second2.to_host(be) == second1.to_host(be));
    const std::vector<float> got_master = master2.to_host(be);
    check_close(got_master, to_double(master1.to_host(be)), float_tolerance, "master");
    std::vector<bf16> rounded;
    for (float x : got_master) rounded.push_back(bf16(x));
    CHECK(p2.to_host(be) == rounded);
    CHECK(p2.to_host(be) != initial);
    // Deterministic: the same launches again from the same state give the same bits.
    const Device<bf16> p3(be, initial, {n});
    const Device<float> master3(be, floats_of(initial), {n}), state3(be, m0, {n}), second3(be, v0, {n});
    std::vector<loom::OptimizerSegment<bf16>> again = segments;
    for (std::size_t i = 0; i < again.size(); ++i) {
      const std::int64_t at = offsets[i], count = offsets[i + 1] - at;
      again[i].params = loom::Tensor<bf16>(p3.buffer.data() + at, {count});
      again[i].master = loom::Tensor<float>(master3.buffer.data() + at, {count});
      again[i].state[0] = loom::Tensor<float>(state3.buffer.data() + at, {count});
      again[i].state[1] = loom::Tensor<float>(second3.buffer.data() + at, {count});
    }
    loom::kernels::adamw_update_segments<bf16>(be, std::span<const loom::OptimizerSegment<bf16>>(again), h);
    CHECK(master3.to_host(be) == got_master);
    CHECK(p3.to_host(be) == p2.to_host(be));
  }
  // A mix of gradient kinds is refused, naming the rule.
  const Device<bf16> p(be, initial, {n}), g(be, grads, {n});
  const Device<float> g32(be, floats_of(grads), {n}), master(be, floats_of(initial), {n}), m(be, m0, {n}), v(be, v0, {n});
  loom::OptimizerSegment<bf16> narrow{.params = p.view(), .grads = g.cview(), .master = master.view(),
                                      .state = {m.view(), v.view()}};
  loom::OptimizerSegment<bf16> wide = narrow;
  wide.grads = {};
  wide.fp32_grads = g32.cview();
  const loom::OptimizerSegment<bf16> mixed[] = {narrow, wide};
  const loom::AdamWUpdate h{.lr = 0.05, .step = 1};
  CHECK_THROWS_WITH_AS(
      loom::kernels::adamw_update_segments<bf16>(be, std::span<const loom::OptimizerSegment<bf16>>(mixed), h),
      doctest::Contains("must all hold fp32 gradients or none"), loom::Error);
}

int main(int argc, char** argv) { return loom::cuda_test::run_tests(argc, argv); }
