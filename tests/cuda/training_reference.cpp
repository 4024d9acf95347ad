#include "training_reference.hpp"

#include "loom/io/training_state.hpp"
#include "loom/models/bert/model.hpp"
#include "support/masked_lm_training.hpp"
#include "support/parity.hpp"

namespace loom::test {

ParityRun cpu_reference_run(std::int64_t global_batch, std::int64_t seq, double clip) {
  return single_rank_run(global_batch, seq, clip);
}

ParityRun adafactor_cpu_reference_run(std::int64_t global_batch, std::int64_t seq, double clip,
                                      const Adafactor::Options& options) {
  using Gpt = gpt2::Model<cpu, float>;
  cpu be(1);
  Trainer<Gpt, Adafactor> trainer(be, Gpt(small_test_config()), Adafactor(options), parity_lr(),
                                  {.micro_batch_size = global_batch, .clip_grad_norm = clip, .seed = 5});
  return train_steps(trainer, global_batch, seq);
}

ParityRun cpu_dropout_reference_run(std::int64_t global_batch, std::int64_t seq, double rate) {
  using Gpt = gpt2::Model<cpu, float>;
  gpt2::Config config = small_test_config();
  config.hidden_dropout = config.attention_dropout = rate;
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(config), AdamW({.weight_decay = 0.1}), parity_lr(),
                              {.micro_batch_size = global_batch, .seed = 5});
  return train_steps(trainer, global_batch, seq);
}

ParityRun bert_cpu_reference_run(std::int64_t global_batch, std::int64_t seq, bool padded) {
  using Bert = bert::Model<cpu, float>;
  cpu be(1);
  Trainer<Bert, AdamW> trainer(be, Bert(bert_test_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
                               {.micro_batch_size = global_batch, .clip_grad_norm = 1.0, .seed = 5});
  return padded ? masked_lm_steps_on(trainer, padded_masked_test_source(), global_batch, seq)
                : masked_lm_steps(trainer, global_batch, seq);
}

ParityRun cpu_training_leg(std::int64_t global_batch, std::int64_t seq, double clip, int first, int last,
                           const std::string& load, const std::string& save) {
  using Gpt = gpt2::Model<cpu, float>;
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(small_test_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
                              {.micro_batch_size = global_batch, .clip_grad_norm = clip, .seed = 5});
  if (!load.empty()) io::load_training_state(trainer, load);
  ParityRun run;
  for (int s = first; s < last; ++s) {
    const StepMetrics m = trainer.step(make_batch(s, global_batch, seq, small_test_config().vocab_size));
    run.losses.push_back(m.loss);
    run.grad_norms.push_back(m.grad_norm);
  }
  if (!save.empty()) io::save_training_state(trainer, save);
  run.weights = trainer.gather_parameters();
  return run;
}

}  // namespace loom::test
