#pragma once
//! \file balance_stages: the pipeline's stages as contiguous layer ranges, balanced by each
//! layer's cost (Model::layer_cost) so that the slowest stage — which sets the pipeline's pace —
//! is as fast as it can be.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "loom/core/error.hpp"

namespace loom {

//! Layers [first, last] of one pipeline stage.
struct StageLayers {
  int first = 0, last = 0;
  int count() const noexcept { return last - first + 1; }
  friend bool operator==(const StageLayers&, const StageLayers&) = default;
  friend std::ostream& operator<<(std::ostream& out, const StageLayers& s) {
    return out << "layers " << s.first << ".." << s.last;
  }
};

//! Splits layers 0..costs.size()−1 into `stages` contiguous, non-empty ranges that minimise the
//! largest sum of costs in a stage (exact: dynamic programming over split points, O(L²·p); ties
//! go to the earliest split, so earlier stages take fewer layers — they hold more micro-batches
//! of activations under 1F1B). Rejects fewer layers than stages, a negative cost, stages < 1.
inline std::vector<StageLayers> balance_stages(std::span<const double> costs, int stages) {
  const int layers = static_cast<int>(costs.size());
  LOOM_CHECK(stages >= 1, "pipeline stages", stages, "must be >= 1");
  LOOM_CHECK(layers >= stages, "pipeline stages", stages,
             "the model has " + std::to_string(layers) + " layers; every stage needs at least one (use pp <= " +
                 std::to_string(layers) + ")");
  for (int l = 0; l < layers; ++l)
    LOOM_CHECK(costs[static_cast<std::size_t>(l)] >= 0, "layer cost of layer " + std::to_string(l),
               costs[static_cast<std::size_t>(l)], "must be >= 0");
  std::vector<double> prefix(static_cast<std::size_t>(layers) + 1, 0.0);
  for (int l = 0; l < layers; ++l) prefix[l + 1] = prefix[l] + costs[static_cast<std::size_t>(l)];
  const auto cost = [&](int first, int end) { return prefix[end] - prefix[first]; };

  // best[s][e]: the smallest possible largest stage cost for layers [0, e) in s stages;
  // split[s][e]: where the last of those stages starts.
  constexpr double none = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<std::size_t>(stages) + 1,
                                        std::vector<double>(static_cast<std::size_t>(layers) + 1, none));
  std::vector<std::vector<int>> split(best.size(), std::vector<int>(static_cast<std::size_t>(layers) + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= stages; ++s)
    for (int e = s; e <= layers; ++e)
      for (int b = s - 1; b < e; ++b) {
        const double candidate = std::max(best[s - 1][b], cost(b, e));
        if (candidate < best[s][e]) {
          best[s][e] = candidate;
          split[s][e] = b;
        }
      }
  std::vector<StageLayers> out(static_cast<std::size_t>(stages));
  for (int s = stages, e = layers; s >= 1; --s) {
    const int b = split[s][e];
    out[static_cast<std::size_t>(s - 1)] = {b, e - 1};
    e = b;
  }
  return out;
}

}  // namespace loom
