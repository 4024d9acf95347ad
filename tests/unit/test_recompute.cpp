// Activation recomputation (TrainerOptions::recompute_layers): a recomputed layer keeps nothing
// but its input between forward and backward and runs its forward again before its backward.
// The run must train the same model bit for bit (the CPU kernels are deterministic and dropout
// masks are keyed, not drawn), on every mesh and schedule that allows it, with the slots smaller
// by the recomputed layers' activations; a schedule that cannot use it is refused before step 1.
// And the head that computes its logits in chunks of rows (Config::logits_chunk_rows), keeping
// per-row statistics instead of the probabilities: gradients against central differences in
// double, the stored head's loss and gradient in float, and parity with one rank on meshes.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "loom/backend/cpu/kernels.hpp"
#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/masked_lm_training.hpp"
#include "support/model_pass.hpp"
#include "support/parity_check.hpp"
#include "support/training.hpp"

namespace test_recompute {

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t global_batch = 8, seq = 16;
constexpr int all_layers = TrainerOptions::all_layers;

//! GPT-2 with 4 blocks and every dropout on, so that a recomputed forward must draw the forward's
//! masks to give the same bits.
gpt2::Config recompute_gpt2_config() {
  gpt2::Config c = small_test_config();
  c.num_layers = 4;
  c.num_heads = 4;
  return with_dropout(c);
}

bert::Config recompute_bert_config() { return with_dropout(bert_test_config()); }

TrainerOptions options(std::int64_t micro_batch, int recompute_layers) {
  return {.micro_batch_size = micro_batch, .clip_grad_norm = 1.0, .seed = 5, .recompute_layers = recompute_layers};
}

//! What one rank of a run saw: its losses, gradient norms and gathered weights, and how many of
//! its layers recomputed.
struct RankRun {
  ParityRun run;
  int recomputed = 0;
  std::int64_t slot_elements = 0;
};

//! Every rank's run of `M` (built by `make_model` over the tensor-parallel group) on `shape` with
//! schedule `S` and strategy `St`, recomputing `recompute_layers` per chunk.
template <class M, class S, class St, class MakeModel, class Steps>
std::vector<RankRun> mesh_runs(MeshShape shape, int recompute_layers, MakeModel&& make_model, Steps&& steps) {
  std::vector<RankRun> runs(static_cast<std::size_t>(shape.size()));
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<M, AdamW, S, St> trainer(be, mesh, make_model(CommunicatorRef(mesh.tensor_parallel())),
                                     AdamW({.weight_decay = 0.1}), parity_lr(), options(1, recompute_layers));
    RankRun r;
    r.run = steps(trainer);
    r.recomputed = trainer.recomputed_layers();
    r.slot_elements = trainer.activation_slot_elements();
    runs[static_cast<std::size_t>(world.rank())] = std::move(r);
  });
  return runs;
}

//! Runs `shape` with and without recomputing every layer: every rank's losses, gradient norms and
//! weights are the same bits, every rank recomputed at least one layer, and its slots shrank.
template <class M, class S, class St, class MakeModel, class Steps>
void check_same_bits(MeshShape shape, MakeModel&& make_model, Steps&& steps) {
  CAPTURE(shape);
  const std::vector<RankRun> stored = mesh_runs<M, S, St>(shape, 0, make_model, steps);
  const std::vector<RankRun> recomputed = mesh_runs<M, S, St>(shape, all_layers, make_model, steps);
  for (std::size_t r = 0; r < stored.size(); ++r) {
    CAPTURE(r);
    CHECK(stored[r].recomputed == 0);
    CHECK(recomputed[r].recomputed >= 1);
    CHECK(recomputed[r].slot_elements < stored[r].slot_elements);
    CHECK(recomputed[r].run.losses == stored[r].run.losses);
    CHECK(recomputed[r].run.grad_norms == stored[r].run.grad_norms);
    CHECK(recomputed[r].run.weights == stored[r].run.weights);
  }
}

}  // namespace

