// Zero<1>, Zero<2>, Zero<3> on thread ranks: parity with one-rank training for every stage and
// DP = 1..4, with and without gradient accumulation and clipping; results independent of unit
// size, overlap and stage-3 prefetch; hybrid sharding (replicas) likewise; memory per rank equal
// to the ZeRO formulas for fp32 AdamW (with padding reported apart); the shard plan; rejected
// configurations.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/parity.hpp"
#include "support/training.hpp"

namespace test_zero {

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t global_batch = 12, seq = 16;
using Gpt = gpt2::Model<cpu, float>;

template <class St>
ParityRun sharded(int ranks, std::int64_t micro_batch, double clip, St strategy = {}) {
  return thread_ranks_run(ranks, global_batch, seq, micro_batch, clip, strategy);
}

template <class St>
void check_stage_parity(St strategy = {}) {
  for (double clip : {0.0, 0.05}) {
    const ParityRun reference = single_rank_run(global_batch, seq, clip);
    for (int ranks = 1; ranks <= 4; ++ranks)
      for (std::int64_t micro_batch : {global_batch / ranks, std::int64_t{1}}) {
        CAPTURE(clip);
        CAPTURE(ranks);
        CAPTURE(micro_batch);
        check_parity(sharded<St>(ranks, micro_batch, clip, strategy), reference);
      }
  }
}

}  // namespace

TEST_CASE("Zero<1> with 1..4 thread ranks trains the same model as one rank") {
  check_stage_parity<Zero<1>>({.bucket_bytes = 4096});
}

TEST_CASE("Zero<2> with 1..4 thread ranks trains the same model as one rank") {
  check_stage_parity<Zero<2>>({.bucket_bytes = 4096});
}

TEST_CASE("Zero<3> with 1..4 thread ranks trains the same model as one rank") {
  check_stage_parity<Zero<3>>();
}

TEST_CASE("ZeRO results do not depend on unit size, overlap or prefetch") {
  const ParityRun reference = single_rank_run(global_batch, seq, 0.0);
  for (std::size_t bucket_bytes : {std::size_t{1}, std::size_t{25} << 20})
    for (bool overlap : {true, false}) {
      CAPTURE(bucket_bytes);
      CAPTURE(overlap);
      check_parity(sharded<Zero<1>>(3, 2, 0.0, {.bucket_bytes = bucket_bytes, .overlap = overlap}), reference);
      check_parity(sharded<Zero<2>>(3, 2, 0.0, {.bucket_bytes = bucket_bytes, .overlap = overlap}), reference);
    }
  for (int prefetch : {0, 1, 2, 5}) {
    CAPTURE(prefetch);
    check_parity(sharded<Zero<3>>(2, 2, 0.0, {.prefetch = prefetch}), reference);
  }
}

TEST_CASE("hybrid sharding: Zero<S> with replicas trains the same model as one rank") {
  // (ranks, replicas): two copies each sharded over 2 ranks, three over 2, two over 3, and one
  // copy per rank (the shard is the whole model: DDP's holding through ZeRO's code).
  const std::vector<std::pair<int, int>> layouts{{4, 2}, {6, 3}, {6, 2}, {2, 2}};
  for (double clip : {0.0, 0.05}) {
    const ParityRun reference = single_rank_run(global_batch, seq, clip);
    for (const std::pair<int, int>& layout : layouts)
      for (std::int64_t micro_batch : {global_batch / layout.first, std::int64_t{1}}) {
        const int ranks = layout.first, replicas = layout.second;  // not bindings: Clang 14 cannot capture those
        CAPTURE(clip);
        CAPTURE(ranks);
        CAPTURE(replicas);
        CAPTURE(micro_batch);
        check_parity(sharded<Zero<1>>(ranks, micro_batch, clip, {.bucket_bytes = 4096, .replicas = replicas}),
                     reference);
        check_parity(sharded<Zero<2>>(ranks, micro_batch, clip, {.bucket_bytes = 4096, .replicas = replicas}),
                     reference);
        check_parity(sharded<Zero<3>>(ranks, micro_batch, clip, {.replicas = replicas}), reference);
      }
  }
}

