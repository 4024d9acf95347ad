// bf16 storage with fp32 arithmetic: every CPU kernel GPT-2 training calls, run on bf16 tensors,
// against the float kernel run on the same bf16-rounded inputs (widened exactly to float).
//
// The bound. A bf16 kernel computes in float from the same values as the float kernel and rounds
// each stored result once, so per element
//   |bf16 result - float result| <= roundings * 2^-8 * |float result| + sqrt(K) * 2^-22 * m
// where 2^-8 is the unit roundoff of bf16 (8 significant bits), `roundings` the bf16 roundings
// on the way to the result (1 everywhere but the cross-entropy's probabilities, 2: the stored
// exps, then the probabilities), K the length of the reduction behind the result (1 for
// element-wise kernels) and m the magnitude of its terms (sum of |terms|): the second part allows
// for float sums added in another order (tiles instead of Eigen's blocks), a few float ulps
// growing like sqrt(K). A kernel that rounded to bf16 inside a reduction (once per row) would be
// off by about sqrt(K) * 2^-9 * m and fails the bound.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/backend/cpu/kernels.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/bf16.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_bf16 {

namespace {

using loom::bf16;
using loom::cpu;
using loom::Shape;
using loom::Tensor;

static_assert(std::is_same_v<loom::accumulate_t<bf16>, float>);
static_assert(std::is_same_v<loom::accumulate_t<const bf16>, float>);
static_assert(std::is_same_v<loom::accumulate_t<float>, float>);
static_assert(std::is_same_v<loom::accumulate_t<double>, double>);

//! 2^-8: the unit roundoff of bf16.
constexpr double bf16_roundoff = 1.0 / 256;

//! The same values as bf16 and as float (the float ones are exactly the bf16 ones).
struct Values {
  std::vector<bf16> narrow;
  std::vector<float> wide;

  Values() = default;
  Values(std::size_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
    for (float x : loom::test::random_vector<float>(n, seed, lo, hi)) push(x);
  }
  void push(float x) {
    narrow.push_back(bf16(x));
    wide.push_back(static_cast<float>(narrow.back()));
  }
  Tensor<bf16> bf(Shape s) { return {narrow.data(), s}; }
  Tensor<float> fl(Shape s) { return {wide.data(), s}; }
  Tensor<const bf16> cbf(Shape s) const { return {narrow.data(), s}; }
  Tensor<const float> cfl(Shape s) const { return {wide.data(), s}; }
};

//! The bound of the file comment, element by element; `magnitude` is m (one value for all).
void check_close(const std::vector<bf16>& got, const std::vector<float>& want, double magnitude,
                 std::int64_t terms = 1, int roundings = 1) {
  REQUIRE(got.size() == want.size());
  const double slack = std::sqrt(static_cast<double>(terms)) * std::ldexp(1.0, -22) * magnitude;
  double worst = 0;
  std::size_t worst_at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double w = want[i], g = static_cast<float>(got[i]);
    const double excess = std::abs(g - w) - (roundings * bf16_roundoff * std::abs(w) + slack);
    if (i == 0 || excess > worst) worst = excess, worst_at = i;
  }
  INFO("worst element " << worst_at << ": bf16 " << static_cast<float>(got[worst_at]) << ", float "
                        << want[worst_at]);
  CHECK(worst <= 0.0);
}

//! The bound with no bf16 rounding: fp32 results (fp32 gradient sums of bf16 operands) against the
//! float kernel's, which differ only in the order of float sums.
void check_close(const std::vector<float>& got, const std::vector<float>& want, double magnitude,
                 std::int64_t terms) {
  REQUIRE(got.size() == want.size());
  const double slack = std::sqrt(static_cast<double>(terms)) * std::ldexp(1.0, -22) * magnitude;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(got[i]) - static_cast<double>(want[i])));
  INFO("worst difference " << worst << ", allowed " << slack);
  CHECK(worst <= slack);
}

std::vector<float> widened(const std::vector<bf16>& x) {
  std::vector<float> out;
  for (bf16 b : x) out.push_back(static_cast<float>(b));
  return out;
}

}  // namespace

