// matmul kernels: forward and backward against plain loops, backward against central
// differences, the forward's residual, the accumulate convention, optional arguments (an empty din, dweight or dbias is
// skipped, and a split backward gives one call's bits), shape checks and determinism.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/backend/cpu/elementwise.hpp"
#include "loom/backend/cpu/matmul.hpp"
#include "loom/core/accumulate.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_matmul {

namespace {

using loom::Shape;
using loom::Tensor;
using loom::cpu;

struct Case {
  std::int64_t B, T, C, OC;  // in [B,T,C] (B = 1: [T,C]), out [B,T,OC]
  bool bias;
};

Shape rows_shape(const Case& c, std::int64_t cols) {
  return c.B == 1 ? Shape{c.T, cols} : Shape{c.B, c.T, cols};
}

using loom::test::tolerance;

template <class T>
struct Data {
  std::vector<T> in, weight, bias;
};

template <class T>
Data<T> make_data(const Case& c, std::uint64_t seed) {
  const std::int64_t N = c.B * c.T;
  return {loom::test::random_vector<T>(N * c.C, seed), loom::test::random_vector<T>(c.OC * c.C, seed + 1),
          c.bias ? loom::test::random_vector<T>(c.OC, seed + 2) : std::vector<T>{}};
}

template <class T>
std::vector<T> run_forward(const cpu& be, const Data<T>& d, const Case& c) {
  std::vector<T> out(c.B * c.T * c.OC, T(7));
  loom::kernels::matmul_forward<T>(
      be, Tensor<T>(out.data(), rows_shape(c, c.OC)), Tensor<const T>(d.in.data(), rows_shape(c, c.C)),
      Tensor<const T>(d.weight.data(), {c.OC, c.C}),
      c.bias ? Tensor<const T>(d.bias.data(), {c.OC}) : Tensor<const T>{});
  return out;
}

template <class T>
struct Grads {
  std::vector<T> din, dweight, dbias;
};

template <class T>
Grads<T> zero_grads(const Case& c) {
  return {std::vector<T>(c.B * c.T * c.C, T(0)), std::vector<T>(c.OC * c.C, T(0)),
          std::vector<T>(c.OC, T(0))};
}

template <class T>
void run_backward(const cpu& be, Grads<T>& g, const std::vector<T>& dout, const Data<T>& d,
                  const Case& c, bool with_din = true, bool with_dbias = true, bool with_dweight = true,
                  loom::GradientWrite din_write = loom::GradientWrite::accumulate) {
  loom::kernels::matmul_backward<T>(
      be, with_din ? Tensor<T>(g.din.data(), rows_shape(c, c.C)) : Tensor<T>{},
      with_dweight ? Tensor<T>(g.dweight.data(), {c.OC, c.C}) : Tensor<T>{},
      with_dbias ? Tensor<T>(g.dbias.data(), {c.OC}) : Tensor<T>{},
      Tensor<const T>(dout.data(), rows_shape(c, c.OC)), Tensor<const T>(d.in.data(), rows_shape(c, c.C)),
      Tensor<const T>(d.weight.data(), {c.OC, c.C}), din_write);
}

using loom::test::same_values;

//! x in double (bf16 through float, which holds it exactly).
template <class T>
double widen(T x) {
  return static_cast<double>(loom::to_accumulate(x));
}

template <class T>
std::vector<double> reference_forward(const Data<T>& d, const Case& c) {
  const std::int64_t N = c.B * c.T;
  std::vector<double> out(N * c.OC);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t o = 0; o < c.OC; ++o) {
      double acc = c.bias ? widen(d.bias[o]) : 0.0;
      for (std::int64_t i = 0; i < c.C; ++i) acc += widen(d.in[n * c.C + i]) * widen(d.weight[o * c.C + i]);
      out[n * c.OC + o] = acc;
    }
  return out;
}

template <class T>
Grads<double> reference_backward(const std::vector<T>& dout, const Data<T>& d, const Case& c) {
  const std::int64_t N = c.B * c.T;
  Grads<double> g{std::vector<double>(N * c.C, 0.0), std::vector<double>(c.OC * c.C, 0.0),
                  std::vector<double>(c.OC, 0.0)};
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t o = 0; o < c.OC; ++o) {
      const double go = static_cast<double>(dout[n * c.OC + o]);
      g.dbias[o] += go;
      for (std::int64_t i = 0; i < c.C; ++i) {
        g.din[n * c.C + i] += go * static_cast<double>(d.weight[o * c.C + i]);
        g.dweight[o * c.C + i] += go * static_cast<double>(d.in[n * c.C + i]);
      }
    }
  return g;
}

