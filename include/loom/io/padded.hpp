#pragma once
//! \file Batches of sequences of different lengths, padded to one length: what fine-tuning on
//! sentences, or pre-training on documents shorter than the context, feeds a model. Any
//! TokenSource's batches, each row cut to a drawn length and padded.

#include <cstdint>
#include <ostream>
#include <utility>

#include "loom/core/error.hpp"
#include "loom/core/rng.hpp"
#include "loom/io/batch.hpp"

namespace loom::io {

//! How Padded cuts and pads: a value with designated initializers, `==` and `<<`.
struct PaddedConfig {
  //! Each row's length is drawn uniformly from [min_length, seq] (clamped to seq).
  std::int64_t min_length = 1;
  //! The token written at padded positions (BERT's uncased [PAD] is 0); no query attends to it,
  //! but the embedding reads it, so it must be a token of the source's vocabulary.
  std::int32_t pad_token = 0;
  std::uint64_t seed = 8765;  //!< keys every draw

  //! Throws loom::Error naming the first value that breaks a rule.
  void validate() const {
    LOOM_CHECK(min_length >= 1, "padded config: min_length", min_length, "must be >= 1");
    LOOM_CHECK(pad_token >= 0, "padded config: pad_token", pad_token, "must be >= 0");
  }
  friend bool operator==(const PaddedConfig&, const PaddedConfig&) = default;
  friend std::ostream& operator<<(std::ostream& out, const PaddedConfig& c) {
    return out << "{min_length=" << c.min_length << ", pad_token=" << c.pad_token << ", seed=" << c.seed << "}";
  }
};

//! A TokenSource of padded batches over `Source`'s: global row g = step·batch + i is
//! min_length + below(seq - min_length + 1) tokens long, drawn from CounterRng(seed, "padded")
//! at index g; its tokens from there on become pad_token and its targets -1, and Batch::lengths
//! says where each row ends. So a row's length depends on the row alone, never on the mesh
//! (DESIGN.md invariant 2). With min_length >= seq nothing is padded: the source's batches as
//! they are, without lengths. MaskedLm over a Padded source predicts only real positions.
template <TokenSource Source>
class Padded {
 public:
  explicit Padded(Source source, PaddedConfig config = {})
      : source_(std::move(source)), config_((config.validate(), config)), draws_(config.seed, "padded") {
    LOOM_CHECK(config_.pad_token < source_.vocab_size(), "padded config: pad_token", config_.pad_token,
               "must be below the source's vocab_size (" + detail::to_text(source_.vocab_size()) + ")");
  }

  const Source& source() const noexcept { return source_; }
  const PaddedConfig& config() const noexcept { return config_; }
  std::int64_t vocab_size() const noexcept { return source_.vocab_size(); }

  //! The length of global row `row` in batches of `seq` tokens.
  std::int64_t length(std::uint64_t row, std::int64_t seq) const noexcept {
    if (config_.min_length >= seq) return seq;
    const auto spread = static_cast<std::uint64_t>(seq - config_.min_length + 1);
    return config_.min_length + static_cast<std::int64_t>(draws_.below(spread, row, 0));
  }

  //! The global batch of step `step`: the source's, each row cut to its length and padded.
  Batch batch_at(std::int64_t step, std::int64_t batch, std::int64_t seq) const {
    Batch out = source_.batch_at(step, batch, seq);
    if (config_.min_length >= seq) return out;
    out.lengths.assign(static_cast<std::size_t>(batch), 0);
    for (std::int64_t i = 0; i < batch; ++i) {
      const std::int64_t n = length(static_cast<std::uint64_t>(step * batch + i), seq);
      out.lengths[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(n);
      for (std::int64_t t = n; t < seq; ++t) {
        const auto k = static_cast<std::size_t>(i * seq + t);
        out.tokens[k] = config_.pad_token;
        out.targets[k] = -1;
      }
    }
    return out;
  }

 private:
  Source source_;
  PaddedConfig config_;
  CounterRng draws_;
};

}  // namespace loom::io
