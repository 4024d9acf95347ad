#pragma once
//! \file Text generation with a trained GPT-2: the next token's logits after a context (with a
//! key/value cache, or over the whole context), and sampling from them (greedy, temperature,
//! top-k), on one rank of a host backend.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/rng.hpp"
#include "loom/core/tensor.hpp"
#include "loom/models/concepts.hpp"
#include "loom/models/gpt2/model.hpp"

namespace loom::gpt2 {

//! How Generator::generate picks each next token.
struct SamplingOptions {
  std::int64_t max_new_tokens = 64;  //!< tokens to add after the prompt (fewer if stop_token comes)
  //! Divides the logits before the softmax: below 1 sharpens, above 1 flattens; 0 takes the
  //! most likely token (greedy; ties go to the lowest id) and draws nothing.
  double temperature = 1.0;
  std::int64_t top_k = 0;       //!< draw among the k most likely tokens only; 0: the whole vocabulary
  std::uint64_t seed = 0;       //!< keys the draws: draw i is CounterRng(seed, "gpt2.sample") at the token's position
  std::int32_t stop_token = -1;  //!< stop once this token is generated (GPT-2's <|endoftext|> is 50256); -1: none

  //! Throws loom::Error naming the first value out of range.
  void validate() const {
    LOOM_CHECK(max_new_tokens >= 0, "sampling: max_new_tokens", max_new_tokens, "must be >= 0");
    LOOM_CHECK(std::isfinite(temperature) && temperature >= 0, "sampling: temperature", temperature,
               "must be finite and >= 0 (0 = greedy)");
    LOOM_CHECK(top_k >= 0, "sampling: top_k", top_k, "must be >= 0 (0 = the whole vocabulary)");
    LOOM_CHECK(stop_token >= -1, "sampling: stop_token", stop_token, "must be a token id, or -1 for none");
  }
  friend std::ostream& operator<<(std::ostream& out, const SamplingOptions& o) {
    return out << "{max_new_tokens=" << o.max_new_tokens << ", temperature=" << o.temperature
               << ", top_k=" << o.top_k << ", seed=" << o.seed << ", stop_token=" << o.stop_token << "}";
  }
};

//! The token `logits` (one per vocabulary entry) give under `options`' temperature and top_k,
//! for a uniform draw `u` in (0, 1): the inverse of the cumulative distribution of
//! softmax(logits / temperature) over the top_k largest logits (all where top_k is 0 or at
//! least the vocabulary), with the tokens in order of decreasing logit (ties: lower id first).
//! Temperature 0 returns the largest logit's token and ignores `u`.
inline std::int32_t sample_token(std::span<const double> logits, const SamplingOptions& options, double u) {
  options.validate();
  LOOM_CHECK(!logits.empty(), "sample_token: logits", logits.size(), "must hold at least one token's");
  LOOM_CHECK(u > 0 && u < 1, "sample_token: u", u, "must be in (0, 1)");
  const auto n = static_cast<std::int64_t>(logits.size());
  for (std::int64_t i = 0; i < n; ++i)
    LOOM_CHECK(std::isfinite(logits[static_cast<std::size_t>(i)]), "sample_token: logit of token " + std::to_string(i),
               logits[static_cast<std::size_t>(i)], "must be finite");
  if (options.temperature == 0)
    return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const std::int64_t k = options.top_k == 0 ? n : std::min(options.top_k, n);
  std::vector<std::int32_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  const auto before = [&](std::int32_t a, std::int32_t b) {
    const double la = logits[static_cast<std::size_t>(a)], lb = logits[static_cast<std::size_t>(b)];
    return la > lb || (la == lb && a < b);
  };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), before);
  // Weights relative to the largest logit, in double: exp(0) = 1 for the first, so the sum is
  // >= 1 and no weight overflows.
  const double top = logits[static_cast<std::size_t>(order[0])];
  std::vector<double> weights(static_cast<std::size_t>(k));
  double sum = 0;
  for (std::int64_t i = 0; i < k; ++i) {
    weights[static_cast<std::size_t>(i)] =
        std::exp((logits[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])] - top) / options.temperature);
    sum += weights[static_cast<std::size_t>(i)];
  }
  const double target = u * sum;
  double cumulative = 0;
  for (std::int64_t i = 0; i < k; ++i) {
    cumulative += weights[static_cast<std::size_t>(i)];
    if (target < cumulative) return order[static_cast<std::size_t>(i)];
  }
  return order[static_cast<std::size_t>(k - 1)];  // u * sum rounded up to the last boundary
}

