#pragma once
// Test support for training runs: a reproducible learnable batch stream (every mesh sees the
// same global batch, DESIGN.md invariant 2), a small GPT-2 config, and the relative difference
// the parity checks use.

#include <cmath>
#include <cstdint>
#include <vector>

#include "loom/core/rng.hpp"
#include "loom/core/tensor.hpp"
#include "loom/models/gpt2/config.hpp"

namespace loom::test {

//! A [batch, seq] batch of next-token data from a counter-based stream (any mesh sees the same).
struct TestBatch {
  std::int64_t batch, seq;
  std::vector<std::int32_t> tokens, targets;
  Tensor<const std::int32_t> tokens_view() const { return {tokens.data(), Shape{batch, seq}}; }
  Tensor<const std::int32_t> targets_view() const { return {targets.data(), Shape{batch, seq}}; }
};

inline TestBatch make_batch(std::int64_t step, std::int64_t batch, std::int64_t seq, std::int64_t vocab) {
  TestBatch b{batch, seq, {}, {}};
  const CounterRng rng(99, "test.batch");
  // A learnable stream: mostly t -> (3t + 1) mod vocab.
  for (std::int64_t r = 0; r < batch; ++r) {
    std::int64_t x = static_cast<std::int64_t>(rng.below(vocab, (step * batch + r) * 1000));
    std::vector<std::int32_t> row;
    for (std::int64_t t = 0; t <= seq; ++t) {
      row.push_back(static_cast<std::int32_t>(x));
      x = rng.uniform((step * batch + r) * 1000 + t + 1) < 0.9 ? (3 * x + 1) % vocab
                                                               : rng.below(vocab, t, 1);
    }
    b.tokens.insert(b.tokens.end(), row.begin(), row.end() - 1);
    b.targets.insert(b.targets.end(), row.begin() + 1, row.end());
  }
  return b;
}

inline gpt2::Config small_test_config() {
  return {.max_seq_len = 16, .vocab_size = 50, .padded_vocab_size = 64, .num_layers = 2,
          .num_heads = 2, .channels = 16};
}

//! `config` (GPT-2's or BERT's) with hidden and attention dropout at `rate`.
template <class Config>
Config with_dropout(Config config, double rate = 0.1) {
  config.hidden_dropout = config.attention_dropout = rate;
  return config;
}

template <class T>
double relative_difference(const T* a, const T* b, std::int64_t n) {
  double diff = 0, norm = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace loom::test
