// Pipeline schedules as pure generators, checked without a model: every schedule on every
// pipeline of up to 8 stages and 16 micro-batches is complete, deadlock-free and respects its
// dependencies (checked here independently of the simulator), holds the activations it
// declares, and has the bubble its formula promises.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/schedule/concepts.hpp"
#include "loom/schedule/gpipe.hpp"
#include "loom/schedule/gradient_accumulation.hpp"
#include "loom/schedule/interleaved.hpp"
#include "loom/schedule/one_f_one_b.hpp"
#include "loom/schedule/simulate.hpp"
#include "loom/schedule/zero_bubble.hpp"
#include "support/gradcheck.hpp"

namespace test_schedules {

using namespace loom;
using Kind = Action::Kind;

namespace {

constexpr int max_stages = 8;
constexpr std::int64_t max_micro_batches = 16;

// The pipelines each schedule is checked on: p in 1..8 and m in 1..16; the interleaved one
// with v in 2..4 and m a multiple of p (its rule).
template <class S>
std::vector<ScheduleShape> pipelines() {
  std::vector<ScheduleShape> out;
  for (int p = 1; p <= max_stages; ++p)
    for (std::int64_t m = 1; m <= max_micro_batches; ++m)
      out.push_back({.stages = p, .stage = 0, .micro_batches = m});
  return out;
}
template <>
std::vector<ScheduleShape> pipelines<Interleaved1F1B>() {
  std::vector<ScheduleShape> out;
  for (int v = 2; v <= 4; ++v)
    for (int p = 1; p <= max_stages; ++p)
      for (std::int64_t m = p; m <= max_micro_batches; m += p)
        out.push_back({.stages = p, .stage = 0, .micro_batches = m, .virtual_stages = v});
  return out;
}

ScheduleShape on_rank(ScheduleShape shape, int rank) {
  shape.stage = rank;
  return shape;
}

// Whether the schedule splits its backwards into I and W (ZB-H1) or runs them whole.
template <class S>
constexpr bool splits_backward = std::is_same_v<S, ZeroBubbleH1>;

// Each (rank, chunk, micro-batch) has one forward and one whole backward, or one I and one W,
// and nothing else.
template <class S>
void check_complete(const S& schedule, const ScheduleShape& shape) {
  const std::int64_t m = shape.micro_batches;
  for (int r = 0; r < shape.stages; ++r) {
    const auto actions = schedule.actions(on_rank(shape, r));
    CAPTURE(r);
    std::vector<int> counts(static_cast<std::size_t>(4 * shape.virtual_stages * m), 0);
    for (const Action& a : actions) {
      REQUIRE(a.micro_batch >= 0);
      REQUIRE(a.micro_batch < m);
      REQUIRE(a.chunk >= 0);
      REQUIRE(a.chunk < shape.virtual_stages);
      ++counts[static_cast<std::size_t>((a.chunk * m + a.micro_batch) * 4 + static_cast<int>(a.kind))];
    }
    for (std::size_t pair = 0; pair < counts.size() / 4; ++pair) {
      CAPTURE(pair);
      CHECK(counts[pair * 4 + static_cast<int>(Kind::forward)] == 1);
      CHECK(counts[pair * 4 + static_cast<int>(Kind::backward)] == (splits_backward<S> ? 0 : 1));
      CHECK(counts[pair * 4 + static_cast<int>(Kind::backward_input)] == (splits_backward<S> ? 1 : 0));
      CHECK(counts[pair * 4 + static_cast<int>(Kind::backward_weight)] == (splits_backward<S> ? 1 : 0));
    }
    CHECK(actions.size() == static_cast<std::size_t>((splits_backward<S> ? 3 : 2) *
                                                      shape.virtual_stages * m));
  }
}

// The simulation obeys the rules, checked from its timed actions alone: each rank runs its
// actions one at a time for their cost, and every action starts after its dependencies finish.
void check_dependencies(const Simulation& sim) {
  const int p = sim.shape.stages, v = sim.shape.virtual_stages;
  const std::int64_t m = sim.shape.micro_batches;
  const std::size_t pairs = static_cast<std::size_t>(p * v * m);
  std::vector<double> forward_finish(pairs, -1), gradient_finish(pairs, -1);
  auto index = [&](int rank, const Action& a) {
    return static_cast<std::size_t>((a.chunk * p + rank) * m + a.micro_batch);
  };
  for (int r = 0; r < p; ++r)
    for (const TimedAction& t : sim.ranks[static_cast<std::size_t>(r)]) {
      if (t.action.kind == Kind::forward) forward_finish[index(r, t.action)] = t.finish;
      if (t.action.kind == Kind::backward || t.action.kind == Kind::backward_input)
        gradient_finish[index(r, t.action)] = t.finish;
    }
  for (int r = 0; r < p; ++r) {
    double previous = 0;
    for (const TimedAction& t : sim.ranks[static_cast<std::size_t>(r)]) {
      INFO("rank " << r << " " << t.action);
      CHECK(t.start >= previous);
      CHECK(t.finish - t.start == doctest::Approx(sim.costs.of(t.action.kind) / v).epsilon(1e-12));
      previous = t.finish;
      const std::size_t at = index(r, t.action);
      const int k = t.action.chunk * p + r;
      switch (t.action.kind) {
        case Kind::forward:
          if (k > 0) CHECK(t.start >= forward_finish[at - static_cast<std::size_t>(m)]);
          break;
        case Kind::backward:
        case Kind::backward_input:
          CHECK(t.start >= forward_finish[at]);
          if (k + 1 < p * v) CHECK(t.start >= gradient_finish[at + static_cast<std::size_t>(m)]);
          break;
        case Kind::backward_weight:
          CHECK(t.start >= gradient_finish[at]);
          break;
      }
    }
  }
}

double gpipe_bubble(int p, std::int64_t m) {
  return static_cast<double>(p - 1) / static_cast<double>(m + p - 1);
}

// Whole-number costs (so timelines print) under which the formulas are exact: the
// zero-bubble convention F = 1, B = 2 first.
const std::vector<Costs> uniform_costs = {
    Costs{}, Costs{.forward = 1, .backward = 1}, Costs{.forward = 2, .backward = 1},
    Costs{.forward = 1, .backward = 3}};

}  // namespace

namespace {

// Near misses: no opt-in tag; a live count that is not a number; actions that need more than
// the shape.
struct Untagged {
  std::vector<Action> actions(const ScheduleShape&) const;
  std::int64_t live_micro_batches(const ScheduleShape&) const;
};
struct LiveAsText {
  using loom_schedule = void;
  std::vector<Action> actions(const ScheduleShape&) const;
  std::string live_micro_batches(const ScheduleShape&) const;
};
struct NeedsARank {
  using loom_schedule = void;
  std::vector<Action> actions(const ScheduleShape&, int rank) const;
  std::int64_t live_micro_batches(const ScheduleShape&) const;
};

}  // namespace

TEST_CASE("Schedule concept: the pipeline schedules model it, near misses do not") {
  CHECK(Schedule<GPipe>);
  CHECK(Schedule<OneFOneB>);
  CHECK(Schedule<Interleaved1F1B>);
  CHECK(Schedule<ZeroBubbleH1>);
  CHECK(Schedule<GradientAccumulation>);
  CHECK_FALSE(Schedule<Untagged>);
  CHECK_FALSE(Schedule<LiveAsText>);
  CHECK_FALSE(Schedule<NeedsARank>);
  CHECK_FALSE(Schedule<Costs>);
}

TEST_CASE("Actions, shapes and costs print and compare") {
  auto text = [](const auto& value) {
    std::ostringstream out;
    out << value;
    return out.str();
  };
  CHECK(text(Action{Kind::forward, 3}) == "F3");
  CHECK(text(Action{Kind::backward, 3}) == "B3");
  CHECK(text(Action{Kind::backward_input, 3}) == "I3");
  CHECK(text(Action{Kind::backward_weight, 12}) == "W12");
  CHECK(text(Action{Kind::forward, 3, 1}) == "F3.1");
  CHECK(Action{Kind::forward, 3} == Action{Kind::forward, 3, 0});
  CHECK_FALSE(Action{Kind::forward, 3} == Action{Kind::forward, 3, 1});
  const ScheduleShape shape{.stages = 4, .stage = 1, .micro_batches = 8, .virtual_stages = 2};
  CHECK(text(shape) == "{stages=4, stage=1, micro_batches=8, virtual_stages=2}");
  CHECK(shape == ScheduleShape{.stages = 4, .stage = 1, .micro_batches = 8, .virtual_stages = 2});
  CHECK_FALSE(shape == ScheduleShape{.stages = 4, .stage = 1, .micro_batches = 8});
  CHECK(ScheduleShape{}.virtual_stages == 1);
  CHECK(virtual_stage(shape, 1) == 5);  // chunk 1 of rank 1 of 4: Megatron's c·p + s
  CHECK(text(Costs{}) == "{forward=1, backward=2, backward_input=1, backward_weight=1}");
}

TEST_CASE_TEMPLATE("pipeline schedule: complete, deadlock-free, dependencies respected, memory as declared",
                   S, GPipe, OneFOneB, Interleaved1F1B, ZeroBubbleH1) {
  const S schedule;
  for (const ScheduleShape& shape : pipelines<S>()) {
    CAPTURE(shape);
    check_complete(schedule, shape);
    Simulation sim;
    REQUIRE_NOTHROW(sim = simulate(schedule, shape));
    check_dependencies(sim);
    for (int r = 0; r < shape.stages; ++r) {
      CAPTURE(r);
      CHECK(sim.peak_live[static_cast<std::size_t>(r)] ==
            schedule.live_micro_batches(on_rank(shape, r)));
    }
  }
}

TEST_CASE("GPipe: all forwards, then all backwards; m alive on every rank; bubble (p-1)/(m+p-1)") {
  const GPipe gpipe;
  CHECK(gpipe.actions({.stages = 2, .stage = 1, .micro_batches = 2}) ==
        std::vector<Action>{{Kind::forward, 0}, {Kind::forward, 1}, {Kind::backward, 0},
                            {Kind::backward, 1}});
  for (const ScheduleShape& shape : pipelines<GPipe>()) {
    CAPTURE(shape);
    for (int r = 0; r < shape.stages; ++r)
      CHECK(gpipe.live_micro_batches(on_rank(shape, r)) == shape.micro_batches);
    for (const Costs& costs : uniform_costs) {
      CAPTURE(costs);
      CHECK(std::abs(simulate(gpipe, shape, costs).idle_fraction() -
                     gpipe_bubble(shape.stages, shape.micro_batches)) < 1e-12);
    }
  }
}

TEST_CASE("1F1B: at most min(p - stage, m) <= p alive; bubble (p-1)/(m+p-1) as GPipe's") {
  const OneFOneB one_f_one_b;
  for (const ScheduleShape& shape : pipelines<OneFOneB>()) {
    CAPTURE(shape);
    for (int r = 0; r < shape.stages; ++r) {
      const std::int64_t live = one_f_one_b.live_micro_batches(on_rank(shape, r));
      CHECK(live == std::min<std::int64_t>(shape.stages - r, shape.micro_batches));
      CHECK(live <= shape.stages);
    }
    for (const Costs& costs : uniform_costs) {
      CAPTURE(costs);
      CHECK(std::abs(simulate(one_f_one_b, shape, costs).idle_fraction() -
                     gpipe_bubble(shape.stages, shape.micro_batches)) < 1e-12);
    }
  }
}

TEST_CASE("1F1B on one stage is gradient accumulation, which still rejects pipeline stages") {
  for (std::int64_t m = 1; m <= max_micro_batches; ++m) {
    const ScheduleShape shape{.stages = 1, .stage = 0, .micro_batches = m};
    CHECK(OneFOneB{}.actions(shape) == GradientAccumulation{}.actions(shape));
    CHECK(OneFOneB{}.live_micro_batches(shape) == GradientAccumulation{}.live_micro_batches(shape));
  }
  CHECK_THROWS_AS(GradientAccumulation{}.actions({.stages = 2, .stage = 0, .micro_batches = 4}),
                  Error);
}

TEST_CASE("Interleaved 1F1B: Megatron's order and warm-up; bubble (p-1)/(v*m+p-1)") {
  const Interleaved1F1B interleaved;
  // p = 2, v = 2, m = 4, rank 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards over groups of p
  // micro-batches, chunk 0 then chunk 1; backwards take chunk 1 first.
  const ScheduleShape small{.stages = 2, .stage = 0, .micro_batches = 4, .virtual_stages = 2};
  std::ostringstream order;
  for (const Action& a : interleaved.actions(small)) order << a << ' ';
  CHECK(order.str() == "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3 ");
  CHECK(interleaved.live_micro_batches(small) == 5);

  // Costs are per whole stage, so a chunk's action costs 1/v of them: the schedules do the
  // same work as 1F1B, and the bubble shrinks by v. Exact for v = 1 too.
  for (int v = 1; v <= 4; ++v)
    for (int p = 1; p <= max_stages; ++p)
      for (std::int64_t m = p; m <= max_micro_batches; m += p) {
        const ScheduleShape shape{.stages = p, .stage = 0, .micro_batches = m, .virtual_stages = v};
        CAPTURE(shape);
        for (int r = 0; r < p; ++r) {
          const std::int64_t warmup = std::min<std::int64_t>((p - r - 1) * 2 + (v - 1) * p, m * v);
          CHECK(interleaved.live_micro_batches(on_rank(shape, r)) == std::min(warmup + 1, m * v));
        }
        for (const Costs& costs : uniform_costs) {
          CAPTURE(costs);
          const Simulation sim = simulate(interleaved, shape, costs);
          CHECK(std::abs(sim.idle_fraction() -
                         static_cast<double>(p - 1) / static_cast<double>(v * m + p - 1)) < 1e-12);
          // The same total work per rank as 1F1B: m·(F+B).
          for (double busy : sim.busy)
            CHECK(busy == doctest::Approx(static_cast<double>(m) * (costs.forward + costs.backward)));
        }
      }
}

TEST_CASE("ZB-H1: at most p alive (freed after W); bubble below 1F1B's, (p-1)(F+I-W) when m >= p") {
  const ZeroBubbleH1 zero_bubble;
  for (const ScheduleShape& shape : pipelines<ZeroBubbleH1>()) {
    CAPTURE(shape);
    const int p = shape.stages;
    const std::int64_t m = shape.micro_batches;
    for (int r = 0; r < p; ++r) {
      const std::int64_t live = zero_bubble.live_micro_batches(on_rank(shape, r));
      CHECK(live == std::min<std::int64_t>(p, m));
      CHECK(live <= p);
    }
    // The default costs compare like with like: 1F1B's B = ZB-H1's I + W.
    const double zb = simulate(zero_bubble, shape).idle_fraction();
    const double baseline = simulate(OneFOneB{}, shape).idle_fraction();
    if (p >= 2) CHECK(zb < baseline);
    // With a full pipeline (m >= p) and W no longer than F or I, the bubble is exactly the
    // paper's (p-1)(F+I-W) per rank.
    if (m >= p)
      for (const Costs& costs :
           {Costs{}, Costs{.forward = 2, .backward = 3, .backward_input = 2, .backward_weight = 1},
            Costs{.forward = 1, .backward = 3, .backward_input = 2, .backward_weight = 1},
            Costs{.forward = 3, .backward = 5, .backward_input = 3, .backward_weight = 2}}) {
        CAPTURE(costs);
        const double bubble =
            (p - 1) * (costs.forward + costs.backward_input - costs.backward_weight);
        const double work =
            static_cast<double>(m) * (costs.forward + costs.backward_input + costs.backward_weight);
        CHECK(std::abs(simulate(zero_bubble, shape, costs).idle_fraction() -
                       bubble / (bubble + work)) < 1e-12);
      }
  }
}

TEST_CASE("Timelines: golden lines for p = 4, m = 8, and one example per schedule") {
  const ScheduleShape shape{.stages = 4, .stage = 0, .micro_batches = 8};
  auto lines = [](const std::string& text) {
    std::vector<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  };

  std::ostringstream order;
  for (const Action& a : OneFOneB{}.actions(shape)) order << a << ' ';
  CHECK(order.str() == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7 ");

  // With F = B = 1 each action is one slot.
  const auto unit = lines(timeline(OneFOneB{}, shape, {.forward = 1, .backward = 1}));
  REQUIRE(unit.size() == 4);
  CHECK(unit[0] == "rank 0: F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7");
  CHECK(unit[3] == "rank 3: .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .");

  // The default costs, F = 1 and B = 2: a backward fills two slots.
  const auto one_f_one_b = lines(timeline(OneFOneB{}, shape));
  REQUIRE(one_f_one_b.size() == 4);
  CHECK(one_f_one_b[0] ==
        "rank 0: F0 F1 F2 F3 .  .  .  .  .  .  B0 B0 F4 B1 B1 F5 B2 B2 F6 B3 B3 F7 B4 B4 .  B5 B5 "
        ".  B6 B6 .  B7 B7");
  const auto gpipe = lines(timeline(GPipe{}, shape));
  REQUIRE(gpipe.size() == 4);
  CHECK(gpipe[0] ==
        "rank 0: F0 F1 F2 F3 F4 F5 F6 F7 .  .  .  .  .  .  .  .  .  B0 B0 B1 B1 B2 B2 B3 B3 B4 B4 "
        "B5 B5 B6 B6 B7 B7");
  CHECK(gpipe[3] ==
        "rank 3: .  .  .  F0 F1 F2 F3 F4 F5 F6 F7 B0 B0 B1 B1 B2 B2 B3 B3 B4 B4 B5 B5 B6 B6 B7 B7 "
        ".  .  .  .  .  .");
  const auto zero_bubble = lines(timeline(ZeroBubbleH1{}, shape));
  REQUIRE(zero_bubble.size() == 4);
  CHECK(zero_bubble[3] ==
        "rank 3: .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7");

  ScheduleShape interleaved_shape = shape;
  interleaved_shape.virtual_stages = 2;
  MESSAGE("GPipe, p = 4, m = 8, F = 1, B = 2:\n" << timeline(GPipe{}, shape));
  MESSAGE("1F1B, p = 4, m = 8, F = 1, B = 2:\n" << timeline(OneFOneB{}, shape));
  MESSAGE("Interleaved 1F1B, p = 4, m = 8, v = 2, F = 1, B = 2 per stage (a column is 1/2):\n"
          << timeline(Interleaved1F1B{}, interleaved_shape));
  MESSAGE("ZB-H1, p = 4, m = 8, F = I = W = 1:\n" << timeline(ZeroBubbleH1{}, shape));

  // Costs that are not whole slots cannot be drawn.
  test::expect_error([&] { (void)timeline(OneFOneB{}, shape, {.forward = 1.5}); },
                     "must fall on a slot boundary");
}

namespace {

// Two ranks that wait on each other: rank 1 wants micro-batch 1 first, rank 0 only sends it
// after micro-batch 0's backward, which needs rank 1.
struct CrossedOrders {
  using loom_schedule = void;
  std::vector<Action> actions(const ScheduleShape& shape) const {
    if (shape.stage == 0)
      return {{Kind::forward, 0}, {Kind::backward, 0}, {Kind::forward, 1}, {Kind::backward, 1}};
    return {{Kind::forward, 1}, {Kind::forward, 0}, {Kind::backward, 0}, {Kind::backward, 1}};
  }
  std::int64_t live_micro_batches(const ScheduleShape&) const { return 2; }
};

}  // namespace

TEST_CASE("simulate: reports a deadlock naming each stuck rank, its action and what it waits for") {
  const ScheduleShape shape{.stages = 2, .stage = 0, .micro_batches = 2};
  test::expect_error([&] { (void)simulate(CrossedOrders{}, shape); }, "simulate: deadlock");
  test::expect_error([&] { (void)simulate(CrossedOrders{}, shape); },
                     "rank 0 B0 waits for B0 on rank 1; rank 1 F1 waits for F1 on rank 0");
  // A backward before its own forward is stuck too.
  test::expect_error(
      [&] {
        (void)simulate({{{Kind::backward, 0}, {Kind::forward, 0}}},
                       {.stages = 1, .stage = 0, .micro_batches = 1});
      },
      "rank 0 B0 waits for F0 on rank 0");
}

TEST_CASE("simulate: rejects incomplete or out-of-range action lists, naming them") {
  const ScheduleShape two{.stages = 2, .stage = 0, .micro_batches = 1};
  const std::vector<Action> whole{{Kind::forward, 0}, {Kind::backward, 0}};
  test::expect_error([&] { (void)simulate({whole}, two); }, "need one per pipeline stage (2)");
  test::expect_error([&] { (void)simulate({whole, {{Kind::forward, 0}}}, two); },
                     "rank 1, chunk 0, micro-batch 0: 1 F, 0 B, 0 I, 0 W");
  test::expect_error(
      [&] { (void)simulate({whole, {{Kind::forward, 0}, {Kind::forward, 0}, {Kind::backward, 0}}}, two); },
      "2 F, 1 B");
  test::expect_error(
      [&] {
        (void)simulate({whole, {{Kind::forward, 0}, {Kind::backward, 0}, {Kind::backward_weight, 0}}},
                       two);
      },
      "1 F, 1 B, 0 I, 1 W");
  test::expect_error([&] { (void)simulate({whole, {{Kind::forward, 1}, {Kind::backward, 0}}}, two); },
                     "rank 1 F1");
  test::expect_error(
      [&] { (void)simulate({whole, {{Kind::forward, 0, 1}, {Kind::backward, 0}}}, two); },
      "chunk of an action: got rank 1 F0.1");
  test::expect_error([&] { (void)simulate(OneFOneB{}, {.stages = 2, .micro_batches = 2}, {.backward = 0}); },
                     "every cost must be finite and > 0");
  // Mixing whole and split backwards across stages is allowed: the split one's I sends the gradient.
  const Simulation mixed = simulate(
      {whole, {{Kind::forward, 0}, {Kind::backward_input, 0}, {Kind::backward_weight, 0}}}, two);
  CHECK(mixed.makespan == 5);  // F F I (W on rank 1 overlaps) B B on rank 0
}

TEST_CASE("pipeline schedules reject bad shapes, naming the value and the rule") {
  auto all_reject = [](const ScheduleShape& shape, const std::string& fragment) {
    CAPTURE(shape);
    test::expect_error([&] { (void)GPipe{}.actions(shape); }, fragment);
    test::expect_error([&] { (void)OneFOneB{}.live_micro_batches(shape); }, fragment);
    test::expect_error([&] { (void)Interleaved1F1B{}.actions(shape); }, fragment);
    test::expect_error([&] { (void)ZeroBubbleH1{}.actions(shape); }, fragment);
  };
  all_reject({.stages = 0, .stage = 0, .micro_batches = 4}, "pipeline stages: got 0; must be >= 1");
  all_reject({.stages = 4, .stage = 4, .micro_batches = 4}, "stage: got 4; must be in [0, stages) = [0, 4)");
  all_reject({.stages = 4, .stage = -1, .micro_batches = 4}, "stage: got -1");
  all_reject({.stages = 4, .stage = 0, .micro_batches = 0}, "micro-batches: got 0; must be >= 1");
  all_reject({.stages = 4, .stage = 0, .micro_batches = 4, .virtual_stages = 0},
             "virtual stages: got 0; must be >= 1");
  test::expect_error(
      [] { (void)OneFOneB{}.actions({.stages = 4, .stage = 0, .micro_batches = 8, .virtual_stages = 2}); },
      "OneFOneB: virtual stages: got 2; this schedule runs one model chunk per rank; use "
      "Interleaved1F1B");
  test::expect_error(
      [] { (void)GPipe{}.live_micro_batches({.stages = 2, .micro_batches = 2, .virtual_stages = 2}); },
      "GPipe: virtual stages: got 2");
  test::expect_error(
      [] { (void)ZeroBubbleH1{}.actions({.stages = 2, .micro_batches = 2, .virtual_stages = 3}); },
      "ZeroBubbleH1: virtual stages: got 3");
  test::expect_error(
      [] { (void)Interleaved1F1B{}.actions({.stages = 4, .micro_batches = 6, .virtual_stages = 2}); },
      "Interleaved1F1B: micro-batches: got 6; must be a multiple of pipeline stages (4)");
  test::expect_error(
      [] {
        (void)Interleaved1F1B{}.live_micro_batches({.stages = 4, .micro_batches = 6, .virtual_stages = 2});
      },
      "Megatron's rule");
}

}  // namespace test_schedules
