// LayerNorm kernels: forward and backward against plain two-pass loops, backward against central
// differences, the accumulate convention, the backward's residual and overwrite, shape checks and
// thread-count determinism.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "loom/backend/cpu/elementwise.hpp"
#include "loom/backend/cpu/layernorm.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_layernorm {

namespace {

using loom::Shape;
using loom::Tensor;
using loom::cpu;

struct Case {
  std::int64_t B, T, C;  // in [B,T,C]
  double offset;         // added to every input: the row statistics must not cancel
};

constexpr double eps = 1e-5;

using loom::test::tolerance;

template <class T>
struct Data {
  std::vector<T> in, weight, bias;
};

template <class T>
Data<T> make_data(const Case& c, std::uint64_t seed) {
  return {loom::test::random_vector<T>(c.B * c.T * c.C, seed, c.offset - 1.0, c.offset + 1.0),
          loom::test::random_vector<T>(c.C, seed + 1, 0.5, 1.5), loom::test::random_vector<T>(c.C, seed + 2)};
}

template <class T>
struct Forward {
  std::vector<T> out, mean, rstd;
};

template <class T>
Forward<T> run_forward(const cpu& be, const Data<T>& d, const Case& c) {
  const std::int64_t N = c.B * c.T;
  Forward<T> f{std::vector<T>(N * c.C, T(7)), std::vector<T>(N, T(7)), std::vector<T>(N, T(7))};
  loom::kernels::layernorm_forward<T>(be, Tensor<T>(f.out.data(), {c.B, c.T, c.C}),
                                      Tensor<T>(f.mean.data(), {c.B, c.T}), Tensor<T>(f.rstd.data(), {N}),
                                      Tensor<const T>(d.in.data(), {c.B, c.T, c.C}),
                                      Tensor<const T>(d.weight.data(), {c.C}),
                                      Tensor<const T>(d.bias.data(), {c.C}), T(eps));
  return f;
}

template <class T>
struct Grads {
  std::vector<T> din, dweight, dbias;
};

template <class T>
Grads<T> zero_grads(const Case& c) {
  return {std::vector<T>(c.B * c.T * c.C, T(0)), std::vector<T>(c.C, T(0)), std::vector<T>(c.C, T(0))};
}

template <class T>
void run_backward(const cpu& be, Grads<T>& g, const std::vector<T>& dout, const Data<T>& d,
                  const Forward<T>& f, const Case& c) {
  const std::int64_t N = c.B * c.T;
  // din as [N, C] while in is [B, T, C]: only rows and columns must agree.
  loom::kernels::layernorm_backward<T>(
      be, Tensor<T>(g.din.data(), {N, c.C}), Tensor<T>(g.dweight.data(), {c.C}),
      Tensor<T>(g.dbias.data(), {c.C}), Tensor<const T>(dout.data(), {c.B, c.T, c.C}),
      Tensor<const T>(d.in.data(), {c.B, c.T, c.C}), Tensor<const T>(d.weight.data(), {c.C}),
      Tensor<const T>(f.mean.data(), {N}), Tensor<const T>(f.rstd.data(), {N}));
}

//! Two-pass statistics and the normalised output in double.
template <class T>
Forward<double> reference_forward(const Data<T>& d, const Case& c) {
  const std::int64_t N = c.B * c.T;
  Forward<double> f{std::vector<double>(N * c.C), std::vector<double>(N), std::vector<double>(N)};
  for (std::int64_t n = 0; n < N; ++n) {
    double mean = 0;
    for (std::int64_t i = 0; i < c.C; ++i) mean += static_cast<double>(d.in[n * c.C + i]);
    mean /= static_cast<double>(c.C);
    double var = 0;
    for (std::int64_t i = 0; i < c.C; ++i) {
      const double x = static_cast<double>(d.in[n * c.C + i]) - mean;
      var += x * x;
    }
    var /= static_cast<double>(c.C);
    const double rstd = 1.0 / std::sqrt(var + eps);
    f.mean[n] = mean;
    f.rstd[n] = rstd;
    for (std::int64_t i = 0; i < c.C; ++i)
      f.out[n * c.C + i] = (static_cast<double>(d.in[n * c.C + i]) - mean) * rstd *
                               static_cast<double>(d.weight[i]) +
                           static_cast<double>(d.bias[i]);
  }
  return f;
}

//! The textbook backward in double from the reference statistics.
template <class T>
Grads<double> reference_backward(const std::vector<T>& dout, const Data<T>& d, const Case& c) {
  const std::int64_t N = c.B * c.T;
  const auto f = reference_forward(d, c);
  Grads<double> g{std::vector<double>(N * c.C, 0.0), std::vector<double>(c.C, 0.0),
                  std::vector<double>(c.C, 0.0)};
  for (std::int64_t n = 0; n < N; ++n) {
    std::vector<double> norm(c.C), dnorm(c.C);
    double mean_dnorm = 0, mean_dnorm_norm = 0;
    for (std::int64_t i = 0; i < c.C; ++i) {
      const double go = static_cast<double>(dout[n * c.C + i]);
      norm[i] = (static_cast<double>(d.in[n * c.C + i]) - f.mean[n]) * f.rstd[n];
      dnorm[i] = static_cast<double>(d.weight[i]) * go;
      g.dweight[i] += norm[i] * go;
      g.dbias[i] += go;
      mean_dnorm += dnorm[i] / static_cast<double>(c.C);
      mean_dnorm_norm += dnorm[i] * norm[i] / static_cast<double>(c.C);
    }
    for (std::int64_t i = 0; i < c.C; ++i)
      g.din[n * c.C + i] = (dnorm[i] - mean_dnorm - norm[i] * mean_dnorm_norm) * f.rstd[n];
  }
  return g;
}

// The last case is above the kernel's threshold for threads and spans several column blocks.
const Case cases[] = {{1, 7, 5, 0.0}, {2, 3, 5, 0.0}, {2, 3, 5, 10.0}, {1, 1, 1, 0.0},
                      {1, 2, 2, 0.0}, {2, 67, 129, 0.0}};

}  // namespace

