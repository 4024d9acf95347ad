// Adafactor's CUDA kernels (backend/cuda/adafactor.cuh) against the CPU kernels
// (backend/cpu/adafactor.hpp) on the same inputs: runs of a whole matrix, of split_rows and
// split_cols slices (fused blocks: groups = 3, two tensor-parallel ranks) and of a vector (one
// column), each starting at a nonzero element of its slice with an odd length, long enough for
// many blocks; float and bf16 gradients, float parameters, bf16 parameters with fp32 master
// weights from bf16 or float gradients.
//
// Tolerances:
// - the row, column and update square sums add positive terms in double, in another order than
//   the CPU's: 1e-12 relative. Each sum is run twice and must give the same bits;
// - the updates: 1e-6 of |p decay| + |step u| for float parameters and fp32 master weights (the
//   kernel rounds each product as the CPU does, so they normally match bit for bit); bf16
//   parameters within one bf16 ulp of the CPU's.
//
// The runs (their ParameterSpec slices and WholeIndex values) and the CPU reference are built by
// g++ with OpenMP in adafactor_reference.cpp: this nvcc translation unit includes neither the CPU
// backend nor core/parameters.hpp. Without a GPU the host cases run and the program exits with 77
// (ctest: skipped).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "adafactor_reference.hpp"
#include "device_check.hpp"
#include "loom/backend/cuda/kernels.cuh"
#include "loom/core/bf16.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/whole_index.hpp"
#include "loom/optim/update_rules.hpp"

using namespace loom;
using namespace loom::cuda_test;

namespace {

// ------------------------------------------------------------------------------------------
// The runs (adafactor_reference.cpp builds their slices).

using RunCase = cpu_adafactor::Run;

std::vector<RunCase> run_cases() { return cpu_adafactor::runs(); }

// ------------------------------------------------------------------------------------------
// Inputs and checks.

template <class E>
std::vector<E> random_values(std::int64_t n, std::uint32_t seed, float lo, float hi) {
  std::vector<E> out;
  out.reserve(static_cast<std::size_t>(n));
  for (float x : random_floats(n, seed, lo, hi)) out.push_back(static_cast<E>(x));
  return out;
}

std::vector<double> random_doubles(std::int64_t n, std::uint32_t seed, double lo, double hi) {
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (double& x : v) x = dist(gen);
  return v;
}

//! Every |got[i] - want[i]| <= tolerance |want[i]|, reported in one CHECK.
void check_relative(const std::vector<double>& got, const std::vector<double>& want, double tolerance,
                    const std::string& what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0, first = 0;
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double error = std::abs(got[i] - want[i]), bound = tolerance * std::abs(want[i]);
    if (!(error <= bound)) {
      if (bad == 0) first = i;
      ++bad;
    }
    if (want[i] != 0) worst = std::max(worst, error / std::abs(want[i]));
  }
  std::ostringstream message;
  message.precision(17);
  message << what << ": " << bad << " of " << got.size() << " outside " << tolerance << " relative";
  if (bad > 0) message << "; first at " << first << ": got " << got[first] << ", expected " << want[first];
  message << "; worst relative error " << worst;
  INFO(message.str());
  CHECK(bad == 0);
}

//! The position of a bf16 value on the number line in ulps (sign-magnitude to two's complement).
int ordinal(bf16 x) {
  const int magnitude = x.bits & 0x7fff;
  return (x.bits & 0x8000) != 0 ? -magnitude : magnitude;
}

//! Every got[i] within one bf16 ulp of want[i], reported in one CHECK.
void check_within_one_ulp(const std::vector<bf16>& got, const std::vector<bf16>& want, const std::string& what) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0, first = 0, differ = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const int distance = std::abs(ordinal(got[i]) - ordinal(want[i]));
    differ += distance != 0 ? 1 : 0;
    if (distance > 1) {
      if (bad == 0) first = i;
      ++bad;
    }
  }
  std::ostringstream message;
  message << what << ": " << bad << " of " << got.size() << " more than one bf16 ulp away (" << differ
          << " not equal)";
  if (bad > 0)
    message << "; first at " << first << ": got " << static_cast<float>(got[first]) << ", expected "
            << static_cast<float>(want[first]);
  INFO(message.str());
  CHECK(bad == 0);
}

