#pragma once
// The one-rank CPU run the CUDA training tests compare with, built by g++ in
// training_reference.cpp (the CPU kernels stay out of the nvcc translation unit).

#include <cstdint>
#include <string>

#include "loom/optim/adafactor.hpp"
#include "support/parity_check.hpp"

namespace loom::test {

//! parity_steps AdamW steps of small_test_config() on one CPU rank, the whole global batch in
//! one micro-batch (parity.hpp's single_rank_run).
ParityRun cpu_reference_run(std::int64_t global_batch, std::int64_t seq, double clip);

//! cpu_reference_run with Adafactor(options) in place of AdamW.
ParityRun adafactor_cpu_reference_run(std::int64_t global_batch, std::int64_t seq, double clip,
                                      const Adafactor::Options& options);

//! cpu_reference_run (no clipping) with the config's hidden and attention dropout at `rate`: the
//! masks the GPU must draw too.
ParityRun cpu_dropout_reference_run(std::int64_t global_batch, std::int64_t seq, double rate);

//! parity_steps AdamW steps of bert_test_config() on masked_test_source()'s batches (or, padded,
//! padded_masked_test_source()'s), on one CPU rank, the whole global batch in one micro-batch,
//! gradients clipped to 1.
ParityRun bert_cpu_reference_run(std::int64_t global_batch, std::int64_t seq, bool padded = false);

//! Steps [first, last) of cpu_reference_run's training on one CPU rank: from scratch when
//! `load` is empty, else after loading the training state `load` (saved after step `first`);
//! then saves the state to `save` unless it is empty. The run's losses and gradient norms of
//! those steps, and its weights at the end.
ParityRun cpu_training_leg(std::int64_t global_batch, std::int64_t seq, double clip, int first, int last,
                           const std::string& load, const std::string& save);

}  // namespace loom::test
