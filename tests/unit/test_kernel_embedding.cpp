// Embedding kernels: forward and backward against plain loops, backward against central
// differences, the accumulate convention, token and shape checks, thread-count determinism.

#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "loom/backend/cpu/embedding.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_embedding {

namespace {

using loom::Tensor;
using loom::cpu;

struct Case {
  std::int64_t B, T, C, V, maxT;
};
// The last case is above the kernel's threshold for threads and spans three channel blocks; its
// small vocabulary makes many positions share a token row.
const Case cases[] = {{2, 3, 5, 11, 4}, {1, 7, 5, 3, 7}, {1, 1, 1, 1, 1}, {4, 33, 130, 7, 40}};

template <class T>
struct Data {
  std::vector<std::int32_t> tokens;
  std::vector<T> wte, wpe;
};

template <class T>
Data<T> make_data(const Case& c, std::uint64_t seed) {
  Data<T> d{std::vector<std::int32_t>(c.B * c.T), loom::test::random_vector<T>(c.V * c.C, seed + 1),
            loom::test::random_vector<T>(c.maxT * c.C, seed + 2)};
  const auto u = loom::test::random_vector<double>(d.tokens.size(), seed, 0.0, 1.0);
  for (std::size_t i = 0; i < u.size(); ++i) d.tokens[i] = static_cast<std::int32_t>(u[i] * c.V);
  // The last vocabulary row appears at least once.
  d.tokens.back() = static_cast<std::int32_t>(c.V - 1);
  return d;
}

template <class T>
std::vector<T> run_forward(const cpu& be, const Data<T>& d, const Case& c) {
  std::vector<T> out(c.B * c.T * c.C, T(7));
  loom::kernels::embedding_forward<T>(be, Tensor<T>(out.data(), {c.B, c.T, c.C}),
                                      Tensor<const std::int32_t>(d.tokens.data(), {c.B, c.T}),
                                      Tensor<const T>(d.wte.data(), {c.V, c.C}),
                                      Tensor<const T>(d.wpe.data(), {c.maxT, c.C}));
  return out;
}

template <class T>
void run_backward(const cpu& be, std::vector<T>& dwte, std::vector<T>& dwpe, const std::vector<T>& dout,
                  const Data<T>& d, const Case& c) {
  loom::kernels::embedding_backward<T>(be, Tensor<T>(dwte.data(), {c.V, c.C}), Tensor<T>(dwpe.data(), {c.maxT, c.C}),
                                       Tensor<const T>(dout.data(), {c.B, c.T, c.C}),
                                       Tensor<const std::int32_t>(d.tokens.data(), {c.B, c.T}));
}

using loom::test::tolerance;

using loom::test::expect_error;

}  // namespace

TEST_CASE_TEMPLATE("embedding_forward matches the plain lookup", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.T);
    CAPTURE(c.C);
    const auto d = make_data<T>(c, 11);
    std::vector<T> ref(c.B * c.T * c.C);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t t = 0; t < c.T; ++t)
        for (std::int64_t i = 0; i < c.C; ++i)
          ref[(b * c.T + t) * c.C + i] = d.wte[d.tokens[b * c.T + t] * c.C + i] + d.wpe[t * c.C + i];
    CHECK(run_forward(one, d, c) == ref);  // one rounding in T: the same bits
    CHECK(run_forward(two, d, c) == ref);
  }
}

TEST_CASE_TEMPLATE("embedding_backward matches the plain scatter", T, float, double) {
  const cpu one(1), two(2);
  for (const Case& c : cases) {
    CAPTURE(c.T);
    CAPTURE(c.C);
    const auto d = make_data<T>(c, 21);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 24);
    std::vector<double> ref_wte(c.V * c.C, 0.0), ref_wpe(c.maxT * c.C, 0.0);
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t t = 0; t < c.T; ++t)
        for (std::int64_t i = 0; i < c.C; ++i) {
          const double g = static_cast<double>(dout[(b * c.T + t) * c.C + i]);
          ref_wte[d.tokens[b * c.T + t] * c.C + i] += g;
          ref_wpe[t * c.C + i] += g;
        }
    for (const cpu* be : {&one, &two}) {
      CAPTURE(be->threads());
      std::vector<T> dwte(ref_wte.size(), T(0)), dwpe(ref_wpe.size(), T(0));
      run_backward(*be, dwte, dwpe, dout, d, c);
      // Rows sum up to B*T values of O(1): compare on a scale of 10.
      CHECK(loom::test::max_relative_error(dwte, ref_wte, 10.0) <= tolerance<T>());
      CHECK(loom::test::max_relative_error(dwpe, ref_wpe, 10.0) <= tolerance<T>());
      // Positions beyond T get nothing.
      for (std::int64_t i = c.T * c.C; i < c.maxT * c.C; ++i) REQUIRE(dwpe[i] == T(0));
    }
  }
}

