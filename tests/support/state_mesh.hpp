#pragma once
// Test support for training-state checkpoints: the model, schedule and thread-rank trainers the
// save and resume tests share (test_training_state, test_async_training_state).

#include <cstdint>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/training.hpp"

namespace loom::test {

//! The checkpoint tests' run: global batch, sequence length, steps, and the step saved after.
inline constexpr std::int64_t state_batch = 8, state_seq = 16, state_steps = 6, state_saved_at = 3;

//! small_test_config with heads and vocabulary that 4 tensor-parallel ranks divide.
inline gpt2::Config state_config() {
  gpt2::Config c = small_test_config();
  c.num_heads = 4;
  return c;
}

inline WarmupCosineLr state_lr() {
  return {.lr = 1e-2, .warmup = 2, .total_steps = state_steps, .min_lr_factor = 0.1};
}

//! Calls f(trainer, world rank) on every thread rank of `shape`, each with an AdamW trainer of
//! strategy `St` and schedule `Sc` on state_config()'s model.
template <class Sc, class St, class T = float, class F>
void on_state_mesh(MeshShape shape, St strategy, Sc schedule, std::uint64_t seed, F&& f) {
  using Gpt = gpt2::Model<cpu, T>;
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<Gpt, AdamW, Sc, St> trainer(be, mesh, Gpt(state_config(), mesh.tensor_parallel()),
                                        AdamW({.weight_decay = 0.1}), state_lr(),
                                        {.micro_batch_size = 1, .clip_grad_norm = 0.05, .seed = seed}, strategy,
                                        schedule);
    f(trainer, world.rank());
  });
}

}  // namespace loom::test