TEST_CASE("bf16: add_to, residual and scale round each result once") {
  const cpu be(1);
  const std::int64_t n = 70001;
  Values a(n, 1), b(n, 2, -3.0, 3.0), out(n, 3);
  SUBCASE("add_to") {
    loom::kernels::add_to<bf16>(be, a.bf({n}), b.cbf({n}));
    loom::kernels::add_to<float>(be, a.fl({n}), b.cfl({n}));
    check_close(a.narrow, a.wide, 0.0);
  }
  SUBCASE("residual forward and backward") {
    loom::kernels::residual_forward<bf16>(be, out.bf({n}), a.cbf({n}), b.cbf({n}));
    loom::kernels::residual_forward<float>(be, out.fl({n}), a.cfl({n}), b.cfl({n}));
    check_close(out.narrow, out.wide, 0.0);
    Values da(n, 4), db(n, 5);
    loom::kernels::residual_backward<bf16>(be, da.bf({n}), db.bf({n}), b.cbf({n}));
    loom::kernels::residual_backward<float>(be, da.fl({n}), db.fl({n}), b.cfl({n}));
    check_close(da.narrow, da.wide, 0.0);
    check_close(db.narrow, db.wide, 0.0);
  }
  SUBCASE("scale") {
    loom::kernels::scale<bf16>(be, a.bf({n}), 0.37);
    loom::kernels::scale<float>(be, a.fl({n}), 0.37);
    check_close(a.narrow, a.wide, 0.0);
  }
  SUBCASE("copy and zero") {
    loom::kernels::copy<bf16>(be, out.bf({n}), a.cbf({n}));
    CHECK(out.narrow == a.narrow);
    loom::kernels::zero<bf16>(be, out.bf({n}));
    CHECK(std::all_of(out.narrow.begin(), out.narrow.end(), [](bf16 x) { return x == bf16(0.0f); }));
  }
}

TEST_CASE("bf16: sum_of_squares and sum_elements accumulate in double") {
  const cpu one(1), two(2);
  for (std::int64_t n : {1, 7, 100003}) {
    CAPTURE(n);
    const Values x(static_cast<std::size_t>(n), 11, -2.0, 2.0);
    // Every bf16 value is exactly a float: the sums are the float kernel's, bit for bit.
    CHECK(loom::kernels::sum_of_squares<bf16>(one, x.cbf({n})) ==
          loom::kernels::sum_of_squares<float>(one, x.cfl({n})));
    CHECK(loom::kernels::sum_elements<bf16>(one, x.cbf({n})) == loom::kernels::sum_elements<float>(one, x.cfl({n})));
    CHECK(loom::kernels::sum_of_squares<bf16>(two, x.cbf({n})) == loom::kernels::sum_of_squares<bf16>(one, x.cbf({n})));
  }
  // 2^24 + 1 ones: a float accumulator would stop at 2^24.
  const std::vector<bf16> ones((1 << 24) + 1, bf16(1.0f));
  CHECK(loom::kernels::sum_elements<bf16>(two, Tensor<const bf16>(ones.data(), {(1 << 24) + 1})) == 16777217.0);
}

TEST_CASE("bf16: gelu forward and backward, both forms") {
  const cpu one(1), two(2);
  for (const loom::Gelu kind : {loom::Gelu::tanh, loom::Gelu::erf}) {
    for (std::int64_t n : {7, 3 * 1025, 70001}) {
      CAPTURE(std::string(loom::gelu_name(kind)));
      CAPTURE(n);
      const Values x(static_cast<std::size_t>(n), 21, -5.0, 5.0), dout(static_cast<std::size_t>(n), 22);
      for (const cpu* be : {&one, &two}) {
        Values out(static_cast<std::size_t>(n), 23), din(static_cast<std::size_t>(n), 24);
        loom::kernels::gelu_forward<bf16>(*be, out.bf({n}), x.cbf({n}), kind);
        loom::kernels::gelu_forward<float>(*be, out.fl({n}), x.cfl({n}), kind);
        check_close(out.narrow, out.wide, 5.0);  // Eigen's float tanh and erf: a few float ulps of 5
        loom::kernels::gelu_backward<bf16>(*be, din.bf({n}), x.cbf({n}), dout.cbf({n}), kind);
        loom::kernels::gelu_backward<float>(*be, din.fl({n}), x.cfl({n}), dout.cfl({n}), kind);
        check_close(din.narrow, din.wide, 2.0);
      }
    }
  }
}