//! The scale of each updated element: |p decay| + |step g row_scale col_scale| in double.
template <class G>
std::vector<double> update_magnitudes(const RunCase& c, const std::vector<float>& p, const std::vector<G>& g,
                                      const std::vector<float>& row_scale, const std::vector<float>& col_scale,
                                      const AdafactorUpdate& h) {
  const WholeIndex& index = c.index;
  std::vector<double> magnitude(p.size());
  for (std::int64_t i = 0; i < c.count; ++i) {
    const auto k = static_cast<std::size_t>(i);
    const double u = static_cast<double>(static_cast<float>(g[k])) * row_scale[static_cast<std::size_t>(index.row(i))] *
                     col_scale[static_cast<std::size_t>(index.col(i))];
    magnitude[k] = std::abs(p[k] * h.decay) + std::abs(h.step * u);
  }
  return magnitude;
}

// ------------------------------------------------------------------------------------------
// One kernel, one run.

template <class G>
void check_square_sums(loom::cuda& be, const RunCase& c) {
  const WholeIndex& index = c.index;
  const MatrixView& view = c.view;
  const std::vector<G> grads = random_values<G>(c.count, 11, -2.0f, 2.0f);
  // Nonzero starting sums: the kernel adds into them, and leaves rows the run misses alone.
  const std::vector<double> rows0 = random_doubles(view.rows, 12, 0.5, 1.0);
  const std::vector<double> cols0 = random_doubles(view.cols, 13, 0.5, 1.0);

  std::vector<double> row_want = rows0, col_want = cols0;
  cpu_adafactor::square_sums(grads, index, row_want, col_want);

  const DeviceArray<G> device_grads(be, grads, Shape{c.count});
  const auto run = [&] {
    const DeviceArray<double> row_sums(be, rows0, Shape{view.rows}), col_sums(be, cols0, Shape{view.cols});
    adafactor_square_sums<G>(be, device_grads.cview(), index, view.rows, row_sums.buffer.data(),
                             col_sums.buffer.data());
    return std::pair{row_sums.to_host(be), col_sums.to_host(be)};
  };
  const auto [row_got, col_got] = run();
  check_relative(row_got, row_want, 1e-12, "row sums");
  check_relative(col_got, col_want, 1e-12, "column sums");
  const auto [row_again, col_again] = run();
  CHECK(row_again == row_got);  // the same bits on every run
  CHECK(col_again == col_got);
}

template <class G>
void check_update_square_sum(loom::cuda& be, const RunCase& c) {
  const WholeIndex& index = c.index;
  const MatrixView& view = c.view;
  const std::vector<G> grads = random_values<G>(c.count, 21, -2.0f, 2.0f);
  const std::vector<float> row_scale = random_floats(view.rows, 22, 0.25f, 2.0f);
  const std::vector<float> col_scale = random_floats(view.cols, 23, 0.25f, 2.0f);

  const double want = cpu_adafactor::update_square_sum(grads, index, row_scale, col_scale);

  const DeviceArray<G> device_grads(be, grads, Shape{c.count});
  const DeviceArray<float> device_rows(be, row_scale, Shape{view.rows}), device_cols(be, col_scale, Shape{view.cols});
  const double got = adafactor_update_square_sum<G, float>(be, device_grads.cview(), index,
                                                           device_rows.buffer.data(), device_cols.buffer.data());
  check_relative({got}, {want}, 1e-12, "update square sum");
  CHECK(adafactor_update_square_sum<G, float>(be, device_grads.cview(), index, device_rows.buffer.data(),
                                              device_cols.buffer.data()) == got);  // the same bits again
}

constexpr AdafactorUpdate update_factors{.decay = 1.0 - 1e-2 * 0.1, .step = 0.0137};

