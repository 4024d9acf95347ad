#pragma once
// What the CUDA kernel tests share: random inputs, the tolerance check that reports one line per
// tensor, device tensors filled from the host, and the main that reports "skipped" (exit 77)
// where there is no GPU. Tolerances: see test_cuda_kernels.cu's header comment.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/core/bf16.hpp"
#include "loom/core/buffer.hpp"

namespace loom::cuda_test {

inline constexpr double float_tolerance = 1e-5;
inline constexpr double tf32_tolerance = 2e-3;

inline bool have_gpu() { return cuda::device_count() > 0; }

inline std::vector<float> random_floats(std::int64_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (float& x : v) x = dist(gen);
  return v;
}

inline std::vector<double> abs_of(const std::vector<double>& v) {
  std::vector<double> a(v.size());
  std::transform(v.begin(), v.end(), a.begin(), [](double x) { return std::abs(x); });
  return a;
}

//! Every |got[i] - want[i]| <= tolerance * max(magnitude[i], floor); reports the count, the
//! first offender and the worst ratio in one CHECK (not one per element).
inline void check_close(const std::vector<float>& got, const std::vector<double>& want,
                 const std::vector<double>& magnitude, double tolerance, const std::string& what,
                 double floor = 1.0) {
  REQUIRE(got.size() == want.size());
  REQUIRE(magnitude.size() == want.size());
  std::size_t bad = 0, first = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double error = std::abs(static_cast<double>(got[i]) - want[i]);
    const double bound = tolerance * std::max(magnitude[i], floor);
    if (!(error <= bound)) {  // also catches NaN
      if (bad == 0) first = i;
      ++bad;
    }
    if (bound > 0) worst = std::max(worst, error / bound * tolerance);
  }
  std::ostringstream message;
  message << what << ": " << bad << " of " << got.size() << " elements outside " << tolerance;
  if (bad > 0)
    message << "; first at " << first << ": got " << got[first] << ", expected " << want[first]
            << " (magnitude " << magnitude[first] << ")";
  message << "; worst error / scale " << worst;
  INFO(message.str());
  CHECK(bad == 0);
}

//! Element-wise results: magnitude = |want|.
inline void check_close(const std::vector<float>& got, const std::vector<double>& want, double tolerance,
                 const std::string& what) {
  check_close(got, want, abs_of(want), tolerance, what);
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

//! Each of `v` converted to T (bf16: rounded to nearest even).
template <class T>
std::vector<T> cast_to(const std::vector<float>& v) {
  std::vector<T> out(v.size());
  std::transform(v.begin(), v.end(), out.begin(), [](float x) { return static_cast<T>(x); });
  return out;
}

//! Each of `v` (float or bf16) as float.
template <class T>
std::vector<float> floats_of(const std::vector<T>& v) {
  std::vector<float> out(v.size());
  std::transform(v.begin(), v.end(), out.begin(), [](T x) { return static_cast<float>(x); });
  return out;
}

//! n values uniform in [lo, hi), rounded to bf16.
inline std::vector<bf16> random_bf16(std::int64_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  return cast_to<bf16>(random_floats(n, seed, lo, hi));
}


//! A device array of any element type (ids, bf16, double statistics) with a shape, filled from
//! the host.
template <class E>
struct DeviceArray {
  Buffer<E, cuda> buffer;
  Shape shape;

  DeviceArray(cuda& be, const std::vector<E>& host, Shape s)
      : buffer(be, s.numel(), MemoryCategory::workspace), shape(s) {
    REQUIRE(static_cast<std::int64_t>(host.size()) == s.numel());
    be.copy_from_host(buffer.data(), host.data(), buffer.bytes());
  }
  Tensor<E> view() const { return {buffer.data(), shape}; }
  Tensor<const E> cview() const { return view(); }
  std::vector<E> to_host(const cuda& be) const {
    std::vector<E> host(static_cast<std::size_t>(shape.numel()));
    be.copy_to_host(host.data(), buffer.data(), buffer.bytes());
    return host;
  }
};

//! A device buffer of floats with a shape, filled from the host.
using DeviceTensor = DeviceArray<float>;

//! Runs the doctest cases; without a GPU, a clean run reports "skipped" (ctest
//! SKIP_RETURN_CODE 77) because the device cases had nothing to check.
inline int run_tests(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int status = context.run();
  if (status != 0 || context.shouldExit()) return status;
  if (!have_gpu()) {
    std::puts("loom: no CUDA device; the device cases were skipped (the host cases ran)");
    return 77;
  }
  return 0;
}

}  // namespace loom::cuda_test