TEST_CASE_TEMPLATE("layernorm_forward matches the plain two-pass reference", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.offset);
    const auto d = make_data<T>(c, 11);
    const auto ref = reference_forward(d, c);
    for (const cpu* be : {&one, &two}) {
      CAPTURE(be->threads());
      const auto f = run_forward(*be, d, c);
      // Outputs and the mean are O(1) (or O(offset)); rstd is compared relative to itself.
      CHECK(loom::test::max_relative_error(f.out, ref.out, 1.0) <= tolerance<T>());
      CHECK(loom::test::max_relative_error(f.mean, ref.mean, 1.0) <= tolerance<T>());
      CHECK(loom::test::max_relative_error(f.rstd, ref.rstd) <= tolerance<T>());
    }
  }
}

TEST_CASE("layernorm_forward of a constant row gives the bias") {
  const cpu be(1);
  const Case c{1, 2, 4, 0.0};
  Data<double> d{std::vector<double>(8, 3.25), {1.0, 2.0, 3.0, 4.0}, {0.5, -0.5, 1.5, -1.5}};
  const auto f = run_forward(be, d, c);
  for (std::int64_t n = 0; n < 2; ++n) {
    CHECK(f.mean[n] == 3.25);
    CHECK(f.rstd[n] == doctest::Approx(1.0 / std::sqrt(eps)).epsilon(1e-15));
    for (std::int64_t i = 0; i < 4; ++i) CHECK(f.out[n * 4 + i] == d.bias[i]);
  }
}

TEST_CASE_TEMPLATE("layernorm_backward matches the plain reference", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.B);
    CAPTURE(c.T);
    CAPTURE(c.C);
    CAPTURE(c.offset);
    const auto d = make_data<T>(c, 21);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 24);
    const auto ref = reference_backward(dout, d, c);
    for (const cpu* be : {&one, &two}) {
      CAPTURE(be->threads());
      const auto f = run_forward(*be, d, c);
      auto g = zero_grads<T>(c);
      run_backward(*be, g, dout, d, f, c);
      // din is rstd times an O(1) mix (rstd ~ 1.7 here); float error grows with the offset,
      // which the stored float mean carries.
      const double scale = sizeof(T) == sizeof(double) ? 1.0 : 1.0 + c.offset;
      CHECK(loom::test::max_relative_error(g.din, ref.din, 1.0) <= scale * tolerance<T>());
      CHECK(loom::test::max_relative_error(g.dweight, ref.dweight, 1.0) <= scale * tolerance<T>());
      CHECK(loom::test::max_relative_error(g.dbias, ref.dbias, 1.0) <= tolerance<T>());
    }
  }
}

