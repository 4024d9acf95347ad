#include <doctest/doctest.h>

#include <cmath>

#include "loom/core/error.hpp"
#include "loom/optim/lr_schedule.hpp"

using namespace loom;

TEST_CASE("ConstantLr") {
  ConstantLr s{.lr = 3e-4};
  CHECK(s.at(0) == 3e-4);
  CHECK(s.at(1000000) == 3e-4);
}

TEST_CASE("WarmupCosineLr: exact values at step 0, end of warmup, middle, end") {
  const WarmupCosineLr s{.lr = 6e-4, .warmup = 10, .total_steps = 110, .min_lr_factor = 0.1};
  s.validate();
  CHECK(s.at(0) == 0.0);
  CHECK(s.at(5) == doctest::Approx(3e-4).epsilon(1e-15));
  CHECK(s.at(10) == doctest::Approx(6e-4).epsilon(1e-15));
  // Halfway through the decay the cosine is 0: the mean of lr and min_lr.
  CHECK(s.at(60) == doctest::Approx(0.5 * (6e-4 + 6e-5)).epsilon(1e-12));
  // A quarter of the way: min + (lr - min)(1 + cos(pi/4))/2.
  CHECK(s.at(35) == doctest::Approx(6e-5 + 5.4e-4 * 0.5 * (1 + std::cos(M_PI / 4))).epsilon(1e-12));
  CHECK(s.at(110) == doctest::Approx(6e-5).epsilon(1e-15));
  CHECK(s.at(500) == doctest::Approx(6e-5).epsilon(1e-15));
  // Monotone after warmup.
  for (int i = 10; i < 110; ++i) CHECK(s.at(i + 1) <= s.at(i));
}

TEST_CASE("WarmupCosineLr without warmup starts at lr; bad values are rejected") {
  const WarmupCosineLr s{.lr = 1.0, .warmup = 0, .total_steps = 4, .min_lr_factor = 0.0};
  CHECK(s.at(0) == 1.0);
  CHECK(s.at(4) == 0.0);
  CHECK_THROWS_AS((WarmupCosineLr{.lr = 1, .warmup = 10, .total_steps = 5}.validate()), Error);
  CHECK_THROWS_AS((WarmupCosineLr{.lr = 1, .warmup = 0, .total_steps = 5, .min_lr_factor = 2}.validate()), Error);
  CHECK_THROWS_AS((WarmupCosineLr{.lr = -1}.validate()), Error);
}
