#pragma once
//! \file 1F1B: the non-interleaved one-forward-one-backward schedule (PipeDream-Flush, as in
//! Megatron-LM's forward_backward_pipelining_without_interleaving).

#include <algorithm>
#include <cstdint>
#include <vector>

#include "loom/schedule/concepts.hpp"
#include "loom/schedule/detail/pipeline_shape.hpp"

namespace loom {

//! Rank s runs min(p−s−1, m) warm-up forwards, then alternates one forward and one backward,
//! then drains the remaining backwards. Same bubble as GPipe, (p−1)/(m+p−1), but a rank holds
//! at most min(p−s, m) micro-batches' activations instead of m.
struct OneFOneB {
  using loom_schedule = void;
  static constexpr bool pipelined = true;

  std::vector<Action> actions(const ScheduleShape& shape) const {
    detail::check_pipeline_shape("OneFOneB", shape, false);
    const std::int64_t m = shape.micro_batches, warmup = warmup_forwards(shape);
    std::vector<Action> out;
    out.reserve(static_cast<std::size_t>(2 * m));
    for (std::int64_t i = 0; i < warmup; ++i) out.push_back({Action::Kind::forward, i});
    for (std::int64_t i = 0; i + warmup < m; ++i) {
      out.push_back({Action::Kind::forward, i + warmup});
      out.push_back({Action::Kind::backward, i});
    }
    for (std::int64_t i = m - warmup; i < m; ++i) out.push_back({Action::Kind::backward, i});
    return out;
  }

  //! min(p − stage, m): the warm-up forwards plus the one the steady phase adds before its
  //! first backward.
  std::int64_t live_micro_batches(const ScheduleShape& shape) const {
    detail::check_pipeline_shape("OneFOneB", shape, false);
    return std::min<std::int64_t>(shape.stages - shape.stage, shape.micro_batches);
  }

 private:
  // Enough forwards in flight that the first backward reaches this rank just as it is free.
  static std::int64_t warmup_forwards(const ScheduleShape& shape) {
    return std::min<std::int64_t>(shape.stages - shape.stage - 1, shape.micro_batches);
  }
};

static_assert(Schedule<OneFOneB>);

}  // namespace loom
