// GPT-2 generation: sample_token's distribution at known draws, next_logits against the loss the
// Trainer computes, greedy generation of a learned chain, draws keyed by seed and position, and
// bad input refused.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <span>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"
#include "loom/models/gpt2/generate.hpp"
#include "support/error_of.hpp"
#include "support/training.hpp"

namespace test_gpt2_generate {

using namespace loom;
using namespace loom::test;

namespace {

using Gpt = gpt2::Model<cpu, double>;

//! The largest |a[i] - b[i]|.
double max_difference(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

//! Draws `n` evenly spaced u in (0, 1) and counts the tokens sample_token gives.
std::vector<std::int64_t> counts_over_grid(std::span<const double> logits, const gpt2::SamplingOptions& o, int n) {
  std::vector<std::int64_t> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) ++counts[static_cast<std::size_t>(gpt2::sample_token(logits, o, (i + 0.5) / n))];
  return counts;
}

}  // namespace

TEST_CASE("sample_token: greedy, temperature and top-k as the inverse of the softmax's distribution") {
  const std::vector<double> logits{1, 3, 2, 3};
  // Order by logit, ties to the lower id: 1, 3, 2, 0; weights 1, 1, e^-1, e^-2.
  const double sum = 2 + std::exp(-1.0) + std::exp(-2.0);
  SUBCASE("temperature 0 takes the largest logit, the lower id on a tie") {
    CHECK(gpt2::sample_token(logits, {.temperature = 0}, 0.999) == 1);
  }
  SUBCASE("temperature 1: each token over its share of (0, 1)") {
    CHECK(gpt2::sample_token(logits, {}, 0.5 / sum) == 1);
    CHECK(gpt2::sample_token(logits, {}, 1.5 / sum) == 3);
    CHECK(gpt2::sample_token(logits, {}, 2.2 / sum) == 2);
    CHECK(gpt2::sample_token(logits, {}, 0.9999) == 0);
    const int n = 100000;
    const auto counts = counts_over_grid(logits, {}, n);
    const std::vector<double> p{std::exp(-2.0) / sum, 1 / sum, std::exp(-1.0) / sum, 1 / sum};
    for (std::size_t t = 0; t < p.size(); ++t) CHECK(double(counts[t]) / n == doctest::Approx(p[t]).epsilon(1e-4));
  }
  SUBCASE("temperature 2 flattens, 0.5 sharpens") {
    const int n = 100000;
    for (double temperature : {0.5, 2.0}) {
      CAPTURE(temperature);
      const auto counts = counts_over_grid(logits, {.temperature = temperature}, n);
      double z = 0;
      for (double l : logits) z += std::exp(l / temperature);
      for (std::size_t t = 0; t < logits.size(); ++t)
        CHECK(double(counts[t]) / n == doctest::Approx(std::exp(logits[t] / temperature) / z).epsilon(1e-3));
    }
  }
  SUBCASE("top_k keeps the k largest logits") {
    const auto two = counts_over_grid(logits, {.top_k = 2}, 1000);
    CHECK(two[0] == 0);
    CHECK(two[2] == 0);
    CHECK(two[1] == 500);
    CHECK(two[3] == 500);
    CHECK(counts_over_grid(logits, {.top_k = 1}, 1000)[1] == 1000);
    CHECK(counts_over_grid(logits, {.top_k = 99}, 1000) == counts_over_grid(logits, {}, 1000));
  }
  SUBCASE("bad input names the value") {
    CHECK(contains(error_of([&] { (void)gpt2::sample_token(logits, {.temperature = -1}, 0.5); }),
                   "sampling: temperature: got -1; must be finite and >= 0"));
    CHECK(contains(error_of([&] { (void)gpt2::sample_token(logits, {.top_k = -2}, 0.5); }),
                   "sampling: top_k: got -2; must be >= 0"));
    CHECK(contains(error_of([&] { (void)gpt2::sample_token(logits, {}, 1.0); }), "sample_token: u: got 1; must be in (0, 1)"));
    const std::vector<double> bad{0, std::numeric_limits<double>::quiet_NaN()};
    CHECK(contains(error_of([&] { (void)gpt2::sample_token(bad, {}, 0.5); }), "sample_token: logit of token 1"));
    CHECK(contains(error_of([&] { (void)gpt2::sample_token(std::span<const double>{}, {}, 0.5); }),
                   "sample_token: logits: got 0"));
  }
}

TEST_CASE("next_logits: each next token's log-probability gives the loss the Trainer computes") {
  const gpt2::Config config = small_test_config();
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(config), AdamW(), ConstantLr{.lr = 1e-2}, {.micro_batch_size = 1, .seed = 3});
  for (std::int64_t s = 0; s < 3; ++s) trainer.step(make_batch(s, 2, config.max_seq_len, config.vocab_size));
  const std::vector<double> whole = trainer.gather_parameters();
  const Gpt one(config);
  gpt2::Generator<cpu, double> generator(be, one, ParameterView<const double>(whole.data()));

