// Vocabulary-parallel embedding and cross-entropy kernels: the slices of a vocabulary, run one
// after the other with the group's reductions done by hand, against a plain double reference and
// against the whole-vocabulary kernels (one slice: the same bits); central differences in double;
// padding that never contributes, slices that are all padding, ignored targets, errors, threads.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "loom/backend/cpu/embedding.hpp"
#include "loom/backend/cpu/softmax_cross_entropy.hpp"
#include "loom/backend/cpu/vocab_parallel.hpp"
#include "support/gradcheck.hpp"

namespace {

using loom::Tensor;
using loom::cpu;
using loom::test::expect_error;
using loom::test::tolerance;

//! N rows over a padded vocabulary split into `slices` equal slices.
struct Case {
  std::int64_t N, vocab, padded, slices;
  std::int64_t rows() const { return padded / slices; }
};

// One slice; slices with padding in the last; slices that are all padding (5 of 16 over 4).
const Case cases[] = {{5, 7, 8, 1}, {5, 7, 8, 2}, {6, 50, 64, 4}, {4, 5, 16, 4}, {3, 13, 16, 8}, {7, 64, 64, 4}};

std::vector<std::int32_t> make_targets(const Case& c) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(c.N));
  for (std::int64_t n = 0; n < c.N; ++n)
    t[n] = n == 1 ? -1 : static_cast<std::int32_t>((5 * n + 3) % c.vocab);  // row 1 ignored
  return t;
}

//! Logits [N, padded] in [-4, 4) on real columns, huge on padding (which must never count).
template <class T>
std::vector<T> make_logits(const Case& c, std::uint64_t seed) {
  auto x = loom::test::random_vector<T>(static_cast<std::size_t>(c.N * c.padded), seed, -4.0, 4.0);
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t i = c.vocab; i < c.padded; ++i) x[n * c.padded + i] = T(1e4);
  return x;
}

//! Slice `s` ([N, rows] columns [s·rows, (s+1)·rows)) of a [N, padded] matrix.
template <class T>
std::vector<T> column_slice(const std::vector<T>& full, const Case& c, std::int64_t s) {
  std::vector<T> out(static_cast<std::size_t>(c.N * c.rows()));
  for (std::int64_t n = 0; n < c.N; ++n)
    for (std::int64_t j = 0; j < c.rows(); ++j) out[n * c.rows() + j] = full[n * c.padded + s * c.rows() + j];
  return out;
}

template <class T>
struct Result {
  std::vector<T> losses, probs;  // probs [N, padded], the slices put back together
};

//! Every slice's exps [N, rows] (steps 1 and 2) and the group's partials [2, N].
template <class T>
struct Exps {
  std::vector<std::vector<T>> slices;
  std::vector<double> partials;
};

//! Steps 1 and 2 on every slice, with the group's max and sum done here in slice order, as the
//! all-reduces of a tensor-parallel group would.
template <class T>
Exps<T> sliced_exps(const cpu& be, const std::vector<T>& logits, const std::vector<std::int32_t>& targets,
                    const Case& c) {
  const std::int64_t N = c.N, R = c.rows();
  std::vector<std::vector<T>> slices;
  for (std::int64_t s = 0; s < c.slices; ++s) slices.push_back(column_slice(logits, c, s));
  const Tensor<const std::int32_t> target_view(targets.data(), {N});
  std::vector<double> global_max(N, std::numeric_limits<double>::lowest()), local_max(N);
  for (std::int64_t s = 0; s < c.slices; ++s) {
    loom::kernels::vocab_parallel_cross_entropy_max<T>(be, Tensor<double>(local_max.data(), {N}),
                                                       Tensor<const T>(slices[s].data(), {N, R}), s * R, c.vocab);
    for (std::int64_t n = 0; n < N; ++n) global_max[n] = std::max(global_max[n], local_max[n]);
  }
  std::vector<double> partials(2 * N, 0.0), local(2 * N);
  for (std::int64_t s = 0; s < c.slices; ++s) {
    loom::kernels::vocab_parallel_cross_entropy_partials<T>(
        be, Tensor<T>(slices[s].data(), {N, R}), Tensor<double>(local.data(), {2, N}),
        Tensor<const T>(slices[s].data(), {N, R}), Tensor<const double>(global_max.data(), {N}), target_view,
        s * R, c.vocab);
    for (std::int64_t i = 0; i < 2 * N; ++i) partials[i] += local[i];
  }
  return {std::move(slices), std::move(partials)};
}

