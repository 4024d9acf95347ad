#pragma once
//! \file SingleRank: the trivial strategy (one rank holds everything, nothing to communicate).
//! It fills the same Strategy slot DataParallel and Zero<N> fill.

#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/parallel/concepts.hpp"
#include "loom/parallel/detail/flat_update.hpp"

namespace loom {

namespace detail {
//! What SingleRank and DataParallel share: the full flat parameter, gradient and
//! optimizer-state buffers of the layout on this rank (DESIGN.md invariant 4), parameters
//! initialised from the seed (invariant 1), every layer seeing the whole buffers.
//!
//! With fp32 gradients (bf16 parameters and EngineContext::fp32_gradients), the reduction, the
//! norm and the optimizer read an fp32 buffer of gradient sums. Layers that fuse
//! (TrainerOptions::fp32_gradient_fusion) add their gradients to it themselves; what the others
//! write in bf16 into the flat buffer is drained into it after each layer's backward (sum +=
//! part, part = 0), so every layer's contribution of every micro-batch is added in fp32 (a tied
//! embedding's two uses too). Where every layer fuses, the bf16 buffer is not allocated
//! (EngineContext::layers_write_gradients).
template <class B, class T>
class ReplicatedEngine {
 public:
  using wide_type = accumulate_t<T>;

  ReplicatedEngine(EngineContext<B> context)
      : backend_(&context.backend),
        layout_(&context.layout),
        params_(context.backend, context.layout.total(), MemoryCategory::parameters),
        grads_(context.backend, context.template layers_write_gradients<T>() ? context.layout.total() : 0,
               MemoryCategory::gradients),
        wide_(context.backend, fp32_gradients_held(context) ? context.layout.total() : 0, MemoryCategory::gradients),
        drained_(fp32_gradients_held(context) ? context.drained() : std::vector<std::vector<ElementRange>>{}),
        state_(context.backend, context.layout.total() * context.state_slots, MemoryCategory::optimizer_state),
        master_(context.backend, context.layout.total()),
        state_slots_(context.state_slots),
        reports_state_(context.data_parallel.rank() == 0) {
    // Initial values are computed on the host, then moved to the backend's memory.
    std::vector<T> host(static_cast<std::size_t>(context.layout.total()));
    context.layout.initialize(host.data(), context.seed);
    context.backend.copy_from_host(params_.data(), host.data(), params_.bytes());
    master_.initialize(context.layout, 0, 0, context.layout.total(), context.seed);
    grads_.zero();
    wide_.zero();
    state_.zero();
  }

  //! Whether an engine built from `context` keeps fp32 gradients: bf16 parameters (float ones
  //! have them already) and EngineContext::fp32_gradients.
  static bool fp32_gradients_held(const EngineContext<B>& context) noexcept {
    return is_narrow_storage<T> && context.fp32_gradients;
  }
  //! Whether this engine keeps fp32 gradients.
  bool fp32_gradients() const noexcept { return wide_.size() > 0; }

  //! The full parameters and gradients, in layout order (gradients: null where the layers write
  //! none of T, EngineContext::layers_write_gradients).
  const T* params() const noexcept { return params_.data(); }
  T* mutable_params() noexcept { return params_.data(); }
  T* grads() noexcept { return grads_.size() > 0 ? grads_.data() : nullptr; }
  const T* grads() const noexcept { return grads_.size() > 0 ? grads_.data() : nullptr; }
  //! The fp32 gradient sums (null unless fp32_gradients()).
  wide_type* fp32_grads() noexcept { return fp32_gradients() ? wide_.data() : nullptr; }
  const wide_type* fp32_grads() const noexcept { return fp32_gradients() ? wide_.data() : nullptr; }
  //! The same as a view (every layer sees the whole buffer).
  ParameterView<wide_type> fp32_grads_view(int /*layer*/) noexcept { return ParameterView<wide_type>(fp32_grads()); }

  ParameterView<const T> forward_params(int /*layer*/) const noexcept { return ParameterView<const T>(params_.data()); }
  void after_forward(int /*layer*/) noexcept {}
  ParameterView<const T> backward_params(int /*layer*/) const noexcept { return ParameterView<const T>(params_.data()); }
  //! Empty where the layers write no gradient of T: a write through it throws.
  ParameterView<T> backward_grads(int /*layer*/) noexcept {
    return grads_.size() > 0 ? ParameterView<T>(grads_.data()) : ParameterView<T>{};
  }

  void begin_step() {
    grads_.zero();
    wide_.zero();
  }
  //! With fp32 gradients: moves the gradients of the elements `layer` reads from the bf16 buffer
  //! into the fp32 sums. Called after each of the layer's backwards; a contribution that comes
  //! later (the weight pass of a split backward) waits in the bf16 buffer for the next call. A
  //! layer reads only parameters of its own or of earlier layers, whose reductions have not begun.
  void drain(int layer) {
    if (!fp32_gradients() || layer >= static_cast<int>(drained_.size())) return;
    drain_ranges(*backend_, drained_[static_cast<std::size_t>(layer)], ParameterView<T>(grads_.data()),
                 ParameterView<wide_type>(wide_.data()));
  }
  //! Every rank holds the whole (reduced) gradient, so the local sum counts each element once;
  //! parameters replicated over tensor parallelism only when `count_replicated`.
  double grad_sum_of_squares(bool count_replicated = true) const {
    const std::int64_t total = layout_->total();
    return gradient_sum_of_squares(
        *backend_, *layout_, FlatRange<T>{.begin = 0, .end = total, .grads = grads(), .fp32_grads = fp32_grads()},
        count_replicated);
  }