  const TestBatch sequence = make_batch(9, 1, 13, config.vocab_size);
  double loss = 0;
  for (std::size_t t = 0; t < sequence.tokens.size(); ++t) {
    const std::vector<double> logits = generator.next_logits(std::span(sequence.tokens).first(t + 1));
    REQUIRE(logits.size() == static_cast<std::size_t>(config.vocab_size));
    double top = logits[0];
    for (double l : logits) top = std::max(top, l);
    double z = 0;
    for (double l : logits) z += std::exp(l - top);
    loss += top + std::log(z) - logits[static_cast<std::size_t>(sequence.targets[t])];
  }
  loss /= static_cast<double>(sequence.tokens.size());
  CHECK(loss == doctest::Approx(trainer.evaluate(sequence)).epsilon(1e-11));

  // A context longer than max_seq_len is read from its last max_seq_len tokens (bit for bit
  // without the cache; with it the second call runs one position against the cache, whose GEMM
  // shapes round differently).
  const TestBatch longer = make_batch(4, 1, 40, config.vocab_size);
  const auto last = std::span(longer.tokens).last(static_cast<std::size_t>(config.max_seq_len));
  gpt2::Generator<cpu, double> full(be, one, ParameterView<const double>(whole.data()), gpt2::Decoding::full_context);
  CHECK(full.next_logits(longer.tokens) == full.next_logits(last));
  CHECK(max_difference(generator.next_logits(longer.tokens), generator.next_logits(last)) < 1e-12);
}

namespace {

//! The two decodings' next_logits over a run of contexts, and the largest difference between
//! them relative to the largest logit.
template <class T>
struct DecodingPair {
  gpt2::Model<cpu, T> model;
  std::vector<T> params;
  cpu be{2};
  gpt2::Generator<cpu, T> cached, full;

  DecodingPair(const gpt2::Config& config, std::uint64_t seed)
      : model(config),
        params(initial_parameters(model, seed)),
        cached(be, model, ParameterView<const T>(params.data())),
        full(be, model, ParameterView<const T>(params.data()), gpt2::Decoding::full_context) {}

  static std::vector<T> initial_parameters(const gpt2::Model<cpu, T>& m, std::uint64_t seed) {
    std::vector<T> p(static_cast<std::size_t>(m.layout().total()));
    m.layout().initialize(p.data(), seed);
    return p;
  }
  double relative_difference(std::span<const std::int32_t> context) {
    const std::vector<double> a = cached.next_logits(context), b = full.next_logits(context);
    double top = 0;
    for (double x : b) top = std::max(top, std::abs(x));
    return max_difference(a, b) / top;
  }
};

}  // namespace

