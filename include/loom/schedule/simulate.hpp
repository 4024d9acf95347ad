#pragma once
//! \file A host-side simulator of pipeline schedules, and their printed timeline: runs every
//! rank's actions with given costs, checks each dependency, and measures the makespan, the
//! idle fraction (the bubble) and the activations alive per rank. No model, no communicator.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/schedule/concepts.hpp"
#include "loom/schedule/detail/pipeline_shape.hpp"

namespace loom {

//! How long each kind of action takes, for one micro-batch through one rank's whole share of
//! the model (a pipeline stage). With v virtual stages an action covers one chunk, 1/v of the
//! share, and takes 1/v of this: schedules with and without interleaving then do the same work.
//! The default is the zero-bubble paper's convention, F = I = W = 1 and B = I + W = 2.
struct Costs {
  double forward = 1;
  double backward = 2;         //!< input and weight gradients together
  double backward_input = 1;   //!< input gradients only (zero-bubble "B")
  double backward_weight = 1;  //!< weight gradients only (zero-bubble "W")

  friend bool operator==(const Costs&, const Costs&) = default;
  friend std::ostream& operator<<(std::ostream& out, const Costs& c) {
    return out << "{forward=" << c.forward << ", backward=" << c.backward
               << ", backward_input=" << c.backward_input
               << ", backward_weight=" << c.backward_weight << "}";
  }
  //! The time of an action of kind `kind` on the whole stage.
  constexpr double of(Action::Kind kind) const noexcept {
    switch (kind) {
      case Action::Kind::forward: return forward;
      case Action::Kind::backward: return backward;
      case Action::Kind::backward_input: return backward_input;
      case Action::Kind::backward_weight: return backward_weight;
    }
    return 0;
  }
};

//! One action as the simulator ran it, over [start, finish).
struct TimedAction {
  Action action;
  double start = 0;
  double finish = 0;
  friend bool operator==(const TimedAction&, const TimedAction&) = default;
};

//! What simulate() measured for every rank of a pipeline.
struct Simulation {
  ScheduleShape shape;  //!< stages, micro-batches and virtual stages; `stage` is unused (0)
  Costs costs;
  double makespan = 0;                          //!< when the last action on any rank finishes
  std::vector<double> busy;                     //!< per rank: time spent running actions
  std::vector<std::int64_t> peak_live;          //!< per rank: most activation sets alive at once
  std::vector<std::vector<TimedAction>> ranks;  //!< per rank: its actions, in order, with times

