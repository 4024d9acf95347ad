#pragma once
//! \file A synthetic, learnable token task with a known entropy floor: a Markov chain that
//! follows a fixed permutation of the vocabulary and jumps to a uniform token with probability
//! q. Training on it must bring the loss down to `entropy_floor()`, which makes it a test of
//! the whole training loop without a data set.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <ostream>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/rng.hpp"
#include "loom/io/batch.hpp"

namespace loom::io {

//! Parameters of SyntheticMarkov: a value with designated initializers, `==` and `<<`.
struct SyntheticMarkovConfig {
  std::int64_t vocab_size = 256;   //!< V, >= 2
  double jump_probability = 0.1;   //!< q in [0, 1]: chance that a token ignores the chain
  std::uint64_t seed = 1234;       //!< keys the permutation and every draw

  //! Throws loom::Error naming the first value that breaks a rule.
  void validate() const {
    LOOM_CHECK(vocab_size >= 2 && vocab_size <= std::numeric_limits<std::int32_t>::max(),
               "synthetic markov: vocab_size", vocab_size, "must be in [2, 2147483647]");
    LOOM_CHECK(jump_probability >= 0.0 && jump_probability <= 1.0,
               "synthetic markov: jump_probability", jump_probability, "must be in [0, 1]");
  }

  friend bool operator==(const SyntheticMarkovConfig&, const SyntheticMarkovConfig&) = default;
  friend std::ostream& operator<<(std::ostream& out, const SyntheticMarkovConfig& c) {
    return out << "{vocab_size=" << c.vocab_size << ", jump_probability=" << c.jump_probability
               << ", seed=" << c.seed << "}";
  }
};

//! A deterministic Markov-chain TokenSource.
//!
//! A permutation P of [0, V) is drawn once by Fisher–Yates from CounterRng(seed,
//! "synthetic.permutation") (swap k with `below(k + 1, k)` for k = V-1 .. 1). Global sequence
//! j (sequence i of step s with batch B is j = s·B + i) has tokens x_0 .. x_seq: x_0 is uniform,
//! and x_t = P[x_{t-1}] unless a jump happens (probability q), in which case x_t is uniform.
//! All draws come from CounterRng(seed, "synthetic") at index j: lane 2t decides the jump at
//! position t, lane 2t+1 draws the uniform token. So a sequence depends on (seed, j) only, and
//! a shorter `seq` gives a prefix of the same sequence.
class SyntheticMarkov {
 public:
  explicit SyntheticMarkov(SyntheticMarkovConfig config = {})
      : config_((config.validate(), config)),
        draws_(config.seed, "synthetic"),
        permutation_(static_cast<std::size_t>(config.vocab_size)) {
    std::iota(permutation_.begin(), permutation_.end(), 0);
    const CounterRng shuffle(config.seed, "synthetic.permutation");
    for (std::int64_t k = config.vocab_size - 1; k >= 1; --k) {
      const auto other = shuffle.below(static_cast<std::uint64_t>(k + 1),
                                       static_cast<std::uint64_t>(k));
      std::swap(permutation_[static_cast<std::size_t>(k)], permutation_[other]);
    }
  }

  const SyntheticMarkovConfig& config() const noexcept { return config_; }
  std::int64_t vocab_size() const noexcept { return config_.vocab_size; }
  //! P: without a jump, token x is followed by `permutation()[x]`.
  std::span<const std::int32_t> permutation() const noexcept { return permutation_; }

  //! Per-token entropy in nats of the best predictor (one that knows P):
  //! -(1-q+q/V) ln(1-q+q/V) - (V-1)(q/V) ln(q/V). 0 for q = 0, ln V for q = 1. The mean
  //! cross-entropy of a model trained on this source cannot go below it.
  double entropy_floor() const noexcept {
    const double q = config_.jump_probability, v = static_cast<double>(config_.vocab_size);
    const double follow = 1.0 - q + q / v, other = q / v;
    auto plogp = [](double p) { return p > 0.0 ? p * std::log(p) : 0.0; };
    return std::max(0.0, -plogp(follow) - (v - 1.0) * plogp(other));  // no -0.0 for q = 0
  }

  //! Fills `out` with the first `out.size()` tokens of global sequence `sequence`.
  void sequence(std::uint64_t sequence, std::span<std::int32_t> out) const {
    LOOM_CHECK(out.size() <= max_positions, "synthetic markov: sequence length", out.size(),
               "must be <= 2^31 (two RNG lanes per position)");
    const auto v = static_cast<std::uint64_t>(config_.vocab_size);
    const double q = config_.jump_probability;
    std::int32_t previous = 0;
    for (std::size_t t = 0; t < out.size(); ++t) {
      const auto lane = static_cast<std::uint32_t>(2 * t);
      const bool jump = t == 0 || draws_.uniform(sequence, lane) < q;
      previous = jump ? static_cast<std::int32_t>(draws_.below(v, sequence, lane + 1))
                      : permutation_[static_cast<std::size_t>(previous)];
      out[t] = previous;
    }
  }

  //! The global batch of step `step`: sequences s·batch .. s·batch + batch - 1, each of
  //! seq + 1 tokens split into inputs (first seq) and targets (last seq).
  Batch batch_at(std::int64_t step, std::int64_t batch, std::int64_t seq) const {
    detail::check_batch_request("synthetic markov", step, batch, seq);
    LOOM_CHECK(seq < static_cast<std::int64_t>(max_positions), "synthetic markov: batch_at seq",
               seq, "must be < 2^31");
    Batch out = Batch::zeros(batch, seq);
    std::vector<std::int32_t> window(static_cast<std::size_t>(seq + 1));
    for (std::int64_t i = 0; i < batch; ++i) {
      sequence(static_cast<std::uint64_t>(step * batch + i), window);
      std::copy(window.begin(), window.end() - 1, out.tokens.begin() + i * seq);
      std::copy(window.begin() + 1, window.end(), out.targets.begin() + i * seq);
    }
    return out;
  }

 private:
  static constexpr std::size_t max_positions = std::size_t{1} << 31;

  SyntheticMarkovConfig config_;
  CounterRng draws_;
  std::vector<std::int32_t> permutation_;
};

static_assert(TokenSource<SyntheticMarkov>);

}  // namespace loom::io
