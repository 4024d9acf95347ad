// GELU kernels: forward and backward against the plain formula, backward against central
// differences, the accumulate convention, shape checks and thread-count determinism.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/backend/cpu/gelu.hpp"
#include "support/gradcheck.hpp"

namespace {

using loom::Tensor;
using loom::cpu;

using loom::test::tolerance;

const double sqrt_2_over_pi = std::sqrt(2.0 / std::acos(-1.0));

double reference_gelu(double x) {
  return 0.5 * x * (1.0 + std::tanh(sqrt_2_over_pi * (x + 0.044715 * x * x * x)));
}

//! d gelu / dx by the chain rule, written out plainly.
double reference_gelu_grad(double x) {
  const double u = sqrt_2_over_pi * (x + 0.044715 * x * x * x);
  const double du = sqrt_2_over_pi * (1.0 + 3.0 * 0.044715 * x * x);
  const double sech = 1.0 / std::cosh(u);
  return 0.5 * (1.0 + std::tanh(u)) + 0.5 * x * sech * sech * du;
}

template <class T>
std::vector<T> run_forward(const cpu& be, const std::vector<T>& in, std::int64_t rows) {
  std::vector<T> out(in.size(), T(7));
  const std::int64_t cols = static_cast<std::int64_t>(in.size()) / rows;
  loom::kernels::gelu_forward<T>(be, Tensor<T>(out.data(), {rows, cols}), Tensor<const T>(in.data(), {rows, cols}));
  return out;
}

template <class T>
void run_backward(const cpu& be, std::vector<T>& din, const std::vector<T>& in, const std::vector<T>& dout) {
  const auto n = static_cast<std::int64_t>(in.size());
  loom::kernels::gelu_backward<T>(be, Tensor<T>(din.data(), {n}), Tensor<const T>(in.data(), {n}),
                                  Tensor<const T>(dout.data(), {n}));
}

// 7 x 5 is smaller than one chunk; 70001 spans many chunks, a ragged last one and two threads.
struct Case {
  std::int64_t rows, cols;
};
const Case cases[] = {{7, 5}, {1, 1}, {3, 1025}, {70001, 1}};

}  // namespace

TEST_CASE_TEMPLATE("gelu_forward matches the plain formula", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.rows);
    CAPTURE(c.cols);
    const auto in = loom::test::random_vector<T>(c.rows * c.cols, 11, -5.0, 5.0);
    std::vector<double> ref(in.size());
    for (std::size_t i = 0; i < in.size(); ++i) ref[i] = reference_gelu(static_cast<double>(in[i]));
    CHECK(loom::test::max_relative_error(run_forward(one, in, c.rows), ref, 1.0) <= tolerance<T>());
    CHECK(loom::test::max_relative_error(run_forward(two, in, c.rows), ref, 1.0) <= tolerance<T>());
  }
}

TEST_CASE("gelu_forward at fixed points") {
  const cpu be(1);
  const std::vector<double> in{0.0, 1.0, -1.0, 20.0, -20.0};
  const auto out = run_forward(be, in, 1);
  CHECK(out[0] == 0.0);
  CHECK(out[1] == doctest::Approx(0.8411919906082768).epsilon(1e-14));
  CHECK(out[2] == doctest::Approx(-0.15880800939172324).epsilon(1e-14));
  CHECK(out[3] == 20.0);
  CHECK(std::abs(out[4]) < 1e-12);
}

TEST_CASE_TEMPLATE("gelu_backward matches the plain derivative", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.rows);
    CAPTURE(c.cols);
    const auto in = loom::test::random_vector<T>(c.rows * c.cols, 21, -5.0, 5.0);
    const auto dout = loom::test::random_vector<T>(in.size(), 22);
    std::vector<double> ref(in.size());
    for (std::size_t i = 0; i < in.size(); ++i)
      ref[i] = reference_gelu_grad(static_cast<double>(in[i])) * static_cast<double>(dout[i]);
    for (const cpu* be : {&one, &two}) {
      CAPTURE(be->threads());
      std::vector<T> din(in.size(), T(0));
      run_backward(*be, din, in, dout);
      CHECK(loom::test::max_relative_error(din, ref, 1.0) <= tolerance<T>());
    }
  }
}

