// Each policy concept, tested both ways: a type that models it and a near miss that does not.
#include <doctest/doctest.h>

#include <vector>

#include "loom/comm/collectives.hpp"
#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"

namespace test_concepts {

using namespace loom;

namespace {

// Backend: the right members but no opt-in tag.
struct UntaggedBackend {
  void* allocate(std::size_t, MemoryCategory);
  void deallocate(void*, std::size_t, MemoryCategory);
  const MemoryTracker& memory() const;
  void fill_zero(void*, std::size_t);
  void copy_from_host(void*, const void*, std::size_t);
  void copy_to_host(void*, const void*, std::size_t);
  void synchronize();
};
struct TaggedBackend : UntaggedBackend {
  using loom_backend = void;
};
struct BackendWithoutMemory {
  using loom_backend = void;
  void* allocate(std::size_t, MemoryCategory);
};

// Schedule: the shape of one with no tag, and one whose actions return the wrong type.
struct UntaggedSchedule {
  std::vector<Action> actions(const ScheduleShape&) const;
  std::int64_t live_micro_batches(const ScheduleShape&) const;
};
struct WrongActions {
  using loom_schedule = void;
  std::vector<int> actions(const ScheduleShape&) const;
  std::int64_t live_micro_batches(const ScheduleShape&) const;
};

struct UntaggedOptimizer {
  struct Options {};
  static constexpr int state_slots = 1;
  Options options() const;
};
struct TooMuchState {
  using loom_optimizer = void;
  struct Options {};
  static constexpr int state_slots = 3;
  Options options() const;
};

struct NotAStrategy {};

}  // namespace

TEST_CASE("Backend concept") {
  CHECK(Backend<cpu>);
  CHECK(Backend<TaggedBackend>);
  CHECK_FALSE(Backend<UntaggedBackend>);
  CHECK_FALSE(Backend<BackendWithoutMemory>);
}

TEST_CASE("Schedule concept") {
  CHECK(Schedule<GradientAccumulation>);
  CHECK_FALSE(Schedule<UntaggedSchedule>);
  CHECK_FALSE(Schedule<WrongActions>);
}

TEST_CASE("Optimizer concept") {
  CHECK(Optimizer<AdamW>);
  CHECK(Optimizer<SgdMomentum>);
  CHECK(Optimizer<Adafactor>);
  CHECK(TensorwiseOptimizer<Adafactor>);
  CHECK_FALSE(TensorwiseOptimizer<AdamW>);
  CHECK_FALSE(TensorwiseOptimizer<SgdMomentum>);
  CHECK_FALSE(Optimizer<UntaggedOptimizer>);
  CHECK_FALSE(Optimizer<TooMuchState>);
}

TEST_CASE("Strategy concept and its engine") {
  CHECK(Strategy<SingleRank>);
  CHECK_FALSE(Strategy<NotAStrategy>);
  CHECK(StrategyEngine<SingleRank::Engine<cpu, float>, float>);
  CHECK_FALSE(StrategyEngine<SingleRank::Engine<cpu, float>, double>);
}

TEST_CASE("Model concept") {
  CHECK(Model<gpt2::Model<cpu, float>>);
  CHECK(Model<gpt2::Model<cpu, double>>);
  CHECK_FALSE(Model<gpt2::Config>);
}

TEST_CASE("LrSchedule concept") {
  CHECK(LrSchedule<ConstantLr>);
  CHECK(LrSchedule<WarmupCosineLr>);
  CHECK_FALSE(LrSchedule<AdamW>);
}

TEST_CASE("GradientAccumulation generates F0 B0 F1 B1 ... and rejects pipeline stages") {
  const GradientAccumulation g;
  const auto a = g.actions({.stages = 1, .stage = 0, .micro_batches = 3});
  REQUIRE(a.size() == 6);
  CHECK(a[0] == Action{Action::Kind::forward, 0});
  CHECK(a[1] == Action{Action::Kind::backward, 0});
  CHECK(a[4] == Action{Action::Kind::forward, 2});
  CHECK(a[5] == Action{Action::Kind::backward, 2});
  CHECK(g.live_micro_batches({.stages = 1, .stage = 0, .micro_batches = 8}) == 1);
  CHECK_THROWS_AS(g.actions({.stages = 2, .stage = 0, .micro_batches = 3}), Error);
  CHECK_THROWS_AS(g.actions({.stages = 1, .stage = 0, .micro_batches = 0}), Error);
}

namespace {

// Communicator: an archetype with exactly the members the concept asks for (the typed
// collectives come from CollectiveInterface), and near misses.
struct CommunicatorArchetype : loom::CollectiveInterface<CommunicatorArchetype> {
  using loom_communicator = void;
  int rank() const;
  int size() const;
  void run(const loom::CollectiveCall&);
  loom::Request start(const loom::CollectiveCall&);
  CommunicatorArchetype split(int color, int key);
};
struct UntaggedCommunicator : loom::CollectiveInterface<UntaggedCommunicator> {
  int rank() const;
  int size() const;
  void run(const loom::CollectiveCall&);
  loom::Request start(const loom::CollectiveCall&);
  UntaggedCommunicator split(int color, int key);
};
struct SplitReturnsAnotherType : loom::CollectiveInterface<SplitReturnsAnotherType> {
  using loom_communicator = void;
  int rank() const;
  int size() const;
  void run(const loom::CollectiveCall&);
  loom::Request start(const loom::CollectiveCall&);
  CommunicatorArchetype split(int color, int key);
};
// The core without the typed front end.
struct CoreOnlyCommunicator {
  using loom_communicator = void;
  int rank() const;
  int size() const;
  void run(const loom::CollectiveCall&);
  loom::Request start(const loom::CollectiveCall&);
  CoreOnlyCommunicator split(int color, int key);
};

}  // namespace

TEST_CASE("Communicator concept") {
  CHECK(loom::Communicator<loom::threads::Communicator>);
  CHECK(loom::Communicator<CommunicatorArchetype>);
  CHECK_FALSE(loom::Communicator<UntaggedCommunicator>);
  CHECK_FALSE(loom::Communicator<SplitReturnsAnotherType>);
  CHECK_FALSE(loom::Communicator<CoreOnlyCommunicator>);
  CHECK_FALSE(loom::Communicator<int>);
}

}  // namespace test_concepts
