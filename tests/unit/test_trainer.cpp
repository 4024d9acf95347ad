// The Trainer on one rank: gradient accumulation parity, a whole-model gradient check in double,
// clipping, the loss definition, memory accounting and rejected inputs.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/io/padded.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"
#include "support/training.hpp"

namespace test_trainer {

using namespace loom;
using namespace loom::test;

namespace {

template <class T>
struct Run {
  std::vector<double> losses;
  std::vector<T> weights;
};

template <class T>
Run<T> train(std::int64_t micro_batch, double clip, int steps = 5) {
  cpu be(2);
  const gpt2::Config c = small_test_config();
  Trainer<gpt2::Model<cpu, T>, AdamW> trainer(
      be, gpt2::Model<cpu, T>(c), AdamW({.weight_decay = 0.1}),
      WarmupCosineLr{.lr = 1e-2, .warmup = 2, .total_steps = steps, .min_lr_factor = 0.1},
      {.micro_batch_size = micro_batch, .clip_grad_norm = clip, .seed = 5});
  Run<T> run;
  for (int s = 0; s < steps; ++s) run.losses.push_back(trainer.step(make_batch(s, 4, 16, c.vocab_size)).loss);
  run.weights.assign(trainer.parameters(), trainer.parameters() + trainer.model().layout().total());
  return run;
}

template <class T>
void check_accumulation_parity(double tolerance, double clip) {
  const Run<T> reference = train<T>(4, clip);
  for (std::int64_t micro : {1, 2}) {
    CAPTURE(micro);
    const Run<T> run = train<T>(micro, clip);
    for (std::size_t s = 0; s < run.losses.size(); ++s) {
      CAPTURE(s);
      CHECK(std::abs(run.losses[s] - reference.losses[s]) <= tolerance * std::abs(reference.losses[s]));
    }
    CHECK(relative_difference(run.weights.data(), reference.weights.data(),
                              static_cast<std::int64_t>(run.weights.size())) <= tolerance);
  }
}

}  // namespace

TEST_CASE("micro-batches 1, 2, 4 with accumulation 4, 2, 1 train the same weights (float)") {
  check_accumulation_parity<float>(1e-5, 0.0);
}

TEST_CASE("micro-batches 1, 2, 4 with accumulation 4, 2, 1 train the same weights (double)") {
  check_accumulation_parity<double>(1e-12, 0.0);
}

TEST_CASE("accumulation parity holds with gradient clipping") {
  check_accumulation_parity<float>(1e-5, 0.05);
}

namespace {

//! Scales a double trainer's matrices by 20 (so that attention is far from uniform and every
//! path carries a gradient well above finite-difference noise), takes a step at lr 0 on `batch`
//! and checks a few elements of every parameter's gradient (wte's padded rows included) against
//! central differences of evaluate(); returns the worst relative error.
template <class Trainer, class Batch>
double check_gradient_by_differences(Trainer& trainer, const Batch& batch) {
  double* params = trainer.mutable_parameters();
  const ParameterLayout& layout = trainer.model().layout();
  for (const auto& e : layout.entries())
    if (e.spec.shape.rank() == 2)
      for (std::int64_t i = 0; i < e.numel(); ++i) params[e.offset + i] *= 20;
  trainer.step(batch);
  const double* grads = trainer.gradients();
  double worst = 0;
  for (const auto& e : layout.entries()) {
    for (std::int64_t i = 0; i < e.numel(); i += std::max<std::int64_t>(1, e.numel() / 7)) {
      double& p = params[e.offset + i];
      const double saved = p, eps = 1e-5;
      p = saved + eps;
      const double up = trainer.evaluate(batch);
      p = saved - eps;
      const double down = trainer.evaluate(batch);
      p = saved;
      const double numeric = (up - down) / (2 * eps), analytic = grads[e.offset + i];
      CAPTURE(e.spec.name);
      CAPTURE(i);
      CAPTURE(numeric);
      CAPTURE(analytic);
      // Relative error, with an absolute floor above the finite differences' round-off.
      const double err = std::abs(numeric - analytic) / std::max({std::abs(numeric), std::abs(analytic), 1e-4});
      CHECK(err < 1e-6);
      worst = std::max(worst, err);
    }
  }
  return worst;
}

}  // namespace

TEST_CASE("whole-model gradient check in double against finite differences, either GELU") {
  for (const Gelu gelu : {Gelu::tanh, Gelu::erf}) {
    CAPTURE(std::string(gelu_name(gelu)));
    cpu be(1);
    const gpt2::Config c{.max_seq_len = 5, .vocab_size = 11, .padded_vocab_size = 16, .num_layers = 2,
                         .num_heads = 2, .channels = 8, .gelu = gelu};
    // lr 0: the step computes gradients and leaves the weights where they are.
    Trainer<gpt2::Model<cpu, double>, SgdMomentum> trainer(be, gpt2::Model<cpu, double>(c),
                                                           SgdMomentum({.momentum = 0.0}),
                                                           ConstantLr{.lr = 0.0}, {.micro_batch_size = 1});
    TestBatch batch = make_batch(0, 2, 5, c.vocab_size);
    batch.targets[3] = -1;  // an ignored target takes no part in the loss
    const double worst = check_gradient_by_differences(trainer, batch);
    MESSAGE("worst relative gradient error (" << std::string(gelu_name(gelu)) << " GELU): " << worst);
    // Padded vocabulary rows get no gradient.
    const auto& wte = trainer.model().layout().find("wte");
    const double* grads = trainer.gradients();
    for (std::int64_t i = c.vocab_size * c.channels; i < wte.numel(); ++i) CHECK(grads[wte.offset + i] == 0.0);
  }
}

TEST_CASE("the loss is the mean over the global batch's target tokens; init is near ln(vocab)") {
  cpu be(1);
  const gpt2::Config c = small_test_config();
  Trainer<gpt2::Model<cpu, double>, AdamW> trainer(be, gpt2::Model<cpu, double>(c), AdamW(),
                                                   ConstantLr{.lr = 0.0}, {.micro_batch_size = 1});
  TestBatch batch = make_batch(0, 2, 8, c.vocab_size);
  const double full = trainer.evaluate(batch);
  CHECK(std::abs(full - std::log(50.0)) < 0.1);
  // Ignoring every target of the second sequence leaves the mean over the first one's tokens.
  TestBatch first{1, 8, {batch.tokens.begin(), batch.tokens.begin() + 8},
                  {batch.targets.begin(), batch.targets.begin() + 8}};
  TestBatch masked = batch;
  for (int i = 8; i < 16; ++i) masked.targets[i] = -1;
  CHECK(trainer.evaluate(masked) == doctest::Approx(trainer.evaluate(first)).epsilon(1e-13));
}

TEST_CASE("padded vocabulary rows never reach the loss") {
  cpu be(1);
  const gpt2::Config c = small_test_config();
  Trainer<gpt2::Model<cpu, double>, AdamW> trainer(be, gpt2::Model<cpu, double>(c), AdamW(),
                                                   ConstantLr{.lr = 0.0}, {.micro_batch_size = 2});
  const TestBatch batch = make_batch(1, 2, 8, c.vocab_size);
  const double before = trainer.evaluate(batch);
  const auto& wte = trainer.model().layout().find("wte");
  for (std::int64_t i = c.vocab_size * c.channels; i < wte.numel(); ++i)
    trainer.mutable_parameters()[wte.offset + i] = 1e3;
  CHECK(trainer.evaluate(batch) == before);
}

TEST_CASE("clipping scales the gradient to the clip norm; the metric reports the norm before") {
  cpu be(1);
  const gpt2::Config c = small_test_config();
  Trainer<gpt2::Model<cpu, double>, AdamW> trainer(be, gpt2::Model<cpu, double>(c), AdamW(),
                                                   ConstantLr{.lr = 1e-3},
                                                   {.micro_batch_size = 2, .clip_grad_norm = 0.01});
  const StepMetrics m = trainer.step(make_batch(0, 4, 16, c.vocab_size));
  CHECK(m.grad_norm > 0.01);
  double sum = 0;
  for (std::int64_t i = 0; i < trainer.model().layout().total(); ++i)
    sum += trainer.gradients()[i] * trainer.gradients()[i];
  CHECK(std::sqrt(sum) == doctest::Approx(0.01).epsilon(1e-6));
}

TEST_CASE("training lowers the loss on a learnable stream") {
  cpu be(2);
  const gpt2::Config c = small_test_config();
  Trainer<gpt2::Model<cpu, float>, AdamW> trainer(be, gpt2::Model<cpu, float>(c), AdamW(),
                                                  ConstantLr{.lr = 1e-2}, {.micro_batch_size = 8});
  const double first = trainer.step(make_batch(0, 8, 16, c.vocab_size)).loss;
  double last = first;
  for (int s = 1; s < 60; ++s) last = trainer.step(make_batch(s, 8, 16, c.vocab_size)).loss;
  MESSAGE("loss " << first << " -> " << last);
  CHECK(last < 0.6 * first);
}

TEST_CASE("memory report: parameters, gradients and AdamW state are 4 + 4 + 8 bytes per element") {
  cpu be(1);
  const gpt2::Config c = small_test_config();
  Trainer<gpt2::Model<cpu, float>, AdamW> trainer(be, gpt2::Model<cpu, float>(c), AdamW(),
                                                  ConstantLr{.lr = 1e-3}, {.micro_batch_size = 2});
  const auto n = static_cast<std::size_t>(c.stored_parameter_count());
  CHECK(trainer.memory().current(MemoryCategory::parameters) == 4 * n);
  CHECK(trainer.memory().current(MemoryCategory::gradients) == 4 * n);
  CHECK(trainer.memory().current(MemoryCategory::optimizer_state) == 8 * n);
  CHECK(trainer.memory().current(MemoryCategory::activations) == 0);
  trainer.step(make_batch(0, 4, 16, c.vocab_size));
  // One micro-batch of activations: the saved state of every layer, each range starting 16-byte
  // aligned (4 floats), and the hidden states.
  const gpt2::Model<cpu, float>& m = trainer.model();
  std::int64_t expected = 0;
  const MicroBatchShape shape{2, 16};
  for (int l = 0; l < m.num_layers(); ++l) expected += (m.activation_elements(l, shape) + 3) / 4 * 4;
  expected += (m.num_layers() - 1) * m.hidden_elements(shape);
  CHECK(trainer.memory().current(MemoryCategory::activations) == 4 * static_cast<std::size_t>(expected));
}

TEST_CASE("bad batches are rejected before any work, naming the value") {
  cpu be(1);
  const gpt2::Config c = small_test_config();
  Trainer<gpt2::Model<cpu, float>, AdamW> trainer(be, gpt2::Model<cpu, float>(c), AdamW(),
                                                  ConstantLr{.lr = 1e-3}, {.micro_batch_size = 3});
  CHECK_THROWS_WITH_AS(trainer.step(make_batch(0, 4, 8, c.vocab_size)),
                       doctest::Contains("global batch size: got 4; must be a multiple of micro_batch_size (3)"),
                       Error);
  Trainer<gpt2::Model<cpu, float>, AdamW> t2(be, gpt2::Model<cpu, float>(c), AdamW(),
                                             ConstantLr{.lr = 1e-3}, {.micro_batch_size = 1});
  CHECK_THROWS_WITH_AS(t2.step(make_batch(0, 1, 17, c.vocab_size)), doctest::Contains("sequence length: got 17"),
                       Error);
  TestBatch bad = make_batch(0, 1, 8, c.vocab_size);
  bad.tokens[2] = 50;
  CHECK_THROWS_AS(t2.step(bad), Error);
  CHECK(t2.steps() == 0);
  CHECK_THROWS_AS((Trainer<gpt2::Model<cpu, float>, AdamW>(be, gpt2::Model<cpu, float>(c), AdamW(),
                                                           ConstantLr{}, {.micro_batch_size = 0})),
                  Error);
}

TEST_CASE("the Trainer runs every schedule on one stage with gradient accumulation's result") {
  // On one stage GPipe keeps every micro-batch's activations, ZB-H1 splits each backward into
  // input- and weight-gradient passes, and interleaving runs two chunks whose messages stay on
  // the rank: the gradients are the same sums.
  cpu be(1);
  const gpt2::Config c = small_test_config();
  using Gpt = gpt2::Model<cpu, float>;
  const TestBatch batch = make_batch(0, 4, 8, c.vocab_size);
  Trainer<Gpt, AdamW> accumulate(be, Gpt(c), AdamW(), ConstantLr{.lr = 1e-3}, {.micro_batch_size = 1});
  const double loss = accumulate.step(batch).loss;
  const auto check = [&](auto& trainer, std::int64_t slots) {
    CHECK(trainer.step(batch).loss == doctest::Approx(loss).epsilon(1e-6));
    CHECK(relative_difference(trainer.parameters(), accumulate.parameters(), trainer.model().layout().total()) < 1e-6);
    CHECK(trainer.activation_slots() == slots);
  };
  Trainer<Gpt, AdamW, GPipe> gpipe(be, Gpt(c), AdamW(), ConstantLr{.lr = 1e-3}, {.micro_batch_size = 1});
  check(gpipe, 4);
  Trainer<Gpt, AdamW, ZeroBubbleH1> zero_bubble(be, Gpt(c), AdamW(), ConstantLr{.lr = 1e-3}, {.micro_batch_size = 1});
  check(zero_bubble, 1);
  Trainer<Gpt, AdamW, Interleaved1F1B> interleaved(be, Gpt(c), AdamW(), ConstantLr{.lr = 1e-3}, {.micro_batch_size = 1},
                                                   SingleRank{}, Interleaved1F1B{.virtual_stages = 2});
  check(interleaved, 2);
  CHECK(interleaved.stage().chunks() == 2);
}

namespace {

//! The CPU backend dressed as one whose memory the host may not touch (host_addressable is
//! false), counting the bytes it is given from the host: the Trainer must copy the batch into
//! it, and the model must not read tokens on the host.
class device_like_cpu : public cpu {
 public:
  static constexpr bool device_memory = true;
  using cpu::cpu;
  void copy_from_host(void* dst, const void* src, std::size_t bytes) {
    bytes_from_host += bytes;
    cpu::copy_from_host(dst, src, bytes);
  }
  std::size_t bytes_from_host = 0;
};
static_assert(Backend<device_like_cpu> && !host_addressable<device_like_cpu> && host_addressable<cpu>);

}  // namespace

TEST_CASE("a backend with device memory gets each batch copied in, checked on the host first, with the same result") {
  const gpt2::Config c = small_test_config();
  cpu host(1);
  device_like_cpu device(1);
  Trainer<gpt2::Model<cpu, float>, AdamW> on_host(host, gpt2::Model<cpu, float>(c), AdamW(), ConstantLr{.lr = 1e-3},
                                                  {.micro_batch_size = 2});
  Trainer<gpt2::Model<device_like_cpu, float>, AdamW> on_device(device, gpt2::Model<device_like_cpu, float>(c), AdamW(),
                                                                ConstantLr{.lr = 1e-3}, {.micro_batch_size = 2});
  for (int s = 0; s < 2; ++s) {
    const TestBatch batch = make_batch(s, 4, 8, c.vocab_size);
    const std::size_t before = device.bytes_from_host;
    CHECK(on_device.step(batch).loss == on_host.step(batch).loss);
    // Tokens and targets, 4 bytes each, once a step (AdamW's state is zeroed, not copied).
    CHECK(device.bytes_from_host - before == 2 * 4 * 8 * sizeof(std::int32_t));
  }
  CHECK(relative_difference(on_device.parameters(), on_host.parameters(), on_host.model().layout().total()) == 0.0);
  CHECK(on_device.evaluate(make_batch(5, 4, 8, c.vocab_size)) == on_host.evaluate(make_batch(5, 4, 8, c.vocab_size)));
  // The values are checked on the host before the copy, since the kernels cannot check them.
  TestBatch bad = make_batch(0, 4, 8, c.vocab_size);
  bad.tokens[9] = -1;
  CHECK_THROWS_WITH_AS(on_device.step(bad), doctest::Contains("gpt2 forward: token at position 9: got -1"), Error);
  bad = make_batch(0, 4, 8, c.vocab_size);
  bad.targets[3] = 50;
  CHECK_THROWS_WITH_AS(on_device.step(bad), doctest::Contains("gpt2 batch: target at position 3: got 50"), Error);
  CHECK(on_device.steps() == 2);
}

TEST_CASE("GPT-2 on padded batches: the gradient in double against finite differences; lengths copied to a device") {
  // Causal and padded: query t sees keys s <= t below its row's length.
  const gpt2::Config c{.max_seq_len = 6, .vocab_size = 11, .padded_vocab_size = 16, .num_layers = 2,
                       .num_heads = 2, .channels = 8};
  const io::Padded source(io::SyntheticMarkov({.vocab_size = 11, .seed = 5}), {.min_length = 2, .pad_token = 3});
  const io::Batch batch = source.batch_at(1, 3, 6);
  REQUIRE(batch.padded());
  cpu be(1);
  Trainer<gpt2::Model<cpu, double>, SgdMomentum> trainer(be, gpt2::Model<cpu, double>(c),
                                                         SgdMomentum({.momentum = 0.0}), ConstantLr{.lr = 0.0},
                                                         {.micro_batch_size = 1});
  check_gradient_by_differences(trainer, batch);
  // A padded position's token changes nothing: no query sees it and it has no target.
  io::Batch other = batch;
  for (std::int64_t i = 0; i < other.batch; ++i)
    for (std::int64_t t = other.lengths[static_cast<std::size_t>(i)]; t < other.seq; ++t)
      other.tokens[static_cast<std::size_t>(i * other.seq + t)] = 7;
  CHECK(trainer.evaluate(other) == trainer.evaluate(batch));

  // On a backend with device memory the lengths travel with the batch: 4 more bytes a row.
  const gpt2::Config f = small_test_config();
  const io::Batch padded = io::Padded(io::SyntheticMarkov({.vocab_size = f.vocab_size}), {.min_length = 3})
                               .batch_at(0, 4, 8);
  cpu host(1);
  device_like_cpu device(1);
  Trainer<gpt2::Model<cpu, float>, AdamW> on_host(host, gpt2::Model<cpu, float>(f), AdamW(), ConstantLr{.lr = 1e-3},
                                                  {.micro_batch_size = 2});
  Trainer<gpt2::Model<device_like_cpu, float>, AdamW> on_device(device, gpt2::Model<device_like_cpu, float>(f), AdamW(),
                                                                ConstantLr{.lr = 1e-3}, {.micro_batch_size = 2});
  const std::size_t before = device.bytes_from_host;
  CHECK(on_device.step(padded).loss == on_host.step(padded).loss);
  CHECK(device.bytes_from_host - before == (2 * 4 * 8 + 4) * sizeof(std::int32_t));
  CHECK(relative_difference(on_device.parameters(), on_host.parameters(), on_host.model().layout().total()) == 0.0);
}

}  // namespace test_trainer
