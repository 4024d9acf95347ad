#pragma once
//! \file Interleaved 1F1B with virtual stages (Narayanan et al. 2021; Megatron-LM's
//! forward_backward_pipelining_with_interleaving).

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/schedule/concepts.hpp"
#include "loom/schedule/detail/pipeline_shape.hpp"

namespace loom {

//! Each rank holds v = shape.virtual_stages model chunks (chunk c of rank s is virtual stage
//! c·p + s) and runs 1F1B over its m·v (micro-batch, chunk) pairs in Megatron's order: groups
//! of p micro-batches go through chunk 0, then chunk 1, …; backwards take the chunks in
//! reverse. The bubble shrinks to (p−1)/(v·m+p−1) at the price of v times more point-to-point
//! messages. Needs m to be a multiple of p (Megatron's rule: the groups of p must fill up).
struct Interleaved1F1B {
  using loom_schedule = void;
  static constexpr bool pipelined = true;
  //! Model chunks per rank the Trainer cuts the model into (v); actions() reads the
  //! ScheduleShape's, which the Trainer fills from this.
  int virtual_stages = 2;

  std::vector<Action> actions(const ScheduleShape& shape) const {
    check(shape);
    const std::int64_t total = shape.micro_batches * shape.virtual_stages;
    const std::int64_t warmup = warmup_forwards(shape);
    std::vector<Action> out;
    out.reserve(static_cast<std::size_t>(2 * total));
    for (std::int64_t k = 0; k < warmup; ++k) out.push_back(nth(shape, k, Action::Kind::forward));
    for (std::int64_t k = 0; k + warmup < total; ++k) {
      out.push_back(nth(shape, k + warmup, Action::Kind::forward));
      out.push_back(nth(shape, k, Action::Kind::backward));
    }
    for (std::int64_t k = total - warmup; k < total; ++k)
      out.push_back(nth(shape, k, Action::Kind::backward));
    return out;
  }

  //! (micro-batch, chunk) activation sets alive at once on the rank, each 1/v of a whole
  //! stage's: the warm-up forwards plus one, at most m·v.
  std::int64_t live_micro_batches(const ScheduleShape& shape) const {
    check(shape);
    return std::min(warmup_forwards(shape) + 1, shape.micro_batches * shape.virtual_stages);
  }

 private:
  static void check(const ScheduleShape& shape) {
    detail::check_pipeline_shape("Interleaved1F1B", shape, true);
    LOOM_CHECK(shape.micro_batches % shape.stages == 0, "Interleaved1F1B: micro-batches",
               shape.micro_batches,
               "must be a multiple of pipeline stages (" + detail::to_text(shape.stages) +
                   "): micro-batches go through each chunk in groups of stages (Megatron's rule)");
  }

  // Megatron's warm-up: (p−s−1)·2 so that the first backward of the last chunk finds this rank
  // ready, plus (v−1)·p to fill the first v−1 chunks of the first group.
  static std::int64_t warmup_forwards(const ScheduleShape& shape) {
    const std::int64_t p = shape.stages, v = shape.virtual_stages;
    const std::int64_t warmup = (p - shape.stage - 1) * 2 + (v - 1) * p;
    return std::min(warmup, shape.micro_batches * v);
  }

  // The k-th forward or backward on the rank: k runs through groups of p·v, each p micro-batches
  // times v chunks, chunk-major (backward takes the chunks last to first).
  static Action nth(const ScheduleShape& shape, std::int64_t k, Action::Kind kind) {
    const std::int64_t p = shape.stages, v = shape.virtual_stages;
    const std::int64_t group = k / (p * v), in_group = k % (p * v);
    int chunk = static_cast<int>(in_group / p);
    if (kind != Action::Kind::forward) chunk = static_cast<int>(v) - 1 - chunk;
    return {kind, group * p + in_group % p, chunk};
  }
};

static_assert(Schedule<Interleaved1F1B>);

}  // namespace loom
