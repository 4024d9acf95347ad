// The synthetic Markov task: determinism, global identity of sequences, statistics and the
// entropy floor.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "loom/io/synthetic.hpp"

namespace test_io_synthetic {

using loom::io::Batch;
using loom::io::SyntheticMarkov;
using loom::io::SyntheticMarkovConfig;

TEST_CASE("synthetic: is a TokenSource with a validated config") {
  static_assert(loom::io::TokenSource<SyntheticMarkov>);
  const SyntheticMarkov task;
  CHECK(task.config() == SyntheticMarkovConfig{.vocab_size = 256, .jump_probability = 0.1,
                                               .seed = 1234});
  CHECK(task.vocab_size() == 256);
  CHECK_THROWS_WITH_AS(SyntheticMarkov({.vocab_size = 1}), doctest::Contains("vocab_size: got 1"),
                       loom::Error);
  CHECK_THROWS_WITH_AS(SyntheticMarkov({.jump_probability = -0.5}),
                       doctest::Contains("jump_probability: got -0.5"), loom::Error);
  CHECK_THROWS_WITH_AS(SyntheticMarkov({.jump_probability = 1.5}),
                       doctest::Contains("jump_probability: got 1.5"), loom::Error);
  CHECK_THROWS_AS(SyntheticMarkov({.jump_probability = std::numeric_limits<double>::quiet_NaN()}),
                  loom::Error);
  CHECK_THROWS_WITH_AS(task.batch_at(0, 0, 4), doctest::Contains("batch: got 0"), loom::Error);
  CHECK_THROWS_WITH_AS(task.batch_at(-3, 1, 4), doctest::Contains("step: got -3"), loom::Error);
}

TEST_CASE("synthetic: the permutation is a permutation, fixed by the seed") {
  const SyntheticMarkov a({.vocab_size = 1000, .seed = 5});
  std::vector<std::int32_t> p(a.permutation().begin(), a.permutation().end());
  std::vector<std::int32_t> sorted = p;
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::int32_t> identity(1000);
  std::iota(identity.begin(), identity.end(), 0);
  CHECK(sorted == identity);
  CHECK(p != identity);
  const SyntheticMarkov again({.vocab_size = 1000, .seed = 5});
  CHECK(std::equal(p.begin(), p.end(), again.permutation().begin()));
  const SyntheticMarkov other({.vocab_size = 1000, .seed = 6});
  CHECK_FALSE(std::equal(p.begin(), p.end(), other.permutation().begin()));
}

TEST_CASE("synthetic: batches are deterministic and mesh-independent") {
  const SyntheticMarkov task;
  const Batch b = task.batch_at(3, 8, 32);
  CHECK(b.batch == 8);
  CHECK(b.seq == 32);
  CHECK(SyntheticMarkov().batch_at(3, 8, 32) == b);  // a fresh instance agrees
  CHECK(task.batch_at(4, 8, 32) != b);
  CHECK(SyntheticMarkov({.seed = 99}).batch_at(3, 8, 32) != b);
  // Sequence j depends only on j: step 3 of batch 8 == steps 6 and 7 of batch 4.
  CHECK(b.rows(0, 4) == task.batch_at(6, 4, 32));
  CHECK(b.rows(4, 4) == task.batch_at(7, 4, 32));
  // A shorter seq is a prefix of the same sequences.
  const Batch short_batch = task.batch_at(3, 8, 10);
  for (std::int64_t i = 0; i < 8; ++i)
    for (std::int64_t t = 0; t < 10; ++t) {
      CHECK(short_batch.tokens[i * 10 + t] == b.tokens[i * 32 + t]);
      CHECK(short_batch.targets[i * 10 + t] == b.targets[i * 32 + t]);
    }
  // Targets are the tokens shifted by one; all are in the vocabulary and none is ignored.
  CHECK(b.target_count() == 8 * 32);
  for (std::int64_t i = 0; i < 8; ++i)
    for (std::int64_t t = 0; t + 1 < 32; ++t)
      CHECK(b.targets[i * 32 + t] == b.tokens[i * 32 + t + 1]);
  CHECK(std::all_of(b.tokens.begin(), b.tokens.end(), [](std::int32_t x) { return x >= 0 && x < 256; }));
}

TEST_CASE("synthetic: transition statistics and the entropy floor") {
  for (const double q : {0.0, 0.1, 0.5, 1.0}) {
    CAPTURE(q);
    const SyntheticMarkov task({.vocab_size = 64, .jump_probability = q, .seed = 42});
    const auto p = task.permutation();
    const double v = 64.0;
    std::int64_t follows = 0, total = 0;
    double log_loss = 0.0;  // cross-entropy of the predictor that knows P
    std::vector<std::int64_t> histogram(64, 0);
    std::int64_t out_of_vocab = 0;
    for (std::int64_t step = 0; step < 4; ++step) {
      const Batch b = task.batch_at(step, 16, 256);
      for (std::size_t k = 0; k < b.tokens.size(); ++k) {
        const std::int32_t x = b.tokens[k], y = b.targets[k];
        if (x < 0 || x >= 64 || y < 0 || y >= 64) {
          ++out_of_vocab;
          continue;
        }
        const bool follow = y == p[static_cast<std::size_t>(x)];
        follows += follow ? 1 : 0;
        log_loss -= std::log(follow ? 1.0 - q + q / v : q / v);
        ++histogram[static_cast<std::size_t>(y)];
        ++total;
      }
    }
    REQUIRE(out_of_vocab == 0);
    const double expected_follow = 1.0 - q + q / v;  // a jump may land on P[x] too
    CHECK(static_cast<double>(follows) / static_cast<double>(total) ==
          doctest::Approx(expected_follow).epsilon(0.02));
    CHECK(log_loss / static_cast<double>(total) ==
          doctest::Approx(task.entropy_floor()).epsilon(0.03).scale(1.0));
    if (q == 1.0)  // uniform tokens: every value appears about total / V times
      for (std::int64_t count : histogram)
        CHECK(static_cast<double>(count) ==
              doctest::Approx(static_cast<double>(total) / v).epsilon(0.2));
  }
}

TEST_CASE("synthetic: entropy floor values") {
  CHECK(SyntheticMarkov({.jump_probability = 0.0}).entropy_floor() == 0.0);
  CHECK(SyntheticMarkov({.vocab_size = 256, .jump_probability = 1.0}).entropy_floor() ==
        doctest::Approx(std::log(256.0)).epsilon(1e-12));
  CHECK(SyntheticMarkov({.vocab_size = 2, .jump_probability = 1.0}).entropy_floor() ==
        doctest::Approx(std::log(2.0)).epsilon(1e-12));
  const double q = 0.1, v = 256.0, follow = 1.0 - q + q / v, other = q / v;
  const double expected = -follow * std::log(follow) - (v - 1.0) * other * std::log(other);
  CHECK(SyntheticMarkov().entropy_floor() == doctest::Approx(expected).epsilon(1e-12));
  CHECK(SyntheticMarkov().entropy_floor() == doctest::Approx(0.8761).epsilon(1e-3));
  // More noise, more entropy.
  CHECK(SyntheticMarkov({.jump_probability = 0.2}).entropy_floor() >
        SyntheticMarkov({.jump_probability = 0.1}).entropy_floor());
}

}  // namespace test_io_synthetic