void check_float_update(loom::cuda& be, const RunCase& c) {
  const WholeIndex& index = c.index;
  const MatrixView& view = c.view;
  const std::vector<float> params = random_floats(c.count, 31);
  const std::vector<float> grads = random_floats(c.count, 32, -2.0f, 2.0f);
  const std::vector<float> row_scale = random_floats(view.rows, 33, 0.25f, 2.0f);
  const std::vector<float> col_scale = random_floats(view.cols, 34, 0.25f, 2.0f);
  const AdafactorUpdate h = update_factors;

  std::vector<float> want = params;
  cpu_adafactor::update(want, grads, index, row_scale, col_scale, h);

  const DeviceArray<float> device_params(be, params, Shape{c.count}), device_grads(be, grads, Shape{c.count});
  const DeviceArray<float> device_rows(be, row_scale, Shape{view.rows}), device_cols(be, col_scale, Shape{view.cols});
  adafactor_update<float>(be, device_params.view(), device_grads.cview(), index, device_rows.buffer.data(),
                          device_cols.buffer.data(), h);
  const std::vector<float> got = device_params.to_host(be);
  check_close(got, to_double(want), update_magnitudes(c, params, grads, row_scale, col_scale, h), 1e-6,
              "float parameters", 0.0);
  const auto equal = std::inner_product(got.begin(), got.end(), want.begin(), std::size_t{0}, std::plus<>(),
                                        [](float a, float b) { return a == b ? std::size_t{1} : std::size_t{0}; });
  MESSAGE(c.name << ": " << equal << " of " << got.size() << " float parameters equal to the CPU's bits");
}

template <class G>
void check_bf16_update(loom::cuda& be, const RunCase& c) {
  const WholeIndex& index = c.index;
  const MatrixView& view = c.view;
  const std::vector<float> master = random_floats(c.count, 41);
  const std::vector<bf16> params = random_values<bf16>(c.count, 41, -1.0f, 1.0f);  // master rounded
  const std::vector<G> grads = random_values<G>(c.count, 42, -2.0f, 2.0f);
  const std::vector<float> row_scale = random_floats(view.rows, 43, 0.25f, 2.0f);
  const std::vector<float> col_scale = random_floats(view.cols, 44, 0.25f, 2.0f);
  const AdafactorUpdate h = update_factors;

  std::vector<bf16> params_want = params;
  std::vector<float> master_want = master;
  cpu_adafactor::update(params_want, grads, master_want, index, row_scale, col_scale, h);

  const DeviceArray<bf16> device_params(be, params, Shape{c.count});
  const DeviceArray<G> device_grads(be, grads, Shape{c.count});
  const DeviceArray<float> device_master(be, master, Shape{c.count});
  const DeviceArray<float> device_rows(be, row_scale, Shape{view.rows}), device_cols(be, col_scale, Shape{view.cols});
  adafactor_update<bf16, G>(be, device_params.view(), device_grads.cview(), device_master.view(), index,
                            device_rows.buffer.data(), device_cols.buffer.data(), h);
  check_close(device_master.to_host(be), to_double(master_want),
              update_magnitudes(c, master, grads, row_scale, col_scale, h), 1e-6, "fp32 master weights", 0.0);
  check_within_one_ulp(device_params.to_host(be), params_want, "bf16 parameters");
}

// ------------------------------------------------------------------------------------------
// Host cases.

TEST_CASE("WholeIndex places the test runs where ParameterSpec::global_index does, at growing flat indices") {
  // The CUDA row sums rely on rows growing with the run's element; the stretches on consecutive().
  for (const RunCase& c : run_cases()) {
    CAPTURE(c.name);
    const WholeIndex& index = c.index;
    const std::vector<std::int64_t> global = cpu_adafactor::global_indices(c);
    REQUIRE(global.size() == static_cast<std::size_t>(c.count));
    std::int64_t wrong = 0, not_growing = 0, not_consecutive = 0;
    for (std::int64_t i = 0; i < c.count; ++i) {
      const std::int64_t flat = index.flat(i);
      wrong += flat != global[static_cast<std::size_t>(i)] ? 1 : 0;
      if (i > 0) not_growing += flat <= index.flat(i - 1) ? 1 : 0;
      if (i + 1 < c.count && index.consecutive(i) > 1) not_consecutive += index.flat(i + 1) != flat + 1 ? 1 : 0;
    }
    CHECK(wrong == 0);
    CHECK(not_growing == 0);
    CHECK(not_consecutive == 0);
    CHECK(c.count % 2 == 1);
    CHECK(c.first > 0);
  }
}