TEST_CASE("bf16: layernorm keeps float statistics and rounds each result once") {
  const cpu one(1), two(2);
  struct Size {
    std::int64_t N, C;
  };
  for (const Size s : {Size{1, 1}, Size{5, 7}, Size{134, 129}}) {
    CAPTURE(s.N);
    CAPTURE(s.C);
    const std::int64_t N = s.N, C = s.C;
    // Inputs offset by 10: the statistics must not cancel.
    const Values in(N * C, 31, 9.0, 11.0), w(C, 32), b(C, 33), dout(N * C, 34);
    std::vector<bf16> first_out;
    for (const cpu* be : {&one, &two}) {
      Values out(N * C, 35), din(N * C, 36), dw(C, 37), db(C, 38);
      std::vector<float> mean(N), rstd(N), mean_f(N), rstd_f(N);
      loom::kernels::layernorm_forward<bf16>(*be, out.bf({N, C}), Tensor<float>(mean.data(), {N}),
                                             Tensor<float>(rstd.data(), {N}), in.cbf({N, C}), w.cbf({C}), b.cbf({C}));
      loom::kernels::layernorm_forward<float>(*be, out.fl({N, C}), Tensor<float>(mean_f.data(), {N}),
                                              Tensor<float>(rstd_f.data(), {N}), in.cfl({N, C}), w.cfl({C}),
                                              b.cfl({C}));
      // The statistics are float, computed from the same values: the float kernel's bits.
      CHECK(mean == mean_f);
      CHECK(rstd == rstd_f);
      check_close(out.narrow, out.wide, 4.0);
      if (be == &one) first_out = out.narrow;
      CHECK(out.narrow == first_out);

      loom::kernels::layernorm_backward<bf16>(*be, din.bf({N, C}), dw.bf({C}), db.bf({C}), dout.cbf({N, C}),
                                              in.cbf({N, C}), w.cbf({C}), Tensor<const float>(mean.data(), {N}),
                                              Tensor<const float>(rstd.data(), {N}));
      loom::kernels::layernorm_backward<float>(*be, din.fl({N, C}), dw.fl({C}), db.fl({C}), dout.cfl({N, C}),
                                               in.cfl({N, C}), w.cfl({C}), Tensor<const float>(mean.data(), {N}),
                                               Tensor<const float>(rstd.data(), {N}));
      // din: row sums of C terms of size <= |w dout norm| <~ 4; dweight, dbias: N rows.
      check_close(din.narrow, din.wide, 4.0 * static_cast<double>(C), C);
      check_close(dw.narrow, dw.wide, 4.0 * static_cast<double>(N), N);
      check_close(db.narrow, db.wide, static_cast<double>(N), N);
      // Weight and bias gradients into fp32 sums (fp32 gradient fusion): the float kernel's bits,
      // from the same values in the same order, nothing rounded to bf16; din as before.
      Values din32(N * C, 36), dw32(C, 37), db32(C, 38);
      loom::kernels::layernorm_backward<bf16, float>(*be, din32.bf({N, C}), dw32.fl({C}), db32.fl({C}),
                                                     dout.cbf({N, C}), in.cbf({N, C}), w.cbf({C}),
                                                     Tensor<const float>(mean.data(), {N}),
                                                     Tensor<const float>(rstd.data(), {N}));
      CHECK(din32.narrow == din.narrow);
      CHECK(dw32.wide == dw.wide);
      CHECK(db32.wide == db.wide);
    }
  }
}

