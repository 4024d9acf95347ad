// Causal multi-head attention kernels: forward against a plain reference, backward against
// central differences, the accumulate convention, shape checks and thread-count determinism.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
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

//! Plain triple-loop attention in double: returns out [B,T,C] and fills att [B,NH,T,T].
template <class T>
std::vector<double> reference_forward(const std::vector<T>& qkv, const Case& c,
                                      std::vector<double>& att) {
  const std::int64_t hs = c.C / c.NH;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  std::vector<double> out(c.B * c.T * c.C, 0.0);
  att.assign(c.B * c.NH * c.T * c.T, 0.0);
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
//! a small mix) and 0.01 for the probabilities.
template <class T>
double forward_tolerance() {
  return sizeof(T) == sizeof(double) ? 1e-12 : 1e-5;
}

template <class T>
struct Run {
  std::vector<T> out, att;
};

template <class T>
Run<T> run_forward(const cpu& be, const std::vector<T>& qkv, const Case& c) {
  Run<T> r{std::vector<T>(c.B * c.T * c.C), std::vector<T>(c.B * c.NH * c.T * c.T, T(7))};
  loom::kernels::attention_forward<T>(be, Tensor<T>(r.out.data(), {c.B, c.T, c.C}),
                                      Tensor<T>(r.att.data(), {c.B, c.NH, c.T, c.T}),
                                      Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}), c.NH);
  return r;
}

template <class T>
void run_backward(const cpu& be, std::vector<T>& dqkv, const std::vector<T>& dout,
                  const std::vector<T>& qkv, const std::vector<T>& att, const Case& c) {
  loom::kernels::attention_backward<T>(be, Tensor<T>(dqkv.data(), {c.B, c.T, 3 * c.C}),
                                       Tensor<const T>(dout.data(), {c.B, c.T, c.C}),
                                       Tensor<const T>(qkv.data(), {c.B, c.T, 3 * c.C}),
                                       Tensor<const T>(att.data(), {c.B, c.NH, c.T, c.T}), c.NH);
}

// T = 70 and 133 span more than one 64-row block of the kernel.
const Case cases[] = {{2, 5, 6, 2}, {2, 5, 6, 3}, {1, 1, 6, 3}, {3, 1, 4, 1},
                      {2, 70, 12, 3}, {1, 133, 8, 2}};

}  // namespace

TEST_CASE_TEMPLATE("attention_forward matches the plain reference", T, float, double) {
  const cpu be(1);
  for (const Case& c : cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.NH);
    const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 11, -2.0, 2.0);
    std::vector<double> att_ref;
    const auto out_ref = reference_forward(qkv, c, att_ref);
    const auto r = run_forward(be, qkv, c);
    CHECK(loom::test::max_relative_error(r.out, out_ref, 1e-1) <= forward_tolerance<T>());
    CHECK(loom::test::max_relative_error(r.att, att_ref, 1e-2) <= forward_tolerance<T>());
    // Masked entries are exactly zero, not merely small.
    for (std::int64_t bh = 0; bh < c.B * c.NH; ++bh)
      for (std::int64_t t = 0; t < c.T; ++t)
        for (std::int64_t s = t + 1; s < c.T; ++s) REQUIRE(r.att[(bh * c.T + t) * c.T + s] == T(0));
  }
}

TEST_CASE("attention_backward matches central differences (double)") {
  const cpu be(1);
  for (const Case& c : cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.NH);
    auto qkv = loom::test::random_vector<double>(c.B * c.T * 3 * c.C, 21, -1.5, 1.5);
    const auto w = loom::test::random_vector<double>(c.B * c.T * c.C, 22);
    auto loss = [&] {
      const auto r = run_forward(be, qkv, c);
      double total = 0;
      for (std::size_t i = 0; i < w.size(); ++i) total += r.out[i] * w[i];
      return total;
    };
    const auto numeric = loom::test::finite_difference(loss, std::span<double>(qkv), 1e-4);
    const auto r = run_forward(be, qkv, c);
    std::vector<double> dqkv(qkv.size(), 0.0);
    run_backward(be, dqkv, w, qkv, r.att, c);
    CHECK(loom::test::max_relative_error(dqkv, numeric, 1e-3) <= 1e-6);
  }
}

TEST_CASE("attention_backward with T = 1 gives zero dq, dk and dv = dout") {
  const cpu be(1);
  const Case c{2, 1, 6, 3};
  const auto qkv = loom::test::random_vector<double>(c.B * 3 * c.C, 5);
  const auto dout = loom::test::random_vector<double>(c.B * c.C, 6);
  const auto r = run_forward(be, qkv, c);
  for (double a : r.att) CHECK(a == 1.0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t i = 0; i < c.C; ++i) CHECK(r.out[b * c.C + i] == qkv[b * 3 * c.C + 2 * c.C + i]);
  std::vector<double> dqkv(qkv.size(), 0.0);
  run_backward(be, dqkv, dout, qkv, r.att, c);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t i = 0; i < c.C; ++i) {
      CHECK(dqkv[b * 3 * c.C + i] == 0.0);
      CHECK(dqkv[b * 3 * c.C + c.C + i] == 0.0);
      CHECK(dqkv[b * 3 * c.C + 2 * c.C + i] == doctest::Approx(dout[b * c.C + i]).epsilon(1e-15));
    }
}

TEST_CASE_TEMPLATE("attention_backward accumulates into dqkv", T, float, double) {
  const cpu be(1);
  // Adding into dqkv reassociates the sums (values O(1)): compare on an absolute scale of 1.
  const double accumulate_tolerance = sizeof(T) == sizeof(double) ? 1e-14 : 2e-6;
  for (const Case& c : {Case{2, 5, 6, 3}, Case{1, 70, 8, 2}}) {
    CAPTURE(c.T);
    const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 31);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 32);
    const auto r = run_forward(be, qkv, c);
    std::vector<T> fresh(qkv.size(), T(0));
    run_backward(be, fresh, dout, qkv, r.att, c);
    const auto prior = loom::test::random_vector<T>(qkv.size(), 33);
    auto accumulated = prior;
    run_backward(be, accumulated, dout, qkv, r.att, c);
    std::vector<double> expected(qkv.size());
    for (std::size_t i = 0; i < qkv.size(); ++i)
      expected[i] = static_cast<double>(prior[i]) + static_cast<double>(fresh[i]);
    CHECK(loom::test::max_relative_error(accumulated, expected, 1.0) <= accumulate_tolerance);
    // Twice more doubles the gradient part.
    run_backward(be, accumulated, dout, qkv, r.att, c);
    for (std::size_t i = 0; i < qkv.size(); ++i)
      expected[i] += static_cast<double>(fresh[i]);
    CHECK(loom::test::max_relative_error(accumulated, expected, 1.0) <= accumulate_tolerance);
  }
}

TEST_CASE_TEMPLATE("attention kernels give the same bits on 1 and 2 threads", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : {Case{2, 5, 6, 3}, Case{3, 133, 24, 3}}) {
    CAPTURE(c.T);
    const auto qkv = loom::test::random_vector<T>(c.B * c.T * 3 * c.C, 41);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 42);
    const auto r1 = run_forward(one, qkv, c);
    const auto r2 = run_forward(two, qkv, c);
    CHECK(r1.out == r2.out);
    CHECK(r1.att == r2.att);
    std::vector<T> d1(qkv.size(), T(0)), d2(qkv.size(), T(0));
    run_backward(one, d1, dout, qkv, r1.att, c);
    run_backward(two, d2, dout, qkv, r2.att, c);
    CHECK(d1 == d2);
  }
}

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