//! How Generator computes each next token's logits.
enum class Decoding {
  //! Each block keeps the keys and values of the positions it has run (Model::decode), so a
  //! token costs the work of its own position only: the text's cost grows linearly with its
  //! length, up to max_seq_len tokens of context. Past that, each token's context window starts
  //! one position later, every position's embedding changes, and the window runs whole again.
  key_value_cache,
  //! Each token runs the forward pass over its whole context, as llm.c's sampling does (no
  //! cache to hold; the cost grows with the square of the length). The reference the cache is
  //! tested against.
  full_context,
};

//! Generates text with a whole GPT-2 on one rank of a host backend: `model` built without
//! tensor parallelism, `params` its layout's values (a trainer's gather_state(0), or weights
//! loaded from a file). Several texts can grow at once (generate_batch): each step's GEMMs then
//! read the weights once for all of them. With Decoding::key_value_cache (the default) it holds
//! 2·L·max_seq_len·C elements of T per sequence for the cache (MemoryCategory::activations),
//! allocated on first use for as many sequences as a call asks for.
template <Backend B, class T>
  requires host_addressable<B>
class Generator {
 public:
  Generator(B& backend, const Model<B, T>& model, ParameterView<const T> params,
            Decoding decoding = Decoding::key_value_cache)
      : backend_(&backend), model_(&model), params_(params), decoding_(decoding) {
    LOOM_CHECK(model.tensor_parallel_size() == 1, "generator: tensor-parallel ranks", model.tensor_parallel_size(),
               "must be 1: gather the whole model onto one rank first");
  }

  Decoding decoding() const noexcept { return decoding_; }

  //! The logits of the token after `context` (its last max_seq_len tokens are read), one per
  //! vocabulary entry (vocab_size of them; the padded rows are left out). With the cache, only
  //! the positions after the longest prefix `context`'s window shares with the last call's run
  //! (at least the last one), so a context that grows by a token costs one position's work.
  std::vector<double> next_logits(std::span<const std::int32_t> context) {
    const std::int64_t sequence = 0;
    return std::move(logits_in(std::span(&context, 1), std::span(&sequence, 1))[0]);
  }

  //! next_logits of each of `contexts` at once, context s kept in the cache's sequence s. A
  //! context that grew by one token since the last call for its sequence costs one position, and
  //! all such contexts run their blocks together: one GEMM a weight for all of them. Others (new,
  //! changed, or past max_seq_len, whose window slides) run on their own from where they part.
  std::vector<std::vector<double>> next_logits_batch(std::span<const std::vector<std::int32_t>> contexts) {
    const std::vector<std::span<const std::int32_t>> views(contexts.begin(), contexts.end());
    std::vector<std::int64_t> sequences(contexts.size());
    std::iota(sequences.begin(), sequences.end(), std::int64_t{0});
    return logits_in(views, sequences);
  }

  //! `prompt` followed by up to options.max_new_tokens tokens, each drawn by sample_token from
  //! next_logits of everything before it with u = CounterRng(seed, "gpt2.sample").uniform(p),
  //! p its position: the same prompt, model and options give the same tokens.
  std::vector<std::int32_t> generate(std::span<const std::int32_t> prompt, const SamplingOptions& options) {
    const std::vector<std::int32_t> one(prompt.begin(), prompt.end());
    return std::move(generate_batch(std::span(&one, 1), options)[0]);
  }

