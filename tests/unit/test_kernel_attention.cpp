// Causal multi-head attention kernels, both pairs (attention_forward/backward, which save the
// probabilities, and the _lse pair, which saves the row log-sum-exp and recomputes): forward
// against a plain reference, backward against central differences and against each other, the
// accumulate convention, shape checks and thread-count determinism.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "loom/backend/cpu/attention.hpp"
#include "support/gradcheck.hpp"

namespace {

using loom::Shape;
using loom::Tensor;
using loom::cpu;

struct Case {
  std::int64_t B, T, C;
  int NH;
};

//! Plain triple-loop attention in double: returns out [B,T,C] and fills att [B,NH,T,T] and, where
//! given, lse [B,NH,T] = log Σ_{s<=t} exp of the scaled scores.
template <class T>
std::vector<double> reference_forward(const std::vector<T>& qkv, const Case& c,
                                      std::vector<double>& att, std::vector<double>* lse = nullptr) {
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
        double max = -1e300;
        for (std::int64_t s = 0; s <= t; ++s) {
          double dot = 0;
          for (std::int64_t i = 0; i < hs; ++i) dot += at(b, t, 0, h, i) * at(b, s, 1, h, i);
          row[s] = dot * scale;
          max = std::max(max, row[s]);
        }
        double sum = 0;
        for (std::int64_t s = 0; s <= t; ++s) sum += row[s] = std::exp(row[s] - max);
        if (lse != nullptr) (*lse)[(b * c.NH + h) * c.T + t] = max + std::log(sum);
        for (std::int64_t s = 0; s <= t; ++s) row[s] /= sum;
        for (std::int64_t i = 0; i < hs; ++i) {
          double acc = 0;
          for (std::int64_t s = 0; s <= t; ++s) acc += row[s] * at(b, s, 2, h, i);
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
  static Run<T> forward(const cpu& be, const std::vector<T>& qkv, const Case& c) {
    Run<T> r{std::vector<T>(c.B * c.T * c.C), std::vector<T>(c.B * c.NH * c.T * c.T, T(7))};
    loom::kernels::attention_forward<T>(be, Tensor<T>(r.out.data(), {c.B, c.T, c.C}),
                                        Tensor<T>(r.saved.data(), {c.B, c.NH, c.T, c.T}),
                                        Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}), c.NH);
    return r;
  }
  static void backward(const cpu& be, std::vector<T>& dqkv, const std::vector<T>& dout, const std::vector<T>& qkv,
                       const Run<T>& r, const Case& c) {
    loom::kernels::attention_backward<T>(be, Tensor<T>(dqkv.data(), {c.B, c.T, 3 * c.C}),
                                         Tensor<const T>(dout.data(), {c.B, c.T, c.C}),
                                         Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}),
                                         Tensor<const T>(r.saved.data(), {c.B, c.NH, c.T, c.T}), c.NH);
  }
};

//! attention_forward_lse/attention_backward_lse, which save only the row log-sum-exp lse
//! [B,NH,T] (float and double are their own accumulate type).
template <class T>
struct SavesLse {
  using type = T;
  static Run<T> forward(const cpu& be, const std::vector<T>& qkv, const Case& c) {
    Run<T> r{std::vector<T>(c.B * c.T * c.C), std::vector<T>(c.B * c.NH * c.T, T(7))};
    loom::kernels::attention_forward_lse<T>(be, Tensor<T>(r.out.data(), {c.B, c.T, c.C}),
                                            Tensor<T>(r.saved.data(), {c.B, c.NH, c.T}),
                                            Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}), c.NH);
    return r;
  }
  static void backward(const cpu& be, std::vector<T>& dqkv, const std::vector<T>& dout, const std::vector<T>& qkv,
                       const Run<T>& r, const Case& c) {
    loom::kernels::attention_backward_lse<T>(be, Tensor<T>(dqkv.data(), {c.B, c.T, 3 * c.C}),
                                             Tensor<const T>(dout.data(), {c.B, c.T, c.C}),
                                             Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}),
                                             Tensor<const T>(r.out.data(), {c.B, c.T, c.C}),
                                             Tensor<const T>(r.saved.data(), {c.B, c.NH, c.T}), c.NH);
  }
};

