// A step whose loss or gradient norm is not finite (TrainerOptions::stop_on_non_finite): every
// rank of every layout throws the same loom::Error in that step, nothing is updated, and the
// trainer then goes on as if the refused step had never been asked for.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/training.hpp"

namespace test_non_finite {

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t global_batch = 4, seq = 16;

//! Bit-for-bit equality, NaN included.
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

//! What a layout's run reports, rank by rank.
struct Outcome {
  std::string error;             //!< the refused step's message
  std::int64_t steps_after = 0;  //!< Trainer::steps() after it
  bool state_kept = false;       //!< every state array as before the refused step (the NaN loaded)
  bool resumed_alike = false;    //!< the next step gives the uninterrupted run's loss and state
};

//! On `shape` (thread ranks): step 1, then step 2 with a NaN loaded into wte[0][0] (tied to the
//! unembedding, so every loss is NaN), which must be refused; then step 2 again with step 1's
//! weights put back, against a run that never saw the NaN.
template <class T, class O, class S, class St>
std::vector<Outcome> refuse_on(MeshShape shape, O optimizer, S schedule, St strategy,
                               TrainerOptions options = {}) {
  using Gpt = gpt2::Model<cpu, T>;
  options.micro_batch_size = 1;
  options.seed = 5;
  std::vector<Outcome> outcomes(static_cast<std::size_t>(shape.size()));
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    const auto lr = WarmupCosineLr{.lr = 1e-2, .warmup = 1, .total_steps = 4, .min_lr_factor = 0.1};
    const gpt2::Config c = small_test_config();
    Trainer<Gpt, O, S, St> trainer(be, mesh, Gpt(c, mesh.tensor_parallel()), optimizer, lr, options, strategy,
                                   schedule);
    Trainer<Gpt, O, S, St> uninterrupted(be, mesh, Gpt(c, mesh.tensor_parallel()), optimizer, lr, options,
                                         strategy, schedule);
    const auto b0 = make_batch(0, global_batch, seq, c.vocab_size), b1 = make_batch(1, global_batch, seq, c.vocab_size);
    trainer.step(b0);
    uninterrupted.step(b0);
    constexpr int arrays = Trainer<Gpt, O, S, St>::state_arrays;
    std::vector<std::vector<float>> before;
    for (int a = 0; a < arrays; ++a) before.push_back(trainer.gather_state(a));
    const std::vector<double> tensor_state = trainer.copy_tensor_state();  // Adafactor's factored moments
    std::vector<float> poisoned = before[0];
    poisoned[0] = std::numeric_limits<float>::quiet_NaN();  // wte[0][0]: the first parameter
    trainer.load_state(0, poisoned);

    Outcome& out = outcomes[static_cast<std::size_t>(world.rank())];
    try {
      trainer.step(b1);
    } catch (const Error& e) {
      out.error = e.what();
    }
    out.steps_after = trainer.steps();
    out.state_kept = same_bits(trainer.gather_state(0), poisoned) && trainer.copy_tensor_state() == tensor_state;
    for (int a = 1; a < arrays; ++a) out.state_kept = out.state_kept && same_bits(trainer.gather_state(a), before[a]);

    trainer.load_state(0, before[0]);
    const double loss = trainer.step(b1).loss;
    const double reference = uninterrupted.step(b1).loss;
    out.resumed_alike = loss == reference;
    for (int a = 0; a < arrays; ++a)
      out.resumed_alike = out.resumed_alike && same_bits(trainer.gather_state(a), uninterrupted.gather_state(a));
  });
  return outcomes;
}

template <class T = float, class O = AdamW, class S = GradientAccumulation, class St = DataParallel>
void check_refused(MeshShape shape, O optimizer = AdamW({.weight_decay = 0.1}), S schedule = {}, St strategy = {},
                   TrainerOptions options = {}) {
  CAPTURE(shape);
  const std::vector<Outcome> outcomes = refuse_on<T>(shape, optimizer, schedule, strategy, options);
  for (std::size_t r = 0; r < outcomes.size(); ++r) {
    CAPTURE(r);
    const Outcome& o = outcomes[r];
    CHECK(o.error.find("loom: trainer step 2: loss: got ") == 0);
    CHECK(o.error.find("nan") != std::string::npos);
    CHECK(o.error.find("the update was not applied: the parameters and optimizer state are those after step 1") !=
          std::string::npos);
    CHECK(o.error == outcomes[0].error);  // every rank, the same step and values
    CHECK(o.steps_after == 1);
    CHECK(o.state_kept);
    CHECK(o.resumed_alike);
  }
}

}  // namespace

