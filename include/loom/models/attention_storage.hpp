#pragma once
//! \file What a transformer block keeps of its attention for the backward, for every model.

namespace loom {

//! What a block keeps of its attention for the backward (docs/kernels_attention.md).
enum class AttentionStorage {
  //! The softmax probabilities, B·(H/tp)·T² elements of T per block (attention_forward); the
  //! backward reads them.
  stored,
  //! Only each row's log-sum-exp, B·(H/tp)·T values of accumulate_t<T> per block
  //! (attention_forward_lse); the backward recomputes the probabilities from q, k and it (one
  //! more score GEMM), as FlashAttention does and Megatron-LM's selective recomputation.
  recompute,
};

//! "stored" or "recompute".
inline const char* name(AttentionStorage a) noexcept { return a == AttentionStorage::stored ? "stored" : "recompute"; }

}  // namespace loom
