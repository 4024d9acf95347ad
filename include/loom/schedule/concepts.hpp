#pragma once
//! \file The Schedule concept: the order of micro-batch work on each rank, as data.
//!
//! A schedule is a pure generator: given the pipeline's shape and one rank's place in it, it
//! returns that rank's actions in the order the rank runs them. Nothing else is needed to
//! print it (loom/schedule/simulate.hpp: timeline) or to check it without a model (simulate).
//!
//! **Virtual stages.** With `virtual_stages = v`, each of the `stages = p` ranks holds v model
//! chunks; chunk c of rank s is global virtual stage `k = c·p + s` (Megatron-LM's layout), so
//! the model runs through ranks 0, 1, …, p−1, 0, 1, … v times. Without interleaving v = 1 and
//! k = s.
//!
//! **Communication is implied by the actions**, so a schedule lists compute only:
//! - a forward of virtual stage k > 0 first receives the activations of micro-batch i from
//!   k − 1; a forward of k < p·v − 1 then sends its output to k + 1;
//! - a backward (or backward_input) of k < p·v − 1 first receives the output gradient from
//!   k + 1; one of k > 0 then sends its input gradient to k − 1;
//! - a backward_weight is local: it needs the input gradient pass of the same (k, micro-batch).
//! An executor posts each receive before the matching compute and sends without waiting for
//! the receiver (buffered or non-blocking sends), which is the model simulate() checks.

#include <concepts>
#include <cstdint>
#include <ostream>
#include <vector>

namespace loom {

//! One unit of work a schedule asks a rank to do.
struct Action {
  enum class Kind {
    forward,          //!< run the chunk's layers forward on a micro-batch
    backward,         //!< run them backward (input and weight gradients together)
    backward_input,   //!< backward, input gradients only (zero-bubble "B"); sends to k − 1
    backward_weight,  //!< backward, weight gradients only (zero-bubble "W"); local
  };
  Kind kind = Kind::forward;
  std::int64_t micro_batch = 0;
  int chunk = 0;  //!< model chunk on this rank (virtual stage chunk·stages + stage); 0 unless interleaved

  friend bool operator==(const Action&, const Action&) = default;
  //! F3, B3, I3 (input gradient), W3 (weight gradient); chunk c ≠ 0 is appended: F3.1.
  friend std::ostream& operator<<(std::ostream& out, const Action& a) {
    out << letter(a.kind) << a.micro_batch;
    if (a.chunk != 0) out << '.' << a.chunk;
    return out;
  }
  //! The letter an action of kind `k` prints as.
  static constexpr char letter(Kind k) noexcept {
    switch (k) {
      case Kind::forward: return 'F';
      case Kind::backward: return 'B';
      case Kind::backward_input: return 'I';
      case Kind::backward_weight: return 'W';
    }
    return '?';
  }
};

//! Where a rank stands: pipeline stages (ranks) and this rank's stage, micro-batches per step,
//! and model chunks per rank (virtual stages; 1 unless the schedule interleaves).
struct ScheduleShape {
  int stages = 1;
  int stage = 0;
  std::int64_t micro_batches = 1;
  int virtual_stages = 1;

  friend bool operator==(const ScheduleShape&, const ScheduleShape&) = default;
  friend std::ostream& operator<<(std::ostream& out, const ScheduleShape& s) {
    return out << "{stages=" << s.stages << ", stage=" << s.stage
               << ", micro_batches=" << s.micro_batches << ", virtual_stages=" << s.virtual_stages
               << "}";
  }
};

//! The global virtual stage of `chunk` on the rank `shape.stage`: chunk·stages + stage.
constexpr int virtual_stage(const ScheduleShape& shape, int chunk) noexcept {
  return chunk * shape.stages + shape.stage;
}

//! A Schedule generates each rank's actions for one step and says how many micro-batches'
//! activations are alive at once on that rank (the trainer allocates that many slots; with
//! virtual stages a slot holds one chunk's activations of one micro-batch).
//! Opt in with `using loom_schedule = void;`.
template <class S>
concept Schedule = requires { typename S::loom_schedule; } &&
                   requires(const S& s, const ScheduleShape& shape) {
                     { s.actions(shape) } -> std::same_as<std::vector<Action>>;
                     { s.live_micro_batches(shape) } -> std::convertible_to<std::int64_t>;
                   };

//! Whether `S` schedules pipeline stages (GPipe, 1F1B, interleaved, ZB-H1), as its type says with
//! `static constexpr bool pipelined = true`; GradientAccumulation runs one stage.
template <class S>
inline constexpr bool pipelined_schedule = requires { requires S::pipelined; };

//! Whether `S` splits backwards into backward_input and backward_weight actions (zero-bubble
//! schedules), as its type says with `static constexpr bool splits_backward = true`.
template <class S>
inline constexpr bool splits_backward_schedule = requires { requires S::splits_backward; };

//! Model chunks per rank a schedule value asks for: its `virtual_stages` member where it has
//! one (Interleaved1F1B), else 1.
template <class S>
constexpr int chunks_per_rank(const S& schedule) noexcept {
  if constexpr (requires { schedule.virtual_stages; })
    return static_cast<int>(schedule.virtual_stages);
  else
    return 1;
}

}  // namespace loom
