// Multi-head attention kernels, causal and bidirectional (loom::AttentionMask), both pairs
// (attention_forward/backward, which save the probabilities, and the _lse pair, which saves the row
// log-sum-exp and recomputes): forward against a plain reference, backward against central
// differences and against each other, the accumulate convention, bf16 against float, shape and
// mask checks and thread-count determinism.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "loom/backend/attention_mask.hpp"
#include "loom/backend/cpu/attention.hpp"
#include "loom/core/bf16.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_attention {

namespace {

using loom::AttentionMask;
using loom::Shape;
using loom::Tensor;
using loom::cpu;

struct Case {
  std::int64_t B, T, C;
  int NH;
};

//! Plain triple-loop attention in double: returns out [B,T,C] and fills att [B,NH,T,T] and, where
//! given, lse [B,NH,T] = log Σ_s exp of the scaled scores, over the keys s that t sees: s <= t
//! (causal) or all s < T (bidirectional), and below lengths[b] where `lengths` is given (a padded
//! query t >= lengths[b] sees none: its out, att and lse are 0).
template <class T>
std::vector<double> reference_forward(const std::vector<T>& qkv, const Case& c,
                                      std::vector<double>& att, std::vector<double>* lse = nullptr,
                                      AttentionMask mask = AttentionMask::causal,
                                      const std::vector<std::int32_t>* lengths = nullptr) {
  const std::int64_t hs = c.C / c.NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> out(c.B * c.T * c.C, 0.0);
  att.assign(c.B * c.NH * c.T * c.T, 0.0);
  if (lse != nullptr) lse->assign(c.B * c.NH * c.T, 0.0);
  auto at = [&](std::int64_t b, std::int64_t t, std::int64_t part, std::int64_t h,
                std::int64_t i) -> double {
    return static_cast<double>(qkv[(b * c.T + t) * 3 * c.C + part * c.C + h * hs + i]);
  };
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.NH; ++h)
      for (std::int64_t t = 0; t < c.T; ++t) {
        double* row = &att[((b * c.NH + h) * c.T + t) * c.T];
        const std::int64_t length = lengths != nullptr ? (*lengths)[static_cast<std::size_t>(b)] : c.T;
        if (t >= length) continue;  // a padded query sees nothing: out, att and lse stay 0
        const std::int64_t keys = std::min(mask == AttentionMask::causal ? t + 1 : c.T, length);
        double max = -1e300;
        for (std::int64_t s = 0; s < keys; ++s) {
          double dot = 0;
          for (std::int64_t i = 0; i < hs; ++i) dot += at(b, t, 0, h, i) * at(b, s, 1, h, i);
          row[s] = dot * scale;
          max = std::max(max, row[s]);
        }
        double sum = 0;
        for (std::int64_t s = 0; s < keys; ++s) sum += row[s] = std::exp(row[s] - max);
        if (lse != nullptr) (*lse)[(b * c.NH + h) * c.T + t] = max + std::log(sum);
        for (std::int64_t s = 0; s < keys; ++s) row[s] /= sum;
        for (std::int64_t i = 0; i < hs; ++i) {
          double acc = 0;
          for (std::int64_t s = 0; s < keys; ++s) acc += row[s] * at(b, s, 2, h, i);
          out[(b * c.T + t) * c.C + h * hs + i] = acc;
        }
      }
  return out;
}

//! Bound on max_relative_error against the double reference. The floor under the relative error
//! is 0.1 for out (a mix of v values in [-2, 2): float rounding is relative to that scale, not to
//! a small mix), 0.01 for the probabilities and 1 for lse (scaled scores of |q|, |k| <= 2).
template <class T>
double forward_tolerance() {
  return sizeof(T) == sizeof(double) ? 1e-12 : 1e-5;
}

//! A forward's results: out [B,T,C] and what it saves for the backward.
template <class T>
struct Run {
  std::vector<T> out, saved;
};

//! attention_forward/attention_backward, which save the probabilities att [B,NH,T,T].
template <class T>
struct SavesProbs {
  using type = T;
  static Run<T> forward(const cpu& be, const std::vector<T>& qkv, const Case& c,
                        loom::AttentionKeys mask = AttentionMask::causal) {
    Run<T> r{std::vector<T>(c.B * c.T * c.C), std::vector<T>(c.B * c.NH * c.T * c.T, T(7))};
    loom::kernels::attention_forward<T>(be, Tensor<T>(r.out.data(), {c.B, c.T, c.C}),
                                        Tensor<T>(r.saved.data(), {c.B, c.NH, c.T, c.T}),
                                        Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}), c.NH, mask);
    return r;
  }
  static void backward(const cpu& be, std::vector<T>& dqkv, const std::vector<T>& dout, const std::vector<T>& qkv,
                       const Run<T>& r, const Case& c, loom::AttentionKeys mask = AttentionMask::causal,
                       loom::GradientWrite write = loom::GradientWrite::accumulate) {
    loom::kernels::attention_backward<T>(be, Tensor<T>(dqkv.data(), {c.B, c.T, 3 * c.C}),
                                         Tensor<const T>(dout.data(), {c.B, c.T, c.C}),
                                         Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}),
                                         Tensor<const T>(r.saved.data(), {c.B, c.NH, c.T, c.T}), c.NH, mask, {},
                                         write);
  }
};

