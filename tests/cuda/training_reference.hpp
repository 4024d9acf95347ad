#pragma once
// The one-rank CPU run the CUDA training tests compare with, built by g++ in
// training_reference.cpp (the CPU kernels stay out of the nvcc translation unit).

#include <cstdint>

#include "support/parity_check.hpp"

namespace loom::test {

//! parity_steps AdamW steps of small_test_config() on one CPU rank, the whole global batch in
//! one micro-batch (parity.hpp's single_rank_run).
ParityRun cpu_reference_run(std::int64_t global_batch, std::int64_t seq, double clip);

//! parity_steps AdamW steps of bert_test_config() on masked_test_source()'s batches, on one CPU
//! rank, the whole global batch in one micro-batch, gradients clipped to 1.
ParityRun bert_cpu_reference_run(std::int64_t global_batch, std::int64_t seq);

}  // namespace loom::test