// The last case is large enough for Eigen's blocked, multi-threaded GEMM and the parallel bias sum.
const Case cases[] = {{1, 7, 5, 3, true},   {1, 7, 5, 3, false}, {2, 3, 5, 3, true},
                      {1, 1, 1, 1, true},   {3, 1, 4, 9, true},  {2, 67, 129, 263, true}};

}  // namespace

TEST_CASE_TEMPLATE("matmul_forward matches the plain reference", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.OC);
    CAPTURE(c.bias);
    const auto d = make_data<T>(c, 11);
    const auto ref = reference_forward(d, c);
    CHECK(loom::test::max_relative_error(run_forward(one, d, c), ref, 1.0) <= tolerance<T>());
    CHECK(loom::test::max_relative_error(run_forward(two, d, c), ref, 1.0) <= tolerance<T>());
  }
}

TEST_CASE_TEMPLATE("matmul_forward on up to 8 rows (decoding): each row's bits do not depend on the others or on threads",
                   T, float, double) {
  // C: a tail alone (1), whole chunks of the 8 lanes with and without a tail (15, 16, 17, 100);
  // OC below, at and across the blocks of 8, 4 and 2 weight rows and the 64-column tasks.
  const cpu one(1), two(2);
  for (const std::int64_t C : {1, 15, 16, 17, 100}) {
    for (const std::int64_t OC : {1, 9, 65, 130}) {
      CAPTURE(C);
      CAPTURE(OC);
      const Case all{1, 8, C, OC, true};
      const auto d = make_data<T>(all, 71 + static_cast<std::uint64_t>(C * OC));
      const auto ref = reference_forward(d, all);
      const std::vector<T> full = run_forward(one, d, all);
      CHECK(loom::test::max_relative_error(full, ref, 1.0) <= tolerance<T>());
      CHECK(run_forward(two, d, all) == full);
      // The first N rows alone, N = 1 .. 7, with and without the bias.
      for (std::int64_t N = 1; N < 8; ++N) {
        CAPTURE(N);
        const Case part{1, N, C, OC, true};
        Data<T> rows = d;
        rows.in.resize(static_cast<std::size_t>(N * C));
        const std::vector<T> got = run_forward(two, rows, part);
        CHECK(std::equal(got.begin(), got.end(), full.begin()));
        const Case unbiased{1, N, C, OC, false};
        rows.bias.clear();
        CHECK(loom::test::max_relative_error(run_forward(one, rows, unbiased), reference_forward(rows, unbiased),
                                             1.0) <= tolerance<T>());
      }
    }
  }
}

TEST_CASE_TEMPLATE("matmul_forward with a residual gives matmul_forward then add_to, bit for bit", T, float, double,
                   loom::bf16) {
  // Every path: up to 8 rows (few_rows_forward), the staged bf16 GEMM, the in-place float one;
  // with and without the bias; 1 and 2 threads.
  for (const int threads : {1, 2}) {
    const cpu be(threads);
    for (const Case& c : cases) {
      const std::string bias = c.bias ? "with bias" : "without bias";
      INFO("threads " << threads << ", [" << c.B << ", " << c.T << ", " << c.C << "] x " << c.OC << ", " << bias);
      const auto d = make_data<T>(c, 23);
      const std::vector<T> residual = loom::test::random_vector<T>(c.B * c.T * c.OC, 29);
      std::vector<T> expected = run_forward(be, d, c);
      loom::kernels::add_to<T>(be, Tensor<T>(expected.data(), rows_shape(c, c.OC)),
                               Tensor<const T>(residual.data(), rows_shape(c, c.OC)));
      std::vector<T> got(expected.size(), T(7));
      loom::kernels::matmul_forward<T>(
          be, Tensor<T>(got.data(), rows_shape(c, c.OC)), Tensor<const T>(d.in.data(), rows_shape(c, c.C)),
          Tensor<const T>(d.weight.data(), {c.OC, c.C}),
          c.bias ? Tensor<const T>(d.bias.data(), {c.OC}) : Tensor<const T>{},
          Tensor<const T>(residual.data(), rows_shape(c, c.OC)));
      CHECK(got == expected);
      // And the sum itself, against double loops: the residual is really added. Relative to the
      // sum of the terms' magnitudes (+ 1), as the sum may cancel (bf16: two roundings of 2^-9).
      const std::vector<double> product = reference_forward(d, c);
      double worst = 0;
      for (std::int64_t n = 0; n < c.B * c.T; ++n) {
        for (std::int64_t o = 0; o < c.OC; ++o) {
          const std::size_t j = static_cast<std::size_t>(n * c.OC + o);
          double magnitude = 1 + std::abs(widen(residual[j])) + (c.bias ? std::abs(widen(d.bias[o])) : 0.0);
          for (std::int64_t i = 0; i < c.C; ++i)
            magnitude += std::abs(widen(d.in[n * c.C + i]) * widen(d.weight[o * c.C + i]));
          worst = std::max(worst, std::abs(widen(got[j]) - product[j] - widen(residual[j])) / magnitude);
        }
      }
      CHECK(worst <= (std::is_same_v<T, loom::bf16> ? 1.0 / 256 : tolerance<T>()));
    }
  }
}

