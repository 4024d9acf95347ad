// matmul_gelu_forward and gelu_matmul_backward on the CPU, with either GELU (Gelu::tanh and
// Gelu::erf): against plain loops in double, the backward against central differences of a loss
// through GELU and the matmul, the same bits as the separate matmul and GELU kernels (what the
// model ran before), dpre written rather than accumulated, empty dweight/dbias skipped, and shape
// errors naming the argument.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/backend/cpu/kernels.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_matmul_gelu {

namespace {

using loom::cpu;
using loom::Gelu;
using loom::Shape;
using loom::Tensor;
using loom::test::tolerance;

const double sqrt_2_over_pi = std::sqrt(2.0 / std::acos(-1.0));

constexpr Gelu kinds[] = {Gelu::tanh, Gelu::erf};

//! GELU(x) of the form `kind`: x Φ(x) with std::erf, or GPT-2's tanh approximation of it.
double reference_gelu(Gelu kind, double x) {
  if (kind == Gelu::erf) return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
  return 0.5 * x * (1.0 + std::tanh(sqrt_2_over_pi * (x + 0.044715 * x * x * x)));
}

struct Case {
  std::int64_t N, C, OC;
};
// One row; odd extents; a case large enough for the blocked, two-thread GEMM and several GELU
// chunks.
const Case cases[] = {{1, 1, 1}, {3, 5, 7}, {33, 17, 65}, {130, 64, 260}};

template <class T>
Tensor<T> t(std::vector<T>& v, Shape s) {
  return {v.data(), s};
}
template <class T>
Tensor<const T> c(const std::vector<T>& v, Shape s) {
  return {v.data(), s};
}

//! pre = in weight^T + bias (in double).
std::vector<double> reference_pre(const Case& k, std::span<const double> in, std::span<const double> weight,
                                  std::span<const double> bias) {
  std::vector<double> pre(static_cast<std::size_t>(k.N * k.OC));
  for (std::int64_t n = 0; n < k.N; ++n)
    for (std::int64_t o = 0; o < k.OC; ++o) {
      double sum = bias.empty() ? 0.0 : bias[o];
      for (std::int64_t i = 0; i < k.C; ++i) sum += in[n * k.C + i] * weight[o * k.C + i];
      pre[n * k.OC + o] = sum;
    }
  return pre;
}

template <class T>
std::vector<double> widen(const std::vector<T>& v) {
  return {v.begin(), v.end()};
}

}  // namespace

TEST_CASE_TEMPLATE("matmul_gelu_forward is the matmul then GELU, bit for bit, and matches double loops", T, float,
                   double) {
  const cpu one(1), two(2);
  for (const Gelu kind : kinds) {
    for (const Case& k : cases) {
      for (const bool with_bias : {true, false}) {
        CAPTURE(std::string(loom::gelu_name(kind)));
        CAPTURE(k.N);
        CAPTURE(k.OC);
        CAPTURE(with_bias);
        const auto in = loom::test::random_vector<T>(k.N * k.C, 1);
        const auto weight = loom::test::random_vector<T>(k.OC * k.C, 2);
        const auto bias = with_bias ? loom::test::random_vector<T>(k.OC, 3) : std::vector<T>{};
        const Tensor<const T> bias_view = with_bias ? c(bias, {k.OC}) : Tensor<const T>{};
        for (const cpu* be : {&one, &two}) {
          std::vector<T> out(k.N * k.OC, T(7)), pre(k.N * k.OC, T(7));
          loom::kernels::matmul_gelu_forward<T>(*be, t(out, {k.N, k.OC}), t(pre, {k.N, k.OC}), c(in, {k.N, k.C}),
                                                c(weight, {k.OC, k.C}), bias_view, kind);
          std::vector<T> separate_pre(k.N * k.OC), separate_out(k.N * k.OC);
          loom::kernels::matmul_forward<T>(*be, t(separate_pre, {k.N, k.OC}), c(in, {k.N, k.C}),
                                           c(weight, {k.OC, k.C}), bias_view);
          loom::kernels::gelu_forward<T>(*be, t(separate_out, {k.N, k.OC}), c(separate_pre, {k.N, k.OC}), kind);
          CHECK(pre == separate_pre);
          CHECK(out == separate_out);

          const std::vector<double> ref_pre = reference_pre(k, widen(in), widen(weight), widen(bias));
          std::vector<double> ref_out(ref_pre.size());
          for (std::size_t i = 0; i < ref_pre.size(); ++i) ref_out[i] = reference_gelu(kind, ref_pre[i]);
          CHECK(loom::test::max_relative_error(pre, ref_pre, 1.0) <= tolerance<T>());
          CHECK(loom::test::max_relative_error(out, ref_out, 1.0) <= tolerance<T>());
        }
      }
    }
  }
}

