#pragma once
//! \file Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
//! Cost", ICML 2018, Algorithms 4 and 5 with update clipping and the relative step size): the
//! second moment of a matrix is kept as its row sums and column sums, n + m numbers instead of
//! n·m, and there is no first moment. Its optimizer state is a few megabytes for GPT-2 small,
//! against AdamW's 8 bytes per parameter.
//!
//! Every statistic is of the whole tensor one rank would hold: ranks that hold slices of it
//! (tensor parallelism) or pieces (ZeRO) add their parts, reduce them over the ranks that share
//! the tensor, and keep identical per-tensor state, so every layout steps the same weights.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <span>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/memory.hpp"
#include "loom/core/parameters.hpp"
#include "loom/core/whole_index.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/optim/update_rules.hpp"

namespace loom {

//! Adafactor. For a parameter whose whole shape has rank >= 2, seen as a matrix [rows, cols]
//! (cols the last extent), step t (from 1) does, with G the gradient:
//!
//!     beta2 = 1 - t^(-decay_rate)
//!     R = beta2 R + (1 - beta2) rowsum(G² + eps1)        (rows numbers)
//!     C = beta2 C + (1 - beta2) colsum(G² + eps1)        (cols numbers)
//!     U = G / sqrt(R C / sum(R))                          (V = R C / sum(R) estimates G²'s average)
//!     U = U / max(1, RMS(U) / clip_threshold)             (update clipping)
//!     rho = relative_step ? min(lr, 1/sqrt(t)) : lr
//!     step = scale_parameter ? max(eps2, RMS(P)) rho : rho
//!     P = P (1 - rho weight_decay) - step U               (decay only on decayed parameters)
//!
//! A vector (biases, layernorms) keeps V = beta2 V + (1 - beta2)(G² + eps1) per element and
//! U = G / sqrt(V). RMS is over the whole tensor. The learning rate comes from the LR schedule;
//! with the relative step and parameter scaling (the defaults, as in the paper and PyTorch's
//! torch.optim.Adafactor) it is a cap, and useful values are around 1e-2, not AdamW's 6e-4.
class Adafactor {
 public:
  using loom_optimizer = void;
  //! Names the optimizer in checkpoints (whose per-tensor state only it can read).
  static constexpr const char* name = "Adafactor";
  //! No state per element: all of it is per tensor (State).
  static constexpr int state_slots = 0;
  static constexpr bool tensorwise = true;

  //! Hyper-parameters; the paper's defaults.
  struct Options {
    double decay_rate = 0.8;      //!< beta2 at step t is 1 - t^(-decay_rate)
    double eps1 = 1e-30;          //!< added to each squared gradient
    double eps2 = 1e-3;           //!< floor of a tensor's RMS in the parameter-scaled step
    double clip_threshold = 1.0;  //!< updates whose RMS is above it are scaled down to it
    double weight_decay = 0.0;    //!< decoupled, on decayed parameters: P -= rho weight_decay P
    bool relative_step = true;    //!< rho = min(lr, 1/sqrt(t)); otherwise rho = lr
    bool scale_parameter = true;  //!< step = max(eps2, RMS(P)) rho; otherwise rho

    //! Throws loom::Error naming the first value that breaks a rule.
    void validate() const {
      LOOM_CHECK(decay_rate > 0 && decay_rate <= 1, "Adafactor: decay_rate", decay_rate,
                 "must be in (0, 1] (beta2 at step t is 1 - t^-decay_rate)");
      LOOM_CHECK(eps1 > 0, "Adafactor: eps1", eps1, "must be > 0");
      LOOM_CHECK(eps2 >= 0, "Adafactor: eps2", eps2, "must be >= 0");
      LOOM_CHECK(clip_threshold > 0, "Adafactor: clip_threshold", clip_threshold, "must be > 0");
      LOOM_CHECK(weight_decay >= 0, "Adafactor: weight_decay", weight_decay, "must be >= 0");
    }
    friend bool operator==(const Options&, const Options&) = default;
    friend std::ostream& operator<<(std::ostream& out, const Options& o) {
      return out << "{decay_rate=" << o.decay_rate << ", eps1=" << o.eps1 << ", eps2=" << o.eps2
                 << ", clip_threshold=" << o.clip_threshold << ", weight_decay=" << o.weight_decay
                 << ", relative_step=" << o.relative_step << ", scale_parameter=" << o.scale_parameter << "}";
    }
  };

  Adafactor() = default;
  explicit Adafactor(Options options) : options_(options) { options_.validate(); }
  const Options& options() const noexcept { return options_; }

  //! The moments of every parameter of a layout, in its order: for parameter p, R (rows
  //! numbers) then C (cols numbers) of its whole shape's matrix view, in double; a vector keeps
  //! V in R's place and its sum in C's. Each rank that holds any part of a parameter keeps its
  //! whole moments (every such rank computes the same values from the same reduced sums).
  //! Besides, in the backend's memory: the sums being reduced and the row and column scales the
  //! update reads. All three are counted as optimizer state.
  template <Backend B, class T>
  class State {
   public:
    using A = accumulate_t<T>;