TEST_CASE("bf16: matmul forward and backward use float GEMMs and round once") {
  const cpu one(1), two(2);
  struct Size {
    std::int64_t N, C, OC;
  };
  // Small; odd; and larger than a tile (128) in every extent, with ragged tiles.
  for (const Size s : {Size{1, 1, 1}, Size{3, 5, 7}, Size{134, 129, 263}}) {
    CAPTURE(s.N);
    CAPTURE(s.C);
    CAPTURE(s.OC);
    const std::int64_t N = s.N, C = s.C, OC = s.OC;
    const Values in(N * C, 41), w(OC * C, 42), bias(OC, 43), dout(N * OC, 44);
    std::vector<bf16> bits_out, bits_din, bits_dw;
    for (const cpu* be : {&one, &two}) {
      CAPTURE(be->threads());
      for (bool with_bias : {false, true}) {
        Values out(N * OC, 45);
        loom::kernels::matmul_forward<bf16>(*be, out.bf({N, OC}), in.cbf({N, C}), w.cbf({OC, C}),
                                            with_bias ? bias.cbf({OC}) : Tensor<const bf16>{});
        loom::kernels::matmul_forward<float>(*be, out.fl({N, OC}), in.cfl({N, C}), w.cfl({OC, C}),
                                             with_bias ? bias.cfl({OC}) : Tensor<const float>{});
        check_close(out.narrow, out.wide, static_cast<double>(C + 1), C + 1);
        if (with_bias && be == &one) bits_out = out.narrow;
        if (with_bias) CHECK(out.narrow == bits_out);  // tiles, not threads, fix the bits
      }
      // Gradients accumulate onto non-zero values.
      Values din(N * C, 46), dw(OC * C, 47), db(OC, 48);
      loom::kernels::matmul_backward<bf16>(*be, din.bf({N, C}), dw.bf({OC, C}), db.bf({OC}), dout.cbf({N, OC}),
                                           in.cbf({N, C}), w.cbf({OC, C}));
      loom::kernels::matmul_backward<float>(*be, din.fl({N, C}), dw.fl({OC, C}), db.fl({OC}), dout.cfl({N, OC}),
                                            in.cfl({N, C}), w.cfl({OC, C}));
      check_close(din.narrow, din.wide, static_cast<double>(OC + 1), OC + 1);
      check_close(dw.narrow, dw.wide, static_cast<double>(N + 1), N + 1);
      check_close(db.narrow, db.wide, static_cast<double>(N + 1), N + 1);
      if (be == &one) bits_din = din.narrow, bits_dw = dw.narrow;
      CHECK(din.narrow == bits_din);
      CHECK(dw.narrow == bits_dw);

      // The split backward (din alone, then dweight and dbias) gives the one call's bits.
      Values din2(N * C, 46), dw2(OC * C, 47), db2(OC, 48);
      loom::kernels::matmul_backward<bf16>(*be, din2.bf({N, C}), Tensor<bf16>{}, Tensor<bf16>{}, dout.cbf({N, OC}),
                                           in.cbf({N, C}), w.cbf({OC, C}));
      loom::kernels::matmul_backward<bf16>(*be, Tensor<bf16>{}, dw2.bf({OC, C}), db2.bf({OC}), dout.cbf({N, OC}),
                                           in.cbf({N, C}), w.cbf({OC, C}));
      CHECK(din2.narrow == din.narrow);
      CHECK(dw2.narrow == dw.narrow);
      CHECK(db2.narrow == db.narrow);

      // fp32 gradient sums (TrainerOptions::fp32_gradient_fusion): bf16 operands, float dweight
      // and dbias that take the float products unrounded, as the float kernel's on the same values
      // (up to the order of the float sums), through gelu_matmul_backward too.
      for (const bool through_gelu : {false, true}) {
        CAPTURE(through_gelu);
        Values dw3(OC * C, 47), db3(OC, 48), dpre(N * C, 49);
        if (through_gelu)
          loom::kernels::gelu_matmul_backward<bf16>(*be, dpre.bf({N, C}), dw3.fl({OC, C}), db3.fl({OC}),
                                                    dout.cbf({N, OC}), in.cbf({N, C}), w.cbf({OC, C}),
                                                    in.cbf({N, C}));
        else
          loom::kernels::matmul_backward<bf16>(*be, Tensor<bf16>{}, dw3.fl({OC, C}), db3.fl({OC}), dout.cbf({N, OC}),
                                               in.cbf({N, C}), w.cbf({OC, C}));
        check_close(dw3.wide, dw.wide, static_cast<double>(N + 1), N + 1);
        check_close(db3.wide, db.wide, static_cast<double>(N + 1), N + 1);
      }
    }
  }
}