//! attention_forward_lse/attention_backward_lse, which save only the row log-sum-exp lse
//! [B,NH,T] (float and double are their own accumulate type).
template <class T>
struct SavesLse {
  using type = T;
  static Run<T> forward(const cpu& be, const std::vector<T>& qkv, const Case& c,
                        loom::AttentionKeys mask = AttentionMask::causal) {
    Run<T> r{std::vector<T>(c.B * c.T * c.C), std::vector<T>(c.B * c.NH * c.T, T(7))};
    loom::kernels::attention_forward_lse<T>(be, Tensor<T>(r.out.data(), {c.B, c.T, c.C}),
                                            Tensor<T>(r.saved.data(), {c.B, c.NH, c.T}),
                                            Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}), c.NH, mask);
    return r;
  }
  static void backward(const cpu& be, std::vector<T>& dqkv, const std::vector<T>& dout, const std::vector<T>& qkv,
                       const Run<T>& r, const Case& c, loom::AttentionKeys mask = AttentionMask::causal,
                       loom::GradientWrite write = loom::GradientWrite::accumulate) {
    loom::kernels::attention_backward_lse<T>(be, Tensor<T>(dqkv.data(), {c.B, c.T, 3 * c.C}),
                                             Tensor<const T>(dout.data(), {c.B, c.T, c.C}),
                                             Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}),
                                             Tensor<const T>(r.out.data(), {c.B, c.T, c.C}),
                                             Tensor<const T>(r.saved.data(), {c.B, c.NH, c.T}), c.NH, mask, {},
                                             write);
  }
};

//! A backward checked against central differences in double: the loss Σ out·w (w random) of
//! Kernels' forward with `keys`, differentiated over every element of a random qkv.
template <class Kernels>
struct CheckedBackward {
  std::vector<double> qkv, w, numeric, dqkv;
  Run<double> run;
};

//! Runs Kernels' backward for case `c` (data from `seed`) and CHECKs it against central
//! differences (relative error <= 1e-6 over a floor of 1e-3); returns what it used.
template <class Kernels>
CheckedBackward<Kernels> check_backward_by_differences(const cpu& be, const Case& c, const loom::AttentionKeys& keys,
                                                       std::uint64_t seed) {
  CAPTURE(c.B);
  CAPTURE(c.T);
  CAPTURE(c.C);
  CAPTURE(c.NH);
  CheckedBackward<Kernels> k;
  k.qkv = loom::test::random_vector<double>(c.B * c.T * 3 * c.C, seed, -1.5, 1.5);
  k.w = loom::test::random_vector<double>(c.B * c.T * c.C, seed + 1);
  auto loss = [&] {
    const auto r = Kernels::forward(be, k.qkv, c, keys);
    double total = 0;
    for (std::size_t i = 0; i < k.w.size(); ++i) total += r.out[i] * k.w[i];
    return total;
  };
  k.numeric = loom::test::finite_difference(loss, std::span<double>(k.qkv), 1e-4);
  k.run = Kernels::forward(be, k.qkv, c, keys);
  k.dqkv.assign(k.qkv.size(), 0.0);
  Kernels::backward(be, k.dqkv, k.w, k.qkv, k.run, c, keys);
  CHECK(loom::test::max_relative_error(k.dqkv, k.numeric, 1e-3) <= 1e-6);
  return k;
}

//! Both kernel pairs in both types, for the tests that hold for each (the saved state is opaque to
//! them).
using KernelPairs = std::tuple<SavesProbs<float>, SavesProbs<double>, SavesLse<float>, SavesLse<double>>;

// T = 70 and 133 span more than one 64-row block of the kernel.
const Case cases[] = {{2, 5, 6, 2}, {2, 5, 6, 3}, {1, 1, 6, 3}, {3, 1, 4, 1},
                      {2, 70, 12, 3}, {1, 133, 8, 2}};

// The bidirectional mask's cases: odd T (70 and 130 cross the 64-row blocks, 130 by a block of
// two rows) and 1 to 4 heads.
const Case bidirectional_cases[] = {{2, 1, 6, 3}, {2, 5, 6, 2}, {2, 5, 6, 3}, {1, 17, 12, 4},
                                    {2, 70, 12, 3}, {1, 130, 8, 2}, {2, 130, 6, 1}};

// The central differences take two forward passes per qkv element, a cost of about
// B² T³ C²: smaller shapes for both masks, still crossing one 64-row block (70) and two (133,
// by a block of five rows), with 1 to 4 heads and T = 1. The debug + ASan build runs these
// too; {2, 70, 12, 3} and {1, 133, 8, 2} alone took it 15 minutes.
const Case gradient_cases[] = {{2, 5, 6, 2}, {2, 5, 6, 3}, {1, 1, 6, 3}, {3, 1, 4, 1},
                               {1, 17, 12, 4}, {1, 70, 6, 2}, {1, 133, 2, 1}};

constexpr AttentionMask both_masks[] = {AttentionMask::causal, AttentionMask::bidirectional};

}  // namespace

TEST_CASE_TEMPLATE("attention_forward and attention_forward_lse match the plain reference", T, float, double) {
  const cpu be(1);
  for (const Case& c : cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.NH);
    const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 11, -2.0, 2.0);
    std::vector<double> att_ref, lse_ref;
    const auto out_ref = reference_forward(qkv, c, att_ref, &lse_ref);
    const auto r = SavesProbs<T>::forward(be, qkv, c);
    CHECK(loom::test::max_relative_error(r.out, out_ref, 1e-1) <= forward_tolerance<T>());
    CHECK(loom::test::max_relative_error(r.saved, att_ref, 1e-2) <= forward_tolerance<T>());
    // Masked entries are exactly zero, not merely small.
    for (std::int64_t bh = 0; bh < c.B * c.NH; ++bh)
      for (std::int64_t t = 0; t < c.T; ++t)
        for (std::int64_t s = t + 1; s < c.T; ++s) REQUIRE(r.saved[(bh * c.T + t) * c.T + s] == T(0));
    // The lse forward runs the same arithmetic for out: the same bits.
    const auto l = SavesLse<T>::forward(be, qkv, c);
    CHECK(l.out == r.out);
    CHECK(loom::test::max_relative_error(l.saved, lse_ref, 1.0) <= forward_tolerance<T>());
  }
}

TEST_CASE_TEMPLATE("attention backward matches central differences (double)", Kernels, SavesProbs<double>,
                   SavesLse<double>) {
  const cpu be(1);
  for (const Case& c : gradient_cases) check_backward_by_differences<Kernels>(be, c, AttentionMask::causal, 21);
}