TEST_CASE("gelu_matmul_backward matches central differences in double") {
  const cpu be(2);
  for (const Gelu kind : kinds) {
    for (const Case& k : {Case{1, 1, 1}, Case{3, 5, 7}, Case{6, 9, 4}}) {
      CAPTURE(std::string(loom::gelu_name(kind)));
      CAPTURE(k.N);
      CAPTURE(k.C);
      CAPTURE(k.OC);
      // in = GELU(pre); loss = sum(dout * (in weight^T + bias)).
      auto pre = loom::test::random_vector<double>(k.N * k.C, 10, -3.0, 3.0);
      auto weight = loom::test::random_vector<double>(k.OC * k.C, 11);
      auto bias = loom::test::random_vector<double>(k.OC, 12);
      const auto dout = loom::test::random_vector<double>(k.N * k.OC, 13);
      const auto loss = [&] {
        double sum = 0;
        for (std::int64_t n = 0; n < k.N; ++n)
          for (std::int64_t o = 0; o < k.OC; ++o) {
            double y = bias[o];
            for (std::int64_t i = 0; i < k.C; ++i) y += reference_gelu(kind, pre[n * k.C + i]) * weight[o * k.C + i];
            sum += dout[n * k.OC + o] * y;
          }
        return sum;
      };
      std::vector<double> in(pre.size());
      for (std::size_t i = 0; i < pre.size(); ++i) in[i] = reference_gelu(kind, pre[i]);

      // dpre starts as garbage (it is written); dweight and dbias start non-zero (they accumulate).
      std::vector<double> dpre(pre.size(), 123.0);
      const auto dweight0 = loom::test::random_vector<double>(weight.size(), 14);
      const auto dbias0 = loom::test::random_vector<double>(bias.size(), 15);
      std::vector<double> dweight = dweight0, dbias = dbias0;
      loom::kernels::gelu_matmul_backward<double>(be, t(dpre, {k.N, k.C}), t(dweight, {k.OC, k.C}),
                                                  t(dbias, {k.OC}), c(dout, {k.N, k.OC}), c(in, {k.N, k.C}),
                                                  c(weight, {k.OC, k.C}), c(pre, {k.N, k.C}), kind);
      const auto fd_pre = loom::test::finite_difference(loss, pre);
      auto fd_weight = loom::test::finite_difference(loss, weight);
      auto fd_bias = loom::test::finite_difference(loss, bias);
      for (std::size_t i = 0; i < fd_weight.size(); ++i) fd_weight[i] += dweight0[i];
      for (std::size_t i = 0; i < fd_bias.size(); ++i) fd_bias[i] += dbias0[i];
      CHECK(loom::test::max_relative_error(dpre, fd_pre, 1e-3) <= 1e-6);
      CHECK(loom::test::max_relative_error(dweight, fd_weight, 1e-3) <= 1e-6);
      CHECK(loom::test::max_relative_error(dbias, fd_bias, 1e-3) <= 1e-6);
    }
  }
}

