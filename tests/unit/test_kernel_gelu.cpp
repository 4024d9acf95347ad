// GELU kernels, both forms (Gelu::tanh and Gelu::erf): forward and backward against the plain
// formulas, backward against central differences, the accumulate convention, shape checks and
// thread-count determinism; the shared scalar formulas (what the CUDA kernels run) and the names.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/backend/cpu/gelu.hpp"
#include "loom/backend/gelu.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_gelu {

namespace {

using loom::Gelu;
using loom::Tensor;
using loom::cpu;

using loom::test::tolerance;

const double pi = std::acos(-1.0);
const double sqrt_2_over_pi = std::sqrt(2.0 / pi);

constexpr Gelu kinds[] = {Gelu::tanh, Gelu::erf};

//! GELU(x) of the form `kind`: x Φ(x) with std::erf, or GPT-2's tanh approximation of it.
double reference_gelu(Gelu kind, double x) {
  if (kind == Gelu::erf) return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
  return 0.5 * x * (1.0 + std::tanh(sqrt_2_over_pi * (x + 0.044715 * x * x * x)));
}

//! d gelu / dx, written out plainly: Φ(x) + x φ(x) for erf, the chain rule through tanh.
double reference_gelu_grad(Gelu kind, double x) {
  if (kind == Gelu::erf)
    return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2 * pi);
  const double u = sqrt_2_over_pi * (x + 0.044715 * x * x * x);
  const double du = sqrt_2_over_pi * (1.0 + 3.0 * 0.044715 * x * x);
  const double sech = 1.0 / std::cosh(u);
  return 0.5 * (1.0 + std::tanh(u)) + 0.5 * x * sech * sech * du;
}

template <class T>
std::vector<T> run_forward(const cpu& be, const std::vector<T>& in, std::int64_t rows, Gelu kind) {
  std::vector<T> out(in.size(), T(7));
  const std::int64_t cols = static_cast<std::int64_t>(in.size()) / rows;
  loom::kernels::gelu_forward<T>(be, Tensor<T>(out.data(), {rows, cols}), Tensor<const T>(in.data(), {rows, cols}),
                                 kind);
  return out;
}

template <class T>
void run_backward(const cpu& be, std::vector<T>& din, const std::vector<T>& in, const std::vector<T>& dout,
                  Gelu kind) {
  const auto n = static_cast<std::int64_t>(in.size());
  loom::kernels::gelu_backward<T>(be, Tensor<T>(din.data(), {n}), Tensor<const T>(in.data(), {n}),
                                  Tensor<const T>(dout.data(), {n}), kind);
}

// 7 x 5 is smaller than one chunk; 70001 spans many chunks, a ragged last one and two threads.
struct Case {
  std::int64_t rows, cols;
};
const Case cases[] = {{7, 5}, {1, 1}, {3, 1025}, {70001, 1}};

}  // namespace

TEST_CASE_TEMPLATE("gelu_forward matches the plain formula", T, float, double) {
  const cpu one(1), two(2);
  for (const Gelu kind : kinds) {
    for (const Case& c : cases) {
      CAPTURE(std::string(loom::gelu_name(kind)));
      CAPTURE(c.rows);
      CAPTURE(c.cols);
      const auto in = loom::test::random_vector<T>(c.rows * c.cols, 11, -5.0, 5.0);
      std::vector<double> ref(in.size());
      for (std::size_t i = 0; i < in.size(); ++i) ref[i] = reference_gelu(kind, static_cast<double>(in[i]));
      CHECK(loom::test::max_relative_error(run_forward(one, in, c.rows, kind), ref, 1.0) <= tolerance<T>());
      CHECK(loom::test::max_relative_error(run_forward(two, in, c.rows, kind), ref, 1.0) <= tolerance<T>());
    }
  }
}