TEST_CASE("bf16: attention forward and backward (both pairs) run each head in float") {
  const cpu one(1), two(2);
  struct Size {
    std::int64_t B, T, NH, hs;
  };
  for (const Size s : {Size{1, 1, 1, 1}, Size{2, 7, 3, 5}, Size{1, 70, 2, 16}}) {
    CAPTURE(s.T);
    const std::int64_t B = s.B, Tn = s.T, NH = s.NH, C = s.NH * s.hs;
    const int heads = static_cast<int>(NH);
    const Values qkv(B * Tn * 3 * C, 51, -2.0, 2.0), dout(B * Tn * C, 52);
    for (const cpu* be : {&one, &two}) {
      Values out(B * Tn * C, 53), att(B * NH * Tn * Tn, 54);
      loom::kernels::attention_forward<bf16>(*be, out.bf({B, Tn, C}), att.bf({B, NH, Tn, Tn}),
                                             qkv.cbf({B, Tn, 3 * C}), heads);
      loom::kernels::attention_forward<float>(*be, out.fl({B, Tn, C}), att.fl({B, NH, Tn, Tn}),
                                              qkv.cfl({B, Tn, 3 * C}), heads);
      check_close(att.narrow, att.wide, 1.0, s.hs);
      check_close(out.narrow, out.wide, 1.0, Tn);  // convex combinations of |v| <= 2
      // The backward from the same (bf16) probabilities on both sides.
      const Values probs = [&] {
        Values p;
        for (bf16 x : att.narrow) p.push(static_cast<float>(x));
        return p;
      }();
      Values dqkv(B * Tn * 3 * C, 55);
      loom::kernels::attention_backward<bf16>(*be, dqkv.bf({B, Tn, 3 * C}), dout.cbf({B, Tn, C}),
                                              qkv.cbf({B, Tn, 3 * C}), probs.cbf({B, NH, Tn, Tn}), heads);
      loom::kernels::attention_backward<float>(*be, dqkv.fl({B, Tn, 3 * C}), dout.cfl({B, Tn, C}),
                                               qkv.cfl({B, Tn, 3 * C}), probs.cfl({B, NH, Tn, Tn}), heads);
      check_close(dqkv.narrow, dqkv.wide, 4.0 * static_cast<double>(s.hs + Tn), s.hs + Tn);

      // The lse pair: out as above; lse is float, computed from the same values, so it differs
      // from the float kernel's by float reassociation at most (|scaled score| <= 4 sqrt(hs), hs
      // products and T exponentials summed), never by a bf16 rounding.
      std::vector<float> lse(B * NH * Tn), lse_f(B * NH * Tn);
      loom::kernels::attention_forward_lse<bf16>(*be, out.bf({B, Tn, C}), Tensor<float>(lse.data(), {B, NH, Tn}),
                                                 qkv.cbf({B, Tn, 3 * C}), heads);
      loom::kernels::attention_forward_lse<float>(*be, out.fl({B, Tn, C}), Tensor<float>(lse_f.data(), {B, NH, Tn}),
                                                  qkv.cfl({B, Tn, 3 * C}), heads);
      check_close(out.narrow, out.wide, 1.0, Tn);
      const double lse_bound =
          std::sqrt(static_cast<double>(s.hs + Tn)) * std::ldexp(1.0, -22) * (4.0 * std::sqrt(s.hs) + Tn);
      for (std::size_t i = 0; i < lse.size(); ++i) CHECK(std::abs(lse[i] - lse_f[i]) <= lse_bound);
      // The backward from the same (float) lse and the same out (bf16's, widened) on both sides.
      const Tensor<const float> saved(lse_f.data(), {B, NH, Tn});
      const std::vector<float> out_widened = widened(out.narrow);
      Values dqkv_lse(B * Tn * 3 * C, 55);
      loom::kernels::attention_backward_lse<bf16>(*be, dqkv_lse.bf({B, Tn, 3 * C}), dout.cbf({B, Tn, C}),
                                                  qkv.cbf({B, Tn, 3 * C}), out.cbf({B, Tn, C}), saved, heads);
      loom::kernels::attention_backward_lse<float>(*be, dqkv_lse.fl({B, Tn, 3 * C}), dout.cfl({B, Tn, C}),
                                                   qkv.cfl({B, Tn, 3 * C}),
                                                   Tensor<const float>(out_widened.data(), {B, Tn, C}), saved, heads);
      check_close(dqkv_lse.narrow, dqkv_lse.wide, 4.0 * static_cast<double>(s.hs + Tn), s.hs + Tn);
    }
  }
}