TEST_CASE("a NaN loss is refused on one rank, in float and bf16 (fp32 gradients too), with AdamW and Adafactor") {
  check_refused({.dp = 1, .tp = 1, .pp = 1});
  check_refused<bf16>({.dp = 1, .tp = 1, .pp = 1});
  check_refused<bf16>({.dp = 1, .tp = 1, .pp = 1}, AdamW({.weight_decay = 0.1}), GradientAccumulation{},
                      DataParallel{}, {.fp32_gradients = true});
  check_refused<float, Adafactor>({.dp = 1, .tp = 1, .pp = 1}, Adafactor());
}

TEST_CASE("a NaN loss is refused by every rank of DDP and ZeRO-1/2/3, and training goes on as if never asked") {
  check_refused({.dp = 2, .tp = 1, .pp = 1}, AdamW({.weight_decay = 0.1}), GradientAccumulation{},
                DataParallel{.bucket_bytes = 4096});
  check_refused<float, AdamW, GradientAccumulation, Zero<1>>({.dp = 2, .tp = 1, .pp = 1});
  check_refused<float, AdamW, GradientAccumulation, Zero<2>>({.dp = 2, .tp = 1, .pp = 1});
  check_refused<float, AdamW, GradientAccumulation, Zero<3>>({.dp = 2, .tp = 1, .pp = 1});
  check_refused<bf16, AdamW, GradientAccumulation, Zero<3>>({.dp = 2, .tp = 1, .pp = 1}, AdamW({.weight_decay = 0.1}),
                                                            {}, {}, {.fp32_gradients = true});
  check_refused<float, Adafactor, GradientAccumulation, Zero<2>>({.dp = 2, .tp = 1, .pp = 1}, Adafactor());
}

TEST_CASE("a NaN loss is refused by every rank of tensor-parallel and pipeline meshes") {
  check_refused({.dp = 1, .tp = 2, .pp = 1});
  check_refused<float, AdamW, OneFOneB>({.dp = 1, .tp = 1, .pp = 2});
  check_refused<float, AdamW, GPipe, Zero<1>>({.dp = 2, .tp = 1, .pp = 2});
  check_refused<float, AdamW, ZeroBubbleH1, Zero<1>>({.dp = 1, .tp = 2, .pp = 2});
}

TEST_CASE("a gradient norm that is not finite is refused as such, the loss finite") {
  cpu be(1);
  using Gpt = gpt2::Model<cpu, float>;
  const gpt2::Config c = small_test_config();
  Trainer<Gpt, AdamW> trainer(be, Gpt(c), AdamW(), ConstantLr{1e-3}, {.micro_batch_size = 2});
  std::vector<float> weights = trainer.gather_parameters();
  // A padding row of wte (past vocab_size): its logits take no part in the loss, which stays
  // finite, but the unembedding's input gradient reads the row.
  const auto& wte = trainer.model().layout().find("wte");
  weights[static_cast<std::size_t>(wte.offset + (c.padded_vocab_size - 1) * c.channels)] =
      std::numeric_limits<float>::quiet_NaN();
  trainer.load_parameters(std::span<const float>(weights));
  try {
    const StepMetrics m = trainer.step(make_batch(0, 2, seq, c.vocab_size));
    FAIL("the step was applied: loss " << m.loss << ", gradient norm " << m.grad_norm);
  } catch (const Error& e) {
    const std::string text = e.what();
    CAPTURE(text);
    CHECK(text.find("loom: trainer step 1: gradient norm: got ") == 0);
    CHECK(text.find("after step 0") != std::string::npos);
  }
  CHECK(trainer.steps() == 0);
}

TEST_CASE("with stop_on_non_finite off, the NaN step is applied as before") {
  cpu be(1);
  using Gpt = gpt2::Model<cpu, float>;
  const gpt2::Config c = small_test_config();
  Trainer<Gpt, AdamW> trainer(be, Gpt(c), AdamW(), ConstantLr{1e-3},
                              {.micro_batch_size = 2, .stop_on_non_finite = false});
  std::vector<float> weights = trainer.gather_parameters();
  weights[0] = std::numeric_limits<float>::quiet_NaN();
  trainer.load_parameters(std::span<const float>(weights));
  const StepMetrics m = trainer.step(make_batch(0, 2, seq, c.vocab_size));
  CHECK(std::isnan(m.loss));
  CHECK(trainer.steps() == 1);
  std::int64_t nans = 0;
  for (float w : trainer.gather_parameters()) nans += std::isnan(w) ? 1 : 0;
  CHECK(nans > 1);  // the update spread it
}

}  // namespace test_non_finite
