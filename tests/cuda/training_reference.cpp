#include "training_reference.hpp"

#include "loom/models/bert/model.hpp"
#include "support/masked_lm_training.hpp"
#include "support/parity.hpp"

namespace loom::test {

ParityRun cpu_reference_run(std::int64_t global_batch, std::int64_t seq, double clip) {
  return single_rank_run(global_batch, seq, clip);
}

ParityRun bert_cpu_reference_run(std::int64_t global_batch, std::int64_t seq) {
  using Bert = bert::Model<cpu, float>;
  cpu be(1);
  Trainer<Bert, AdamW> trainer(be, Bert(bert_test_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
                               {.micro_batch_size = global_batch, .clip_grad_norm = 1.0, .seed = 5});
  return masked_lm_steps(trainer, global_batch, seq);
}

}  // namespace loom::test
