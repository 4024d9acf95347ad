// minimal_trainer: the smallest complete loom program (the README's snippet, on a tiny model).
//
//   minimal_trainer
//
// One idea: a Trainer is Model + Optimizer (+ Schedule + Strategy, defaulted here to gradient
// accumulation on a single rank); a step takes the global batch and returns its metrics.

#include <cstdio>

#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"

int main() {
  loom::cpu backend(2);                // this rank's threads
  loom::gpt2::Config config = loom::gpt2::tiny();
  loom::Trainer<loom::gpt2::Model<loom::cpu>, loom::AdamW> trainer(
      backend, loom::gpt2::Model<loom::cpu>(config), loom::AdamW({.weight_decay = 0.1}),
      loom::WarmupCosineLr{.lr = 3e-3, .warmup = 5, .total_steps = 40, .min_lr_factor = 0.1},
      {.micro_batch_size = 4, .clip_grad_norm = 1.0, .seed = 1337});
  loom::io::SyntheticMarkov data({.vocab_size = config.vocab_size});
  double first = 0, last = 0;
  for (std::int64_t step = 0; step < 40; ++step) {
    const loom::StepMetrics m = trainer.step(data.batch_at(step, /*batch=*/8, /*seq=*/64));
    if (step == 0) first = m.loss;
    last = m.loss;
  }
  std::printf("loss %.3f -> %.3f (entropy floor %.3f)\n", first, last, data.entropy_floor());
  return last < first ? 0 : 1;
}
