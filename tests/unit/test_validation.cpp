// validation_loss: the held-out loss is the mean over every target of every batch (as one batch
// holding them all gives), it is the same on every mesh (ZeRO-3 included) as on one rank, it
// changes nothing, and batches without targets are skipped or refused.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/io/padded.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"
#include "support/error_of.hpp"
#include "support/training.hpp"

namespace test_validation {

using namespace loom;
using namespace loom::test;

namespace {

using Gpt = gpt2::Model<cpu, double>;

constexpr std::int64_t batch_size = 4, seq = 12;

//! Padded rows of drawn lengths: the batches carry different numbers of targets.
io::Padded<io::SyntheticMarkov> held_out() {
  return io::Padded(io::SyntheticMarkov({.vocab_size = small_test_config().vocab_size, .seed = 5}),
                    {.min_length = 2, .pad_token = 0, .seed = 17});
}

//! The sequences of `batches` batches from `first` as one batch.
io::Batch concatenated(const io::Padded<io::SyntheticMarkov>& source, std::int64_t first, std::int64_t batches) {
  io::Batch all = io::Batch::zeros(0, seq);
  for (std::int64_t i = 0; i < batches; ++i) {
    const io::Batch b = source.batch_at(first + i, batch_size, seq);
    all.batch += b.batch;
    all.tokens.insert(all.tokens.end(), b.tokens.begin(), b.tokens.end());
    all.targets.insert(all.targets.end(), b.targets.begin(), b.targets.end());
    all.lengths.insert(all.lengths.end(), b.lengths.begin(), b.lengths.end());
  }
  return all;
}

TrainerOptions options() { return {.micro_batch_size = 2, .seed = 4}; }

//! A source whose even batches have no targets at all.
struct SometimesEmpty {
  io::Padded<io::SyntheticMarkov> inner = held_out();
  std::int64_t vocab_size() const { return inner.vocab_size(); }
  io::Batch batch_at(std::int64_t step, std::int64_t batch, std::int64_t s) const {
    io::Batch b = inner.batch_at(step, batch, s);
    if (step % 2 == 0) std::fill(b.targets.begin(), b.targets.end(), -1);
    return b;
  }
};

}  // namespace

TEST_CASE("validation_loss is the mean over every target of its batches, as one batch holding them gives") {
  const auto source = held_out();
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(small_test_config()), AdamW(), ConstantLr{}, options());
  const io::Batch all = concatenated(source, 7, 3);
  const ValidationLoss v = validation_loss(trainer, source, {.first = 7, .batches = 3, .batch = batch_size, .seq = seq});
  CHECK(v.batches == 3);
  CHECK(v.targets == all.target_count());
  // The batches' target counts differ, so an unweighted mean of their losses would not match.
  std::vector<std::int64_t> counts;
  for (std::int64_t i = 0; i < 3; ++i) counts.push_back(source.batch_at(7 + i, batch_size, seq).target_count());
  CHECK((counts[0] != counts[1] || counts[1] != counts[2]));
  CHECK(v.loss == doctest::Approx(trainer.evaluate(all)).epsilon(1e-12));
  CHECK(v.perplexity() == doctest::Approx(std::exp(v.loss)));
  // An untrained model predicts about uniformly over the padded vocabulary.
  CHECK(v.loss == doctest::Approx(std::log(double(small_test_config().padded_vocab_size))).epsilon(0.1));
}

TEST_CASE("validation_loss changes nothing: the next step is the step of a trainer that never validated") {
  const auto source = held_out();
  const TestBatch train = make_batch(0, batch_size, seq, small_test_config().vocab_size);
  cpu be(1);
  Trainer<Gpt, AdamW> validated(be, Gpt(small_test_config()), AdamW(), ConstantLr{}, options());
  Trainer<Gpt, AdamW> plain(be, Gpt(small_test_config()), AdamW(), ConstantLr{}, options());
  const ValidationOptions opts{.first = 0, .batches = 2, .batch = batch_size, .seq = seq};
  const ValidationLoss before = validation_loss(validated, source, opts);
  CHECK(validated.steps() == 0);
  CHECK(validated.step(train).loss == plain.step(train).loss);
  CHECK(validated.steps() == 1);
  CHECK(validated.gather_parameters() == plain.gather_parameters());
  // The same batches again, after a step: a different model, the same targets.
  const ValidationLoss after = validation_loss(validated, source, opts);
  CHECK(after.targets == before.targets);
  CHECK(after.loss != before.loss);
  CHECK(after.loss == validation_loss(plain, source, opts).loss);
}

