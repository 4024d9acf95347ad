#pragma once
//! \file Gradient accumulation: forward then backward for each micro-batch in turn (one stage).

#include <vector>

#include "loom/core/error.hpp"
#include "loom/schedule/concepts.hpp"

namespace loom {

//! F0 B0 F1 B1 ...: one micro-batch's activations alive at a time; gradients accumulate in
//! the flat gradient buffer, and the data-parallel strategy communicates only after the last.
struct GradientAccumulation {
  using loom_schedule = void;

  std::vector<Action> actions(const ScheduleShape& shape) const {
    LOOM_CHECK(shape.stages == 1, "GradientAccumulation: pipeline stages", shape.stages,
               "this schedule runs one stage; use GPipe or OneFOneB for pipeline parallelism");
    LOOM_CHECK(shape.virtual_stages == 1, "GradientAccumulation: virtual stages", shape.virtual_stages,
               "this schedule runs one stage; use Interleaved1F1B for virtual stages");
    LOOM_CHECK(shape.micro_batches >= 1, "GradientAccumulation: micro-batches",
               shape.micro_batches, "must be >= 1");
    std::vector<Action> out;
    out.reserve(static_cast<std::size_t>(2 * shape.micro_batches));
    for (std::int64_t m = 0; m < shape.micro_batches; ++m) {
      out.push_back({Action::Kind::forward, m});
      out.push_back({Action::Kind::backward, m});
    }
    return out;
  }
  std::int64_t live_micro_batches(const ScheduleShape&) const noexcept { return 1; }
};

static_assert(Schedule<GradientAccumulation>);

}  // namespace loom
