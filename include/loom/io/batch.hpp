#pragma once
//! \file A batch of token sequences and the TokenSource concept: where training data comes from
//! (DESIGN.md invariant 2: the global batch of a step depends only on the source and the step).

#include <concepts>
#include <cstdint>
#include <limits>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::io {

namespace detail {
using loom::detail::to_text;  // io's detail namespace would otherwise hide it
}  // namespace detail

//! `batch` sequences of `seq` tokens each, row-major, with their next-token targets.
//! A target < 0 is ignored by the loss (padding, masked positions). A padded batch says how
//! long each sequence is: row i is its first lengths[i] tokens, then padding that no query
//! attends to (loom::AttentionKeys), whose targets are ignored.
struct Batch {
  std::int64_t batch = 0;               //!< sequences (rows)
  std::int64_t seq = 0;                 //!< tokens per sequence (columns)
  std::vector<std::int32_t> tokens;     //!< [batch, seq] inputs
  std::vector<std::int32_t> targets;    //!< [batch, seq] next tokens; < 0 means "ignored"
  std::vector<std::int32_t> lengths{};  //!< [batch] real tokens of each row, in [1, seq]; empty: all seq

  //! A zero-filled batch of the given shape.
  static Batch zeros(std::int64_t batch, std::int64_t seq) {
    LOOM_CHECK(batch >= 0, "batch: batch", batch, "must be >= 0");
    LOOM_CHECK(seq >= 0, "batch: seq", seq, "must be >= 0");
    const auto n = static_cast<std::size_t>(batch * seq);
    return {batch, seq, std::vector<std::int32_t>(n), std::vector<std::int32_t>(n)};
  }

  //! The inputs as a [batch, seq] view.
  Tensor<const std::int32_t> tokens_view() const { return {tokens.data(), Shape{batch, seq}}; }
  //! The targets as a [batch, seq] view.
  Tensor<const std::int32_t> targets_view() const { return {targets.data(), Shape{batch, seq}}; }
  //! The sequence lengths as a [batch] view, or an empty one where no row is padded.
  Tensor<const std::int32_t> lengths_view() const {
    if (lengths.empty()) return {};
    return {lengths.data(), Shape{static_cast<std::int64_t>(lengths.size())}};
  }
  //! Whether the rows carry lengths (some may be shorter than seq).
  bool padded() const noexcept { return !lengths.empty(); }

  //! Sequences [first, first + count) as a batch of their own: how a data-parallel rank takes
  //! its share of the global batch and how a rank's share splits into micro-batches.
  Batch rows(std::int64_t first, std::int64_t count) const {
    LOOM_CHECK(first >= 0 && first < batch, "batch rows: first", first,
               "must be in [0, " + detail::to_text(batch) + ") for a batch of " +
                   detail::to_text(batch) + " sequences");
    LOOM_CHECK(count >= 1 && count <= batch - first, "batch rows: count", count,
               "must be in [1, " + detail::to_text(batch - first) + "] (first = " +
                   detail::to_text(first) + ", batch = " + detail::to_text(batch) + ")");
    const auto begin = static_cast<std::ptrdiff_t>(first * seq);
    const auto end = static_cast<std::ptrdiff_t>((first + count) * seq);
    std::vector<std::int32_t> kept_lengths;
    if (padded()) kept_lengths.assign(lengths.begin() + first, lengths.begin() + first + count);
    return {count, seq, {tokens.begin() + begin, tokens.begin() + end},
            {targets.begin() + begin, targets.begin() + end}, std::move(kept_lengths)};
  }

  //! Targets that count towards the loss (those >= 0): the loss is their mean.
  std::int64_t target_count() const noexcept {
    std::int64_t n = 0;
    for (std::int32_t t : targets) n += t >= 0 ? 1 : 0;
    return n;
  }

  friend bool operator==(const Batch&, const Batch&) = default;
  friend std::ostream& operator<<(std::ostream& out, const Batch& b) {
    return out << "Batch{batch=" << b.batch << ", seq=" << b.seq << "}";
  }
};

//! A source of training data. `batch_at(step, batch, seq)` is the global batch of step `step`:
//! a pure function of (source, step, batch, seq), never of who asks, how often or in what
//! order, so that every mesh sees the same data (DESIGN.md invariant 2). Every token is in
//! [0, vocab_size()).
template <class S>
concept TokenSource = requires(const S& source, std::int64_t step, std::int64_t batch,
                               std::int64_t seq) {
  { source.vocab_size() } -> std::convertible_to<std::int64_t>;
  { source.batch_at(step, batch, seq) } -> std::same_as<Batch>;
};

namespace detail {
//! Checks the arguments of a `batch_at` call; `source` names the source in the message.
inline void check_batch_request(std::string_view source, std::int64_t step, std::int64_t batch,
                                std::int64_t seq) {
  const std::string who(source);
  LOOM_CHECK(step >= 0, who + ": batch_at step", step, "must be >= 0");
  LOOM_CHECK(batch >= 1, who + ": batch_at batch", batch, "must be >= 1");
  LOOM_CHECK(seq >= 1, who + ": batch_at seq", seq, "must be >= 1");
  // Global sequence indices step * batch + i must fit in int64.
  LOOM_CHECK(step <= (std::numeric_limits<std::int64_t>::max() - batch) / batch,
             who + ": batch_at step", step,
             "step * batch must fit in int64 (batch = " + detail::to_text(batch) + ")");
}
}  // namespace detail

}  // namespace loom::io
