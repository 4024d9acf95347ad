#pragma once
// The parity check of DESIGN.md invariant 3, shared by the strategy tests: train 5 AdamW steps
// (warmup, then cosine) on the same global batches, and compare losses, gradient norms and final
// weights with one-rank training (fp32: 1e-5 relative).

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/training.hpp"

namespace loom::test {

//! What a run produced, for comparison with another.
struct ParityRun {
  std::vector<double> losses, grad_norms;
  std::vector<float> weights;
};

inline constexpr int parity_steps = 5;

inline WarmupCosineLr parity_lr() {
  return {.lr = 1e-2, .warmup = 2, .total_steps = parity_steps, .min_lr_factor = 0.1};
}

//! Trains `trainer` for parity_steps steps on global batches of [global_batch, seq].
template <class Trainer>
ParityRun train_steps(Trainer& trainer, std::int64_t global_batch, std::int64_t seq) {
  ParityRun run;
  for (int s = 0; s < parity_steps; ++s) {
    const StepMetrics m = trainer.step(make_batch(s, global_batch, seq, small_test_config().vocab_size));
    run.losses.push_back(m.loss);
    run.grad_norms.push_back(m.grad_norm);
  }
  run.weights = trainer.gather_parameters();
  return run;
}

//! The one-rank reference: the whole global batch in one micro-batch.
inline ParityRun single_rank_run(std::int64_t global_batch, std::int64_t seq, double clip) {
  using Gpt = gpt2::Model<cpu, float>;
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(small_test_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
                              {.micro_batch_size = global_batch, .clip_grad_norm = clip, .seed = 5});
  return train_steps(trainer, global_batch, seq);
}

//! Trains with strategy `St` on `ranks` thread ranks; returns rank 0's run and checks that every
//! rank ended with the same losses and bit-identical weights.
template <class St>
ParityRun thread_ranks_run(int ranks, std::int64_t global_batch, std::int64_t seq, std::int64_t micro_batch,
                           double clip, St strategy = {}) {
  using Gpt = gpt2::Model<cpu, float>;
  std::vector<ParityRun> runs(static_cast<std::size_t>(ranks));
  threads::run(ranks, [&](threads::Communicator& comm) {
    cpu be(1);
    Trainer<Gpt, AdamW, GradientAccumulation, St> trainer(
        be, comm, Gpt(small_test_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
        {.micro_batch_size = micro_batch, .clip_grad_norm = clip, .seed = 5}, strategy);
    runs[static_cast<std::size_t>(comm.rank())] = train_steps(trainer, global_batch, seq);
  });
  for (int r = 1; r < ranks; ++r) {
    CAPTURE(r);
    CHECK(runs[r].losses == runs[0].losses);
    CHECK(runs[r].weights == runs[0].weights);  // replicas (or gathered shards) bit-identical
  }
  return runs[0];
}

//! Losses, gradient norms and weights of `run` within 1e-5 relative of `reference`.
inline void check_parity(const ParityRun& run, const ParityRun& reference) {
  REQUIRE(run.losses.size() == reference.losses.size());
  for (std::size_t s = 0; s < run.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(run.losses[s] - reference.losses[s]) <= 1e-5 * std::abs(reference.losses[s]));
    CHECK(std::abs(run.grad_norms[s] - reference.grad_norms[s]) <= 1e-5 * reference.grad_norms[s]);
  }
  CHECK(relative_difference(run.weights.data(), reference.weights.data(),
                            static_cast<std::int64_t>(run.weights.size())) <= 1e-5);
}

//! What is wrong with one rank's `run` against `reference` (empty when nothing): losses and
//! gradient norms within 1e-5 relative, and this rank's tensor-parallel slice of the gathered
//! weights (trainer.model().layout() order) within 1e-5 of the matching one-rank elements,
//! found through ParameterSpec::global_index.
template <class Trainer>
std::string parity_failures(const Trainer& trainer, const ParityRun& run, const ParityRun& reference,
                            const ParameterLayout& global_layout) {
  std::string failure;
  if (run.losses.size() != reference.losses.size()) return " steps " + std::to_string(run.losses.size());
  for (std::size_t s = 0; s < run.losses.size(); ++s) {
    if (!(std::abs(run.losses[s] - reference.losses[s]) <= 1e-5 * std::abs(reference.losses[s])))
      failure += " loss[" + std::to_string(s) + "]=" + std::to_string(run.losses[s]) + " vs " +
                 std::to_string(reference.losses[s]);
    if (!(std::abs(run.grad_norms[s] - reference.grad_norms[s]) <= 1e-5 * reference.grad_norms[s]))
      failure += " grad_norm[" + std::to_string(s) + "]=" + std::to_string(run.grad_norms[s]) + " vs " +
                 std::to_string(reference.grad_norms[s]);
  }
  const ParameterLayout& local = trainer.model().layout();
  if (static_cast<std::int64_t>(run.weights.size()) != local.total())
    return failure + " gathered " + std::to_string(run.weights.size()) + " weights, layout has " +
           std::to_string(local.total());
  double diff = 0, norm = 0;
  for (const auto& e : local.entries()) {
    const auto& g = global_layout.find(e.spec.name);
    for (std::int64_t i = 0; i < e.numel(); ++i) {
      const double want = reference.weights[static_cast<std::size_t>(g.offset + e.spec.global_index(i))];
      const double got = run.weights[static_cast<std::size_t>(e.offset + i)];
      diff += (got - want) * (got - want);
      norm += want * want;
    }
  }
  const double relative = std::sqrt(diff / norm);
  if (!(relative <= 1e-5)) failure += " weights " + std::to_string(relative);
  return failure;
}

}  // namespace loom::test
