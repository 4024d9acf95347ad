// DataParallel over MPI processes (label "mpi", 8 ranks under mpiexec): DP = 2, 4 and 8, each on
// the ranks [0, dp) of the world, with and without gradient accumulation and clipping, against
// one-rank training that every rank also runs locally (DESIGN.md invariant 3: fp32, 1e-5
// relative over 5 AdamW steps), and the replicas bit-identical across processes.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "loom/comm/mpi.hpp"
#include "loom/loom.hpp"
#include "support/training.hpp"

using namespace loom;
using namespace loom::test;

namespace {

mpi::Communicator* world_pointer = nullptr;
using Gpt = gpt2::Model<cpu, float>;
constexpr int steps = 5;
constexpr std::int64_t global_batch = 8, seq = 16;

struct Run {
  std::vector<double> losses;
  std::vector<float> weights;
};

template <class Trainer>
Run train_steps(Trainer& trainer) {
  Run run;
  for (int s = 0; s < steps; ++s)
    run.losses.push_back(trainer.step(make_batch(s, global_batch, seq, small_test_config().vocab_size)).loss);
  run.weights.assign(trainer.parameters(), trainer.parameters() + trainer.model().layout().total());
  return run;
}

WarmupCosineLr lr_schedule() { return {.lr = 1e-2, .warmup = 2, .total_steps = steps, .min_lr_factor = 0.1}; }

Run single_rank(double clip) {
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(small_test_config()), AdamW({.weight_decay = 0.1}), lr_schedule(),
                              {.micro_batch_size = global_batch, .clip_grad_norm = clip, .seed = 5});
  return train_steps(trainer);
}

}  // namespace

TEST_CASE("DDP over MPI processes trains the same model as one rank (DP = 2, 4, 8)") {
  mpi::Communicator& world = *world_pointer;
  for (double clip : {0.0, 0.05}) {
    const Run reference = single_rank(clip);
    for (int dp : {2, 4, 8}) {
      if (dp > world.size()) continue;
      mpi::Communicator group = world.split(world.rank() < dp ? 0 : 1, world.rank());
      if (world.rank() < dp) {
        for (std::int64_t micro_batch : {global_batch / dp, std::int64_t{1}}) {
          CAPTURE(clip);
          CAPTURE(dp);
          CAPTURE(micro_batch);
          cpu be(1);
          Trainer<Gpt, AdamW, GradientAccumulation, DataParallel> trainer(
              be, group, Gpt(small_test_config()), AdamW({.weight_decay = 0.1}), lr_schedule(),
              {.micro_batch_size = micro_batch, .clip_grad_norm = clip, .seed = 5},
              {.bucket_bytes = 4096});
          const Run run = train_steps(trainer);
          for (int s = 0; s < steps; ++s) {
            CAPTURE(s);
            CHECK(std::abs(run.losses[s] - reference.losses[s]) <= 1e-5 * std::abs(reference.losses[s]));
          }
          CHECK(relative_difference(run.weights.data(), reference.weights.data(),
                                    static_cast<std::int64_t>(run.weights.size())) <= 1e-5);
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