TEST_CASE("embedding_backward matches central differences (double)") {
  const cpu be(1);
  const Case c{2, 3, 5, 4, 4};
  auto d = make_data<double>(c, 31);
  d.tokens = {3, 1, 3, 0, 3, 1};  // repeated tokens; row 2 unused
  const auto w = loom::test::random_vector<double>(c.B * c.T * c.C, 34);
  auto loss = [&] {
    const auto out = run_forward(be, d, c);
    double total = 0;
    for (std::size_t i = 0; i < w.size(); ++i) total += out[i] * w[i];
    return total;
  };
  const auto num_wte = loom::test::finite_difference(loss, std::span<double>(d.wte));
  const auto num_wpe = loom::test::finite_difference(loss, std::span<double>(d.wpe));
  std::vector<double> dwte(d.wte.size(), 0.0), dwpe(d.wpe.size(), 0.0);
  run_backward(be, dwte, dwpe, w, d, c);
  CHECK(loom::test::max_relative_error(dwte, num_wte, 1e-2) <= 1e-6);
  CHECK(loom::test::max_relative_error(dwpe, num_wpe, 1e-2) <= 1e-6);
}

TEST_CASE_TEMPLATE("embedding_backward accumulates into dwte and dwpe", T, float, double) {
  const cpu be(2);
  for (const Case& c : cases) {
    CAPTURE(c.T);
    const auto d = make_data<T>(c, 41);
    const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 44);
    std::vector<T> fresh_wte(c.V * c.C, T(0)), fresh_wpe(c.maxT * c.C, T(0));
    run_backward(be, fresh_wte, fresh_wpe, dout, d, c);
    const auto prior_wte = loom::test::random_vector<T>(fresh_wte.size(), 45);
    const auto prior_wpe = loom::test::random_vector<T>(fresh_wpe.size(), 46);
    auto wte = prior_wte, wpe = prior_wpe;
    run_backward(be, wte, wpe, dout, d, c);
    std::vector<double> expect_wte(wte.size()), expect_wpe(wpe.size());
    for (std::size_t i = 0; i < wte.size(); ++i)
      expect_wte[i] = static_cast<double>(prior_wte[i]) + static_cast<double>(fresh_wte[i]);
    for (std::size_t i = 0; i < wpe.size(); ++i)
      expect_wpe[i] = static_cast<double>(prior_wpe[i]) + static_cast<double>(fresh_wpe[i]);
    const double accumulate_tolerance = sizeof(T) == sizeof(double) ? 1e-14 : 1e-6;
    CHECK(loom::test::max_relative_error(wte, expect_wte, 10.0) <= accumulate_tolerance);
    CHECK(loom::test::max_relative_error(wpe, expect_wpe, 10.0) <= accumulate_tolerance);
  }
}

TEST_CASE_TEMPLATE("embedding_backward gives the same bits on 1 and 2 threads", T, float, double) {
  const cpu one(1), two(2);
  const Case c = cases[3];
  const auto d = make_data<T>(c, 51);
  const auto dout = loom::test::random_vector<T>(c.B * c.T * c.C, 52);
  std::vector<T> wte1(c.V * c.C, T(0)), wpe1(c.maxT * c.C, T(0));
  auto wte2 = wte1, wpe2 = wpe1;
  run_backward(one, wte1, wpe1, dout, d, c);
  run_backward(two, wte2, wpe2, dout, d, c);
  CHECK(wte1 == wte2);
  CHECK(wpe1 == wpe2);
}