  //! Each of `prompts` followed by up to options.max_new_tokens tokens, the texts growing
  //! together (next_logits_batch). Text s draws from lane s of the same counter,
  //! u = CounterRng(seed, "gpt2.sample").uniform(p, s): text 0 draws as generate does (its logits
  //! agree with generate's up to rounding, since a GEMM over more rows may add in another order),
  //! the others independently of it; a text that reaches stop_token stops alone.
  std::vector<std::vector<std::int32_t>> generate_batch(std::span<const std::vector<std::int32_t>> prompts,
                                                        const SamplingOptions& options) {
    options.validate();
    const Config& config = model_->config();
    LOOM_CHECK(!prompts.empty(), "generator: prompts", prompts.size(), "must be at least one");
    for (std::size_t s = 0; s < prompts.size(); ++s) {
      const std::string name = prompts.size() == 1 ? "generator: prompt" : "generator: prompt " + std::to_string(s);
      LOOM_CHECK(!prompts[s].empty(), name + " tokens", prompts[s].size(), "must be at least one");
      for (std::size_t i = 0; i < prompts[s].size(); ++i)
        LOOM_CHECK(prompts[s][i] >= 0 && prompts[s][i] < config.vocab_size, name + " token " + std::to_string(i),
                   prompts[s][i], "must be in [0, vocab_size = " + detail::to_text(config.vocab_size) + ")");
    }
    const CounterRng rng(options.seed, "gpt2.sample");
    std::vector<std::vector<std::int32_t>> out(prompts.begin(), prompts.end());
    std::vector<std::size_t> growing(prompts.size());  // the texts still growing, by index in `out`
    std::iota(growing.begin(), growing.end(), std::size_t{0});
    for (std::int64_t i = 0; i < options.max_new_tokens && !growing.empty(); ++i) {
      // Text s keeps cache sequence s, so a text that stops leaves the others' caches as they are.
      std::vector<std::span<const std::int32_t>> contexts;
      std::vector<std::int64_t> sequences;
      for (const std::size_t s : growing) {
        contexts.push_back(out[s]);
        sequences.push_back(static_cast<std::int64_t>(s));
      }
      const std::vector<std::vector<double>> logits = logits_in(contexts, sequences);
      std::vector<std::size_t> still;
      for (std::size_t k = 0; k < growing.size(); ++k) {
        std::vector<std::int32_t>& text = out[growing[k]];
        const std::int32_t next =
            sample_token(logits[k], options, rng.uniform(text.size(), static_cast<std::uint32_t>(growing[k])));
        text.push_back(next);
        if (next != options.stop_token) still.push_back(growing[k]);
      }
      growing = std::move(still);
    }
    return out;
  }