TEST_CASE("gelu_forward at fixed points") {
  const cpu be(1);
  const std::vector<double> in{0.0, 1.0, -1.0, 20.0, -20.0};
  const auto out = run_forward(be, in, 1, Gelu::tanh);
  CHECK(out[0] == 0.0);
  CHECK(out[1] == doctest::Approx(0.8411919906082768).epsilon(1e-14));
  CHECK(out[2] == doctest::Approx(-0.15880800939172324).epsilon(1e-14));
  CHECK(out[3] == 20.0);
  CHECK(std::abs(out[4]) < 1e-12);
  // The exact form: x Φ(x), so GELU(1) = Φ(1) and GELU(-1) = -Φ(-1).
  const auto exact = run_forward(be, in, 1, Gelu::erf);
  CHECK(exact[0] == 0.0);
  CHECK(exact[1] == doctest::Approx(0.8413447460685429).epsilon(1e-14));
  CHECK(exact[2] == doctest::Approx(-0.15865525393145707).epsilon(1e-14));
  CHECK(exact[3] == 20.0);
  CHECK(std::abs(exact[4]) < 1e-12);
  // The default is GPT-2's form.
  std::vector<double> by_default(in.size());
  loom::kernels::gelu_forward<double>(be, Tensor<double>(by_default.data(), {5}), Tensor<const double>(in.data(), {5}));
  CHECK(by_default == out);
}

TEST_CASE_TEMPLATE("gelu_backward matches the plain derivative", T, float, double) {
  const cpu one(1), two(2);
  for (const Gelu kind : kinds) {
    for (const Case& c : cases) {
      CAPTURE(std::string(loom::gelu_name(kind)));
      CAPTURE(c.rows);
      CAPTURE(c.cols);
      const auto in = loom::test::random_vector<T>(c.rows * c.cols, 21, -5.0, 5.0);
      const auto dout = loom::test::random_vector<T>(in.size(), 22);
      std::vector<double> ref(in.size());
      for (std::size_t i = 0; i < in.size(); ++i)
        ref[i] = reference_gelu_grad(kind, static_cast<double>(in[i])) * static_cast<double>(dout[i]);
      for (const cpu* be : {&one, &two}) {
        CAPTURE(be->threads());
        std::vector<T> din(in.size(), T(0));
        run_backward(*be, din, in, dout, kind);
        CHECK(loom::test::max_relative_error(din, ref, 1.0) <= tolerance<T>());
      }
    }
  }
}

TEST_CASE("gelu_backward matches central differences (double)") {
  const cpu be(1);
  for (const Gelu kind : kinds) {
    CAPTURE(std::string(loom::gelu_name(kind)));
    auto in = loom::test::random_vector<double>(7 * 5, 31, -4.0, 4.0);
    const auto w = loom::test::random_vector<double>(in.size(), 32);
    auto loss = [&] {
      const auto out = run_forward(be, in, 7, kind);
      double total = 0;
      for (std::size_t i = 0; i < w.size(); ++i) total += out[i] * w[i];
      return total;
    };
    const auto numeric = loom::test::finite_difference(loss, std::span<double>(in));
    std::vector<double> din(in.size(), 0.0);
    run_backward(be, din, in, w, kind);
    CHECK(loom::test::max_relative_error(din, numeric, 1e-2) <= 1e-6);
  }
}

TEST_CASE_TEMPLATE("gelu_backward accumulates into din", T, float, double) {
  const cpu be(2);
  const double accumulate_tolerance = sizeof(T) == sizeof(double) ? 1e-15 : 2e-7;
  for (const Gelu kind : kinds) {
    for (const Case& c : {Case{7, 5}, Case{70001, 1}}) {
      CAPTURE(std::string(loom::gelu_name(kind)));
      CAPTURE(c.rows);
      const auto in = loom::test::random_vector<T>(c.rows * c.cols, 41, -3.0, 3.0);
      const auto dout = loom::test::random_vector<T>(in.size(), 42);
      std::vector<T> fresh(in.size(), T(0));
      run_backward(be, fresh, in, dout, kind);
      const auto prior = loom::test::random_vector<T>(in.size(), 43);
      auto accumulated = prior;
      run_backward(be, accumulated, in, dout, kind);
      std::vector<double> expected(in.size());
      for (std::size_t i = 0; i < in.size(); ++i)
        expected[i] = static_cast<double>(prior[i]) + static_cast<double>(fresh[i]);
      CHECK(loom::test::max_relative_error(accumulated, expected, 1.0) <= accumulate_tolerance);
    }
  }
}