namespace {
//! A thread communicator that logs every collective its rank issues as "<group>: <call>", its
//! splits logging to the same list as "<group>/<k>" for its k-th split.
class Recording : public CollectiveInterface<Recording> {
 public:
  using loom_communicator = void;
  Recording(threads::Communicator comm, std::vector<std::string>& log, std::string name)
      : comm_(std::move(comm)), log_(&log), name_(std::move(name)) {}
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  void run(const CollectiveCall& call) {
    record(call);
    comm_.run(call);
  }
  Request start(const CollectiveCall& call) {
    record(call);
    return comm_.start(call);
  }
  std::vector<Request> start_group(std::span<const CollectiveCall> calls) {
    for (const CollectiveCall& call : calls) record(call);
    return comm_.start_group(calls);
  }
  Recording split(int color, int key) {
    return Recording(comm_.split(color, key), *log_, name_ + "/" + std::to_string(splits_++));
  }

 private:
  void record(const CollectiveCall& call) {
    std::ostringstream line;
    line << name_ << ": " << call;
    log_->push_back(line.str());
  }
  threads::Communicator comm_;
  std::vector<std::string>* log_;
  std::string name_;
  int splits_ = 0;
};

//! Each rank's log of collectives over two steps of `strategy` on 4 ranks, 3 micro-batches each.
template <class St>
std::vector<std::vector<std::string>> collective_logs(St strategy) {
  std::vector<std::vector<std::string>> logs(4);
  threads::run(4, [&](threads::Communicator& world) {
    std::vector<std::string>& log = logs[static_cast<std::size_t>(world.rank())];
    Recording comm(std::move(world), log, "dp");
    cpu be(1);
    Trainer<Gpt, AdamW, GradientAccumulation, St> trainer(be, comm, Gpt(small_test_config()), AdamW(),
                                                          ConstantLr{.lr = 1e-3}, {.micro_batch_size = 1}, strategy);
    for (std::int64_t step = 0; step < 2; ++step) trainer.step(make_batch(step, global_batch, seq, small_test_config().vocab_size));
  });
  return logs;
}

//! Index of the first (or last) line of log[begin, end) that starts with `prefix`; -1 if none.
std::ptrdiff_t find_line(const std::vector<std::string>& log, std::size_t begin, std::size_t end,
                         const std::string& prefix, bool last) {
  std::ptrdiff_t found = -1;
  for (std::size_t i = begin; i < end; ++i)
    if (log[i].starts_with(prefix)) {
      found = static_cast<std::ptrdiff_t>(i);
      if (!last) break;
    }
  return found;
}
}  // namespace

TEST_CASE("hybrid sharding: every rank issues the same collectives in the same order, replicas' overlapped") {
  // NCCL runs a rank's collectives in issue order; ranks of two groups that issued them in
  // different orders could wait on each other forever. Here the copies' all-reduces ("dp/1")
  // start during the last micro-batch's backward, between the reduce-scatters ("dp/0"), and
  // every rank's sequence is the same.
  const auto check = [](const std::vector<std::vector<std::string>>& logs, bool overlapped) {
    for (std::size_t r = 1; r < logs.size(); ++r) CHECK(logs[r] == logs[0]);
    // The two steps issue the same calls: each is half of the log.
    const std::vector<std::string>& log = logs[0];
    const std::size_t half = log.size() / 2;
    REQUIRE(log.size() == 2 * half);
    CHECK(std::equal(log.begin(), log.begin() + static_cast<std::ptrdiff_t>(half), log.begin() + static_cast<std::ptrdiff_t>(half)));
    for (std::size_t begin : {std::size_t{0}, half}) {
      const std::ptrdiff_t first_replica = find_line(log, begin, begin + half, "dp/1: all_reduce", false);
      const std::ptrdiff_t last_scatter = find_line(log, begin, begin + half, "dp/0: reduce_scatter", true);
      REQUIRE(first_replica >= 0);
      REQUIRE(last_scatter >= 0);
      CHECK((first_replica < last_scatter) == overlapped);
    }
  };
  SUBCASE("Zero<1>") {
    check(collective_logs(Zero<1>{.bucket_bytes = 4096, .replicas = 2}), true);
    check(collective_logs(Zero<1>{.bucket_bytes = 4096, .overlap = false, .replicas = 2}), false);
  }
  SUBCASE("Zero<2>") { check(collective_logs(Zero<2>{.bucket_bytes = 4096, .replicas = 2}), true); }
  SUBCASE("Zero<3>") {
    check(collective_logs(Zero<3>{.replicas = 2}), true);
    check(collective_logs(Zero<3>{.overlap = false, .replicas = 2}), false);
  }
}