TEST_CASE_TEMPLATE("attention backward with T = 1 gives zero dq, dk and dv = dout", Kernels, SavesProbs<double>,
                   SavesLse<double>) {
  const cpu be(1);
  const Case c{2, 1, 6, 3};
  const auto qkv = loom::test::random_vector<double>(c.B * 3 * c.C, 5);
  const auto dout = loom::test::random_vector<double>(c.B * c.C, 6);
  const auto r = Kernels::forward(be, qkv, c);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t i = 0; i < c.C; ++i) CHECK(r.out[b * c.C + i] == qkv[b * 3 * c.C + 2 * c.C + i]);
  // What is saved for one key: its probability 1, or lse = its scaled score.
  if constexpr (std::is_same_v<Kernels, SavesProbs<double>>) {
    for (double a : r.saved) CHECK(a == 1.0);
  } else {
    const std::int64_t hs = c.C / c.NH;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.NH; ++h) {
        double dot = 0;
        for (std::int64_t i = 0; i < hs; ++i)
          dot += qkv[b * 3 * c.C + h * hs + i] * qkv[b * 3 * c.C + c.C + h * hs + i];
        CHECK(r.saved[b * c.NH + h] == doctest::Approx(dot / std::sqrt(static_cast<double>(hs))).epsilon(1e-14));
      }
  }
  std::vector<double> dqkv(qkv.size(), 0.0);
  Kernels::backward(be, dqkv, dout, qkv, r, c);
  // The stored probability is exactly 1, so dq and dk are exactly 0; the recomputed one,
  // exp(score - lse), is 1 to the last bit, or within an ulp where a compiler fuses
  // score * scale - lse.
  const double zero = std::is_same_v<Kernels, SavesProbs<double>> ? 0.0 : 1e-15;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t i = 0; i < c.C; ++i) {
      CHECK(std::abs(dqkv[b * 3 * c.C + i]) <= zero);
      CHECK(std::abs(dqkv[b * 3 * c.C + c.C + i]) <= zero);
      CHECK(dqkv[b * 3 * c.C + 2 * c.C + i] == doctest::Approx(dout[b * c.C + i]).epsilon(1e-15));
    }
}

TEST_CASE_TEMPLATE("attention_backward_lse matches attention_backward", T, float, double) {
  const cpu be(1);
  // The recomputed probabilities differ from the stored ones in the last bits (measured 3e-7 for
  // float, 1e-15 for double); gradients are O(1): compare on an absolute scale of 1.
  const double tolerance = sizeof(T) == sizeof(double) ? 1e-13 : 2e-6;
  for (const Case& c : cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.NH);
    const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 23, -2.0, 2.0);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 24);
    std::vector<T> stored(qkv.size(), T(0)), recomputed(qkv.size(), T(0));
    SavesProbs<T>::backward(be, stored, dout, qkv, SavesProbs<T>::forward(be, qkv, c), c);
    SavesLse<T>::backward(be, recomputed, dout, qkv, SavesLse<T>::forward(be, qkv, c), c);
    CHECK(loom::test::max_relative_error(recomputed, stored, 1.0) <= tolerance);
  }
}

// ---------------------------------------------------------------------------------------------
// The bidirectional mask: every query sees every key of its sequence.

TEST_CASE_TEMPLATE("bidirectional attention_forward and attention_forward_lse match the plain reference", T, float,
                   double) {
  const cpu be(1);
  constexpr AttentionMask mask = AttentionMask::bidirectional;
  for (const Case& c : bidirectional_cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.NH);
    const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 12, -2.0, 2.0);
    std::vector<double> att_ref, lse_ref;
    const auto out_ref = reference_forward(qkv, c, att_ref, &lse_ref, mask);
    const auto r = SavesProbs<T>::forward(be, qkv, c, mask);
    CHECK(loom::test::max_relative_error(r.out, out_ref, 1e-1) <= forward_tolerance<T>());
    CHECK(loom::test::max_relative_error(r.saved, att_ref, 1e-2) <= forward_tolerance<T>());
    // Every row is a distribution over all T keys: no entry is 0 (the causal upper triangle would
    // be), and each row sums to 1.
    std::int64_t zeros = 0;
    double worst_sum = 0;
    for (std::int64_t row = 0; row < c.B * c.NH * c.T; ++row) {
      double sum = 0;
      for (std::int64_t s = 0; s < c.T; ++s) {
        const T p = r.saved[row * c.T + s];
        zeros += p == T(0);
        sum += static_cast<double>(p);
      }
      worst_sum = std::max(worst_sum, std::abs(sum - 1.0));
    }
    CHECK(zeros == 0);
    CHECK(worst_sum <= static_cast<double>(c.T) * forward_tolerance<T>());
    // Not the causal result: with T > 1 every query but the last sees keys the causal mask hides;
    // the last query sees all keys under both masks. With T = 1 the masks agree to the bit.
    const auto causal = SavesProbs<T>::forward(be, qkv, c);
    if (c.T == 1) {
      CHECK(r.out == causal.out);
      CHECK(r.saved == causal.saved);
    } else {
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t t = 0; t < c.T; ++t) {
          double diff = 0;
          for (std::int64_t i = 0; i < c.C; ++i) {
            const std::int64_t o = (b * c.T + t) * c.C + i;
            diff = std::max(diff, std::abs(static_cast<double>(r.out[o]) - static_cast<double>(causal.out[o])));
          }
          CAPTURE(b);
          CAPTURE(t);
          // Far beyond float's rounding (out is O(1)), though the hidden keys may weigh little.
          if (t + 1 < c.T) CHECK(diff > 1e-5);
          else CHECK(diff <= 1e-6);
        }
    }
    // The lse forward runs the same arithmetic for out: the same bits.
    const auto l = SavesLse<T>::forward(be, qkv, c, mask);
    CHECK(l.out == r.out);
    CHECK(loom::test::max_relative_error(l.saved, lse_ref, 1.0) <= forward_tolerance<T>());
  }
}