  //! Scales the gradients by `grad_scale` (clipping), then calls `apply` with the ranges this
  //! rank updates (std::span<const FlatRange<T>>): the whole layout, in one range.
  template <class F>
  void update(double grad_scale, F&& apply) {
    if (grad_scale != 1.0) {
      if (fp32_gradients())
        scale<wide_type>(*backend_, wide_.view(), grad_scale);
      else
        scale<T>(*backend_, grads_.view(), grad_scale);
    }
    const std::int64_t total = layout_->total();
    const FlatRange<T> range{.begin = 0, .end = total, .params = params_.data(), .grads = grads(),
                             .fp32_grads = fp32_grads(), .state = state_.data(), .state_stride = total,
                             .master = master_.data()};
    apply(std::span<const FlatRange<T>>(&range, 1));
  }
  //! Sums `values` computed over the elements this rank updates into the values over all
  //! elements: nothing to do, every replica updates every element.
  void reduce_updated(std::span<double> /*values*/) const noexcept {}

  //! Copies the parameters, in layout order, to host memory `out` (layout().total() elements).
  void copy_parameters_to(T* out) const { backend_->copy_to_host(out, params_.data(), params_.bytes()); }
  //! Replaces the parameters with `in` (host memory, layout order), e.g. from a checkpoint: of T
  //! or, for bf16 parameters, fp32 (the master weights take it exactly, the parameters rounded).
  template <class U>
  void load_parameters(const U* in) {
    if constexpr (std::is_same_v<U, T>)
      backend_->copy_from_host(params_.data(), in, params_.bytes());
    else
      backend_->copy_from_host(params_.data(), stored_as<T>(in, layout_->total()).data(), params_.bytes());
    master_.load(0, in, layout_->total());
  }

  //! The layout ranges of the training state this rank reports: all of it on data-parallel
  //! rank 0 (every replica holds the same values), none elsewhere.
  std::vector<ElementRange> owned_state_ranges() const {
    if (!reports_state_) return {};
    return {ElementRange{0, layout_->total()}};
  }
  //! The layout ranges load_state takes: all of it (every replica holds everything).
  std::vector<ElementRange> needed_state_ranges(int /*array*/) const { return {ElementRange{0, layout_->total()}}; }
  //! Writes training-state array `array` to host `out` (owned_state_ranges() one after another)
  //! if this rank reports it: array 0 is the parameters at the optimizer's precision (the fp32
  //! master weights of bf16 parameters), array k >= 1 the optimizer's state slot k - 1.
  void copy_owned_state_to(int array, accumulate_t<T>* out) {
    check_state_array(array, state_slots_);
    if (!reports_state_) return;
    const std::int64_t total = layout_->total();
    const std::size_t bytes = sizeof(accumulate_t<T>) * static_cast<std::size_t>(total);
    if (array > 0)
      backend_->copy_to_host(out, state_.data() + (array - 1) * total, bytes);
    else if constexpr (MasterWeights<B, T>::held)
      backend_->copy_to_host(out, master_.data(), bytes);
    else
      backend_->copy_to_host(out, params_.data(), bytes);
  }
  //! Replaces training-state array `array` (as in copy_owned_state_to) with host `in`, every
  //! element of the layout (needed_state_ranges); the parameters of bf16 models become the master
  //! weights rounded.
  void load_state(int array, const accumulate_t<T>* in) {
    check_state_array(array, state_slots_);
    if (array == 0) return load_parameters(in);
    const std::int64_t total = layout_->total();
    backend_->copy_from_host(state_.data() + (array - 1) * total, in,
                             sizeof(accumulate_t<T>) * static_cast<std::size_t>(total));
  }

 protected:
  B& backend() const noexcept { return *backend_; }
  Buffer<T, B>& gradient_buffer() noexcept { return grads_; }

 private:
  B* backend_;
  const ParameterLayout* layout_;
  Buffer<T, B> params_, grads_;
  Buffer<wide_type, B> wide_;  // empty unless fp32 gradients
  std::vector<std::vector<ElementRange>> drained_;  // per layer, what it drains (fp32 gradients only)
  Buffer<accumulate_t<T>, B> state_;
  MasterWeights<B, T> master_;
  int state_slots_;
  bool reports_state_;
};
}  // namespace detail

//! Training on one rank: full parameters, gradients and optimizer state, no communication.
struct SingleRank {
  using loom_strategy = void;

  friend bool operator==(const SingleRank&, const SingleRank&) = default;
  friend std::ostream& operator<<(std::ostream& out, const SingleRank&) { return out << "SingleRank{}"; }

  //! Owns the rank's flat buffers and applies the optimizer to them.
  template <Backend B, class T>
  class Engine : public detail::ReplicatedEngine<B, T> {
   public:
    Engine(const SingleRank&, EngineContext<B> context)
        : detail::ReplicatedEngine<B, T>((check_group(context.data_parallel), context)) {}

    void on_backward(int layer, bool /*last_micro_batch*/) { this->drain(layer); }
    void finish_gradients() noexcept {}
    double global_sum(double local) const noexcept { return local; }

   private:
    static void check_group(CommunicatorRef group) {
      LOOM_CHECK(group.size() == 1, "SingleRank: data-parallel ranks", group.size(),
                 "SingleRank trains on one rank; use DataParallel (or Zero<N>) for " +
                     std::to_string(group.size()) + " ranks");
    }
  };
};

static_assert(Strategy<SingleRank>);

}  // namespace loom
