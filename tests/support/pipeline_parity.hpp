#pragma once
// The pipeline rows of the parity matrix (DESIGN.md invariant 3), shared by the four
// test_pipeline_parity_* executables (one schedule each, so that two cores build and run them
// side by side) and by tests/mpi/test_pipeline_mpi.cpp: on every DP x TP x PP mesh with pp >= 2
// and at most 8 ranks, 5 AdamW steps match one-rank training on the same global batches within
// 1e-5 relative (losses, gradient norms, and each rank's weights against the matching elements
// of the one-rank weights); every rank reports the same losses, data-parallel replicas end
// bit-identical, and so do the copies of the tied wte on the first and last stages.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/parity.hpp"
#include "support/training.hpp"

namespace loom::test {

//! Global batch [16, 16] in micro-batches of one sequence: m = 16 / dp micro-batches per
//! pipeline, a multiple of pp on every mesh below (Interleaved1F1B needs that).
inline constexpr std::int64_t pipeline_global_batch = 16, pipeline_seq = 16;

//! GPT-2 with 14 blocks, i.e. 16 model layers: enough for pp = 8 with 2 virtual stages (one
//! layer each). Heads and padded vocabulary divide by 4 tensor-parallel ranks. The vocabulary
//! is small_test_config's, which train_steps draws batches from.
inline gpt2::Config pipeline_config() {
  gpt2::Config c = small_test_config();
  c.num_layers = 14;
  c.num_heads = 4;
  return c;
}

//! Every mesh with pp in {2, 4, 8}, dp and tp in {1, 2, 4}, and dp x tp x pp <= 8.
inline std::vector<MeshShape> pipeline_meshes() {
  std::vector<MeshShape> out;
  for (int pp : {2, 4, 8})
    for (int dp : {1, 2, 4})
      for (int tp : {1, 2, 4})
        if (dp * tp * pp <= 8) out.push_back({.dp = dp, .tp = tp, .pp = pp});
  return out;
}

//! The settings every run of the matrix shares (the reference's micro-batch is the whole batch).
inline TrainerOptions pipeline_options(double clip, std::int64_t micro_batch = 1) {
  return {.micro_batch_size = micro_batch, .clip_grad_norm = clip, .seed = 5};
}

//! One-rank training on the whole global batch in one micro-batch.
inline ParityRun pipeline_single_rank_run(double clip) {
  using Gpt = gpt2::Model<cpu, float>;
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(pipeline_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
                              pipeline_options(clip, pipeline_global_batch));
  return train_steps(trainer, pipeline_global_batch, pipeline_seq);
}

//! pipeline_single_rank_run, computed once per clip value and process. Safe to call from rank
//! threads at once: the first caller computes it while the others wait.
inline const ParityRun& pipeline_reference(double clip) {
  static std::mutex mutex;
  static std::map<double, ParityRun> cache;  // std::map: a reference stays valid as it grows
  std::lock_guard lock(mutex);
  auto it = cache.find(clip);
  if (it == cache.end()) it = cache.emplace(clip, pipeline_single_rank_run(clip)).first;
  return it->second;
}

//! Trains schedule `S` with strategy `St` on `shape` (thread ranks) and checks parity with the
//! one-rank run, and that every rank saw the same losses.
template <class S, class St>
void check_pipeline_mesh(MeshShape shape, double clip, S schedule, St strategy) {
  using Gpt = gpt2::Model<cpu, float>;
  const Gpt global_model(pipeline_config());
  const ParityRun& reference = pipeline_reference(clip);
  std::mutex mutex;
  std::vector<std::string> failures;
  const auto ranks = static_cast<std::size_t>(shape.size());
  std::vector<std::vector<double>> losses(ranks);
  std::vector<std::vector<float>> weights(ranks), tied(ranks);
  bool reads_tied = false;  // whether the strategy shows the stage's parameters (not ZeRO-1's)
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<Gpt, AdamW, S, St> trainer(be, mesh, Gpt(pipeline_config(), mesh.tensor_parallel()),
                                       AdamW({.weight_decay = 0.1}), parity_lr(), pipeline_options(clip), strategy,
                                       schedule);
    // gather_parameters (in train_steps) is collective over the pipeline: every rank calls it.
    const ParityRun run = train_steps(trainer, pipeline_global_batch, pipeline_seq);
    const std::string failure = parity_failures(trainer, run, reference, global_model.layout());
    std::lock_guard lock(mutex);
    const auto r = static_cast<std::size_t>(world.rank());
    losses[r] = run.losses;
    weights[r] = run.weights;
    // The tied wte as this stage holds it (DDP keeps the stage's parameters whole in place).
    if constexpr (requires { trainer.parameters(); }) {
      reads_tied = true;
      for (const TiedParameter& t : trainer.stage().tied())
        tied[r].insert(tied[r].end(), trainer.parameters() + t.offset, trainer.parameters() + t.offset + t.numel);
    }
    if (!failure.empty()) failures.push_back("rank " + std::to_string(world.rank()) + ":" + failure);
  });
  CAPTURE(shape);
  CAPTURE(clip);
  std::string report;
  for (const std::string& f : failures) report += "\n  " + f;
  CHECK_MESSAGE(failures.empty(), report);
  for (std::size_t r = 0; r < ranks; ++r) {
    CAPTURE(r);
    const MeshCoordinates c = mesh_coordinates(shape, static_cast<int>(r));
    CHECK(losses[r] == losses[0]);  // bit-identical: the same sums, broadcast by the collectives
    // Data-parallel replicas end bit-identical, so every rank of one tensor-parallel slice
    // gathers the same weights; a tied copy stays bit-identical to its owner's (stage 0).
    CHECK(weights[r] == weights[static_cast<std::size_t>(mesh_rank(shape, {.dp = 0, .tp = c.tp, .pp = 0}))]);
    if (c.pp == shape.pp - 1 && reads_tied) {
      CHECK_FALSE(tied[r].empty());
      CHECK(tied[r] == tied[static_cast<std::size_t>(mesh_rank(shape, {.dp = c.dp, .tp = c.tp, .pp = 0}))]);
    }
  }
}

//! check_pipeline_mesh on every mesh of pipeline_meshes(), without clipping and with a clip
//! norm (0.05) that every step exceeds.
template <class S, class St>
void check_pipeline_meshes(S schedule, St strategy) {
  for (double clip : {0.0, 0.05})
    for (const MeshShape& shape : pipeline_meshes()) check_pipeline_mesh(shape, clip, schedule, strategy);
}

}  // namespace loom::test
