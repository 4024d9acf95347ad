// Sequence parallelism (gpt2::Config and bert::Config::sequence_parallel): under tensor
// parallelism the hidden state between layers is split by rows over the group. Tested against one
// rank (DESIGN.md invariant 3) with dropout on, on DP x TP and DP x TP x PP meshes with every
// strategy and with the combined and the split (zero-bubble) backward, with full recomputation,
// for GPT-2 and BERT; the activations it saves, counted; a group of one unchanged; and a
// micro-batch that does not split refused. The layer-by-layer checks of GPT-2 against one rank
// are in test_tensor_parallel.cpp, the split backward's bits in bf16 in test_gpt2_bf16.cpp.
#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/gradcheck.hpp"
#include "support/masked_lm_training.hpp"
#include "support/parity_check.hpp"
#include "support/training.hpp"

namespace test_sequence_parallel {

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

bert::Config sequence_parallel_bert_config(bool sequence_parallel = true) {
  bert::Config c = with_dropout(bert_test_config());
  c.sequence_parallel = sequence_parallel;
  return c;
}

//! One-rank training of `model`, the whole global batch in one micro-batch; `steps(trainer)`
//! trains it.
template <class M, class Steps>
ParityRun one_rank(M model, Steps&& steps) {
  cpu be(1);
  Trainer<M, AdamW> trainer(be, std::move(model), AdamW({.weight_decay = 0.1}), parity_lr(), options(global_batch));
  return steps(trainer);
}
ParityRun one_rank(const gpt2::Config& config, AttentionStorage storage) {
  return one_rank(Gpt(config, storage), [](auto& trainer) { return train_steps(trainer, global_batch, seq); });
}

//! Every rank's failures against `reference` on `shape` with schedule `S` and strategy `St`,
//! micro-batches of one sequence (16 rows: 8, 4 or 2 a rank), recomputing `recompute_layers`;
//! each rank's model is make_model(its tensor-parallel group), `global_layout` the one-rank
//! model's layout.
template <class M, class S, class St, class MakeModel, class Steps>
std::vector<std::string> mesh_failures(MeshShape shape, const ParityRun& reference, MakeModel&& make_model,
                                       Steps&& steps, const ParameterLayout& global_layout, int recompute_layers = 0) {
  std::vector<std::string> failures(static_cast<std::size_t>(shape.size()));
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<M, AdamW, S, St> trainer(be, mesh, make_model(CommunicatorRef(mesh.tensor_parallel())),
                                     AdamW({.weight_decay = 0.1}), parity_lr(), options(1, recompute_layers));
    const std::string failure = parity_failures(trainer, steps(trainer), reference, global_layout);
    if (trainer.model().sequence_parallel() != (shape.tp > 1))
      failures[static_cast<std::size_t>(world.rank())] += " the model does not split the rows";
    if (!failure.empty()) failures[static_cast<std::size_t>(world.rank())] += failure;
  });
  std::vector<std::string> wrong;
  for (std::size_t r = 0; r < failures.size(); ++r)
    if (!failures[r].empty()) wrong.push_back("rank " + std::to_string(r) + ":" + failures[r]);
  return wrong;
}

//! mesh_failures for the GPT-2 of sequence_parallel_config().
template <class S, class St>
std::vector<std::string> gpt2_failures(MeshShape shape, const ParityRun& reference, AttentionStorage storage,
                                       int recompute_layers = 0) {
  return mesh_failures<Gpt, S, St>(
      shape, reference, [&](CommunicatorRef tp) { return Gpt(sequence_parallel_config(), tp, storage); },
      [](auto& trainer) { return train_steps(trainer, global_batch, seq); },
      Gpt(sequence_parallel_config(false)).layout(), recompute_layers);
}

}  // namespace