TEST_CASE_TEMPLATE("gelu kernels give the same bits on 1 and 2 threads", T, float, double) {
  const cpu one(1), two(2);
  const auto in = loom::test::random_vector<T>(70001, 51, -5.0, 5.0);
  const auto dout = loom::test::random_vector<T>(in.size(), 52);
  for (const Gelu kind : kinds) {
    CAPTURE(std::string(loom::gelu_name(kind)));
    CHECK(run_forward(one, in, 1, kind) == run_forward(two, in, 1, kind));
    std::vector<T> d1(in.size(), T(0)), d2(in.size(), T(0));
    run_backward(one, d1, in, dout, kind);
    run_backward(two, d2, in, dout, kind);
    CHECK(d1 == d2);
  }
}

// Eigen vectorises float's erf (a rational approximation, a few ulp) where it vectorises at all,
// as it does tanh: the erf form is no scalar loop.
#if defined(EIGEN_VECTORIZE) && EIGEN_FAST_MATH
static_assert(Eigen::internal::functor_traits<Eigen::internal::scalar_erf_op<float>>::PacketAccess);
static_assert(Eigen::internal::functor_traits<Eigen::internal::scalar_tanh_op<float>>::PacketAccess);
#endif

TEST_CASE_TEMPLATE("the scalar GELU formulas (what the CUDA kernels run) match the plain ones", T, float, double) {
  namespace d = loom::detail::gelu;
  const auto xs = loom::test::random_vector<T>(1001, 61, -5.0, 5.0);
  for (const Gelu kind : kinds) {
    CAPTURE(std::string(loom::gelu_name(kind)));
    std::vector<T> value, derivative;
    std::vector<double> value_ref, derivative_ref;
    for (const T x : xs) {
      value.push_back(kind == Gelu::erf ? d::value<Gelu::erf>(x) : d::value<Gelu::tanh>(x));
      derivative.push_back(kind == Gelu::erf ? d::derivative<Gelu::erf>(x) : d::derivative<Gelu::tanh>(x));
      value_ref.push_back(reference_gelu(kind, static_cast<double>(x)));
      derivative_ref.push_back(reference_gelu_grad(kind, static_cast<double>(x)));
    }
    CHECK(loom::test::max_relative_error(value, value_ref, 1.0) <= tolerance<T>());
    CHECK(loom::test::max_relative_error(derivative, derivative_ref, 1.0) <= tolerance<T>());
  }
  CHECK(d::value<Gelu::erf>(T(0)) == T(0));
  CHECK(d::derivative<Gelu::erf>(T(0)) == T(0.5));
  CHECK(d::value<Gelu::erf>(T(20)) == T(20));
  CHECK(d::value<Gelu::erf>(T(-20)) == T(0));
}

TEST_CASE("the two GELUs differ by less than 5e-4, their derivatives by less than 1e-3") {
  const cpu be(1);
  std::vector<double> in;
  for (double x = -8.0; x <= 8.0; x += 1.0 / 1024) in.push_back(x);
  const auto tanh_form = run_forward(be, in, 1, Gelu::tanh), erf_form = run_forward(be, in, 1, Gelu::erf);
  const std::vector<double> ones(in.size(), 1.0);
  std::vector<double> tanh_grad(in.size(), 0.0), erf_grad(in.size(), 0.0);
  run_backward(be, tanh_grad, in, ones, Gelu::tanh);
  run_backward(be, erf_grad, in, ones, Gelu::erf);
  double value_gap = 0, derivative_gap = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    value_gap = std::max(value_gap, std::abs(tanh_form[i] - erf_form[i]));
    derivative_gap = std::max(derivative_gap, std::abs(tanh_grad[i] - erf_grad[i]));
  }
  CAPTURE(value_gap);
  CAPTURE(derivative_gap);
  CHECK(value_gap > 4e-4);
  CHECK(value_gap < 5e-4);
  CHECK(derivative_gap > 8e-4);
  CHECK(derivative_gap < 1e-3);
}

TEST_CASE("gelu_name and gelu_from_name name each form; an unknown name is refused, naming it") {
  for (const Gelu kind : kinds) CHECK(loom::gelu_from_name(loom::gelu_name(kind), "test") == kind);
  CHECK(std::string(loom::gelu_name(Gelu::tanh)) == "tanh");
  CHECK(std::string(loom::gelu_name(Gelu::erf)) == "erf");
  CHECK(loom::detail::to_text(Gelu::erf) == "erf");
  loom::test::expect_error([] { loom::gelu_from_name("gelu_new", "bert_train: --gelu"); },
                           "bert_train: --gelu: got gelu_new; expected tanh");
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

}  // namespace test_kernel_gelu
