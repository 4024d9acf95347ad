// balance_stages: contiguous, non-empty stages covering every layer, with the smallest possible
// slowest stage (checked against brute force), GPT-2's costs, and the rejections.
#include <doctest/doctest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <vector>

#include "loom/loom.hpp"
#include "loom/parallel/stage_partition.hpp"

namespace test_stage_partition {

using namespace loom;

namespace {
double largest(const std::vector<double>& costs, const std::vector<StageLayers>& stages) {
  double worst = 0;
  for (const auto& s : stages) {
    double sum = 0;
    for (int l = s.first; l <= s.last; ++l) sum += costs[static_cast<std::size_t>(l)];
    worst = std::max(worst, sum);
  }
  return worst;
}

//! The best largest-stage cost over every way to cut `costs` into `stages` contiguous parts.
double brute_force(const std::vector<double>& costs, int stages) {
  const int layers = static_cast<int>(costs.size());
  double best = 1e300;
  std::vector<int> cuts;
  std::function<void(int, int)> place = [&](int from, int left) {
    if (left == 0) {
      std::vector<StageLayers> s;
      int begin = 0;
      for (int c : cuts) {
        s.push_back({begin, c - 1});
        begin = c;
      }
      s.push_back({begin, layers - 1});
      best = std::min(best, largest(costs, s));
      return;
    }
    for (int c = from; c <= layers - left; ++c) {
      cuts.push_back(c);
      place(c + 1, left - 1);
      cuts.pop_back();
    }
  };
  place(1, stages - 1);
  return best;
}
}  // namespace

TEST_CASE("stages are contiguous, non-empty, cover every layer, and are optimally balanced") {
  const CounterRng rng(7, "test.costs");
  for (int layers = 1; layers <= 9; ++layers)
    for (int stages = 1; stages <= layers; ++stages)
      for (int trial = 0; trial < 5; ++trial) {
        std::vector<double> costs;
        for (int l = 0; l < layers; ++l) costs.push_back(1.0 + 9.0 * rng.uniform(static_cast<std::uint64_t>(trial * 100 + l)));
        CAPTURE(layers);
        CAPTURE(stages);
        const auto parts = balance_stages(costs, stages);
        REQUIRE(static_cast<int>(parts.size()) == stages);
        CHECK(parts.front().first == 0);
        CHECK(parts.back().last == layers - 1);
        for (std::size_t s = 0; s < parts.size(); ++s) {
          CHECK(parts[s].count() >= 1);
          if (s > 0) CHECK(parts[s].first == parts[s - 1].last + 1);
        }
        CHECK(largest(costs, parts) == doctest::Approx(brute_force(costs, stages)));
      }
}

TEST_CASE("GPT-2 small over 4 stages: the embedding and head share stages with blocks") {
  const gpt2::Model<cpu, float> model(gpt2::small());
  std::vector<double> costs;
  for (int l = 0; l < model.num_layers(); ++l) costs.push_back(model.layer_cost(l));
  const auto parts = balance_stages(costs, 4);
  MESSAGE(parts[0] << ", " << parts[1] << ", " << parts[2] << ", " << parts[3]);
  // 14 layers: the head (logits over 50304 words, 2·V·C) costs about 4.5 blocks (24·C² + 4·s·C),
  // so it gets a stage of its own: layers 0..4, 5..8, 9..12, 13.
  CHECK(parts.back() == StageLayers{13, 13});
  CHECK(parts.back().count() < parts.front().count());
  const double total = std::accumulate(costs.begin(), costs.end(), 0.0);
  CHECK(largest(costs, parts) < 0.3 * total);
}

TEST_CASE("fewer layers than stages, a negative cost, or no stage are rejected naming the value") {
  const std::vector<double> three{1, 1, 1};
  CHECK_THROWS_WITH_AS(balance_stages(three, 4),
                       doctest::Contains("pipeline stages: got 4; the model has 3 layers; every stage needs at least one"),
                       Error);
  CHECK_THROWS_WITH_AS(balance_stages(three, 0), doctest::Contains("pipeline stages: got 0; must be >= 1"), Error);
  const std::vector<double> negative{1, -1};
  CHECK_THROWS_WITH_AS(balance_stages(negative, 1), doctest::Contains("layer cost of layer 1: got -1"), Error);
}

}  // namespace test_stage_partition
