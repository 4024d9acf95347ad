// Softmax + cross-entropy kernels: forward against a plain reference, backward against central
// differences, padded vocabulary, ignored targets, in-place aliasing, errors and threads.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/backend/cpu/softmax_cross_entropy.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_cross_entropy {

namespace {

using loom::Tensor;
using loom::cpu;

struct Case {
  std::int64_t N, vocab, padded;
};

const Case cases[] = {{5, 7, 7}, {5, 7, 8}, {1, 1, 3}, {9, 13, 16}, {3, 300, 301}};

//! Targets for `n` rows: row 1 (when present) is ignored, the others cycle through the vocab.
std::vector<std::int32_t> make_targets(const Case& c) {
  std::vector<std::int32_t> t(c.N);
  for (std::int64_t n = 0; n < c.N; ++n)
    t[n] = n == 1 ? -1 : static_cast<std::int32_t>((3 * n + 2) % c.vocab);
  return t;
}

template <class T>
struct Forward {
  std::vector<T> losses, probs;
};

template <class T>
Forward<T> forward(const cpu& be, const std::vector<T>& logits, const std::vector<std::int32_t>& targets,
                   const Case& c) {
  Forward<T> f{std::vector<T>(c.N, T(-3)), std::vector<T>(logits.size(), T(-3))};
  loom::kernels::softmax_cross_entropy_forward<T>(
      be, Tensor<T>(f.losses.data(), {c.N}), Tensor<T>(f.probs.data(), {c.N, c.padded}),
      Tensor<const T>(logits.data(), {c.N, c.padded}),
      Tensor<const std::int32_t>(targets.data(), {c.N}), c.vocab);
  return f;
}

template <class T>
std::vector<T> backward(const cpu& be, const std::vector<T>& probs,
                        const std::vector<std::int32_t>& targets, const Case& c, T scale) {
  std::vector<T> d(probs.size(), T(5));  // garbage: the kernel writes every element
  loom::kernels::softmax_cross_entropy_backward<T>(
      be, Tensor<T>(d.data(), {c.N, c.padded}), Tensor<const T>(probs.data(), {c.N, c.padded}),
      Tensor<const std::int32_t>(targets.data(), {c.N}), c.vocab, scale);
  return d;
}

//! Logits in [-4, 4) on real columns, garbage (large) on padded columns.
template <class T>
std::vector<T> make_logits(const Case& c, std::uint64_t seed) {
  auto x = loom::test::random_vector<T>(c.N * c.padded, seed, -4.0, 4.0);
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t i = c.vocab; i < c.padded; ++i) x[n * c.padded + i] = T(1e4);
  return x;
}

using loom::test::tolerance;

using loom::test::expect_error;

}  // namespace

TEST_CASE_TEMPLATE("softmax_cross_entropy_forward matches the plain reference", T, float, double) {
  const cpu be(1);
  for (const Case& c : cases) {
    CAPTURE(c.N);
    CAPTURE(c.vocab);
    CAPTURE(c.padded);
    const auto logits = make_logits<T>(c, 3);
    const auto targets = make_targets(c);
    std::vector<double> probs_ref(logits.size(), 0.0), losses_ref(c.N, 0.0);
    for (std::int64_t n = 0; n < c.N; ++n) {
      double sum = 0;
      for (std::int64_t i = 0; i < c.vocab; ++i) sum += std::exp(double(logits[n * c.padded + i]));
      for (std::int64_t i = 0; i < c.vocab; ++i)
        probs_ref[n * c.padded + i] = std::exp(double(logits[n * c.padded + i])) / sum;
      if (targets[n] >= 0) losses_ref[n] = -std::log(probs_ref[n * c.padded + targets[n]]);
    }
    const auto f = forward(be, logits, targets, c);
    CHECK(loom::test::max_relative_error(f.probs, probs_ref, 1e-3) <= tolerance<T>());
    CHECK(loom::test::max_relative_error(f.losses, losses_ref, 1e-3) <= tolerance<T>());
    for (std::int64_t n = 0; n < c.N; ++n) {
      for (std::int64_t i = c.vocab; i < c.padded; ++i) REQUIRE(f.probs[n * c.padded + i] == T(0));
      if (targets[n] < 0) CHECK(f.losses[n] == T(0));
    }
  }
}

