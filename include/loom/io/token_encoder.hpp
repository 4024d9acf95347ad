#pragma once
//! \file Text to GPT-2 token ids: GPT-2's pre-tokenizer, then byte-level BPE over each piece, with
//! a TokenDecoder's table (llm.c's `gpt2_tokenizer.bin` or a Hugging Face `vocab.json`) as the
//! merge ranks.
//!
//! The pre-tokenizer is GPT-2's pattern (Radford et al. 2019, its `encoder.py`), written out as a
//! scanner rather than a regular expression:
//!
//!     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//!
//! \p{L} and \p{N} are Unicode's letters and numbers (detail/unicode_classes.hpp), \s its
//! White_Space property. Bytes that are not valid UTF-8 count as one character each, of neither
//! class, so every byte string is split and encoded, and decode(encode(s)) == s for all s.
//!
//! Merging follows the ranks rule (as OpenAI's tiktoken does): within a piece, starting from
//! single bytes, the adjacent pair whose concatenation is the token of lowest id is merged,
//! leftmost first among equals, until no adjacent pair is a token. GPT-2's ids are its merges in
//! order after the 256 bytes, so the lowest id is the earliest merge.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/io/detail/unicode_classes.hpp"
#include "loom/io/token_decoder.hpp"

namespace loom::io {

namespace detail {

//! What GPT-2's pattern tells apart: \p{L}, \p{N}, \s, and everything else.
enum class CharClass : unsigned char { letter, number, space, other };

//! Whether `c` lies in one of the sorted, disjoint `ranges`.
template <std::size_t N>
constexpr bool in_ranges(const CodePointRange (&ranges)[N], char32_t c) noexcept {
  const auto* it = std::upper_bound(std::begin(ranges), std::end(ranges), c,
                                    [](char32_t value, const CodePointRange& r) { return value < r.first; });
  return it != std::begin(ranges) && c <= (it - 1)->last;
}

//! Unicode's White_Space property (PropList.txt): 25 code points.
constexpr bool is_white_space(char32_t c) noexcept {
  return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

//! The class of code point `c`.
inline CharClass char_class(char32_t c) noexcept {
  if (c < 0x80) {  // the common case, without a search
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return CharClass::letter;
    if (c >= '0' && c <= '9') return CharClass::number;
    return is_white_space(c) ? CharClass::space : CharClass::other;
  }
  if (is_white_space(c)) return CharClass::space;
  if (in_ranges(unicode_letters, c)) return CharClass::letter;
  if (in_ranges(unicode_numbers, c)) return CharClass::number;
  return CharClass::other;
}

//! One character of a byte string: its class and its length in bytes.
struct TextChar {
  CharClass kind;
  std::size_t bytes;
};

//! The character at byte `at` of `text`: a well-formed UTF-8 sequence (no overlong forms, no
//! surrogates, at most U+10FFFF), or else one byte of class `other`.
inline TextChar char_at(std::string_view text, std::size_t at) noexcept {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[at + k]); };
  const unsigned lead = byte(0);
  if (lead < 0x80) return {char_class(lead), 1};
  const std::size_t length = lead >= 0xc2 && lead <= 0xdf ? 2 : lead >= 0xe0 && lead <= 0xef ? 3
                             : lead >= 0xf0 && lead <= 0xf4                                   ? 4
                                                                                              : 0;
  if (length == 0 || text.size() - at < length) return {CharClass::other, 1};
  char32_t c = lead & (0x7fu >> length);
  for (std::size_t k = 1; k < length; ++k) {
    if ((byte(k) & 0xc0) != 0x80) return {CharClass::other, 1};
    c = (c << 6) | (byte(k) & 0x3f);
  }
  const bool overlong = (length == 3 && c < 0x800) || (length == 4 && c < 0x10000);
  if (overlong || (c >= 0xd800 && c <= 0xdfff) || c > 0x10ffff) return {CharClass::other, 1};
  return {char_class(c), length};
}

//! Hash of byte strings that also takes string_views (heterogeneous lookup).
struct BytesHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view bytes) const noexcept { return std::hash<std::string_view>{}(bytes); }
};

}  // namespace detail