TEST_CASE_TEMPLATE("the key/value cache gives the whole context's logits, whatever the last call ran", T, double, float,
                   bf16) {
  gpt2::Config config = small_test_config();
  config.max_seq_len = 24;
  DecodingPair<T> pair(config, 11);
  // Rounding: double's, float's over a few layers (GEMMs of other shapes sum in other orders),
  // and bf16's (a rounding is up to 2^-9 relative).
  const double tolerance = std::is_same_v<T, double> ? 1e-13 : std::is_same_v<T, float> ? 2e-6 : 1e-2;
  const TestBatch text = make_batch(2, 1, 60, config.vocab_size);
  const std::span<const std::int32_t> tokens(text.tokens);
  double worst = 0;
  // Growing by one token a call, past max_seq_len (where the window slides and runs whole).
  for (std::size_t t = 1; t <= tokens.size(); ++t) worst = std::max(worst, pair.relative_difference(tokens.first(t)));
  CHECK(worst < tolerance);
  worst = 0;
  // The same context twice; a shorter one; one that parts from the cached tokens after 9; one
  // that grows by 5 at once; one that starts anew.
  std::vector<std::int32_t> branch(tokens.begin(), tokens.begin() + 12);
  branch[9] = (branch[9] + 1) % static_cast<std::int32_t>(config.vocab_size);
  for (const std::span<const std::int32_t> context :
       {tokens.first(20), tokens.first(20), tokens.first(7), std::span<const std::int32_t>(branch), tokens.first(17),
        tokens.subspan(30, 10)})
    worst = std::max(worst, pair.relative_difference(context));
  CHECK(worst < tolerance);
  if constexpr (std::is_same_v<T, double>) {
    // The same text, greedy and drawn.
    const std::vector<std::int32_t> prompt(tokens.begin(), tokens.begin() + 3);
    for (const gpt2::SamplingOptions& o : {gpt2::SamplingOptions{.max_new_tokens = 40, .temperature = 0},
                                           gpt2::SamplingOptions{.max_new_tokens = 40, .temperature = 1.5, .seed = 4}})
      CHECK(pair.cached.generate(prompt, o) == pair.full.generate(prompt, o));
  }
}

