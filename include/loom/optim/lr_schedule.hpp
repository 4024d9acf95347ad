#pragma once
//! \file Learning-rate schedules: small value types with `double at(step)`.

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <numbers>
#include <ostream>
#include <string_view>

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

//! How a WarmupDecayLr falls from `lr` to `min_lr_factor × lr` after its warmup: the decay
//! styles of Megatron-LM's `--lr-decay-style` and Hugging Face's `lr_scheduler_type`.
enum class LrDecay {
  cosine,        //!< half a cosine from lr at `warmup` to the minimum at `total_steps`
  linear,        //!< a straight line over the same span (BERT's and Hugging Face's default)
  constant,      //!< lr from `warmup` on; `total_steps` and the minimum are not used
  inverse_sqrt,  //!< lr · sqrt(warmup / step) from `warmup` on, never below the minimum (Transformer, T5)
  warmup_stable_decay,  //!< lr until `total_steps − decay_steps`, then `cooldown`'s shape to the minimum
};

//! The shape of a warmup-stable-decay schedule's final decay (its cooldown), over progress p
//! from 0 to 1: the share of `lr − min` left is 1 − p (linear), (1 + cos πp) / 2 (cosine) or
//! 1 − sqrt(p) (`one_minus_sqrt`, which Hägele et al. 2024, "Scaling Laws and Compute-Optimal
//! Training Beyond Fixed Training Durations", found to do best).
enum class LrCooldown { linear, cosine, one_minus_sqrt };

//! The name `--lr-decay` and `operator<<` use: cosine, linear, constant, inverse-sqrt, wsd.
constexpr std::string_view name(LrDecay d) noexcept {
  switch (d) {
    case LrDecay::cosine: return "cosine";
    case LrDecay::linear: return "linear";
    case LrDecay::constant: return "constant";
    case LrDecay::inverse_sqrt: return "inverse-sqrt";
    case LrDecay::warmup_stable_decay: return "wsd";
  }
  return "?";
}

//! The name `--wsd-cooldown` and `operator<<` use: linear, cosine, 1-sqrt.
constexpr std::string_view name(LrCooldown c) noexcept {
  switch (c) {
    case LrCooldown::linear: return "linear";
    case LrCooldown::cosine: return "cosine";
    case LrCooldown::one_minus_sqrt: return "1-sqrt";
  }
  return "?";
}

//! Linear warmup from 0 over `warmup` steps to `lr`, then `decay` down to `min_lr_factor × lr`,
//! reached at `total_steps` and kept after it (Megatron-LM's `--lr-decay-iters`: give the step
//! the decay ends at, which may come before the run's last). at(0) = 0 when warmup > 0.
//! Under `warmup_stable_decay` the rate stays at `lr` until `total_steps − decay_steps` and then
//! falls along `cooldown` over the last `decay_steps` (Hu et al. 2024, MiniCPM).
struct WarmupDecayLr {
  double lr = 6e-4;
  std::int64_t warmup = 0;
  std::int64_t total_steps = 1;
  double min_lr_factor = 0.0;
  LrDecay decay = LrDecay::cosine;
  std::int64_t decay_steps = 0;  //!< warmup_stable_decay only: the cooldown's length
  LrCooldown cooldown = LrCooldown::one_minus_sqrt;  //!< warmup_stable_decay only

  double at(std::int64_t step) const noexcept {
    if (step < warmup) return lr * static_cast<double>(step) / static_cast<double>(warmup);
    const double min_lr = min_lr_factor * lr;
    if (decay == LrDecay::constant) return lr;
    if (decay == LrDecay::inverse_sqrt)  // lr at `warmup` (or step 1 without one), halved at 4×
      return std::max(min_lr, lr * std::sqrt(static_cast<double>(std::max<std::int64_t>(warmup, 1)) /
                                             static_cast<double>(std::max<std::int64_t>(step, 1))));
    if (step >= total_steps) return min_lr;
    const std::int64_t begin = decay == LrDecay::warmup_stable_decay ? total_steps - decay_steps : warmup;
    if (step < begin) return lr;
    const double progress = static_cast<double>(step - begin) / static_cast<double>(total_steps - begin);
    return min_lr + remaining(progress) * (lr - min_lr);
  }

