#pragma once
//! \file The Schedule concept: the order of micro-batch work on each rank, as data.

#include <concepts>
#include <cstdint>
#include <ostream>
#include <vector>

namespace loom {

//! One unit of work a schedule asks a rank to do.
struct Action {
  enum class Kind {
    forward,        //!< run the rank's layers forward on a micro-batch
    backward,       //!< run them backward (input and weight gradients)
  };
  Kind kind = Kind::forward;
  std::int64_t micro_batch = 0;

  friend bool operator==(const Action&, const Action&) = default;
  friend std::ostream& operator<<(std::ostream& out, const Action& a) {
    return out << (a.kind == Kind::forward ? 'F' : 'B') << a.micro_batch;
  }
};

//! Where a rank stands: pipeline stages and this rank's stage, and micro-batches per step.
struct ScheduleShape {
  int stages = 1;
  int stage = 0;
  std::int64_t micro_batches = 1;
  friend bool operator==(const ScheduleShape&, const ScheduleShape&) = default;
};

//! A Schedule generates each rank's actions for one step and says how many micro-batches'
//! activations are alive at once (the trainer allocates that many slots).
//! Opt in with `using loom_schedule = void;`.
template <class S>
concept Schedule = requires { typename S::loom_schedule; } &&
                   requires(const S& s, const ScheduleShape& shape) {
                     { s.actions(shape) } -> std::same_as<std::vector<Action>>;
                     { s.live_micro_batches(shape) } -> std::convertible_to<std::int64_t>;
                   };

}  // namespace loom