TEST_CASE_TEMPLATE("matmul_backward matches the plain reference", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.OC);
    const auto d = make_data<T>({c.B, c.T, c.C, c.OC, true}, 21);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.OC, 24);
    const auto ref = reference_backward(dout, d, c);
    for (const cpu* be : {&one, &two}) {
      CAPTURE(be->threads());
      auto g = zero_grads<T>(c);
      run_backward(*be, g, dout, d, {c.B, c.T, c.C, c.OC, true});
      CHECK(loom::test::max_relative_error(g.din, ref.din, 1.0) <= tolerance<T>());
      CHECK(loom::test::max_relative_error(g.dweight, ref.dweight, 1.0) <= tolerance<T>());
      CHECK(loom::test::max_relative_error(g.dbias, ref.dbias, 1.0) <= tolerance<T>());
    }
  }
}

TEST_CASE("matmul_backward matches central differences (double)") {
  const cpu be(1);
  for (const Case& c : {Case{1, 7, 5, 3, true}, Case{2, 3, 5, 3, true}}) {
    CAPTURE(c.B);
    auto d = make_data<double>(c, 31);
    const auto w = loom::test::random_vector<double>(c.B * c.T * c.OC, 34);
    auto loss = [&] {
      const auto out = run_forward(be, d, c);
      double total = 0;
      for (std::size_t i = 0; i < w.size(); ++i) total += out[i] * w[i];
      return total;
    };
    const auto num_in = loom::test::finite_difference(loss, std::span<double>(d.in));
    const auto num_weight = loom::test::finite_difference(loss, std::span<double>(d.weight));
    const auto num_bias = loom::test::finite_difference(loss, std::span<double>(d.bias));
    auto g = zero_grads<double>(c);
    run_backward(be, g, w, d, c);
    CHECK(loom::test::max_relative_error(g.din, num_in, 1e-2) <= 1e-6);
    CHECK(loom::test::max_relative_error(g.dweight, num_weight, 1e-2) <= 1e-6);
    CHECK(loom::test::max_relative_error(g.dbias, num_bias, 1e-2) <= 1e-6);
  }
}

TEST_CASE_TEMPLATE("matmul_backward accumulates into every gradient", T, float, double) {
  const cpu be(2);
  // Adding into the buffers reassociates sums of O(1) values: compare on an absolute scale of 1.
  const double accumulate_tolerance = sizeof(T) == sizeof(double) ? 1e-13 : 2e-6;
  for (const Case& c : {Case{1, 7, 5, 3, true}, Case{2, 67, 129, 263, true}}) {
    CAPTURE(c.T);
    const auto d = make_data<T>(c, 41);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.OC, 44);
    auto fresh = zero_grads<T>(c);
    run_backward(be, fresh, dout, d, c);
    const Grads<T> prior{loom::test::random_vector<T>(fresh.din.size(), 45),
                         loom::test::random_vector<T>(fresh.dweight.size(), 46),
                         loom::test::random_vector<T>(fresh.dbias.size(), 47)};
    auto accumulated = prior;
    run_backward(be, accumulated, dout, d, c);
    auto expect = [](const std::vector<T>& a, const std::vector<T>& b) {
      std::vector<double> sum(a.size());
      for (std::size_t i = 0; i < a.size(); ++i) sum[i] = static_cast<double>(a[i]) + static_cast<double>(b[i]);
      return sum;
    };
    CHECK(loom::test::max_relative_error(accumulated.din, expect(prior.din, fresh.din), 1.0) <=
          accumulate_tolerance);
    CHECK(loom::test::max_relative_error(accumulated.dweight, expect(prior.dweight, fresh.dweight), 1.0) <=
          accumulate_tolerance);
    CHECK(loom::test::max_relative_error(accumulated.dbias, expect(prior.dbias, fresh.dbias), 1.0) <=
          accumulate_tolerance);
  }
}