namespace {
//! Bytes held per category by each rank right after construction, and after one step.
struct Held {
  std::size_t parameters = 0, gradients = 0, optimizer_state = 0, communication_peak = 0;
  std::int64_t shard = 0, padding = 0, units = 0;
};

//! Deeper than small_test_config, so that one layer's working set is a small part of the whole.
gpt2::Config deep_config() {
  gpt2::Config c = small_test_config();
  c.num_layers = 8;
  return c;
}

template <class St>
std::vector<Held> held_by_rank(int ranks, int replicas = 1) {
  std::vector<Held> held(static_cast<std::size_t>(ranks));
  threads::run(ranks, [&](threads::Communicator& comm) {
    cpu be(1);
    Trainer<Gpt, AdamW, GradientAccumulation, St> trainer(be, comm, Gpt(deep_config()), AdamW(),
                                                          ConstantLr{.lr = 1e-3}, {.micro_batch_size = 1},
                                                          St{.bucket_bytes = 4096, .replicas = replicas});
    Held& h = held[static_cast<std::size_t>(comm.rank())];
    h.parameters = be.memory().current(MemoryCategory::parameters);
    h.gradients = be.memory().current(MemoryCategory::gradients);
    h.optimizer_state = be.memory().current(MemoryCategory::optimizer_state);
    h.shard = trainer.engine().plan().shard_size();
    h.padding = trainer.engine().plan().padding();
    h.units = static_cast<std::int64_t>(trainer.engine().plan().units().size());
    trainer.step(make_batch(0, 2 * ranks, seq, deep_config().vocab_size));
    h.communication_peak = be.memory().peak(MemoryCategory::communication);
  });
  return held;
}
}  // namespace

TEST_CASE("memory per rank: the ZeRO formulas for fp32 AdamW, padding apart") {
  // Ψ parameters (stored, with GPT-2's padded vocabulary), N ranks; a padded full buffer has
  // Ψ' = Ψ + padding = N × shard elements, so each formula holds exactly in Ψ'.
  const auto psi = static_cast<std::size_t>(deep_config().stored_parameter_count());
  for (int n = 1; n <= 4; ++n) {
    CAPTURE(n);
    const auto N = static_cast<std::size_t>(n);
    for (const Held& h : held_by_rank<Zero<1>>(n)) {
      const std::size_t padded = N * static_cast<std::size_t>(h.shard);  // Ψ'
      CHECK(padded == psi + static_cast<std::size_t>(h.padding));
      CHECK(h.padding < h.units * n);  // under one element per rank and unit
      CHECK(h.parameters + h.gradients + h.optimizer_state == 8 * padded + 8 * padded / N);  // 8Ψ + 8Ψ/N
      CHECK(h.optimizer_state == 8 * padded / N);
      CHECK(h.communication_peak == 0);
    }
    for (const Held& h : held_by_rank<Zero<2>>(n)) {
      const std::size_t padded = N * static_cast<std::size_t>(h.shard);
      CHECK(h.parameters + h.gradients + h.optimizer_state == 4 * padded + 12 * padded / N);  // 4Ψ + 12Ψ/N
      CHECK(h.gradients == 4 * padded / N);
      // Per-unit gradient buffers while backward fills them: never the full gradients.
      CHECK(h.communication_peak > 0);
      CHECK(h.communication_peak < 4 * padded / 2);
    }
    for (const Held& h : held_by_rank<Zero<3>>(n)) {
      const std::size_t padded = N * static_cast<std::size_t>(h.shard);
      CHECK(h.parameters + h.gradients + h.optimizer_state == 16 * padded / N);  // 16Ψ/N
      // The gathered parameters and the per-unit gradients, reported apart: a few layers' worth.
      CHECK(h.communication_peak > 0);
      CHECK(h.communication_peak < 4 * padded);
    }
  }
}

TEST_CASE("memory per rank under hybrid sharding: the formulas with N the ranks of one replica") {
  // Four ranks as two replicas hold what two ranks of plain ZeRO hold, byte for byte.
  const auto totals = [](const Held& h) { return h.parameters + h.gradients + h.optimizer_state; };
  const std::vector<Held> two = held_by_rank<Zero<3>>(2);
  for (const Held& h : held_by_rank<Zero<3>>(4, 2)) {
    CHECK(h.shard == two[0].shard);
    CHECK(totals(h) == totals(two[0]));
    CHECK(h.communication_peak == two[0].communication_peak);
  }
  const std::vector<Held> two_1 = held_by_rank<Zero<1>>(2);
  for (const Held& h : held_by_rank<Zero<1>>(4, 2)) CHECK(totals(h) == totals(two_1[0]));
}

