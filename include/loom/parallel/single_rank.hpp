#pragma once
//! \file SingleRank: the trivial strategy (one rank holds everything, nothing to communicate).
//! It fills the same Strategy slot DataParallel and Zero<N> fill.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameters.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/parallel/concepts.hpp"
#include "loom/parallel/detail/flat_update.hpp"

namespace loom {

namespace detail {
//! The full flat parameter, gradient and optimizer-state buffers of a layout on one rank
//! (DESIGN.md invariant 4), parameters initialised from the seed (invariant 1). SingleRank and
//! DataParallel hold this; ZeRO holds shards instead.
template <class B, class T>
struct ReplicatedState {
  ReplicatedState(B& backend, const ParameterLayout& layout, int state_slots, std::uint64_t seed)
      : params(backend, layout.total(), MemoryCategory::parameters),
        grads(backend, layout.total(), MemoryCategory::gradients),
        state(backend, layout.total() * state_slots, MemoryCategory::optimizer_state) {
    // Initial values are computed on the host, then moved to the backend's memory.
    std::vector<T> host(static_cast<std::size_t>(layout.total()));
    layout.initialize(host.data(), seed);
    backend.copy_from_host(params.data(), host.data(), params.bytes());
    grads.zero();
    state.zero();
  }

  //! Scales the gradients by `grad_scale` (clipping) and applies `optimizer` to every parameter.
  template <Optimizer O>
  void update(B& backend, const ParameterLayout& layout, const O& optimizer, double lr,
              std::int64_t step, double grad_scale) {
    if (grad_scale != 1.0) scale<T>(backend, grads.view(), grad_scale);
    apply_optimizer(optimizer, backend, layout,
                    FlatRange<T>{.begin = 0, .end = layout.total(), .params = params.data(),
                                 .grads = grads.data(), .state = state.data(),
                                 .state_stride = layout.total()},
                    lr, step);
  }

  Buffer<T, B> params, grads, state;
};
}  // namespace detail

//! Training on one rank: full parameters, gradients and optimizer state, no communication.
struct SingleRank {
  using loom_strategy = void;

  friend bool operator==(const SingleRank&, const SingleRank&) = default;
  friend std::ostream& operator<<(std::ostream& out, const SingleRank&) { return out << "SingleRank{}"; }

  //! Owns the rank's flat buffers and applies the optimizer to them.
  template <Backend B, class T>
  class Engine {
   public:
    Engine(const SingleRank&, EngineContext<B> context)
        : backend_(&context.backend),
          layout_(&context.layout),
          state_((check_group(context.data_parallel), context.backend), context.layout,
                 context.state_slots, context.seed) {}

    const T* params() const noexcept { return state_.params.data(); }
    T* grads() noexcept { return state_.grads.data(); }
    //! The full parameters, writable (to load a checkpoint).
    T* mutable_params() noexcept { return state_.params.data(); }

    void begin_step() { state_.grads.zero(); }
    void on_backward(int /*layer*/, bool /*last_micro_batch*/) {}
    void finish_gradients() {}
    double global_sum(double local) const noexcept { return local; }
    double grad_sum_of_squares() const {
      return sum_of_squares<T>(*backend_, Tensor<const T>(state_.grads.view()));
    }

    //! Scales the gradients by `grad_scale` (clipping) and applies `optimizer` to every
    //! parameter at learning rate `lr` for step `step` (from 1).
    template <Optimizer O>
    void update(const O& optimizer, double lr, std::int64_t step, double grad_scale) {
      state_.update(*backend_, *layout_, optimizer, lr, step, grad_scale);
    }

   private:
    static void check_group(CommunicatorRef group) {
      LOOM_CHECK(group.size() == 1, "SingleRank: data-parallel ranks", group.size(),
                 "SingleRank trains on one rank; use DataParallel (or Zero<N>) for " +
                     std::to_string(group.size()) + " ranks");
    }
    B* backend_;
    const ParameterLayout* layout_;
    detail::ReplicatedState<B, T> state_;
  };
};

static_assert(Strategy<SingleRank>);

}  // namespace loom