//! The three forward steps on every slice (sliced_exps, then finish on each).
template <class T>
Result<T> sliced_forward(const cpu& be, const std::vector<T>& logits, const std::vector<std::int32_t>& targets,
                         const Case& c) {
  const std::int64_t N = c.N, R = c.rows();
  auto [slices, partials] = sliced_exps(be, logits, targets, c);
  const Tensor<const std::int32_t> target_view(targets.data(), {N});
  Result<T> r{std::vector<T>(N), std::vector<T>(N * c.padded)};
  for (std::int64_t s = 0; s < c.slices; ++s) {
    std::vector<T> losses(N, T(-7));
    loom::kernels::vocab_parallel_cross_entropy_finish<T>(be, Tensor<T>(losses.data(), {N}),
                                                          Tensor<T>(slices[s].data(), {N, R}),
                                                          Tensor<const double>(partials.data(), {2, N}), target_view);
    if (s == 0) r.losses = losses;
    CHECK(losses == r.losses);  // every slice (rank) gets the same losses
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t j = 0; j < R; ++j) r.probs[n * c.padded + s * R + j] = slices[s][n * R + j];
  }
  return r;
}

//! The backward on every slice, put back together as [N, padded].
template <class T>
std::vector<T> sliced_backward(const cpu& be, const std::vector<T>& probs, const std::vector<std::int32_t>& targets,
                               const Case& c, T scale) {
  const std::int64_t N = c.N, R = c.rows();
  std::vector<T> out(N * c.padded);
  for (std::int64_t s = 0; s < c.slices; ++s) {
    const std::vector<T> p = column_slice(probs, c, s);
    std::vector<T> d(p.size(), T(5));  // garbage: the kernel writes every element
    loom::kernels::vocab_parallel_cross_entropy_backward<T>(be, Tensor<T>(d.data(), {N, R}),
                                                            Tensor<const T>(p.data(), {N, R}),
                                                            Tensor<const std::int32_t>(targets.data(), {N}), s * R,
                                                            c.vocab, scale);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t j = 0; j < R; ++j) out[n * c.padded + s * R + j] = d[n * R + j];
  }
  return out;
}

//! Plain double reference over the whole vocabulary: losses and probabilities.
Result<double> reference_forward(const std::vector<double>& x, const std::vector<std::int32_t>& targets, const Case& c) {
  Result<double> r{std::vector<double>(c.N), std::vector<double>(c.N * c.padded, 0.0)};
  for (std::int64_t n = 0; n < c.N; ++n) {
    const double* row = x.data() + n * c.padded;
    const double max = *std::max_element(row, row + c.vocab);
    double sum = 0;
    for (std::int64_t i = 0; i < c.vocab; ++i) sum += std::exp(row[i] - max);
    for (std::int64_t i = 0; i < c.vocab; ++i) r.probs[n * c.padded + i] = std::exp(row[i] - max) / sum;
    r.losses[n] = targets[n] >= 0 ? std::log(sum) - (row[targets[n]] - max) : 0.0;
  }
  return r;
}

template <class T>
std::vector<double> as_double(const std::vector<T>& v) {
  return {v.begin(), v.end()};
}

}  // namespace

