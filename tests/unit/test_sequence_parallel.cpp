// Sequence parallelism (gpt2::Config::sequence_parallel): under tensor parallelism the hidden
// state between layers is split by rows over the group. Tested against one rank (DESIGN.md
// invariant 3) with dropout on, on DP x TP and DP x TP x PP meshes with every strategy and with
// the combined and the split (zero-bubble) backward, with full recomputation; the activations it
// saves, counted; a group of one unchanged; and a micro-batch that does not split refused. The
// layer-by-layer checks against one rank are in test_tensor_parallel.cpp, the split backward's
// bits in bf16 in test_gpt2_bf16.cpp.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/gradcheck.hpp"
#include "support/parity_check.hpp"
#include "support/training.hpp"

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t global_batch = 8, seq = 16;
using Gpt = gpt2::Model<cpu, float>;

//! 4 heads and 3 blocks (a pipeline of 2 stages splits them unevenly), every dropout on: each
//! rank must draw its rows of the one mask.
gpt2::Config sequence_parallel_config(bool sequence_parallel = true) {
  gpt2::Config c = with_dropout(small_test_config());
  c.num_heads = 4;
  c.num_layers = 3;
  c.sequence_parallel = sequence_parallel;
  return c;
}

TrainerOptions options(std::int64_t micro_batch, int recompute_layers = 0) {
  return {.micro_batch_size = micro_batch, .clip_grad_norm = 1.0, .seed = 5, .recompute_layers = recompute_layers};
}

//! One-rank training of `config`: the whole global batch in one micro-batch.
ParityRun one_rank(const gpt2::Config& config, AttentionStorage storage) {
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(config, storage), AdamW({.weight_decay = 0.1}), parity_lr(),
                              options(global_batch));
  return train_steps(trainer, global_batch, seq);
}

//! Every rank's failures against `reference` on `shape` with schedule `S` and strategy `St`,
//! micro-batches of one sequence (16 rows: 8, 4 or 2 a rank), recomputing `recompute_layers`.
template <class S, class St>
std::vector<std::string> mesh_failures(MeshShape shape, const ParityRun& reference, AttentionStorage storage,
                                       int recompute_layers = 0) {
  const Gpt global_model(sequence_parallel_config(false));
  std::vector<std::string> failures(static_cast<std::size_t>(shape.size()));
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<Gpt, AdamW, S, St> trainer(be, mesh,
                                       Gpt(sequence_parallel_config(), CommunicatorRef(mesh.tensor_parallel()), storage),
                                       AdamW({.weight_decay = 0.1}), parity_lr(), options(1, recompute_layers));
    const std::string failure =
        parity_failures(trainer, train_steps(trainer, global_batch, seq), reference, global_model.layout());
    if (trainer.model().sequence_parallel() != (shape.tp > 1))
      failures[static_cast<std::size_t>(world.rank())] += " the model does not split the rows";
    if (!failure.empty()) failures[static_cast<std::size_t>(world.rank())] += failure;
  });
  std::vector<std::string> wrong;
  for (std::size_t r = 0; r < failures.size(); ++r)
    if (!failures[r].empty()) wrong.push_back("rank " + std::to_string(r) + ":" + failures[r]);
  return wrong;
}

}  // namespace

TEST_CASE("with sequence parallelism every mesh, strategy and schedule trains the same GPT-2 as one rank") {
  for (AttentionStorage storage : {AttentionStorage::stored, AttentionStorage::recompute}) {
    CAPTURE(storage);
    const ParityRun reference = one_rank(sequence_parallel_config(false), storage);
    const std::vector<std::string> none;
    CHECK(mesh_failures<GradientAccumulation, DataParallel>({.dp = 1, .tp = 2, .pp = 1}, reference, storage) == none);
    CHECK(mesh_failures<GradientAccumulation, Zero<3>>({.dp = 2, .tp = 2, .pp = 1}, reference, storage) == none);
    CHECK(mesh_failures<GradientAccumulation, Zero<2>>({.dp = 2, .tp = 4, .pp = 1}, reference, storage) == none);
    CHECK(mesh_failures<OneFOneB, Zero<1>>({.dp = 1, .tp = 2, .pp = 2}, reference, storage) == none);
    // The split backward: the weight pass reads the layernorms' outputs the input pass gathered.
    CHECK(mesh_failures<ZeroBubbleH1, DataParallel>({.dp = 1, .tp = 2, .pp = 2}, reference, storage) == none);
    // Full recomputation: the recomputed forward gathers and reduce-scatters again.
    CHECK(mesh_failures<OneFOneB, DataParallel>({.dp = 2, .tp = 2, .pp = 2}, reference, storage,
                                                TrainerOptions::all_layers) == none);
  }
}

