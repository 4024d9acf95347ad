#pragma once
//! \file GPipe: every micro-batch forward, then every micro-batch backward (Huang et al. 2019).

#include <cstdint>
#include <vector>

#include "loom/schedule/concepts.hpp"
#include "loom/schedule/detail/pipeline_shape.hpp"

namespace loom {

//! F0 F1 … F(m−1) B0 B1 … B(m−1) on every rank. The simplest pipeline schedule, and the most
//! memory-hungry: all m micro-batches' activations are alive at once on every rank. Bubble
//! (p−1)/(m+p−1) of the step (docs/pipeline_schedules.md).
struct GPipe {
  using loom_schedule = void;
  static constexpr bool pipelined = true;

  std::vector<Action> actions(const ScheduleShape& shape) const {
    detail::check_pipeline_shape("GPipe", shape, false);
    std::vector<Action> out;
    out.reserve(static_cast<std::size_t>(2 * shape.micro_batches));
    for (std::int64_t i = 0; i < shape.micro_batches; ++i)
      out.push_back({Action::Kind::forward, i});
    for (std::int64_t i = 0; i < shape.micro_batches; ++i)
      out.push_back({Action::Kind::backward, i});
    return out;
  }

  //! m on every rank: no backward starts before the last forward.
  std::int64_t live_micro_batches(const ScheduleShape& shape) const {
    detail::check_pipeline_shape("GPipe", shape, false);
    return shape.micro_batches;
  }
};

static_assert(Schedule<GPipe>);

}  // namespace loom
