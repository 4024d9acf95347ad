#pragma once
//! \file Which keys a query attends to, for the self-attention kernels of every backend.

namespace loom {

//! The attention kernels' mask: a decoder's (GPT-2) or an encoder's (BERT).
enum class AttentionMask {
  causal,         //!< query t sees keys s <= t
  bidirectional,  //!< every query sees every key of its sequence
};

//! "causal" or "bidirectional".
inline const char* name(AttentionMask m) noexcept { return m == AttentionMask::causal ? "causal" : "bidirectional"; }

}  // namespace loom