TEST_CASE("gelu_backward matches central differences (double)") {
  const cpu be(1);
  auto in = loom::test::random_vector<double>(7 * 5, 31, -4.0, 4.0);
  const auto w = loom::test::random_vector<double>(in.size(), 32);
  auto loss = [&] {
    const auto out = run_forward(be, in, 7);
    double total = 0;
    for (std::size_t i = 0; i < w.size(); ++i) total += out[i] * w[i];
    return total;
  };
  const auto numeric = loom::test::finite_difference(loss, std::span<double>(in));
  std::vector<double> din(in.size(), 0.0);
  run_backward(be, din, in, w);
  CHECK(loom::test::max_relative_error(din, numeric, 1e-2) <= 1e-6);
}

TEST_CASE_TEMPLATE("gelu_backward accumulates into din", T, float, double) {
  const cpu be(2);
  const double accumulate_tolerance = sizeof(T) == sizeof(double) ? 1e-15 : 2e-7;
  for (const Case& c : {Case{7, 5}, Case{70001, 1}}) {
    CAPTURE(c.rows);
    const auto in = loom::test::random_vector<T>(c.rows * c.cols, 41, -3.0, 3.0);
    const auto dout = loom::test::random_vector<T>(in.size(), 42);
    std::vector<T> fresh(in.size(), T(0));
    run_backward(be, fresh, in, dout);
    const auto prior = loom::test::random_vector<T>(in.size(), 43);
    auto accumulated = prior;
    run_backward(be, accumulated, in, dout);
    std::vector<double> expected(in.size());
    for (std::size_t i = 0; i < in.size(); ++i)
      expected[i] = static_cast<double>(prior[i]) + static_cast<double>(fresh[i]);
    CHECK(loom::test::max_relative_error(accumulated, expected, 1.0) <= accumulate_tolerance);
  }
}

TEST_CASE_TEMPLATE("gelu kernels give the same bits on 1 and 2 threads", T, float, double) {
  const cpu one(1), two(2);
  const auto in = loom::test::random_vector<T>(70001, 51, -5.0, 5.0);
  const auto dout = loom::test::random_vector<T>(in.size(), 52);
  CHECK(run_forward(one, in, 1) == run_forward(two, in, 1));
  std::vector<T> d1(in.size(), T(0)), d2(in.size(), T(0));
  run_backward(one, d1, in, dout);
  run_backward(two, d2, in, dout);
  CHECK(d1 == d2);
}

TEST_CASE("gelu kernels reject mismatched element counts") {
  const cpu be(1);
  std::vector<float> a(35), b(36), c(35);
  using loom::test::expect_error;
  using loom::kernels::gelu_backward;
  using loom::kernels::gelu_forward;
  CHECK_THROWS_AS(gelu_forward<float>(be, Tensor<float>(b.data(), {36}), Tensor<const float>(a.data(), {7, 5})),
                  loom::Error);
  expect_error([&] { gelu_forward<float>(be, Tensor<float>(b.data(), {6, 6}), Tensor<const float>(a.data(), {7, 5})); },
               "gelu_forward: argument out");
  expect_error([&] {
    gelu_backward<float>(be, Tensor<float>(b.data(), {36}), Tensor<const float>(a.data(), {35}),
                         Tensor<const float>(c.data(), {35}));
  }, "gelu_backward: argument din");
  expect_error([&] {
    gelu_backward<float>(be, Tensor<float>(c.data(), {35}), Tensor<const float>(a.data(), {35}),
                         Tensor<const float>(b.data(), {36}));
  }, "gelu_backward: argument dout");
}
