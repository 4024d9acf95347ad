#pragma once
//! \file GPT-2 configurations and their parameter specs.

#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "loom/backend/gelu.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/error.hpp"
#include "loom/core/parameters.hpp"
#include "loom/models/detail/transformer_config.hpp"

namespace loom::gpt2 {

//! Shape of a GPT-2: a value, compared with `==` and printed with `<<`.
struct Config {
  std::int64_t max_seq_len = 1024;         //!< context length T (rows of wpe)
  std::int64_t vocab_size = 50257;         //!< real vocabulary V
  std::int64_t padded_vocab_size = 50304;  //!< rows of wte (V rounded up; padding never reaches the loss)
  std::int64_t num_layers = 12;            //!< transformer blocks L
  std::int64_t num_heads = 12;             //!< attention heads per block
  std::int64_t channels = 768;             //!< hidden size C
  //! Dropout on the embedding's output and on each block's attention and MLP branches before
  //! their residual adds (GPT-2's embd_pdrop and resid_pdrop; 0 = none, as llm.c trains).
  double hidden_dropout = 0.0;
  double attention_dropout = 0.0;          //!< dropout on the attention probabilities (attn_pdrop)
  //! 0: the head keeps its slice of the probabilities, N·V/tp values, for the backward. n > 0:
  //! it computes the logits and the loss n rows at a time, keeps only each row's statistics (3
  //! doubles), and its backward computes each chunk's logits again (one more unembedding GEMM;
  //! docs/recompute.md). The same model to rounding.
  std::int64_t logits_chunk_rows = 0;
  //! Under tensor parallelism, split the rows (tokens) of the hidden state between the layers over
  //! the tensor-parallel group as well (Megatron's --sequence-parallel): each rank keeps and
  //! normalizes 1/tp of the rows, the all-reduces become reduce-scatters and all-gathers of the
  //! same volume, and a block keeps 3·C/tp values a token for its layernorms and residual instead
  //! of 3·C (docs/tensor_parallel.md). The micro-batch's tokens must be a multiple of tp. No
  //! effect with one rank. The same model to rounding.
  bool sequence_parallel = false;
  //! The MLP's GELU: Gelu::tanh (the default) is GPT-2's approximation, Hugging Face GPT-2's
  //! activation_function "gelu_new"; Gelu::erf is the exact form (Hugging Face's "gelu").
  Gelu gelu = Gelu::tanh;

  friend bool operator==(const Config&, const Config&) = default;
  friend std::ostream& operator<<(std::ostream& out, const Config& c) {
    return out << "{max_seq_len=" << c.max_seq_len << ", vocab_size=" << c.vocab_size
               << ", padded_vocab_size=" << c.padded_vocab_size << ", num_layers=" << c.num_layers
               << ", num_heads=" << c.num_heads << ", channels=" << c.channels
               << ", hidden_dropout=" << c.hidden_dropout << ", attention_dropout=" << c.attention_dropout
               << ", logits_chunk_rows=" << c.logits_chunk_rows
               << ", sequence_parallel=" << (c.sequence_parallel ? "true" : "false") << ", gelu=" << c.gelu
               << "}";
  }

  //! The published parameter count l·(12h² + 13h) + v·h + s·h + 2h (no vocabulary padding).
  std::int64_t parameter_count() const noexcept {
    const std::int64_t l = num_layers, h = channels;
    return l * (12 * h * h + 13 * h) + vocab_size * h + max_seq_len * h + 2 * h;
  }
  //! Elements stored: parameter_count() plus the padded rows of wte.
  std::int64_t stored_parameter_count() const noexcept {
    return parameter_count() + (padded_vocab_size - vocab_size) * channels;
  }

  //! Throws loom::Error naming the first value that breaks a rule.
  void validate() const { detail::transformer::validate_common(*this, "gpt2"); }

