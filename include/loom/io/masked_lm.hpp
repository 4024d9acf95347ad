#pragma once
//! \file Masked-language-model batches (BERT's pre-training objective) from any TokenSource:
//! a share of the positions is selected for prediction, most of them replaced by a mask token in
//! the input, and only the selected positions carry a target.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <utility>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/rng.hpp"
#include "loom/io/batch.hpp"

namespace loom::io {

//! How MaskedLm masks: a value with designated initializers, `==` and `<<`. The defaults are
//! BERT's (Devlin et al. 2019): 15% of the positions are predicted; of those, 80% read the mask
//! token, 10% a uniform random token, 10% themselves.
struct MaskedLmConfig {
  double select_probability = 0.15;  //!< chance that a position is predicted
  double mask_share = 0.8;           //!< of the selected, the share whose input is the mask token
  double random_share = 0.1;         //!< of the selected, the share whose input is a random token
  //! The mask token's id; -1 (the default) makes it a new id, the source's vocab_size(), so
  //! that MaskedLm's vocabulary is one larger. A tokenizer's own [MASK] (103 in BERT's uncased
  //! WordPiece) must be below the source's vocab_size().
  std::int64_t mask_token = -1;
  //! At most this many predicted positions a sequence (BERT's max_predictions_per_seq: 20 at
  //! sequence 128, 80 at 512); 0 = no cap. Where more are drawn, the ones with the smallest
  //! selection draws stay. A model told the same cap (bert::Config::max_predictions_per_seq) keeps
  //! room for that many rows of logits a sequence instead of all of them.
  std::int64_t max_predictions = 0;
  std::uint64_t seed = 4321;  //!< keys every draw

  //! Throws loom::Error naming the first value that breaks a rule.
  void validate() const {
    LOOM_CHECK(select_probability > 0.0 && select_probability <= 1.0, "masked lm config: select_probability",
               select_probability, "must be in (0, 1]");
    LOOM_CHECK(mask_share >= 0.0 && random_share >= 0.0 && mask_share + random_share <= 1.0,
               "masked lm config: mask_share + random_share", mask_share + random_share,
               "each must be >= 0 and their sum <= 1");
    LOOM_CHECK(mask_token >= -1, "masked lm config: mask_token", mask_token, "must be >= 0, or -1 for a new id");
    LOOM_CHECK(max_predictions >= 0, "masked lm config: max_predictions", max_predictions, "must be >= 0 (0: no cap)");
  }
  friend bool operator==(const MaskedLmConfig&, const MaskedLmConfig&) = default;
  friend std::ostream& operator<<(std::ostream& out, const MaskedLmConfig& c) {
    return out << "{select_probability=" << c.select_probability << ", mask_share=" << c.mask_share
               << ", random_share=" << c.random_share << ", mask_token=" << c.mask_token
               << ", max_predictions=" << c.max_predictions << ", seed=" << c.seed << "}";
  }
};

//! A TokenSource of masked-LM batches over `Source`'s token sequences (its targets are not used).
//!
//! Position t of row i of step s is global position j = (s·batch + i)·seq + t; its draws come
//! from CounterRng(seed, "masked_lm") at index j: lane 0 selects it, lane 1 chooses mask / random
//! / keep, lane 2 draws the random token (in [0, source vocabulary), never the new mask id). A
//! row in which no position was selected gets its position below(seq, row index, lane 3)
//! selected, so that every sequence carries at least one target. A padded source's rows
//! (Batch::lengths, e.g. from Padded) are masked over their real positions only: seq above is
//! then the row's length, and the padding keeps its tokens and no target. With a cap
//! (MaskedLmConfig::max_predictions) a row keeps the selected positions with the smallest lane-0
//! draws (the earlier position on a tie). Like its source, a batch is a pure function of (config,
//! source, step, batch, seq) (DESIGN.md invariant 2).
template <TokenSource Source>
class MaskedLm {
 public:
  explicit MaskedLm(Source source, MaskedLmConfig config = {})
      : source_(std::move(source)), config_((config.validate(), config)), draws_(config.seed, "masked_lm") {
    LOOM_CHECK(config_.mask_token < source_.vocab_size(), "masked lm config: mask_token", config_.mask_token,
               "must be below the source's vocab_size (" + detail::to_text(source_.vocab_size()) +
                   "), or -1 for a new id");
  }

