// DP × TP meshes (product <= 8) on thread ranks, for DDP and ZeRO-1/2/3: the same losses,
// gradient norms (clipping included) and weights as one-rank training (DESIGN.md invariant 3),
// each rank's weights being its tensor-parallel slice of the one-rank weights.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/parity.hpp"
#include "support/training.hpp"

namespace test_mesh_parity {

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t global_batch = 8, seq = 16;
using Gpt = gpt2::Model<cpu, float>;

//! small_test_config with heads and vocabulary that 4 tensor-parallel ranks divide.
gpt2::Config mesh_config() {
  gpt2::Config c = small_test_config();
  c.num_heads = 4;
  return c;
}

//! One rank's run on a mesh, and its local weights mapped back to the global layout.
template <class St>
std::vector<std::string> check_mesh(MeshShape shape, double clip, St strategy, const ParityRun& reference,
                                    const ParameterLayout& global_layout) {
  std::mutex mutex;
  std::vector<std::string> failures;
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<Gpt, AdamW, GradientAccumulation, St> trainer(
        be, mesh, Gpt(mesh_config(), mesh.tensor_parallel()), AdamW({.weight_decay = 0.1}), parity_lr(),
        {.micro_batch_size = 1, .clip_grad_norm = clip, .seed = 5}, strategy);
    const ParityRun run = train_steps(trainer, global_batch, seq);
    // This rank's slice against the matching elements of the one-rank weights.
    const std::string failure = parity_failures(trainer, run, reference, global_layout);
    if (!failure.empty()) {
      std::lock_guard lock(mutex);
      failures.push_back("rank " + std::to_string(world.rank()) + ":" + failure);
    }
  });
  return failures;
}

template <class St>
void check_all_meshes(St strategy = {}) {
  const Gpt global_model(mesh_config());
  for (double clip : {0.0, 0.05}) {
    ParityRun reference;
    {
      cpu be(1);
      Trainer<Gpt, AdamW> trainer(be, Gpt(mesh_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
                                  {.micro_batch_size = global_batch, .clip_grad_norm = clip, .seed = 5});
      reference = train_steps(trainer, global_batch, seq);
    }
    for (int dp : {1, 2, 4})
      for (int tp : {1, 2, 4}) {
        if (dp * tp > 8 || dp * tp == 1) continue;
        const MeshShape shape{.dp = dp, .tp = tp, .pp = 1};
        CAPTURE(shape);
        CAPTURE(clip);
        CHECK(check_mesh(shape, clip, strategy, reference, global_model.layout()) == std::vector<std::string>{});
      }
  }
}

}  // namespace

TEST_CASE("DDP on every DP x TP mesh up to 8 ranks trains the same model as one rank") {
  check_all_meshes<DataParallel>({.bucket_bytes = 4096});
}

TEST_CASE("Zero<1> on every DP x TP mesh up to 8 ranks trains the same model as one rank") {
  check_all_meshes<Zero<1>>({.bucket_bytes = 4096});
}

TEST_CASE("Zero<2> on every DP x TP mesh up to 8 ranks trains the same model as one rank") {
  check_all_meshes<Zero<2>>({.bucket_bytes = 4096});
}

TEST_CASE("Zero<3> on every DP x TP mesh up to 8 ranks trains the same model as one rank") {
  check_all_meshes<Zero<3>>();
}

TEST_CASE("a Trainer on a mesh rejects pipeline stages without a pipeline schedule, and a model split over another group") {
  std::mutex mutex;
  std::vector<std::string> messages;
  threads::run(2, [&](threads::Communicator& world) {
    const auto record = [&](const Error& e) {
      std::lock_guard lock(mutex);
      messages.push_back(e.what());
    };
    cpu be(1);
    {
      Mesh<threads::Communicator> mesh(world, {.dp = 1, .tp = 1, .pp = 2});
      try {
        Trainer<Gpt, AdamW, GradientAccumulation, DataParallel> t(be, mesh, Gpt(mesh_config()), AdamW(), ConstantLr{});
      } catch (const Error& e) {
        record(e);
      }
    }
    {
      Mesh<threads::Communicator> mesh(world, {.dp = 1, .tp = 2, .pp = 1});
      try {  // the model is not split although the mesh has tp = 2
        Trainer<Gpt, AdamW, GradientAccumulation, DataParallel> t(be, mesh, Gpt(mesh_config()), AdamW(), ConstantLr{});
      } catch (const Error& e) {
        record(e);
      }
    }
  });
  REQUIRE(messages.size() == 4);
  int pipeline = 0, tensor = 0;
  for (const auto& m : messages) {
    pipeline += m.find("GradientAccumulation: pipeline stages: got 2; this schedule runs one stage") != std::string::npos;
    tensor += m.find("the model's tensor-parallel ranks: got 1; must equal the mesh's tp (2)") != std::string::npos;
  }
  CHECK(pipeline == 2);
  CHECK(tensor == 2);
}

}  // namespace test_mesh_parity