  //! validate(), then the rules of a tensor-parallel group of `ranks` (docs/tensor_parallel.md):
  //! channels (hence the MLP's 4·channels) split across ranks, whole heads per rank, and whole
  //! rows of the padded vocabulary per rank. Throws loom::Error naming the value and the rule.
  void validate_tensor_parallel(std::int64_t ranks) const {
    validate();
    detail::transformer::validate_tensor_parallel_split(
        *this, ranks, "gpt2", " (round it up with gpt2::pad_vocab(vocab_size, multiple of the tensor-parallel size))");
  }
};

//! Vocabulary rounded up to a multiple of `multiple` (llm.c pads 50257 to 50304 = 128·393).
constexpr std::int64_t pad_vocab(std::int64_t vocab, std::int64_t multiple = 128) {
  return (vocab + multiple - 1) / multiple * multiple;
}

//! A small model for tests and the demo: byte vocabulary, 2 layers, 64 channels.
inline Config tiny() { return {.max_seq_len = 64, .vocab_size = 256, .padded_vocab_size = 256,
                               .num_layers = 2, .num_heads = 4, .channels = 64}; }
//! GPT-2 small, 124M parameters.
inline Config small() { return {}; }
//! GPT-2 medium, 350M.
inline Config medium() { return {.num_layers = 24, .num_heads = 16, .channels = 1024}; }
//! GPT-2 large, 774M.
inline Config large() { return {.num_layers = 36, .num_heads = 20, .channels = 1280}; }
//! GPT-2 XL, 1.5B.
inline Config xl() { return {.num_layers = 48, .num_heads = 25, .channels = 1600}; }
//! The 2.7B shape (GPT-3 2.7B's depth and width on GPT-2's vocabulary and context).
inline Config gpt2_2_7b() { return {.num_layers = 32, .num_heads = 32, .channels = 2560}; }

//! The config called `name`: tiny, small (124M), medium (350M), large (774M), xl (1.5B), 2.7B.
inline Config config_by_name(std::string_view name) {
  if (name == "tiny") return tiny();
  if (name == "small" || name == "124M") return small();
  if (name == "medium" || name == "350M") return medium();
  if (name == "large" || name == "774M") return large();
  if (name == "xl" || name == "1.5B") return xl();
  if (name == "2.7B") return gpt2_2_7b();
  throw Error("gpt2 config name", std::string(name),
              "expected one of tiny, small, medium, large, xl, 2.7B");
}

//! Layer indices: 0 is the embedding, 1..L the blocks, L+1 the head (final norm, tied
//! unembedding, cross-entropy).
using detail::transformer::block_layer;
using detail::transformer::embedding_layer;
using detail::transformer::head_layer;
//! Global name of parameter `what` of block `block`, e.g. block_param(3, "attn.qkv.weight").
using detail::transformer::block_param;

//! Every parameter of the model, in layer order. Init follows GPT-2 / llm.c: N(0, 0.02) for
//! matrices and embeddings, residual projections scaled by 1/sqrt(2L), zero biases, unit norms.
inline std::vector<ParameterSpec> parameter_specs(const Config& c) {
  c.validate();
  const std::int64_t C = c.channels;
  const double std_dev = 0.02, proj_std = 0.02 / std::sqrt(2.0 * static_cast<double>(c.num_layers));
  using P = Partition;
  std::vector<ParameterSpec> specs;
  specs.push_back({"wte", {c.padded_vocab_size, C}, embedding_layer, true, P::split_rows,
                   Init::normal(std_dev, c.vocab_size)});
  specs.push_back({"wpe", {c.max_seq_len, C}, embedding_layer, true, P::replicated,
                   Init::normal(std_dev)});
  for (std::int64_t l = 0; l < c.num_layers; ++l)
    for (const std::string_view what : {"ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias",
                                        "attn.proj.weight", "attn.proj.bias", "ln_2.weight", "ln_2.bias",
                                        "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"})
      specs.push_back(detail::transformer::block_parameter_spec(l, what, C, std_dev, proj_std));
  const int head = head_layer(c);
  specs.push_back({"ln_f.weight", {C}, head, false, P::replicated, Init::ones()});
  specs.push_back({"ln_f.bias", {C}, head, false, P::replicated, Init::zeros()});
  return specs;
}

//! The parameters rank `rank` of a tensor-parallel group of `ranks` stores (Megatron's split,
//! docs/tensor_parallel.md): same names, layers and order as parameter_specs(c), local shapes,
//! and each spec's Shard says which slice of the global tensor it is. Validates `c` for `ranks`
//! first. ranks = 1 gives parameter_specs(c) (with global_shape filled in).
inline std::vector<ParameterSpec> parameter_specs(const Config& c, std::int64_t ranks, std::int64_t rank) {
  c.validate_tensor_parallel(ranks);
  std::vector<ParameterSpec> specs = parameter_specs(c);
  for (auto& spec : specs) spec = tensor_parallel_slice(std::move(spec), ranks, rank);
  return specs;
}

}  // namespace loom::gpt2
