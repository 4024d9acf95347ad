// Vocabulary-parallel embedding and cross-entropy kernels: the slices of a vocabulary, run one
// after the other with the group's reductions done by hand, against a plain double reference,
// against one slice and against the whole-vocabulary kernels; central differences in double;
// padding that never contributes, slices that are all padding, ignored targets, errors, threads.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "loom/backend/cpu/embedding.hpp"
#include "loom/backend/cpu/reduction.hpp"
#include "loom/backend/cpu/softmax_cross_entropy.hpp"
#include "loom/backend/cpu/vocab_parallel.hpp"
#include "loom/core/bf16.hpp"
#include "support/gradcheck.hpp"

namespace test_kernel_vocab_parallel {

namespace {

using loom::Tensor;
using loom::cpu;
using loom::test::expect_error;
using loom::test::same_bits;
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

//! The group's row statistics: row_max [N] and partials [2, N].
struct Statistics {
  std::vector<double> row_max, partials;
};

//! The statistics of the whole vocabulary as a group of `c.slices` ranks forms them: one slice
//! runs step 1 alone (a group of one); several run step 1 each (keeping their own max), take the
//! group's max here in slice order, rebase their sums to it and sum the partials in slice order,
//! as the all-reduces would.
template <class T>
Statistics sliced_statistics(const cpu& be, const std::vector<T>& logits, const std::vector<std::int32_t>& targets,
                             const Case& c) {
  const std::int64_t N = c.N, R = c.rows();
  const Tensor<const std::int32_t> target_view(targets.data(), {N});
  Statistics g{std::vector<double>(N, std::numeric_limits<double>::lowest()), std::vector<double>(2 * N, 0.0)};
  if (c.slices == 1) {
    loom::kernels::vocab_parallel_cross_entropy_statistics<T>(
        be, Tensor<double>(g.row_max.data(), {N}), Tensor<double>(g.partials.data(), {2, N}),
        Tensor<const T>(logits.data(), {N, R}), target_view, 0, c.vocab);
    return g;
  }
  std::vector<std::vector<double>> own_max, own_partials;
  for (std::int64_t s = 0; s < c.slices; ++s) {
    const std::vector<T> slice = column_slice(logits, c, s);
    std::vector<double> row_max(N, -3.0), copy(N, -5.0), partials(2 * N, -7.0);  // garbage: all written
    loom::kernels::vocab_parallel_cross_entropy_statistics<T>(
        be, Tensor<double>(row_max.data(), {N}), Tensor<double>(partials.data(), {2, N}),
        Tensor<const T>(slice.data(), {N, R}), target_view, s * R, c.vocab, Tensor<double>(copy.data(), {N}));
    CHECK(copy == row_max);
    for (std::int64_t n = 0; n < N; ++n) g.row_max[n] = std::max(g.row_max[n], row_max[n]);
    own_max.push_back(std::move(row_max));
    own_partials.push_back(std::move(partials));
  }
  for (std::int64_t s = 0; s < c.slices; ++s) {
    loom::kernels::vocab_parallel_cross_entropy_rebase(be, Tensor<double>(own_partials[s].data(), {2, N}),
                                                       Tensor<const double>(own_max[s].data(), {N}),
                                                       Tensor<const double>(g.row_max.data(), {N}));
    for (std::int64_t i = 0; i < 2 * N; ++i) g.partials[i] += own_partials[s][i];
  }
  return g;
}

template <class T>
struct Result {
  std::vector<T> losses, dlogits;  // dlogits [N, padded], the slices put back together
};

//! The forward (sliced_statistics, then the losses on every slice) and the backward from each
//! slice's logits, in place as the models call it, with the given `scale`.
template <class T>
Result<T> sliced_loss(const cpu& be, const std::vector<T>& logits, const std::vector<std::int32_t>& targets,
                      const Case& c, T scale) {
  const std::int64_t N = c.N, R = c.rows();
  const Statistics g = sliced_statistics(be, logits, targets, c);
  const Tensor<const std::int32_t> target_view(targets.data(), {N});
  const Tensor<const double> row_max(g.row_max.data(), {N}), partials(g.partials.data(), {2, N});
  Result<T> r{std::vector<T>(N), std::vector<T>(N * c.padded)};
  for (std::int64_t s = 0; s < c.slices; ++s) {
    std::vector<T> losses(N, T(-7));
    loom::kernels::vocab_parallel_cross_entropy_losses<T>(be, Tensor<T>(losses.data(), {N}), row_max, partials,
                                                          target_view);
    if (s == 0) r.losses = losses;
    CHECK(losses == r.losses);  // every slice (rank) gets the same losses
    std::vector<T> d = column_slice(logits, c, s);
    loom::kernels::vocab_parallel_cross_entropy_backward<T>(be, Tensor<T>(d.data(), {N, R}),
                                                            Tensor<const T>(d.data(), {N, R}), row_max, partials,
                                                            target_view, s * R, c.vocab, scale);
    for (std::int64_t n = 0; n < N; ++n)
      for (std::int64_t j = 0; j < R; ++j) r.dlogits[n * c.padded + s * R + j] = d[n * R + j];
  }
  return r;
}

//! The backward from probabilities on every slice, put back together as [N, padded].
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

//! The reference's losses [N] and probabilities [N, padded].
struct Reference {
  std::vector<double> losses, probs;
};

//! Plain double reference over the whole vocabulary: losses and probabilities.
Reference reference_forward(const std::vector<double>& x, const std::vector<std::int32_t>& targets, const Case& c) {
  Reference r{std::vector<double>(c.N), std::vector<double>(c.N * c.padded, 0.0)};
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

//! The reference's dlogits = scale (p - onehot), 0 on padding and ignored rows.
std::vector<double> reference_dlogits(const Reference& want, const std::vector<std::int32_t>& targets,
                                      const Case& c, double scale) {
  std::vector<double> d(c.N * c.padded, 0.0);
  for (std::int64_t n = 0; n < c.N; ++n) {
    if (targets[n] < 0) continue;
    for (std::int64_t i = 0; i < c.vocab; ++i) d[n * c.padded + i] = scale * want.probs[n * c.padded + i];
    d[n * c.padded + targets[n]] -= scale;
  }
  return d;
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
    const Result<T> got = sliced_loss<T>(be, logits, targets, c, T(0.25));
    const Reference want = reference_forward(as_double(logits), targets, c);
    CHECK(loom::test::max_relative_error(got.losses, want.losses, 1.0) <= tolerance<T>());
    const std::vector<double> want_dlogits = reference_dlogits(want, targets, c, 0.25);
    CHECK(loom::test::max_relative_error(got.dlogits, want_dlogits, 1.0) <= tolerance<T>());
    for (std::int64_t n = 0; n < c.N; ++n)
      for (std::int64_t i = c.vocab; i < c.padded; ++i) CHECK(got.dlogits[n * c.padded + i] == T(0));
    // The backward from probabilities: scale (p - onehot) of the probabilities it is given.
    std::vector<T> probs(want.probs.begin(), want.probs.end());
    CHECK(loom::test::max_relative_error(sliced_backward<T>(be, probs, targets, c, T(0.25)), want_dlogits, 1.0) <=
          tolerance<T>());
  }
}

TEST_CASE_TEMPLATE("a group's rebased statistics give one slice's losses and dlogits, and one slice those of "
                   "softmax_cross_entropy",
                   T, float, double) {
  const cpu be(2);
  // A few units in the last place: the group sums its exps in another order (and under
  // another max), and the whole-vocabulary kernel may take its exps on other code paths.
  const double close = 16 * std::numeric_limits<T>::epsilon();
  for (const Case& c : cases) {
    CAPTURE(c.vocab);
    CAPTURE(c.slices);
    const auto logits = make_logits<T>(c, 13);
    const auto targets = make_targets(c);
    const Case whole{c.N, c.vocab, c.padded, 1};
    const Result<T> group = sliced_loss<T>(be, logits, targets, c, T(0.25));
    const Result<T> one = sliced_loss<T>(be, logits, targets, whole, T(0.25));
    CHECK(loom::test::max_relative_error(group.losses, one.losses, 1.0) <= close);
    CHECK(loom::test::max_relative_error(group.dlogits, one.dlogits, 1.0) <= close);

    std::vector<T> losses(c.N), probs(c.N * c.padded), d(c.N * c.padded);
    const Tensor<const std::int32_t> target_view(targets.data(), {c.N});
    loom::kernels::softmax_cross_entropy_forward<T>(be, Tensor<T>(losses.data(), {c.N}),
                                                    Tensor<T>(probs.data(), {c.N, c.padded}),
                                                    Tensor<const T>(logits.data(), {c.N, c.padded}), target_view,
                                                    c.vocab);
    loom::kernels::softmax_cross_entropy_backward<T>(be, Tensor<T>(d.data(), {c.N, c.padded}),
                                                     Tensor<const T>(probs.data(), {c.N, c.padded}), target_view,
                                                     c.vocab, T(0.25));
    CHECK(loom::test::max_relative_error(one.losses, losses, 1.0) <= close);
    CHECK(loom::test::max_relative_error(one.dlogits, d, 1.0) <= close);
  }
}

TEST_CASE_TEMPLATE("the backward from the logits writes the same bits in place and out of place", T, float, double) {
  const cpu be(2);
  for (const Case& c : cases) {
    CAPTURE(c.vocab);
    const Case whole{c.N, c.vocab, c.padded, 1};
    const auto logits = make_logits<T>(c, 17);
    const auto targets = make_targets(c);
    const Statistics g = sliced_statistics(be, logits, targets, whole);
    const Tensor<const std::int32_t> target_view(targets.data(), {c.N});
    const Tensor<const double> row_max(g.row_max.data(), {c.N}), partials(g.partials.data(), {2, c.N});
    std::vector<T> apart(logits.size(), T(5)), in_place = logits;
    loom::kernels::vocab_parallel_cross_entropy_backward<T>(be, Tensor<T>(apart.data(), {c.N, c.padded}),
                                                            Tensor<const T>(logits.data(), {c.N, c.padded}), row_max,
                                                            partials, target_view, 0, c.vocab, T(0.5));
    loom::kernels::vocab_parallel_cross_entropy_backward<T>(be, Tensor<T>(in_place.data(), {c.N, c.padded}),
                                                            Tensor<const T>(in_place.data(), {c.N, c.padded}), row_max,
                                                            partials, target_view, 0, c.vocab, T(0.5));
    CHECK(apart == in_place);
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
      const Result<double> r = sliced_loss<double>(be, logits, targets, c, 1.0);
      double total = 0;
      for (std::int64_t n = 0; n < c.N; ++n) total += (n + 1) * r.losses[n];  // rows weighted
      return total;
    };
    const auto numeric = loom::test::finite_difference(loss, std::span<double>(logits), 1e-4);
    std::vector<double> analytic = sliced_loss<double>(be, logits, targets, c, 1.0).dlogits;
    for (std::int64_t n = 0; n < c.N; ++n)
      for (std::int64_t i = 0; i < c.padded; ++i) analytic[n * c.padded + i] *= static_cast<double>(n + 1);
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
  const Result<float> a = sliced_loss<float>(one, logits, targets, c, 0.5f),
                      b = sliced_loss<float>(two, logits, targets, c, 0.5f);
  CHECK(a.losses == b.losses);
  CHECK(a.dlogits == b.dlogits);
  CHECK(sliced_backward<float>(one, logits, targets, c, 0.5f) == sliced_backward<float>(two, logits, targets, c, 0.5f));
}

TEST_CASE("vocab-parallel kernels reject bad arguments, naming them") {
  const cpu be(1);
  std::vector<float> x(8, 0.f), e(8), losses(2);
  std::vector<double> m(2, 0.0), partials(4, 1.0);
  const std::vector<std::int32_t> targets{1, 9}, tokens{0, -1};
  const Tensor<const float> logits(x.data(), {2, 4});
  const Tensor<const std::int32_t> target_view(targets.data(), {2});
  const auto statistics = [&](std::int64_t max_rows, std::int64_t partial_rows, std::int64_t vocab_begin,
                              std::int64_t vocab, Tensor<double> slice_max) {
    loom::kernels::vocab_parallel_cross_entropy_statistics<float>(
        be, Tensor<double>(m.data(), {max_rows}), Tensor<double>(partials.data(), {partial_rows}), logits,
        target_view, vocab_begin, vocab, slice_max);
  };
  expect_error([&] { statistics(2, 4, -1, 10, {}); }, "vocab_begin");
  expect_error([&] { statistics(1, 4, 0, 10, {}); }, "row_max");
  expect_error([&] { statistics(2, 3, 0, 10, {}); }, "partials");
  expect_error([&] { statistics(2, 4, 0, 10, Tensor<double>(partials.data(), {3})); }, "slice_max");
  expect_error([&] { statistics(2, 4, 4, 8, {}); }, "targets[1]");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_rebase(be, Tensor<double>(partials.data(), {4}),
                                                           Tensor<const double>(m.data(), {1}),
                                                           Tensor<const double>(m.data(), {2}));
      },
      "slice_max");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_backward<float>(be, Tensor<float>(e.data(), {4, 2}), logits,
                                                                    target_view, 0, 10, 1.f);
      },
      "dlogits");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_backward<float>(
            be, Tensor<float>(e.data(), {2, 4}), logits, Tensor<const double>(m.data(), {2}),
            Tensor<const double>(partials.data(), {3}), target_view, 0, 10, 1.f);
      },
      "partials");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_backward<float>(
            be, Tensor<float>(e.data(), {2, 4}), logits, Tensor<const double>(m.data(), {1}),
            Tensor<const double>(partials.data(), {4}), target_view, 0, 10, 1.f);
      },
      "row_max");
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_losses<float>(be, Tensor<float>(losses.data(), {2}),
                                                                  Tensor<const double>(m.data(), {2}),
                                                                  Tensor<const double>(partials.data(), {2}),
                                                                  target_view);
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

