#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "loom/core/error.hpp"
#include "loom/optim/lr_schedule.hpp"

namespace test_lr_schedule {

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

TEST_CASE("WarmupCosineLr is WarmupDecayLr with the cosine decay, value for value") {
  const WarmupCosineLr named{.lr = 6e-4, .warmup = 7, .total_steps = 93, .min_lr_factor = 0.1};
  const WarmupDecayLr general{.lr = 6e-4, .warmup = 7, .total_steps = 93, .min_lr_factor = 0.1};
  CHECK(named.general() == general);
  for (std::int64_t s = 0; s < 120; ++s) CHECK(named.at(s) == general.at(s));
  CHECK(detail::to_text(named) == "warmup_cosine(lr=0.0006, warmup=7, total_steps=93, min_lr_factor=0.1)");
}

TEST_CASE("WarmupDecayLr linear: a straight line from lr at warmup to the minimum at total_steps") {
  const WarmupDecayLr s{.lr = 1.0, .warmup = 10, .total_steps = 110, .min_lr_factor = 0.2, .decay = LrDecay::linear};
  s.validate();
  CHECK(s.at(0) == 0.0);
  CHECK(s.at(5) == doctest::Approx(0.5).epsilon(1e-15));
  CHECK(s.at(10) == 1.0);
  CHECK(s.at(35) == doctest::Approx(0.2 + 0.8 * 0.75).epsilon(1e-15));
  CHECK(s.at(60) == doctest::Approx(0.6).epsilon(1e-15));
  CHECK(s.at(110) == doctest::Approx(0.2).epsilon(1e-15));
  CHECK(s.at(1000) == doctest::Approx(0.2).epsilon(1e-15));
  // Equal steps fall by equal amounts: the line's slope is (1 - 0.2) / 100 throughout.
  for (int i = 10; i < 110; ++i) CHECK(s.at(i) - s.at(i + 1) == doctest::Approx(0.008).epsilon(1e-9));
  CHECK(detail::to_text(s) == "warmup_linear(lr=1, warmup=10, total_steps=110, min_lr_factor=0.2)");
}

TEST_CASE("WarmupDecayLr constant: lr after the warmup, whatever total_steps says") {
  const WarmupDecayLr s{.lr = 3e-4, .warmup = 4, .total_steps = 1, .min_lr_factor = 0.5, .decay = LrDecay::constant};
  s.validate();  // no end step to check
  CHECK(s.at(2) == doctest::Approx(1.5e-4).epsilon(1e-15));
  for (std::int64_t step : {4, 5, 100, 1000000}) CHECK(s.at(step) == 3e-4);
  CHECK(detail::to_text(s) == "warmup_constant(lr=0.0003, warmup=4)");
}

TEST_CASE("WarmupDecayLr inverse-sqrt: lr at the end of the warmup, halved at four times it, floored") {
  const WarmupDecayLr s{.lr = 1e-3, .warmup = 100, .min_lr_factor = 0.05, .decay = LrDecay::inverse_sqrt};
  s.validate();
  CHECK(s.at(50) == doctest::Approx(5e-4).epsilon(1e-15));
  CHECK(s.at(100) == doctest::Approx(1e-3).epsilon(1e-15));
  CHECK(s.at(400) == doctest::Approx(5e-4).epsilon(1e-15));
  CHECK(s.at(10000) == doctest::Approx(1e-4).epsilon(1e-15));
  CHECK(s.at(40000) == doctest::Approx(5e-5).epsilon(1e-15));      // lr / 20: the floor itself
  CHECK(s.at(4000000) == doctest::Approx(5e-5).epsilon(1e-15));    // held at min_lr_factor x lr
  // Without a warmup it starts at lr at step 0 and 1 and follows 1/sqrt(step).
  const WarmupDecayLr bare{.lr = 1.0, .decay = LrDecay::inverse_sqrt};
  CHECK(bare.at(0) == 1.0);
  CHECK(bare.at(1) == 1.0);
  CHECK(bare.at(9) == doctest::Approx(1.0 / 3).epsilon(1e-15));
  CHECK(detail::to_text(s) == "warmup_inverse-sqrt(lr=0.001, warmup=100, min_lr_factor=0.05)");
}

TEST_CASE("WarmupDecayLr warmup-stable-decay: flat at lr, then each cooldown shape to the minimum") {
  // Warmup 10, stable to step 80, cooldown over the last 20 steps to 0.1.
  WarmupDecayLr s{.lr = 1.0, .warmup = 10, .total_steps = 100, .min_lr_factor = 0.1,
                  .decay = LrDecay::warmup_stable_decay, .decay_steps = 20};
  for (LrCooldown shape : {LrCooldown::linear, LrCooldown::cosine, LrCooldown::one_minus_sqrt}) {
    CAPTURE(name(shape));
    s.cooldown = shape;
    s.validate();
    CHECK(s.at(0) == 0.0);
    CHECK(s.at(5) == 0.5);
    for (std::int64_t step = 10; step <= 80; ++step) CHECK(s.at(step) == 1.0);
    CHECK(s.at(100) == doctest::Approx(0.1).epsilon(1e-15));
    CHECK(s.at(150) == doctest::Approx(0.1).epsilon(1e-15));
    for (std::int64_t step = 80; step < 100; ++step) CHECK(s.at(step + 1) < s.at(step));
  }
  // A quarter of the way through the cooldown (step 85) the share of lr - min left is
  // 3/4 (linear), (1 + cos(pi/4))/2 (cosine) and 1 - 1/2 (1-sqrt).
  s.cooldown = LrCooldown::linear;
  CHECK(s.at(85) == doctest::Approx(0.1 + 0.9 * 0.75).epsilon(1e-15));
  s.cooldown = LrCooldown::cosine;
  CHECK(s.at(85) == doctest::Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI / 4))).epsilon(1e-15));
  s.cooldown = LrCooldown::one_minus_sqrt;
  CHECK(s.at(85) == doctest::Approx(0.1 + 0.9 * 0.5).epsilon(1e-15));
  CHECK(detail::to_text(s) ==
        "warmup_stable_decay(lr=1, warmup=10, total_steps=100, decay_steps=20, cooldown=1-sqrt, min_lr_factor=0.1)");
  // The cooldown may take everything after the warmup: then it is a decay with that shape.
  s.decay_steps = 90;
  s.cooldown = LrCooldown::linear;
  WarmupDecayLr linear = s;
  linear.decay = LrDecay::linear;
  for (std::int64_t step = 0; step <= 110; ++step) CHECK(s.at(step) == doctest::Approx(linear.at(step)).epsilon(1e-15));
}

TEST_CASE("WarmupDecayLr: bad values are refused by name") {
  const auto message = [](const WarmupDecayLr& s) {
    try {
      s.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const WarmupDecayLr wsd{.lr = 1, .warmup = 10, .total_steps = 100, .decay = LrDecay::warmup_stable_decay,
                          .decay_steps = 20};
  CHECK(message(wsd) == "no error");
  WarmupDecayLr bad = wsd;
  bad.decay_steps = 0;
  CHECK(message(bad).find("decay_steps: got 0") != std::string::npos);
  bad.decay_steps = 91;  // would start inside the warmup
  CHECK(message(bad).find("must be in [1, total_steps - warmup] = [1, 90]") != std::string::npos);
  bad = wsd;
  bad.total_steps = 5;
  CHECK(message(bad).find("total_steps: got 5") != std::string::npos);
  bad = wsd;
  bad.min_lr_factor = 1.5;
  CHECK(message(bad).find("min_lr_factor: got 1.5") != std::string::npos);
  bad = {.lr = -1, .decay = LrDecay::linear};
  CHECK(message(bad).find("lr: got -1") != std::string::npos);
}

}  // namespace test_lr_schedule
