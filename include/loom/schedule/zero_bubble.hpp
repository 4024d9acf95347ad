#pragma once
//! \file ZB-H1, the zero-bubble schedule with 1F1B's memory (Qi et al. 2023, "Zero Bubble
//! Pipeline Parallelism", section 3.1).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "loom/schedule/concepts.hpp"
#include "loom/schedule/detail/pipeline_shape.hpp"

namespace loom {

//! Splits each backward into I (input gradients, on the critical path: the previous stage
//! waits for them) and W (weight gradients, needed by nobody until the optimizer step). Rank s
//! runs 1F1B's p−s−1 warm-up forwards, then s rounds of F I (its W's deferred), then F I W
//! rounds, then I W, then the deferred W's. Deferring W shortens the chain of backwards that
//! crosses the pipeline, so with F = I = W the bubble is about a third of 1F1B's, while a rank
//! still holds at most p micro-batches' activations (a micro-batch is freed after its W, which
//! reads the layer inputs the forward saved).
struct ZeroBubbleH1 {
  using loom_schedule = void;
  static constexpr bool pipelined = true;
  static constexpr bool splits_backward = true;

  std::vector<Action> actions(const ScheduleShape& shape) const {
    detail::check_pipeline_shape("ZeroBubbleH1", shape, false);
    const std::int64_t m = shape.micro_batches;
    const std::int64_t warmup = std::min<std::int64_t>(shape.stages - shape.stage - 1, m);
    const std::int64_t deferred = std::min<std::int64_t>(shape.stage, m - warmup);
    std::int64_t forwards = 0, inputs = 0, weights = 0;
    std::vector<Action> out;
    out.reserve(static_cast<std::size_t>(3 * m));
    auto forward = [&] { out.push_back({Action::Kind::forward, forwards++}); };
    auto input = [&] { out.push_back({Action::Kind::backward_input, inputs++}); };
    auto weight = [&] { out.push_back({Action::Kind::backward_weight, weights++}); };
    for (std::int64_t i = 0; i < warmup; ++i) forward();
    for (std::int64_t i = 0; i < deferred; ++i) forward(), input();
    while (forwards < m) forward(), input(), weight();
    while (inputs < m) input(), weight();
    while (weights < m) weight();
    return out;
  }

  //! min(p, m): a micro-batch stays alive from its forward until its W.
  std::int64_t live_micro_batches(const ScheduleShape& shape) const {
    detail::check_pipeline_shape("ZeroBubbleH1", shape, false);
    return std::min<std::int64_t>(shape.stages, shape.micro_batches);
  }
};

static_assert(Schedule<ZeroBubbleH1>);

}  // namespace loom
