#pragma once
//! \file Dropout masks that depend only on (seed, step, layer, site, global element index)
//! (DESIGN.md invariant 2): every rank of every mesh draws the same mask for the same element of
//! the global batch, so dropout keeps the parity between meshes. Nothing is stored: the backward
//! draws the forward's mask again from the same counter (Philox), which costs a few multiplies
//! an element and saves the byte an element a stored mask takes.

#include <cstdint>
#include <string>

#include "loom/core/error.hpp"
#include "loom/core/hd.hpp"
#include "loom/core/rng.hpp"

namespace loom {

//! Where a pass sits in training, which is what keys its dropout masks: the seed, the step (the
//! steps done before it, Trainer::steps()) and the global index of the micro-batch's first
//! sequence in the global batch. The Trainer fills it in for the forward and backward passes of
//! step(); a default key (evaluation, a direct call) turns dropout off.
struct DropoutKey {
  std::uint64_t seed = 0;
  std::int64_t step = -1;            //!< < 0: no dropout in this pass
  std::int64_t first_sequence = 0;   //!< global index of the micro-batch's first sequence

  //! Whether this pass drops anything (rates > 0 still decide where).
  constexpr bool active() const noexcept { return step >= 0; }
  friend constexpr bool operator==(const DropoutKey&, const DropoutKey&) = default;
};

//! Throws loom::Error unless `rate` (named `what`) is in [0, 1).
inline void check_dropout_rate(double rate, const std::string& what) {
  LOOM_CHECK(rate >= 0.0 && rate < 1.0, what, rate,
             "a dropout rate must be in [0, 1) (the probability that an element is zeroed)");
}

//! The mask of one dropout site (a layer's `site`-th dropout) in one pass: element `i` of the
//! site's global tensor is kept with probability 1 - rate and then scaled by 1 / (1 - rate)
//! (inverted dropout: evaluation needs no rescaling). Element i takes 32 bits of the Philox block
//! i / 4 under the key of the seed, with the block's counter (i / 4, site, step): four elements a
//! block, and nothing of the mesh in the key.
class DropoutMask {
 public:
  //! Sites per layer: a layer's site s is `layer · sites_per_layer + s`.
  static constexpr int sites_per_layer = 4;

  //! An inactive mask keeps everything (rate 0 or an inactive key).
  DropoutMask() = default;
  //! The mask of `layer`'s dropout `site` (< sites_per_layer) at `rate` in the pass `key`.
  DropoutMask(const DropoutKey& key, int layer, int site, double rate)
      : key_(stream_key(key.seed, "loom.dropout")),
        counter_site_(static_cast<std::uint32_t>(layer * sites_per_layer + site)),
        counter_step_(static_cast<std::uint32_t>(key.step)) {
    check_dropout_rate(rate, "dropout rate");
    LOOM_CHECK(site >= 0 && site < sites_per_layer, "dropout site", site,
               "must be in [0, " + detail::to_text(sites_per_layer) + ")");
    if (!key.active() || rate == 0.0) return;
    active_ = true;
    // Keep when the 32 bits are >= rate · 2^32: exactly the fraction 1 - rate of all words, to
    // within 2^-32.
    threshold_ = static_cast<std::uint64_t>(rate * 4294967296.0);
    scale_ = 1.0 / (1.0 - rate);
  }

  //! Whether the mask drops anything.
  LOOM_HD bool active() const noexcept { return active_; }
  //! The factor kept elements are multiplied by, 1 / (1 - rate).
  LOOM_HD double scale() const noexcept { return scale_; }
  //! The four 32-bit words of block `block` (elements 4·block .. 4·block + 3).
  LOOM_HD Philox4x32::Counter block(std::uint64_t block) const noexcept {
    return Philox4x32::generate({static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                                 counter_site_, counter_step_},
                                key_);
  }
  //! Whether a word of a block keeps its element.
  LOOM_HD bool keeps(std::uint32_t word) const noexcept { return word >= threshold_; }
  //! Whether global element `i` is kept. The word is picked by selects, not by indexing the block
  //! at run time, which on a GPU would put the block in local memory.
  LOOM_HD bool keep(std::uint64_t i) const noexcept {
    if (!active_) return true;
    const Philox4x32::Counter w = block(i >> 2);
    const std::uint64_t at = i & 3;
    return keeps(at == 0 ? w[0] : at == 1 ? w[1] : at == 2 ? w[2] : w[3]);
  }

 private:
  Philox4x32::Key key_{};
  std::uint32_t counter_site_ = 0, counter_step_ = 0;
  std::uint64_t threshold_ = 0;
  double scale_ = 1.0;
  bool active_ = false;
};

//! Dropout on the attention probabilities of one micro-batch on one rank: `mask` over the global
//! tensor [sequences, heads, T, T], of which the rank holds sequences [first_sequence, + B) and
//! heads [first_head, + its heads) (a tensor-parallel rank's heads).
struct AttentionDropout {
  DropoutMask mask;
  std::int64_t first_sequence = 0;
  std::int64_t heads = 1;       //!< heads of the whole model
  std::int64_t first_head = 0;  //!< global index of this rank's first head

  //! The global index of element (0, 0) of local (batch, head) `b`, `h`: its row t, key s is
  //! that + t·T + s.
  LOOM_HD std::uint64_t head_origin(std::int64_t b, std::int64_t h, std::int64_t tokens) const noexcept {
    return static_cast<std::uint64_t>(((first_sequence + b) * heads + first_head + h) * tokens * tokens);
  }
};

}  // namespace loom
