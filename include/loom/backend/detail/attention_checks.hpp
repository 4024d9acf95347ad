#pragma once
//! \file The argument checks of the self-attention kernels (causal or bidirectional, padded or
//! not; host code only, no Eigen), so that attention_forward and attention_backward reject a bad argument with the
//! same words, in the same order, on the CPU and on the GPU.

#include <algorithm>
#include <cstdint>
#include <string>

#include "loom/backend/attention_mask.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::attention {

//! Shape, mask and sequence lengths of one attention call, validated.
struct Dims {
  std::int64_t batch, tokens, channels, heads, head_size;
  AttentionMask mask = AttentionMask::causal;
  //! [B] tokens of each sequence (AttentionKeys::lengths), or null: all T. Where the kernel runs.
  const std::int32_t* lengths = nullptr;
  //! Whether there is nothing to compute (B, T or C is 0): the kernels return before any work.
  bool empty() const noexcept { return batch == 0 || tokens == 0 || channels == 0; }
  //! Whether query t sees only keys s <= t.
  bool causal() const noexcept { return mask == AttentionMask::causal; }
  //! Tokens of sequence b, past which keys are padding (host-memory lengths only).
  std::int64_t length(std::int64_t b) const noexcept { return lengths != nullptr ? lengths[b] : tokens; }
  //! The keys [0, keys(t, length)) that query t of a sequence of `length` tokens sees: t + 1
  //! (causal) or T (bidirectional), at most `length`; none for a padded query (t >= length).
  std::int64_t keys(std::int64_t t, std::int64_t length) const noexcept {
    return t < length ? std::min(causal() ? t + 1 : tokens, length) : 0;
  }
  //! The keys [0, keys(t)) that query t of a full-length sequence sees.
  std::int64_t keys(std::int64_t t) const noexcept { return keys(t, tokens); }
};

//! Checks that every one of the `d.batch` host-memory lengths is in [1, T] (a kernel reading
//! them on the host calls it; the GPU's lengths are checked where the batch is, before they are
//! copied to the device).
inline void check_length_values(const Dims& d, const char* kernel) {
  if (d.lengths == nullptr) return;
  for (std::int64_t b = 0; b < d.batch; ++b)
    if (d.lengths[b] < 1 || d.lengths[b] > d.tokens)
      throw Error(std::string(kernel) + ": lengths[" + detail::to_text(b) + "]", d.lengths[b],
                  "must be in [1, T = " + detail::to_text(d.tokens) + "]");
}

//! Checks that `qkv` is [B, T, 3C], that `num_heads` > 0 divides C, that `keys.mask` is one of
//! AttentionMask's values (not an integer cast to it) and that `keys.lengths`, where given, is [B].
template <class T>
Dims check_qkv(const Tensor<const T>& qkv, int num_heads, const AttentionKeys& keys, const char* kernel) {
  const AttentionMask mask = keys.mask;
  if (mask != AttentionMask::causal && mask != AttentionMask::bidirectional)
    throw Error(std::string(kernel) + ": argument mask", static_cast<int>(mask),
                "expected AttentionMask::causal or AttentionMask::bidirectional");
  if (qkv.shape().rank() != 3 || qkv.extent(2) % 3 != 0)
    throw Error(std::string(kernel) + ": argument qkv shape", qkv.shape(),
                "expected [B, T, 3C] (rank 3, last extent a multiple of 3)");
  const std::int64_t channels = qkv.extent(2) / 3;
  if (num_heads <= 0)
    throw Error(std::string(kernel) + ": argument num_heads", num_heads, "must be > 0");
  if (channels % num_heads != 0)
    throw Error(std::string(kernel) + ": argument num_heads", num_heads,
                "must divide the channels C = " + detail::to_text(channels));
  if (keys.padded()) loom::check_shape(keys.lengths, Shape{qkv.extent(0)}, kernel, "lengths");
  return {qkv.extent(0), qkv.extent(1), channels, num_heads, channels / num_heads, mask,
          keys.padded() ? keys.lengths.data() : nullptr};
}

//! Every check of attention_forward, in order: the mask, qkv and num_heads, the lengths' shape, then out [B,T,C] and
//! att [B,NH,T,T] (shape and data).
template <class T>
Dims check_forward(const Tensor<T>& out, const Tensor<T>& att, const Tensor<const T>& qkv,
                   int num_heads, const AttentionKeys& keys = AttentionMask::causal) {
  constexpr const char* kernel = "attention_forward";
  const Dims d = check_qkv(qkv, num_heads, keys, kernel);
  loom::check_shape(out, Shape{d.batch, d.tokens, d.channels}, kernel, "out");
  loom::check_shape(att, Shape{d.batch, d.heads, d.tokens, d.tokens}, kernel, "att");
  return d;
}

//! Every check of attention_backward, in order: the mask, qkv and num_heads, the lengths' shape, then dqkv (qkv's
//! shape), dout [B,T,C] and att [B,NH,T,T] (shape and data).
template <class T>
Dims check_backward(const Tensor<T>& dqkv, const Tensor<const T>& dout, const Tensor<const T>& qkv,
                    const Tensor<const T>& att, int num_heads, const AttentionKeys& keys = AttentionMask::causal) {
  constexpr const char* kernel = "attention_backward";
  const Dims d = check_qkv(qkv, num_heads, keys, kernel);
  loom::check_shape(dqkv, qkv.shape(), kernel, "dqkv");
  loom::check_shape(dout, Shape{d.batch, d.tokens, d.channels}, kernel, "dout");
  loom::check_shape(att, Shape{d.batch, d.heads, d.tokens, d.tokens}, kernel, "att");
  return d;
}

//! Every check of attention_forward_lse, in order: the mask, qkv and num_heads, the lengths' shape, then out [B,T,C]
//! and lse [B,NH,T] (shape and data).
template <class T, class A>
Dims check_forward_lse(const Tensor<T>& out, const Tensor<A>& lse, const Tensor<const T>& qkv, int num_heads,
                       const AttentionKeys& keys = AttentionMask::causal) {
  constexpr const char* kernel = "attention_forward_lse";
  const Dims d = check_qkv(qkv, num_heads, keys, kernel);
  loom::check_shape(out, Shape{d.batch, d.tokens, d.channels}, kernel, "out");
  loom::check_shape(lse, Shape{d.batch, d.heads, d.tokens}, kernel, "lse");
  return d;
}

//! Every check of attention_backward_lse, in order: the mask, qkv and num_heads, the lengths' shape, then dqkv
//! (qkv's shape), dout [B,T,C], out [B,T,C], lse [B,NH,T] (shape and data).
template <class T, class A>
Dims check_backward_lse(const Tensor<T>& dqkv, const Tensor<const T>& dout, const Tensor<const T>& qkv,
                        const Tensor<const T>& out, const Tensor<const A>& lse, int num_heads,
                        const AttentionKeys& keys = AttentionMask::causal) {
  constexpr const char* kernel = "attention_backward_lse";
  const Dims d = check_qkv(qkv, num_heads, keys, kernel);
  loom::check_shape(dqkv, qkv.shape(), kernel, "dqkv");
  loom::check_shape(dout, Shape{d.batch, d.tokens, d.channels}, kernel, "dout");
  loom::check_shape(out, Shape{d.batch, d.tokens, d.channels}, kernel, "out");
  loom::check_shape(lse, Shape{d.batch, d.heads, d.tokens}, kernel, "lse");
  return d;
}

}  // namespace loom::detail::attention