  //! 1 − total busy time / (ranks × makespan): the pipeline bubble as a fraction of the step.
  double idle_fraction() const {
    double total = 0;
    for (double b : busy) total += b;
    return makespan > 0 ? 1.0 - total / (static_cast<double>(busy.size()) * makespan) : 0.0;
  }
};

namespace detail {

//! The action's name in a timeline: operator<<'s, with the chunk always shown when the
//! pipeline has virtual stages (F3.0 and F3.1 line up).
inline std::string action_name(const Action& a, bool show_chunk) {
  std::string name = Action::letter(a.kind) + std::to_string(a.micro_batch);
  if (show_chunk || a.chunk != 0) name += '.' + std::to_string(a.chunk);
  return name;
}

//! Where the actions of one (virtual stage, micro-batch) stand while simulating.
struct SimulatedPair {
  int forwards = 0, backwards = 0, inputs = 0, weights = 0;  // how many the ranks list
  double forward_done = -1;   // finish of the forward; -1 until it ran
  double gradient_done = -1;  // finish of the backward or backward_input (input gradient sent)
};

}  // namespace detail

//! Runs `actions[r]`, rank r's actions in order, for every rank r of `shape` (stages ranks, its
//! micro-batches and virtual stages; shape.stage is ignored). Each action starts when its rank
//! is free and its dependencies have finished; it takes `costs` / virtual_stages:
//! - forward of virtual stage k > 0, micro-batch i: after forward (k−1, i);
//! - backward or backward_input (k, i): after forward (k, i), and after the backward or
//!   backward_input (k+1, i) unless k is the last virtual stage;
//! - backward_weight (k, i): after backward_input (k, i).
//! A micro-batch's activations on a rank are alive from its forward's start until the action
//! that finishes with them completes: its backward, or its backward_weight when the backward
//! is split (the weight gradient reads the layer inputs the forward saved).
//! Throws loom::Error when an action is out of range, when a (micro-batch, chunk) of a rank
//! lacks its forward or backward or has two, and on deadlock (no rank can start its next
//! action), naming each stuck rank, its action and what it waits for.
inline Simulation simulate(const std::vector<std::vector<Action>>& actions, ScheduleShape shape,
                           Costs costs = {}) {
  shape.stage = 0;
  detail::check_pipeline_shape("simulate", shape, true);
  LOOM_CHECK(static_cast<std::int64_t>(actions.size()) == shape.stages, "simulate: action lists",
             actions.size(), "need one per pipeline stage (" + detail::to_text(shape.stages) + ")");
  for (Action::Kind kind : {Action::Kind::forward, Action::Kind::backward,
                            Action::Kind::backward_input, Action::Kind::backward_weight})
    LOOM_CHECK(std::isfinite(costs.of(kind)) && costs.of(kind) > 0, "simulate: costs", costs,
               "every cost must be finite and > 0");

  const int p = shape.stages, v = shape.virtual_stages;
  const std::int64_t m = shape.micro_batches;
  const bool chunked = v > 1;
  std::vector<detail::SimulatedPair> pairs(static_cast<std::size_t>(p * v * m));
  auto pair_of = [&](int virtual_stage, std::int64_t micro_batch) -> detail::SimulatedPair& {
    return pairs[static_cast<std::size_t>(virtual_stage * m + micro_batch)];
  };
  auto where = [&](int rank, const Action& a) {
    return "rank " + std::to_string(rank) + " " + detail::action_name(a, chunked);
  };

  // Every (rank, chunk, micro-batch) has one forward and one backward, whole or split.
  for (int r = 0; r < p; ++r)
    for (const Action& a : actions[static_cast<std::size_t>(r)]) {
      LOOM_CHECK(a.micro_batch >= 0 && a.micro_batch < m, "simulate: micro-batch of an action",
                 where(r, a), "must be in [0, micro_batches) = [0, " + detail::to_text(m) + ")");
      LOOM_CHECK(a.chunk >= 0 && a.chunk < v, "simulate: chunk of an action", where(r, a),
                 "must be in [0, virtual_stages) = [0, " + detail::to_text(v) + ")");
      auto& pair = pair_of(a.chunk * p + r, a.micro_batch);
      switch (a.kind) {
        case Action::Kind::forward: ++pair.forwards; break;
        case Action::Kind::backward: ++pair.backwards; break;
        case Action::Kind::backward_input: ++pair.inputs; break;
        case Action::Kind::backward_weight: ++pair.weights; break;
      }
    }
  for (int k = 0; k < p * v; ++k)
    for (std::int64_t i = 0; i < m; ++i) {
      const auto& pair = pair_of(k, i);
      const bool whole = pair.backwards == 1 && pair.inputs == 0 && pair.weights == 0;
      const bool split = pair.backwards == 0 && pair.inputs == 1 && pair.weights == 1;
      LOOM_CHECK(pair.forwards == 1 && (whole || split), "simulate: actions of a micro-batch",
                 "rank " + std::to_string(k % p) + ", chunk " + std::to_string(k / p) +
                     ", micro-batch " + std::to_string(i) + ": " + std::to_string(pair.forwards) +
                     " F, " + std::to_string(pair.backwards) + " B, " +
                     std::to_string(pair.inputs) + " I, " + std::to_string(pair.weights) + " W",
                 "each needs exactly one forward (F) and either one backward (B) or one "
                 "backward_input (I) and one backward_weight (W)");
    }

  // When `a` on `rank` may start, or -1 while a dependency has not run; `waits_for` names it.
  auto ready_time = [&](int rank, const Action& a, std::string& waits_for) -> double {
    const int k = a.chunk * p + rank;
    const auto& own = pair_of(k, a.micro_batch);
    auto name_of = [&](Action::Kind kind, int stage) {
      const Action needed{kind, a.micro_batch, stage / p};
      return detail::action_name(needed, chunked) + " on rank " + std::to_string(stage % p);
    };
    double ready = 0;
    switch (a.kind) {
      case Action::Kind::forward:
        if (k == 0) return 0;
        waits_for = name_of(Action::Kind::forward, k - 1);
        return pair_of(k - 1, a.micro_batch).forward_done;
      case Action::Kind::backward:
      case Action::Kind::backward_input:
        waits_for = name_of(Action::Kind::forward, k);
        if (own.forward_done < 0) return -1;
        ready = own.forward_done;
        if (k + 1 < p * v) {
          const auto& next = pair_of(k + 1, a.micro_batch);
          waits_for = name_of(next.backwards == 1 ? Action::Kind::backward
                                                  : Action::Kind::backward_input,
                              k + 1);
          if (next.gradient_done < 0) return -1;
          ready = std::max(ready, next.gradient_done);
        }
        return ready;
      case Action::Kind::backward_weight:
        waits_for = name_of(Action::Kind::backward_input, k);
        return own.gradient_done;
    }
    return -1;
  };

  Simulation sim;
  sim.shape = shape;
  sim.costs = costs;
  sim.busy.assign(static_cast<std::size_t>(p), 0.0);
  sim.peak_live.assign(static_cast<std::size_t>(p), 0);
  sim.ranks.assign(static_cast<std::size_t>(p), {});
  std::vector<std::size_t> next(static_cast<std::size_t>(p), 0);
  std::vector<double> free_at(static_cast<std::size_t>(p), 0.0);
  std::size_t remaining = 0;
  for (const auto& list : actions) remaining += list.size();

  // Rounds over the ranks, each running as far as its dependencies allow. Start times depend
  // only on finish times already fixed, so the order of the ranks within a round is immaterial.
  while (remaining > 0) {
    bool progress = false;
    for (int r = 0; r < p; ++r) {
      const auto& list = actions[static_cast<std::size_t>(r)];
      auto& at = next[static_cast<std::size_t>(r)];
      for (; at < list.size(); ++at) {
        const Action& a = list[at];
        std::string waits_for;
        const double ready = ready_time(r, a, waits_for);
        if (ready < 0) break;
        const double start = std::max(free_at[static_cast<std::size_t>(r)], ready);
        const double finish = start + costs.of(a.kind) / v;
        auto& pair = pair_of(a.chunk * p + r, a.micro_batch);
        if (a.kind == Action::Kind::forward) pair.forward_done = finish;
        if (a.kind == Action::Kind::backward || a.kind == Action::Kind::backward_input)
          pair.gradient_done = finish;
        free_at[static_cast<std::size_t>(r)] = finish;
        sim.busy[static_cast<std::size_t>(r)] += finish - start;
        sim.ranks[static_cast<std::size_t>(r)].push_back({a, start, finish});
        sim.makespan = std::max(sim.makespan, finish);
        --remaining;
        progress = true;
      }
    }
    if (!progress) {
      std::string stuck;
      for (int r = 0; r < p; ++r) {
        const auto& list = actions[static_cast<std::size_t>(r)];
        const std::size_t at = next[static_cast<std::size_t>(r)];
        if (at == list.size()) continue;
        std::string waits_for;
        ready_time(r, list[at], waits_for);
        if (!stuck.empty()) stuck += "; ";
        stuck += where(r, list[at]) + " waits for " + waits_for;
      }
      throw Error("simulate: deadlock", stuck,
                  "no rank can start its next action: the ranks' orders wait on each other");
    }
  }

  // Activations alive per rank: +1 at a forward's start, −1 when its last backward action
  // finishes; at equal times the release comes first (the rank ran them one after the other).
  for (int r = 0; r < p; ++r) {
    std::vector<std::pair<double, int>> events;
    for (const TimedAction& t : sim.ranks[static_cast<std::size_t>(r)]) {
      if (t.action.kind == Action::Kind::forward) events.emplace_back(t.start, +1);
      if (t.action.kind == Action::Kind::backward ||
          t.action.kind == Action::Kind::backward_weight)
        events.emplace_back(t.finish, -1);
    }
    std::sort(events.begin(), events.end());
    std::int64_t live = 0, peak = 0;
    for (const auto& [time, change] : events) peak = std::max(peak, live += change);
    sim.peak_live[static_cast<std::size_t>(r)] = peak;
  }
  return sim;
}

//! Simulates `schedule` on every rank of `shape` (shape.stage is ignored): see the overload
//! that takes the action lists.
template <Schedule S>
Simulation simulate(const S& schedule, ScheduleShape shape, Costs costs = {}) {
  shape.stage = 0;
  detail::check_pipeline_shape("simulate", shape, true);
  std::vector<std::vector<Action>> actions;
  for (int r = 0; r < shape.stages; ++r) {
    shape.stage = r;
    actions.push_back(schedule.actions(shape));
  }
  shape.stage = 0;
  return simulate(actions, shape, costs);
}

//! The simulation as text: one line per rank, one column per time slot of 1/v (v virtual
//! stages), so with whole-number costs each action fills `cost` columns, and `.` marks idle
//! slots up to the makespan: `rank 0: F0 F1 F2 F3 .  .  B0 B0 F4 …`. Throws loom::Error when
//! an action does not start and end on a slot boundary (costs that are not whole numbers).
inline std::string timeline(const Simulation& sim) {
  const int v = sim.shape.virtual_stages;
  auto slot_of = [&](double time, const TimedAction& t, int rank) {
    const double slot = std::round(time * v);
    LOOM_CHECK(std::abs(slot - time * v) < 1e-6, "timeline: time of an action",
               "rank " + std::to_string(rank) + " " + detail::action_name(t.action, v > 1) +
                   " at " + detail::to_text(time),
               "must fall on a slot boundary; the timeline needs whole-number costs");
    return static_cast<std::size_t>(slot);
  };
  const std::size_t columns = static_cast<std::size_t>(std::llround(sim.makespan * v));
  std::size_t width = 1;
  std::vector<std::vector<std::string>> cells(sim.ranks.size(),
                                              std::vector<std::string>(columns, "."));
  for (std::size_t r = 0; r < sim.ranks.size(); ++r)
    for (const TimedAction& t : sim.ranks[r]) {
      const std::string name = detail::action_name(t.action, v > 1);
      width = std::max(width, name.size());
      const std::size_t first = slot_of(t.start, t, static_cast<int>(r));
      const std::size_t last = std::min(slot_of(t.finish, t, static_cast<int>(r)), columns);
      for (std::size_t c = first; c < last; ++c) cells[r][c] = name;
    }
  const std::size_t label = std::to_string(sim.ranks.empty() ? 0 : sim.ranks.size() - 1).size();
  std::string out;
  for (std::size_t r = 0; r < sim.ranks.size(); ++r) {
    std::string line = "rank " + std::to_string(r);
    line.resize(5 + label, ' ');
    line += ':';
    for (const std::string& cell : cells[r]) {
      line += ' ';
      line += cell;
      line.append(width - cell.size(), ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line;
    out += '\n';
  }
  return out;
}

//! The timeline of `schedule` on `shape` with `costs` (whole numbers; by default F = 1, B = 2,
//! I = W = 1): what a user prints to see the bubble.
template <Schedule S>
std::string timeline(const S& schedule, ScheduleShape shape, Costs costs = {}) {
  return timeline(simulate(schedule, shape, costs));
}

}  // namespace loom
