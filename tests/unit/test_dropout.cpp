// Dropout keyed by (seed, step, layer, site, global element) (DESIGN.md invariant 2): the masks'
// statistics and independence, the kernel on any slice of a global tensor, attention-probability
// dropout against a reference and central differences, GPT-2 and BERT gradients with dropout in
// double, the split backward's bits, parity of every mesh shape and schedule with one rank while
// dropping, evaluation without dropout, and a resumed run drawing the same masks.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "loom/backend/cpu/kernels.hpp"
#include "loom/comm/threads.hpp"
#include "loom/core/dropout.hpp"
#include "loom/io/masked_lm.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"
#include "support/gradcheck.hpp"
#include "support/masked_lm_training.hpp"
#include "support/model_pass.hpp"
#include "support/parity_check.hpp"
#include "support/training.hpp"

namespace test_dropout {

using namespace loom;
using namespace loom::test;

namespace {

constexpr DropoutKey key{.seed = 7, .step = 3, .first_sequence = 0};

//! How many of elements [0, n) `mask` keeps.
std::int64_t kept(const DropoutMask& mask, std::int64_t n) {
  std::int64_t k = 0;
  for (std::int64_t i = 0; i < n; ++i) k += mask.keep(static_cast<std::uint64_t>(i));
  return k;
}

//! Fraction of elements [0, n) on which two masks agree.
double agreement(const DropoutMask& a, const DropoutMask& b, std::int64_t n) {
  std::int64_t same = 0;
  for (std::int64_t i = 0; i < n; ++i)
    same += a.keep(static_cast<std::uint64_t>(i)) == b.keep(static_cast<std::uint64_t>(i));
  return static_cast<double>(same) / static_cast<double>(n);
}

}  // namespace

TEST_CASE("a dropout mask keeps the fraction 1 - rate; seeds, steps, layers and sites draw independent masks") {
  constexpr std::int64_t n = 1 << 20;
  for (double rate : {0.1, 0.5, 0.9}) {
    CAPTURE(rate);
    const DropoutMask mask(key, 2, 1, rate);
    CHECK(mask.active());
    CHECK(mask.scale() == 1.0 / (1.0 - rate));
    const double fraction = static_cast<double>(kept(mask, n)) / n;
    // Five standard deviations of a binomial fraction.
    CHECK(std::abs(fraction - (1 - rate)) < 5 * std::sqrt(rate * (1 - rate) / n));
  }
  // Independent masks at rate 0.5 agree on half the elements; the same key on all of them.
  const DropoutMask base(key, 2, 1, 0.5);
  const auto independent = [&](const DropoutMask& other) {
    return std::abs(agreement(base, other, n) - 0.5) < 5 * 0.5 / std::sqrt(double(n));
  };
  CHECK(agreement(base, DropoutMask(key, 2, 1, 0.5), n) == 1.0);
  CHECK(independent(DropoutMask({.seed = 8, .step = 3}, 2, 1, 0.5)));
  CHECK(independent(DropoutMask({.seed = 7, .step = 4}, 2, 1, 0.5)));
  CHECK(independent(DropoutMask(key, 3, 1, 0.5)));
  CHECK(independent(DropoutMask(key, 2, 2, 0.5)));
  // The micro-batch's place moves the mask with it: it indexes global elements.
  CHECK(DropoutMask({.seed = 7, .step = 3, .first_sequence = 5}, 2, 1, 0.5).keep(1234) == base.keep(1234));
  // Inactive: a pass with no step (evaluation), or rate 0, keeps everything unscaled.
  for (const DropoutMask& none : {DropoutMask(DropoutKey{}, 2, 1, 0.5), DropoutMask(key, 2, 1, 0.0), DropoutMask()}) {
    CHECK_FALSE(none.active());
    CHECK(kept(none, 1000) == 1000);
    CHECK(none.scale() == 1.0);
  }
}

TEST_CASE_TEMPLATE("the dropout kernel on any slice of a global tensor draws that slice's mask", T, float, double,
                   bf16) {
  constexpr std::int64_t n = 61;  // odd, and not a multiple of the four elements of a Philox block
  const DropoutMask mask(key, 1, 0, 0.3);
  const std::vector<double> values = random_vector<double>(n, 3, 0.5, 2.0);
  std::vector<T> whole(n);
  for (std::int64_t i = 0; i < n; ++i) whole[i] = static_cast<T>(values[i]);
  const std::vector<T> original = whole;
  cpu be(2);
  dropout<T>(be, Tensor<T>(whole.data(), {n}), mask, 0);
  std::int64_t zeros = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    CAPTURE(i);
    const T expected = mask.keep(static_cast<std::uint64_t>(i))
                           ? static_cast<T>(to_accumulate(original[i]) * static_cast<accumulate_t<T>>(mask.scale()))
                           : T(0);
    CHECK(whole[i] == expected);
    zeros += whole[i] == T(0);
  }
  CHECK(zeros > 5);
  CHECK(zeros < 40);
  // Slices of lengths 1..8 at every offset of a block, and an odd-length tail, agree with the whole.
  for (std::int64_t first : {0, 1, 2, 3, 5, 13, 40}) {
    for (std::int64_t len = 1; len <= 8 && first + len <= n; ++len) {
      CAPTURE(first);
      CAPTURE(len);
      std::vector<T> slice(original.begin() + first, original.begin() + first + len);
      dropout<T>(be, Tensor<T>(slice.data(), {len}), mask, first);
      CHECK(std::memcmp(slice.data(), whole.data() + first, sizeof(T) * static_cast<std::size_t>(len)) == 0);
    }
  }
  // An inactive mask leaves the values alone.
  std::vector<T> untouched = original;
  dropout<T>(be, Tensor<T>(untouched.data(), {n}), DropoutMask(), 0);
  CHECK(std::memcmp(untouched.data(), original.data(), sizeof(T) * n) == 0);
}