namespace {

//! What the fused kernel and the three kernels it replaces write: losses, statistics, dlogits.
template <class T>
struct Fused {
  std::vector<loom::accumulate_t<T>> losses;
  std::vector<double> row_max, partials;
  std::vector<T> dlogits;
};

//! The statistics, the losses and the backward from the logits in place (one slice: the whole
//! vocabulary), as vocab_parallel_loss runs them where no backward is announced.
template <class T>
Fused<T> three_kernels(const cpu& be, const std::vector<T>& logits, const std::vector<std::int32_t>& targets,
                       const Case& c, loom::accumulate_t<T> scale) {
  using A = loom::accumulate_t<T>;
  const std::int64_t N = c.N;
  Fused<T> r{std::vector<A>(N, A(-7)), std::vector<double>(N, -3.0), std::vector<double>(2 * N, -5.0), logits};
  const Tensor<const std::int32_t> target_view(targets.data(), {N});
  loom::kernels::vocab_parallel_cross_entropy_statistics<T>(be, Tensor<double>(r.row_max.data(), {N}),
                                                            Tensor<double>(r.partials.data(), {2, N}),
                                                            Tensor<const T>(logits.data(), {N, c.padded}),
                                                            target_view, 0, c.vocab);
  const Tensor<const double> row_max(r.row_max.data(), {N}), partials(r.partials.data(), {2, N});
  loom::kernels::vocab_parallel_cross_entropy_losses<T>(be, Tensor<A>(r.losses.data(), {N}), row_max, partials,
                                                        target_view);
  loom::kernels::vocab_parallel_cross_entropy_backward<T>(be, Tensor<T>(r.dlogits.data(), {N, c.padded}),
                                                          Tensor<const T>(r.dlogits.data(), {N, c.padded}), row_max,
                                                          partials, target_view, 0, c.vocab, scale);
  return r;
}

//! cross_entropy_forward_backward on the same logits; `gradient_scale` gets its flag.
template <class T>
Fused<T> fused(const cpu& be, const std::vector<T>& logits, const std::vector<std::int32_t>& targets, const Case& c,
               loom::accumulate_t<T> scale, double& gradient_scale) {
  using A = loom::accumulate_t<T>;
  const std::int64_t N = c.N;
  Fused<T> r{std::vector<A>(N, A(-7)), std::vector<double>(N, -3.0), std::vector<double>(2 * N, -5.0), logits};
  gradient_scale = -1.0;
  loom::kernels::cross_entropy_forward_backward<T>(
      be, Tensor<A>(r.losses.data(), {N}), Tensor<double>(r.row_max.data(), {N}),
      Tensor<double>(r.partials.data(), {2, N}), Tensor<T>(r.dlogits.data(), {N, c.padded}),
      Tensor<const std::int32_t>(targets.data(), {N}), c.vocab, scale, Tensor<double>(&gradient_scale, {1}));
  return r;
}

}  // namespace