TEST_CASE_TEMPLATE("gelu_matmul_backward gives the separate kernels' bits; empty gradients are skipped", T, float,
                   double, loom::bf16) {
  const cpu one(1), two(2);
  for (const Gelu kind : kinds) {
    for (const Case& k : cases) {
      CAPTURE(std::string(loom::gelu_name(kind)));
      CAPTURE(k.N);
      CAPTURE(k.OC);
      const auto pre = loom::test::random_vector<T>(k.N * k.C, 20, -3.0, 3.0);
      std::vector<T> in(pre.size());
      loom::kernels::gelu_forward<T>(one, t(in, {k.N, k.C}), c(pre, {k.N, k.C}), kind);
      const auto weight = loom::test::random_vector<T>(k.OC * k.C, 21);
      const auto dout = loom::test::random_vector<T>(k.N * k.OC, 22);
      const auto dweight0 = loom::test::random_vector<T>(k.OC * k.C, 23);
      const auto dbias0 = loom::test::random_vector<T>(k.OC, 24);
      for (const cpu* be : {&one, &two}) {
        // What the model ran before: din into a zeroed buffer, then gelu_backward into a zeroed dpre.
        std::vector<T> din(pre.size(), T(0)), expected_dpre(pre.size(), T(0));
        std::vector<T> expected_dweight = dweight0, expected_dbias = dbias0;
        loom::kernels::matmul_backward<T>(*be, t(din, {k.N, k.C}), t(expected_dweight, {k.OC, k.C}),
                                          t(expected_dbias, {k.OC}), c(dout, {k.N, k.OC}), c(in, {k.N, k.C}),
                                          c(weight, {k.OC, k.C}));
        loom::kernels::gelu_backward<T>(*be, t(expected_dpre, {k.N, k.C}), c(pre, {k.N, k.C}), c(din, {k.N, k.C}),
                                        kind);

        std::vector<T> dpre(pre.size(), T(5)), dweight = dweight0, dbias = dbias0;
        loom::kernels::gelu_matmul_backward<T>(*be, t(dpre, {k.N, k.C}), t(dweight, {k.OC, k.C}), t(dbias, {k.OC}),
                                               c(dout, {k.N, k.OC}), c(in, {k.N, k.C}), c(weight, {k.OC, k.C}),
                                               c(pre, {k.N, k.C}), kind);
        CHECK(dpre == expected_dpre);
        CHECK(dweight == expected_dweight);
        CHECK(dbias == expected_dbias);

        // The input pass of a split backward: dpre only, the same bits; dweight, dbias untouched.
        std::vector<T> split_dpre(pre.size(), T(9));
        loom::kernels::gelu_matmul_backward<T>(*be, t(split_dpre, {k.N, k.C}), Tensor<T>{}, Tensor<T>{},
                                               c(dout, {k.N, k.OC}), c(in, {k.N, k.C}), c(weight, {k.OC, k.C}),
                                               c(pre, {k.N, k.C}), kind);
        CHECK(split_dpre == expected_dpre);
      }
    }
  }
}

TEST_CASE("matmul_gelu kernels reject wrong shapes, naming the argument") {
  const cpu be(1);
  std::vector<float> in(12), weight(15), bias(5), out(20), pre(20), wrong(21), dpre(12), dout(20);
  using loom::test::expect_error;
  expect_error(
      [&] {
        loom::kernels::matmul_gelu_forward<float>(be, t(out, {4, 5}), t(wrong, {3, 7}), c(in, {4, 3}),
                                                  c(weight, {5, 3}), c(bias, {5}));
      },
      "matmul_gelu_forward: argument pre shape");
  expect_error(
      [&] {
        loom::kernels::matmul_gelu_forward<float>(be, t(wrong, {7, 3}), t(pre, {4, 5}), c(in, {4, 3}),
                                                  c(weight, {5, 3}), c(bias, {5}));
      },
      "matmul_gelu_forward: argument out shape");
  expect_error(
      [&] {
        loom::kernels::gelu_matmul_backward<float>(be, t(dpre, {4, 3}), Tensor<float>{}, Tensor<float>{},
                                                   c(dout, {4, 5}), c(in, {4, 3}), c(weight, {5, 3}),
                                                   c(wrong, {7, 3}));
      },
      "gelu_matmul_backward: argument pre shape");
  expect_error(
      [&] {
        loom::kernels::gelu_matmul_backward<float>(be, t(wrong, {3, 7}), Tensor<float>{}, Tensor<float>{},
                                                   c(dout, {4, 5}), c(in, {4, 3}), c(weight, {5, 3}),
                                                   c(pre, {4, 3}));
      },
      "gelu_matmul_backward: argument dpre shape");
}

}  // namespace test_kernel_matmul_gelu