TEST_CASE("dropout rates outside [0, 1) are refused before any work, naming the value") {
  for (double rate : {-0.1, 1.0, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    CAPTURE(rate);
    CHECK_THROWS_WITH_AS(DropoutMask(key, 1, 0, rate), doctest::Contains("must be in [0, 1)"), Error);
    gpt2::Config g = small_test_config();
    g.hidden_dropout = rate;
    CHECK_THROWS_WITH_AS(gpt2::Model<cpu>{g}, doctest::Contains("gpt2 config: hidden_dropout"), Error);
    g = small_test_config();
    g.attention_dropout = rate;
    CHECK_THROWS_WITH_AS(gpt2::Model<cpu>{g}, doctest::Contains("gpt2 config: attention_dropout"), Error);
    bert::Config b = bert_test_config();
    b.hidden_dropout = rate;
    CHECK_THROWS_WITH_AS(bert::Model<cpu>{b}, doctest::Contains("bert config: hidden_dropout"), Error);
  }
  CHECK_THROWS_WITH_AS(DropoutMask(key, 1, DropoutMask::sites_per_layer, 0.1), doctest::Contains("dropout site"),
                       Error);
}

namespace {

//! A backend whose attention kernels take no dropout (as the CUDA backend's, for now).
struct NoAttentionDropout {
  using loom_backend = void;
  static constexpr bool attention_dropout = false;
  void* allocate(std::size_t, MemoryCategory) { return nullptr; }
  void deallocate(void*, std::size_t, MemoryCategory) {}
  const MemoryTracker& memory() const { return tracker; }
  void fill_zero(void*, std::size_t) {}
  void copy_from_host(void*, const void*, std::size_t) {}
  void copy_to_host(void*, const void*, std::size_t) {}
  void synchronize() {}
  MemoryTracker tracker;
};
static_assert(Backend<NoAttentionDropout>);
static_assert(!supports_attention_dropout<NoAttentionDropout>);
static_assert(supports_attention_dropout<cpu>);

}  // namespace

TEST_CASE("a backend without attention-dropout kernels refuses an attention dropout rate, not a hidden one") {
  namespace tr = detail::transformer;
  CHECK_NOTHROW(tr::check_attention_dropout<NoAttentionDropout>(0.0, "gpt2"));
  CHECK_THROWS_WITH_AS(tr::check_attention_dropout<NoAttentionDropout>(0.1, "gpt2"),
                       doctest::Contains("gpt2 config: attention_dropout: got 0.1"), Error);
  CHECK_NOTHROW(tr::check_attention_dropout<cpu>(0.1, "bert"));
}

namespace {

//! out [B,T,C] of attention with dropout on the probabilities, by the definition, in double: per
//! (b, h) P = softmax(q·k / sqrt(hs)) over the keys t sees, out_t = Σ_s dropout(P)_ts v_s.
std::vector<double> reference_attention(const std::vector<double>& qkv, std::int64_t B, std::int64_t T,
                                        std::int64_t C, std::int64_t NH, AttentionMask mask,
                                        const AttentionDropout& drop) {
  const std::int64_t hs = C / NH;
  std::vector<double> out(static_cast<std::size_t>(B * T * C), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < NH; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t keys = mask == AttentionMask::causal ? t + 1 : T;
        std::vector<double> p(static_cast<std::size_t>(keys));
        double max = -1e300, sum = 0;
        for (std::int64_t s = 0; s < keys; ++s) {
          double dot = 0;
          for (std::int64_t i = 0; i < hs; ++i)
            dot += qkv[(b * T + t) * 3 * C + h * hs + i] * qkv[(b * T + s) * 3 * C + C + h * hs + i];
          p[s] = dot / std::sqrt(static_cast<double>(hs));
          max = std::max(max, p[s]);
        }
        for (auto& x : p) sum += (x = std::exp(x - max));
        for (std::int64_t s = 0; s < keys; ++s) {
          const std::uint64_t e = drop.head_origin(b, h, T) + static_cast<std::uint64_t>(t * T + s);
          const double w = drop.mask.keep(e) ? p[s] / sum * drop.mask.scale() : 0.0;
          for (std::int64_t i = 0; i < hs; ++i)
            out[(b * T + t) * C + h * hs + i] += w * qkv[(b * T + s) * 3 * C + 2 * C + h * hs + i];
        }
      }
  return out;
}

}  // namespace

TEST_CASE("attention with dropout: out is dropout(P)·V, stored and recomputed agree, gradients in double") {
  constexpr std::int64_t B = 2, T = 7, C = 8, NH = 2;
  cpu be(2);
  for (AttentionMask mask : {AttentionMask::causal, AttentionMask::bidirectional}) {
    CAPTURE(mask);
    // Heads 1..2 of a model with 4, the second sequence of the global batch first: a
    // tensor-parallel rank's slice of a data-parallel rank's micro-batch.
    const AttentionDropout drop{.mask = DropoutMask(key, 1, 2, 0.4), .first_sequence = 1, .heads = 4, .first_head = 1};
    std::vector<double> qkv = random_vector<double>(B * T * 3 * C, 11, -1.5, 1.5);
    const std::vector<double> expected = reference_attention(qkv, B, T, C, NH, mask, drop);
    std::vector<double> out(B * T * C), att(B * NH * T * T), out_lse(B * T * C), lse(B * NH * T);
    attention_forward<double>(be, Tensor<double>(out.data(), {B, T, C}), Tensor<double>(att.data(), {B, NH, T, T}),
                              Tensor<const double>(qkv.data(), {B, T, 3 * C}), NH, mask, drop);
    attention_forward_lse<double>(be, Tensor<double>(out_lse.data(), {B, T, C}),
                                  Tensor<double>(lse.data(), {B, NH, T}),
                                  Tensor<const double>(qkv.data(), {B, T, 3 * C}), NH, mask, drop);
    CHECK(max_relative_error(out, expected, 1e-9) < 1e-12);
    CHECK(max_relative_error(out_lse, expected, 1e-9) < 1e-12);
    // The probabilities kept are the undropped softmax: each row sums to 1.
    for (std::int64_t r = 0; r < B * NH * T; ++r) {
      double sum = 0;
      for (std::int64_t s = 0; s < T; ++s) sum += att[r * T + s];
      CHECK(sum == doctest::Approx(1.0).epsilon(1e-12));
    }
    // Gradient of L = Σ w·out against central differences, for both kernel pairs.
    const std::vector<double> w = random_vector<double>(B * T * C, 12);
    const auto loss = [&] {
      const std::vector<double> o = reference_attention(qkv, B, T, C, NH, mask, drop);
      double l = 0;
      for (std::size_t i = 0; i < o.size(); ++i) l += w[i] * o[i];
      return l;
    };
    const std::vector<double> numeric = finite_difference(loss, std::span<double>(qkv), 1e-6);
    std::vector<double> dqkv(qkv.size(), 0.0), dqkv_lse(qkv.size(), 0.0);
    attention_backward<double>(be, Tensor<double>(dqkv.data(), {B, T, 3 * C}), Tensor<const double>(w.data(), {B, T, C}),
                               Tensor<const double>(qkv.data(), {B, T, 3 * C}),
                               Tensor<const double>(att.data(), {B, NH, T, T}), NH, mask, drop);
    attention_backward_lse<double>(be, Tensor<double>(dqkv_lse.data(), {B, T, 3 * C}),
                                   Tensor<const double>(w.data(), {B, T, C}),
                                   Tensor<const double>(qkv.data(), {B, T, 3 * C}),
                                   Tensor<const double>(out_lse.data(), {B, T, C}),
                                   Tensor<const double>(lse.data(), {B, NH, T}), NH, mask, drop);
    CHECK(max_relative_error(dqkv, numeric, 1e-4) < 1e-5);  // finite differences' round-off: ~1e-10
    CHECK(max_relative_error(dqkv_lse, numeric, 1e-4) < 1e-5);
  }
}

namespace {

gpt2::Config dropout_gpt2_config() {
  gpt2::Config c = small_test_config();
  c.num_heads = 4;
  return with_dropout(c);
}

bert::Config dropout_bert_config() { return with_dropout(bert_test_config()); }

}  // namespace

TEST_CASE("GPT-2 and BERT gradients with dropout match central differences in double") {
  // Large rates, so that a mask applied in the wrong place cannot hide.
  const DropoutKey pass{.seed = 3, .step = 2, .first_sequence = 4};
  for (AttentionStorage storage : {AttentionStorage::stored, AttentionStorage::recompute}) {
    CAPTURE(storage);
    const gpt2::Model<cpu, double> gpt(
        {.max_seq_len = 5, .vocab_size = 11, .padded_vocab_size = 16, .num_layers = 2, .num_heads = 2, .channels = 8,
         .hidden_dropout = 0.3, .attention_dropout = 0.3},
        storage);
    check_model_gradient(gpt, noisy_parameters<double>(gpt.layout()), make_batch(0, 2, 5, 11), pass);
    const bert::Model<cpu, double> bert(
        {.max_seq_len = 6, .vocab_size = 11, .padded_vocab_size = 12, .num_layers = 2, .num_heads = 2, .channels = 8,
         .hidden_dropout = 0.3, .attention_dropout = 0.3},
        storage);
    const auto source = io::MaskedLm(io::SyntheticMarkov({.vocab_size = 10, .seed = 3}), {.select_probability = 0.4});
    check_model_gradient(bert, noisy_parameters<double>(bert.layout()), source.batch_at(0, 2, 5), pass);
  }
}

TEST_CASE_TEMPLATE("with dropout the split backward accumulates the combined backward's bits", T, float, double) {
  cpu be(2);
  const DropoutKey pass{.seed = 3, .step = 1, .first_sequence = 2};
  const gpt2::Model<cpu, T> gpt(dropout_gpt2_config());
  const bert::Model<cpu, T> bert(dropout_bert_config());
  const auto check = [&](const auto& model, const auto& batch) {
    const std::vector<T> params = noisy_parameters<T>(model.layout());
    std::vector<T> combined, split;
    const double loss = loss_and_gradient(model, be, params, batch, &combined, Pass::combined, pass);
    CHECK(loss_and_gradient(model, be, params, batch, &split, Pass::split, pass) == loss);
    CHECK(std::memcmp(combined.data(), split.data(), combined.size() * sizeof(T)) == 0);
    // And dropout is on: the loss without it differs.
    CHECK(loss_and_gradient(model, be, params, batch, nullptr) != loss);
  };
  check(gpt, make_batch(1, 2, 8, 50));
  check(bert, masked_test_source().batch_at(1, 2, 8));
}

namespace {

constexpr std::int64_t global_batch = 8, seq = 16;

//! One rank's run of `M` (built by `make_model` over the tensor-parallel group) on `shape`, with
//! schedule `S` and strategy `St`; the failures of every rank against `reference`.
template <class M, class S, class St, class MakeModel, class Steps>
std::vector<std::string> mesh_failures(MeshShape shape, const ParityRun& reference, MakeModel&& make_model,
                                       Steps&& steps, St strategy = {}, S schedule = {}) {
  const M global_model = make_model(CommunicatorRef{});
  std::mutex mutex;
  std::vector<std::string> failures;
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<M, AdamW, S, St> trainer(be, mesh, make_model(CommunicatorRef(mesh.tensor_parallel())),
                                     AdamW({.weight_decay = 0.1}), parity_lr(),
                                     {.micro_batch_size = 1, .clip_grad_norm = 1.0, .seed = 5}, strategy, schedule);
    const ParityRun run = steps(trainer);
    const std::string failure = parity_failures(trainer, run, reference, global_model.layout());
    std::lock_guard lock(mutex);
    if (!failure.empty()) failures.push_back("rank " + std::to_string(world.rank()) + ":" + failure);
  });
  return failures;
}

