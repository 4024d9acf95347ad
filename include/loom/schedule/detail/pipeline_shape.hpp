#pragma once
//! \file Checks shared by the pipeline schedules: a ScheduleShape they can generate for.

#include <string>

#include "loom/core/error.hpp"
#include "loom/schedule/concepts.hpp"

namespace loom::detail {

//! Rejects a shape no pipeline schedule can run, naming `schedule` and the broken rule.
//! Schedules without model chunks pass `allows_virtual_stages = false`.
inline void check_pipeline_shape(const std::string& schedule, const ScheduleShape& shape,
                                 bool allows_virtual_stages) {
  LOOM_CHECK(shape.stages >= 1, schedule + ": pipeline stages", shape.stages, "must be >= 1");
  LOOM_CHECK(shape.stage >= 0 && shape.stage < shape.stages, schedule + ": stage", shape.stage,
             "must be in [0, stages) = [0, " + to_text(shape.stages) + ")");
  LOOM_CHECK(shape.micro_batches >= 1, schedule + ": micro-batches", shape.micro_batches,
             "must be >= 1");
  LOOM_CHECK(shape.virtual_stages >= 1, schedule + ": virtual stages", shape.virtual_stages,
             "must be >= 1");
  LOOM_CHECK(allows_virtual_stages || shape.virtual_stages == 1,
             schedule + ": virtual stages", shape.virtual_stages,
             "this schedule runs one model chunk per rank; use Interleaved1F1B for virtual stages");
}

}  // namespace loom::detail