TEST_CASE_TEMPLATE("texts that grow together get each one's whole-context logits, and the texts each gets alone", T,
                   double, float, bf16) {
  gpt2::Config config = small_test_config();
  config.max_seq_len = 24;
  DecodingPair<T> pair(config, 11);
  const double tolerance = std::is_same_v<T, double> ? 1e-13 : std::is_same_v<T, float> ? 2e-6 : 1e-2;
  // Four texts of 40 tokens, the fourth the first again; each starts from a prompt of its own
  // length (3, 1, 7, 3), so they reach max_seq_len (and slide) on different calls.
  std::vector<std::vector<std::int32_t>> texts;
  for (std::uint64_t seed : {2, 3, 4, 2}) texts.push_back(make_batch(static_cast<std::int64_t>(seed), 1, 40, config.vocab_size).tokens);
  const std::vector<std::size_t> prompt_lengths{3, 1, 7, 3};
  double worst = 0;
  const auto compare = [&](const std::vector<std::vector<std::int32_t>>& contexts) {
    const std::vector<std::vector<double>> together = pair.cached.next_logits_batch(contexts);
    REQUIRE(together.size() == contexts.size());
    for (std::size_t s = 0; s < contexts.size(); ++s) {
      const std::vector<double> alone = pair.full.next_logits(contexts[s]);
      double top = 0;
      for (double x : alone) top = std::max(top, std::abs(x));
      worst = std::max(worst, max_difference(together[s], alone) / top);
    }
  };
  for (std::size_t t = 0; t + 7 <= 40; ++t) {
    std::vector<std::vector<std::int32_t>> contexts;
    for (std::size_t s = 0; s < texts.size(); ++s)
      contexts.emplace_back(texts[s].begin(), texts[s].begin() + static_cast<std::ptrdiff_t>(prompt_lengths[s] + t));
    compare(contexts);
  }
  // One context branches while the others grow: it runs alone, they together; then fewer
  // contexts than sequences, and the same ones in another order.
  std::vector<std::vector<std::int32_t>> mixed{std::vector<std::int32_t>(texts[0].begin(), texts[0].begin() + 5),
                                               std::vector<std::int32_t>(texts[1].begin(), texts[1].begin() + 12),
                                               std::vector<std::int32_t>(texts[2].begin(), texts[2].begin() + 9)};
  compare(mixed);
  for (auto& context : mixed) context.push_back(context.front());
  mixed[1][4] = (mixed[1][4] + 1) % static_cast<std::int32_t>(config.vocab_size);
  compare(mixed);
  compare({mixed[2], mixed[0]});
  CHECK(worst < tolerance);

  if constexpr (std::is_same_v<T, double>) {
    std::vector<std::vector<std::int32_t>> prompts;
    for (std::size_t s = 0; s < texts.size(); ++s)
      prompts.emplace_back(texts[s].begin(), texts[s].begin() + static_cast<std::ptrdiff_t>(prompt_lengths[s]));
    // Greedy: each text is the one it gets alone, with the cache or without; past max_seq_len.
    const gpt2::SamplingOptions greedy{.max_new_tokens = 30, .temperature = 0};
    const auto greedy_texts = pair.cached.generate_batch(prompts, greedy);
    REQUIRE(greedy_texts.size() == 4);
    for (std::size_t s = 0; s < prompts.size(); ++s) {
      CHECK(greedy_texts[s] == pair.full.generate(prompts[s], greedy));
      CHECK(greedy_texts[s].size() == prompts[s].size() + 30);
    }
    // Drawn: text s draws from lane s, the same with the cache or without; text 0 as generate
    // draws; the fourth, from the first's prompt, draws apart from it.
    const gpt2::SamplingOptions drawn{.max_new_tokens = 30, .temperature = 1.5, .seed = 4};
    const auto drawn_texts = pair.cached.generate_batch(prompts, drawn);
    CHECK(drawn_texts == pair.full.generate_batch(prompts, drawn));
    CHECK(drawn_texts[0] == pair.full.generate(prompts[0], drawn));
    CHECK(drawn_texts[3] != drawn_texts[0]);
    // A text that generates stop_token stops alone; the others go on as they would alone.
    const std::int32_t stop = greedy_texts[1][prompts[1].size() + 2];
    gpt2::SamplingOptions stopping = greedy;
    stopping.stop_token = stop;
    const auto stopped = pair.cached.generate_batch(prompts, stopping);
    CHECK(stopped[1].size() <= prompts[1].size() + 3);
    CHECK(stopped[1].back() == stop);
    for (std::size_t s = 0; s < prompts.size(); ++s) CHECK(stopped[s] == pair.full.generate(prompts[s], stopping));
  }
}

TEST_CASE("generate_batch and next_logits_batch refuse empty lists and name the text at fault") {
  const gpt2::Config config = small_test_config();
  cpu be(1);
  const Gpt one(config);
  std::vector<double> params(static_cast<std::size_t>(one.layout().total()), 0.0);
  gpt2::Generator<cpu, double> generator(be, one, ParameterView<const double>(params.data()));
  const std::vector<std::vector<std::int32_t>> none;
  CHECK(contains(error_of([&] { (void)generator.generate_batch(none, {}); }), "generator: prompts: got 0; must be at least one"));
  CHECK(contains(error_of([&] { (void)generator.next_logits_batch(none); }), "generator: contexts: got 0; must be at least one"));
  const std::vector<std::vector<std::int32_t>> bad{{1, 2}, {3, 50}};
  CHECK(contains(error_of([&] { (void)generator.generate_batch(bad, {}); }),
                 "generator: prompt 1 token 1: got 50; must be in [0, vocab_size = 50)"));
  const std::vector<std::vector<std::int32_t>> empty_second{{1}, {}};
  CHECK(contains(error_of([&] { (void)generator.next_logits_batch(empty_second); }),
                 "generator: context 1 tokens: got 0; must be at least one"));
}