TEST_CASE("layernorm_backward matches central differences (double)") {
  const cpu be(1);
  for (const Case& c : {Case{1, 7, 5, 0.0}, Case{2, 3, 5, 0.0}, Case{2, 3, 5, 10.0}}) {
    CAPTURE(c.B);
    CAPTURE(c.offset);
    auto d = make_data<double>(c, 31);
    const auto w = loom::test::random_vector<double>(c.B * c.T * c.C, 34);
    auto loss = [&] {
      const auto f = run_forward(be, d, c);
      double total = 0;
      for (std::size_t i = 0; i < w.size(); ++i) total += f.out[i] * w[i];
      return total;
    };
    const auto num_in = loom::test::finite_difference(loss, std::span<double>(d.in));
    const auto num_weight = loom::test::finite_difference(loss, std::span<double>(d.weight));
    const auto num_bias = loom::test::finite_difference(loss, std::span<double>(d.bias));
    const auto f = run_forward(be, d, c);
    auto g = zero_grads<double>(c);
    run_backward(be, g, w, d, f, c);
    CHECK(loom::test::max_relative_error(g.din, num_in, 1e-2) <= 1e-6);
    CHECK(loom::test::max_relative_error(g.dweight, num_weight, 1e-2) <= 1e-6);
    CHECK(loom::test::max_relative_error(g.dbias, num_bias, 1e-2) <= 1e-6);
  }
}

TEST_CASE_TEMPLATE("layernorm_backward accumulates into every gradient", T, float, double) {
  const cpu be(2);
  const double accumulate_tolerance = sizeof(T) == sizeof(double) ? 1e-13 : 2e-6;
  for (const Case& c : {Case{1, 7, 5, 0.0}, Case{2, 67, 129, 0.0}}) {
    CAPTURE(c.T);
    const auto d = make_data<T>(c, 41);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 44);
    const auto f = run_forward(be, d, c);
    auto fresh = zero_grads<T>(c);
    run_backward(be, fresh, dout, d, f, c);
    const Grads<T> prior{loom::test::random_vector<T>(fresh.din.size(), 45),
                         loom::test::random_vector<T>(fresh.dweight.size(), 46),
                         loom::test::random_vector<T>(fresh.dbias.size(), 47)};
    auto accumulated = prior;
    run_backward(be, accumulated, dout, d, f, c);
    auto expect = [](const std::vector<T>& a, const std::vector<T>& b) {
      std::vector<double> sum(a.size());
      for (std::size_t i = 0; i < a.size(); ++i) sum[i] = static_cast<double>(a[i]) + static_cast<double>(b[i]);
      return sum;
    };
    // dweight and dbias sum many rows: their scale is that of the sum.
    const double param_scale = c.T > 7 ? 30.0 : 1.0;
    CHECK(loom::test::max_relative_error(accumulated.din, expect(prior.din, fresh.din), 1.0) <=
          accumulate_tolerance);
    CHECK(loom::test::max_relative_error(accumulated.dweight, expect(prior.dweight, fresh.dweight), param_scale) <=
          accumulate_tolerance);
    CHECK(loom::test::max_relative_error(accumulated.dbias, expect(prior.dbias, fresh.dbias), param_scale) <=
          accumulate_tolerance);
  }
}

namespace {

//! The backward in every form on `T` (float, double or bf16, whose statistics are float): din
//! from `din0`, optionally a residual and overwrite; returns din, dweight, dbias (both from prior
//! values 0.25).
template <class T>
struct ResidualRun {
  const cpu& be;
  const Case& c;
  std::vector<T> in, weight, bias, dout, residual;
  std::vector<loom::accumulate_t<T>> mean, rstd;

  ResidualRun(const cpu& b, const Case& k, std::uint64_t seed) : be(b), c(k) {
    const std::int64_t N = c.B * c.T;
    in = loom::test::random_vector<T>(N * c.C, seed, -1.0, 1.0);
    weight = loom::test::random_vector<T>(c.C, seed + 1, 0.5, 1.5);
    bias = loom::test::random_vector<T>(c.C, seed + 2);
    dout = loom::test::random_vector<T>(N * c.C, seed + 3);
    residual = loom::test::random_vector<T>(N * c.C, seed + 4, -4.0, 4.0);
    mean.resize(N);
    rstd.resize(N);
    std::vector<T> out(N * c.C);
    using A = loom::accumulate_t<T>;
    loom::kernels::layernorm_forward<T>(be, Tensor<T>(out.data(), {N, c.C}), Tensor<A>(mean.data(), {N}),
                                        Tensor<A>(rstd.data(), {N}), Tensor<const T>(in.data(), {N, c.C}),
                                        Tensor<const T>(weight.data(), {c.C}), Tensor<const T>(bias.data(), {c.C}));
  }
  Grads<T> operator()(std::vector<T> din0, bool with_residual, loom::GradientWrite write) const {
    const std::int64_t N = c.B * c.T;
    Grads<T> g{std::move(din0), std::vector<T>(c.C, T(0.25f)), std::vector<T>(c.C, T(0.25f))};
    loom::kernels::layernorm_backward<T>(
        be, Tensor<T>(g.din.data(), {N, c.C}), Tensor<T>(g.dweight.data(), {c.C}), Tensor<T>(g.dbias.data(), {c.C}),
        Tensor<const T>(dout.data(), {N, c.C}), Tensor<const T>(in.data(), {N, c.C}),
        Tensor<const T>(weight.data(), {c.C}), Tensor<const loom::accumulate_t<T>>(mean.data(), {N}),
        Tensor<const loom::accumulate_t<T>>(rstd.data(), {N}),
        with_residual ? Tensor<const T>(residual.data(), {N, c.C}) : Tensor<const T>{}, write);
    return g;
  }
};

}  // namespace

