#pragma once
// Test support for comparing training runs of any element type: each step's loss and the final
// weights widened to float, the comparison within a tolerance, and the check that every rank of
// a data-parallel run ended the same.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "support/parity_check.hpp"
#include "support/training.hpp"

namespace loom::test {

//! Losses per step and the final weights (widened to float) of one rank.
struct WeightRun {
  std::vector<double> losses;
  std::vector<float> weights;
};

//! Trains `trainer` for `steps` steps on make_batch's [global_batch, seq] batches.
template <class Tr>
WeightRun train_run(Tr& trainer, std::int64_t global_batch, std::int64_t seq, int steps = parity_steps) {
  WeightRun run;
  for (int s = 0; s < steps; ++s)
    run.losses.push_back(trainer.step(make_batch(s, global_batch, seq, small_test_config().vocab_size)).loss);
  for (const auto w : trainer.gather_parameters()) run.weights.push_back(static_cast<float>(w));
  return run;
}

//! Each step's loss within `tolerance` relative of the reference's, and the weights within
//! `tolerance` in relative L2 norm (printed, for the figures the tests' comments quote).
inline void check_close(const WeightRun& run, const WeightRun& reference, double tolerance) {
  REQUIRE(run.losses.size() == reference.losses.size());
  for (std::size_t s = 0; s < run.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(run.losses[s] - reference.losses[s]) <= tolerance * std::abs(reference.losses[s]));
  }
  REQUIRE(run.weights.size() == reference.weights.size());
  const double difference = relative_difference(run.weights.data(), reference.weights.data(),
                                                static_cast<std::int64_t>(run.weights.size()));
  MESSAGE("weights: relative L2 difference ", difference);
  CHECK(difference <= tolerance);
}

//! Every rank's run equals rank 0's; returns rank 0's.
inline WeightRun same_on_every_rank(const std::vector<WeightRun>& runs) {
  for (std::size_t r = 1; r < runs.size(); ++r) {
    CAPTURE(r);
    CHECK(runs[r].losses == runs[0].losses);
    CHECK(runs[r].weights == runs[0].weights);
  }
  return runs[0];
}

}  // namespace loom::test
