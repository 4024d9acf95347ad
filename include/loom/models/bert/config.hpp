#pragma once
//! \file BERT configurations and their parameter specs.

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

namespace loom::bert {

//! Shape of a BERT encoder: a value, compared with `==` and printed with `<<`.
struct Config {
  std::int64_t max_seq_len = 512;          //!< position embeddings (rows of wpe)
  std::int64_t vocab_size = 30522;         //!< real vocabulary V (BERT's uncased WordPiece)
  std::int64_t padded_vocab_size = 30592;  //!< rows of wte (V rounded up to 128; never reaches the loss)
  std::int64_t num_layers = 12;            //!< encoder blocks L
  std::int64_t num_heads = 12;             //!< attention heads per block
  std::int64_t channels = 768;             //!< hidden size C (the MLP is 4C wide)
  double layernorm_eps = 1e-12;            //!< BERT's epsilon (GPT-2 uses 1e-5)
  //! Dropout on the embeddings' output and on each block's attention and MLP branches before
  //! their residual adds (BERT's hidden_dropout_prob, 0.1 in its pre-training; 0 = none).
  double hidden_dropout = 0.0;
  double attention_dropout = 0.0;          //!< dropout on the attention probabilities (0.1 in BERT's)
  //! 0: the head keeps its slice of the probabilities, N·V/tp values, for the backward. n > 0:
  //! it computes the logits and the loss n rows at a time, keeps only each row's statistics (3
  //! doubles), and its backward computes each chunk's logits again (one more unembedding GEMM;
  //! docs/recompute.md). The same model to rounding.
  std::int64_t logits_chunk_rows = 0;
  //! false (the default): the head gathers the rows whose target is >= 0 (the ~15% that masked-LM
  //! predicts) and runs its transform, logits and loss on those alone, as BERT's reference code
  //! does; true: on every position, as Megatron-LM and Hugging Face do, and the positions without
  //! a target add nothing. The same model to rounding; true costs about 6x the head's GEMMs.
  bool logits_at_every_position = false;
  //! n > 0: a sequence carries at most n targets (BERT's max_predictions_per_seq: 20 at sequence
  //! 128, 80 at 512; give the data source the same cap, io::MaskedLmConfig::max_predictions), so
  //! the head keeps room for B·min(n, T) rows instead of B·T, its probabilities included. A batch
  //! with a sequence of more targets is refused before its step. 0: no cap.
  std::int64_t max_predictions_per_seq = 0;
  //! Under tensor parallelism, split the rows (tokens) of the hidden state between the layers over
  //! the tensor-parallel group as well (Megatron's --sequence-parallel): each rank keeps and
  //! normalizes 1/tp of the rows, and the all-reduces become reduce-scatters and all-gathers of
  //! the same volume (docs/tensor_parallel.md). The micro-batch's tokens must be a multiple of
  //! tp. No effect with one rank. The same model to rounding.
  bool sequence_parallel = false;
  //! The GELU of the MLPs and the masked-LM head's transform: Gelu::erf is BERT's (Hugging Face
  //! BERT's hidden_act "gelu"; give it to reproduce those weights' outputs); Gelu::tanh is GPT-2's
  //! approximation ("gelu_new"), loom's default, so that existing runs are unchanged. The two
  //! differ by at most 4.7e-4 (at x = ±2.7).
  Gelu gelu = Gelu::tanh;

  friend bool operator==(const Config&, const Config&) = default;
  friend std::ostream& operator<<(std::ostream& out, const Config& c) {
    return out << "{max_seq_len=" << c.max_seq_len << ", vocab_size=" << c.vocab_size
               << ", padded_vocab_size=" << c.padded_vocab_size << ", num_layers=" << c.num_layers
               << ", num_heads=" << c.num_heads << ", channels=" << c.channels
               << ", hidden_dropout=" << c.hidden_dropout << ", attention_dropout=" << c.attention_dropout
               << ", logits_chunk_rows=" << c.logits_chunk_rows
               << ", logits_at_every_position=" << (c.logits_at_every_position ? "true" : "false")
               << ", max_predictions_per_seq=" << c.max_predictions_per_seq
               << ", sequence_parallel=" << (c.sequence_parallel ? "true" : "false") << ", gelu=" << c.gelu
               << "}";
  }

  //! Parameters without the vocabulary padding: the embeddings and their layernorm
  //! v·h + s·h + 2h, the blocks l·(12h² + 13h), the masked-LM head's transform h² + 3h and its
  //! output bias v (the output matrix is wte, tied).
  std::int64_t parameter_count() const noexcept {
    const std::int64_t l = num_layers, h = channels;
    return vocab_size * h + max_seq_len * h + 2 * h + l * (12 * h * h + 13 * h) + h * h + 3 * h + vocab_size;
  }
  //! Elements stored: parameter_count() plus the padded rows of wte and of the output bias.
  std::int64_t stored_parameter_count() const noexcept {
    return parameter_count() + (padded_vocab_size - vocab_size) * (channels + 1);
  }