TEST_CASE("a recomputed layer keeps nothing in the slot; one buffer holds one layer's activations") {
  using Gpt = gpt2::Model<cpu, float>;
  const gpt2::Config config = recompute_gpt2_config();
  const Gpt model(config);
  const MicroBatchShape shape{2, seq};
  // The Trainer starts each layer's range 16-byte aligned (4 floats).
  const auto aligned = [](std::int64_t elements) { return (elements + 3) / 4 * 4; };
  const std::int64_t hidden = model.hidden_elements(shape), block = aligned(model.activation_elements(1, shape)),
                     head = aligned(model.activation_elements(config.num_layers + 1, shape));
  const auto trained = [&](int recompute_layers) {
    cpu be(1);
    Trainer<Gpt, AdamW> trainer(be, Gpt(config), AdamW({.weight_decay = 0.1}), parity_lr(),
                                options(2, recompute_layers));
    ParityRun run = train_steps(trainer, global_batch, seq);
    return std::tuple{std::move(run), trainer.recomputed_layers(), trainer.activation_slot_elements(),
                      trainer.recompute_elements(), be.memory().peak(MemoryCategory::activations)};
  };
  const auto [stored, none, stored_slot, stored_buffer, stored_peak] = trained(0);
  CHECK(none == 0);
  CHECK(stored_buffer == 0);
  // The hidden states between the layers: the embedding's output and each block's.
  const std::int64_t hiddens = hidden * (config.num_layers + 1);
  CHECK(stored_slot == hiddens + config.num_layers * block + head);
  // Two blocks (the first two of the chunk), then all four: the head, which computes the loss,
  // and the embedding, which keeps nothing, never recompute.
  for (const int layers : {2, 4, all_layers}) {
    CAPTURE(layers);
    const auto [run, recomputed, slot, buffer, peak] = trained(layers);
    const int expected = layers == 2 ? 2 : static_cast<int>(config.num_layers);
    CHECK(recomputed == expected);
    CHECK(slot == hiddens + (config.num_layers - expected) * block + head);
    CHECK(buffer == block + hidden);
    CHECK(peak < stored_peak);
    // The same model, bit for bit, with dropout on.
    CHECK(run.losses == stored.losses);
    CHECK(run.grad_norms == stored.grad_norms);
    CHECK(run.weights == stored.weights);
  }
}

TEST_CASE("recomputing every layer trains the same GPT-2, bit for bit, on every mesh and schedule") {
  using Gpt = gpt2::Model<cpu, float>;
  for (AttentionStorage storage : {AttentionStorage::stored, AttentionStorage::recompute}) {
    CAPTURE(storage);
    const auto make = [&](CommunicatorRef tp) { return Gpt(recompute_gpt2_config(), tp, storage); };
    const auto steps = [](auto& trainer) { return train_steps(trainer, global_batch, seq); };
    check_same_bits<Gpt, GradientAccumulation, Zero<1>>({.dp = 2, .tp = 2, .pp = 1}, make, steps);
    check_same_bits<Gpt, GradientAccumulation, Zero<3>>({.dp = 4, .tp = 1, .pp = 1}, make, steps);
    check_same_bits<Gpt, OneFOneB, DataParallel>({.dp = 2, .tp = 2, .pp = 2}, make, steps);
    check_same_bits<Gpt, GPipe, Zero<1>>({.dp = 1, .tp = 1, .pp = 4}, make, steps);
    check_same_bits<Gpt, Interleaved1F1B, DataParallel>({.dp = 1, .tp = 2, .pp = 2}, make, steps);
  }
}

TEST_CASE("recomputing every layer trains the same BERT, bit for bit, embedding included") {
  using Bert = bert::Model<cpu, float>;
  const auto make = [](CommunicatorRef tp) { return Bert(recompute_bert_config(), tp); };
  const auto steps = [](auto& trainer) { return masked_lm_steps(trainer, global_batch, seq); };
  check_same_bits<Bert, GradientAccumulation, Zero<2>>({.dp = 2, .tp = 2, .pp = 1}, make, steps);
  check_same_bits<Bert, OneFOneB, DataParallel>({.dp = 1, .tp = 2, .pp = 2}, make, steps);
  // BERT's embedding keeps its layernorm's activations, so it recomputes too.
  cpu be(1);
  const Bert model(recompute_bert_config());
  Trainer<Bert, AdamW> trainer(be, Bert(recompute_bert_config()), AdamW(), ConstantLr{1e-3}, options(2, 1));
  trainer.step(masked_test_source().batch_at(0, 2, seq));
  CHECK(trainer.recomputed_layers() == 1);
  CHECK(trainer.recompute_elements() == model.activation_elements(0, {2, seq}) + model.hidden_elements({2, seq}));
}