TEST_CASE("shard plan: equal pieces per unit, padding at each unit's end, every element owned once") {
  const Gpt model(small_test_config());
  const ParameterLayout& layout = model.layout();
  for (int ranks = 1; ranks <= 5; ++ranks) {
    std::vector<int> owners(static_cast<std::size_t>(layout.total()), 0);
    std::int64_t shard = -1;
    for (int rank = 0; rank < ranks; ++rank) {
      const ShardPlan plan(layout, gradient_buckets(layout, sizeof(float), 1), ranks, rank);
      if (shard >= 0) CHECK(plan.shard_size() == shard);
      shard = plan.shard_size();
      std::int64_t offset = 0;
      for (const ShardUnit& u : plan.units()) {
        CHECK(u.piece * ranks >= u.size);
        CHECK(u.piece * ranks < u.size + ranks);
        CHECK(u.shard_offset == offset);
        offset += u.piece;
        for (std::int64_t i = 0; i < plan.owned_count(u); ++i) ++owners[static_cast<std::size_t>(plan.owned_begin(u) + i)];
      }
    }
    for (int o : owners) REQUIRE(o == 1);
  }
}

TEST_CASE("ZeRO rejects a rank whose shard would hold no parameter, and a bad prefetch") {
  const ParameterLayout tiny({{.name = "w", .shape = Shape{3}, .layer = 0}});
  CHECK_THROWS_WITH_AS(ShardPlan(tiny, gradient_buckets(tiny, 4, 1), 4, 3),
                       doctest::Contains("every rank must own at least one parameter element"), Error);
  CHECK_NOTHROW(ShardPlan(tiny, gradient_buckets(tiny, 4, 1), 3, 2));
  std::mutex mutex;
  std::vector<std::string> messages;
  threads::run(2, [&](threads::Communicator& comm) {
    cpu be(1);
    try {
      Trainer<Gpt, AdamW, GradientAccumulation, Zero<3>> trainer(be, comm, Gpt(small_test_config()), AdamW(),
                                                                 ConstantLr{}, {}, {.prefetch = -1});
    } catch (const Error& e) {
      std::lock_guard lock(mutex);
      messages.push_back(e.what());
    }
  });
  REQUIRE(messages.size() == 2);
  CHECK(messages[0].find("Zero<3>: prefetch: got -1") != std::string::npos);

  // Replicas that do not divide the ranks are refused on every rank, before any split.
  for (int replicas : {0, 3, 8}) {
    CAPTURE(replicas);
    messages.clear();
    threads::run(4, [&](threads::Communicator& comm) {
      cpu be(1);
      try {
        Trainer<Gpt, AdamW, GradientAccumulation, Zero<2>> trainer(be, comm, Gpt(small_test_config()), AdamW(),
                                                                   ConstantLr{}, {}, {.replicas = replicas});
      } catch (const Error& e) {
        std::lock_guard lock(mutex);
        messages.push_back(e.what());
      }
    });
    REQUIRE(messages.size() == 4);
    CHECK(messages[0].find("Zero<2>: replicas: got " + std::to_string(replicas) +
                           "; must divide the data-parallel ranks (4)") != std::string::npos);
  }
}

TEST_CASE("gather_parameters and load_parameters round-trip under every stage") {
  std::vector<float> values(static_cast<std::size_t>(Gpt(small_test_config()).layout().total()));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 97) * 0.01f;
  const auto round_trip = [&]<class St>(St) {
    threads::run(3, [&](threads::Communicator& comm) {
      cpu be(1);
      Trainer<Gpt, AdamW, GradientAccumulation, St> trainer(be, comm, Gpt(small_test_config()), AdamW(),
                                                            ConstantLr{}, {});
      trainer.load_parameters(values);
      const std::vector<float> back = trainer.gather_parameters();
      if (comm.rank() == 0) CHECK(back == values);
    });
  };
  round_trip(Zero<1>{});
  round_trip(Zero<2>{});
  round_trip(Zero<3>{});
  round_trip(Zero<3>{.replicas = 3});
}

}  // namespace test_zero