template <class M, class MakeModel, class Steps>
ParityRun one_rank(MakeModel&& make_model, Steps&& steps) {
  cpu be(1);
  Trainer<M, AdamW> trainer(be, make_model(CommunicatorRef{}), AdamW({.weight_decay = 0.1}), parity_lr(),
                            {.micro_batch_size = global_batch, .clip_grad_norm = 1.0, .seed = 5});
  return steps(trainer);
}

}  // namespace

TEST_CASE("with dropout every mesh and schedule trains the same GPT-2 as one rank") {
  using Gpt = gpt2::Model<cpu, float>;
  for (AttentionStorage storage : {AttentionStorage::stored, AttentionStorage::recompute}) {
    CAPTURE(storage);
    const auto make = [&](CommunicatorRef tp) { return Gpt(dropout_gpt2_config(), tp, storage); };
    const auto steps = [](auto& trainer) { return train_steps(trainer, global_batch, seq); };
    const ParityRun reference = one_rank<Gpt>(make, steps);
    // Dropout is on: the same run without it has another loss at the first step.
    {
      cpu be(1);
      gpt2::Config plain = dropout_gpt2_config();
      plain.hidden_dropout = plain.attention_dropout = 0;
      Trainer<Gpt, AdamW> trainer(be, Gpt(plain, storage), AdamW({.weight_decay = 0.1}), parity_lr(),
                                  {.micro_batch_size = global_batch, .clip_grad_norm = 1.0, .seed = 5});
      CHECK(trainer.step(make_batch(0, global_batch, seq, plain.vocab_size)).loss != reference.losses[0]);
    }
    CHECK(mesh_failures<Gpt, GradientAccumulation, Zero<1>>({.dp = 2, .tp = 2, .pp = 1}, reference, make, steps) ==
          std::vector<std::string>{});
    CHECK(mesh_failures<Gpt, GradientAccumulation, Zero<3>>({.dp = 4, .tp = 1, .pp = 1}, reference, make, steps) ==
          std::vector<std::string>{});
    CHECK(mesh_failures<Gpt, OneFOneB, DataParallel>({.dp = 2, .tp = 2, .pp = 2}, reference, make, steps) ==
          std::vector<std::string>{});
    CHECK(mesh_failures<Gpt, ZeroBubbleH1, Zero<1>>({.dp = 1, .tp = 2, .pp = 2}, reference, make, steps) ==
          std::vector<std::string>{});
  }
}