TEST_CASE_TEMPLATE("bidirectional attention backward matches central differences (double)", Kernels,
                   SavesProbs<double>, SavesLse<double>) {
  const cpu be(1);
  for (const Case& c : gradient_cases) {
    const auto k = check_backward_by_differences<Kernels>(be, c, AttentionMask::bidirectional, 25);
    if (c.T > 1) {
      // The causal backward from the same forward is another gradient: the mask reaches it.
      std::vector<double> causal(k.qkv.size(), 0.0);
      Kernels::backward(be, causal, k.w, k.qkv, k.run, c);
      CHECK(loom::test::max_relative_error(causal, k.numeric, 1e-3) > 1e-2);
    }
  }
}

TEST_CASE_TEMPLATE("bidirectional attention_backward_lse matches attention_backward", T, float, double) {
  const cpu be(1);
  constexpr AttentionMask mask = AttentionMask::bidirectional;
  // As for the causal mask (measured here: 2.4e-7 for float, 4.5e-16 for double).
  const double tolerance = sizeof(T) == sizeof(double) ? 1e-13 : 2e-6;
  for (const Case& c : bidirectional_cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.NH);
    const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 27, -2.0, 2.0);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 28);
    std::vector<T> stored(qkv.size(), T(0)), recomputed(qkv.size(), T(0));
    SavesProbs<T>::backward(be, stored, dout, qkv, SavesProbs<T>::forward(be, qkv, c, mask), c, mask);
    SavesLse<T>::backward(be, recomputed, dout, qkv, SavesLse<T>::forward(be, qkv, c, mask), c, mask);
    CHECK(loom::test::max_relative_error(recomputed, stored, 1.0) <= tolerance);
  }
}

namespace {

using loom::bf16;

//! bf16(x) of each float, and those values widened back to float (exactly).
struct Rounded {
  std::vector<bf16> narrow;
  std::vector<float> wide;
  explicit Rounded(const std::vector<float>& x) {
    for (float v : x) {
      narrow.push_back(bf16(v));
      wide.push_back(static_cast<float>(narrow.back()));
    }
  }
};

//! test_kernel_bf16.cpp's bound: |bf16 - float| <= 2^-8 |float| + sqrt(terms) 2^-22 magnitude,
//! element by element (one bf16 rounding of the result, float sums reassociated).
void check_bf16_close(const std::vector<bf16>& got, const std::vector<float>& want, double magnitude,
                      std::int64_t terms) {
  REQUIRE(got.size() == want.size());
  const double slack = std::sqrt(static_cast<double>(terms)) * std::ldexp(1.0, -22) * magnitude;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double w = want[i], g = static_cast<float>(got[i]);
    worst = std::max(worst, std::abs(g - w) - (std::ldexp(1.0, -8) * std::abs(w) + slack));
  }
  CHECK(worst <= 0.0);
}

}  // namespace

TEST_CASE("bidirectional attention on bf16 (both pairs) runs each head in float") {
  const cpu one(1), two(2);
  constexpr AttentionMask mask = AttentionMask::bidirectional;
  struct Size {
    std::int64_t B, T, NH, hs;
  };
  for (const Size z : {Size{1, 1, 1, 1}, Size{2, 7, 3, 5}, Size{1, 70, 2, 16}, Size{1, 130, 4, 8}}) {
    CAPTURE(z.T);
    const std::int64_t B = z.B, Tn = z.T, NH = z.NH, C = z.NH * z.hs;
    const int heads = static_cast<int>(NH);
    const Rounded qkv(loom::test::random_vector<float>(B * Tn * 3 * C, 51, -2.0, 2.0));
    const Rounded dout(loom::test::random_vector<float>(B * Tn * C, 52));
    const Rounded dqkv0(loom::test::random_vector<float>(B * Tn * 3 * C, 55));
    const Tensor<const bf16> qkv_b(qkv.narrow.data(), {B, Tn, 3 * C}), dout_b(dout.narrow.data(), {B, Tn, C});
    const Tensor<const float> qkv_f(qkv.wide.data(), {B, Tn, 3 * C}), dout_f(dout.wide.data(), {B, Tn, C});
    for (const cpu* be : {&one, &two}) {
      // The stored pair.
      std::vector<bf16> out_b(B * Tn * C), att_b(B * NH * Tn * Tn);
      std::vector<float> out_f(out_b.size()), att_f(att_b.size());
      loom::kernels::attention_forward<bf16>(*be, Tensor<bf16>(out_b.data(), {B, Tn, C}),
                                             Tensor<bf16>(att_b.data(), {B, NH, Tn, Tn}), qkv_b, heads, mask);
      loom::kernels::attention_forward<float>(*be, Tensor<float>(out_f.data(), {B, Tn, C}),
                                              Tensor<float>(att_f.data(), {B, NH, Tn, Tn}), qkv_f, heads, mask);
      check_bf16_close(att_b, att_f, 1.0, z.hs);
      check_bf16_close(out_b, out_f, 1.0, Tn);  // convex combinations of |v| <= 2
      for (bf16 p : att_b) REQUIRE(static_cast<float>(p) > 0.0f);  // every key seen
      // The backward from the same (bf16) probabilities on both sides.
      const Rounded probs([&] {
        std::vector<float> p;
        for (bf16 x : att_b) p.push_back(static_cast<float>(x));
        return p;
      }());
      std::vector<bf16> dqkv_b = dqkv0.narrow;
      std::vector<float> dqkv_f = dqkv0.wide;
      loom::kernels::attention_backward<bf16>(*be, Tensor<bf16>(dqkv_b.data(), {B, Tn, 3 * C}), dout_b, qkv_b,
                                              Tensor<const bf16>(probs.narrow.data(), {B, NH, Tn, Tn}), heads, mask);
      loom::kernels::attention_backward<float>(*be, Tensor<float>(dqkv_f.data(), {B, Tn, 3 * C}), dout_f, qkv_f,
                                               Tensor<const float>(probs.wide.data(), {B, NH, Tn, Tn}), heads, mask);
      check_bf16_close(dqkv_b, dqkv_f, 4.0 * static_cast<double>(z.hs + Tn), z.hs + Tn);

      // The lse pair: out as above; lse in float from the same values (float reassociation only).
      std::vector<float> lse_b(B * NH * Tn), lse_f(lse_b.size());
      loom::kernels::attention_forward_lse<bf16>(*be, Tensor<bf16>(out_b.data(), {B, Tn, C}),
                                                 Tensor<float>(lse_b.data(), {B, NH, Tn}), qkv_b, heads, mask);
      loom::kernels::attention_forward_lse<float>(*be, Tensor<float>(out_f.data(), {B, Tn, C}),
                                                  Tensor<float>(lse_f.data(), {B, NH, Tn}), qkv_f, heads, mask);
      check_bf16_close(out_b, out_f, 1.0, Tn);
      const double lse_bound =
          std::sqrt(static_cast<double>(z.hs + Tn)) * std::ldexp(1.0, -22) * (4.0 * std::sqrt(z.hs) + Tn);
      for (std::size_t i = 0; i < lse_b.size(); ++i) CHECK(std::abs(lse_b[i] - lse_f[i]) <= lse_bound);
      // The backward from the same (float) lse and the same out (bf16's, widened) on both sides.
      std::vector<float> out_widened;
      for (bf16 x : out_b) out_widened.push_back(static_cast<float>(x));
      const Tensor<const float> saved(lse_f.data(), {B, NH, Tn});
      dqkv_b = dqkv0.narrow;
      dqkv_f = dqkv0.wide;
      loom::kernels::attention_backward_lse<bf16>(*be, Tensor<bf16>(dqkv_b.data(), {B, Tn, 3 * C}), dout_b, qkv_b,
                                                  Tensor<const bf16>(out_b.data(), {B, Tn, C}), saved, heads, mask);
      loom::kernels::attention_backward_lse<float>(*be, Tensor<float>(dqkv_f.data(), {B, Tn, 3 * C}), dout_f, qkv_f,
                                                   Tensor<const float>(out_widened.data(), {B, Tn, C}), saved, heads,
                                                   mask);
      check_bf16_close(dqkv_b, dqkv_f, 4.0 * static_cast<double>(z.hs + Tn), z.hs + Tn);
    }
  }
}

