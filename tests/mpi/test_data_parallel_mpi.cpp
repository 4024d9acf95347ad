// DataParallel and Zero<1>, Zero<2>, Zero<3> over MPI processes (label "mpi", 8 ranks under
// mpiexec): DP = 2, 4 and 8, each on the ranks [0, dp) of the world, with and without gradient
// accumulation and clipping, against one-rank training that every rank also runs locally
// (DESIGN.md invariant 3: fp32, 1e-5 relative over 5 AdamW steps), and the replicas
// bit-identical across processes; hybrid sharding (Zero's replicas) on DP = 4.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "loom/comm/mpi.hpp"
#include "loom/loom.hpp"
#include "support/parity.hpp"
#include "support/training.hpp"

using namespace loom;
using namespace loom::test;

namespace {

mpi::Communicator* world_pointer = nullptr;
using Gpt = gpt2::Model<cpu, float>;
constexpr std::int64_t global_batch = 8, seq = 16;

//! Trains with strategy `St` on the ranks [0, dp) of the world for dp in `sizes`.
template <class St>
void check_parity(const std::vector<int>& sizes, St strategy) {
  mpi::Communicator& world = *world_pointer;
  for (double clip : {0.0, 0.05}) {
    const ParityRun reference = single_rank_run(global_batch, seq, clip);
    for (int dp : sizes) {
      if (dp > world.size()) continue;
      mpi::Communicator group = world.split(world.rank() < dp ? 0 : 1, world.rank());
      if (world.rank() < dp) {
        for (std::int64_t micro_batch : {global_batch / dp, std::int64_t{1}}) {
          CAPTURE(clip);
          CAPTURE(dp);
          CAPTURE(micro_batch);
          cpu be(1);
          Trainer<Gpt, AdamW, GradientAccumulation, St> trainer(
              be, group, Gpt(small_test_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
              {.micro_batch_size = micro_batch, .clip_grad_norm = clip, .seed = 5}, strategy);
          const ParityRun run = train_steps(trainer, global_batch, seq);
          check_parity(run, reference);
          // Every process ends with rank 0's bytes.
          std::vector<float> first = run.weights;
          group.broadcast(std::span<float>(first), 0);
          CHECK(first == run.weights);
        }
      }
      world.barrier();
    }
  }
}

}  // namespace

TEST_CASE("DDP over MPI processes trains the same model as one rank (DP = 2, 4, 8)") {
  check_parity<DataParallel>({2, 4, 8}, {.bucket_bytes = 4096});
}

TEST_CASE("Zero<1>, Zero<2>, Zero<3> over MPI processes train the same model as one rank (DP = 2, 4)") {
  check_parity<Zero<1>>({2, 4}, {.bucket_bytes = 4096});
  check_parity<Zero<2>>({2, 4}, {.bucket_bytes = 4096});
  check_parity<Zero<3>>({2, 4}, {});
}

TEST_CASE("hybrid sharding over MPI processes: 4 ranks as 2 replicas of 2 shards train as one rank") {
  check_parity<Zero<2>>({4}, {.bucket_bytes = 4096, .replicas = 2});
  check_parity<Zero<3>>({4}, {.replicas = 2});
}

int main(int argc, char** argv) {
  mpi::Environment environment(argc, argv);
  int result = 1;
  {
    mpi::Communicator world = mpi::Communicator::world({.timeout = std::chrono::seconds(120)});
    world_pointer = &world;
    doctest::Context context(argc, argv);
    if (world.rank() != 0) {
      context.setOption("minimal", true);
      context.setOption("no-colors", true);
    }
    result = context.run();
    if (context.shouldExit()) return result;
    double worst = result;
    world.all_reduce(std::span<double>(&worst, 1), ReduceOp::max);
    result = static_cast<int>(worst);
    world_pointer = nullptr;
  }
  return result;
}