TEST_CASE_TEMPLATE("cross_entropy_forward_backward writes the three kernels' bits: statistics, losses, dlogits", T,
                   float, double, loom::bf16) {
  using A = loom::accumulate_t<T>;
  // One slice of each case's padded vocabulary; no padding; rows past the kernels' thread
  // threshold (so 2 threads split them).
  std::vector<Case> whole;
  for (const Case& c : cases) whole.push_back({c.N, c.vocab, c.padded, 1});
  whole.push_back({4, 9, 9, 1});
  whole.push_back({40, 1000, 1024, 1});
  for (const Case& c : whole) {
    CAPTURE(c.N);
    CAPTURE(c.vocab);
    CAPTURE(c.padded);
    const auto logits = make_logits<T>(c, 23);
    std::vector<std::int32_t> targets = make_targets(c);
    targets.back() = -5;  // a second ignored row, the last
    for (const int threads : {1, 2}) {
      CAPTURE(threads);
      const cpu be(threads);
      const A scale = A(1) / A(3 * c.N);
      const Fused<T> want = three_kernels<T>(be, logits, targets, c, scale);
      double flag = 0;
      const Fused<T> got = fused<T>(be, logits, targets, c, scale, flag);
      CHECK(same_bits(got.losses, want.losses));
      CHECK(same_bits(got.row_max, want.row_max));
      CHECK(same_bits(got.partials, want.partials));
      CHECK(same_bits(got.dlogits, want.dlogits));
      CHECK(flag == static_cast<double>(scale));

      // The backward told so keeps the gradient; at another scale it rescales it (kernels::scale's
      // bits); told 0, it computes the gradient from what it takes to be logits.
      const std::int64_t N = c.N;
      const auto backward = [&](std::vector<T>& d, A at, double told) {
        loom::kernels::vocab_parallel_cross_entropy_backward<T>(
            be, Tensor<T>(d.data(), {N, c.padded}), Tensor<const T>(d.data(), {N, c.padded}),
            Tensor<const double>(got.row_max.data(), {N}), Tensor<const double>(got.partials.data(), {2, N}),
            Tensor<const std::int32_t>(targets.data(), {N}), 0, c.vocab, at, Tensor<const double>(&told, {1}));
      };
      std::vector<T> kept = got.dlogits;
      backward(kept, scale, flag);
      CHECK(same_bits(kept, want.dlogits));
      std::vector<T> doubled = got.dlogits, want_doubled = got.dlogits;
      loom::kernels::scale<T>(be, Tensor<T>(want_doubled.data(), {N, c.padded}), 2.0);
      backward(doubled, A(2) * scale, flag);
      CHECK(same_bits(doubled, want_doubled));
      std::vector<T> computed = logits;
      backward(computed, scale, 0.0);
      CHECK(same_bits(computed, want.dlogits));
    }
  }
}