// Padded sequences (AttentionKeys::lengths): no query sees a key at or past its sequence's length.

namespace {

//! A batch of sequences of different lengths: a case and each sequence's length (1 and T
//! included; 65 and 2 against the 64-row blocks).
struct PaddedCase {
  Case c;
  std::vector<std::int32_t> lengths;
};

std::vector<PaddedCase> padded_cases() {
  return {{{3, 5, 6, 2}, {1, 3, 5}}, {{2, 70, 12, 3}, {70, 37}}, {{3, 130, 8, 2}, {130, 65, 2}}};
}

loom::AttentionKeys padded_keys(AttentionMask mask, const std::vector<std::int32_t>& lengths) {
  return {mask, Tensor<const std::int32_t>(lengths.data(), {static_cast<std::int64_t>(lengths.size())})};
}

}  // namespace

TEST_CASE_TEMPLATE("padded attention (both pairs) matches the plain reference; padding gets exactly zero weight", T,
                   float, double) {
  const cpu be(2);
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : padded_cases()) {
      const Case& c = pc.c;
      INFO(loom::name(mask));
      CAPTURE(c.T);
      const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 61, -2.0, 2.0);
      std::vector<double> att_ref, lse_ref;
      const auto out_ref = reference_forward(qkv, c, att_ref, &lse_ref, mask, &pc.lengths);
      const auto keys = padded_keys(mask, pc.lengths);
      const auto r = SavesProbs<T>::forward(be, qkv, c, keys);
      CHECK(loom::test::max_relative_error(r.out, out_ref, 1e-1) <= forward_tolerance<T>());
      CHECK(loom::test::max_relative_error(r.saved, att_ref, 1e-2) <= forward_tolerance<T>());
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t bh = b * c.NH; bh < (b + 1) * c.NH; ++bh)
          for (std::int64_t t = 0; t < c.T; ++t)
            for (std::int64_t s = pc.lengths[static_cast<std::size_t>(b)]; s < c.T; ++s)
              REQUIRE(r.saved[(bh * c.T + t) * c.T + s] == T(0));
      const auto l = SavesLse<T>::forward(be, qkv, c, keys);
      CHECK(l.out == r.out);
      CHECK(loom::test::max_relative_error(l.saved, lse_ref, 1.0) <= forward_tolerance<T>());
    }
  }
}

TEST_CASE_TEMPLATE("padded attention backward matches central differences (double); padding gets no gradient",
                   Kernels, SavesProbs<double>, SavesLse<double>) {
  const cpu be(1);
  const PaddedCase padded_gradient_cases[] = {{{2, 5, 6, 2}, {2, 5}}, {{2, 6, 4, 1}, {1, 4}}, {{1, 70, 6, 2}, {66}}};
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : padded_gradient_cases) {
      const Case& c = pc.c;
      INFO(loom::name(mask));
      const auto dqkv = check_backward_by_differences<Kernels>(be, c, padded_keys(mask, pc.lengths), 62).dqkv;
      // Padding takes no part: no query sees a padded key and a padded query sees nothing, so
      // its q, k and v get exactly no gradient.
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t t = pc.lengths[static_cast<std::size_t>(b)]; t < c.T; ++t)
          for (std::int64_t i = 0; i < 3 * c.C; ++i) REQUIRE(dqkv[(b * c.T + t) * 3 * c.C + i] == 0.0);
    }
  }
}