  //! Throws loom::Error naming the first value that breaks a rule.
  void validate() const {
    detail::transformer::validate_common(*this, "bert");
    LOOM_CHECK(max_predictions_per_seq >= 0, "bert config: max_predictions_per_seq", max_predictions_per_seq,
               "must be >= 0 (0: no cap)");
    LOOM_CHECK(max_predictions_per_seq == 0 || !logits_at_every_position, "bert config: max_predictions_per_seq",
               max_predictions_per_seq, "must be 0 with logits_at_every_position: the head then runs on every row");
    LOOM_CHECK(layernorm_eps > 0, "bert config: layernorm_eps", layernorm_eps, "must be > 0");
  }

  //! validate(), then the rules of a tensor-parallel group of `ranks` (docs/tensor_parallel.md):
  //! channels split across ranks, whole heads per rank, whole rows of the padded vocabulary per
  //! rank. Throws loom::Error naming the value and the rule.
  void validate_tensor_parallel(std::int64_t ranks) const {
    validate();
    detail::transformer::validate_tensor_parallel_split(*this, ranks, "bert");
  }
};

//! A small model for tests and the demo: 256-entry vocabulary, 2 layers, 64 channels.
inline Config tiny() {
  return {.max_seq_len = 64, .vocab_size = 256, .padded_vocab_size = 256, .num_layers = 2, .num_heads = 4,
          .channels = 64};
}
//! BERT-base, 110M parameters (Devlin et al. 2019).
inline Config base() { return {}; }
//! BERT-large, 340M.
inline Config large() { return {.num_layers = 24, .num_heads = 16, .channels = 1024}; }

//! The config called `name`: tiny, base (110M), large (340M).
inline Config config_by_name(std::string_view name) {
  if (name == "tiny") return tiny();
  if (name == "base" || name == "110M") return base();
  if (name == "large" || name == "340M") return large();
  throw Error("bert config name", std::string(name), "expected one of tiny, base, large");
}

//! Layer indices: 0 embeds (token and position embeddings, then a layernorm), 1..L are the
//! encoder blocks, L+1 is the masked-LM head (transform, tied unembedding, cross-entropy).
using detail::transformer::block_layer;
using detail::transformer::embedding_layer;
using detail::transformer::head_layer;
//! Global name of parameter `what` of block `block`, e.g. block_param(3, "attn.qkv.weight").
using detail::transformer::block_param;

//! Every parameter of the model, in layer order. Init follows BERT: N(0, 0.02) for matrices and
//! embeddings, zero biases, unit layernorm weights.
inline std::vector<ParameterSpec> parameter_specs(const Config& c) {
  c.validate();
  const std::int64_t C = c.channels;
  const double std_dev = 0.02;
  using P = Partition;
  std::vector<ParameterSpec> specs;
  specs.push_back({"wte", {c.padded_vocab_size, C}, embedding_layer, true, P::split_rows,
                   Init::normal(std_dev, c.vocab_size)});
  specs.push_back({"wpe", {c.max_seq_len, C}, embedding_layer, true, P::replicated, Init::normal(std_dev)});
  specs.push_back({"ln_e.weight", {C}, embedding_layer, false, P::replicated, Init::ones()});
  specs.push_back({"ln_e.bias", {C}, embedding_layer, false, P::replicated, Init::zeros()});
  for (std::int64_t l = 0; l < c.num_layers; ++l)
    for (const std::string_view what : {"attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "attn.proj.bias",
                                        "ln_1.weight", "ln_1.bias", "mlp.fc.weight", "mlp.fc.bias",
                                        "mlp.proj.weight", "mlp.proj.bias", "ln_2.weight", "ln_2.bias"})
      specs.push_back(detail::transformer::block_parameter_spec(l, what, C, std_dev, std_dev));
  const int head = head_layer(c);
  // The transform is small (C x C) and replicated over tensor-parallel ranks, like the norms.
  specs.push_back({"mlm.dense.weight", {C, C}, head, true, P::replicated, Init::normal(std_dev)});
  specs.push_back({"mlm.dense.bias", {C}, head, false, P::replicated, Init::zeros()});
  specs.push_back({"mlm.ln.weight", {C}, head, false, P::replicated, Init::ones()});
  specs.push_back({"mlm.ln.bias", {C}, head, false, P::replicated, Init::zeros()});
  specs.push_back({"mlm.bias", {c.padded_vocab_size}, head, false, P::split_rows, Init::zeros()});
  return specs;
}

//! The parameters rank `rank` of a tensor-parallel group of `ranks` stores: same names, layers
//! and order as parameter_specs(c), local shapes, each spec's Shard naming its slice. Validates
//! `c` for `ranks` first.
inline std::vector<ParameterSpec> parameter_specs(const Config& c, std::int64_t ranks, std::int64_t rank) {
  c.validate_tensor_parallel(ranks);
  std::vector<ParameterSpec> specs = parameter_specs(c);
  for (auto& spec : specs) spec = tensor_parallel_slice(std::move(spec), ranks, rank);
  return specs;
}

}  // namespace loom::bert
