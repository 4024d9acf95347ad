// gpt2::Attention::recompute: a block keeps each attention row's log-sum-exp instead of the
// probabilities, and its backward recomputes them (attention_forward_lse/backward_lse). It keeps
// B·(H/tp)·T values in place of B·(H/tp)·T² per block, computes the same gradients as
// Attention::stored (double: to rounding), trains like it (float), and every layout trains as one
// rank does with it (DESIGN.md invariant 3).
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/parity.hpp"
#include "support/training.hpp"

namespace test_gpt2_attention_recompute {

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t global_batch = 8, seq = 16;

//! small_test_config with 4 heads, so that 2 tensor-parallel ranks hold 2 each.
gpt2::Config recompute_config() {
  gpt2::Config c = small_test_config();
  c.num_heads = 4;
  return c;
}

template <class T>
std::int64_t block_elements(const gpt2::Model<cpu, T>& m, MicroBatchShape s) {
  return m.activation_elements(gpt2::block_layer(0), s);
}

//! One run of `St` with schedule `S` on `shape` (thread ranks), with Attention::recompute; the
//! failures of every rank against `reference` (empty when all match).
template <class S, class St>
std::vector<std::string> recompute_mesh_failures(MeshShape shape, const ParityRun& reference, St strategy = {},
                                                 S schedule = {}) {
  using Gpt = gpt2::Model<cpu, float>;
  const Gpt global_model(recompute_config());
  std::mutex mutex;
  std::vector<std::string> failures;
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<Gpt, AdamW, S, St> trainer(be, mesh, Gpt(recompute_config(), mesh.tensor_parallel(), gpt2::Attention::recompute),
                                       AdamW({.weight_decay = 0.1}), parity_lr(),
                                       {.micro_batch_size = 1, .clip_grad_norm = 1.0, .seed = 5}, strategy, schedule);
    const ParityRun run = train_steps(trainer, global_batch, seq);
    const std::string failure = parity_failures(trainer, run, reference, global_model.layout());
    std::lock_guard lock(mutex);
    if (!failure.empty()) failures.push_back("rank " + std::to_string(world.rank()) + ":" + failure);
  });
  return failures;
}

//! One-rank training of recompute_config() with `attention`, the whole batch in one micro-batch.
ParityRun one_rank_run(gpt2::Attention attention) {
  using Gpt = gpt2::Model<cpu, float>;
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(recompute_config(), attention), AdamW({.weight_decay = 0.1}), parity_lr(),
                              {.micro_batch_size = global_batch, .clip_grad_norm = 1.0, .seed = 5});
  return train_steps(trainer, global_batch, seq);
}

}  // namespace

TEST_CASE_TEMPLATE("recompute keeps B·H·T log-sum-exp values in place of B·H·T² probabilities per block", T, float,
                   double, bf16) {
  gpt2::Config c = recompute_config();
  c.max_seq_len = 40;
  const gpt2::Model<cpu, T> stored(c), recompute(c, gpt2::Attention::recompute);
  CHECK(stored.attention() == gpt2::Attention::stored);
  CHECK(recompute.attention() == gpt2::Attention::recompute);
  // A log-sum-exp value is accumulate_t<T>: two elements of a bf16 range.
  constexpr std::int64_t per_value = sizeof(accumulate_t<T>) / sizeof(T);
  for (const MicroBatchShape s : {MicroBatchShape{3, 40}, MicroBatchShape{1, 1}, MicroBatchShape{2, 17}}) {
    CAPTURE(s.batch);
    CAPTURE(s.seq);
    const std::int64_t probabilities = s.batch * c.num_heads * s.seq * s.seq, lse = s.batch * c.num_heads * s.seq;
    CHECK(block_elements(recompute, s) == block_elements(stored, s) - probabilities + lse * per_value);
    // The embedding and the head keep the same either way.
    CHECK(recompute.activation_elements(gpt2::embedding_layer, s) == stored.activation_elements(gpt2::embedding_layer, s));
    CHECK(recompute.activation_elements(gpt2::head_layer(c), s) == stored.activation_elements(gpt2::head_layer(c), s));
  }
  // Under tensor parallelism a rank keeps its own heads' values: H/tp.
  threads::run(2, [&](threads::Communicator& comm) {
    const gpt2::Model<cpu, T> tp_stored(c, CommunicatorRef(comm)),
        tp_recompute(c, CommunicatorRef(comm), gpt2::Attention::recompute);
    const MicroBatchShape s{3, 40};
    const std::int64_t heads = c.num_heads / 2;
    CHECK(block_elements(tp_recompute, s) ==
          block_elements(tp_stored, s) - s.batch * heads * s.seq * s.seq + s.batch * heads * s.seq * per_value);
  });
}

TEST_CASE("recompute gives stored's losses, gradient norms and weights in double, to rounding") {
  using Gpt = gpt2::Model<cpu, double>;
  const gpt2::Config c = recompute_config();
  cpu be(2);
  Trainer<Gpt, AdamW> stored(be, Gpt(c), AdamW({.weight_decay = 0.1}), parity_lr(), {.micro_batch_size = 4, .seed = 3});
  Trainer<Gpt, AdamW> recompute(be, Gpt(c, gpt2::Attention::recompute), AdamW({.weight_decay = 0.1}), parity_lr(),
                                {.micro_batch_size = 4, .seed = 3});
  for (int s = 0; s < parity_steps; ++s) {
    CAPTURE(s);
    const TestBatch batch = make_batch(s, global_batch, seq, c.vocab_size);
    const StepMetrics a = stored.step(batch), b = recompute.step(batch);
    CHECK(b.loss == doctest::Approx(a.loss).epsilon(1e-12));
    CHECK(b.grad_norm == doctest::Approx(a.grad_norm).epsilon(1e-10));
  }
  const std::vector<double> wa = stored.gather_parameters(), wb = recompute.gather_parameters();
  CHECK(relative_difference(wb.data(), wa.data(), static_cast<std::int64_t>(wa.size())) <= 1e-10);
  const TestBatch held_out = make_batch(99, 4, seq, c.vocab_size);
  CHECK(recompute.evaluate(held_out) == doctest::Approx(stored.evaluate(held_out)).epsilon(1e-12));
}

TEST_CASE("recompute trains as stored does in float") {
  check_parity(one_rank_run(gpt2::Attention::recompute), one_rank_run(gpt2::Attention::stored));
}

TEST_CASE("with recompute, DDP, ZeRO-3, TP, DP x TP and a 1F1B pipeline train as one rank does") {
  const ParityRun reference = one_rank_run(gpt2::Attention::recompute);
  const std::vector<std::string> none;
  CHECK(recompute_mesh_failures<GradientAccumulation>({.dp = 2, .tp = 1, .pp = 1}, reference,
                                                      DataParallel{.bucket_bytes = 4096}) == none);
  CHECK(recompute_mesh_failures<GradientAccumulation>({.dp = 2, .tp = 1, .pp = 1}, reference, Zero<3>{}) == none);
  CHECK(recompute_mesh_failures<GradientAccumulation, DataParallel>({.dp = 1, .tp = 2, .pp = 1}, reference) == none);
  CHECK(recompute_mesh_failures<GradientAccumulation, DataParallel>({.dp = 2, .tp = 2, .pp = 1}, reference) == none);
  CHECK(recompute_mesh_failures<OneFOneB, DataParallel>({.dp = 1, .tp = 2, .pp = 2}, reference) == none);
}

}  // namespace test_gpt2_attention_recompute
