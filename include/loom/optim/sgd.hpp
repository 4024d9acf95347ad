#pragma once
//! \file SGD with momentum (PyTorch's formulation).

#include <cstdint>
#include <ostream>

#include "loom/core/error.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/optim/update_rules.hpp"

namespace loom {

//! SGD with momentum; weight decay (L2, added to the gradient) only on decayed segments.
//! One state slot: the momentum buffer.
class SgdMomentum {
 public:
  using loom_optimizer = void;
  //! Names the optimizer in checkpoints (whose state slots only it can read).
  static constexpr const char* name = "SgdMomentum";
  static constexpr int state_slots = 1;

  struct Options {
    double momentum = 0.9;
    double weight_decay = 0.0;
    bool nesterov = false;

    //! Throws loom::Error naming the first value that breaks a rule (PyTorch's).
    void validate() const {
      LOOM_CHECK(momentum >= 0, "SgdMomentum: momentum", momentum, "must be >= 0");
      LOOM_CHECK(weight_decay >= 0, "SgdMomentum: weight_decay", weight_decay, "must be >= 0");
      LOOM_CHECK(!nesterov || momentum > 0, "SgdMomentum: momentum", momentum, "must be > 0 with nesterov");
    }
    friend bool operator==(const Options&, const Options&) = default;
    friend std::ostream& operator<<(std::ostream& out, const Options& o) {
      return out << "{momentum=" << o.momentum << ", weight_decay=" << o.weight_decay
                 << ", nesterov=" << o.nesterov << "}";
    }
  };

  SgdMomentum() = default;
  explicit SgdMomentum(Options options) : options_(options) { options_.validate(); }
  const Options& options() const noexcept { return options_; }

  template <class B, class T>
  void update(B& backend, const OptimizerSegment<T>& s, double lr, std::int64_t /*step*/) const {
    const SgdUpdate h{.lr = lr,
                      .momentum = options_.momentum,
                      .weight_decay = s.weight_decay ? options_.weight_decay : 0.0,
                      .nesterov = options_.nesterov};
    if constexpr (is_narrow_storage<T>) {
      if (s.fp32_grads.data() != nullptr)
        sgd_momentum_update<T>(backend, s.params, s.fp32_grads, s.master, s.state[0], h);
      else
        sgd_momentum_update<T>(backend, s.params, s.grads, s.master, s.state[0], h);
    } else
      sgd_momentum_update<T>(backend, s.params, s.grads, s.state[0], h);
  }

 private:
  Options options_{};
};

static_assert(Optimizer<SgdMomentum>);

}  // namespace loom
