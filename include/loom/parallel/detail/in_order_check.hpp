#pragma once
//! \file Whether the pipeline executor's messages would deadlock on a communicator that runs a
//! rank's point-to-point operations in issue order (NCCL: one communication stream, no tags, a send holds up
//! what comes after it until its receiver takes it; only the calls of one group progress
//! together). Every rank's actions are a function of the schedule and the shape, so each rank
//! models all of them on the host, before a step sends anything.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "loom/schedule/concepts.hpp"

namespace loom::detail {

//! One send or receive the executor issues on the pipeline group: the peer rank, and which
//! message it is (an activation, direction 0, or a gradient, 1, of `micro_batch` for virtual
//! stage `to_stage`).
struct PlannedMessage {
  bool send = false;
  int peer = 0;
  int direction = 0;
  std::int64_t micro_batch = 0;
  int to_stage = 0;

  //! "send a3 to stage 2 (rank 0)", "recv g3 for stage 1 (rank 1)".
  std::string text() const {
    return std::string(send ? "send " : "recv ") + (direction == 0 ? "a" : "g") + std::to_string(micro_batch) +
           " for stage " + std::to_string(to_stage) + (send ? " to rank " : " from rank ") + std::to_string(peer);
  }
  bool same_message(const PlannedMessage& o) const noexcept {
    return direction == o.direction && micro_batch == o.micro_batch && to_stage == o.to_stage;
  }
};
//! Calls the executor issues as one unit (Communicator::start_group), or one call alone.
using PlannedGroup = std::vector<PlannedMessage>;

//! How the executor joins sends and receives into groups.
//! - per_action: the sends an action makes go in one group with the next action's receive
//!   from another rank, or alone before that action when it receives nothing from another rank.
//! - per_unit: a forward directly followed by a backward (or backward_input) is one unit, as in
//!   Megatron-LM's interleaved steady state; the sends of a unit go in one group with the
//!   receives of the next unit, both of them posted before its forward computes.
enum class MessageGrouping { per_action, per_unit };

inline const char* to_string(MessageGrouping g) noexcept {
  return g == MessageGrouping::per_action ? "per action" : "per unit";
}

//! The remote receive action `a` needs before it computes, if any: an activation for a forward
//! (direction 0), an output gradient for a backward or backward_input (direction 1). Messages
//! between a rank's own chunks (pp = 1) stay on the rank and are not listed.
inline std::optional<PlannedMessage> planned_receive(const Action& a, const ScheduleShape& shape) {
  const int p = shape.stages, stages = shape.stages * shape.virtual_stages, vs = virtual_stage(shape, a.chunk);
  const auto remote = [&](int stage) { return stage % p != shape.stage; };
  if (a.kind == Action::Kind::forward && vs > 0 && remote(vs - 1))
    return PlannedMessage{.send = false, .peer = (vs - 1) % p, .direction = 0, .micro_batch = a.micro_batch, .to_stage = vs};
  if ((a.kind == Action::Kind::backward || a.kind == Action::Kind::backward_input) && vs + 1 < stages &&
      remote(vs + 1))
    return PlannedMessage{.send = false, .peer = (vs + 1) % p, .direction = 1, .micro_batch = a.micro_batch, .to_stage = vs};
  return std::nullopt;
}

//! The remote send action `a` makes when it has computed, if any.
inline std::optional<PlannedMessage> planned_send(const Action& a, const ScheduleShape& shape) {
  const int p = shape.stages, stages = shape.stages * shape.virtual_stages, vs = virtual_stage(shape, a.chunk);
  const auto remote = [&](int stage) { return stage % p != shape.stage; };
  if (a.kind == Action::Kind::forward && vs + 1 < stages && remote(vs + 1))
    return PlannedMessage{.send = true, .peer = (vs + 1) % p, .direction = 0, .micro_batch = a.micro_batch, .to_stage = vs + 1};
  if ((a.kind == Action::Kind::backward || a.kind == Action::Kind::backward_input) && vs > 0 && remote(vs - 1))
    return PlannedMessage{.send = true, .peer = (vs - 1) % p, .direction = 1, .micro_batch = a.micro_batch, .to_stage = vs - 1};
  return std::nullopt;
}

//! The group the executor issues before each of `actions` on pipeline rank `shape.stage`, and
//! after the last one (element actions.size()); empty where it issues nothing. In a group the
//! sends come first, in the order they were made, then the receives in action order. A group
//! holds at most one gradient receive (the executor has one buffer for it). The exchange of
//! tied gradients after the actions is not planned here: it goes pair by pair in holder order,
//! each pair's send and receive in one group, which always match.
inline std::vector<PlannedGroup> message_plan(const std::vector<Action>& actions, const ScheduleShape& shape,
                                              MessageGrouping grouping) {
  std::vector<PlannedGroup> before(actions.size() + 1);
  PlannedGroup sends;  // made by the last unit, not yet issued
  for (std::size_t i = 0; i < actions.size();) {
    std::size_t end = i + 1;
    if (grouping == MessageGrouping::per_unit && actions[i].kind == Action::Kind::forward && end < actions.size() &&
        (actions[end].kind == Action::Kind::backward || actions[end].kind == Action::Kind::backward_input))
      ++end;
    PlannedGroup& group = before[i];
    group = std::move(sends);
    sends.clear();
    for (std::size_t k = i; k < end; ++k) {
      if (const auto r = planned_receive(actions[k], shape)) group.push_back(*r);
      if (const auto s = planned_send(actions[k], shape)) sends.push_back(*s);
    }
    i = end;
  }
  before.back() = std::move(sends);
  return before;
}

//! The groups of a plan in issue order, without the empty ones.
inline std::vector<PlannedGroup> issued_groups(std::vector<PlannedGroup> plan) {
  std::erase_if(plan, [](const PlannedGroup& g) { return g.empty(); });
  return plan;
}

//! The groups the executor issues, in order, on pipeline rank `shape.stage` for the step
//! `actions` under `grouping`.
inline std::vector<PlannedGroup> executor_groups(const std::vector<Action>& actions, const ScheduleShape& shape,
                                                 MessageGrouping grouping = MessageGrouping::per_action) {
  return issued_groups(message_plan(actions, shape, grouping));
}

//! "" when the groups of every rank (`by_rank[r]`, in issue order) all complete under in-order
//! rules, else why not: the first message that would be delivered to a receive expecting
//! another (the k-th send from a to b meets the k-th receive at b from a, whatever it expects),
//! a message without its other side, or the group each rank is stuck in.
inline std::string in_order_deadlock(const std::vector<std::vector<PlannedGroup>>& by_rank) {
  const int ranks = static_cast<int>(by_rank.size());
  struct Place {
    int rank = 0;
    std::size_t group = 0, call = 0;
  };
  // Match the k-th send from a to b with the k-th receive at b from a.
  std::vector<std::vector<std::vector<Place>>> sends(static_cast<std::size_t>(ranks),
                                                     std::vector<std::vector<Place>>(static_cast<std::size_t>(ranks)));
  auto receives = sends;
  for (int r = 0; r < ranks; ++r)
    for (std::size_t g = 0; g < by_rank[static_cast<std::size_t>(r)].size(); ++g)
      for (std::size_t c = 0; c < by_rank[static_cast<std::size_t>(r)][g].size(); ++c) {
        const PlannedMessage& m = by_rank[static_cast<std::size_t>(r)][g][c];
        if (m.peer < 0 || m.peer >= ranks || m.peer == r)
          return "rank " + std::to_string(r) + ": " + m.text() + " names no other rank of " + std::to_string(ranks);
        if (m.send)
          sends[static_cast<std::size_t>(r)][static_cast<std::size_t>(m.peer)].push_back({r, g, c});
        else
          receives[static_cast<std::size_t>(m.peer)][static_cast<std::size_t>(r)].push_back({r, g, c});
      }
  const auto at = [&](const Place& p) -> const PlannedMessage& {
    return by_rank[static_cast<std::size_t>(p.rank)][p.group][p.call];
  };
  // For every call, the place of its other side.
  std::vector<std::vector<std::vector<Place>>> partner(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    partner[static_cast<std::size_t>(r)].resize(by_rank[static_cast<std::size_t>(r)].size());
    for (std::size_t g = 0; g < by_rank[static_cast<std::size_t>(r)].size(); ++g)
      partner[static_cast<std::size_t>(r)][g].resize(by_rank[static_cast<std::size_t>(r)][g].size());
  }
  for (int a = 0; a < ranks; ++a)
    for (int b = 0; b < ranks; ++b) {
      const auto& s = sends[static_cast<std::size_t>(a)][static_cast<std::size_t>(b)];
      const auto& v = receives[static_cast<std::size_t>(a)][static_cast<std::size_t>(b)];
      for (std::size_t k = 0; k < std::max(s.size(), v.size()); ++k) {
        if (k >= v.size()) return "rank " + std::to_string(a) + ": " + at(s[k]).text() + " is never received";
        if (k >= s.size()) return "rank " + std::to_string(b) + ": " + at(v[k]).text() + " is never sent";
        if (!at(s[k]).same_message(at(v[k])))
          return "rank " + std::to_string(b) + ": " + at(v[k]).text() + " would get rank " + std::to_string(a) +
                 "'s " + at(s[k]).text() + " (sent in that order, and point-to-point has no tags)";
        partner[static_cast<std::size_t>(a)][s[k].group][s[k].call] = v[k];
        partner[static_cast<std::size_t>(b)][v[k].group][v[k].call] = s[k];
      }
    }
  // Run: each rank works in its current group; a call completes when its other side's group is
  // current on the other rank; a group ends when all its calls have completed.
  std::vector<std::size_t> current(static_cast<std::size_t>(ranks), 0);
  std::vector<std::vector<std::vector<bool>>> done(static_cast<std::size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    for (const PlannedGroup& g : by_rank[static_cast<std::size_t>(r)])
      done[static_cast<std::size_t>(r)].emplace_back(g.size(), false);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < ranks; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      while (current[ru] < by_rank[ru].size()) {
        const std::size_t g = current[ru];
        bool all = true;
        for (std::size_t c = 0; c < by_rank[ru][g].size(); ++c) {
          if (done[ru][g][c]) continue;
          const Place& o = partner[ru][g][c];
          if (current[static_cast<std::size_t>(o.rank)] == o.group) {
            done[ru][g][c] = true;
            done[static_cast<std::size_t>(o.rank)][o.group][o.call] = true;
            progress = true;
          } else {
            all = false;
          }
        }
        if (!all) break;
        ++current[ru];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int r = 0; r < ranks; ++r) {
    const auto ru = static_cast<std::size_t>(r);
    if (current[ru] == by_rank[ru].size()) continue;
    stuck += (stuck.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) + " waits in {";
    for (std::size_t c = 0; c < by_rank[ru][current[ru]].size(); ++c)
      stuck += (c > 0 ? ", " : "") + by_rank[ru][current[ru]][c].text();
    stuck += "}";
  }
  return stuck;
}

//! The first grouping (per action, then per unit) under which the groups of every pipeline rank
//! complete under in-order rules, or none; `why_not` says where each one tried would stop.
struct GroupingChoice {
  std::optional<MessageGrouping> safe;
  std::string why_not;
};

//! `actions[s]` are the actions of pipeline rank s on `shape` (whose `stage` is ignored). Not a
//! template over how the caller finds them: every Trainer type shares this one.
inline GroupingChoice choose_grouping(const std::vector<std::vector<Action>>& actions, ScheduleShape shape) {
  GroupingChoice choice;
  for (const MessageGrouping g : {MessageGrouping::per_action, MessageGrouping::per_unit}) {
    std::vector<std::vector<PlannedGroup>> by_rank;
    for (int s = 0; s < shape.stages; ++s) {
      shape.stage = s;
      by_rank.push_back(executor_groups(actions[static_cast<std::size_t>(s)], shape, g));
    }
    const std::string why = in_order_deadlock(by_rank);
    if (why.empty()) return {g, ""};
    choice.why_not += (choice.why_not.empty() ? "" : "; ") + std::string("grouped ") + to_string(g) + ": " + why;
  }
  return choice;
}

}  // namespace loom::detail