TEST_CASE_TEMPLATE_DEFINE("a padded sequence gets what it gets alone at its length; full lengths change no bit",
                          Kernels, padded_alone) {
  using T = typename Kernels::type;
  const cpu be(2);
  const double tolerance = sizeof(T) == sizeof(double) ? 1e-12 : 1e-5;
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : padded_cases()) {
      const Case& c = pc.c;
      INFO(loom::name(mask));
      CAPTURE(c.T);
      const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 64);
      // Padded rows' output gradient too: a padded query's out is 0 whatever its q, k and v.
      const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 65);
      const auto keys = padded_keys(mask, pc.lengths);
      const auto r = Kernels::forward(be, qkv, c, keys);
      std::vector<T> dqkv(qkv.size(), T(0));
      Kernels::backward(be, dqkv, dout, qkv, r, c, keys);
      for (std::int64_t b = 0; b < c.B; ++b) {
        const std::int64_t n = pc.lengths[static_cast<std::size_t>(b)];
        CAPTURE(n);
        const Case alone{1, n, c.C, c.NH};
        const std::vector<T> q(qkv.begin() + b * c.T * 3 * c.C, qkv.begin() + (b * c.T + n) * 3 * c.C);
        const std::vector<T> g(dout.begin() + b * c.T * c.C, dout.begin() + (b * c.T + n) * c.C);
        const auto ra = Kernels::forward(be, q, alone, mask);
        std::vector<T> da(q.size(), T(0));
        Kernels::backward(be, da, g, q, ra, alone, mask);
        const std::vector<T> out_b(r.out.begin() + b * c.T * c.C, r.out.begin() + (b * c.T + n) * c.C);
        const std::vector<T> dqkv_b(dqkv.begin() + b * c.T * 3 * c.C, dqkv.begin() + (b * c.T + n) * 3 * c.C);
        std::vector<double> out_alone(ra.out.begin(), ra.out.end()), d_alone(da.begin(), da.end());
        CHECK(loom::test::max_relative_error(out_b, out_alone, 1.0) <= tolerance);
        CHECK(loom::test::max_relative_error(dqkv_b, d_alone, 1.0) <= tolerance);
        // The padded rows: out 0, and no gradient to their q, k or v.
        for (std::int64_t i = (b * c.T + n) * c.C; i < (b + 1) * c.T * c.C; ++i) REQUIRE(r.out[i] == T(0));
        for (std::int64_t i = (b * c.T + n) * 3 * c.C; i < (b + 1) * c.T * 3 * c.C; ++i) REQUIRE(dqkv[i] == T(0));
      }
      // Every sequence full: the same bits as no lengths.
      const std::vector<std::int32_t> full(static_cast<std::size_t>(c.B), static_cast<std::int32_t>(c.T));
      const auto rf = Kernels::forward(be, qkv, c, padded_keys(mask, full));
      const auto rn = Kernels::forward(be, qkv, c, mask);
      CHECK(rf.out == rn.out);
      CHECK(rf.saved == rn.saved);
      std::vector<T> df(qkv.size(), T(0)), dn(qkv.size(), T(0));
      Kernels::backward(be, df, dout, qkv, rf, c, padded_keys(mask, full));
      Kernels::backward(be, dn, dout, qkv, rn, c, mask);
      CHECK(df == dn);
    }
  }
}
TEST_CASE_TEMPLATE_APPLY(padded_alone, KernelPairs);

TEST_CASE("attention kernels reject lengths of the wrong shape or outside [1, T], before any work") {
  const cpu be(1);
  const Case c{2, 5, 6, 2};
  const auto qkv = loom::test::random_vector<float>(c.B * c.T * 3 * c.C, 66);
  const std::vector<std::int32_t> three{5, 5, 5}, zero{5, 0}, long_one{6, 5};
  const struct {
    const std::vector<std::int32_t>* lengths;
    const char* says;
  } bad[] = {{&three, "lengths shape"}, {&zero, "lengths[1]: got 0"}, {&long_one, "lengths[0]: got 6"}};
  for (const auto& x : bad) {
    CAPTURE(x.says);
    const auto keys = padded_keys(AttentionMask::bidirectional, *x.lengths);
    std::vector<float> out(c.B * c.T * c.C, 7.0f), att(c.B * c.NH * c.T * c.T, 7.0f), lse(c.B * c.NH * c.T, 7.0f);
    loom::test::expect_error(
        [&] {
          loom::kernels::attention_forward<float>(be, Tensor<float>(out.data(), {c.B, c.T, c.C}),
                                                  Tensor<float>(att.data(), {c.B, c.NH, c.T, c.T}),
                                                  Tensor<const float>(qkv.data(), {c.B, c.T, 3 * c.C}), c.NH, keys);
        },
        x.says);
    loom::test::expect_error(
        [&] {
          loom::kernels::attention_forward_lse<float>(be, Tensor<float>(out.data(), {c.B, c.T, c.C}),
                                                      Tensor<float>(lse.data(), {c.B, c.NH, c.T}),
                                                      Tensor<const float>(qkv.data(), {c.B, c.T, 3 * c.C}), c.NH, keys);
        },
        x.says);
    for (float v : out) REQUIRE(v == 7.0f);
    for (float v : att) REQUIRE(v == 7.0f);
  }
}

TEST_CASE("attention kernels reject a mask that is not an AttentionMask value, before any work") {
  const cpu be(1);
  const std::int64_t B = 2, T = 5, C = 6;
  std::vector<float> qkv(B * T * 3 * C, 0.5f), out(B * T * C, 0.0f), att(B * 2 * T * T, 0.0f), lse(B * 2 * T, 0.0f),
      dqkv(qkv.size(), 0.0f), dout(out.size(), 0.0f);
  const Tensor<const float> qkv_view(qkv.data(), {B, T, 3 * C});
  const auto bad = static_cast<AttentionMask>(7);
  using loom::test::expect_error;
  expect_error(
      [&] {
        loom::kernels::attention_forward<float>(be, Tensor<float>(out.data(), {B, T, C}),
                                                Tensor<float>(att.data(), {B, 2, T, T}), qkv_view, 2, bad);
      },
      "attention_forward: argument mask");
  expect_error(
      [&] {
        loom::kernels::attention_backward<float>(be, Tensor<float>(dqkv.data(), {B, T, 3 * C}),
                                                 Tensor<const float>(dout.data(), {B, T, C}), qkv_view,
                                                 Tensor<const float>(att.data(), {B, 2, T, T}), 2, bad);
      },
      "attention_backward: argument mask");
  expect_error(
      [&] {
        loom::kernels::attention_forward_lse<float>(be, Tensor<float>(out.data(), {B, T, C}),
                                                    Tensor<float>(lse.data(), {B, 2, T}), qkv_view, 2, bad);
      },
      "attention_forward_lse: argument mask");
  expect_error(
      [&] {
        loom::kernels::attention_backward_lse<float>(be, Tensor<float>(dqkv.data(), {B, T, 3 * C}),
                                                     Tensor<const float>(dout.data(), {B, T, C}), qkv_view,
                                                     Tensor<const float>(out.data(), {B, T, C}),
                                                     Tensor<const float>(lse.data(), {B, 2, T}), 2, bad);
      },
      "attention_backward_lse: argument mask");
  for (float x : out) CHECK(x == 0.0f);
  for (float x : dqkv) CHECK(x == 0.0f);
  CHECK(std::string(loom::name(AttentionMask::causal)) == "causal");
  CHECK(std::string(loom::name(AttentionMask::bidirectional)) == "bidirectional");
}