TEST_CASE("embedding kernels reject a bad token, naming its position and value") {
  const cpu be(1);
  const Case c{2, 3, 5, 11, 4};
  auto d = make_data<float>(c, 61);
  std::vector<float> out(c.B * c.T * c.C), dwte(d.wte.size()), dwpe(d.wpe.size());
  const std::vector<float> dout(out.size(), 1.0f);
  d.tokens[1 * c.T + 2] = 11;  // one past the last row
  CHECK_THROWS_AS(run_forward(be, d, c), loom::Error);
  expect_error([&] { run_forward(be, d, c); }, "embedding_forward: token at tokens[1, 2]: got 11");
  expect_error([&] { run_forward(be, d, c); }, "must be in [0, 11)");
  expect_error([&] { run_backward(be, dwte, dwpe, dout, d, c); }, "embedding_backward: token at tokens[1, 2]: got 11");
  d.tokens[1 * c.T + 2] = 0;
  d.tokens[0 * c.T + 1] = -3;
  expect_error([&] { run_forward(be, d, c); }, "tokens[0, 1]: got -3");
  expect_error([&] { run_backward(be, dwte, dwpe, dout, d, c); }, "tokens[0, 1]: got -3");
  // A rejected backward leaves the gradients untouched.
  for (float x : dwte) CHECK(x == 0.0f);
  for (float x : dwpe) CHECK(x == 0.0f);
}

TEST_CASE("embedding kernels reject wrong shapes and sequences longer than wpe") {
  const cpu be(1);
  const std::int64_t B = 2, T = 3, C = 5, V = 11, maxT = 4;
  std::vector<std::int32_t> tokens(16, 1);
  std::vector<float> wte(V * C), wpe(maxT * C), out(B * T * C), big(1000);
  using loom::kernels::embedding_backward;
  using loom::kernels::embedding_forward;
  const Tensor<const std::int32_t> tok(tokens.data(), {B, T});
  const Tensor<const float> wte_v(wte.data(), {V, C}), wpe_v(wpe.data(), {maxT, C});
  const Tensor<float> out_v(out.data(), {B, T, C});
  CHECK_NOTHROW(embedding_forward<float>(be, out_v, tok, wte_v, wpe_v));
  CHECK_THROWS_AS(embedding_forward<float>(be, Tensor<float>(out.data(), {B * T, C}), tok, wte_v, wpe_v), loom::Error);
  expect_error([&] { embedding_forward<float>(be, Tensor<float>(out.data(), {B * T, C}), tok, wte_v, wpe_v); },
               "embedding_forward: argument out");
  expect_error([&] { embedding_forward<float>(be, out_v, Tensor<const std::int32_t>(tokens.data(), {B * T}), wte_v, wpe_v); },
               "embedding_forward: argument tokens");
  expect_error([&] { embedding_forward<float>(be, out_v, tok, wte_v, Tensor<const float>(big.data(), {maxT, C + 1})); },
               "embedding_forward: argument wpe");
  expect_error([&] { embedding_forward<float>(be, out_v, tok, Tensor<const float>(wte.data(), {V * C}), wpe_v); },
               "embedding_forward: argument wte");
  expect_error([&] {
    embedding_forward<float>(be, Tensor<float>(big.data(), {B, 5, C}), Tensor<const std::int32_t>(tokens.data(), {B, 5}),
                             wte_v, wpe_v);
  }, "must be <= the rows of wpe (4)");

  std::vector<float> dwte(V * C), dwpe(maxT * C), dout(B * T * C);
  const Tensor<float> dwte_v(dwte.data(), {V, C}), dwpe_v(dwpe.data(), {maxT, C});
  const Tensor<const float> dout_v(dout.data(), {B, T, C});
  CHECK_NOTHROW(embedding_backward<float>(be, dwte_v, dwpe_v, dout_v, tok));
  expect_error([&] { embedding_backward<float>(be, dwte_v, dwpe_v, Tensor<const float>(big.data(), {B, T, C + 1}), tok); },
               "embedding_backward: argument dout");
  expect_error([&] { embedding_backward<float>(be, dwte_v, Tensor<float>(big.data(), {maxT, C - 1}), dout_v, tok); },
               "embedding_backward: argument dwpe");
  expect_error([&] { embedding_backward<float>(be, Tensor<float>(big.data(), {V, C, 1}), dwpe_v, dout_v, tok); },
               "embedding_backward: argument dwte");
  expect_error([&] {
    embedding_backward<float>(be, dwte_v, dwpe_v, Tensor<const float>(big.data(), {B, 5, C}),
                              Tensor<const std::int32_t>(tokens.data(), {B, 5}));
  }, "must be <= the rows of wpe (4)");
}

}  // namespace test_kernel_embedding
