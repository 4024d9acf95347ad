// DataParallel (DDP) on thread ranks: parity with one-rank training for DP = 1..4, with and
// without gradient accumulation and clipping, any bucket size and with overlap off; buckets;
// no communication before the last micro-batch; rejected configurations.
#include <doctest/doctest.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/gradcheck.hpp"
#include "support/parity.hpp"
#include "support/training.hpp"

namespace test_data_parallel {

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t global_batch = 12, seq = 16;
using Gpt = gpt2::Model<cpu, float>;

ParityRun data_parallel(int ranks, std::int64_t micro_batch, double clip, DataParallel ddp = {}) {
  return thread_ranks_run(ranks, global_batch, seq, micro_batch, clip, ddp);
}

}  // namespace

TEST_CASE("DDP with 1..4 thread ranks trains the same model as one rank") {
  for (double clip : {0.0, 0.05}) {
    const ParityRun reference = single_rank_run(global_batch, seq, clip);
    for (int ranks = 1; ranks <= 4; ++ranks) {
      // One micro-batch per rank, and gradient accumulation over several.
      for (std::int64_t micro_batch : {global_batch / ranks, std::int64_t{1}}) {
        CAPTURE(clip);
        CAPTURE(ranks);
        CAPTURE(micro_batch);
        check_parity(data_parallel(ranks, micro_batch, clip), reference);
      }
    }
  }
}

TEST_CASE("DDP results do not depend on bucket size or overlap") {
  const ParityRun reference = single_rank_run(global_batch, seq, 0.0);
  for (std::size_t bucket_bytes : {std::size_t{1}, std::size_t{4096}, std::size_t{25} << 20}) {
    for (bool overlap : {true, false}) {
      CAPTURE(bucket_bytes);
      CAPTURE(overlap);
      check_parity(data_parallel(2, 3, 0.0, {.bucket_bytes = bucket_bytes, .overlap = overlap}), reference);
    }
  }
}

TEST_CASE("gradient buckets cover the layout in reverse layer order, whole layers each") {
  const Gpt model(small_test_config());
  const ParameterLayout& layout = model.layout();
  for (std::size_t bucket_bytes : {std::size_t{1}, std::size_t{20000}, std::size_t{1} << 30}) {
    CAPTURE(bucket_bytes);
    const auto buckets = gradient_buckets(layout, sizeof(float), bucket_bytes);
    REQUIRE(!buckets.empty());
    CHECK(buckets.front().end == layout.total());
    CHECK(buckets.back().begin == 0);
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      CHECK(buckets[b].first_layer <= buckets[b].last_layer);
      if (b > 0) {
        CHECK(buckets[b].end == buckets[b - 1].begin);
        CHECK(buckets[b].last_layer == buckets[b - 1].first_layer - 1);
        // Only the last bucket may be smaller than bucket_bytes.
        CHECK(static_cast<std::size_t>(buckets[b - 1].end - buckets[b - 1].begin) * sizeof(float) >= bucket_bytes);
      }
    }
    if (bucket_bytes == 1) CHECK(buckets.size() == static_cast<std::size_t>(model.num_layers()));
    if (bucket_bytes == std::size_t{1} << 30) CHECK(buckets.size() == 1);
  }
  CHECK_THROWS_AS(gradient_buckets(layout, 4, 0), Error);
}

namespace {
//! Forwards to a thread communicator and counts the calls, to see when DDP communicates.
class CountingCommunicator : public CollectiveInterface<CountingCommunicator> {
 public:
  using loom_communicator = void;
  explicit CountingCommunicator(threads::Communicator& inner) : inner_(&inner) {}
  int rank() const { return inner_->rank(); }
  int size() const { return inner_->size(); }
  void run(const CollectiveCall& call) { record(call), inner_->run(call); }
  Request start(const CollectiveCall& call) { return record(call), inner_->start(call); }
  CountingCommunicator split(int, int) { throw Error("counting communicator: split", "", "not needed"); }

  std::vector<std::size_t> gradient_counts;  // element counts of the float all-reduces, in order
  int double_sums = 0;                       // loss sums and other scalars

 private:
  void record(const CollectiveCall& call) {
    if (call.dtype == DType::float32) gradient_counts.push_back(call.count);
    else ++double_sums;
  }
  threads::Communicator* inner_;
};
}  // namespace

TEST_CASE("DDP reduces each bucket once per step, only after the last micro-batch (no_sync)") {
  threads::run(2, [&](threads::Communicator& comm) {
    CountingCommunicator counting(comm);
    cpu be(1);
    Trainer<Gpt, AdamW, GradientAccumulation, DataParallel> trainer(
        be, counting, Gpt(small_test_config()), AdamW(), ConstantLr{.lr = 1e-3},
        {.micro_batch_size = 1}, {.bucket_bytes = 1});
    trainer.step(make_batch(0, 8, seq, small_test_config().vocab_size));  // 4 micro-batches per rank
    const auto& buckets = trainer.engine().buckets();
    if (comm.rank() != 0) return;
    std::vector<std::size_t> expected;
    for (const auto& b : buckets) expected.push_back(static_cast<std::size_t>(b.end - b.begin));
    CHECK(counting.gradient_counts == expected);  // one all-reduce per bucket, in bucket order
    CHECK(counting.double_sums == 1);              // the loss
  });
}

TEST_CASE("DDP rejects a global batch that the ranks and micro-batches do not divide") {
  std::mutex mutex;
  std::vector<std::string> messages;
  threads::run(3, [&](threads::Communicator& comm) {
    cpu be(1);
    Trainer<Gpt, AdamW, GradientAccumulation, DataParallel> trainer(
        be, comm, Gpt(small_test_config()), AdamW(), ConstantLr{.lr = 1e-3}, {.micro_batch_size = 2});
    try {
      trainer.step(make_batch(0, 8, seq, small_test_config().vocab_size));
    } catch (const Error& e) {
      std::lock_guard lock(mutex);
      messages.push_back(e.what());
    }
  });
  REQUIRE(messages.size() == 3);
  for (const auto& m : messages)
    CHECK(m.find("global batch size: got 8; must be a multiple of micro_batch_size (2) x data-parallel ranks (3)") !=
          std::string::npos);
}

TEST_CASE("SingleRank refuses a group of more than one rank") {
  std::atomic<int> errors{0};
  threads::run(2, [&](threads::Communicator& comm) {
    cpu be(1);
    try {
      Trainer<Gpt, AdamW> trainer(be, comm, Gpt(small_test_config()), AdamW(), ConstantLr{});
    } catch (const Error& e) {
      if (std::string(e.what()).find("use DataParallel") != std::string::npos) ++errors;
    }
  });
  CHECK(errors == 2);
}

}  // namespace test_data_parallel
