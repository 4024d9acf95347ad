// GPT-2 in bf16 storage (mixed precision as llm.c trains: bf16 parameters, activations and
// gradients; float arithmetic, layernorm statistics, losses and loss scale) against the float
// model on the same bf16-rounded parameters and batch, through every layer forward and
// backward; the bf16 split backward against its whole backward, bit for bit (one rank and
// tp = 2); and the bf16 activation ranges: their element counts, the float statistics inside
// them (guard elements after each range stay untouched) and the alignment they need.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/gradcheck.hpp"
#include "support/training.hpp"

namespace test_gpt2_bf16 {

using namespace loom;
using namespace loom::test;

static_assert(SplitBackwardModel<gpt2::Model<cpu, bf16>>);
static_assert(std::same_as<decltype(BackwardArgs<bf16>::loss_scale), float>);
static_assert(std::same_as<decltype(BackwardArgs<float>::loss_scale), float>);
static_assert(std::same_as<decltype(BackwardArgs<double>::loss_scale), double>);

namespace {

// Tolerances. bf16 keeps 8 significant bits: one rounding is off by at most u = 2^-8 relative,
// by u / sqrt(3) ~ 2.3e-3 in the root mean square. Every kernel computes in float and rounds
// each stored result once, so a tensor's error is its own rounding plus the roundings upstream
// of it; independent roundings add in quadrature. A block's forward stores about 10 rounded
// tensors in a chain (ln1, qkv, att, atty, res2, ln2, fch, fch_gelu, output, twice through
// residual adds), its backward about as many again, and the gradient of a weight also carries
// the errors of the activations it is the product with: through the 4 layers of the test model
// about k = 40 roundings reach the embedding's gradient, sqrt(40) * 2.3e-3 ~ 1.5e-2.
//  - hidden states and gradients, in relative L2 (|x_bf16 - x_float|_2 / |x_float|_2): 3e-2,
//    twice that estimate (measured: hidden states <= 4.2e-3, their gradients <= 6.9e-3,
//    parameter gradients <= 1.5e-2, the largest h.0.attn.qkv.bias: a sum of cancelling terms);
//  - the per-token loss sum, relative: 1e-2 (each token's loss is computed in float from bf16
//    logits that carry ~sqrt(20) roundings; measured 3.4e-5).
// Float itself is 2^16 times more precise, so the float model stands for the exact values.
// A gradient off by a factor (an unscaled loss: 1 instead of 1/16 here) or computed from wrong
// statistics is off by O(1) and fails these bounds (checked below for the loss scale; checked
// once by hand for float statistics carved one bf16 element a value, so that they overlap the
// tensors after them: relative differences 0.8 to 1e22).
constexpr double hidden_tolerance = 3e-2;
constexpr double gradient_tolerance = 3e-2;
constexpr double loss_tolerance = 1e-2;

constexpr std::int64_t guard_elements = 8;  // after each range: must stay as they were

template <class T>
T guard_value() {
  return static_cast<T>(-12345.0f);
}

template <class T>
bool same_bits(const T* a, const T* b, std::int64_t n) {
  return n == 0 || std::memcmp(a, b, static_cast<std::size_t>(n) * sizeof(T)) == 0;
}

//! A range of `n` elements followed by guard elements.
template <class T>
struct GuardedRange {
  std::vector<T> storage;
  std::int64_t n = 0;