TEST_CASE_TEMPLATE("matmul_backward with GradientWrite::overwrite writes din over anything: accumulating into zeros' "
                   "bits",
                   T, float, double, loom::bf16) {
  // Every path (the staged bf16 GEMM; Eigen's coefficient-wise product on small shapes and its
  // blocked GEMM on the last), 1 and 2 threads. din starts as NaN: a read of it would show.
  for (const int threads : {1, 2}) {
    const cpu be(threads);
    for (const Case& c : cases) {
      INFO("threads " << threads << ", [" << c.B << ", " << c.T << ", " << c.C << "] x " << c.OC);
      const auto d = make_data<T>(c, 81);
      const auto dout = loom::test::random_vector<T>(c.B * c.T * c.OC, 82);
      const Grads<T> prior{std::vector<T>(c.B * c.T * c.C, T(0)), loom::test::random_vector<T>(c.OC * c.C, 83),
                           loom::test::random_vector<T>(c.OC, 84)};
      auto accumulated = prior;
      run_backward(be, accumulated, dout, d, c);
      auto written = prior;
      std::fill(written.din.begin(), written.din.end(), T(std::numeric_limits<float>::quiet_NaN()));
      run_backward(be, written, dout, d, c, true, true, true, loom::GradientWrite::overwrite);
      CHECK(same_values(written.din, accumulated.din));
      // dweight and dbias still accumulate (onto random values here).
      CHECK(written.dweight == accumulated.dweight);
      CHECK(written.dbias == accumulated.dbias);
    }
  }
}

TEST_CASE("matmul_backward skips an empty din and dbias") {
  const cpu be(1);
  const Case c{2, 3, 5, 3, true};
  const auto d = make_data<double>(c, 51);
  const auto dout = loom::test::random_vector<double>(c.B * c.T * c.OC, 52);
  auto full = zero_grads<double>(c);
  run_backward(be, full, dout, d, c);
  auto partial = zero_grads<double>(c);
  run_backward(be, partial, dout, d, c, /*with_din=*/false, /*with_dbias=*/false);
  CHECK(partial.dweight == full.dweight);
  for (double x : partial.din) CHECK(x == 0.0);
  for (double x : partial.dbias) CHECK(x == 0.0);
}

TEST_CASE_TEMPLATE("matmul_backward skips an empty dweight; split calls give one call's bits", T, float, double) {
  // An empty dweight (and dbias) is the input-gradient pass of a split backward, an empty din
  // the weight-gradient pass: together they must accumulate exactly what one call does.
  const cpu be(2);
  for (const Case& c : {Case{2, 3, 5, 3, true}, Case{2, 67, 129, 263, true}}) {
    CAPTURE(c.T);
    const auto d = make_data<T>(c, 71);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.OC, 72);
    const Grads<T> prior{loom::test::random_vector<T>(c.B * c.T * c.C, 73),
                         loom::test::random_vector<T>(c.OC * c.C, 74), loom::test::random_vector<T>(c.OC, 75)};
    auto full = prior;
    run_backward(be, full, dout, d, c);
    auto no_weight = prior;
    run_backward(be, no_weight, dout, d, c, /*with_din=*/true, /*with_dbias=*/true, /*with_dweight=*/false);
    CHECK(no_weight.din == full.din);
    CHECK(no_weight.dbias == full.dbias);
    CHECK(no_weight.dweight == prior.dweight);  // untouched
    auto split = prior;
    run_backward(be, split, dout, d, c, /*with_din=*/true, /*with_dbias=*/false, /*with_dweight=*/false);
    CHECK(split.dweight == prior.dweight);
    CHECK(split.dbias == prior.dbias);
    run_backward(be, split, dout, d, c, /*with_din=*/false, /*with_dbias=*/true, /*with_dweight=*/true);
    CHECK(split.din == full.din);
    CHECK(split.dweight == full.dweight);
    CHECK(split.dbias == full.dbias);
    // All three empty: nothing to do, nothing touched.
    auto none = prior;
    run_backward(be, none, dout, d, c, false, false, false);
    CHECK(none.din == prior.din);
    CHECK(none.dweight == prior.dweight);
    CHECK(none.dbias == prior.dbias);
  }
}