TEST_CASE_TEMPLATE("vocab-parallel cross-entropy over slices matches the plain reference", T, float, double) {
  const cpu be(1);
  for (const Case& c : cases) {
    CAPTURE(c.N);
    CAPTURE(c.vocab);
    CAPTURE(c.padded);
    CAPTURE(c.slices);
    const auto logits = make_logits<T>(c, 11);
    const auto targets = make_targets(c);
    const Result<T> got = sliced_forward<T>(be, logits, targets, c);
    const Result<double> want = reference_forward(as_double(logits), targets, c);
    CHECK(loom::test::max_relative_error(got.losses, want.losses, 1.0) <= tolerance<T>());
    CHECK(loom::test::max_relative_error(got.probs, want.probs, 1.0) <= tolerance<T>());
    for (std::int64_t n = 0; n < c.N; ++n)
      for (std::int64_t i = c.vocab; i < c.padded; ++i) CHECK(got.probs[n * c.padded + i] == T(0));

    const T scale = T(0.25);
    const auto dlogits = sliced_backward<T>(be, got.probs, targets, c, scale);
    std::vector<double> want_d(c.N * c.padded, 0.0);
    for (std::int64_t n = 0; n < c.N; ++n) {
      if (targets[n] < 0) continue;
      for (std::int64_t i = 0; i < c.vocab; ++i) want_d[n * c.padded + i] = 0.25 * want.probs[n * c.padded + i];
      want_d[n * c.padded + targets[n]] -= 0.25;
    }
    CHECK(loom::test::max_relative_error(dlogits, want_d, 1.0) <= tolerance<T>());
  }
}

TEST_CASE_TEMPLATE("one slice gives the bits of softmax_cross_entropy forward and backward", T, float, double) {
  const cpu be(1);
  for (const Case& c : {Case{5, 7, 8, 1}, Case{9, 13, 16, 1}, Case{3, 300, 301, 1}}) {
    CAPTURE(c.vocab);
    const auto logits = make_logits<T>(c, 5);
    const auto targets = make_targets(c);
    const Result<T> got = sliced_forward<T>(be, logits, targets, c);
    std::vector<T> losses(c.N), probs(c.N * c.padded);
    loom::kernels::softmax_cross_entropy_forward<T>(be, Tensor<T>(losses.data(), {c.N}),
                                                    Tensor<T>(probs.data(), {c.N, c.padded}),
                                                    Tensor<const T>(logits.data(), {c.N, c.padded}),
                                                    Tensor<const std::int32_t>(targets.data(), {c.N}), c.vocab);
    CHECK(got.losses == losses);
    CHECK(got.probs == probs);
    std::vector<T> d(probs.size());
    loom::kernels::softmax_cross_entropy_backward<T>(be, Tensor<T>(d.data(), {c.N, c.padded}),
                                                     Tensor<const T>(probs.data(), {c.N, c.padded}),
                                                     Tensor<const std::int32_t>(targets.data(), {c.N}), c.vocab,
                                                     T(0.5));
    CHECK(sliced_backward<T>(be, probs, targets, c, T(0.5)) == d);
  }
}

TEST_CASE_TEMPLATE("the losses from the partials, and the backward from the exps, give finish's losses and the bits of "
                   "finish then the backward",
                   T, float, double) {
  const cpu be(2);
  for (const Case& c : cases) {
    CAPTURE(c.vocab);
    CAPTURE(c.slices);
    const auto logits = make_logits<T>(c, 13);
    const auto targets = make_targets(c);
    const Exps<T> e = sliced_exps<T>(be, logits, targets, c);
    const std::int64_t N = c.N, R = c.rows();
    const Tensor<const std::int32_t> target_view(targets.data(), {N});
    const Tensor<const double> partials(e.partials.data(), {2, N});
    std::vector<T> want_losses(N, T(-7)), got_losses(N, T(-7));
    loom::kernels::vocab_parallel_cross_entropy_losses<T>(be, Tensor<T>(got_losses.data(), {N}), partials, target_view);
    for (std::int64_t s = 0; s < c.slices; ++s) {
      CAPTURE(s);
      std::vector<T> probs = e.slices[s], fused = e.slices[s];
      loom::kernels::vocab_parallel_cross_entropy_finish<T>(be, Tensor<T>(want_losses.data(), {N}),
                                                            Tensor<T>(probs.data(), {N, R}), partials, target_view);
      CHECK(got_losses == want_losses);
      std::vector<T> want(probs.size(), T(5));
      loom::kernels::vocab_parallel_cross_entropy_backward<T>(be, Tensor<T>(want.data(), {N, R}),
                                                              Tensor<const T>(probs.data(), {N, R}), target_view,
                                                              s * R, c.vocab, T(0.25));
      // In place, as the models call it.
      loom::kernels::vocab_parallel_cross_entropy_backward<T>(be, Tensor<T>(fused.data(), {N, R}),
                                                              Tensor<const T>(fused.data(), {N, R}), partials,
                                                              target_view, s * R, c.vocab, T(0.25));
      CHECK(fused == want);
    }
  }
}