TEST_CASE("validation_loss on DP x TP x PP meshes: every rank gets one rank's loss") {
  const auto source = held_out();
  const ValidationOptions opts{.first = 3, .batches = 2, .batch = batch_size, .seq = seq};
  cpu be(1);
  Trainer<Gpt, AdamW> one(be, Gpt(small_test_config()), AdamW(), ConstantLr{}, {.micro_batch_size = 1, .seed = 4});
  const ValidationLoss want = validation_loss(one, source, opts);
  const auto check = [&]<class S, class Strategy = DataParallel>(MeshShape shape, S schedule, Strategy strategy = {}) {
    CAPTURE(shape);
    std::vector<ValidationLoss> got(static_cast<std::size_t>(shape.size()));
    threads::run(shape.size(), [&](threads::Communicator& world) {
      Mesh<threads::Communicator> mesh(world, shape);
      cpu rank_be(1);
      Trainer<Gpt, AdamW, S, Strategy> trainer(rank_be, mesh, Gpt(small_test_config(), mesh.tensor_parallel()),
                                               AdamW(), ConstantLr{}, {.micro_batch_size = 1, .seed = 4}, strategy,
                                               schedule);
      got[static_cast<std::size_t>(world.rank())] = validation_loss(trainer, source, opts);
    });
    for (const ValidationLoss& v : got) {
      CHECK(v.targets == want.targets);
      CHECK(v.batches == want.batches);
      CHECK(v.loss == doctest::Approx(want.loss).epsilon(1e-12));
    }
  };
  check(MeshShape{.dp = 2, .tp = 2, .pp = 1}, GradientAccumulation{});
  check(MeshShape{.dp = 2, .tp = 1, .pp = 2}, OneFOneB{});
  check(MeshShape{.dp = 1, .tp = 2, .pp = 2}, GPipe{});
  // ZeRO-3 gathers each layer's parameters for the forward passes too.
  check(MeshShape{.dp = 2, .tp = 2, .pp = 1}, GradientAccumulation{}, Zero<3>{});
}

TEST_CASE("batches without targets: skipped by validation_loss on every rank, refused alone") {
  const SometimesEmpty source;
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(small_test_config()), AdamW(), ConstantLr{}, options());

  const ValidationLoss v = validation_loss(trainer, source, {.first = 0, .batches = 4, .batch = batch_size, .seq = seq});
  CHECK(v.batches == 2);
  const io::Batch b1 = source.batch_at(1, batch_size, seq), b3 = source.batch_at(3, batch_size, seq);
  CHECK(v.targets == b1.target_count() + b3.target_count());
  CHECK(v.loss == doctest::Approx((trainer.evaluate(b1) * double(b1.target_count()) +
                                   trainer.evaluate(b3) * double(b3.target_count())) /
                                  double(v.targets))
                      .epsilon(1e-12));

  const std::string none = error_of([&] {
    (void)validation_loss(trainer, source, {.first = 2, .batches = 1, .batch = batch_size, .seq = seq});
  });
  CHECK(contains(none, "validation: targets: got 0"));
  CHECK(contains(none, "the 1 batch(es) from index 2 need at least one target"));
  CHECK(contains(error_of([&] { (void)trainer.evaluate(source.batch_at(0, batch_size, seq)); }),
                 "trainer evaluate: target tokens: got 0"));
  // Across ranks, too: every rank skips the same batches, so none waits for another.
  std::vector<ValidationLoss> got(2);
  threads::run(2, [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, {.dp = 2, .tp = 1, .pp = 1});
    cpu rank_be(1);
    Trainer<Gpt, AdamW, GradientAccumulation, DataParallel> ranks(rank_be, mesh, Gpt(small_test_config()), AdamW(),
                                                                  ConstantLr{}, options());
    got[static_cast<std::size_t>(world.rank())] =
        validation_loss(ranks, source, {.first = 0, .batches = 4, .batch = batch_size, .seq = seq});
  });
  for (const ValidationLoss& r : got) CHECK(r.loss == doctest::Approx(v.loss).epsilon(1e-12));
}

TEST_CASE("validation options out of range are refused, naming the value") {
  const auto source = held_out();
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(small_test_config()), AdamW(), ConstantLr{}, options());
  const auto message = [&](ValidationOptions o) { return error_of([&] { (void)validation_loss(trainer, source, o); }); };
  CHECK(contains(message({.first = 0, .batches = 0, .batch = 4, .seq = seq}), "validation: batches: got 0; must be >= 1"));
  CHECK(contains(message({.first = -1, .batches = 1, .batch = 4, .seq = seq}), "validation: first: got -1; must be >= 0"));
  CHECK(contains(message({.first = 0, .batches = 1, .batch = 0, .seq = seq}), "validation: batch: got 0; must be >= 1"));
  CHECK(contains(message({.first = 0, .batches = 1, .batch = 4, .seq = 0}), "validation: seq: got 0; must be >= 1"));
}

}  // namespace test_validation