using loom::test::same_values;

TEST_CASE_TEMPLATE("layernorm_backward's residual and overwrite give the bits of copy or add_to, then the backward",
                   T, float, double, loom::bf16) {
  using loom::GradientWrite;
  const T nan(std::numeric_limits<float>::quiet_NaN());
  for (const int threads : {1, 2}) {
    const cpu be(threads);
    for (const Case& c : cases) {
      INFO("threads " << threads << ", [" << c.B << ", " << c.T << ", " << c.C << "]");
      const ResidualRun<T> run(be, c, 91);
      const std::size_t n = run.dout.size();
      const std::vector<T> zeros(n, T(0.0f)), garbage(n, nan);
      const Grads<T> plain = run(zeros, false, GradientWrite::accumulate);
      // Overwrite: din never read (NaN), the bits of accumulating into zeros.
      const Grads<T> written = run(garbage, false, GradientWrite::overwrite);
      CHECK(same_values(written.din, plain.din));
      CHECK(written.dweight == plain.dweight);
      CHECK(written.dbias == plain.dbias);
      // Overwrite with a residual: the bits of copying the residual into din, then accumulating.
      const Grads<T> copied = run(run.residual, false, GradientWrite::accumulate);
      const Grads<T> residual_written = run(garbage, true, GradientWrite::overwrite);
      CHECK(same_values(residual_written.din, copied.din));
      CHECK(residual_written.dweight == plain.dweight);
      // Accumulate with a residual into zeros (a model's input gradient): add_to's bits, then the
      // backward's.
      std::vector<T> added = zeros;
      loom::kernels::add_to<T>(be, Tensor<T>(added.data(), {static_cast<std::int64_t>(n)}),
                               Tensor<const T>(run.residual.data(), {static_cast<std::int64_t>(n)}));
      CHECK(same_values(run(zeros, true, GradientWrite::accumulate).din,
                        run(added, false, GradientWrite::accumulate).din));
      // Onto a nonzero din, in double: din0 + residual + the change.
      const std::vector<T> prior = loom::test::random_vector<T>(n, 95);
      const Grads<T> onto = run(prior, true, GradientWrite::accumulate);
      double worst = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const double want = static_cast<double>(loom::to_accumulate(prior[i])) +
                            static_cast<double>(loom::to_accumulate(run.residual[i])) +
                            static_cast<double>(loom::to_accumulate(plain.din[i]));
        worst = std::max(worst, std::abs(static_cast<double>(loom::to_accumulate(onto.din[i])) - want) /
                                    (1 + std::abs(want)));
      }
      CHECK(worst <= (std::is_same_v<T, loom::bf16> ? 1.0 / 128 : 10 * tolerance<T>()));
    }
  }
}

TEST_CASE_TEMPLATE("layernorm kernels give the same bits on 1 and 2 threads", T, float, double) {
  const cpu one(1), two(2);
  const Case c{2, 67, 129, 0.0};
  const auto d = make_data<T>(c, 61);
  const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 64);
  const auto f1 = run_forward(one, d, c), f2 = run_forward(two, d, c);
  CHECK(f1.out == f2.out);
  CHECK(f1.mean == f2.mean);
  CHECK(f1.rstd == f2.rstd);
  auto g1 = zero_grads<T>(c), g2 = zero_grads<T>(c);
  run_backward(one, g1, dout, d, f1, c);
  run_backward(two, g2, dout, d, f2, c);
  CHECK(g1.din == g2.din);
  CHECK(g1.dweight == g2.dweight);
  CHECK(g1.dbias == g2.dbias);
}

