// Reduction kernels: sum_of_squares against a plain double sum, scale against plain products,
// and the same bits on any thread count.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "loom/backend/cpu/reduction.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_reduction {

namespace {

using loom::Tensor;
using loom::cpu;

// Sizes below one lane group, ragged lanes, one chunk, many chunks with a ragged last one.
const std::int64_t sizes[] = {1, 7, 35, 16384, 100003};

}  // namespace

TEST_CASE_TEMPLATE("sum_of_squares matches a plain double sum", T, float, double) {
  const cpu one(1), two(2);
  for (std::int64_t n : sizes) {
    CAPTURE(n);
    const auto x = loom::test::random_vector<T>(static_cast<std::size_t>(n), 11, -3.0, 3.0);
    double ref = 0;
    for (T value : x) ref += static_cast<double>(value) * static_cast<double>(value);
    // Any shape: only the elements count.
    const Tensor<const T> view(x.data(), n % 5 == 0 ? loom::Shape{5, n / 5} : loom::Shape{n});
    const double s1 = loom::kernels::sum_of_squares<T>(one, view);
    const double s2 = loom::kernels::sum_of_squares<T>(two, view);
    // Accumulated in double whatever T: double-precision agreement for float inputs too.
    CHECK(std::abs(s1 - ref) <= 1e-13 * ref);
    CHECK(s1 == s2);  // the same bits on 1 and 2 threads
  }
}

TEST_CASE_TEMPLATE("sum_elements matches a plain double sum, the same bits on any thread count", T, float, double) {
  const cpu one(1), two(2);
  for (std::int64_t n : sizes) {
    CAPTURE(n);
    const auto x = loom::test::random_vector<T>(static_cast<std::size_t>(n), 12, -3.0, 3.0);
    double ref = 0, magnitude = 0;
    for (T value : x) {
      ref += static_cast<double>(value);
      magnitude += std::abs(static_cast<double>(value));
    }
    const Tensor<const T> view(x.data(), loom::Shape{n});
    const double s1 = loom::kernels::sum_elements<T>(one, view);
    CHECK(std::abs(s1 - ref) <= 1e-13 * magnitude);
    CHECK(s1 == loom::kernels::sum_elements<T>(two, view));
  }
  CHECK(loom::kernels::sum_elements<float>(one, Tensor<const float>{}) == 0.0);
  // 2^24 + 1 ones: a float accumulator would stop at 2^24.
  const std::vector<float> ones((1u << 24) + 1, 1.0f);
  CHECK(loom::kernels::sum_elements<float>(two, Tensor<const float>(ones.data(), loom::Shape{static_cast<std::int64_t>(ones.size())})) ==
        16777217.0);
}

TEST_CASE("sum_of_squares over parts adds each part's sum in order (the same bits), empty parts count 0") {
  const cpu be(2);
  const auto x = loom::test::random_vector<float>(200000, 13, -2.0, 2.0);
  const std::int64_t cuts[] = {0, 1, 8, 8, 16392, 100003, 200000};  // an empty part in the middle
  std::vector<Tensor<const float>> parts;
  double want = 0;
  for (std::size_t i = 0; i + 1 < std::size(cuts); ++i) {
    parts.emplace_back(x.data() + cuts[i], loom::Shape{cuts[i + 1] - cuts[i]});
    want += loom::kernels::sum_of_squares<float>(be, parts.back());
  }
  parts.emplace_back();  // Tensor<T>{}: no data
  CHECK(loom::kernels::sum_of_squares<float>(be, std::span<const Tensor<const float>>(parts)) == want);
  CHECK(loom::kernels::sum_of_squares<float>(be, std::span<const Tensor<const float>>()) == 0.0);
}

TEST_CASE("sum_of_squares of an empty tensor is zero") {
  const cpu be(2);
  CHECK(loom::kernels::sum_of_squares<float>(be, Tensor<const float>{}) == 0.0);
  CHECK(loom::kernels::sum_of_squares<double>(be, Tensor<const double>{}) == 0.0);
}

TEST_CASE("sum_of_squares keeps float inputs in double") {
  // 2^24 + 1 ones squared: a float accumulator would stall at 2^24.
  const cpu be(2);
  const std::int64_t n = (std::int64_t{1} << 24) + 1;
  std::vector<float> x(static_cast<std::size_t>(n), 1.0f);
  CHECK(loom::kernels::sum_of_squares<float>(be, Tensor<const float>(x.data(), {n})) == static_cast<double>(n));
}

TEST_CASE_TEMPLATE("scale multiplies in place", T, float, double) {
  const cpu one(1), two(2);
  for (std::int64_t n : sizes) {
    CAPTURE(n);
    const auto x = loom::test::random_vector<T>(static_cast<std::size_t>(n), 21);
    const double factor = 0.37;
    std::vector<T> ref(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) ref[i] = x[i] * static_cast<T>(factor);  // one rounding in T
    for (const cpu* be : {&one, &two}) {
      CAPTURE(be->threads());
      auto y = x;
      loom::kernels::scale<T>(*be, Tensor<T>(y.data(), {n}), factor);
      CHECK(y == ref);
    }
  }
}

TEST_CASE("the global norm is the square root of the summed ranges") {
  const cpu be(2);
  const auto a = loom::test::random_vector<float>(1000, 31);
  const auto b = loom::test::random_vector<float>(70000, 32);
  std::vector<float> joined(a);
  joined.insert(joined.end(), b.begin(), b.end());
  const double parts = loom::kernels::sum_of_squares<float>(be, Tensor<const float>(a.data(), {1000})) +
                       loom::kernels::sum_of_squares<float>(be, Tensor<const float>(b.data(), {70000}));
  const double whole = loom::kernels::sum_of_squares<float>(be, Tensor<const float>(joined.data(), {71000}));
  CHECK(std::sqrt(parts) == doctest::Approx(std::sqrt(whole)).epsilon(1e-13));
}

}  // namespace test_kernel_reduction