TEST_CASE("adafactor's launch sizes depend on the element count and the columns only, within their limits") {
  namespace af = detail::cuda_adafactor;
  CHECK(af::chunks_for(1) == 1);
  CHECK(af::chunks_for(af::min_chunk_elements + 1) == 2);
  CHECK(af::chunks_for(std::int64_t{40} << 20) == af::max_chunks);
  for (const std::int64_t cols : {std::int64_t{1}, std::int64_t{768}, std::int64_t{3072}, std::int64_t{50304},
                                  std::int64_t{1} << 23}) {
    CAPTURE(cols);
    const std::int64_t chunks = af::column_chunks_for(std::int64_t{40} << 20, cols);
    CHECK(chunks >= 1);
    CHECK((chunks == 1 || chunks * cols <= af::max_column_partials));
  }
  // Every element in exactly one chunk.
  const std::int64_t n = 200001, chunks = af::chunks_for(n);
  CHECK(af::chunk_begin(n, chunks, 0) == 0);
  CHECK(af::chunk_begin(n, chunks, chunks) == n);
}

// ------------------------------------------------------------------------------------------
// Device cases.

TEST_CASE("adafactor_square_sums adds each run's g^2 per whole row and column as the CPU does, deterministically") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const RunCase& c : run_cases()) {
    CAPTURE(c.name);
    {
      INFO("float gradients");
      check_square_sums<float>(be, c);
    }
    {
      INFO("bf16 gradients");
      check_square_sums<bf16>(be, c);
    }
  }
}

TEST_CASE("adafactor_update_square_sum gives the CPU's squared update norm, deterministically") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const RunCase& c : run_cases()) {
    CAPTURE(c.name);
    {
      INFO("float gradients");
      check_update_square_sum<float>(be, c);
    }
    {
      INFO("bf16 gradients");
      check_update_square_sum<bf16>(be, c);
    }
  }
}

TEST_CASE("adafactor_update steps float parameters and bf16 parameters with fp32 master weights as the CPU does") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  for (const RunCase& c : run_cases()) {
    CAPTURE(c.name);
    check_float_update(be, c);
    {
      INFO("bf16 parameters, bf16 gradients");
      check_bf16_update<bf16>(be, c);
    }
    {
      INFO("bf16 parameters, float gradients");
      check_bf16_update<float>(be, c);
    }
  }
}

TEST_CASE("adafactor's cuda kernels skip empty runs and reject rows outside the matrix view") {
  if (!have_gpu()) return;
  loom::cuda be(0);
  const RunCase c = run_cases().front();
  const MatrixView& view = c.view;
  const std::vector<double> rows0(static_cast<std::size_t>(view.rows), 1.0);
  const std::vector<double> cols0(static_cast<std::size_t>(view.cols), 2.0);
  const DeviceArray<double> row_sums(be, rows0, Shape{view.rows}), col_sums(be, cols0, Shape{view.cols});
  adafactor_square_sums<float>(be, Tensor<const float>{}, c.index, view.rows, row_sums.buffer.data(),
                               col_sums.buffer.data());
  CHECK(row_sums.to_host(be) == rows0);
  CHECK(col_sums.to_host(be) == cols0);
  CHECK(adafactor_update_square_sum<float, float>(be, Tensor<const float>{}, c.index, nullptr, nullptr) == 0.0);

  // A run whose last rows lie beyond the `rows` given: an error before any work.
  const std::vector<float> grads(static_cast<std::size_t>(c.count), 1.0f);
  const DeviceArray<float> device_grads(be, grads, Shape{c.count});
  CHECK_THROWS_WITH_AS(adafactor_square_sums<float>(be, device_grads.cview(), c.index, view.rows / 2,
                                                    row_sums.buffer.data(), col_sums.buffer.data()),
                       doctest::Contains("adafactor_square_sums"), loom::Error);
  CHECK(row_sums.to_host(be) == rows0);
}

}  // namespace

int main(int argc, char** argv) { return loom::cuda_test::run_tests(argc, argv); }
