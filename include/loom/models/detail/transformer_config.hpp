#pragma once
//! \file What the GPT-2 and BERT configs share: the rules on the fields both have, the rules of a
//! tensor-parallel split, the layer indices, and a block's parameter specs by name (each model
//! lists them in its own order, which is its layout's).

#include <cstdint>
#include <string>
#include <string_view>

#include "loom/backend/gelu.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameters.hpp"

namespace loom::detail::transformer {

//! Throws loom::Error naming the first field of `c` that breaks a rule of the fields every
//! transformer config has: positive sizes, a padded vocabulary no smaller than the real one, whole
//! heads, dropout rates in [0, 1), a chunk size >= 0 and a known GELU. `model` names the model in
//! the message ("gpt2", "bert").
template <class Config>
void validate_common(const Config& c, std::string_view model) {
  const std::string what = std::string(model) + " config: ";
  LOOM_CHECK(c.max_seq_len > 0, what + "max_seq_len", c.max_seq_len, "must be > 0");
  LOOM_CHECK(c.vocab_size > 0, what + "vocab_size", c.vocab_size, "must be > 0");
  LOOM_CHECK(c.padded_vocab_size >= c.vocab_size, what + "padded_vocab_size", c.padded_vocab_size,
             "must be >= vocab_size (" + detail::to_text(c.vocab_size) + ")");
  LOOM_CHECK(c.num_layers > 0, what + "num_layers", c.num_layers, "must be > 0");
  LOOM_CHECK(c.num_heads > 0, what + "num_heads", c.num_heads, "must be > 0");
  LOOM_CHECK(c.channels > 0 && c.channels % c.num_heads == 0, what + "channels", c.channels,
             "must be a positive multiple of num_heads (" + detail::to_text(c.num_heads) + ")");
  check_dropout_rate(c.hidden_dropout, what + "hidden_dropout");
  check_dropout_rate(c.attention_dropout, what + "attention_dropout");
  LOOM_CHECK(c.logits_chunk_rows >= 0, what + "logits_chunk_rows", c.logits_chunk_rows,
             "must be >= 0 (0: the head keeps its probabilities)");
  LOOM_CHECK(c.gelu == Gelu::tanh || c.gelu == Gelu::erf, what + "gelu", static_cast<int>(c.gelu),
             "must be Gelu::tanh or Gelu::erf");
}

//! Throws loom::Error unless `c` splits over a tensor-parallel group of `ranks`
//! (docs/tensor_parallel.md): channels (hence the MLP's 4·channels) across ranks, whole heads per
//! rank, whole rows of the padded vocabulary per rank. `vocab_advice` ends the vocabulary's
//! message (how to round it up, or nothing). Call it after the config's own validate().
template <class Config>
void validate_tensor_parallel_split(const Config& c, std::int64_t ranks, std::string_view model,
                                    std::string_view vocab_advice = {}) {
  const std::string what = std::string(model) + " config: ";
  const std::string tp = "the tensor-parallel size (" + detail::to_text(ranks) + ")";
  LOOM_CHECK(ranks >= 1, what + "tensor-parallel size", ranks, "must be >= 1");
  LOOM_CHECK(c.channels % ranks == 0, what + "channels", c.channels,
             "must be a multiple of " + tp +
                 ": the attention and MLP projections (channels and 4·channels wide) are split");
  LOOM_CHECK(c.num_heads % ranks == 0, what + "num_heads", c.num_heads,
             "must be a multiple of " + tp + ": attention is split by whole heads");
  LOOM_CHECK(c.padded_vocab_size % ranks == 0, what + "padded_vocab_size", c.padded_vocab_size,
             "must be a multiple of " + tp + ": each rank holds an equal slice of wte's rows" +
                 std::string(vocab_advice));
}

//! Layer indices of both models: 0 is the embedding, 1..L the blocks, L+1 the head.
constexpr int embedding_layer = 0;
inline int block_layer(std::int64_t block) { return static_cast<int>(block) + 1; }
template <class Config>
int head_layer(const Config& c) {
  return static_cast<int>(c.num_layers) + 1;
}

//! Global name of parameter `what` of block `block`, e.g. block_param(3, "attn.qkv.weight").
inline std::string block_param(std::int64_t block, std::string_view what) {
  return "h." + std::to_string(block) + "." + std::string(what);
}

//! The spec of block `block`'s parameter `what`, one of the twelve both models' blocks have
//! (ln_1, ln_2, attn.qkv, attn.proj, mlp.fc, mlp.proj; each .weight and .bias) on `channels`
//! C: its shape, Megatron's split (docs/tensor_parallel.md) and its init: N(0, `std_dev`) for
//! matrices, N(0, `projection_std`) for the two projections into the residual stream, zero biases,
//! unit layernorm weights. Matrices decay, biases and norms do not. Throws loom::Error for
//! another name.
inline ParameterSpec block_parameter_spec(std::int64_t block, std::string_view what, std::int64_t channels,
                                          double std_dev, double projection_std) {
  const std::int64_t C = channels;
  using P = Partition;
  const auto spec = [&](Shape shape, bool decay, P partition, Init init) {
    return ParameterSpec{block_param(block, what), shape, block_layer(block), decay, partition, init};
  };
  if (what == "ln_1.weight" || what == "ln_2.weight") return spec({C}, false, P::replicated, Init::ones());
  if (what == "ln_1.bias" || what == "ln_2.bias") return spec({C}, false, P::replicated, Init::zeros());
  if (what == "attn.qkv.weight" || what == "attn.qkv.bias") {
    // [q; k; v] stacked: three blocks, each split by heads (Shard::groups).
    ParameterSpec s = what == "attn.qkv.weight" ? spec({3 * C, C}, true, P::split_rows, Init::normal(std_dev))
                                                : spec({3 * C}, false, P::split_rows, Init::zeros());
    s.shard.groups = 3;
    return s;
  }
  if (what == "attn.proj.weight") return spec({C, C}, true, P::split_cols, Init::normal(projection_std));
  if (what == "mlp.fc.weight") return spec({4 * C, C}, true, P::split_rows, Init::normal(std_dev));
  if (what == "mlp.fc.bias") return spec({4 * C}, false, P::split_rows, Init::zeros());
  if (what == "mlp.proj.weight") return spec({C, 4 * C}, true, P::split_cols, Init::normal(projection_std));
  // A row-parallel layer's bias is added once, after the partial sums: every rank holds it whole.
  if (what == "attn.proj.bias" || what == "mlp.proj.bias") return spec({C}, false, P::replicated, Init::zeros());
  throw Error("transformer block parameter", std::string(what),
              "expected ln_1, ln_2, attn.qkv, attn.proj, mlp.fc or mlp.proj, each .weight or .bias");
}

}  // namespace loom::detail::transformer