TEST_CASE_TEMPLATE_DEFINE("attention backward accumulates into dqkv", Kernels, accumulates) {
  using T = typename Kernels::type;
  const cpu be(1);
  // Adding into dqkv reassociates the sums (values O(1)): compare on an absolute scale of 1.
  const double accumulate_tolerance = sizeof(T) == sizeof(double) ? 1e-14 : 2e-6;
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : {Case{2, 5, 6, 3}, Case{1, 70, 8, 2}}) {
      INFO(loom::name(mask));
      CAPTURE(c.T);
      const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 31);
      const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 32);
      const auto r = Kernels::forward(be, qkv, c, mask);
      std::vector<T> fresh(qkv.size(), T(0));
      Kernels::backward(be, fresh, dout, qkv, r, c, mask);
      const auto prior = loom::test::random_vector<T>(qkv.size(), 33);
      auto accumulated = prior;
      Kernels::backward(be, accumulated, dout, qkv, r, c, mask);
      std::vector<double> expected(qkv.size());
      for (std::size_t i = 0; i < qkv.size(); ++i)
        expected[i] = static_cast<double>(prior[i]) + static_cast<double>(fresh[i]);
      CHECK(loom::test::max_relative_error(accumulated, expected, 1.0) <= accumulate_tolerance);
      // Twice more doubles the gradient part.
      Kernels::backward(be, accumulated, dout, qkv, r, c, mask);
      for (std::size_t i = 0; i < qkv.size(); ++i)
        expected[i] += static_cast<double>(fresh[i]);
      CHECK(loom::test::max_relative_error(accumulated, expected, 1.0) <= accumulate_tolerance);
    }
  }
}

TEST_CASE_TEMPLATE_DEFINE("attention kernels give the same bits on 1 and 2 threads", Kernels, thread_count) {
  using T = typename Kernels::type;
  const cpu one(1), two(2);
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : {Case{2, 5, 6, 3}, Case{3, 133, 24, 3}}) {
      INFO(loom::name(mask));
      CAPTURE(c.T);
      const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 41);
      const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 42);
      const auto r1 = Kernels::forward(one, qkv, c, mask);
      const auto r2 = Kernels::forward(two, qkv, c, mask);
      CHECK(r1.out == r2.out);
      CHECK(r1.saved == r2.saved);
      std::vector<T> d1(qkv.size(), T(0)), d2(qkv.size(), T(0));
      Kernels::backward(one, d1, dout, qkv, r1, c, mask);
      Kernels::backward(two, d2, dout, qkv, r2, c, mask);
      CHECK(d1 == d2);
    }
  }
}
TEST_CASE_TEMPLATE_DEFINE("attention backward with GradientWrite::overwrite writes dqkv over anything, padding 0: "
                          "accumulating into zeros' bits",
                          Kernels, overwrites) {
  using T = typename Kernels::type;
  const T nan(std::numeric_limits<float>::quiet_NaN());
  std::vector<PaddedCase> overwrite_cases = padded_cases();
  overwrite_cases.push_back({{2, 70, 12, 3}, {}});  // unpadded, more than one 64-row block
  for (const int threads : {1, 2}) {
    const cpu be(threads);
    for (const AttentionMask mask : both_masks) {
      for (const PaddedCase& pc : overwrite_cases) {
        const Case& c = pc.c;
        INFO("threads " << threads << ", " << loom::name(mask) << ", T " << c.T << ", "
                        << (pc.lengths.empty() ? "unpadded" : "padded"));
        const loom::AttentionKeys keys = pc.lengths.empty() ? loom::AttentionKeys(mask) : padded_keys(mask, pc.lengths);
        const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 51);
        const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 52);
        const auto r = Kernels::forward(be, qkv, c, keys);
        std::vector<T> accumulated(qkv.size(), T(0.0f)), written(qkv.size(), nan);
        Kernels::backward(be, accumulated, dout, qkv, r, c, keys);
        Kernels::backward(be, written, dout, qkv, r, c, keys, loom::GradientWrite::overwrite);
        std::size_t differ = 0;  // a zero's sign aside; a NaN left over differs
        for (std::size_t i = 0; i < qkv.size(); ++i)
          differ += !(loom::to_accumulate(written[i]) == loom::to_accumulate(accumulated[i]));
        CHECK(differ == 0);
      }
    }
  }
}

TEST_CASE_TEMPLATE_APPLY(accumulates, KernelPairs);
TEST_CASE_TEMPLATE_APPLY(thread_count, KernelPairs);
//! bf16 too: its heads run on widened copies (the slice of dqkv zeroed there, not read).
TEST_CASE_TEMPLATE_APPLY(overwrites, decltype(std::tuple_cat(KernelPairs{}, std::tuple<SavesProbs<loom::bf16>>{})));