TEST_CASE("bf16: vocabulary-parallel embedding, forward and backward") {
  const cpu one(1), two(2);
  const std::int64_t B = 4, Tn = 33, C = 130, V = 11, maxT = 40;
  std::vector<std::int32_t> tokens(B * Tn);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 7) % V);  // repeats
  const Tensor<const std::int32_t> ids(tokens.data(), {B, Tn});
  const Values wte(V * C, 61), wpe(maxT * C, 62), dout(B * Tn * C, 63);
  for (const cpu* be : {&one, &two}) {
    for (std::int64_t vocab_begin : {0, 4}) {
      CAPTURE(vocab_begin);
      const std::int64_t rows = V - vocab_begin;  // the slice [vocab_begin, V)
      const Values slice = [&] {
        Values x;
        for (std::int64_t i = vocab_begin * C; i < V * C; ++i) x.push(wte.wide[i]);
        return x;
      }();
      Values out(B * Tn * C, 64);
      loom::kernels::vocab_parallel_embedding_forward<bf16>(*be, out.bf({B, Tn, C}), ids, slice.cbf({rows, C}),
                                                            vocab_begin, wpe.cbf({maxT, C}));
      loom::kernels::vocab_parallel_embedding_forward<float>(*be, out.fl({B, Tn, C}), ids, slice.cfl({rows, C}),
                                                             vocab_begin, wpe.cfl({maxT, C}));
      check_close(out.narrow, out.wide, 0.0);
      Values dwte(rows * C, 65), dwpe(maxT * C, 66);
      loom::kernels::vocab_parallel_embedding_backward<bf16>(*be, dwte.bf({rows, C}), vocab_begin,
                                                             dwpe.bf({maxT, C}), dout.cbf({B, Tn, C}), ids);
      loom::kernels::vocab_parallel_embedding_backward<float>(*be, dwte.fl({rows, C}), vocab_begin,
                                                              dwpe.fl({maxT, C}), dout.cfl({B, Tn, C}), ids);
      // A token repeats up to B * Tn / V + 1 = 13 times; a position sums B rows.
      check_close(dwte.narrow, dwte.wide, 14.0, 14);
      check_close(dwpe.narrow, dwpe.wide, static_cast<double>(B + 1), B + 1);
      // Into fp32 sums (fp32 gradient fusion): the float kernel's bits, from the same values in
      // the same order, nothing rounded to bf16.
      Values dwte32(rows * C, 65), dwpe32(maxT * C, 66);
      loom::kernels::vocab_parallel_embedding_backward<bf16>(*be, dwte32.fl({rows, C}), vocab_begin,
                                                             dwpe32.fl({maxT, C}), dout.cbf({B, Tn, C}), ids);
      CHECK(dwte32.wide == dwte.wide);
      CHECK(dwpe32.wide == dwpe.wide);
    }
    // The whole-vocabulary kernels share the same code.
    Values out(B * Tn * C, 67), dwte(V * C, 68), dwpe(maxT * C, 69);
    loom::kernels::embedding_forward<bf16>(*be, out.bf({B, Tn, C}), ids, wte.cbf({V, C}), wpe.cbf({maxT, C}));
    loom::kernels::embedding_forward<float>(*be, out.fl({B, Tn, C}), ids, wte.cfl({V, C}), wpe.cfl({maxT, C}));
    check_close(out.narrow, out.wide, 0.0);
    loom::kernels::embedding_backward<bf16>(*be, dwte.bf({V, C}), dwpe.bf({maxT, C}), dout.cbf({B, Tn, C}), ids);
    loom::kernels::embedding_backward<float>(*be, dwte.fl({V, C}), dwpe.fl({maxT, C}), dout.cfl({B, Tn, C}), ids);
    check_close(dwte.narrow, dwte.wide, 14.0, 14);
    check_close(dwpe.narrow, dwpe.wide, static_cast<double>(B + 1), B + 1);
  }
}