TEST_CASE("cross_entropy_forward_backward and the backward's gradient_scale reject bad arguments, naming them") {
  const cpu be(1);
  std::vector<float> x(8, 0.f), losses(2);
  std::vector<double> m(2), partials(4), flag(2);
  std::vector<std::int32_t> targets{1, 3};
  const auto run = [&](std::int64_t columns, std::int64_t vocab, float scale, std::int64_t flags,
                       std::int64_t loss_rows) {
    loom::kernels::cross_entropy_forward_backward<float>(
        be, Tensor<float>(losses.data(), {loss_rows}), Tensor<double>(m.data(), {2}),
        Tensor<double>(partials.data(), {2, 2}), Tensor<float>(x.data(), {2, columns}),
        Tensor<const std::int32_t>(targets.data(), {2}), vocab, scale, Tensor<double>(flag.data(), {flags}));
  };
  expect_error([&] { run(4, 5, 1.f, 1, 2); }, "logits columns");
  expect_error([&] { run(4, 4, 0.f, 1, 2); }, "scale");
  expect_error([&] { run(4, 4, std::numeric_limits<float>::quiet_NaN(), 1, 2); }, "scale");
  expect_error([&] { run(4, 4, 1.f, 2, 2); }, "gradient_scale");
  expect_error([&] { run(4, 4, 1.f, 1, 1); }, "losses");
  targets[1] = 4;
  expect_error([&] { run(4, 4, 1.f, 1, 2); }, "targets[1]");
  targets[1] = 3;
  std::vector<float> other(8);
  expect_error(
      [&] {
        loom::kernels::vocab_parallel_cross_entropy_backward<float>(
            be, Tensor<float>(other.data(), {2, 4}), Tensor<const float>(x.data(), {2, 4}),
            Tensor<const double>(m.data(), {2}), Tensor<const double>(partials.data(), {4}),
            Tensor<const std::int32_t>(targets.data(), {2}), 0, 4, 1.f, Tensor<const double>(flag.data(), {1}));
      },
      "dlogits");
}

}  // namespace test_kernel_vocab_parallel