 private:
  //! next_logits_batch with context s kept in the cache's sequence sequences[s] (distinct).
  std::vector<std::vector<double>> logits_in(std::span<const std::span<const std::int32_t>> contexts,
                                             std::span<const std::int64_t> sequences) {
    LOOM_CHECK(!contexts.empty(), "generator: contexts", contexts.size(), "must be at least one");
    for (std::size_t s = 0; s < contexts.size(); ++s)
      LOOM_CHECK(!contexts[s].empty(),
                 contexts.size() == 1 ? std::string("generator: context tokens")
                                      : "generator: context " + std::to_string(s) + " tokens",
                 contexts[s].size(), "must be at least one");
    const Config& config = model_->config();
    const auto S = static_cast<std::int64_t>(contexts.size());
    const std::int64_t C = config.channels, vocab_rows = model_->vocab_rows();
    Buffer<T, B> last(*backend_, S * C, MemoryCategory::activations);
    const auto keep_last_row = [&](std::int64_t s, const Buffer<T, B>& hidden) {
      const T* row = hidden.data() + hidden.size() - C;
      std::copy(row, row + C, last.data() + s * C);
    };
    if (decoding_ == Decoding::full_context) {
      for (std::int64_t s = 0; s < S; ++s) keep_last_row(s, forward(window(contexts[static_cast<std::size_t>(s)])));
    } else {
      reserve_sequences(*std::max_element(sequences.begin(), sequences.end()) + 1);
      std::vector<std::int64_t> stepping;  // the contexts one token past their sequence's cache
      for (std::int64_t s = 0; s < S; ++s) {
        const std::span<const std::int32_t> context = contexts[static_cast<std::size_t>(s)];
        const std::vector<std::int32_t>& cached = cached_[static_cast<std::size_t>(sequences[static_cast<std::size_t>(s)])];
        if (context.size() <= static_cast<std::size_t>(config.max_seq_len) && cached.size() + 1 == context.size() &&
            std::equal(cached.begin(), cached.end(), context.begin()))
          stepping.push_back(s);
        else
          keep_last_row(s, decode(sequences[static_cast<std::size_t>(s)], window(context)));
      }
      if (!stepping.empty()) {
        const Buffer<T, B> hidden = step(contexts, sequences, stepping);
        for (std::size_t j = 0; j < stepping.size(); ++j)
          std::copy(hidden.data() + static_cast<std::int64_t>(j) * C, hidden.data() + static_cast<std::int64_t>(j + 1) * C,
                    last.data() + stepping[j] * C);
      }
    }
    std::vector<T> rows(static_cast<std::size_t>(S * vocab_rows));
    model_->head_logits(*backend_, params_, Tensor<const T>{last.data(), Shape{S, C}},
                        Tensor<T>{rows.data(), Shape{S, vocab_rows}});
    std::vector<std::vector<double>> out(static_cast<std::size_t>(S), std::vector<double>(static_cast<std::size_t>(config.vocab_size)));
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t i = 0; i < config.vocab_size; ++i) {
        // Through float for bf16, whose conversion is explicit and to float only.
        const T logit = rows[static_cast<std::size_t>(s * vocab_rows + i)];
        if constexpr (std::is_floating_point_v<T>) out[static_cast<std::size_t>(s)][static_cast<std::size_t>(i)] = logit;
        else out[static_cast<std::size_t>(s)][static_cast<std::size_t>(i)] = static_cast<float>(logit);
      }
    return out;
  }

  //! The last max_seq_len tokens of `context`: what the model can read.
  std::span<const std::int32_t> window(std::span<const std::int32_t> context) const {
    const auto max = static_cast<std::size_t>(model_->config().max_seq_len);
    return context.size() > max ? context.last(max) : context;
  }

  //! The last block's output [T, C] for the whole window: every layer but the head, each reading
  //! the last one's output; nothing is kept between calls.
  Buffer<T, B> forward(std::span<const std::int32_t> window) {
    const Config& config = model_->config();
    const MicroBatchShape shape{1, static_cast<std::int64_t>(window.size())};
    const std::vector<std::int32_t> targets(window.size(), -1);
    const Tensor<const std::int32_t> tokens{window.data(), Shape{1, shape.seq}};
    std::int64_t saved_elements = 0;
    for (int layer = 0; layer + 1 < model_->num_layers(); ++layer)
      saved_elements = std::max(saved_elements, model_->activation_elements(layer, shape));
    const std::int64_t hidden = model_->hidden_elements(shape);
    Buffer<T, B> a(*backend_, hidden, MemoryCategory::activations), b(*backend_, hidden, MemoryCategory::activations),
        saved(*backend_, saved_elements, MemoryCategory::activations);
    const Shape hidden_shape{1, shape.seq, config.channels};
    for (int layer = 0; layer + 1 < model_->num_layers(); ++layer) {
      const ForwardArgs<T> args{.tokens = tokens,
                                .targets = {targets.data(), Shape{1, shape.seq}},
                                .input = layer == 0 ? Tensor<const T>{} : Tensor<const T>{a.data(), hidden_shape},
                                .output = {b.data(), hidden_shape},
                                .saved = {saved.data(), Shape{model_->activation_elements(layer, shape)}}};
      model_->forward(*backend_, layer, params_, args);
      a.swap(b);
    }
    return a;
  }

  //! Room in the cache for `sequences` sequences. Growing it starts every sequence empty.
  void reserve_sequences(std::int64_t sequences) {
    if (sequences <= sequences_) return;
    const Config& config = model_->config();
    const std::int64_t blocks = model_->num_layers() - 2;
    cache_ = Buffer<T, B>();  // the old cache goes before the new one comes
    cache_ = Buffer<T, B>(*backend_, 2 * blocks * sequences * config.max_seq_len * config.channels,
                          MemoryCategory::activations);
    sequences_ = sequences;
    cached_.assign(static_cast<std::size_t>(sequences), {});
  }

  //! Block `layer`'s cache of sequence `s`: its keys, or with `values` its values, [max_seq_len, C].
  Tensor<T> cache_of(int layer, std::int64_t s, bool values) {
    const Config& config = model_->config();
    const std::int64_t rows = config.max_seq_len * config.channels;
    T* base = cache_.data() + 2 * (layer - 1) * sequences_ * rows;
    return Tensor<T>{base + ((values ? sequences_ : 0) + s) * rows, Shape{config.max_seq_len, config.channels}};
  }

  //! Sequence `s`'s last block output [n, C] for the window's positions after those its cache
  //! already holds: the longest prefix the window shares with the cached tokens, less at least
  //! one position (whose output the head needs). Those positions' keys and values join the cache.
  Buffer<T, B> decode(std::int64_t s, std::span<const std::int32_t> window) {
    std::vector<std::int32_t>& cached = cached_[static_cast<std::size_t>(s)];
    const std::size_t shared = std::min(
        static_cast<std::size_t>(std::mismatch(cached.begin(), cached.end(), window.begin(), window.end()).first -
                                 cached.begin()),
        window.size() - 1);
    // Until this call's blocks have run, the cache holds the shared prefix only.
    cached.resize(shared);
    std::vector<DecodeSequence<T>> one{{.past = static_cast<std::int64_t>(shared)}};
    Buffer<T, B> out = run_layers(window.subspan(shared), one, std::span(&s, 1));
    cached.assign(window.begin(), window.end());
    return out;
  }

  //! The last block's output [n, C] for the last token of each of the n `contexts[stepping[j]]`,
  //! whose cache sequence (`cache_sequences[stepping[j]]`) holds all the others: one
  //! Model::decode call a layer for all n.
  Buffer<T, B> step(std::span<const std::span<const std::int32_t>> contexts,
                    std::span<const std::int64_t> cache_sequences, const std::vector<std::int64_t>& stepping) {
    std::vector<std::int32_t> tokens;
    std::vector<DecodeSequence<T>> sequences;
    std::vector<std::int64_t> cache;
    for (const std::int64_t k : stepping) {
      const std::span<const std::int32_t> context = contexts[static_cast<std::size_t>(k)];
      tokens.push_back(context.back());
      sequences.push_back({.past = static_cast<std::int64_t>(context.size()) - 1});
      cache.push_back(cache_sequences[static_cast<std::size_t>(k)]);
    }
    Buffer<T, B> out = run_layers(tokens, sequences, cache);
    for (std::size_t j = 0; j < cache.size(); ++j) cached_[static_cast<std::size_t>(cache[j])].push_back(tokens[j]);
    return out;
  }

  //! Every layer but the head on `tokens`, split evenly among `sequences` (their `past` set),
  //! sequence j reading and adding to cache sequence `cache[j]`: the last block's output [n, C].
  Buffer<T, B> run_layers(std::span<const std::int32_t> tokens, std::vector<DecodeSequence<T>>& sequences,
                          std::span<const std::int64_t> cache) {
    const std::int64_t C = model_->config().channels, n = static_cast<std::int64_t>(tokens.size());
    Buffer<T, B> a(*backend_, n * C, MemoryCategory::activations), b(*backend_, n * C, MemoryCategory::activations);
    const Shape rows{n, C};
    for (int layer = 0; layer + 1 < model_->num_layers(); ++layer) {
      for (std::size_t j = 0; j < sequences.size(); ++j) {
        sequences[j].keys = layer == 0 ? Tensor<T>{} : cache_of(layer, cache[j], false);
        sequences[j].values = layer == 0 ? Tensor<T>{} : cache_of(layer, cache[j], true);
      }
      const DecodeArgs<T> args{.tokens = {tokens.data(), Shape{n}},
                               .input = layer == 0 ? Tensor<const T>{} : Tensor<const T>{a.data(), rows},
                               .output = {b.data(), rows},
                               .sequences = sequences};
      model_->decode(*backend_, layer, params_, args);
      a.swap(b);
    }
    return a;
  }

  B* backend_;
  const Model<B, T>* model_;
  ParameterView<const T> params_;
  Decoding decoding_;
  //! Per block: the keys of each of the `sequences_` sequences [max_seq_len, C], then their values.
  Buffer<T, B> cache_;
  std::int64_t sequences_ = 0;
  std::vector<std::vector<std::int32_t>> cached_;  //!< per sequence, the tokens its cache holds, from position 0
};

}  // namespace loom::gpt2