TEST_CASE("vocab-parallel cross-entropy gradient check in double (central differences)") {
  const cpu be(1);
  for (const Case& c : {Case{4, 7, 8, 2}, Case{3, 5, 16, 4}, Case{3, 13, 16, 8}}) {
    CAPTURE(c.slices);
    auto logits = make_logits<double>(c, 21);
    for (double& x : logits) x = std::min(x, 4.0);  // finite differences need moderate padding values too
    const auto targets = make_targets(c);
    const auto loss = [&] {
      const Result<double> r = sliced_forward<double>(be, logits, targets, c);
      double total = 0;
      for (std::int64_t n = 0; n < c.N; ++n) total += (n + 1) * r.losses[n];  // rows weighted
      return total;
    };
    const auto numeric = loom::test::finite_difference(loss, std::span<double>(logits), 1e-4);
    const Result<double> r = sliced_forward<double>(be, logits, targets, c);
    std::vector<double> analytic(logits.size());
    for (std::int64_t n = 0; n < c.N; ++n) {
      // Row n's weight is its scale: backward one row at a time through a one-row case.
      const Case row{1, c.vocab, c.padded, c.slices};
      const std::vector<double> p(r.probs.begin() + n * c.padded, r.probs.begin() + (n + 1) * c.padded);
      const auto d = sliced_backward<double>(be, p, {targets[n]}, row, static_cast<double>(n + 1));
      std::copy(d.begin(), d.end(), analytic.begin() + n * c.padded);
    }
    CHECK(loom::test::max_relative_error(analytic, numeric, 1e-3) <= 1e-6);
  }
}

TEST_CASE_TEMPLATE("vocab-parallel embedding over slices gives embedding_forward/backward's bits", T, float, double) {
  const cpu be(1);
  const std::int64_t B = 3, Tn = 5, C = 7, vocab = 11, padded = 16, maxT = 6;
  for (std::int64_t slices : {1, 2, 4}) {
    CAPTURE(slices);
    const std::int64_t rows = padded / slices;
    const auto wte = loom::test::random_vector<T>(padded * C, 1);
    const auto wpe = loom::test::random_vector<T>(maxT * C, 2);
    const auto dout = loom::test::random_vector<T>(B * Tn * C, 3);
    std::vector<std::int32_t> tokens(B * Tn);
    for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((7 * i + 2) % vocab);
    const Tensor<const std::int32_t> ids(tokens.data(), {B, Tn});

    std::vector<T> want(B * Tn * C), want_dwte(padded * C, T(0)), want_dwpe(maxT * C, T(0));
    loom::kernels::embedding_forward<T>(be, Tensor<T>(want.data(), {B, Tn, C}), ids,
                                        Tensor<const T>(wte.data(), {padded, C}), Tensor<const T>(wpe.data(), {maxT, C}));
    loom::kernels::embedding_backward<T>(be, Tensor<T>(want_dwte.data(), {padded, C}),
                                         Tensor<T>(want_dwpe.data(), {maxT, C}),
                                         Tensor<const T>(dout.data(), {B, Tn, C}), ids);

    // Forward: slice 0 adds the positions; the others contribute their rows or zero; the sum
    // over slices (the all-reduce) has at most two non-zero terms, so it is exact.
    std::vector<T> sum(B * Tn * C, T(0)), part(B * Tn * C);
    std::vector<T> dwte(padded * C, T(0));
    for (std::int64_t s = 0; s < slices; ++s) {
      loom::kernels::vocab_parallel_embedding_forward<T>(
          be, Tensor<T>(part.data(), {B, Tn, C}), ids, Tensor<const T>(wte.data() + s * rows * C, {rows, C}), s * rows,
          s == 0 ? Tensor<const T>(wpe.data(), {maxT, C}) : Tensor<const T>{});
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += part[i];
      std::vector<T> dwpe(maxT * C, T(0));
      loom::kernels::vocab_parallel_embedding_backward<T>(be, Tensor<T>(dwte.data() + s * rows * C, {rows, C}),
                                                          s * rows, Tensor<T>(dwpe.data(), {maxT, C}),
                                                          Tensor<const T>(dout.data(), {B, Tn, C}), ids);
      CHECK(dwpe == want_dwpe);  // every slice gets the whole (replicated) position gradient
    }
    CHECK(sum == want);
    CHECK(dwte == want_dwte);
  }
}