  const Source& source() const noexcept { return source_; }
  const MaskedLmConfig& config() const noexcept { return config_; }
  //! The mask token's id.
  std::int64_t mask_token() const noexcept { return config_.mask_token >= 0 ? config_.mask_token : source_.vocab_size(); }
  //! The source's vocabulary, plus one where the mask token is a new id.
  std::int64_t vocab_size() const noexcept { return source_.vocab_size() + (config_.mask_token < 0 ? 1 : 0); }

  //! The global batch of step `step`: the source's tokens, masked; targets are the original
  //! tokens at the selected positions and -1 elsewhere.
  Batch batch_at(std::int64_t step, std::int64_t batch, std::int64_t seq) const {
    Batch out = source_.batch_at(step, batch, seq);
    const auto source_vocab = static_cast<std::uint64_t>(source_.vocab_size());
    const auto mask = static_cast<std::int32_t>(mask_token());
    const auto cap = static_cast<std::size_t>(config_.max_predictions);
    std::vector<std::pair<double, std::int64_t>> drawn;  // (lane-0 draw, position) of a row's selected positions
    for (std::int64_t i = 0; i < batch; ++i) {
      const auto row = static_cast<std::uint64_t>(step * batch + i);
      drawn.clear();
      // A padded row (a Padded source) predicts only its real positions.
      const std::int64_t length = out.padded() ? out.lengths[static_cast<std::size_t>(i)] : seq;
      for (std::int64_t t = 0; t < length; ++t) {
        const double u = draws_.uniform(position(row, seq, t), 0);
        if (u < config_.select_probability) drawn.emplace_back(u, t);
      }
      if (drawn.empty())  // every sequence carries a target
        drawn.emplace_back(0.0, static_cast<std::int64_t>(draws_.below(static_cast<std::uint64_t>(length), row, 3)));
      if (cap > 0 && drawn.size() > cap) {
        std::nth_element(drawn.begin(), drawn.begin() + static_cast<std::ptrdiff_t>(cap) - 1, drawn.end());
        drawn.resize(cap);
      }
      for (std::int64_t t = 0; t < seq; ++t) out.targets[static_cast<std::size_t>(i * seq + t)] = -1;
      for (const auto& d : drawn) predict(out, position(row, seq, d.second), i * seq + d.second, source_vocab, mask);
    }
    return out;
  }

 private:
  //! The global index of position t of global row `row`: it keys the position's draws.
  static std::uint64_t position(std::uint64_t row, std::int64_t seq, std::int64_t t) {
    return row * static_cast<std::uint64_t>(seq) + static_cast<std::uint64_t>(t);
  }
  //! Predicts the position at flat index `at` of the batch (global position `j`): its target is
  //! its token, and its input becomes the mask token, a random token or stays (lanes 1 and 2).
  void predict(Batch& b, std::uint64_t j, std::int64_t at, std::uint64_t vocab, std::int32_t mask) const {
    const auto k = static_cast<std::size_t>(at);
    b.targets[k] = b.tokens[k];
    const double how = draws_.uniform(j, 1);
    if (how < config_.mask_share) b.tokens[k] = mask;
    else if (how < config_.mask_share + config_.random_share)
      b.tokens[k] = static_cast<std::int32_t>(draws_.below(vocab, j, 2));
  }

  Source source_;
  MaskedLmConfig config_;
  CounterRng draws_;
};

}  // namespace loom::io
