#pragma once
//! \file SingleRank: the trivial strategy (one rank holds everything, nothing to communicate).
//! It fills the same Strategy slot DataParallel and Zero<N> fill.

#include <cstdint>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/parameters.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/parallel/concepts.hpp"

namespace loom {

//! Training on one rank: full parameters, gradients and optimizer state, no communication.
struct SingleRank {
  using loom_strategy = void;

  //! Owns the rank's flat buffers (DESIGN.md invariant 4) and applies the optimizer to them.
  template <Backend B, class T>
  class Engine {
   public:
    Engine(B& backend, const ParameterLayout& layout, int state_slots, std::uint64_t seed)
        : backend_(&backend),
          layout_(&layout),
          params_(backend, layout.total(), MemoryCategory::parameters),
          grads_(backend, layout.total(), MemoryCategory::gradients),
          state_(backend, layout.total() * state_slots, MemoryCategory::optimizer_state),
          state_slots_(state_slots) {
      // Initial values are computed on the host, then moved to the backend's memory.
      std::vector<T> host(static_cast<std::size_t>(layout.total()));
      layout.initialize(host.data(), seed);
      backend.copy_from_host(params_.data(), host.data(), params_.bytes());
      grads_.zero();
      state_.zero();
    }

    const T* params() const noexcept { return params_.data(); }
    T* grads() noexcept { return grads_.data(); }
    //! The full parameters, writable (to load a checkpoint).
    T* mutable_params() noexcept { return params_.data(); }

    void begin_step() { grads_.zero(); }
    void on_backward(int /*layer*/, bool /*last_micro_batch*/) {}
    void finish_gradients() {}
    double global_sum(double local) const noexcept { return local; }
    double grad_sum_of_squares() const {
      return sum_of_squares<T>(*backend_, Tensor<const T>(grads_.view()));
    }

    //! Scales the gradients by `grad_scale` (clipping) and applies `optimizer` to every
    //! parameter at learning rate `lr` for step `step` (from 1).
    template <Optimizer O>
    void update(const O& optimizer, double lr, std::int64_t step, double grad_scale) {
      if (grad_scale != 1.0) scale<T>(*backend_, grads_.view(), grad_scale);
      const std::int64_t total = layout_->total();
      for (const auto& e : layout_->entries()) {
        OptimizerSegment<T> s;
        s.params = {params_.data() + e.offset, Shape{e.numel()}};
        s.grads = {grads_.data() + e.offset, Shape{e.numel()}};
        for (int k = 0; k < state_slots_; ++k)
          s.state[k] = {state_.data() + k * total + e.offset, Shape{e.numel()}};
        s.weight_decay = e.spec.weight_decay;
        optimizer.update(*backend_, s, lr, step);
      }
    }

   private:
    B* backend_;
    const ParameterLayout* layout_;
    Buffer<T, B> params_, grads_, state_;
    int state_slots_;
  };
};

static_assert(Strategy<SingleRank>);

}  // namespace loom