TEST_CASE("vocab-parallel embedding gradient check in double; tokens outside the slice give zero") {
  const cpu be(1);
  const std::int64_t B = 2, Tn = 3, C = 4, rows = 4, begin = 4, maxT = 3;
  auto wte = loom::test::random_vector<double>(rows * C, 4);
  auto wpe = loom::test::random_vector<double>(maxT * C, 5);
  const auto weights = loom::test::random_vector<double>(B * Tn * C, 6);
  const std::vector<std::int32_t> tokens{4, 0, 7, 5, 9, 4};  // 0 and 9 are other slices' rows
  const Tensor<const std::int32_t> ids(tokens.data(), {B, Tn});
  std::vector<double> out(B * Tn * C);
  const auto loss = [&] {
    loom::kernels::vocab_parallel_embedding_forward<double>(be, Tensor<double>(out.data(), {B, Tn, C}), ids,
                                                            Tensor<const double>(wte.data(), {rows, C}), begin,
                                                            Tensor<const double>(wpe.data(), {maxT, C}));
    double total = 0;
    for (std::size_t i = 0; i < out.size(); ++i) total += weights[i] * out[i];
    return total;
  };
  loss();
  for (std::int64_t j = 0; j < C; ++j) CHECK(out[1 * C + j] == wpe[1 * C + j]);  // token 0: positions only
  std::vector<double> dwte(wte.size(), 0.0), dwpe(wpe.size(), 0.0);
  loom::kernels::vocab_parallel_embedding_backward<double>(be, Tensor<double>(dwte.data(), {rows, C}), begin,
                                                           Tensor<double>(dwpe.data(), {maxT, C}),
                                                           Tensor<const double>(weights.data(), {B, Tn, C}), ids);
  CHECK(loom::test::max_relative_error(dwte, loom::test::finite_difference(loss, std::span<double>(wte)), 1e-4) <= 1e-6);
  CHECK(loom::test::max_relative_error(dwpe, loom::test::finite_difference(loss, std::span<double>(wpe)), 1e-4) <= 1e-6);
}

TEST_CASE("select_target_rows keeps the rows with a target >= 0, in order, at lengths 0..40, within its room") {
  cpu be(1);
  const auto kept_every = [](std::int64_t period) {
    return [period](std::int64_t n) { return period > 0 && n % period == 0; };
  };
  for (std::int64_t N = 0; N <= 40; ++N) {
    CAPTURE(N);
    for (const std::int64_t period : {0, 1, 3, 7}) {  // none kept, all kept, every 3rd, every 7th
      CAPTURE(period);
      std::vector<std::int32_t> targets(static_cast<std::size_t>(N));
      std::vector<std::int32_t> want_rows, want_targets;
      for (std::int64_t n = 0; n < N; ++n) {
        const bool kept = kept_every(period)(n);
        targets[n] = kept ? static_cast<std::int32_t>((7 * n) % 11) : static_cast<std::int32_t>(-1 - n % 3);
        if (kept) {
          want_rows.push_back(static_cast<std::int32_t>(n));
          want_targets.push_back(targets[n]);
        }
      }
      std::vector<std::int32_t> rows(static_cast<std::size_t>(N), 99), row_targets(static_cast<std::size_t>(N), 99);
      const std::int64_t M = loom::select_target_rows(be, Tensor<std::int32_t>(rows.data(), {N}),
                                                      Tensor<std::int32_t>(row_targets.data(), {N}),
                                                      Tensor<const std::int32_t>(targets.data(), {N}));
      REQUIRE(M == static_cast<std::int64_t>(want_rows.size()));
      CHECK(std::vector<std::int32_t>(rows.begin(), rows.begin() + M) == want_rows);
      CHECK(std::vector<std::int32_t>(row_targets.begin(), row_targets.begin() + M) == want_targets);
      // Past M nothing is written.
      CHECK(std::all_of(rows.begin() + M, rows.end(), [](std::int32_t r) { return r == 99; }));
      CHECK(std::all_of(row_targets.begin() + M, row_targets.end(), [](std::int32_t r) { return r == 99; }));
    }
  }
  // Room for fewer rows than are kept: the first ones written, the whole count returned.
  const std::vector<std::int32_t> targets{-1, 4, 5, -1, 6, 7, -1};
  std::vector<std::int32_t> rows(2, 99), row_targets(2, 99);
  CHECK(loom::select_target_rows(be, Tensor<std::int32_t>(rows.data(), {2}),
                                 Tensor<std::int32_t>(row_targets.data(), {2}),
                                 Tensor<const std::int32_t>(targets.data(), {7})) == 4);
  CHECK(rows == std::vector<std::int32_t>{1, 2});
  CHECK(row_targets == std::vector<std::int32_t>{4, 5});
  std::vector<std::int32_t> three(3);
  expect_error(
      [&] {
        loom::select_target_rows(be, Tensor<std::int32_t>(rows.data(), {2}), Tensor<std::int32_t>(three.data(), {3}),
                                 Tensor<const std::int32_t>(targets.data(), {7}));
      },
      "row_targets");
}