TEST_CASE("Model::decode refuses the head, positions past max_seq_len and mis-shaped caches") {
  const gpt2::Config config = small_test_config();
  cpu be(1);
  const Gpt one(config);
  std::vector<double> params(static_cast<std::size_t>(one.layout().total()), 0.0);
  const ParameterView<const double> view(params.data());
  const std::int64_t C = config.channels, T_max = config.max_seq_len;
  std::vector<double> input(2 * C), output(2 * C), keys(T_max * C), values(T_max * C);
  const std::vector<std::int32_t> tokens{1, 2};
  const gpt2::DecodeArgs<double> ok{.past = 3,
                                    .tokens = {tokens.data(), Shape{2}},
                                    .input = {input.data(), Shape{2, C}},
                                    .output = {output.data(), Shape{2, C}},
                                    .keys = {keys.data(), Shape{T_max, C}},
                                    .values = {values.data(), Shape{T_max, C}}};
  CHECK(error_of([&] { one.decode(be, 1, view, ok); }).empty());
  CHECK(error_of([&] { one.decode(be, 0, view, ok); }).empty());
  CHECK(contains(error_of([&] { one.decode(be, one.num_layers() - 1, view, ok); }),
                 "gpt2 decode: layer: got 3; must be the embedding (0) or a block (1..2)"));
  gpt2::DecodeArgs<double> late = ok;
  late.past = T_max - 1;
  CHECK(contains(error_of([&] { one.decode(be, 1, view, late); }),
                 "gpt2 decode: past: got 15; must be >= 0 and leave room for the 2 new positions in max_seq_len = 16"));
  gpt2::DecodeArgs<double> short_cache = ok;
  short_cache.values = {values.data(), Shape{T_max - 1, C}};
  CHECK(contains(error_of([&] { one.decode(be, 1, view, short_cache); }), "gpt2 decode: argument values"));
  const std::vector<std::int32_t> bad{1, 50};
  gpt2::DecodeArgs<double> bad_token = ok;
  bad_token.tokens = {bad.data(), Shape{2}};
  CHECK(contains(error_of([&] { one.decode(be, 0, view, bad_token); }), "got 50"));

  // Several sequences: one row each here; the rows must split evenly, each past must leave room,
  // and each cache must be [max_seq_len, C].
  std::vector<double> keys2(T_max * C), values2(T_max * C);
  std::vector<gpt2::DecodeSequence<double>> two{{.past = 3, .keys = {keys.data(), Shape{T_max, C}}, .values = {values.data(), Shape{T_max, C}}},
                                               {.past = 9, .keys = {keys2.data(), Shape{T_max, C}}, .values = {values2.data(), Shape{T_max, C}}}};
  gpt2::DecodeArgs<double> pair_args{.tokens = {tokens.data(), Shape{2}},
                                     .input = {input.data(), Shape{2, C}},
                                     .output = {output.data(), Shape{2, C}},
                                     .sequences = two};
  CHECK(error_of([&] { one.decode(be, 1, view, pair_args); }).empty());
  CHECK(error_of([&] { one.decode(be, 0, view, pair_args); }).empty());
  const std::vector<std::int32_t> three_tokens{1, 2, 3};
  std::vector<double> input3(3 * C), output3(3 * C);
  gpt2::DecodeArgs<double> uneven = pair_args;
  uneven.tokens = {three_tokens.data(), Shape{3}};
  uneven.input = {input3.data(), Shape{3, C}};
  uneven.output = {output3.data(), Shape{3, C}};
  CHECK(contains(error_of([&] { one.decode(be, 1, view, uneven); }),
                 "gpt2 decode: rows: got 3; must split evenly over the 2 sequences"));
  two[1].past = T_max;
  CHECK(contains(error_of([&] { one.decode(be, 1, view, pair_args); }),
                 "gpt2 decode: past of sequence 1: got 16; must be >= 0 and leave room for the 1 new positions"));
  two[1].past = 9;
  two[0].keys = {keys.data(), Shape{T_max - 1, C}};
  CHECK(contains(error_of([&] { one.decode(be, 1, view, pair_args); }), "gpt2 decode: argument keys"));
}

