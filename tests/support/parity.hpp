#pragma once
// The one-rank CPU references of the parity checks (parity_check.hpp has the comparisons).

#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/parity_check.hpp"
#include "support/training.hpp"

namespace loom::test {

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

}  // namespace loom::test