TEST_CASE("with dropout every mesh and schedule trains the same BERT as one rank") {
  using Bert = bert::Model<cpu, float>;
  const auto make = [](CommunicatorRef tp) { return Bert(dropout_bert_config(), tp); };
  const auto steps = [](auto& trainer) { return masked_lm_steps(trainer, global_batch, seq); };
  const ParityRun reference = one_rank<Bert>(make, steps);
  CHECK(mesh_failures<Bert, GradientAccumulation, Zero<2>>({.dp = 2, .tp = 2, .pp = 1}, reference, make, steps) ==
        std::vector<std::string>{});
  CHECK(mesh_failures<Bert, ZeroBubbleH1, DataParallel>({.dp = 2, .tp = 1, .pp = 2}, reference, make, steps) ==
        std::vector<std::string>{});
}

TEST_CASE("evaluation does not drop; a run resumed at step n draws the masks of steps n + 1, ...") {
  using Gpt = gpt2::Model<cpu, float>;
  gpt2::Config plain = dropout_gpt2_config();
  plain.hidden_dropout = plain.attention_dropout = 0;
  const auto trainer_for = [](cpu& be, const gpt2::Config& c) {
    return Trainer<Gpt, AdamW>(be, Gpt(c), AdamW({.weight_decay = 0.1}), parity_lr(),
                               {.micro_batch_size = 2, .clip_grad_norm = 1.0, .seed = 5});
  };
  const TestBatch held_out = make_batch(100, 4, seq, plain.vocab_size);
  cpu be(1);
  auto dropping = trainer_for(be, dropout_gpt2_config());
  auto plain_trainer = trainer_for(be, plain);
  // The same initial weights: evaluation gives the same bits with and without dropout rates.
  CHECK(dropping.evaluate(held_out) == plain_trainer.evaluate(held_out));
  CHECK(dropping.evaluate(held_out) == dropping.evaluate(held_out));
  for (int s = 0; s < 4; ++s) dropping.step(make_batch(s, 4, seq, plain.vocab_size));

  // Two steps, then a fresh trainer takes the state and the step count and runs the last two.
  auto first = trainer_for(be, dropout_gpt2_config());
  for (int s = 0; s < 2; ++s) first.step(make_batch(s, 4, seq, plain.vocab_size));
  auto resumed = trainer_for(be, dropout_gpt2_config());
  for (int a = 0; a < decltype(first)::state_arrays; ++a) resumed.load_state(a, first.gather_state(a));
  resumed.set_steps(first.steps());
  for (int s = 2; s < 4; ++s) resumed.step(make_batch(s, 4, seq, plain.vocab_size));
  CHECK(resumed.gather_parameters() == dropping.gather_parameters());
}

}  // namespace test_dropout