TEST_CASE("attention kernels reject bad shapes and head counts") {
  const cpu be(1);
  const std::int64_t B = 2, T = 5, C = 6;
  std::vector<float> qkv(B * T * 3 * C, 0.5f), out(B * T * C), att(B * 2 * T * T),
      dqkv(qkv.size()), dout(out.size());
  const Tensor<const float> qkv_view(qkv.data(), {B, T, 3 * C});
  using loom::test::expect_error;
  using loom::kernels::attention_backward;
  using loom::kernels::attention_forward;
  // num_heads that does not divide C.
  expect_error(
      [&] {
        attention_forward<float>(be, Tensor<float>(out.data(), {B, T, C}),
                                 Tensor<float>(att.data(), {B, 4, T, T}), qkv_view, 4);
      },
      "num_heads");
  expect_error(
      [&] {
        attention_forward<float>(be, Tensor<float>(out.data(), {B, T, C}),
                                 Tensor<float>(att.data(), {B, 2, T, T}), qkv_view, 0);
      },
      "num_heads");
  // qkv whose last extent is not 3C.
  expect_error(
      [&] {
        attention_forward<float>(be, Tensor<float>(out.data(), {B, T, C}),
                                 Tensor<float>(att.data(), {B, 2, T, T}),
                                 Tensor<const float>(qkv.data(), {B, T * 3 * C / 4, 4}), 2);
      },
      "attention_forward: argument qkv");
  expect_error(
      [&] {
        attention_forward<float>(be, Tensor<float>(out.data(), {B, T, C}),
                                 Tensor<float>(att.data(), {B, 2, T, T}),
                                 Tensor<const float>(qkv.data(), {B * T, 3 * C}), 2);
      },
      "attention_forward: argument qkv");
  // out and att that do not match qkv.
  expect_error(
      [&] {
        attention_forward<float>(be, Tensor<float>(out.data(), {B * T, C}),
                                 Tensor<float>(att.data(), {B, 2, T, T}), qkv_view, 2);
      },
      "attention_forward: argument out");
  expect_error(
      [&] {
        attention_forward<float>(be, Tensor<float>(out.data(), {B, T, C}),
                                 Tensor<float>(att.data(), {B, 3, T, T}), qkv_view, 2);
      },
      "attention_forward: argument att");
  // Backward: each argument in turn.
  const Tensor<const float> att_view(att.data(), {B, 2, T, T});
  const Tensor<const float> dout_view(dout.data(), {B, T, C});
  expect_error(
      [&] {
        attention_backward<float>(be, Tensor<float>(dqkv.data(), {B, T, 3 * C}), dout_view,
                                  qkv_view, att_view, 4);
      },
      "num_heads");
  expect_error(
      [&] {
        attention_backward<float>(be, Tensor<float>(dqkv.data(), {B, 3 * C, T}), dout_view,
                                  qkv_view, att_view, 2);
      },
      "attention_backward: argument dqkv");
  expect_error(
      [&] {
        attention_backward<float>(be, Tensor<float>(dqkv.data(), {B, T, 3 * C}),
                                  Tensor<const float>(dout.data(), {B, C, T}), qkv_view,
                                  att_view, 2);
      },
      "attention_backward: argument dout");
  expect_error(
      [&] {
        attention_backward<float>(be, Tensor<float>(dqkv.data(), {B, T, 3 * C}), dout_view,
                                  qkv_view, Tensor<const float>(att.data(), {B, 2, T * T}), 2);
      },
      "attention_backward: argument att");
}

TEST_CASE("attention lse kernels reject bad shapes") {
  const cpu be(1);
  const std::int64_t B = 2, T = 5, C = 6;
  std::vector<float> qkv(B * T * 3 * C, 0.5f), out(B * T * C), lse(B * 2 * T), dqkv(qkv.size()),
      dout(out.size());
  const Tensor<const float> qkv_view(qkv.data(), {B, T, 3 * C});
  const Tensor<const float> lse_view(lse.data(), {B, 2, T});
  const Tensor<const float> dout_view(dout.data(), {B, T, C});
  const Tensor<const float> out_view(out.data(), {B, T, C});
  const Tensor<float> dqkv_view(dqkv.data(), {B, T, 3 * C});
  using loom::test::expect_error;
  using loom::kernels::attention_backward_lse;
  using loom::kernels::attention_forward_lse;
  expect_error(
      [&] {
        attention_forward_lse<float>(be, Tensor<float>(out.data(), {B, T, C}), Tensor<float>(lse.data(), {B, 2, T}),
                                     qkv_view, 4);
      },
      "num_heads");
  expect_error(
      [&] {
        attention_forward_lse<float>(be, Tensor<float>(out.data(), {B, T, C}), Tensor<float>(lse.data(), {B, T, 2}),
                                     qkv_view, 2);
      },
      "attention_forward_lse: argument lse");
  expect_error(
      [&] {
        attention_forward_lse<float>(be, Tensor<float>(out.data(), {B, T, C}), Tensor<float>(lse.data(), {B, 3, T}),
                                     qkv_view, 2);
      },
      "attention_forward_lse: argument lse");
  expect_error(
      [&] {
        attention_forward_lse<float>(be, Tensor<float>(out.data(), {B, C, T}), Tensor<float>(lse.data(), {B, 2, T}),
                                     qkv_view, 2);
      },
      "attention_forward_lse: argument out");
  expect_error(
      [&] {
        attention_backward_lse<float>(be, dqkv_view, Tensor<const float>(dout.data(), {B, C, T}), qkv_view,
                                      out_view, lse_view, 2);
      },
      "attention_backward_lse: argument dout");
  expect_error(
      [&] {
        attention_backward_lse<float>(be, dqkv_view, dout_view, qkv_view, Tensor<const float>(out.data(), {B, C, T}),
                                      lse_view, 2);
      },
      "attention_backward_lse: argument out");
  expect_error(
      [&] {
        attention_backward_lse<float>(be, dqkv_view, dout_view, qkv_view, out_view,
                                      Tensor<const float>(lse.data(), {B, 2 * T}), 2);
      },
      "attention_backward_lse: argument lse");
  expect_error(
      [&] {
        attention_backward_lse<float>(be, Tensor<float>(dqkv.data(), {B, 3 * C, T}), dout_view, qkv_view, out_view,
                                      lse_view, 2);
      },
      "attention_backward_lse: argument dqkv");
  // Nothing is written before the checks pass.
  for (float x : dqkv) CHECK(x == 0.0f);
}

}  // namespace test_kernel_attention
