#pragma once
//! \file AdamW: Adam with decoupled weight decay (Loshchilov & Hutter, 2019), bias-corrected.

#include <cstdint>
#include <ostream>
#include <span>

#include "loom/core/error.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/optim/update_rules.hpp"

namespace loom {

//! AdamW. Weight decay applies only to segments marked for it (GPT-2: matrices and
//! embeddings, not biases or layernorm parameters). Two state slots: first and second moment.
class AdamW {
 public:
  using loom_optimizer = void;
  //! Names the optimizer in checkpoints (whose state slots only it can read).
  static constexpr const char* name = "AdamW";
  static constexpr int state_slots = 2;

  //! Hyper-parameters; the learning rate comes from the LR schedule each step.
  struct Options {
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;

    //! Throws loom::Error naming the first value that breaks a rule (PyTorch's: a beta of 1
    //! would divide by zero in the bias correction).
    void validate() const {
      LOOM_CHECK(beta1 >= 0 && beta1 < 1, "AdamW: beta1", beta1, "must be in [0, 1)");
      LOOM_CHECK(beta2 >= 0 && beta2 < 1, "AdamW: beta2", beta2, "must be in [0, 1)");
      LOOM_CHECK(eps >= 0, "AdamW: eps", eps, "must be >= 0");
      LOOM_CHECK(weight_decay >= 0, "AdamW: weight_decay", weight_decay, "must be >= 0");
    }
    friend bool operator==(const Options&, const Options&) = default;
    friend std::ostream& operator<<(std::ostream& out, const Options& o) {
      return out << "{beta1=" << o.beta1 << ", beta2=" << o.beta2 << ", eps=" << o.eps
                 << ", weight_decay=" << o.weight_decay << "}";
    }
  };

  AdamW() = default;
  explicit AdamW(Options options) : options_(options) { options_.validate(); }
  const Options& options() const noexcept { return options_; }

  //! Updates one segment in place (bf16 parameters through their fp32 master copy).
  template <class B, class T>
  void update(B& backend, const OptimizerSegment<T>& s, double lr, std::int64_t step) const {
    const AdamWUpdate h{.lr = lr,
                        .beta1 = options_.beta1,
                        .beta2 = options_.beta2,
                        .eps = options_.eps,
                        .weight_decay = s.weight_decay ? options_.weight_decay : 0.0,
                        .step = step};
    if constexpr (is_narrow_storage<T>) {
      if (s.fp32_grads.data() != nullptr)
        adamw_update<T>(backend, s.params, s.fp32_grads, s.master, s.state[0], s.state[1], h);
      else
        adamw_update<T>(backend, s.params, s.grads, s.master, s.state[0], s.state[1], h);
    } else
      adamw_update<T>(backend, s.params, s.grads, s.state[0], s.state[1], h);
  }

  //! Updates several segments (a flat range's, in order): where the backend has
  //! adamw_update_segments (cuda: a launch per 40 segments instead of one each), through it, else
  //! one by one. The same arithmetic either way.
  template <class B, class T>
  void update_segments(B& backend, std::span<const OptimizerSegment<T>> segments, double lr,
                       std::int64_t step) const {
    const AdamWUpdate h{.lr = lr,
                        .beta1 = options_.beta1,
                        .beta2 = options_.beta2,
                        .eps = options_.eps,
                        .weight_decay = options_.weight_decay,
                        .step = step};
    if constexpr (requires { adamw_update_segments<T>(backend, segments, h); })
      adamw_update_segments<T>(backend, segments, h);
    else
      for (const OptimizerSegment<T>& s : segments) update(backend, s, lr, step);
  }

 private:
  Options options_{};
};

static_assert(Optimizer<AdamW>);

}  // namespace loom