TEST_CASE_TEMPLATE("softmax_cross_entropy_forward is stable for large logits", T, float, double) {
  const cpu be(1);
  const Case c{2, 4, 4};
  // Without subtracting the row max exp(1000) overflows in float and in double.
  const std::vector<T> logits{T(1000), T(999), T(998), T(990), T(-1000), T(-1001), T(-1002), T(-1100)};
  const std::vector<std::int32_t> targets{1, 3};
  const auto f = forward(be, logits, targets, c);
  for (T p : f.probs) CHECK(std::isfinite(p));
  const double lse0 = 1000 + std::log(1 + std::exp(-1.0) + std::exp(-2.0) + std::exp(-10.0));
  const double lse1 = -1000 + std::log(1 + std::exp(-1.0) + std::exp(-2.0) + std::exp(-100.0));
  CHECK(f.losses[0] == doctest::Approx(lse0 - 999).epsilon(1e-6));
  // A tiny probability (e^-100 underflows in float) still gives the exact loss.
  CHECK(f.losses[1] == doctest::Approx(lse1 + 1100).epsilon(1e-6));
}

TEST_CASE("softmax_cross_entropy_backward matches central differences (double)") {
  const cpu be(1);
  for (const Case& c : cases) {
    CAPTURE(c.N);
    CAPTURE(c.vocab);
    CAPTURE(c.padded);
    auto logits = make_logits<double>(c, 7);
    const auto targets = make_targets(c);
    const double scale = 1.0 / 7.0;
    auto loss = [&] {
      const auto f = forward(be, logits, targets, c);
      double total = 0;
      for (double l : f.losses) total += scale * l;
      return total;
    };
    const auto numeric = loom::test::finite_difference(loss, std::span<double>(logits), 1e-4);
    const auto f = forward(be, logits, targets, c);
    const auto d = backward(be, f.probs, targets, c, scale);
    std::vector<double> analytic_real, numeric_real;
    for (std::int64_t n = 0; n < c.N; ++n)
      for (std::int64_t i = 0; i < c.padded; ++i) {
        const std::int64_t k = n * c.padded + i;
        if (i < c.vocab) {
          analytic_real.push_back(d[k]);
          numeric_real.push_back(numeric[k]);
        } else {
          REQUIRE(d[k] == 0.0);        // padded columns: exactly zero gradient
          REQUIRE(numeric[k] == 0.0);  // and the loss does not depend on them at all
        }
        if (targets[n] < 0) REQUIRE(d[k] == 0.0);  // ignored rows
      }
    CHECK(loom::test::max_relative_error(analytic_real, numeric_real, 1e-3) <= 1e-6);

    // A huge padded logit leaves the loss bit-for-bit unchanged.
    if (c.padded > c.vocab) {
      const double before = loss();
      logits[c.vocab] = 1e300;
      logits[c.padded - 1] = -1e300;
      CHECK(loss() == before);
    }
  }
}

TEST_CASE_TEMPLATE("softmax_cross_entropy kernels work in place", T, float, double) {
  const cpu be(1);
  for (const Case& c : cases) {
    CAPTURE(c.N);
    CAPTURE(c.padded);
    const auto logits = make_logits<T>(c, 9);
    const auto targets = make_targets(c);
    const T scale = T(0.25);
    const auto f = forward(be, logits, targets, c);
    const auto d = backward(be, f.probs, targets, c, scale);

    auto buffer = logits;  // logits -> probs -> dlogits, all in one buffer
    std::vector<T> losses(c.N);
    const Tensor<T> view(buffer.data(), {c.N, c.padded});
    const Tensor<const std::int32_t> target_view(targets.data(), {c.N});
    loom::kernels::softmax_cross_entropy_forward<T>(be, Tensor<T>(losses.data(), {c.N}), view,
                                                    view, target_view, c.vocab);
    CHECK(losses == f.losses);
    CHECK(buffer == f.probs);
    loom::kernels::softmax_cross_entropy_backward<T>(be, view, view, target_view, c.vocab, scale);
    CHECK(buffer == d);
  }
}

TEST_CASE_TEMPLATE("softmax_cross_entropy ignores negative targets", T, float, double) {
  const cpu be(1);
  const Case c{4, 6, 8};
  const auto logits = make_logits<T>(c, 13);
  const std::vector<std::int32_t> targets{-1, 2, -100, 5};
  const auto f = forward(be, logits, targets, c);
  CHECK(f.losses[0] == T(0));
  CHECK(f.losses[2] == T(0));
  CHECK(f.losses[1] > T(0));
  CHECK(f.losses[3] > T(0));
  const auto d = backward(be, f.probs, targets, c, T(1));
  for (std::int64_t n : {0, 2})
    for (std::int64_t i = 0; i < c.padded; ++i) CHECK(d[n * c.padded + i] == T(0));
  // Rows that are not ignored sum to zero over the vocabulary: sum(probs) - 1.
  for (std::int64_t n : {1, 3}) {
    double sum = 0;
    for (std::int64_t i = 0; i < c.padded; ++i) sum += d[n * c.padded + i];
    CHECK(std::abs(sum) < 1e-6);
  }
}