TEST_CASE("sequence parallelism keeps a rank's rows of the layernorms' activations and passes its rows") {
  const MicroBatchShape s{2, seq};
  const std::int64_t N = s.batch * s.seq, C = small_test_config().channels;
  const int block = gpt2::block_layer(0), head = gpt2::head_layer(sequence_parallel_config());
  for (const std::int64_t tp : {2, 4}) {
    CAPTURE(tp);
    std::vector<std::int64_t> hidden(2), block_saved(2), head_saved(2);
    for (const bool sequence_parallel : {false, true})
      threads::run(static_cast<int>(tp), [&](threads::Communicator& comm) {
        const Gpt model(sequence_parallel_config(sequence_parallel), CommunicatorRef(comm));
        if (comm.rank() != 0) return;
        hidden[sequence_parallel] = model.hidden_elements(s);
        block_saved[sequence_parallel] = model.activation_elements(block, s);
        head_saved[sequence_parallel] = model.activation_elements(head, s);
      });
    const std::int64_t n = N / tp;
    CHECK(hidden[0] == N * C);
    CHECK(hidden[1] == n * C);
    // ln1, res2, ln2 (3·C a row) and the two layernorms' statistics (4 a row) on n rows, not N.
    CHECK(block_saved[0] - block_saved[1] == (N - n) * (3 * C + 4));
    // ln_f's mean and rstd on n rows; its output stays whole (the unembedding GEMMs read it).
    CHECK(head_saved[0] - head_saved[1] == (N - n) * 2);
  }
  // The Trainer's slots shrink by as much: hidden states and blocks.
  std::vector<std::int64_t> slot(2);
  for (const bool sequence_parallel : {false, true})
    threads::run(2, [&](threads::Communicator& comm) {
      cpu be(1);
      Trainer<Gpt, AdamW> trainer(be, Gpt(sequence_parallel_config(sequence_parallel), CommunicatorRef(comm)),
                                  AdamW(), parity_lr(), options(2));
      trainer.step(make_batch(0, 2, seq, small_test_config().vocab_size));
      if (comm.rank() == 0) slot[sequence_parallel] = trainer.activation_slot_elements();
    });
  CHECK(slot[1] < slot[0]);
}

TEST_CASE("a group of one rank ignores sequence_parallel: the same bits as without it") {
  const gpt2::Config config = sequence_parallel_config();
  CHECK_FALSE(Gpt(config).sequence_parallel());
  const ParityRun with = one_rank(config, AttentionStorage::stored);
  const ParityRun without = one_rank(sequence_parallel_config(false), AttentionStorage::stored);
  CHECK(with.losses == without.losses);
  CHECK(with.grad_norms == without.grad_norms);
  CHECK(with.weights == without.weights);
}

TEST_CASE("a micro-batch whose tokens do not split over the group is refused on every rank, naming the count") {
  gpt2::Config config = sequence_parallel_config();
  config.max_seq_len = 8;
  // One sequence of 7 tokens over 2 ranks: refused in the first layer's forward, before any
  // collective, so no rank waits for another.
  expect_error(
      [&] {
        threads::run(2, [&](threads::Communicator& comm) {
          cpu be(1);
          Trainer<Gpt, AdamW> trainer(be, Gpt(config, CommunicatorRef(comm)), AdamW(), parity_lr(), options(1));
          trainer.step(make_batch(0, 1, 7, config.vocab_size));
        });
      },
      "gpt2 sequence parallelism: tokens of the micro-batch: got 7");
  // 8 tokens split.
  threads::run(2, [&](threads::Communicator& comm) {
    cpu be(1);
    Trainer<Gpt, AdamW> trainer(be, Gpt(config, CommunicatorRef(comm)), AdamW(), parity_lr(), options(1));
    trainer.step(make_batch(0, 1, 8, config.vocab_size));
  });
}