  explicit GuardedRange(std::int64_t elements)
      : storage(static_cast<std::size_t>(elements + guard_elements), guard_value<T>()), n(elements) {}
  Tensor<T> view() { return n == 0 ? Tensor<T>{} : Tensor<T>(storage.data(), {n}); }
  bool guard_intact() const {
    const std::vector<T> expected(static_cast<std::size_t>(guard_elements), guard_value<T>());
    return same_bits(storage.data() + n, expected.data(), guard_elements);
  }
};

//! GPT-2's initial values plus noise (biases not zero, layernorm weights not one), keyed by
//! global index so that tensor-parallel slices hold slices of one set, rounded to bf16: the
//! same values in either element type.
template <class T>
std::vector<T> bf16_exact_parameters(const ParameterLayout& layout) {
  std::vector<float> values(static_cast<std::size_t>(layout.total()));
  layout.initialize(values.data(), 7);
  std::vector<T> out(values.size());
  for (const auto& e : layout.entries()) {
    const CounterRng noise(61, e.spec.name);
    for (std::int64_t k = 0; k < e.numel(); ++k) {
      const auto i = static_cast<std::size_t>(e.offset + k);
      const double x = values[i] + 0.2 * noise.uniform(static_cast<std::uint64_t>(e.spec.global_index(k))) - 0.1;
      out[i] = static_cast<T>(static_cast<float>(bf16(static_cast<float>(x))));
    }
  }
  return out;
}

template <class T>
std::vector<double> widened(const std::vector<T>& v) {
  std::vector<double> out(v.size());
  std::transform(v.begin(), v.end(), out.begin(), [](T x) { return static_cast<double>(static_cast<float>(x)); });
  return out;
}

//! |a - b|_2 / |b|_2 over [offset, offset + n).
template <class T>
double relative_l2(const std::vector<T>& a, const std::vector<float>& b, std::int64_t offset, std::int64_t n) {
  const std::vector<double> wide = widened(a);
  const std::vector<float> part(b.begin() + offset, b.begin() + offset + n);
  return relative_difference(wide.data() + offset, widened(part).data(), n);
}

enum class Backward { whole, split };

//! One micro-batch through every layer: forward, then backward, whole or split. Split, each
//! layer's backward_weight runs after the next layer's backward_input has reused the workspace
//! (deferred, as in a zero-bubble schedule, but not past the embedding's backward: the tied wte
//! then receives the head's and the embedding's gradients in the whole backward's order; rounded
//! sums in another order differ in their last bits, in float as in bf16). Buffers as the Trainer
//! lays them out: one saved range and one stash per layer, one workspace for all; every range
//! has guard elements after it.
template <class T>
struct Step {
  double loss = 0;
  std::vector<std::vector<T>> hidden;       //!< hidden[l]: the output of layer l
  std::vector<std::vector<T>> hidden_grad;  //!< hidden_grad[l]: d loss / d hidden[l]
  std::vector<T> grads;
  bool guards_intact = true;
};

template <class T>
Step<T> run_step(const gpt2::Model<cpu, T>& model, cpu& be, const std::vector<T>& params, const TestBatch& batch,
                 accumulate_t<T> loss_scale, Backward how) {
  const MicroBatchShape s{batch.batch, batch.seq};
  // The Trainer's shape: [B, T, C], or [B, T, C/tp] holding a sequence-parallel rank's rows.
  const Shape hidden_shape{s.batch, s.seq, model.hidden_elements(s) / (s.batch * s.seq)};
  const int layers = model.num_layers();
  const ParameterView<const T> p(params.data());
  Step<T> step;
  step.hidden.assign(static_cast<std::size_t>(layers - 1), std::vector<T>(static_cast<std::size_t>(hidden_shape.numel())));
  step.hidden_grad = step.hidden;  // zeros: gradients accumulate
  step.grads.assign(params.size(), T(0.0f));
  const ParameterView<T> g(step.grads.data());

  std::vector<GuardedRange<T>> saved, stash;
  std::int64_t workspace_elements = 0;
  for (int l = 0; l < layers; ++l) {
    saved.emplace_back(model.activation_elements(l, s));
    stash.emplace_back(model.stash_elements(l, s));
    workspace_elements = std::max(workspace_elements, model.workspace_elements(l, s));
  }
  GuardedRange<T> workspace(workspace_elements);
  const auto hidden = [&](std::vector<std::vector<T>>& v, int l) {
    return l < 0 || l >= layers - 1 ? Tensor<T>{} : Tensor<T>(v[static_cast<std::size_t>(l)].data(), hidden_shape);
  };

  for (int l = 0; l < layers; ++l)
    step.loss += model.forward(be, l, p,
                               {.tokens = batch.tokens_view(), .targets = batch.targets_view(),
                                .input = hidden(step.hidden, l - 1), .output = hidden(step.hidden, l),
                                .saved = saved[static_cast<std::size_t>(l)].view()});
  const auto args = [&](int l, bool weight_pass) {
    const auto ws = Tensor<T>(workspace.storage.data(), {model.workspace_elements(l, s)});
    return BackwardArgs<T>{.tokens = batch.tokens_view(), .targets = batch.targets_view(),
                           .input = hidden(step.hidden, l - 1),
                           .output_grad = weight_pass ? Tensor<T>{} : hidden(step.hidden_grad, l),
                           .input_grad = weight_pass ? Tensor<T>{} : hidden(step.hidden_grad, l - 1),
                           .saved = saved[static_cast<std::size_t>(l)].view(), .workspace = ws,
                           .loss_scale = loss_scale};
  };
  const auto weight_pass = [&](int l) {
    model.backward_weight(be, l, p, g, args(l, true), stash[static_cast<std::size_t>(l)].view());
  };
  for (int l = layers - 1; l >= 0; --l) {
    if (how == Backward::whole) {
      model.backward(be, l, p, g, args(l, false));
      continue;
    }
    model.backward_input(be, l, p, g, args(l, false), stash[static_cast<std::size_t>(l)].view());
    if (l + 1 < layers) weight_pass(l + 1);
  }
  if (how == Backward::split) weight_pass(0);

  step.guards_intact = workspace.guard_intact();
  for (const auto* ranges : {&saved, &stash})
    for (const GuardedRange<T>& r : *ranges) step.guards_intact = step.guards_intact && r.guard_intact();
  return step;
}

//! How far the bf16 step is from the float step: the largest relative L2 difference of a
//! parameter's gradient, naming it.
struct WorstGradient {
  double difference = 0;
  std::string name;
};
WorstGradient worst_gradient(const Step<bf16>& low, const Step<float>& reference, const ParameterLayout& layout) {
  WorstGradient worst;
  for (const auto& e : layout.entries()) {
    const double d = relative_l2(low.grads, reference.grads, e.offset, e.numel());
    if (!(d <= worst.difference)) worst = {d, e.spec.name};  // NaN wins
  }
  return worst;
}

}  // namespace

TEST_CASE("GPT-2 in bf16 against float on the same parameters: loss, hidden states and all gradients") {
  const gpt2::Config c = small_test_config();
  const TestBatch batch = make_batch(3, 2, 8, c.vocab_size);
  const float loss_scale = 1.0f / static_cast<float>(batch.batch * batch.seq);
  cpu be(2);
  const gpt2::Model<cpu, bf16> low(c);
  const gpt2::Model<cpu, float> reference(c);
  const Step<bf16> l = run_step(low, be, bf16_exact_parameters<bf16>(low.layout()), batch, loss_scale, Backward::whole);
  const Step<float> r =
      run_step(reference, be, bf16_exact_parameters<float>(reference.layout()), batch, loss_scale, Backward::whole);
  CHECK(l.guards_intact);

  INFO("loss bf16 " << l.loss << ", float " << r.loss);
  CHECK(r.loss > 0);
  CHECK(std::abs(l.loss - r.loss) <= loss_tolerance * r.loss);
  for (std::size_t k = 0; k < r.hidden.size(); ++k) {
    CAPTURE(k);
    const auto n = static_cast<std::int64_t>(r.hidden[k].size());
    CHECK(relative_l2(l.hidden[k], r.hidden[k], 0, n) <= hidden_tolerance);
    CHECK(relative_l2(l.hidden_grad[k], r.hidden_grad[k], 0, n) <= gradient_tolerance);
  }
  for (const auto& e : reference.layout().entries()) {
    CAPTURE(e.spec.name);
    CHECK(relative_l2(l.grads, r.grads, e.offset, e.numel()) <= gradient_tolerance);
  }

  // The bounds catch a gradient off by a factor: the bf16 model run with the loss unscaled.
  const Step<bf16> unscaled = run_step(low, be, bf16_exact_parameters<bf16>(low.layout()), batch, 1.0f, Backward::whole);
  const WorstGradient worst = worst_gradient(unscaled, r, reference.layout());
  CAPTURE(worst.name);
  CHECK(worst.difference > 10 * gradient_tolerance);
  CHECK(worst_gradient(l, r, reference.layout()).difference <= gradient_tolerance);
}

TEST_CASE("GPT-2 in bf16: backward_input then backward_weight give backward's bits, one rank and tp = 2") {
  gpt2::Config c = small_test_config();
  const TestBatch batch = make_batch(5, 2, 8, c.vocab_size);
  const float loss_scale = 1.0f / static_cast<float>(batch.batch * batch.seq);
  const auto split_matches_whole = [&](const gpt2::Model<cpu, bf16>& model, cpu& be) {
    const std::vector<bf16> params = bf16_exact_parameters<bf16>(model.layout());
    const Step<bf16> whole = run_step(model, be, params, batch, loss_scale, Backward::whole);
    const Step<bf16> split = run_step(model, be, params, batch, loss_scale, Backward::split);
    std::vector<std::string> wrong;
    if (!whole.guards_intact || !split.guards_intact) wrong.push_back("a guard element was overwritten");
    if (!same_bits(split.grads.data(), whole.grads.data(), static_cast<std::int64_t>(whole.grads.size())))
      for (const auto& e : model.layout().entries())
        if (!same_bits(split.grads.data() + e.offset, whole.grads.data() + e.offset, e.numel()))
          wrong.push_back(e.spec.name + ": gradient differs");
    for (std::size_t k = 0; k < whole.hidden_grad.size(); ++k)
      if (!same_bits(split.hidden_grad[k].data(), whole.hidden_grad[k].data(),
                     static_cast<std::int64_t>(whole.hidden_grad[k].size())))
        wrong.push_back("input gradient of layer " + std::to_string(k + 1) + " differs");
    return wrong;
  };

  cpu be(2);
  for (const std::string& w : split_matches_whole(gpt2::Model<cpu, bf16>(c), be)) FAIL_CHECK(w);
  // And with the hidden state's rows split over the group (the weight pass reads the layernorms'
  // outputs the input pass gathered into the stash).
  for (const bool sequence_parallel : {false, true}) {
    CAPTURE(sequence_parallel);
    c.sequence_parallel = sequence_parallel;
    std::vector<std::vector<std::string>> wrong(2);
    threads::run(2, [&](threads::Communicator& comm) {
      cpu rank_be(1);
      wrong[static_cast<std::size_t>(comm.rank())] =
          split_matches_whole(gpt2::Model<cpu, bf16>(c, CommunicatorRef(comm)), rank_be);
    });
    for (std::size_t rank = 0; rank < 2; ++rank) {
      CAPTURE(rank);
      for (const std::string& w : wrong[rank]) FAIL_CHECK(w);
    }
  }
}

TEST_CASE("GPT-2 activation ranges: float statistics inside bf16 ranges, counted and aligned") {
  // One head of 12 channels and 3 tokens: a block's bf16 tensors (B·H·T² = 9 attention
  // weights among them) add up to an odd count.
  const gpt2::Config c{.max_seq_len = 8, .vocab_size = 50, .padded_vocab_size = 64, .num_layers = 1,
                       .num_heads = 1, .channels = 12};
  const MicroBatchShape s{1, 3};
  const std::int64_t N = 3, C = 12, V = 64, attention = 9;
  const int block = gpt2::block_layer(0), head = gpt2::head_layer(c);
  const auto even = [](std::int64_t n) { return (n + 1) / 2 * 2; };
  const auto round_up = [](std::int64_t n, std::int64_t m) { return (n + m - 1) / m * m; };

  const gpt2::Model<cpu, float> single(c);
  CHECK(single.activation_elements(gpt2::embedding_layer, s) == 0);
  // The head: ln_f's statistics and the losses (3 floats a token), each row's logit statistics
  // (3 doubles, 8-byte aligned), lnf, the logits and the scale of their gradient (a double).
  CHECK(single.activation_elements(head, s) == round_up(round_up(3 * N, 2) + 2 * 3 * N + N * C + N * V, 2) + 2);
  CHECK(single.activation_elements(block, s) == N * (3 * C + 12 * C + 4) + attention);
  const gpt2::Model<cpu, double> wide(c);
  CHECK(wide.activation_elements(block, s) == single.activation_elements(block, s));

  // bf16: each float statistic takes two elements (4 per token in a block, 3 in the head),
  // and a range is rounded up to even so that the next one starts 4-byte aligned too.
  const gpt2::Model<cpu, bf16> low(c);
  CHECK(low.activation_elements(gpt2::embedding_layer, s) == 0);
  CHECK(low.activation_elements(head, s) == round_up(round_up(2 * 3 * N, 4) + 4 * 3 * N + N * C + N * V, 4) + 4);
  CHECK(low.activation_elements(block, s) == 2 * 4 * N + even(N * (3 * C + 12 * C) + attention));
  CHECK(low.activation_elements(block, s) % 2 == 0);
  for (int layer = 0; layer <= head; ++layer) {
    CAPTURE(layer);
    CHECK(low.workspace_elements(layer, s) == single.workspace_elements(layer, s));
    CHECK(low.stash_elements(layer, s) == single.stash_elements(layer, s));
  }

  // A saved range that does not start 4-byte aligned is refused before any work.
  const TestBatch batch = make_batch(0, 1, 3, c.vocab_size);
  const std::vector<bf16> params = bf16_exact_parameters<bf16>(low.layout());
  std::vector<bf16> input(static_cast<std::size_t>(low.hidden_elements(s)), bf16(0.5f));
  std::vector<bf16> saved(static_cast<std::size_t>(low.activation_elements(head, s) + 1));
  cpu be(1);
  const ForwardArgs<bf16> misaligned{.tokens = batch.tokens_view(), .targets = batch.targets_view(),
                                     .input = Tensor<const bf16>(input.data(), {1, 3, C}), .output = {},
                                     .saved = Tensor<bf16>(saved.data() + 1, {low.activation_elements(head, s)})};
  expect_error([&] { low.forward(be, head, ParameterView<const bf16>(params.data()), misaligned); },
               "must be aligned to 4 bytes");
}

}  // namespace test_gpt2_bf16