TEST_CASE("vocab-parallel kernels give the same bits on 1 and 2 threads") {
  const Case c{64, 1000, 1024, 2};
  const auto logits = make_logits<float>(c, 8);
  const auto targets = make_targets(c);
  const cpu one(1), two(2);
  const Result<float> a = sliced_forward<float>(one, logits, targets, c), b = sliced_forward<float>(two, logits, targets, c);
  CHECK(a.losses == b.losses);
  CHECK(a.probs == b.probs);
  CHECK(sliced_backward<float>(one, a.probs, targets, c, 0.5f) == sliced_backward<float>(two, a.probs, targets, c, 0.5f));
}

TEST_CASE("vocab-parallel kernels reject bad arguments, naming them") {
  const cpu be(1);
  std::vector<float> x(8, 0.f), e(8), losses(2);
  std::vector<double> m(2, 0.0), partials(4, 1.0);
  const std::vector<std::int32_t> targets{1, 9}, tokens{0, -1};
  const Tensor<const float> logits(x.data(), {2, 4});
  expect_error([&] { loom::kernels::vocab_parallel_cross_entropy_max<float>(be, Tensor<double>(m.data(), {2}), logits, -1, 8); },
               "vocab_begin");
  expect_error([&] { loom::kernels::vocab_parallel_cross_entropy_max<float>(be, Tensor<double>(m.data(), {1}), logits, 0, 8); },
               "row_max");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_partials<float>(
            be, Tensor<float>(e.data(), {2, 4}), Tensor<double>(partials.data(), {2, 2}), logits,
            Tensor<const double>(m.data(), {2}), Tensor<const std::int32_t>(targets.data(), {2}), 4, 8);
      },
      "targets[1]");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_backward<float>(be, Tensor<float>(e.data(), {4, 2}), logits,
                                                                    Tensor<const std::int32_t>(targets.data(), {2}),
                                                                    0, 10, 1.f);
      },
      "dlogits");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_backward<float>(
            be, Tensor<float>(e.data(), {2, 4}), logits, Tensor<const double>(partials.data(), {3}),
            Tensor<const std::int32_t>(targets.data(), {2}), 0, 10, 1.f);
      },
      "partials");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_losses<float>(be, Tensor<float>(losses.data(), {2}),
                                                                  Tensor<const double>(partials.data(), {2}),
                                                                  Tensor<const std::int32_t>(targets.data(), {2}));
      },
      "partials");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_embedding_forward<float>(be, Tensor<float>(e.data(), {1, 2, 4}),
                                                               Tensor<const std::int32_t>(tokens.data(), {1, 2}),
                                                               Tensor<const float>(x.data(), {2, 4}), 0, Tensor<const float>{});
      },
      "token at tokens[0, 1]");
}
