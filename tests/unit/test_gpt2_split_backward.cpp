// GPT-2's split backward (SplitBackwardModel, for zero-bubble pipeline schedules) against its
// combined backward: for every layer, in double and float, on one rank and with tp = 2,
// backward_input then backward_weight accumulate the same bits into every parameter gradient
// and into the input gradient as backward. The weight pass runs after the caller's output
// gradient, input gradient and workspace were overwritten with NaN (so it reads none of them),
// and the input pass leaves the linear layers' weight gradients untouched (so it does not run
// their GEMMs). TP ranks are threads; results are collected per rank and checked after join
// (doctest's assertions are not thread-safe).

#include <doctest/doctest.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/gradcheck.hpp"
#include "support/model_pass.hpp"
#include "support/training.hpp"

namespace test_gpt2_split_backward {

using namespace loom;
using namespace loom::test;

static_assert(SplitBackwardModel<gpt2::Model<cpu, float>>);
static_assert(SplitBackwardModel<gpt2::Model<cpu, double>>);

namespace {

//! A near miss: a GPT-2 whose weight pass is out of reach is still a Model, but not split.
struct WithoutWeightPass : gpt2::Model<cpu, float> {
  using gpt2::Model<cpu, float>::Model;

 private:
  using gpt2::Model<cpu, float>::backward_weight;
};
static_assert(Model<WithoutWeightPass>);
static_assert(!SplitBackwardModel<WithoutWeightPass>);

//! GPT-2's initial values plus noise keyed by (name, global index): every tensor-parallel rank
//! holds its slice of one set of values, and biases are not zero.
template <class T>
std::vector<T> test_parameters(const ParameterLayout& layout) {
  std::vector<T> v(static_cast<std::size_t>(layout.total()));
  layout.initialize(v.data(), 5);
  for (const auto& e : layout.entries()) {
    const CounterRng rng(23, e.spec.name);
    for (std::int64_t k = 0; k < e.numel(); ++k)
      v[static_cast<std::size_t>(e.offset + k)] +=
          static_cast<T>(0.2 * rng.uniform(static_cast<std::uint64_t>(e.spec.global_index(k))) - 0.1);
  }
  return v;
}

//! The parameters whose gradients the weight pass of `layer` computes: the four linear layers
//! of a block (weights and biases), the tied wte for the head, nothing for the embedding.
bool deferred(const ParameterLayout::Entry& e, int layer, const gpt2::Config& c) {
  if (layer == gpt2::head_layer(c)) return e.spec.name == "wte";
  if (layer == gpt2::embedding_layer || e.spec.layer != layer) return false;
  for (std::string_view linear : {".attn.qkv.", ".attn.proj.", ".mlp.fc.", ".mlp.proj."})
    if (e.spec.name.find(linear) != std::string::npos) return true;
  return false;
}

//! How the weight pass receives the buffers it must not read.
enum class Buffers { empty, overwritten };

//! One layer's gradients (local layout) and input gradient from backward, from backward_input
//! alone, and from backward_input then backward_weight, each from the same prior values.
template <class T>
struct SplitRun {
  std::vector<T> grads, input_grad;                    // backward
  std::vector<T> input_pass_grads;                     // backward_input
  std::vector<T> split_grads, split_input_grad;        // backward_input + backward_weight
  std::vector<T> prior_grads;
  std::vector<T> input_grad_after_weight;              // the caller's buffer, overwritten before W
  std::int64_t stash = 0;
};

template <class T>
SplitRun<T> run_split(const gpt2::Model<cpu, T>& model, cpu& be, int layer, const std::vector<T>& params,
                      const TestBatch& batch, const std::vector<T>& input, const std::vector<T>& output_grad,
                      Buffers weight_pass_buffers) {
  const MicroBatchShape s{batch.batch, batch.seq};
  const bool first = layer == gpt2::embedding_layer, last = layer == gpt2::head_layer(model.config());
  const Shape hidden{s.batch, s.seq, model.config().channels};
  const ParameterView<const T> p(params.data());
  const T loss_scale = static_cast<T>(1.0 / static_cast<double>(s.batch * s.seq));

  std::vector<T> saved(static_cast<std::size_t>(model.activation_elements(layer, s)));
  std::vector<T> output(last ? 0 : static_cast<std::size_t>(hidden.numel()));
  const ForwardArgs<T> f{.tokens = batch.tokens_view(), .targets = batch.targets_view(),
                         .input = first ? Tensor<const T>{} : Tensor<const T>(input.data(), hidden),
                         .output = last ? Tensor<T>{} : Tensor<T>(output.data(), hidden),
                         .saved = flat(saved)};
  model.forward(be, layer, p, f);

  // Gradients accumulate: both runs start from the same non-zero values. Scratch starts as NaN,
  // so reading it before writing it shows up.
  SplitRun<T> run;
  run.prior_grads = random_vector<T>(static_cast<std::size_t>(model.layout().total()), 41);
  // The input gradient is written (writes_input_grad), never read: NaN there shows a read.
  const auto prior_input_grad = garbage<T>(first ? 0 : hidden.numel());
  const std::int64_t workspace_elements = model.workspace_elements(layer, s);
  const auto args = [&](std::vector<T>& layer_saved, std::vector<T>& workspace, const std::vector<T>& dout,
                        std::vector<T>& din) {
    return BackwardArgs<T>{.tokens = f.tokens, .targets = f.targets, .input = f.input,
                           .output_grad = last ? Tensor<const T>{} : Tensor<const T>(dout.data(), hidden),
                           .input_grad = first ? Tensor<T>{} : Tensor<T>(din.data(), hidden),
                           .saved = flat(layer_saved), .workspace = flat(workspace), .loss_scale = loss_scale};
  };

  {
    std::vector<T> layer_saved = saved, workspace = garbage<T>(workspace_elements);
    run.grads = run.prior_grads;
    run.input_grad = prior_input_grad;
    model.backward(be, layer, p, ParameterView<T>(run.grads.data()), args(layer_saved, workspace, output_grad, run.input_grad));
  }

  std::vector<T> layer_saved = saved, workspace = garbage<T>(workspace_elements), dout = output_grad;
  run.stash = model.stash_elements(layer, s);
  std::vector<T> stash = garbage<T>(run.stash);
  const Tensor<T> stash_view = run.stash == 0 ? Tensor<T>{} : flat(stash);  // an empty stash for 0
  std::vector<T> grads = run.prior_grads, din = prior_input_grad;
  const ParameterView<T> g(grads.data());
  model.backward_input(be, layer, p, g, args(layer_saved, workspace, dout, din), stash_view);
  run.input_pass_grads = grads;
  run.split_input_grad = din;

  // Other micro-batches' work reuses the caller's buffers before this one's weight pass.
  for (auto* buffer : {&workspace, &dout, &din}) *buffer = garbage<T>(static_cast<std::int64_t>(buffer->size()));
  BackwardArgs<T> weight_args = args(layer_saved, workspace, dout, din);
  if (weight_pass_buffers == Buffers::empty) {
    weight_args.output_grad = {};
    weight_args.input_grad = {};
  }
  model.backward_weight(be, layer, p, g, weight_args, stash_view);
  run.split_grads = grads;
  run.input_grad_after_weight = din;
  return run;
}

//! Everything the contract promises about one run, as text for the failures (checked after join).
template <class T>
std::vector<std::string> contract_violations(const SplitRun<T>& run, const ParameterLayout& layout, int layer,
                                             const gpt2::Config& c) {
  std::vector<std::string> wrong;
  if (!same_bits(run.split_input_grad, run.input_grad)) wrong.push_back("input gradient differs from backward");
  for (const T x : run.input_grad)
    if (!(x == x)) {
      wrong.push_back("backward left part of the input gradient unwritten (NaN)");
      break;
    }
  for (const T x : run.input_grad_after_weight)
    if (x == x) {
      wrong.push_back("backward_weight wrote into the input gradient");
      break;
    }
  bool any_deferred_changed = false;
  for (const auto& e : layout.entries()) {
    const auto part = [&](const std::vector<T>& v) {
      return std::vector<T>(v.begin() + e.offset, v.begin() + e.offset + e.numel());
    };
    if (!same_bits(part(run.split_grads), part(run.grads))) wrong.push_back(e.spec.name + ": gradient differs from backward");
    if (deferred(e, layer, c)) {
      if (!same_bits(part(run.input_pass_grads), part(run.prior_grads)))
        wrong.push_back(e.spec.name + ": backward_input touched a weight-pass gradient");
      any_deferred_changed = any_deferred_changed || !same_bits(part(run.split_grads), part(run.prior_grads));
    } else if (!same_bits(part(run.input_pass_grads), part(run.grads))) {
      wrong.push_back(e.spec.name + ": backward_input did not finish an input-pass gradient");
    }
  }
  if (layer != gpt2::embedding_layer && !any_deferred_changed) wrong.push_back("the weight pass changed nothing");
  return wrong;
}

std::vector<int> all_layers(const gpt2::Config& c) {
  std::vector<int> layers;
  for (int l = 0; l <= gpt2::head_layer(c); ++l) layers.push_back(l);
  return layers;
}

}  // namespace

TEST_CASE("stash_elements: nothing for the embedding and the head, N (2C + 7C/tp) for a block") {
  const gpt2::Config c = small_test_config();
  const MicroBatchShape s{2, 8};
  const std::int64_t N = 16, C = c.channels;
  const gpt2::Model<cpu, float> whole(c);
  CHECK(whole.stash_elements(gpt2::embedding_layer, s) == 0);
  CHECK(whole.stash_elements(gpt2::head_layer(c), s) == 0);
  CHECK(whole.stash_elements(gpt2::block_layer(0), s) == N * 9 * C);
  std::vector<std::int64_t> per_rank(2);
  threads::run(2, [&](threads::Communicator& comm) {
    const gpt2::Model<cpu, float> model(c, CommunicatorRef(comm));
    per_rank[static_cast<std::size_t>(comm.rank())] = model.stash_elements(gpt2::block_layer(1), s);
  });
  CHECK(per_rank[0] == N * (2 * C + 7 * C / 2));
  CHECK(per_rank[1] == per_rank[0]);
}

TEST_CASE_TEMPLATE("every GPT-2 layer: backward_input then backward_weight give backward's bits", T, double, float) {
  const gpt2::Config c = small_test_config();
  const TestBatch batch = make_batch(2, 2, 8, c.vocab_size);
  const std::int64_t hidden = batch.batch * batch.seq * c.channels;
  const auto input = random_vector<T>(static_cast<std::size_t>(hidden), 31);
  const auto output_grad = random_vector<T>(static_cast<std::size_t>(hidden), 37);
  cpu be(2);
  const gpt2::Model<cpu, T> model(c);
  const std::vector<T> params = test_parameters<T>(model.layout());
  for (const Buffers buffers : {Buffers::overwritten, Buffers::empty})
    for (const int layer : all_layers(c)) {
      CAPTURE(layer);
      CAPTURE(buffers == Buffers::empty ? "empty" : "overwritten with NaN");
      const SplitRun<T> run = run_split(model, be, layer, params, batch, input, output_grad, buffers);
      for (const std::string& wrong : contract_violations(run, model.layout(), layer, c)) FAIL_CHECK(wrong);
    }
}

TEST_CASE_TEMPLATE("every GPT-2 layer with tp = 2: the split backward gives the tp-2 backward's bits", T, double,
                   float) {
  const gpt2::Config c = small_test_config();
  const TestBatch batch = make_batch(4, 2, 8, c.vocab_size);
  const std::int64_t hidden = batch.batch * batch.seq * c.channels;
  const auto input = random_vector<T>(static_cast<std::size_t>(hidden), 51);
  const auto output_grad = random_vector<T>(static_cast<std::size_t>(hidden), 53);
  for (const int layer : all_layers(c)) {
    CAPTURE(layer);
    std::vector<std::vector<std::string>> wrong(2);
    std::vector<std::int64_t> stash(2);
    threads::run(2, [&](threads::Communicator& comm) {
      cpu rank_be(1);
      const gpt2::Model<cpu, T> model(c, CommunicatorRef(comm));
      const auto r = static_cast<std::size_t>(comm.rank());
      const SplitRun<T> run = run_split(model, rank_be, layer, test_parameters<T>(model.layout()), batch, input,
                                        output_grad, Buffers::empty);
      wrong[r] = contract_violations(run, model.layout(), layer, c);
      stash[r] = run.stash;
    });
    for (std::size_t r = 0; r < 2; ++r) {
      CAPTURE(r);
      for (const std::string& w : wrong[r]) FAIL_CHECK(w);
      CHECK(stash[r] == (layer == gpt2::embedding_layer || layer == gpt2::head_layer(c)
                             ? 0
                             : batch.batch * batch.seq * (2 * c.channels + 7 * c.channels / 2)));
    }
  }
}

TEST_CASE("a stash of the wrong size is rejected before any work") {
  const gpt2::Config c = small_test_config();
  const TestBatch batch = make_batch(0, 1, 4, c.vocab_size);
  const MicroBatchShape s{1, 4};
  const gpt2::Model<cpu, float> model(c);
  cpu be(1);
  const int block = gpt2::block_layer(0);
  std::vector<float> params(static_cast<std::size_t>(model.layout().total())), grads(params.size());
  std::vector<float> input(static_cast<std::size_t>(model.hidden_elements(s))), output_grad(input.size()),
      input_grad(input.size());
  std::vector<float> saved(static_cast<std::size_t>(model.activation_elements(block, s)));
  std::vector<float> workspace(static_cast<std::size_t>(model.workspace_elements(block, s)));
  std::vector<float> stash(static_cast<std::size_t>(model.stash_elements(block, s) - 1));
  const Shape hidden{1, 4, c.channels};
  const BackwardArgs<float> a{.tokens = batch.tokens_view(), .targets = batch.targets_view(),
                              .input = Tensor<const float>(input.data(), hidden),
                              .output_grad = Tensor<const float>(output_grad.data(), hidden),
                              .input_grad = Tensor<float>(input_grad.data(), hidden), .saved = flat(saved),
                              .workspace = flat(workspace)};
  const ParameterView<const float> p(params.data());
  const ParameterView<float> g(grads.data());
  expect_error([&] { model.backward_input(be, block, p, g, a, flat(stash)); },
               "gpt2 backward_input: argument stash element count");
  expect_error([&] { model.backward_weight(be, block, p, g, a, Tensor<float>{}); },
               "gpt2 backward_weight: argument stash element count");
  // A layer without a stash takes an empty one or one of zero elements, not more.
  std::vector<float> head_stash(1);
  expect_error([&] { model.backward_weight(be, gpt2::head_layer(c), p, g, a, flat(head_stash)); },
               "gpt2 backward_weight: argument stash element count");
}

}  // namespace test_gpt2_split_backward