//! Both kernel pairs in both types, for the tests that hold for each (the saved state is opaque to
//! them).
using KernelPairs = std::tuple<SavesProbs<float>, SavesProbs<double>, SavesLse<float>, SavesLse<double>>;

// T = 70 and 133 span more than one 64-row block of the kernel.
const Case cases[] = {{2, 5, 6, 2}, {2, 5, 6, 3}, {1, 1, 6, 3}, {3, 1, 4, 1},
                      {2, 70, 12, 3}, {1, 133, 8, 2}};

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
  for (const Case& c : cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.NH);
    auto qkv = loom::test::random_vector<double>(c.B * c.T * 3 * c.C, 21, -1.5, 1.5);
    const auto w = loom::test::random_vector<double>(c.B * c.T * c.C, 22);
    auto loss = [&] {
      const auto r = Kernels::forward(be, qkv, c);
      double total = 0;
      for (std::size_t i = 0; i < w.size(); ++i) total += r.out[i] * w[i];
      return total;
    };
    const auto numeric = loom::test::finite_difference(loss, std::span<double>(qkv), 1e-4);
    const auto r = Kernels::forward(be, qkv, c);
    std::vector<double> dqkv(qkv.size(), 0.0);
    Kernels::backward(be, dqkv, w, qkv, r, c);
    CHECK(loom::test::max_relative_error(dqkv, numeric, 1e-3) <= 1e-6);
  }
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

TEST_CASE_TEMPLATE_DEFINE("attention backward accumulates into dqkv", Kernels, accumulates) {
  using T = typename Kernels::type;
  const cpu be(1);
  // Adding into dqkv reassociates the sums (values O(1)): compare on an absolute scale of 1.
  const double accumulate_tolerance = sizeof(T) == sizeof(double) ? 1e-14 : 2e-6;
  for (const Case& c : {Case{2, 5, 6, 3}, Case{1, 70, 8, 2}}) {
    CAPTURE(c.T);
    const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 31);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 32);
    const auto r = Kernels::forward(be, qkv, c);
    std::vector<T> fresh(qkv.size(), T(0));
    Kernels::backward(be, fresh, dout, qkv, r, c);
    const auto prior = loom::test::random_vector<T>(qkv.size(), 33);
    auto accumulated = prior;
    Kernels::backward(be, accumulated, dout, qkv, r, c);
    std::vector<double> expected(qkv.size());
    for (std::size_t i = 0; i < qkv.size(); ++i)
      expected[i] = static_cast<double>(prior[i]) + static_cast<double>(fresh[i]);
    CHECK(loom::test::max_relative_error(accumulated, expected, 1.0) <= accumulate_tolerance);
    // Twice more doubles the gradient part.
    Kernels::backward(be, accumulated, dout, qkv, r, c);
    for (std::size_t i = 0; i < qkv.size(); ++i)
      expected[i] += static_cast<double>(fresh[i]);
    CHECK(loom::test::max_relative_error(accumulated, expected, 1.0) <= accumulate_tolerance);
  }
}

TEST_CASE_TEMPLATE_DEFINE("attention kernels give the same bits on 1 and 2 threads", Kernels, thread_count) {
  using T = typename Kernels::type;
  const cpu one(1), two(2);
  for (const Case& c : {Case{2, 5, 6, 3}, Case{3, 133, 24, 3}}) {
    CAPTURE(c.T);
    const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 41);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 42);
    const auto r1 = Kernels::forward(one, qkv, c);
    const auto r2 = Kernels::forward(two, qkv, c);
    CHECK(r1.out == r2.out);
    CHECK(r1.saved == r2.saved);
    std::vector<T> d1(qkv.size(), T(0)), d2(qkv.size(), T(0));
    Kernels::backward(one, d1, dout, qkv, r1, c);
    Kernels::backward(two, d2, dout, qkv, r2, c);
    CHECK(d1 == d2);
  }
}
TEST_CASE_TEMPLATE_APPLY(accumulates, KernelPairs);
TEST_CASE_TEMPLATE_APPLY(thread_count, KernelPairs);

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