TEST_CASE("recompute_layers is refused before step 1 under a split backward and when negative") {
  using Gpt = gpt2::Model<cpu, float>;
  const auto refusal = [](auto make_trainer) -> std::string {
    try {
      make_trainer();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  const std::string zero_bubble = refusal([] {
    threads::run(2, [](threads::Communicator& world) {
      Mesh<threads::Communicator> mesh(world, {.dp = 1, .tp = 1, .pp = 2});
      cpu be(1);
      Trainer<Gpt, AdamW, ZeroBubbleH1> trainer(be, mesh, Gpt(recompute_gpt2_config()), AdamW(),
                                                ConstantLr{1e-3}, options(1, 1));
    });
  });
  CHECK(zero_bubble.find("recompute_layers") != std::string::npos);
  CHECK(zero_bubble.find("ZeroBubbleH1") != std::string::npos);
  const std::string negative = refusal([] {
    cpu be(1);
    Trainer<Gpt, AdamW> trainer(be, Gpt(recompute_gpt2_config()), AdamW(), ConstantLr{1e-3}, options(1, -1));
  });
  CHECK(negative.find("recompute_layers") != std::string::npos);
  CHECK(negative.find("-1") != std::string::npos);
}

namespace {

//! A GPT-2 and a BERT config for gradient checks (N = 2 x 5 = 10 rows: chunks of 3, 3, 3, 1).
gpt2::Config small_gpt2(std::int64_t chunk_rows) {
  return {.max_seq_len = 6, .vocab_size = 11, .padded_vocab_size = 12, .num_layers = 2, .num_heads = 2,
          .channels = 8, .logits_chunk_rows = chunk_rows};
}
bert::Config small_bert(std::int64_t chunk_rows) {
  return {.max_seq_len = 6, .vocab_size = 11, .padded_vocab_size = 12, .num_layers = 2, .num_heads = 2,
          .channels = 8, .logits_chunk_rows = chunk_rows};
}
auto small_masked_source() {
  return io::MaskedLm(io::SyntheticMarkov({.vocab_size = 10, .seed = 3}), {.select_probability = 0.4});
}

}  // namespace

TEST_CASE("a head with chunked logits: gradients match central differences in double, combined and split") {
  for (const std::int64_t chunk : {3, 10, 64}) {
    CAPTURE(chunk);
    const gpt2::Model<cpu, double> gpt(small_gpt2(chunk));
    const bert::Model<cpu, double> bert(small_bert(chunk));
    check_model_gradient(gpt, noisy_parameters<double>(gpt.layout()), make_batch(0, 2, 5, 11));
    check_model_gradient(bert, noisy_parameters<double>(bert.layout()), small_masked_source().batch_at(0, 2, 5));
    // The split backward (the head's input pass adds the unembedding's gradient) gives the bits of
    // the combined one.
    cpu be(1);
    const auto same_bits = [&](const auto& model, const auto& batch) {
      const std::vector<double> params = noisy_parameters<double>(model.layout());
      std::vector<double> combined, split;
      const double loss = loss_and_gradient(model, be, params, batch, &combined, Pass::combined);
      CHECK(loss_and_gradient(model, be, params, batch, &split, Pass::split) == loss);
      CHECK(std::memcmp(combined.data(), split.data(), combined.size() * sizeof(double)) == 0);
    };
    same_bits(gpt, make_batch(1, 2, 5, 11));
    same_bits(bert, small_masked_source().batch_at(1, 2, 5));
  }
}

TEST_CASE("a head with chunked logits keeps its 3 doubles a row but not the logits' exps, and computes their loss") {
  cpu be(2);
  const MicroBatchShape s{2, seq};
  const std::int64_t N = s.batch * s.seq;
  const auto compare = [&](const auto& stored, const auto& chunked, const auto& batch, std::int64_t head) {
    using T = typename std::decay_t<decltype(stored)>::scalar_type;
    const std::int64_t V = stored.config().padded_vocab_size;
    // Both keep each row's statistics (the unchunked head's backward normalises its exps with
    // them); the stored head also the scale of the gradient its forward may write (a double).
    CHECK(stored.activation_elements(static_cast<int>(head), s) - chunked.activation_elements(static_cast<int>(head), s) ==
          N * V + static_cast<std::int64_t>(sizeof(double) / sizeof(T)));
    const std::vector<T> params = noisy_parameters<T>(stored.layout());
    std::vector<T> expected, got;
    const double loss = loss_and_gradient(stored, be, params, batch, &expected);
    CHECK(std::abs(loss_and_gradient(chunked, be, params, batch, &got) - loss) <= 1e-6 * loss);
    CHECK(relative_difference(got.data(), expected.data(), static_cast<std::int64_t>(got.size())) < 1e-5);
  };
  gpt2::Config gpt = small_test_config();
  bert::Config bert = bert_test_config();
  gpt.logits_chunk_rows = bert.logits_chunk_rows = 7;  // 32 rows: 4 chunks of 7 and one of 4
  compare(gpt2::Model<cpu, float>(small_test_config()), gpt2::Model<cpu, float>(gpt), make_batch(0, 2, seq, 50),
          gpt2::head_layer(gpt));
  compare(bert::Model<cpu, float>(bert_test_config()), bert::Model<cpu, float>(bert),
          masked_test_source().batch_at(0, 2, seq), bert::head_layer(bert));

  // Given the layer's workspace (as the Trainer gives it), the forward computes the chunks there
  // and allocates nothing; without one, it allocates one chunk's logits.
  cpu fresh(1);
  const gpt2::Model<cpu, float> model(gpt);
  const int head = gpt2::head_layer(gpt);
  const TestBatch batch = make_batch(0, 2, seq, 50);
  std::vector<float> params = noisy_parameters<float>(model.layout());
  std::vector<float> input(static_cast<std::size_t>(model.hidden_elements(s)), 0.5f);
  std::vector<float> saved(static_cast<std::size_t>(model.activation_elements(head, s)));
  std::vector<float> workspace(static_cast<std::size_t>(model.workspace_elements(head, s)));
  const auto head_loss = [&](Tensor<float> scratch) {
    return model.forward(fresh, head, ParameterView<const float>(params.data()),
                         {.tokens = batch.tokens_view(),
                          .targets = batch.targets_view(),
                          .input = Tensor<const float>(input.data(), {2, seq, gpt.channels}),
                          .output = {},  // the head's forward ends in the loss
                          .saved = flat(saved),
                          .workspace = scratch});
  };
  const double in_workspace = head_loss(flat(workspace));
  CHECK(fresh.memory().peak(MemoryCategory::workspace) == 0);
  CHECK(head_loss({}) == in_workspace);
  CHECK(fresh.memory().peak(MemoryCategory::workspace) == 7 * gpt.padded_vocab_size * std::int64_t{sizeof(float)});
}

TEST_CASE("a head told its backward's loss scale gives the loss and gradients of one that is not, bit for bit") {
  // Told (ForwardArgs::loss_scale, as the Trainer tells it), a head on one rank writes the
  // gradient of its logits over them as it computes the loss (cross_entropy_forward_backward);
  // not told, the backward computes it from the logits and their statistics. Combined and split
  // backward, float and bf16, GPT-2 and BERT; the chunked head, which keeps no logits, alike.
  cpu be(2);
  const auto compare = [&](const auto& model, const auto& batch) {
    using T = typename std::decay_t<decltype(model)>::scalar_type;
    const std::vector<float> noisy = noisy_parameters<float>(model.layout());
    std::vector<T> params(noisy.size());
    for (std::size_t i = 0; i < noisy.size(); ++i) params[i] = static_cast<T>(noisy[i]);
    for (const Pass pass : {Pass::combined, Pass::split}) {
      CAPTURE(pass == Pass::split);
      std::vector<T> told, untold;
      const double told_loss = loss_and_gradient(model, be, params, batch, &told, pass, {}, Announce::backward);
      const double untold_loss = loss_and_gradient(model, be, params, batch, &untold, pass, {}, Announce::nothing);
      CHECK(told_loss == untold_loss);
      CHECK(told == untold);
    }
  };
  gpt2::Config chunked = small_test_config();
  chunked.logits_chunk_rows = 7;
  const TestBatch batch = make_batch(0, 2, seq, 50);
  compare(gpt2::Model<cpu, float>(small_test_config()), batch);
  compare(gpt2::Model<cpu, bf16>(small_test_config()), batch);
  compare(gpt2::Model<cpu, float>(chunked), batch);
  compare(bert::Model<cpu, float>(bert_test_config()), masked_test_source().batch_at(0, 2, seq));
  compare(bert::Model<cpu, bf16>(bert_test_config()), masked_test_source().batch_at(0, 2, seq));
}

TEST_CASE("a head with chunked logits trains as one rank on meshes, and with every layer recomputed") {
  using Gpt = gpt2::Model<cpu, float>;
  using Bert = bert::Model<cpu, float>;
  gpt2::Config gpt = recompute_gpt2_config();
  bert::Config bert = recompute_bert_config();
  gpt.logits_chunk_rows = bert.logits_chunk_rows = 5;
  const auto make_gpt = [&](CommunicatorRef tp) { return Gpt(gpt, tp); };
  const auto make_bert = [&](CommunicatorRef tp) { return Bert(bert, tp); };
  const auto gpt_steps = [](auto& trainer) { return train_steps(trainer, global_batch, seq); };
  const auto bert_steps = [](auto& trainer) { return masked_lm_steps(trainer, global_batch, seq); };
  // One rank, the whole batch in one micro-batch.
  const auto one_rank = [](auto model, auto&& steps) {
    cpu be(1);
    Trainer<decltype(model), AdamW> trainer(be, std::move(model), AdamW({.weight_decay = 0.1}), parity_lr(),
                                            options(global_batch, 0));
    return steps(trainer);
  };
  const ParityRun gpt_reference = one_rank(Gpt(gpt), gpt_steps), bert_reference = one_rank(Bert(bert), bert_steps);
  // Against the one-rank run of the stored head: the same model to rounding.
  const ParityRun stored = one_rank(Gpt(recompute_gpt2_config()), gpt_steps);
  for (std::size_t k = 0; k < stored.losses.size(); ++k)
    CHECK(std::abs(gpt_reference.losses[k] - stored.losses[k]) <= 1e-5 * stored.losses[k]);
  const auto parity = [](const std::vector<RankRun>& runs, const ParityRun& reference) {
    for (std::size_t r = 0; r < runs.size(); ++r) {
      CAPTURE(r);
      for (std::size_t k = 0; k < reference.losses.size(); ++k)
        CHECK(std::abs(runs[r].run.losses[k] - reference.losses[k]) <= 1e-5 * reference.losses[k]);
    }
  };
  // Vocabulary-parallel chunks (their statistics cross the group chunk by chunk), a zero-bubble
  // pipeline (the head's input pass adds dwte), and all layers recomputed on top.
  parity(mesh_runs<Gpt, GradientAccumulation, Zero<1>>({.dp = 2, .tp = 2, .pp = 1}, 0, make_gpt, gpt_steps),
         gpt_reference);
  parity(mesh_runs<Gpt, ZeroBubbleH1, DataParallel>({.dp = 1, .tp = 2, .pp = 2}, 0, make_gpt, gpt_steps),
         gpt_reference);
  parity(mesh_runs<Bert, ZeroBubbleH1, DataParallel>({.dp = 2, .tp = 2, .pp = 2}, 0, make_bert, bert_steps),
         bert_reference);
  check_same_bits<Gpt, OneFOneB, DataParallel>({.dp = 1, .tp = 2, .pp = 2}, make_gpt, gpt_steps);
}

}  // namespace test_recompute