    State(B& backend, const ParameterLayout& layout) : backend_(&backend) {
      offsets_.reserve(layout.entries().size() + 1);
      std::int64_t total = 0;
      for (const auto& e : layout.entries()) {
        offsets_.push_back(total);
        views_.push_back(matrix_view(e.spec.whole_shape()));
        total += numbers(e.spec.whole_shape());
      }
      offsets_.push_back(total);
      moments_ = Buffer<double, B>(backend, total, MemoryCategory::optimizer_state);
      sums_ = Buffer<double, B>(backend, total, MemoryCategory::optimizer_state);
      scales_ = Buffer<A, B>(backend, total, MemoryCategory::optimizer_state);
      moments_.zero();
      host_sums_.resize(static_cast<std::size_t>(total) + layout.entries().size());
      host_moments_.resize(static_cast<std::size_t>(total));
      host_scales_.resize(static_cast<std::size_t>(total));
    }

    //! Numbers of moments of a parameter of whole shape `whole`: rows + cols of its matrix view.
    static std::int64_t numbers(const Shape& whole) {
      const MatrixView v = matrix_view(whole);
      return v.rows + v.cols;
    }
    //! Bytes held in the backend's memory: the moments, the sums and the scales.
    std::int64_t bytes() const noexcept {
      return static_cast<std::int64_t>(moments_.bytes() + sums_.bytes() + scales_.bytes());
    }
    //! Numbers of moments (of every parameter together).
    std::int64_t size() const noexcept { return offsets_.back(); }
    //! Where parameter p's moments start, and its matrix view.
    std::int64_t offset(std::size_t p) const noexcept { return offsets_[p]; }
    const MatrixView& view(std::size_t p) const noexcept { return views_[p]; }
    //! The moments, copied to host memory (checkpoints).
    std::vector<double> moments() const {
      std::vector<double> out(static_cast<std::size_t>(size()));
      if (size() > 0) backend_->copy_to_host(out.data(), moments_.data(), moments_.bytes());
      return out;
    }
    //! Replaces the moments with `values` (host memory, size() numbers).
    void load_moments(std::span<const double> values) {
      LOOM_CHECK(static_cast<std::int64_t>(values.size()) == size(), "Adafactor state: moments",
                 values.size(), "expected " + detail::to_text(size()) + " numbers");
      if (size() > 0) backend_->copy_from_host(moments_.data(), values.data(), moments_.bytes());
    }

   private:
    friend class Adafactor;
    B* backend_;
    std::vector<std::int64_t> offsets_;
    std::vector<MatrixView> views_;
    Buffer<double, B> moments_, sums_;
    Buffer<A, B> scales_;
    // Host copies the update works on between the reductions, allocated once: the sums (then
    // each tensor's sum(P²)), the moments and the scales.
    std::vector<double> host_sums_, host_moments_;
    std::vector<A> host_scales_;
  };

