#pragma once
//! \file Learning-rate schedules: small value types with `double at(step)`.

#include <cmath>
#include <concepts>
#include <cstdint>
#include <numbers>
#include <ostream>

#include "loom/core/error.hpp"

namespace loom {

//! A learning-rate schedule maps a step (from 0) to a learning rate.
template <class S>
concept LrSchedule = requires(const S& s, std::int64_t step) {
  { s.at(step) } -> std::convertible_to<double>;
};

//! The same rate at every step.
struct ConstantLr {
  double lr = 1e-3;
  double at(std::int64_t) const noexcept { return lr; }
  friend bool operator==(const ConstantLr&, const ConstantLr&) = default;
  friend std::ostream& operator<<(std::ostream& out, const ConstantLr& s) {
    return out << "constant(lr=" << s.lr << ")";
  }
};

//! Linear warmup from 0 over `warmup` steps, then cosine decay to `min_lr_factor × lr` at
//! `total_steps`, constant after. at(0) = 0 (when warmup > 0), at(warmup) = lr,
//! at(total_steps) = min_lr_factor × lr.
struct WarmupCosineLr {
  double lr = 6e-4;
  std::int64_t warmup = 0;
  std::int64_t total_steps = 1;
  double min_lr_factor = 0.0;

  double at(std::int64_t step) const noexcept {
    if (step < warmup) return lr * static_cast<double>(step) / static_cast<double>(warmup);
    const double min_lr = min_lr_factor * lr;
    if (step >= total_steps) return min_lr;
    const double progress =
        static_cast<double>(step - warmup) / static_cast<double>(total_steps - warmup);
    return min_lr + 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) * (lr - min_lr);
  }

  //! Throws loom::Error naming the first value that breaks a rule.
  void validate() const {
    LOOM_CHECK(lr >= 0, "lr schedule: lr", lr, "must be >= 0");
    LOOM_CHECK(warmup >= 0, "lr schedule: warmup", warmup, "must be >= 0");
    LOOM_CHECK(total_steps >= warmup, "lr schedule: total_steps", total_steps,
               "must be >= warmup (" + detail::to_text(warmup) + ")");
    LOOM_CHECK(min_lr_factor >= 0 && min_lr_factor <= 1, "lr schedule: min_lr_factor",
               min_lr_factor, "must be in [0, 1]");
  }

  friend bool operator==(const WarmupCosineLr&, const WarmupCosineLr&) = default;
  friend std::ostream& operator<<(std::ostream& out, const WarmupCosineLr& s) {
    return out << "warmup_cosine(lr=" << s.lr << ", warmup=" << s.warmup
               << ", total_steps=" << s.total_steps << ", min_lr_factor=" << s.min_lr_factor << ")";
  }
};

static_assert(LrSchedule<ConstantLr> && LrSchedule<WarmupCosineLr>);

}  // namespace loom
