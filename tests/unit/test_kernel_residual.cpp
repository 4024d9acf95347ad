// Residual kernels: forward against the plain sum, backward against central differences, the
// accumulate convention, shape checks and thread-count determinism.

#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/backend/cpu/residual.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_residual {

namespace {

using loom::Tensor;
using loom::cpu;

struct Case {
  std::int64_t B, T, C;
};
// The last case is above the kernel's threshold for threads.
const Case cases[] = {{2, 3, 5}, {1, 7, 5}, {1, 1, 1}, {3, 101, 131}};

template <class T>
std::vector<T> run_forward(const cpu& be, const std::vector<T>& a, const std::vector<T>& b, const Case& c) {
  std::vector<T> out(a.size(), T(7));
  loom::kernels::residual_forward<T>(be, Tensor<T>(out.data(), {c.B, c.T, c.C}),
                                     Tensor<const T>(a.data(), {c.B, c.T, c.C}),
                                     Tensor<const T>(b.data(), {c.B, c.T, c.C}));
  return out;
}

template <class T>
void run_backward(const cpu& be, std::vector<T>& da, std::vector<T>& db, const std::vector<T>& dout,
                  const Case& c) {
  loom::kernels::residual_backward<T>(be, Tensor<T>(da.data(), {c.B, c.T, c.C}),
                                      Tensor<T>(db.data(), {c.B, c.T, c.C}),
                                      Tensor<const T>(dout.data(), {c.B, c.T, c.C}));
}

}  // namespace

TEST_CASE_TEMPLATE("residual_forward matches the plain sum", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.T);
    const auto a = loom::test::random_vector<T>(c.B * c.T * c.C, 11);
    const auto b = loom::test::random_vector<T>(a.size(), 12);
    std::vector<T> ref(a.size());
    for (std::size_t i = 0; i < a.size(); ++i) ref[i] = a[i] + b[i];  // exact in T: same bits
    CHECK(run_forward(one, a, b, c) == ref);
    CHECK(run_forward(two, a, b, c) == ref);
    // In place: out aliasing a.
    auto in_place = a;
    const auto n = static_cast<std::int64_t>(a.size());
    loom::kernels::residual_forward<T>(two, Tensor<T>(in_place.data(), {n}), Tensor<const T>(in_place.data(), {n}),
                                       Tensor<const T>(b.data(), {n}));
    CHECK(in_place == ref);
  }
}

TEST_CASE("residual_backward matches central differences (double)") {
  const cpu be(1);
  const Case c{2, 3, 5};
  auto a = loom::test::random_vector<double>(c.B * c.T * c.C, 21);
  auto b = loom::test::random_vector<double>(a.size(), 22);
  const auto w = loom::test::random_vector<double>(a.size(), 23);
  auto loss = [&] {
    const auto out = run_forward(be, a, b, c);
    double total = 0;
    for (std::size_t i = 0; i < w.size(); ++i) total += out[i] * w[i];
    return total;
  };
  const auto num_a = loom::test::finite_difference(loss, std::span<double>(a));
  const auto num_b = loom::test::finite_difference(loss, std::span<double>(b));
  std::vector<double> da(a.size(), 0.0), db(a.size(), 0.0);
  run_backward(be, da, db, w, c);
  CHECK(loom::test::max_relative_error(da, num_a, 1e-2) <= 1e-6);
  CHECK(loom::test::max_relative_error(db, num_b, 1e-2) <= 1e-6);
}

TEST_CASE_TEMPLATE("residual_backward accumulates into da and db", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.T);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 31);
    const auto prior_a = loom::test::random_vector<T>(dout.size(), 32);
    const auto prior_b = loom::test::random_vector<T>(dout.size(), 33);
    std::vector<T> expect_a(dout.size()), expect_b(dout.size());
    for (std::size_t i = 0; i < dout.size(); ++i) {
      expect_a[i] = prior_a[i] + dout[i];
      expect_b[i] = prior_b[i] + dout[i];
    }
    for (const cpu* be : {&one, &two}) {
      CAPTURE(be->threads());
      auto da = prior_a, db = prior_b;
      run_backward(*be, da, db, dout, c);
      CHECK(da == expect_a);
      CHECK(db == expect_b);
    }
  }
}

TEST_CASE("residual kernels reject mismatched element counts") {
  const cpu be(1);
  std::vector<float> x(30), y(31), z(30);
  using loom::test::expect_error;
  using loom::kernels::residual_backward;
  using loom::kernels::residual_forward;
  CHECK_THROWS_AS(residual_forward<float>(be, Tensor<float>(x.data(), {2, 3, 5}), Tensor<const float>(y.data(), {31}),
                                          Tensor<const float>(z.data(), {2, 3, 5})),
                  loom::Error);
  expect_error([&] {
    residual_forward<float>(be, Tensor<float>(x.data(), {30}), Tensor<const float>(y.data(), {31}),
                            Tensor<const float>(z.data(), {30}));
  }, "residual_forward: argument a");
  expect_error([&] {
    residual_forward<float>(be, Tensor<float>(x.data(), {30}), Tensor<const float>(z.data(), {30}),
                            Tensor<const float>(y.data(), {31}));
  }, "residual_forward: argument b");
  expect_error([&] {
    residual_backward<float>(be, Tensor<float>(y.data(), {31}), Tensor<float>(x.data(), {30}),
                             Tensor<const float>(z.data(), {30}));
  }, "residual_backward: argument da");
  expect_error([&] {
    residual_backward<float>(be, Tensor<float>(x.data(), {30}), Tensor<float>(y.data(), {31}),
                             Tensor<const float>(z.data(), {30}));
  }, "residual_backward: argument db");
}

}  // namespace test_kernel_residual