TEST_CASE("with sequence parallelism every mesh, strategy and schedule trains the same GPT-2 as one rank") {
  for (AttentionStorage storage : {AttentionStorage::stored, AttentionStorage::recompute}) {
    CAPTURE(storage);
    const ParityRun reference = one_rank(sequence_parallel_config(false), storage);
    const std::vector<std::string> none;
    CHECK(gpt2_failures<GradientAccumulation, DataParallel>({.dp = 1, .tp = 2, .pp = 1}, reference, storage) == none);
    CHECK(gpt2_failures<GradientAccumulation, Zero<3>>({.dp = 2, .tp = 2, .pp = 1}, reference, storage) == none);
    CHECK(gpt2_failures<GradientAccumulation, Zero<2>>({.dp = 2, .tp = 4, .pp = 1}, reference, storage) == none);
    CHECK(gpt2_failures<OneFOneB, Zero<1>>({.dp = 1, .tp = 2, .pp = 2}, reference, storage) == none);
    // The split backward: the weight pass reads the layernorms' outputs the input pass gathered.
    CHECK(gpt2_failures<ZeroBubbleH1, DataParallel>({.dp = 1, .tp = 2, .pp = 2}, reference, storage) == none);
    // Full recomputation: the recomputed forward gathers and reduce-scatters again.
    CHECK(gpt2_failures<OneFOneB, DataParallel>({.dp = 2, .tp = 2, .pp = 2}, reference, storage,
                                                TrainerOptions::all_layers) == none);
  }
}

TEST_CASE("with sequence parallelism every mesh, strategy and schedule trains the same BERT as one rank") {
  using Bert = bert::Model<cpu, float>;
  const auto steps = [](auto& trainer) { return masked_lm_steps(trainer, global_batch, seq); };
  const ParameterLayout layout = Bert(sequence_parallel_bert_config(false)).layout();
  for (AttentionStorage storage : {AttentionStorage::stored, AttentionStorage::recompute}) {
    CAPTURE(storage);
    const ParityRun reference = one_rank(Bert(sequence_parallel_bert_config(false), storage), steps);
    const auto make = [&](CommunicatorRef tp) { return Bert(sequence_parallel_bert_config(), tp, storage); };
    const std::vector<std::string> none;
    CHECK(mesh_failures<Bert, GradientAccumulation, Zero<3>>({.dp = 2, .tp = 2, .pp = 1}, reference, make, steps,
                                                             layout) == none);
    CHECK(mesh_failures<Bert, GradientAccumulation, DataParallel>({.dp = 1, .tp = 4, .pp = 1}, reference, make, steps,
                                                                  layout) == none);
    CHECK(mesh_failures<Bert, ZeroBubbleH1, Zero<1>>({.dp = 1, .tp = 2, .pp = 2}, reference, make, steps, layout) ==
          none);
    CHECK(mesh_failures<Bert, OneFOneB, DataParallel>({.dp = 2, .tp = 2, .pp = 2}, reference, make, steps, layout,
                                                      TrainerOptions::all_layers) == none);
  }
}

TEST_CASE("sequence parallelism keeps a rank's rows of the layernorms' activations and passes its rows (GPT-2, BERT)") {
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
  // BERT: the embedding's sum and its layernorm's statistics, and each block's r1, h, r2 and
  // statistics, on n rows.
  {
    const std::int64_t Cb = bert_test_config().channels, n = N / 2;
    std::vector<std::int64_t> hidden(2), embedding(2), block_saved(2);
    for (const bool sequence_parallel : {false, true})
      threads::run(2, [&](threads::Communicator& comm) {
        const bert::Model<cpu, float> model(sequence_parallel_bert_config(sequence_parallel), CommunicatorRef(comm));
        if (comm.rank() != 0) return;
        hidden[sequence_parallel] = model.hidden_elements(s);
        embedding[sequence_parallel] = model.activation_elements(bert::embedding_layer, s);
        block_saved[sequence_parallel] = model.activation_elements(bert::block_layer(0), s);
      });
    CHECK(hidden[1] == n * Cb);
    CHECK(embedding[0] - embedding[1] == (N - n) * (Cb + 2));
    CHECK(block_saved[0] - block_saved[1] == (N - n) * (3 * Cb + 4));
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

}  // namespace test_sequence_parallel