  //! Throws loom::Error naming the first value that breaks a rule.
  void validate() const {
    LOOM_CHECK(lr >= 0, "lr schedule: lr", lr, "must be >= 0");
    LOOM_CHECK(warmup >= 0, "lr schedule: warmup", warmup, "must be >= 0");
    LOOM_CHECK(min_lr_factor >= 0 && min_lr_factor <= 1, "lr schedule: min_lr_factor", min_lr_factor,
               "must be in [0, 1]");
    if (!has_end()) return;
    LOOM_CHECK(total_steps >= warmup, "lr schedule: total_steps", total_steps,
               "must be >= warmup (" + detail::to_text(warmup) + ")");
    if (decay != LrDecay::warmup_stable_decay) return;
    LOOM_CHECK(decay_steps >= 1 && decay_steps <= total_steps - warmup, "lr schedule: decay_steps", decay_steps,
               "must be in [1, total_steps - warmup] = [1, " + detail::to_text(total_steps - warmup) +
                   "]: the cooldown comes after the warmup");
  }

  //! Whether the decay ends at `total_steps` (constant and inverse_sqrt have no end step).
  constexpr bool has_end() const noexcept { return decay != LrDecay::constant && decay != LrDecay::inverse_sqrt; }

  friend bool operator==(const WarmupDecayLr&, const WarmupDecayLr&) = default;
  friend std::ostream& operator<<(std::ostream& out, const WarmupDecayLr& s) {
    out << "warmup_" << (s.decay == LrDecay::warmup_stable_decay ? "stable_decay" : name(s.decay))
        << "(lr=" << s.lr << ", warmup=" << s.warmup;
    if (s.has_end()) out << ", total_steps=" << s.total_steps;
    if (s.decay == LrDecay::warmup_stable_decay)
      out << ", decay_steps=" << s.decay_steps << ", cooldown=" << name(s.cooldown);
    if (s.decay != LrDecay::constant) out << ", min_lr_factor=" << s.min_lr_factor;
    return out << ")";
  }

 private:
  // The share of lr - min_lr left at `progress` through the decay (1 at 0, 0 at 1).
  // A cosine or linear decay is the cooldown of that shape over the whole span after the warmup.
  double remaining(double progress) const noexcept {
    const LrCooldown shape = decay == LrDecay::cosine   ? LrCooldown::cosine
                             : decay == LrDecay::linear ? LrCooldown::linear
                                                        : cooldown;
    switch (shape) {
      case LrCooldown::cosine: return 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
      case LrCooldown::one_minus_sqrt: return 1.0 - std::sqrt(progress);
      case LrCooldown::linear: break;
    }
    return 1.0 - progress;
  }
};

//! Linear warmup from 0 over `warmup` steps, then cosine decay to `min_lr_factor × lr` at
//! `total_steps`, constant after. at(0) = 0 (when warmup > 0), at(warmup) = lr,
//! at(total_steps) = min_lr_factor × lr. WarmupDecayLr with LrDecay::cosine, by name.
struct WarmupCosineLr {
  double lr = 6e-4;
  std::int64_t warmup = 0;
  std::int64_t total_steps = 1;
  double min_lr_factor = 0.0;

  double at(std::int64_t step) const noexcept { return general().at(step); }

  //! Throws loom::Error naming the first value that breaks a rule.
  void validate() const { general().validate(); }

  //! The same schedule as a WarmupDecayLr.
  constexpr WarmupDecayLr general() const noexcept {
    return {.lr = lr, .warmup = warmup, .total_steps = total_steps, .min_lr_factor = min_lr_factor};
  }

  friend bool operator==(const WarmupCosineLr&, const WarmupCosineLr&) = default;
  friend std::ostream& operator<<(std::ostream& out, const WarmupCosineLr& s) { return out << s.general(); }
};

static_assert(LrSchedule<ConstantLr> && LrSchedule<WarmupCosineLr> && LrSchedule<WarmupDecayLr>);

}  // namespace loom
