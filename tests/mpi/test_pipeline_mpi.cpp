// Pipeline parallelism over MPI processes (label "mpi", 8 ranks under mpiexec): OneFOneB and
// Interleaved1F1B (2 virtual stages), under DDP and ZeRO-1 (and 1F1B under ZeRO-3, Interleaved1F1B under
// ZeRO-2), on the meshes {dp 2, pp 4},
// {tp 2, pp 4}, {dp 2, tp 2, pp 2} and {pp 8} of the whole world, with and without clipping,
// against one-rank training that every process also runs locally (DESIGN.md invariant 3: fp32,
// 1e-5 relative over 5 AdamW steps; each rank's weights against the matching one-rank
// elements), every process reporting the same losses and data-parallel replicas ending
// bit-identical. The model and the checks are support/pipeline_parity.hpp's, which the
// thread-rank tests run on every mesh. And a training state saved by the processes on one mesh
// resumes on another (io/training_state.hpp: one process writes, every process reads).

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "loom/comm/mpi.hpp"
#include "loom/io/training_state.hpp"
#include "loom/loom.hpp"
#include "support/parity.hpp"
#include "support/pipeline_parity.hpp"

using namespace loom;
using namespace loom::test;

namespace {

mpi::Communicator* world_pointer = nullptr;
using Gpt = gpt2::Model<cpu, float>;

//! The meshes this file trains on: each uses all 8 ranks (the world must have 8).
const std::vector<MeshShape> mpi_meshes = {
    {.dp = 2, .tp = 1, .pp = 4}, {.dp = 1, .tp = 2, .pp = 4}, {.dp = 2, .tp = 2, .pp = 2}, {.dp = 1, .tp = 1, .pp = 8}};

//! Trains schedule `S` with strategy `St` on every mesh of mpi_meshes, clip 0 and 0.05.
template <class S, class St>
void check_meshes(S schedule, St strategy) {
  mpi::Communicator& world = *world_pointer;
  REQUIRE(world.size() == 8);
  const Gpt global_model(pipeline_config());
  for (double clip : {0.0, 0.05}) {
    const ParityRun& reference = pipeline_reference(clip);  // every process trains its own
    for (const MeshShape& shape : mpi_meshes) {
      CAPTURE(shape);
      CAPTURE(clip);
      Mesh<mpi::Communicator> mesh(world, shape);
      cpu be(1);
      Trainer<Gpt, AdamW, S, St> trainer(be, mesh, Gpt(pipeline_config(), mesh.tensor_parallel()),
                                         AdamW({.weight_decay = 0.1}), parity_lr(), pipeline_options(clip), strategy,
                                         schedule);
      // gather_parameters (in train_steps) is collective over the pipeline: every rank calls it.
      const ParityRun run = train_steps(trainer, pipeline_global_batch, pipeline_seq);
      const std::string failure = parity_failures(trainer, run, reference, global_model.layout());
      CHECK_MESSAGE(failure.empty(), "rank " << world.rank() << ":" << failure);
      // Every process ends with rank 0's losses, bit for bit.
      std::vector<double> first = run.losses;
      world.broadcast(std::span<double>(first), 0);
      CHECK(first == run.losses);
      // Data-parallel replicas end bit-identical (each gathers its whole tensor-parallel slice).
      std::vector<float> replica = run.weights;
      mesh.data_parallel().broadcast(std::span<float>(replica), 0);
      CHECK(replica == run.weights);
      world.barrier();
    }
  }
}

}  // namespace

TEST_CASE("OneFOneB with DDP over MPI processes trains the same model as one rank") {
  check_meshes(OneFOneB{}, DataParallel{.bucket_bytes = 4096});
}

TEST_CASE("OneFOneB with Zero<1> over MPI processes trains the same model as one rank") {
  check_meshes(OneFOneB{}, Zero<1>{.bucket_bytes = 4096});
}

TEST_CASE("Interleaved1F1B (v = 2) with DDP over MPI processes trains the same model as one rank") {
  check_meshes(Interleaved1F1B{.virtual_stages = 2}, DataParallel{.bucket_bytes = 4096});
}

TEST_CASE("Interleaved1F1B (v = 2) with Zero<1> over MPI processes trains the same model as one rank") {
  check_meshes(Interleaved1F1B{.virtual_stages = 2}, Zero<1>{.bucket_bytes = 4096});
}

TEST_CASE("OneFOneB with Zero<3> over MPI processes trains the same model as one rank") {
  check_meshes(OneFOneB{}, Zero<3>{});
}

TEST_CASE("Interleaved1F1B (v = 2) with Zero<2> over MPI processes trains the same model as one rank") {
  check_meshes(Interleaved1F1B{.virtual_stages = 2}, Zero<2>{.bucket_bytes = 4096});
}

TEST_CASE("a training state saved over MPI processes on one mesh resumes on another and trains the same model") {
  mpi::Communicator& world = *world_pointer;
  REQUIRE(world.size() == 8);
  const Gpt global_model(pipeline_config());
  const ParityRun& reference = pipeline_reference(0.05);
  // One path for every process: rank 0's process id names it.
  double id = world.rank() == 0 ? static_cast<double>(::getpid()) : 0.0;
  world.broadcast(std::span<double>(&id, 1), 0);
  const std::filesystem::path path = std::filesystem::temp_directory_path() /
                                     ("loom_mpi_state_" + std::to_string(static_cast<long long>(id)) + ".bin");
  constexpr int saved_at = 2;
  ParityRun run;
  auto train = [&](auto& trainer, int first, int last) {
    for (int s = first; s < last; ++s) {
      const StepMetrics m =
          trainer.step(make_batch(s, pipeline_global_batch, pipeline_seq, pipeline_config().vocab_size));
      run.losses.push_back(m.loss);
      run.grad_norms.push_back(m.grad_norm);
    }
  };
  {
    Mesh<mpi::Communicator> mesh(world, {.dp = 2, .tp = 2, .pp = 2});
    cpu be(1);
    Trainer<Gpt, AdamW, OneFOneB, Zero<1>> trainer(be, mesh, Gpt(pipeline_config(), mesh.tensor_parallel()),
                                                   AdamW({.weight_decay = 0.1}), parity_lr(), pipeline_options(0.05),
                                                   Zero<1>{.bucket_bytes = 4096}, OneFOneB{});
    train(trainer, 0, saved_at);
    io::save_training_state(trainer, path);
  }
  {
    Mesh<mpi::Communicator> mesh(world, {.dp = 2, .tp = 1, .pp = 4});
    cpu be(1);
    Trainer<Gpt, AdamW, OneFOneB, DataParallel> trainer(be, mesh, Gpt(pipeline_config(), mesh.tensor_parallel()),
                                                        AdamW({.weight_decay = 0.1}), parity_lr(),
                                                        pipeline_options(0.05), DataParallel{.bucket_bytes = 4096},
                                                        OneFOneB{});
    CHECK(io::load_training_state(trainer, path).steps == saved_at);
    train(trainer, saved_at, parity_steps);
    run.weights = trainer.gather_parameters();
    const std::string failure = parity_failures(trainer, run, reference, global_model.layout());
    CHECK_MESSAGE(failure.empty(), "rank " << world.rank() << ":" << failure);
  }
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove(path);
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
