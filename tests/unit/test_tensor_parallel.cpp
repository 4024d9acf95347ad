// Tensor parallelism for GPT-2 (Megatron's split), tested against one rank: the sharding map
// and initial values, each layer (embedding, block, head) forward and backward with tp = 2 and 4
// in double and float (and with sequence parallelism, each rank passing its rows of the hidden
// state), the padded vocabulary, 5 AdamW steps of the whole model, and the rejected
// configurations. TP ranks are threads; results are collected per rank and checked after join
// (doctest's assertions are not thread-safe).

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/gradcheck.hpp"
#include "support/training.hpp"

namespace test_tensor_parallel {

using namespace loom;
using namespace loom::test;

namespace {

//! 4 heads of 8 channels, a vocabulary of 50 padded to 64 (the last rank of tp = 4 holds 2 real
//! rows and 14 padding rows).
gpt2::Config tp_config() {
  return {.max_seq_len = 8, .vocab_size = 50, .padded_vocab_size = 64, .num_layers = 2, .num_heads = 4,
          .channels = 32};
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

//! Global flat indices, in local order, of the elements rank `rank` of `tp` holds of parameter
//! `name` (global shape `g`): Megatron's split written out by name, independently of
//! ParameterSpec::global_index, which the tests check against it.
std::vector<std::int64_t> expected_slice(const std::string& name, const Shape& g, std::int64_t tp, std::int64_t rank) {
  std::vector<std::int64_t> idx;
  const std::int64_t inner = g.numel() / g[0];  // elements per row of axis 0 (1 for a vector)
  const auto rows = [&](std::int64_t first, std::int64_t count) {
    for (std::int64_t r = first; r < first + count; ++r)
      for (std::int64_t c = 0; c < inner; ++c) idx.push_back(r * inner + c);
  };
  if (name == "wte" || ends_with(name, "mlp.fc.weight") || ends_with(name, "mlp.fc.bias")) {
    rows(rank * g[0] / tp, g[0] / tp);  // vocab-parallel / column-parallel: a block of rows
  } else if (ends_with(name, "attn.qkv.weight") || ends_with(name, "attn.qkv.bias")) {
    const std::int64_t C = g[0] / 3, per_rank = C / tp;  // this rank's heads in each of q, k, v
    for (std::int64_t part = 0; part < 3; ++part) rows(part * C + rank * per_rank, per_rank);
  } else if (ends_with(name, "attn.proj.weight") || ends_with(name, "mlp.proj.weight")) {
    const std::int64_t cols = g[1] / tp;  // row-parallel: a block of input columns
    for (std::int64_t r = 0; r < g[0]; ++r)
      for (std::int64_t c = rank * cols; c < (rank + 1) * cols; ++c) idx.push_back(r * g[1] + c);
  } else {
    for (std::int64_t i = 0; i < g.numel(); ++i) idx.push_back(i);  // replicated
  }
  return idx;
}

//! This rank's local buffer (laid out by `local`) cut from `global` (laid out by `whole`).
template <class T>
std::vector<T> slice_of(const std::vector<T>& global, const ParameterLayout& whole, const ParameterLayout& local,
                        std::int64_t tp, std::int64_t rank) {
  std::vector<T> out(static_cast<std::size_t>(local.total()));
  for (const auto& e : local.entries()) {
    const auto& g = whole.find(e.spec.name);
    const auto idx = expected_slice(e.spec.name, g.spec.shape, tp, rank);
    REQUIRE(static_cast<std::int64_t>(idx.size()) == e.numel());
    for (std::int64_t i = 0; i < e.numel(); ++i) out[e.offset + i] = global[g.offset + idx[i]];
  }
  return out;
}

//! max |a - b| / max |b|: the error relative to the tensor's scale (reassociated sums differ
//! by round-off of the terms, not of the result).
template <class A, class B>
double scaled_error(const A& a, const B& b) {
  REQUIRE(a.size() == b.size());
  double diff = 0, scale = 1e-300;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

//! What one layer's forward and backward produced on one rank.
template <class T>
struct LayerRun {
  double loss = 0;
  std::vector<T> output, input_grad, grads;  // grads in the rank's local layout
};

//! Runs `layer` of `model` forward then backward on `batch`, with parameters `params` (local
//! layout), the layer's input `input` and output gradient `output_grad` (the rank's hidden
//! state each: [B, T, C], or its rows under sequence parallelism).
template <class T>
LayerRun<T> run_layer(const gpt2::Model<cpu, T>& model, cpu& be, int layer, const std::vector<T>& params,
                      const TestBatch& batch, const std::vector<T>& input, const std::vector<T>& output_grad) {
  const MicroBatchShape s{batch.batch, batch.seq};
  const std::int64_t C = model.config().channels;
  const bool first = layer == gpt2::embedding_layer, last = layer == gpt2::head_layer(model.config());
  const Shape hidden = model.sequence_parallel() ? Shape{model.hidden_elements(s) / C, C} : Shape{s.batch, s.seq, C};
  LayerRun<T> run;
  std::vector<T> saved(static_cast<std::size_t>(model.activation_elements(layer, s)));
  std::vector<T> workspace(static_cast<std::size_t>(model.workspace_elements(layer, s)));
  run.output.assign(last ? 0 : static_cast<std::size_t>(hidden.numel()), T(0));
  run.input_grad.assign(first ? 0 : static_cast<std::size_t>(hidden.numel()), T(0));
  run.grads.assign(static_cast<std::size_t>(model.layout().total()), T(0));
  const ParameterView<const T> p(params.data());
  ForwardArgs<T> f{.tokens = batch.tokens_view(), .targets = batch.targets_view(),
                   .input = first ? Tensor<const T>{} : Tensor<const T>(input.data(), hidden),
                   .output = last ? Tensor<T>{} : Tensor<T>(run.output.data(), hidden),
                   .saved = Tensor<T>(saved.data(), {static_cast<std::int64_t>(saved.size())})};
  run.loss = model.forward(be, layer, p, f);
  BackwardArgs<T> b{.tokens = f.tokens, .targets = f.targets, .input = f.input,
                    .output_grad = last ? Tensor<const T>{} : Tensor<const T>(output_grad.data(), hidden),
                    .input_grad = first ? Tensor<T>{} : Tensor<T>(run.input_grad.data(), hidden),
                    .saved = f.saved,
                    .workspace = Tensor<T>(workspace.data(), {static_cast<std::int64_t>(workspace.size())}),
                    .loss_scale = static_cast<T>(1.0 / static_cast<double>(s.batch * s.seq))};
  model.backward(be, layer, p, ParameterView<T>(run.grads.data()), b);
  return run;
}

//! Random global parameters (not GPT-2's init: non-zero biases and far-from-uniform attention
//! exercise every path), laid out by `whole`.
template <class T>
std::vector<T> random_parameters(const ParameterLayout& whole) {
  auto v = random_vector<T>(static_cast<std::size_t>(whole.total()), 17, -0.3, 0.3);
  for (const auto& e : whole.entries())
    if (ends_with(e.spec.name, "ln_1.weight") || ends_with(e.spec.name, "ln_2.weight") || e.spec.name == "ln_f.weight")
      for (std::int64_t i = 0; i < e.numel(); ++i) v[e.offset + i] += T(1);
  return v;
}

//! Rows [rank·n, (rank + 1)·n) of a [N, C] tensor held flat, n = N / tp.
template <class T>
std::vector<T> rows_of(const std::vector<T>& whole, std::int64_t tp, std::int64_t rank) {
  const auto n = static_cast<std::int64_t>(whole.size()) / tp;
  return {whole.begin() + rank * n, whole.begin() + (rank + 1) * n};
}

//! Layer `layer` with tp ranks against one rank: outputs, loss, input gradients and every
//! parameter-gradient slice within `tol` of the one-rank values; replicated gradients equal on
//! every rank. With `sequence_parallel` each rank passes and gets its rows of the hidden state.
template <class T>
double check_layer(int layer, std::int64_t tp, double tol, bool sequence_parallel = false) {
  gpt2::Config c = tp_config();
  c.sequence_parallel = sequence_parallel;
  const TestBatch batch = make_batch(3, 2, 8, c.vocab_size);
  const std::int64_t hidden = batch.batch * batch.seq * c.channels;
  const auto input = random_vector<T>(static_cast<std::size_t>(hidden), 31, -1.0, 1.0);
  const auto output_grad = random_vector<T>(static_cast<std::size_t>(hidden), 37, -1.0, 1.0);

  cpu be(1);
  const gpt2::Model<cpu, T> whole(c);
  const std::vector<T> params = random_parameters<T>(whole.layout());
  const LayerRun<T> want = run_layer(whole, be, layer, params, batch, input, output_grad);

  std::vector<LayerRun<T>> runs(static_cast<std::size_t>(tp));
  std::vector<std::vector<T>> want_grads(static_cast<std::size_t>(tp));
  std::vector<ParameterLayout> layouts(static_cast<std::size_t>(tp));
  threads::run(static_cast<int>(tp), [&](threads::Communicator& comm) {
    cpu rank_be(1);
    const gpt2::Model<cpu, T> model(c, CommunicatorRef(comm));
    const auto r = static_cast<std::size_t>(comm.rank());
    layouts[r] = model.layout();
    const auto hidden = [&](const std::vector<T>& v) { return sequence_parallel ? rows_of(v, tp, comm.rank()) : v; };
    runs[r] = run_layer(model, rank_be, layer, slice_of(params, whole.layout(), model.layout(), tp, comm.rank()),
                        batch, hidden(input), hidden(output_grad));
  });
  double worst = 0;
  const auto within = [&](double error) {
    worst = std::max(worst, error);
    return error <= tol;
  };
  for (std::int64_t r = 0; r < tp; ++r) {
    CAPTURE(r);
    const LayerRun<T>& got = runs[r];
    CHECK(within(std::abs(got.loss - want.loss) / std::max(1.0, std::abs(want.loss))));
    const auto hidden = [&](const std::vector<T>& v) { return sequence_parallel ? rows_of(v, tp, r) : v; };
    CHECK(within(scaled_error(got.output, hidden(want.output))));
    CHECK(within(scaled_error(got.input_grad, hidden(want.input_grad))));
    const std::vector<T> want_slice = slice_of(want.grads, whole.layout(), layouts[r], tp, r);
    for (const auto& e : layouts[r].entries()) {
      const std::vector<T> g(got.grads.begin() + e.offset, got.grads.begin() + e.offset + e.numel());
      const std::vector<T> w(want_slice.begin() + e.offset, want_slice.begin() + e.offset + e.numel());
      CAPTURE(e.spec.name);
      CHECK(within(scaled_error(g, w)));
      if (e.spec.replicated_over_tensor_parallel())
        CHECK(std::equal(g.begin(), g.end(), runs[0].grads.begin() + e.offset));  // the same bits on every rank
    }
  }
  // The layer was not trivially zero.
  CHECK(std::any_of(want.grads.begin(), want.grads.end(), [](T x) { return x != T(0); }));
  return worst;
}

}  // namespace

TEST_CASE("the sharding map: every rank's initial values are its slice of the one-rank values, bit for bit") {
  const gpt2::Config c = tp_config();
  const ParameterLayout whole(gpt2::parameter_specs(c));
  std::vector<float> global(static_cast<std::size_t>(whole.total()));
  whole.initialize(global.data(), 5);
  for (std::int64_t tp : {1, 2, 4}) {
    CAPTURE(tp);
    std::vector<std::vector<float>> local(static_cast<std::size_t>(tp)), ranged(static_cast<std::size_t>(tp));
    std::vector<ParameterLayout> layouts(static_cast<std::size_t>(tp));
    threads::run(static_cast<int>(tp), [&](threads::Communicator& comm) {
      const gpt2::Model<cpu, float> model(c, CommunicatorRef(comm));
      const auto r = static_cast<std::size_t>(comm.rank());
      layouts[r] = model.layout();
      local[r].resize(static_cast<std::size_t>(model.layout().total()));
      model.layout().initialize(local[r].data(), 5);
      // The ranged form (a ZeRO-3 shard of a TP shard) computes the same elements.
      const std::int64_t begin = model.layout().total() / 3, end = 2 * model.layout().total() / 3;
      ranged[r].resize(static_cast<std::size_t>(end - begin));
      model.layout().initialize(ranged[r].data(), begin, end, 5);
    });
    std::int64_t stored = 0;
    for (std::int64_t r = 0; r < tp; ++r) {
      CAPTURE(r);
      const ParameterLayout& layout = layouts[r];
      REQUIRE(layout.entries().size() == whole.entries().size());
      for (std::size_t i = 0; i < whole.entries().size(); ++i) {
        const auto& e = layout.entries()[i];
        const auto& g = whole.entries()[i];
        CAPTURE(e.spec.name);
        CHECK(e.spec.name == g.spec.name);  // same names, order and owning layers
        CHECK(e.spec.layer == g.spec.layer);
        CHECK(e.spec.global_shape == g.spec.shape);
        CHECK(e.spec.replicated_over_tensor_parallel() == (e.spec.partition == Partition::replicated));
        CHECK(e.numel() * (e.spec.replicated_over_tensor_parallel() ? 1 : tp) == g.numel());
        // ParameterSpec::global_index is Megatron's split, qkv included.
        const auto idx = expected_slice(e.spec.name, g.spec.shape, tp, r);
        bool same = true;
        for (std::int64_t k = 0; k < e.numel(); ++k) same = same && e.spec.global_index(k) == idx[k];
        CHECK(same);
        stored += e.spec.replicated_over_tensor_parallel() ? (r == 0 ? e.numel() : 0) : e.numel();
      }
      CHECK(local[r] == slice_of(global, whole, layout, tp, r));
      const std::int64_t begin = layout.total() / 3;
      CHECK(std::equal(ranged[r].begin(), ranged[r].end(), local[r].begin() + begin));
    }
    CHECK(stored == whole.total());  // the slices cover the global parameters exactly once
  }
  // The replicated parameters, which a TP-aware gradient norm counts once.
  const gpt2::Model<cpu, float> model(c);
  for (const auto& e : model.layout().entries()) {
    CAPTURE(e.spec.name);
    const bool replicated = e.spec.name == "wpe" || e.spec.name.find("ln_") != std::string::npos ||
                            ends_with(e.spec.name, "proj.bias");
    CHECK(e.spec.replicated_over_tensor_parallel() == replicated);
  }
}

TEST_CASE("a fused qkv shard holds its heads' rows of q, of k and of v") {
  ParameterSpec qkv{"h.0.attn.qkv.weight", {12, 2}, 1, true, Partition::split_rows, Init::normal(0.02)};
  qkv.shard.groups = 3;
  const ParameterSpec rank1 = tensor_parallel_slice(qkv, 2, 1);
  CHECK(rank1.shape == Shape{6, 2});
  CHECK(rank1.global_shape == Shape{12, 2});
  // Local rows 0-1 are q rows 2-3, local rows 2-3 are k rows 6-7, local 4-5 are v rows 10-11.
  const std::int64_t want_rows[] = {2, 3, 6, 7, 10, 11};
  for (std::int64_t i = 0; i < 12; ++i) CHECK(rank1.global_index(i) == want_rows[i / 2] * 2 + i % 2);
  const ParameterSpec proj = tensor_parallel_slice({"p", {2, 4}, 1, true, Partition::split_cols}, 2, 1);
  CHECK(proj.shape == Shape{2, 2});
  const std::int64_t want_cols[] = {2, 3, 6, 7};
  for (std::int64_t i = 0; i < 4; ++i) CHECK(proj.global_index(i) == want_cols[i]);
  expect_error([&] { tensor_parallel_slice(qkv, 3, 0); }, "must be a multiple of 3 blocks x the tensor-parallel size (3)");
  ParameterSpec lying = rank1;
  lying.shape = Shape{4, 2};
  expect_error([&] { ParameterLayout(std::vector<ParameterSpec>{lying}); }, "must be the slice [6, 2]");
}

TEST_CASE("global_run: from every element, the longest run that is contiguous both locally and globally") {
  // Brute force against global_index: rows and columns split, 1 and 3 blocks, 2 and 4 ranks,
  // a vector and matrices, every rank and every starting element.
  struct Case {
    Shape shape;
    Partition partition;
    std::int64_t groups;
  };
  const Case cases[] = {{{24, 5}, Partition::split_rows, 1}, {{24, 5}, Partition::split_rows, 3},
                        {{24}, Partition::split_rows, 3},    {{5, 24}, Partition::split_cols, 1},
                        {{3, 24}, Partition::split_cols, 3}, {{7, 5}, Partition::replicated, 1}};
  for (const Case& c : cases) {
    for (const std::int64_t ranks : {2, 4}) {
      for (std::int64_t rank = 0; rank < ranks; ++rank) {
        ParameterSpec whole{"p", c.shape, 0, true, c.partition};
        whole.shard.groups = c.groups;
        const ParameterSpec spec = tensor_parallel_slice(whole, ranks, rank);
        CAPTURE(spec.shape);
        CAPTURE(spec.shard);
        const std::int64_t n = spec.shape.numel();
        bool exact = true;
        for (std::int64_t i = 0; i < n; ++i) {
          const ParameterSpec::GlobalRun run = spec.global_run(i);
          exact = exact && run.count >= 1 && i + run.count <= n;
          for (std::int64_t k = 0; exact && k < run.count; ++k) exact = spec.global_index(i + k) == run.global + k;
          // Longest: the next element is not the next global position.
          exact = exact && (i + run.count == n || spec.global_index(i + run.count) != run.global + run.count);
        }
        CHECK(exact);
      }
    }
  }
}

TEST_CASE_TEMPLATE("each GPT-2 layer with tp = 2 and 4 matches one rank, forward and backward, and with sequence "
                   "parallelism on its rows", T, double, float) {
  const double tol = tolerance<T>();
  const int head = gpt2::head_layer(tp_config());
  for (const bool sequence_parallel : {false, true}) {
    double worst = 0;
    for (std::int64_t tp : {2, 4})
      for (int layer : {gpt2::embedding_layer, gpt2::block_layer(0), gpt2::block_layer(1), head}) {
        CAPTURE(sequence_parallel);
        CAPTURE(tp);
        CAPTURE(layer);
        worst = std::max(worst, check_layer<T>(layer, tp, tol, sequence_parallel));
      }
    MESSAGE("sequence parallel " << sequence_parallel << ": worst error relative to the tensor's largest element: "
                                 << worst << " (bound " << tol << ")");
  }
}

TEST_CASE("a padded vocabulary split over tp ranks gives one rank's loss; padding never contributes") {
  // 50 of 64 rows real with tp = 4: the last rank holds 2 real rows; with 40 real rows it holds
  // none. Padded rows set to 1e3 would dominate the softmax if they were not masked (the
  // Megatron padding bug: a loss far off one rank's).
  for (const std::int64_t vocab : {50, 40}) {
    CAPTURE(vocab);
    gpt2::Config c = tp_config();
    c.vocab_size = vocab;
    const TestBatch batch = make_batch(0, 4, 8, vocab);
    using Gpt = gpt2::Model<cpu, double>;
    const TrainerOptions options{.micro_batch_size = 2, .seed = 5};
    cpu be(1);
    Trainer<Gpt, AdamW> one(be, Gpt(c), AdamW(), ConstantLr{.lr = 0.0}, options);
    const double want = one.evaluate(batch);
    for (std::int64_t tp : {2, 4}) {
      CAPTURE(tp);
      std::vector<double> plain(static_cast<std::size_t>(tp)), poisoned(static_cast<std::size_t>(tp));
      threads::run(static_cast<int>(tp), [&](threads::Communicator& comm) {
        cpu rank_be(1);
        Trainer<Gpt, AdamW> trainer(rank_be, Gpt(c, CommunicatorRef(comm)), AdamW(), ConstantLr{.lr = 0.0}, options);
        const auto r = static_cast<std::size_t>(comm.rank());
        plain[r] = trainer.evaluate(batch);
        const Gpt& m = trainer.model();
        const auto& wte = m.layout().find("wte");
        for (std::int64_t row = 0; row < m.vocab_rows(); ++row)
          if (m.vocab_begin() + row >= vocab)
            for (std::int64_t j = 0; j < c.channels; ++j)
              trainer.mutable_parameters()[wte.offset + row * c.channels + j] = 1e3;
        poisoned[r] = trainer.evaluate(batch);
      });
      for (std::int64_t r = 0; r < tp; ++r) {
        CAPTURE(r);
        CHECK(std::abs(plain[r] - want) <= 1e-12 * want);
        CHECK(poisoned[r] == plain[r]);
        CHECK(plain[r] == plain[0]);  // the same loss on every rank
      }
    }
  }
}

TEST_CASE("5 AdamW steps with tp = 2 and 4 (SingleRank on each TP rank) match one rank") {
  const gpt2::Config c = tp_config();
  using Gpt = gpt2::Model<cpu, float>;
  const auto lr = WarmupCosineLr{.lr = 1e-2, .warmup = 2, .total_steps = 5, .min_lr_factor = 0.1};
  const TrainerOptions options{.micro_batch_size = 2, .seed = 5};  // no clipping: that needs the TP-aware norm
  const auto train = [&](Trainer<Gpt, AdamW>& trainer, std::vector<double>& losses) {
    for (int s = 0; s < 5; ++s) losses.push_back(trainer.step(make_batch(s, 4, 8, c.vocab_size)).loss);
  };
  cpu be(1);
  Trainer<Gpt, AdamW> one(be, Gpt(c), AdamW({.weight_decay = 0.1}), lr, options);
  std::vector<double> want_losses;
  train(one, want_losses);
  const std::vector<float> want_weights(one.parameters(), one.parameters() + one.model().layout().total());

  for (std::int64_t tp : {2, 4}) {
    CAPTURE(tp);
    std::vector<std::vector<double>> losses(static_cast<std::size_t>(tp));
    std::vector<std::vector<float>> weights(static_cast<std::size_t>(tp));
    std::vector<ParameterLayout> layouts(static_cast<std::size_t>(tp));
    threads::run(static_cast<int>(tp), [&](threads::Communicator& comm) {
      cpu rank_be(1);
      const auto r = static_cast<std::size_t>(comm.rank());
      Trainer<Gpt, AdamW> trainer(rank_be, Gpt(c, CommunicatorRef(comm)), AdamW({.weight_decay = 0.1}), lr, options);
      train(trainer, losses[r]);
      layouts[r] = trainer.model().layout();
      weights[r].assign(trainer.parameters(), trainer.parameters() + layouts[r].total());
    });
    double worst_loss = 0, worst_weights = 0;
    for (std::int64_t r = 0; r < tp; ++r) {
      CAPTURE(r);
      for (std::size_t s = 0; s < want_losses.size(); ++s) {
        CAPTURE(s);
        const double error = std::abs(losses[r][s] - want_losses[s]) / std::abs(want_losses[s]);
        worst_loss = std::max(worst_loss, error);
        CHECK(error <= 1e-5);
        CHECK(losses[r][s] == losses[0][s]);
      }
      const std::vector<float> want = slice_of(want_weights, one.model().layout(), layouts[r], tp, r);
      const double error = relative_difference(weights[r].data(), want.data(), static_cast<std::int64_t>(want.size()));
      worst_weights = std::max(worst_weights, error);
      CHECK(error <= 1e-5);
    }
    MESSAGE("tp " << tp << ": worst relative loss error " << worst_loss << ", weights " << worst_weights);
    CHECK(want_losses.back() < want_losses.front());  // it learned something
  }
}

TEST_CASE("configurations that do not split over the tensor-parallel group are rejected before any work") {
  gpt2::Config eight = tp_config();
  eight.num_heads = 8;  // 8 heads of 4 channels split over 8 ranks
  gpt2::Config six_heads{.max_seq_len = 8, .vocab_size = 50, .padded_vocab_size = 64, .num_layers = 1,
                         .num_heads = 6, .channels = 24};  // 24 channels split over 4; 6 heads do not
  gpt2::Config channels{.max_seq_len = 8, .vocab_size = 50, .padded_vocab_size = 64, .num_layers = 1,
                        .num_heads = 3, .channels = 18};  // 18 channels (and 72 MLP channels) over 4
  gpt2::Config vocab = tp_config();
  vocab.padded_vocab_size = 50;  // 50 rows of wte over 4 ranks
  expect_error([&] { six_heads.validate_tensor_parallel(4); }, "gpt2 config: num_heads: got 6");
  expect_error([&] { six_heads.validate_tensor_parallel(4); }, "attention is split by whole heads");
  expect_error([&] { channels.validate_tensor_parallel(4); }, "gpt2 config: channels: got 18");
  expect_error([&] { channels.validate_tensor_parallel(4); }, "multiple of the tensor-parallel size (4)");
  expect_error([&] { vocab.validate_tensor_parallel(4); }, "gpt2 config: padded_vocab_size: got 50");
  expect_error([&] { vocab.validate_tensor_parallel(4); }, "gpt2::pad_vocab");
  CHECK_NOTHROW(vocab.validate_tensor_parallel(2));
  CHECK_NOTHROW(eight.validate_tensor_parallel(8));
  // The Model's constructor rejects them on every rank, before any collective.
  for (const gpt2::Config& bad : {six_heads, channels, vocab}) {
    CAPTURE(bad);
    expect_error(
        [&] {
          threads::run(4, [&](threads::Communicator& comm) { gpt2::Model<cpu, float> m(bad, CommunicatorRef(comm)); });
        },
        "must be a multiple of the tensor-parallel size (4)");
  }
}

}  // namespace test_tensor_parallel