  //! Updates every segment of `segments` (this rank's pieces of the parameters of `layout`) at
  //! learning rate `lr` for step `step` (from 1). `reduce(std::span<double>)` must sum its
  //! values over the ranks that hold other pieces or slices of the same tensors, so that each
  //! rank gets the whole tensor's sums (collective: every such rank calls update). Parameters
  //! replicated over tensor parallelism are counted only where `count_replicated`, so that a
  //! sum over the tensor-parallel group counts them once.
  template <class B, class T, class Reduce>
  void update(B& backend, const ParameterLayout& layout, std::span<const TensorSegment<T>> segments,
              State<B, T>& state, double lr, std::int64_t step, bool count_replicated, Reduce&& reduce) const {
    using A = accumulate_t<T>;
    LOOM_CHECK(step >= 1, "Adafactor: step", step, "steps count from 1");
    const auto& entries = layout.entries();
    const std::size_t tensors = entries.size();
    const auto counted = [&](const TensorSegment<T>& s) {
      return count_replicated || !entries[static_cast<std::size_t>(s.parameter)].spec.replicated_over_tensor_parallel();
    };

    // 1. This rank's parts of every tensor's row and column sums of G², and of sum(P²).
    state.sums_.zero();
    std::vector<double> params_squared(tensors, 0.0);
    for (const TensorSegment<T>& s : segments) {
      if (!counted(s)) continue;
      const auto p = static_cast<std::size_t>(s.parameter);
      double* rows = state.sums_.data() + state.offset(p);
      with_grads(s, [&](auto grads) {
        adafactor_square_sums(backend, grads, s.index, state.view(p).rows, rows, rows + state.view(p).rows);
      });
      if (options_.scale_parameter) params_squared[p] += sum_of_squares(backend, weights(s));
    }
    // 2. The whole tensors' sums, on every rank that shares them: one reduction.
    std::vector<double>& sums = state.host_sums_;
    if (state.size() > 0) backend.copy_to_host(sums.data(), state.sums_.data(), state.sums_.bytes());
    std::copy(params_squared.begin(), params_squared.end(), sums.begin() + state.size());
    reduce(std::span<double>(sums));

    // 3. The moments and the scales of every tensor (the same on every rank that holds it).
    std::vector<double>& moments = state.host_moments_;
    if (state.size() > 0) backend.copy_to_host(moments.data(), state.moments_.data(), state.moments_.bytes());
    std::vector<A>& scales = state.host_scales_;
    const double beta2 = 1.0 - std::pow(static_cast<double>(step), -options_.decay_rate);
    for (std::size_t p = 0; p < tensors; ++p) {
      const MatrixView& v = state.view(p);
      const auto at = static_cast<std::size_t>(state.offset(p));
      double* r = moments.data() + at;
      double* c = r + v.rows;
      const double* row_sums = sums.data() + at;
      const double* col_sums = row_sums + v.rows;
      for (std::int64_t i = 0; i < v.rows; ++i)
        r[i] = beta2 * r[i] + (1.0 - beta2) * (row_sums[i] + static_cast<double>(v.cols) * options_.eps1);
      for (std::int64_t j = 0; j < v.cols; ++j)
        c[j] = beta2 * c[j] + (1.0 - beta2) * (col_sums[j] + static_cast<double>(v.rows) * options_.eps1);
      A* row_scale = scales.data() + at;
      A* col_scale = row_scale + v.rows;
      if (v.matrix) {
        double total = 0;
        for (std::int64_t i = 0; i < v.rows; ++i) total += r[i];
        // 1 / sqrt(R_i C_j / total) = (1 / sqrt(R_i / total)) (1 / sqrt(C_j)).
        for (std::int64_t i = 0; i < v.rows; ++i) row_scale[i] = static_cast<A>(1.0 / std::sqrt(r[i] / total));
        for (std::int64_t j = 0; j < v.cols; ++j) col_scale[j] = static_cast<A>(1.0 / std::sqrt(c[j]));
      } else {
        for (std::int64_t i = 0; i < v.rows; ++i) row_scale[i] = static_cast<A>(1.0 / std::sqrt(r[i]));
        col_scale[0] = A(1);
      }
    }
    state.load_moments(moments);
    if (state.size() > 0) backend.copy_from_host(state.scales_.data(), scales.data(), state.scales_.bytes());

    // 4. Each tensor's update RMS: a second reduction.
    std::vector<double> update_squared(tensors, 0.0);
    for (const TensorSegment<T>& s : segments) {
      if (!counted(s)) continue;
      const auto p = static_cast<std::size_t>(s.parameter);
      const A* row_scale = state.scales_.data() + state.offset(p);
      with_grads(s, [&](auto grads) {
        update_squared[p] +=
            adafactor_update_square_sum(backend, grads, s.index, row_scale, row_scale + state.view(p).rows);
      });
    }
    reduce(std::span<double>(update_squared));

    // 5. The update.
    const double rho = options_.relative_step ? std::min(lr, 1.0 / std::sqrt(static_cast<double>(step))) : lr;
    for (const TensorSegment<T>& s : segments) {
      const auto p = static_cast<std::size_t>(s.parameter);
      const MatrixView& v = state.view(p);
      const double n = std::max(1.0, static_cast<double>(v.rows) * static_cast<double>(v.cols));
      const double clip = std::max(1.0, std::sqrt(update_squared[p] / n) / options_.clip_threshold);
      const double params_rms = std::sqrt(sums[static_cast<std::size_t>(state.size()) + p] / n);
      const double size = options_.scale_parameter ? std::max(options_.eps2, params_rms) * rho : rho;
      const AdafactorUpdate h{.decay = 1.0 - (s.elements.weight_decay ? rho * options_.weight_decay : 0.0),
                              .step = size / clip};
      const A* row_scale = state.scales_.data() + state.offset(p);
      const A* col_scale = row_scale + v.rows;
      with_grads(s, [&](auto grads) {
        if constexpr (is_narrow_storage<T>)
          adafactor_update<T>(backend, s.elements.params, grads, s.elements.master, s.index, row_scale, col_scale, h);
        else
          adafactor_update<T>(backend, s.elements.params, grads, s.index, row_scale, col_scale, h);
      });
    }
  }

 private:
  //! Calls f with the segment's gradients: the fp32 sums where they are kept, else the gradients.
  template <class T, class F>
  static void with_grads(const TensorSegment<T>& s, F&& f) {
    if constexpr (is_narrow_storage<T>) {
      if (s.elements.fp32_grads.data() != nullptr) return f(s.elements.fp32_grads);
    }
    f(s.elements.grads);
  }
  //! The weights the optimizer steps: the fp32 master copy of bf16 parameters, else the parameters.
  template <class T>
  static auto weights(const TensorSegment<T>& s) {
    if constexpr (is_narrow_storage<T>)
      return Tensor<const accumulate_t<T>>(s.elements.master);
    else
      return Tensor<const T>(s.elements.params);
  }

  Options options_{};
};

static_assert(TensorwiseOptimizer<Adafactor>);

}  // namespace loom
