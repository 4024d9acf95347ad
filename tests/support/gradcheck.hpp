#pragma once
// Test support: random fills, central finite differences and tolerant comparisons for the
// double-precision gradient checks every kernel gets.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/rng.hpp"

namespace loom::test {

//! Fills `x` with uniform values in [lo, hi) from a counter-based stream (reproducible).
template <class T>
void fill_uniform(std::span<T> x, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  CounterRng rng(seed, "test.fill");
  for (std::size_t i = 0; i < x.size(); ++i)
    x[i] = static_cast<T>(lo + (hi - lo) * rng.uniform(i));
}

template <class T>
std::vector<T> random_vector(std::size_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::vector<T> v(n);
  fill_uniform<T>(v, seed, lo, hi);
  return v;
}

//! d loss / d x[i] by central differences; `loss` re-evaluates with the current x.
template <class Loss>
std::vector<double> finite_difference(Loss&& loss, std::span<double> x, double eps = 1e-6) {
  std::vector<double> grad(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double up = loss();
    x[i] = saved - eps;
    const double down = loss();
    x[i] = saved;
    grad[i] = (up - down) / (2 * eps);
  }
  return grad;
}

//! max_i |a_i - b_i| / max(|a_i|, |b_i|, floor).
template <class A, class B>
double max_relative_error(const A& a, const B& b, double floor = 1e-6) {
  REQUIRE(std::size(a) == std::size(b));
  double worst = 0;
  for (std::size_t i = 0; i < std::size(a); ++i) {
    const double x = static_cast<double>(a[i]), y = static_cast<double>(b[i]);
    const double scale = std::max({std::abs(x), std::abs(y), floor});
    worst = std::max(worst, std::abs(x - y) / scale);
  }
  return worst;
}

//! Error bound of a kernel against its double reference, relative to max(|value|, floor).
template <class T>
constexpr double tolerance() {
  return sizeof(T) == sizeof(double) ? 1e-12 : 1e-5;
}

//! Whether a and b hold the same values (a zero's sign aside; a NaN matches nothing): what an
//! overwriting kernel (GradientWrite::overwrite) must give against accumulating into zeros.
template <class T>
bool same_values(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(loom::to_accumulate(a[i]) == loom::to_accumulate(b[i]))) return false;
  return true;
}

//! Whether a and b hold the same bits (-0 and 0 apart, a NaN matching its own bits).
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

//! Runs `call`, which must throw loom::Error whose message contains `fragment`.
template <class Call>
void expect_error(Call&& call, const std::string& fragment) {
  try {
    call();
    FAIL("expected loom::Error mentioning " << fragment);
  } catch (const loom::Error& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find(fragment) != std::string::npos);
  }
}

}  // namespace loom::test
