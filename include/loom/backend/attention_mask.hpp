#pragma once
//! \file Which keys a query attends to, for the self-attention kernels of every backend: the mask
//! (causal or bidirectional) and, for a batch of padded sequences, each sequence's length.

#include <cstdint>

#include "loom/core/tensor.hpp"

namespace loom {

//! The attention kernels' mask: a decoder's (GPT-2) or an encoder's (BERT).
enum class AttentionMask {
  causal,         //!< query t sees keys s <= t
  bidirectional,  //!< every query sees every key of its sequence
};

//! "causal" or "bidirectional".
inline const char* name(AttentionMask m) noexcept { return m == AttentionMask::causal ? "causal" : "bidirectional"; }

//! The keys each query of an attention call sees: those its `mask` allows, less the padding of
//! its sequence. Sequence b of a [B, T] batch holds `lengths[b]` real tokens, in [1, T], followed
//! by padding, which takes no part in attention: no query sees a key at or past its sequence's
//! length (BERT's padded-bidirectional mask; causal: s <= t and s < length), and a query at a
//! padded position sees no key at all, so its output is 0 and it passes no gradient (as if the
//! batch were unpadded, FlashAttention's variable-length form). Empty `lengths` (the default, and
//! what an AttentionMask converts to) means every sequence is T tokens. The lengths live where the
//! kernel runs: host memory on the CPU backend, device memory on CUDA.
struct AttentionKeys {
  AttentionMask mask = AttentionMask::causal;
  Tensor<const std::int32_t> lengths{};  //!< [B], or empty: no padding

  constexpr AttentionKeys() = default;
  //! Every sequence full-length, under `m` (so that a kernel taking AttentionKeys takes an
  //! AttentionMask too).
  constexpr AttentionKeys(AttentionMask m) noexcept : mask(m) {}  // NOLINT(google-explicit-constructor)
  //! `m`, with sequence b holding `sequence_lengths[b]` tokens (empty: all of them).
  constexpr AttentionKeys(AttentionMask m, Tensor<const std::int32_t> sequence_lengths) noexcept
      : mask(m), lengths(sequence_lengths) {}

  //! Whether some sequences may be shorter than T.
  constexpr bool padded() const noexcept { return !lengths.empty(); }
};

}  // namespace loom