TEST_CASE("bf16: vocabulary-parallel cross-entropy keeps float losses and double statistics") {
  const cpu be(2);
  const std::int64_t N = 9, vocab = 50, Vs = 64;  // one slice with 14 padding columns
  const Values logits(N * Vs, 71, -4.0, 4.0);
  std::vector<std::int32_t> target_values(N);
  for (std::int64_t n = 0; n < N; ++n) target_values[n] = n == 2 ? -1 : static_cast<std::int32_t>((7 * n + 1) % vocab);
  const Tensor<const std::int32_t> targets(target_values.data(), {N});

  std::vector<double> stats(3 * N), stats_f(3 * N);
  const auto row_max = [](std::vector<double>& s) { return Tensor<double>(s.data(), {N}); };
  const auto partials = [](std::vector<double>& s) { return Tensor<double>(s.data() + N, {2, N}); };
  loom::kernels::vocab_parallel_cross_entropy_statistics<bf16>(be, row_max(stats), partials(stats),
                                                               logits.cbf({N, Vs}), targets, 0, vocab);
  loom::kernels::vocab_parallel_cross_entropy_statistics<float>(be, row_max(stats_f), partials(stats_f),
                                                                logits.cfl({N, Vs}), targets, 0, vocab);
  CHECK(std::equal(stats.begin(), stats.begin() + N, stats_f.begin()));              // a max is exact
  CHECK(std::equal(stats.begin() + 2 * N, stats.end(), stats_f.begin() + 2 * N));    // so is a target's logit
  // The sums of exps are taken over the float exps of the widened logits: float's sums.
  for (std::int64_t i = N; i < 2 * N; ++i) CHECK(std::abs(stats[i] - stats_f[i]) <= 1e-6 * std::abs(stats_f[i]));

  std::vector<float> losses(N), losses_f(N);
  loom::kernels::vocab_parallel_cross_entropy_losses<bf16>(be, Tensor<float>(losses.data(), {N}),
                                                           Tensor<const double>(row_max(stats)),
                                                           Tensor<const double>(partials(stats)), targets);
  loom::kernels::vocab_parallel_cross_entropy_losses<float>(be, Tensor<float>(losses_f.data(), {N}),
                                                            Tensor<const double>(row_max(stats_f)),
                                                            Tensor<const double>(partials(stats_f)), targets);
  for (std::int64_t n = 0; n < N; ++n) CHECK(std::abs(losses[n] - losses_f[n]) <= 1e-6 * std::abs(losses_f[n]));

  // The models' path: dlogits in place of the logits, the probabilities rounded once to bf16,
  // then the gradient once more.
  Values dlogits = logits;
  loom::kernels::vocab_parallel_cross_entropy_backward<bf16>(
      be, dlogits.bf({N, Vs}), dlogits.cbf({N, Vs}), Tensor<const double>(row_max(stats)),
      Tensor<const double>(partials(stats)), targets, 0, vocab, 1.0f / N);
  loom::kernels::vocab_parallel_cross_entropy_backward<float>(
      be, dlogits.fl({N, Vs}), dlogits.cfl({N, Vs}), Tensor<const double>(row_max(stats_f)),
      Tensor<const double>(partials(stats_f)), targets, 0, vocab, 1.0f / N);
  check_close(dlogits.narrow, dlogits.wide, 1.0f / N, 1, 2);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t j = vocab; j < Vs; ++j) CHECK(dlogits.narrow[n * Vs + j] == bf16(0.0f));
  CHECK(dlogits.narrow != logits.narrow);  // not a test that passes by doing nothing

  // Backward from the same probabilities (bf16 ones) on both sides.
  Values probs;
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t j = 0; j < Vs; ++j)
      probs.push(j < vocab ? static_cast<float>(std::exp(static_cast<double>(logits.wide[n * Vs + j]) - stats[n]) /
                                                stats[N + n])
                           : 0.0f);
  loom::kernels::vocab_parallel_cross_entropy_backward<bf16>(be, probs.bf({N, Vs}), probs.cbf({N, Vs}), targets, 0,
                                                             vocab, 1.0f / N);
  loom::kernels::vocab_parallel_cross_entropy_backward<float>(be, probs.fl({N, Vs}), probs.cfl({N, Vs}), targets, 0,
                                                              vocab, 1.0f / N);
  check_close(probs.narrow, probs.wide, 0.0);
}