TEST_CASE("greedy generation follows the chain a trained model learned; draws are keyed by seed and position") {
  gpt2::Config config = small_test_config();
  const io::SyntheticMarkov chain({.vocab_size = config.vocab_size, .jump_probability = 0.0, .seed = 21});
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(config), AdamW(), ConstantLr{.lr = 1e-2}, {.micro_batch_size = 8, .seed = 3});
  double loss = 0;
  for (std::int64_t s = 0; s < 150; ++s) loss = trainer.step(chain.batch_at(s, 8, config.max_seq_len)).loss;
  CHECK(loss < 0.05);
  const std::vector<double> whole = trainer.gather_parameters();
  const Gpt one(config);
  gpt2::Generator<cpu, double> generator(be, one, ParameterView<const double>(whole.data()));
  const auto next = chain.permutation();

  // 30 new tokens: past max_seq_len (16), so the last ones are read from a cropped context.
  const std::vector<std::int32_t> prompt{7};
  const std::vector<std::int32_t> greedy = generator.generate(prompt, {.max_new_tokens = 30, .temperature = 0});
  REQUIRE(greedy.size() == 31);
  for (std::size_t i = 1; i < greedy.size(); ++i) CHECK(greedy[i] == next[static_cast<std::size_t>(greedy[i - 1])]);
  // top_k 1 draws from one token: greedy's.
  CHECK(generator.generate(prompt, {.max_new_tokens = 30, .top_k = 1, .seed = 5}) == greedy);
  // stop_token ends the text once generated.
  const std::int32_t third = greedy[3];
  const auto stopped = generator.generate(prompt, {.max_new_tokens = 30, .temperature = 0, .stop_token = third});
  CHECK(stopped == std::vector<std::int32_t>(greedy.begin(), greedy.begin() + 4));

  // Temperature 3 flattens the learned chain enough that two seeds part; one seed repeats.
  const gpt2::SamplingOptions hot{.max_new_tokens = 12, .temperature = 3.0, .seed = 1};
  const auto a = generator.generate(prompt, hot);
  CHECK(generator.generate(prompt, hot) == a);
  gpt2::SamplingOptions other = hot;
  other.seed = 2;
  CHECK(generator.generate(prompt, other) != a);
  // Draw i depends on the position alone: the text from a prompt that is a's first 5 tokens
  // goes on as a did.
  CHECK(generator.generate(std::span(a).first(5), {.max_new_tokens = 8, .temperature = 3.0, .seed = 1}) == a);
}

TEST_CASE("generation refuses a tensor-parallel slice, an empty prompt and tokens outside the vocabulary") {
  const gpt2::Config config = small_test_config();
  cpu be(1);
  const Gpt one(config);
  std::vector<double> params(static_cast<std::size_t>(one.layout().total()), 0.0);
  gpt2::Generator<cpu, double> generator(be, one, ParameterView<const double>(params.data()));
  CHECK(contains(error_of([&] { (void)generator.generate(std::vector<std::int32_t>{}, {}); }),
                 "generator: prompt tokens: got 0; must be at least one"));
  CHECK(contains(error_of([&] { (void)generator.generate(std::vector<std::int32_t>{3, 50}, {}); }),
                 "generator: prompt token 1: got 50; must be in [0, vocab_size = 50)"));
  CHECK(contains(error_of([&] { (void)generator.generate(std::vector<std::int32_t>{3}, {.max_new_tokens = -1}); }),
                 "sampling: max_new_tokens: got -1; must be >= 0"));
  CHECK(generator.generate(std::vector<std::int32_t>{3, 4}, {.max_new_tokens = 0}) == std::vector<std::int32_t>{3, 4});
  std::vector<std::string> messages(2);
  threads::run(2, [&](threads::Communicator& tp) {
    const Gpt slice(config, tp);
    messages[static_cast<std::size_t>(tp.rank())] =
        error_of([&] { gpt2::Generator<cpu, double>(be, slice, ParameterView<const double>(params.data())); });
  });
  for (const std::string& m : messages) CHECK(contains(m, "generator: tensor-parallel ranks: got 2; must be 1"));
}

}  // namespace test_gpt2_generate