TEST_CASE("layernorm kernels reject wrong shapes") {
  const cpu be(1);
  const std::int64_t N = 7, C = 5;
  std::vector<float> in(N * C, 0.5f), w(C, 1.0f), b(C), out(N * C), mean(N), rstd(N), big(1000);
  using loom::test::expect_error;
  using loom::kernels::layernorm_backward;
  using loom::kernels::layernorm_forward;
  const Tensor<const float> in_v(in.data(), {N, C}), w_v(w.data(), {C}), b_v(b.data(), {C});
  const Tensor<float> out_v(out.data(), {N, C}), mean_v(mean.data(), {N}), rstd_v(rstd.data(), {N});
  CHECK_NOTHROW(layernorm_forward<float>(be, out_v, mean_v, rstd_v, in_v, w_v, b_v));
  CHECK_THROWS_AS(layernorm_forward<float>(be, Tensor<float>(big.data(), {N, C + 1}), mean_v, rstd_v, in_v, w_v, b_v),
                  loom::Error);
  expect_error([&] { layernorm_forward<float>(be, Tensor<float>(big.data(), {C, N}), mean_v, rstd_v, in_v, w_v, b_v); },
               "layernorm_forward: argument out");
  expect_error([&] { layernorm_forward<float>(be, out_v, Tensor<float>(big.data(), {N + 1}), rstd_v, in_v, w_v, b_v); },
               "layernorm_forward: argument mean");
  expect_error([&] { layernorm_forward<float>(be, out_v, mean_v, Tensor<float>(big.data(), {N - 1}), in_v, w_v, b_v); },
               "layernorm_forward: argument rstd");
  expect_error([&] { layernorm_forward<float>(be, out_v, mean_v, rstd_v, in_v, Tensor<const float>(big.data(), {N}), b_v); },
               "layernorm_forward: argument weight");
  expect_error([&] { layernorm_forward<float>(be, out_v, mean_v, rstd_v, in_v, w_v, Tensor<const float>(big.data(), {1, C})); },
               "layernorm_forward: argument bias");

  std::vector<float> din(N * C), dw(C), db(C), dout(N * C);
  const Tensor<float> din_v(din.data(), {N, C}), dw_v(dw.data(), {C}), db_v(db.data(), {C});
  const Tensor<const float> dout_v(dout.data(), {N, C});
  CHECK_NOTHROW(layernorm_backward<float>(be, din_v, dw_v, db_v, dout_v, in_v, w_v, mean_v, rstd_v));
  expect_error([&] { layernorm_backward<float>(be, Tensor<float>(big.data(), {N + 1, C}), dw_v, db_v, dout_v, in_v, w_v, mean_v, rstd_v); },
               "layernorm_backward: argument din");
  expect_error([&] { layernorm_backward<float>(be, din_v, Tensor<float>(big.data(), {C + 1}), db_v, dout_v, in_v, w_v, mean_v, rstd_v); },
               "layernorm_backward: argument dweight");
  expect_error([&] { layernorm_backward<float>(be, din_v, dw_v, Tensor<float>(big.data(), {C - 1}), dout_v, in_v, w_v, mean_v, rstd_v); },
               "layernorm_backward: argument dbias");
  expect_error([&] { layernorm_backward<float>(be, din_v, dw_v, db_v, Tensor<const float>(big.data(), {N, C - 1}), in_v, w_v, mean_v, rstd_v); },
               "layernorm_backward: argument dout");
  expect_error([&] { layernorm_backward<float>(be, din_v, dw_v, db_v, dout_v, in_v, Tensor<const float>(big.data(), {2 * C}), mean_v, rstd_v); },
               "layernorm_backward: argument weight");
  expect_error([&] { layernorm_backward<float>(be, din_v, dw_v, db_v, dout_v, in_v, w_v, Tensor<const float>(big.data(), {2}), rstd_v); },
               "layernorm_backward: argument mean");
  expect_error([&] { layernorm_backward<float>(be, din_v, dw_v, db_v, dout_v, in_v, w_v, mean_v, Tensor<const float>(big.data(), {2})); },
               "layernorm_backward: argument rstd");
  const Tensor<const float> wide(big.data(), {N, C + 1});
  expect_error([&] { layernorm_backward<float>(be, din_v, dw_v, db_v, dout_v, in_v, w_v, mean_v, rstd_v, wide); },
               "layernorm_backward: argument residual");
  expect_error([&] { layernorm_backward<float>(be, din_v, dw_v, db_v, dout_v, in_v, w_v, mean_v, rstd_v, din_v); },
               "layernorm_backward: argument residual: got din itself; a tensor other than din");
}

}  // namespace test_kernel_layernorm