TEST_CASE("bf16: AdamW with fp32 master weights gives the float kernel's bits") {
  const cpu one(1), two(2);
  for (std::size_t n : {std::size_t{7}, std::size_t{100003}}) {
    CAPTURE(n);
    const auto count = static_cast<std::int64_t>(n);
    for (const cpu* be : {&one, &two}) {
      const Values initial(n, 81);
      std::vector<float> master = initial.wide, m(n, 0.0f), v(n, 0.0f);
      std::vector<bf16> params = initial.narrow;
      std::vector<float> params_f = initial.wide, m_f(n, 0.0f), v_f(n, 0.0f);
      for (int s = 1; s <= 3; ++s) {
        const loom::AdamWUpdate h{.lr = 0.05, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = s};
        const Values grads(n, 90 + s, -2.0, 2.0);
        loom::kernels::adamw_update<bf16>(*be, Tensor<bf16>(params.data(), {count}), grads.cbf({count}),
                                          Tensor<float>(master.data(), {count}), Tensor<float>(m.data(), {count}),
                                          Tensor<float>(v.data(), {count}), h);
        loom::kernels::adamw_update<float>(*be, Tensor<float>(params_f.data(), {count}), grads.cfl({count}),
                                           Tensor<float>(m_f.data(), {count}), Tensor<float>(v_f.data(), {count}), h);
      }
      CHECK(master == params_f);
      CHECK(m == m_f);
      CHECK(v == v_f);
      std::vector<bf16> rounded;
      for (float x : master) rounded.push_back(bf16(x));
      CHECK(params == rounded);
      CHECK(widened(params) != master);  // the master weights hold what bf16 cannot
    }
  }
  std::vector<float> too_short(3);
  std::vector<bf16> p(4);
  loom::test::expect_error(
      [&] {
        loom::kernels::adamw_update<bf16>(one, Tensor<bf16>(p.data(), {4}), Tensor<const bf16>(p.data(), {4}),
                                          Tensor<float>(too_short.data(), {3}), Tensor<float>(too_short.data(), {3}),
                                          Tensor<float>(too_short.data(), {3}), loom::AdamWUpdate{});
      },
      "adamw_update: argument m element count");
}

TEST_CASE("bf16: SGD with momentum and fp32 master weights gives the float kernel's bits") {
  const cpu be(2);
  const std::size_t n = 70001;
  const auto count = static_cast<std::int64_t>(n);
  for (bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    const Values initial(n, 101);
    std::vector<float> master = initial.wide, momentum(n, 0.0f), params_f = initial.wide, momentum_f(n, 0.0f);
    std::vector<bf16> params = initial.narrow;
    for (int s = 1; s <= 3; ++s) {
      const loom::SgdUpdate h{.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01, .nesterov = nesterov};
      const Values grads(n, 110 + s);
      loom::kernels::sgd_momentum_update<bf16>(be, Tensor<bf16>(params.data(), {count}), grads.cbf({count}),
                                               Tensor<float>(master.data(), {count}),
                                               Tensor<float>(momentum.data(), {count}), h);
      loom::kernels::sgd_momentum_update<float>(be, Tensor<float>(params_f.data(), {count}), grads.cfl({count}),
                                                Tensor<float>(momentum_f.data(), {count}), h);
    }
    CHECK(master == params_f);
    CHECK(momentum == momentum_f);
    std::vector<bf16> rounded;
    for (float x : master) rounded.push_back(bf16(x));
    CHECK(params == rounded);
  }
}

}  // namespace test_kernel_bf16