TEST_CASE("softmax_cross_entropy rejects out-of-range targets and bad shapes") {
  const cpu be(1);
  const Case c{3, 5, 8};
  std::vector<float> logits(c.N * c.padded, 0.1f), probs(logits.size()), losses(c.N);
  const Tensor<const float> logits_view(logits.data(), {c.N, c.padded});
  const Tensor<float> probs_view(probs.data(), {c.N, c.padded});
  const Tensor<float> losses_view(losses.data(), {c.N});
  using loom::kernels::softmax_cross_entropy_backward;
  using loom::kernels::softmax_cross_entropy_forward;

  for (std::int32_t bad : {5, 7, 12345}) {  // = vocab, a padded column, far out
    const std::vector<std::int32_t> targets{0, bad, 1};
    const Tensor<const std::int32_t> tv(targets.data(), {c.N});
    const std::string fragment = "targets[1]: got " + std::to_string(bad);
    expect_error([&] { softmax_cross_entropy_forward<float>(be, losses_view, probs_view, logits_view, tv, c.vocab); },
                 fragment);
    expect_error([&] { softmax_cross_entropy_backward<float>(be, probs_view, probs_view, tv, c.vocab, 1.0f); },
                 fragment);
  }

  const std::vector<std::int32_t> targets{0, 1, 2};
  const Tensor<const std::int32_t> tv(targets.data(), {c.N});
  expect_error([&] { softmax_cross_entropy_forward<float>(be, losses_view, probs_view, logits_view, tv, 9); },
               "argument vocab");
  expect_error([&] { softmax_cross_entropy_forward<float>(be, losses_view, probs_view, logits_view, tv, 0); },
               "argument vocab");
  expect_error(
      [&] {
        softmax_cross_entropy_forward<float>(be, losses_view, Tensor<float>(probs.data(), {c.padded, c.N}),
                                             logits_view, tv, c.vocab);
      },
      "softmax_cross_entropy_forward: argument probs");
  expect_error(
      [&] {
        softmax_cross_entropy_forward<float>(be, Tensor<float>(losses.data(), {c.N - 1}), probs_view,
                                             logits_view, tv, c.vocab);
      },
      "softmax_cross_entropy_forward: argument losses");
  expect_error(
      [&] {
        softmax_cross_entropy_forward<float>(be, losses_view, probs_view, logits_view,
                                             Tensor<const std::int32_t>(targets.data(), {c.N - 1}), c.vocab);
      },
      "softmax_cross_entropy_forward: argument targets");
  expect_error(
      [&] {
        softmax_cross_entropy_backward<float>(be, Tensor<float>(probs.data(), {c.N * c.padded}),
                                              logits_view, tv, c.vocab, 1.0f);
      },
      "softmax_cross_entropy_backward: argument dlogits");
  expect_error(
      [&] {
        softmax_cross_entropy_backward<float>(be, probs_view, logits_view,
                                              Tensor<const std::int32_t>(targets.data(), {2}), c.vocab, 1.0f);
      },
      "softmax_cross_entropy_backward: argument targets");
}

TEST_CASE("softmax_cross_entropy accepts [B, T, Vp] logits") {
  const cpu be(1);
  const Case flat{6, 5, 8};
  const auto logits = make_logits<double>(flat, 17);
  const auto targets = make_targets(flat);
  const auto f = forward(be, logits, targets, flat);
  std::vector<double> losses(6), probs(logits.size());
  loom::kernels::softmax_cross_entropy_forward<double>(
      be, Tensor<double>(losses.data(), {2, 3}), Tensor<double>(probs.data(), {2, 3, 8}),
      Tensor<const double>(logits.data(), {2, 3, 8}),
      Tensor<const std::int32_t>(targets.data(), {2, 3}), flat.vocab);
  CHECK(losses == f.losses);
  CHECK(probs == f.probs);
}

TEST_CASE_TEMPLATE("softmax_cross_entropy gives the same bits on 1 and 2 threads", T, float, double) {
  const cpu one(1), two(2);
  const Case c{37, 301, 320};
  const auto logits = make_logits<T>(c, 19);
  const auto targets = make_targets(c);
  const auto f1 = forward(one, logits, targets, c);
  const auto f2 = forward(two, logits, targets, c);
  CHECK(f1.losses == f2.losses);
  CHECK(f1.probs == f2.probs);
  CHECK(backward(one, f1.probs, targets, c, T(0.5)) == backward(two, f2.probs, targets, c, T(0.5)));
}

}  // namespace test_kernel_cross_entropy
