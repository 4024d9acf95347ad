#pragma once
// The parity check of DESIGN.md invariant 3, written over any backend: train 5 AdamW steps
// (warmup, then cosine) on the same global batches, and compare losses, gradient norms and final
// weights with one-rank training (fp32: 1e-5 relative by default). parity.hpp adds the CPU
// reference runs.

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/parameters.hpp"
#include "loom/optim/lr_schedule.hpp"
#include "loom/parallel/trainer.hpp"
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

//! Losses, gradient norms and weights of `run` within `tolerance` relative of `reference`.
inline void check_parity(const ParityRun& run, const ParityRun& reference, double tolerance = 1e-5) {
  REQUIRE(run.losses.size() == reference.losses.size());
  for (std::size_t s = 0; s < run.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(run.losses[s] - reference.losses[s]) <= tolerance * std::abs(reference.losses[s]));
    CHECK(std::abs(run.grad_norms[s] - reference.grad_norms[s]) <= tolerance * reference.grad_norms[s]);
  }
  CHECK(relative_difference(run.weights.data(), reference.weights.data(),
                            static_cast<std::int64_t>(run.weights.size())) <= tolerance);
}

//! What is wrong with one rank's `run` against `reference` (empty when nothing): losses and
//! gradient norms within `tolerance` (1e-5) relative, and this rank's tensor-parallel slice of the gathered
//! weights (trainer.model().layout() order) within `tolerance` of the matching one-rank elements,
//! found through ParameterSpec::global_index.
template <class Trainer>
std::string parity_failures(const Trainer& trainer, const ParityRun& run, const ParityRun& reference,
                            const ParameterLayout& global_layout, double tolerance = 1e-5) {
  std::string failure;
  if (run.losses.size() != reference.losses.size()) return " steps " + std::to_string(run.losses.size());
  for (std::size_t s = 0; s < run.losses.size(); ++s) {
    if (!(std::abs(run.losses[s] - reference.losses[s]) <= tolerance * std::abs(reference.losses[s])))
      failure += " loss[" + std::to_string(s) + "]=" + std::to_string(run.losses[s]) + " vs " +
                 std::to_string(reference.losses[s]);
    if (!(std::abs(run.grad_norms[s] - reference.grad_norms[s]) <= tolerance * reference.grad_norms[s]))
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
  if (!(relative <= tolerance)) failure += " weights " + std::to_string(relative);
  return failure;
}

}  // namespace loom::test
