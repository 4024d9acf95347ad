#pragma once
// Test support for BERT: the masked synthetic task, a small BERT config, and parity_steps AdamW
// steps on its batches (shared by tests/unit/test_bert.cpp and the CUDA training test).

#include <cstdint>

#include "loom/io/masked_lm.hpp"
#include "loom/io/padded.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/models/bert/config.hpp"
#include "support/parity_check.hpp"

namespace loom::test {

//! The synthetic chain over 49 tokens, masked: a vocabulary of 50 with the mask token last.
inline io::MaskedLm<io::SyntheticMarkov> masked_test_source(std::int64_t max_predictions = 0) {
  return io::MaskedLm(io::SyntheticMarkov({.vocab_size = 49, .jump_probability = 0.1, .seed = 7}),
                      {.max_predictions = max_predictions});
}

//! 2 layers, 4 heads of 4 channels, a vocabulary of 50 padded to 64 (4 tensor-parallel ranks
//! divide it).
inline bert::Config bert_test_config() {
  return {.max_seq_len = 16, .vocab_size = 50, .padded_vocab_size = 64, .num_layers = 2, .num_heads = 4,
          .channels = 16};
}

//! masked_test_source() over sequences of 2 to seq tokens, padded with token 0.
inline io::MaskedLm<io::Padded<io::SyntheticMarkov>> padded_masked_test_source() {
  return io::MaskedLm(io::Padded(io::SyntheticMarkov({.vocab_size = 49, .jump_probability = 0.1, .seed = 7}),
                                 {.min_length = 2, .pad_token = 0}));
}

//! Trains `trainer` for parity_steps steps on `source`'s [global_batch, seq] batches.
template <class Trainer, class Source>
ParityRun masked_lm_steps_on(Trainer& trainer, const Source& source, std::int64_t global_batch, std::int64_t seq) {
  ParityRun run;
  for (int s = 0; s < parity_steps; ++s) {
    const StepMetrics m = trainer.step(source.batch_at(s, global_batch, seq));
    run.losses.push_back(m.loss);
    run.grad_norms.push_back(m.grad_norm);
  }
  run.weights = trainer.gather_parameters();
  return run;
}

//! Trains `trainer` for parity_steps steps on masked_test_source(max_predictions)'s
//! [global_batch, seq] batches.
template <class Trainer>
ParityRun masked_lm_steps(Trainer& trainer, std::int64_t global_batch, std::int64_t seq,
                          std::int64_t max_predictions = 0) {
  return masked_lm_steps_on(trainer, masked_test_source(max_predictions), global_batch, seq);
}

}  // namespace loom::test