TEST_CASE_TEMPLATE("matmul kernels give the same bits on repeated runs with 2 threads", T, float, double) {
  const cpu be(2);
  const Case c{2, 67, 129, 263, true};
  const auto d = make_data<T>(c, 61);
  const auto dout = loom::test::random_vector<T>(c.B * c.T * c.OC, 64);
  CHECK(run_forward(be, d, c) == run_forward(be, d, c));
  auto g1 = zero_grads<T>(c), g2 = zero_grads<T>(c);
  run_backward(be, g1, dout, d, c);
  run_backward(be, g2, dout, d, c);
  CHECK(g1.din == g2.din);
  CHECK(g1.dweight == g2.dweight);
  CHECK(g1.dbias == g2.dbias);
}

TEST_CASE("matmul kernels reject wrong shapes") {
  const cpu be(1);
  const std::int64_t N = 7, C = 5, OC = 3;
  std::vector<float> in(N * C), w(OC * C), b(OC), out(N * OC), din(N * C), dw(OC * C), db(OC),
      dout(N * OC), big(1000);
  using loom::test::expect_error;
  using loom::kernels::matmul_backward;
  using loom::kernels::matmul_forward;
  const Tensor<const float> in_v(in.data(), {N, C}), w_v(w.data(), {OC, C}), b_v(b.data(), {OC});
  const Tensor<float> out_v(out.data(), {N, OC});
  CHECK_NOTHROW(matmul_forward<float>(be, out_v, in_v, w_v, b_v));
  CHECK_THROWS_AS(matmul_forward<float>(be, out_v, in_v, Tensor<const float>(w.data(), {C, OC}), b_v),
                  loom::Error);
  expect_error([&] { matmul_forward<float>(be, out_v, in_v, Tensor<const float>(w.data(), {C, OC}), b_v); },
               "matmul_forward: argument weight");
  expect_error([&] { matmul_forward<float>(be, out_v, in_v, Tensor<const float>(w.data(), {OC * C}), b_v); },
               "matmul_forward: argument weight");
  expect_error([&] { matmul_forward<float>(be, Tensor<float>(big.data(), {N + 1, OC}), in_v, w_v, b_v); },
               "matmul_forward: argument out");
  expect_error([&] { matmul_forward<float>(be, Tensor<float>(big.data(), {N, OC + 1}), in_v, w_v, b_v); },
               "matmul_forward: argument out");
  expect_error([&] { matmul_forward<float>(be, out_v, in_v, w_v, Tensor<const float>(big.data(), {OC + 1})); },
               "matmul_forward: argument bias");
  expect_error([&] { matmul_forward<float>(be, out_v, in_v, w_v, b_v, Tensor<const float>(big.data(), {N, OC + 1})); },
               "matmul_forward: argument residual shape: got [7, 4]; expected 7 rows of 3");
  expect_error([&] { matmul_forward<float>(be, out_v, in_v, w_v, b_v, Tensor<const float>(out_v)); },
               "matmul_forward: argument residual: got out itself; a tensor other than out");

  const Tensor<const float> dout_v(dout.data(), {N, OC});
  const Tensor<float> din_v(din.data(), {N, C}), dw_v(dw.data(), {OC, C}), db_v(db.data(), {OC});
  CHECK_NOTHROW(matmul_backward<float>(be, din_v, dw_v, db_v, dout_v, in_v, w_v));
  expect_error([&] { matmul_backward<float>(be, Tensor<float>(big.data(), {N, C + 1}), dw_v, db_v, dout_v, in_v, w_v); },
               "matmul_backward: argument din");
  expect_error([&] { matmul_backward<float>(be, din_v, Tensor<float>(big.data(), {C, OC}), db_v, dout_v, in_v, w_v); },
               "matmul_backward: argument dweight");
  expect_error([&] { matmul_backward<float>(be, din_v, dw_v, Tensor<float>(big.data(), {C}), dout_v, in_v, w_v); },
               "matmul_backward: argument dbias");
  expect_error([&] {
    matmul_backward<float>(be, din_v, dw_v, db_v, Tensor<const float>(big.data(), {N - 1, OC}), in_v, w_v);
  }, "matmul_backward: argument dout");
  expect_error([&] {
    matmul_backward<float>(be, din_v, dw_v, db_v, dout_v, in_v, Tensor<const float>(big.data(), {OC, C + 1}));
  }, "matmul_backward: argument weight");
}

}  // namespace test_kernel_matmul