//! GPT-2's pre-tokenization of `text` (the pattern in the file note): the pieces, in order, which
//! together are `text`. Each piece is encoded on its own, so no token spans two pieces.
inline std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  using detail::CharClass;
  std::vector<std::string_view> pieces;
  const std::size_t n = text.size();
  // The end of the run of characters of class `kind` that starts at byte `at`.
  const auto run_end = [&](std::size_t at, CharClass kind) {
    while (at < n) {
      const detail::TextChar ch = detail::char_at(text, at);
      if (ch.kind != kind) break;
      at += ch.bytes;
    }
    return at;
  };
  std::size_t at = 0;
  while (at < n) {
    const std::size_t start = at;
    if (text[at] == '\'') {  // 's 't 're 've 'm 'll 'd, in the pattern's order
      const std::string_view rest = text.substr(at + 1);
      std::size_t suffix = 0;
      for (const std::string_view s : {"s", "t", "re", "ve", "m", "ll", "d"})
        if (rest.starts_with(s)) {
          suffix = s.size();
          break;
        }
      if (suffix > 0) {
        pieces.push_back(text.substr(start, 1 + suffix));
        at += 1 + suffix;
        continue;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+` and ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run of one class.
    const std::size_t run_start = text[at] == ' ' && at + 1 < n ? at + 1 : at;
    const detail::TextChar first = detail::char_at(text, run_start);
    if (first.kind != CharClass::space) {
      at = run_end(run_start, first.kind);
      pieces.push_back(text.substr(start, at - start));
      continue;
    }
    // `\s+(?!\S)|\s+`: a run of white space, less its last character where text follows it and the
    // run has more than one (that character then leads the next piece).
    std::size_t last = at;  // where the run's last character starts
    while (at < n) {
      const detail::TextChar ch = detail::char_at(text, at);
      if (ch.kind != CharClass::space) break;
      last = at;
      at += ch.bytes;
    }
    if (at < n && last > start) at = last;
    pieces.push_back(text.substr(start, at - start));
  }
  return pieces;
}

//! Text to token ids for a byte-level BPE vocabulary whose ids are its merge ranks (GPT-2's; see
//! the file note). Every byte needs a token of its own; the end-of-text token is written as the
//! literal `<|endoftext|>` in the text (as nanoGPT and llm.c write it between documents).
class TokenEncoder {
 public:
  //! The ranks of `vocabulary`'s tokens: each byte string's lowest id, the end-of-text token left
  //! out. Throws loom::Error naming the first byte that has no token.
  explicit TokenEncoder(const TokenDecoder& vocabulary) : end_of_text_(vocabulary.end_of_text()) {
    byte_ids_.fill(-1);
    ranks_.reserve(static_cast<std::size_t>(vocabulary.size()));
    for (std::int32_t id = 0; id < vocabulary.size(); ++id) {
      const std::string& bytes = vocabulary.bytes(id);
      if (id == end_of_text_ || bytes.empty()) continue;
      ranks_.try_emplace(bytes, id);
      if (bytes.size() == 1 && byte_ids_[static_cast<unsigned char>(bytes[0])] < 0)
        byte_ids_[static_cast<unsigned char>(bytes[0])] = id;
    }
    for (std::size_t b = 0; b < byte_ids_.size(); ++b)
      LOOM_CHECK(byte_ids_[b] >= 0, "token encoder: byte", b,
                 "has no token of its own: a byte-level BPE vocabulary has one for each of the 256 bytes");
    if (end_of_text_ >= 0) end_of_text_text_ = vocabulary.bytes(end_of_text_);
  }

  //! The ids of `text`: its pre-tokenized pieces, each merged on its own; each occurrence of the
  //! end-of-text token's text (`<|endoftext|>` in GPT-2) is that token.
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids;
    ids.reserve(text.size() / 3 + 1);
    while (!text.empty()) {
      const std::size_t special = end_of_text_text_.empty() ? std::string_view::npos : text.find(end_of_text_text_);
      for (const std::string_view piece : gpt2_pretokenize(text.substr(0, special))) encode_piece(piece, ids);
      if (special == std::string_view::npos) break;
      ids.push_back(end_of_text_);
      text.remove_prefix(special + end_of_text_text_.size());
    }
    return ids;
  }

  //! Appends the ids of one piece to `out`: the piece's own id where it is a token, else the
  //! merges from its bytes.
  void encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const {
    if (piece.empty()) return;
    if (const std::int32_t id = rank(piece); id != none) {
      out.push_back(id);
      return;
    }
    // starts[k] is where part k begins; pair_rank[k] the rank of parts k and k + 1 together.
    std::vector<std::size_t> starts(piece.size() + 1);
    for (std::size_t k = 0; k <= piece.size(); ++k) starts[k] = k;
    const auto pair_rank = [&](std::size_t k) {
      return k + 2 < starts.size() ? rank(piece.substr(starts[k], starts[k + 2] - starts[k])) : none;
    };
    std::vector<std::int32_t> ranks(piece.size());
    for (std::size_t k = 0; k < ranks.size(); ++k) ranks[k] = pair_rank(k);
    while (starts.size() > 2) {
      const auto lowest = std::min_element(ranks.begin(), ranks.end() - 1);  // ranks.back() pairs the end
      if (*lowest == none) break;
      const auto k = static_cast<std::size_t>(lowest - ranks.begin());
      starts.erase(starts.begin() + static_cast<std::ptrdiff_t>(k) + 1);
      ranks.erase(ranks.begin() + static_cast<std::ptrdiff_t>(k) + 1);
      ranks[k] = pair_rank(k);
      if (k > 0) ranks[k - 1] = pair_rank(k - 1);
    }
    for (std::size_t k = 0; k + 1 < starts.size(); ++k) {
      const std::string_view part = piece.substr(starts[k], starts[k + 1] - starts[k]);
      out.push_back(part.size() == 1 ? byte_ids_[static_cast<unsigned char>(part[0])] : rank(part));
    }
  }

  //! The end-of-text id, or -1.
  std::int32_t end_of_text() const noexcept { return end_of_text_; }

 private:
  static constexpr std::int32_t none = std::numeric_limits<std::int32_t>::max();

  std::int32_t rank(std::string_view bytes) const {
    const auto it = ranks_.find(bytes);
    return it == ranks_.end() ? none : it->second;
  }

  std::unordered_map<std::string, std::int32_t, detail::BytesHash, std::equal_to<>> ranks_;
  std::array<std::int32_t, 256> byte_ids_{};
  std::int32_t end_of_text_ = -1;
  std::string end_of_text_text_;
};

}  // namespace loom::io
