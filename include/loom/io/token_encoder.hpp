#pragma once
//! \file Text to token ids for a byte-level BPE (GPT-2's, a tiktoken file's, or one read from a
//! Hugging Face tokenizer.json): a pre-tokenizer, then the merges over each piece; or for BERT's
//! WordPiece read from a tokenizer.json or a vocab.txt (detail::WordPiece, below).
//!
//! The pre-tokenizer is GPT-2's pattern (Radford et al. 2019, its `encoder.py`), or cl100k_base's,
//! Llama 3's or o200k_base's (cl100k_pretokenize, llama3_pretokenize, o200k_pretokenize, below),
//! each written out as a scanner rather than a regular expression. GPT-2's:
//!
//!     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//!
//! \p{L} and \p{N} are Unicode's letters and numbers (detail/unicode_classes.hpp), \s its
//! White_Space property. Bytes that are not valid UTF-8 count as one character each, of neither
//! class, so every byte string is split and encoded, and decode(encode(s)) == s for all s.
//!
//! Merging, within a piece, starts from single bytes and merges the best-ranked adjacent pair,
//! leftmost first among equals, until no adjacent pair merges. With a TokenDecoder's table alone
//! (llm.c's `gpt2_tokenizer.bin`, a `vocab.json`) a pair's rank is the id of its concatenation,
//! where that is a token (the ranks rule, as OpenAI's tiktoken has it): GPT-2's ids are its merges
//! in order after the 256 bytes, so the lowest id is the earliest merge. With a merge list
//! (TokenizerRules, from a tokenizer.json) a pair's rank is its place in the list, as Hugging Face's
//! `tokenizers` has it, whatever the ids.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/io/detail/unicode_bert.hpp"
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

//! The character at byte `at` of `text` (code_point_at): its class, of `other` where the bytes
//! are not well-formed UTF-8.
inline TextChar char_at(std::string_view text, std::size_t at) noexcept {
  const CodePointAt ch = code_point_at(text, at);
  return {ch.valid ? char_class(ch.c) : CharClass::other, ch.bytes};
}

//! The end of the run of characters of class `kind` from byte `at` of `text`, at most `most` of
//! them.
inline std::size_t class_run_end(std::string_view text, std::size_t at, CharClass kind,
                                 std::size_t most = std::numeric_limits<std::size_t>::max()) noexcept {
  for (std::size_t count = 0; at < text.size() && count < most; ++count) {
    const TextChar ch = char_at(text, at);
    if (ch.kind != kind) break;
    at += ch.bytes;
  }
  return at;
}

//! Hash of byte strings that also takes string_views (heterogeneous lookup).
struct BytesHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view bytes) const noexcept { return std::hash<std::string_view>{}(bytes); }
};

//! The mapping of code point `c` in a table sorted by `from`, or null.
template <int N, std::size_t Size>
const CodePointMapping<N>* find_mapping(const CodePointMapping<N> (&table)[Size], char32_t c) noexcept {
  const auto* it = std::lower_bound(std::begin(table), std::end(table), c,
                                    [](const CodePointMapping<N>& m, char32_t value) { return m.from < value; });
  return it != std::end(table) && it->from == c ? it : nullptr;
}

//! BERT's normalizer, pre-tokenizer and WordPiece (WordPieceRules) as Hugging Face's `tokenizers`
//! applies them, with its character tables (detail/unicode_bert.hpp):
//! 1. normalize each character: clean_text drops the control and other characters of
//!    bert_removed and makes the rest of White_Space a space; chinese_chars puts a space before
//!    and after each CJK ideograph; strip_accents decomposes (NFD, Hangul syllables by
//!    arithmetic) and drops the nonspacing marks; lowercase lowers (a character at a time, as
//!    `tokenizers` does: no final-sigma rule);
//! 2. split into words at White_Space, each punctuation character a word of its own;
//! 3. spell each word greedily, the longest vocabulary token first from its start, then from
//!    where that ends with the continuation prefix; a word longer than max_chars characters, or
//!    one with a place no token spells, is the unknown token whole.
//! Bytes that are not well-formed UTF-8 are U+FFFD, which clean_text drops.
class WordPiece {
 public:
  explicit WordPiece(WordPieceRules rules)
      : unknown_(rules.unknown),
        prefix_(std::move(rules.prefix)),
        max_chars_(rules.max_chars),
        clean_text_(rules.clean_text),
        chinese_chars_(rules.chinese_chars),
        strip_accents_(rules.strip_accents),
        lowercase_(rules.lowercase) {
    ids_.reserve(rules.vocab.size());
    for (auto& [token, id] : rules.vocab) ids_.try_emplace(std::move(token), id);
  }

  //! Appends the ids of `text` to `out`.
  void encode(std::string_view text, std::vector<std::int32_t>& out) const {
    std::vector<char32_t> word;
    const auto end_word = [&] {
      if (!word.empty()) spell(word, out);
      word.clear();
    };
    std::vector<char32_t> normal;
    for (std::size_t at = 0; at < text.size();) {
      const CodePointAt ch = code_point_at(text, at);
      at += ch.bytes;
      normal.clear();
      normalize(ch.c, normal);
      for (const char32_t c : normal) {
        if (is_white_space(c)) {
          end_word();
        } else if (in_ranges(bert_punctuation, c)) {
          end_word();
          word.push_back(c);
          end_word();
        } else {
          word.push_back(c);
        }
      }
    }
    end_word();
  }

 private:
  //! Appends what the normalizer makes of `c` to `out`.
  void normalize(char32_t c, std::vector<char32_t>& out) const {
    if (clean_text_) {
      if (in_ranges(bert_removed, c)) return;
      if (is_white_space(c)) c = ' ';
    }
    const bool spaced = chinese_chars_ && is_chinese(c);
    if (spaced) out.push_back(' ');
    char32_t stripped[3] = {c};
    int count = 1;
    if (strip_accents_) {
      if (in_ranges(bert_nonspacing, c)) {
        if (spaced) out.push_back(' ');
        return;
      }
      if (c >= hangul_first && c < hangul_first + hangul_count) {  // Unicode 16, section 3.12
        const char32_t s = c - hangul_first;
        stripped[0] = 0x1100 + s / 588;
        stripped[1] = 0x1161 + s % 588 / 28;
        stripped[2] = 0x11a7 + s % 28;
        count = s % 28 != 0 ? 3 : 2;
      } else if (const auto* m = find_mapping(bert_stripped, c)) {
        std::copy(m->to, m->to + m->length, stripped);
        count = m->length;
      }
    }
    for (int k = 0; k < count; ++k) {
      const auto* lower = lowercase_ ? find_mapping(bert_lowercase, stripped[k]) : nullptr;
      if (lower != nullptr)
        out.insert(out.end(), lower->to, lower->to + lower->length);
      else
        out.push_back(stripped[k]);
    }
    if (spaced) out.push_back(' ');
  }

  //! The CJK ideographs that BERT spaces out (its `_is_chinese_char`).
  static bool is_chinese(char32_t c) noexcept {
    return (c >= 0x4e00 && c <= 0x9fff) || (c >= 0x3400 && c <= 0x4dbf) || (c >= 0x20000 && c <= 0x2a6df) ||
           (c >= 0x2a700 && c <= 0x2b73f) || (c >= 0x2b740 && c <= 0x2b81f) || (c >= 0x2b920 && c <= 0x2ceaf) ||
           (c >= 0xf900 && c <= 0xfaff) || (c >= 0x2f800 && c <= 0x2fa1f);
  }

  //! Appends the ids that spell `word` (normalized characters, no white space) to `out`.
  void spell(const std::vector<char32_t>& word, std::vector<std::int32_t>& out) const {
    if (static_cast<std::int64_t>(word.size()) > max_chars_) {
      out.push_back(unknown_);
      return;
    }
    std::string text;
    std::vector<std::size_t> offsets{0};  // offsets[k]: where character k starts in text
    for (const char32_t c : word) {
      append_utf8(text, c);
      offsets.push_back(text.size());
    }
    const std::size_t first = out.size();
    std::string candidate;
    for (std::size_t start = 0; start < word.size();) {
      std::size_t end = word.size();
      for (; end > start; --end) {
        candidate.assign(start > 0 ? prefix_ : std::string());
        candidate.append(text, offsets[start], offsets[end] - offsets[start]);
        if (const auto it = ids_.find(candidate); it != ids_.end()) {
          out.push_back(it->second);
          break;
        }
      }
      if (end == start) {  // no token spells what starts here: the word is unknown
        out.resize(first);
        out.push_back(unknown_);
        return;
      }
      start = end;
    }
  }

  static constexpr char32_t hangul_first = 0xac00, hangul_count = 11172;

  std::unordered_map<std::string, std::int32_t, BytesHash, std::equal_to<>> ids_;
  std::int32_t unknown_;
  std::string prefix_;
  std::int64_t max_chars_;
  bool clean_text_, chinese_chars_, strip_accents_, lowercase_;
};

}  // namespace detail

//! GPT-2's pre-tokenization of `text` (the pattern in the file note): the pieces, in order, which
//! together are `text`. Each piece is encoded on its own, so no token spans two pieces.
inline std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  using detail::CharClass;
  std::vector<std::string_view> pieces;
  const std::size_t n = text.size();
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
      at = detail::class_run_end(text, run_start, first.kind);
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

namespace detail {

//! The length in bytes of the contraction `(?i:'s|'t|'re|'ve|'m|'ll|'d)` at byte `at` of `text`,
//! 0 where there is none. Case is ignored as Unicode's simple case folding has it, as Python's
//! `regex`, Rust's `regex` (tiktoken) and Oniguruma (Hugging Face's `tokenizers`) ignore it: each
//! of those letters matches its capital, and `s` the long s (U+017F) too.
inline std::size_t contraction_ignoring_case(std::string_view text, std::size_t at) noexcept {
  if (at >= text.size() || text[at] != '\'') return 0;
  // The folded ASCII letter at byte k and its length, or 0.
  const auto letter = [&](std::size_t k, std::size_t& bytes) -> char {
    bytes = 1;
    if (k >= text.size()) return 0;
    const char c = text[k];
    if (c >= 'A' && c <= 'Z') return static_cast<char>(c - 'A' + 'a');
    if (c >= 'a' && c <= 'z') return c;
    if (text.substr(k).starts_with("\xc5\xbf")) {  // U+017F, the long s
      bytes = 2;
      return 's';
    }
    return 0;
  };
  std::size_t first_bytes = 0, second_bytes = 0;
  const char first = letter(at + 1, first_bytes);
  if (first == 's' || first == 't' || first == 'm' || first == 'd') return 1 + first_bytes;
  const char second = letter(at + 1 + first_bytes, second_bytes);
  if ((first == 'r' && second == 'e') || (first == 'v' && second == 'e') || (first == 'l' && second == 'l'))
    return 1 + first_bytes + second_bytes;
  return 0;
}

//! Whether byte `at` of `text` is a line end, `\r` or `\n`.
inline bool is_line_end(std::string_view text, std::size_t at) noexcept {
  return text[at] == '\r' || text[at] == '\n';
}

//! The end of ` ?[^\s\p{L}\p{N}]+[\r\n]*` (with `slash`, `[\r\n/]*`: o200k_base's) at byte `at`,
//! or npos where it does not match there.
inline std::size_t punctuation_end(std::string_view text, std::size_t at, bool slash) noexcept {
  const std::size_t run = text[at] == ' ' && at + 1 < text.size() ? at + 1 : at;
  if (char_at(text, run).kind != CharClass::other) return std::string_view::npos;
  std::size_t end = class_run_end(text, run, CharClass::other);
  while (end < text.size() && (is_line_end(text, end) || (slash && text[end] == '/'))) ++end;
  return end;
}

//! The end of the piece of white space at byte `at` of `text`, by cl100k_base's alternatives
//! `\s++$|\s*[\r\n]|\s+(?!\S)|\s` (`whole_at_end`) or Llama 3's and o200k_base's
//! `\s*[\r\n]+|\s+(?!\S)|\s+` (the first only differs): of the run W from `at`, all of it at the
//! end of the text (cl100k_base); else W up to its last line end; else W less its last character
//! where text follows and W has more than one; else all of W.
inline std::size_t white_space_end(std::string_view text, std::size_t at, bool whole_at_end) noexcept {
  constexpr std::size_t none = std::string_view::npos;
  std::size_t last_line_end = none, last = at, end = at;
  while (end < text.size()) {
    const TextChar w = char_at(text, end);
    if (w.kind != CharClass::space) break;
    if (is_line_end(text, end)) last_line_end = end;
    last = end;
    end += w.bytes;
  }
  if (whole_at_end && end == text.size()) return end;
  if (last_line_end != none) return last_line_end + 1;
  if (end < text.size() && last > at) return last;
  return end;
}

//! cl100k_pretokenize and llama3_pretokenize, which differ only where the text ends in white
//! space holding a line end: `whole_trailing_space` is cl100k_base's `\s++$`.
inline std::vector<std::string_view> cl100k_family_pretokenize(std::string_view text, bool whole_trailing_space) {
  std::vector<std::string_view> pieces;
  const std::size_t n = text.size();
  std::size_t at = 0;
  while (at < n) {
    const TextChar ch = char_at(text, at);
    std::size_t end = std::string_view::npos;
    if (const std::size_t c = contraction_ignoring_case(text, at); c > 0) {
      end = at + c;
    } else if (ch.kind == CharClass::letter) {  // [^\r\n\p{L}\p{N}]?\p{L}+, without the character before
      end = class_run_end(text, at, CharClass::letter);
    } else if (ch.kind != CharClass::number && !is_line_end(text, at) && at + ch.bytes < n &&
               char_at(text, at + ch.bytes).kind == CharClass::letter) {  // ... with it
      end = class_run_end(text, at + ch.bytes, CharClass::letter);
    } else if (ch.kind == CharClass::number) {  // \p{N}{1,3}
      end = class_run_end(text, at, CharClass::number, 3);
    } else {
      end = punctuation_end(text, at, false);
      if (end == std::string_view::npos) end = white_space_end(text, at, whole_trailing_space);
    }
    pieces.push_back(text.substr(at, end - at));
    at = end;
  }
  return pieces;
}

//! How o200k_base's letter classes see a character: `upper` is in [\p{Lu}\p{Lt}] only, `lower` in
//! \p{Ll} only, `caseless` (\p{Lm}, \p{Lo} and the marks \p{M}) in both of the pattern's classes
//! [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}] and [\p{Ll}\p{Lm}\p{Lo}\p{M}]; `none` in neither.
enum class LetterCase : unsigned char { upper, lower, caseless, none };

//! The LetterCase of code point `c`.
inline LetterCase letter_case(char32_t c) noexcept {
  if (c < 0x80) {
    if (c >= 'A' && c <= 'Z') return LetterCase::upper;
    return c >= 'a' && c <= 'z' ? LetterCase::lower : LetterCase::none;
  }
  if (in_ranges(unicode_upper_letters, c)) return LetterCase::upper;
  if (in_ranges(unicode_lower_letters, c)) return LetterCase::lower;
  if (in_ranges(unicode_letters, c) || in_ranges(unicode_marks, c)) return LetterCase::caseless;
  return LetterCase::none;
}

//! One character of a byte string as o200k_base's letter classes see it, and its length in bytes.
struct CasedChar {
  LetterCase letter;
  std::size_t bytes;
};

//! The character at byte `at` of `text` (LetterCase::none where the bytes are not UTF-8).
inline CasedChar cased_char_at(std::string_view text, std::size_t at) noexcept {
  const CodePointAt ch = code_point_at(text, at);
  return {ch.valid ? letter_case(ch.c) : LetterCase::none, ch.bytes};
}

//! o200k_base's two letter alternatives from byte `p`, then the contraction after them: with
//! `lower_last`, `[U]*[W]+` (U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}], W = [\p{Ll}\p{Lm}\p{Lo}\p{M}]),
//! else `[U]+[W]*`. Returns where the match ends, or npos.
inline std::size_t o200k_letters_end(std::string_view text, std::size_t p, bool lower_last) noexcept {
  constexpr std::size_t none = std::string_view::npos;
  const auto in_upper = [](LetterCase l) { return l == LetterCase::upper || l == LetterCase::caseless; };
  const auto in_lower = [](LetterCase l) { return l == LetterCase::lower || l == LetterCase::caseless; };
  // The run of U from p, and the end of its last character that is in W too.
  std::size_t run = p, last_lower_end = none;
  while (run < text.size()) {
    const CasedChar ch = cased_char_at(text, run);
    if (!in_upper(ch.letter)) break;
    run += ch.bytes;
    if (in_lower(ch.letter)) last_lower_end = run;
  }
  const auto lower_run_end = [&](std::size_t at) {
    while (at < text.size()) {
      const CasedChar ch = cased_char_at(text, at);
      if (!in_lower(ch.letter)) break;
      at += ch.bytes;
    }
    return at;
  };
  std::size_t end = none;
  if (!lower_last) {
    if (run > p) end = lower_run_end(run);  // [U]+, then [W]* from where the run ends
  } else if (run < text.size() && cased_char_at(text, run).letter == LetterCase::lower) {
    end = lower_run_end(run);  // [U]* the whole run, [W]+ from where it ends
  } else if (last_lower_end != none) {
    end = last_lower_end;  // [U]* gives back the run's last W character, which [W]+ takes
  }
  return end == none ? none : end + contraction_ignoring_case(text, end);
}

}  // namespace detail

//! tiktoken's o200k_base pre-tokenization of `text` (Pretokenizer::o200k; GPT-4o's), written out
//! as a scanner; its pattern is io::o200k_pattern. Letter runs split where case falls back from
//! lower to upper ("loomWeaves" is "loom", "Weaves"), with at most one character before them that
//! is not a line end, letter or number, and the contraction after them; numbers three digits at a
//! time; punctuation takes the line ends and slashes after it; white space as Llama 3's.
inline std::vector<std::string_view> o200k_pretokenize(std::string_view text) {
  std::vector<std::string_view> pieces;
  const std::size_t n = text.size();
  constexpr std::size_t none = std::string_view::npos;
  std::size_t at = 0;
  while (at < n) {
    const detail::TextChar ch = detail::char_at(text, at);
    // [^\r\n\p{L}\p{N}]? before the letters: tried with the character, then without it.
    const bool may_lead = (ch.kind == detail::CharClass::space || ch.kind == detail::CharClass::other) &&
                          !detail::is_line_end(text, at);
    std::size_t end = none;
    for (const bool lower_last : {true, false}) {
      if (may_lead) end = detail::o200k_letters_end(text, at + ch.bytes, lower_last);
      if (end == none) end = detail::o200k_letters_end(text, at, lower_last);
      if (end != none) break;
    }
    if (end == none && ch.kind == detail::CharClass::number)
      end = detail::class_run_end(text, at, detail::CharClass::number, 3);
    if (end == none) end = detail::punctuation_end(text, at, true);
    if (end == none) end = detail::white_space_end(text, at, false);
    pieces.push_back(text.substr(at, end - at));
    at = end;
  }
  return pieces;
}

//! tiktoken's cl100k_base pre-tokenization of `text` (Pretokenizer::cl100k), written out as a
//! scanner; its pattern is io::cl100k_pattern. Bytes that are not UTF-8 count as
//! characters of their own, neither letters, numbers nor white space.
inline std::vector<std::string_view> cl100k_pretokenize(std::string_view text) {
  return detail::cl100k_family_pretokenize(text, true);
}

//! Llama 3's pre-tokenization of `text` (Pretokenizer::llama3): cl100k_pretokenize's pieces,
//! except that white space holding a line end at the end of the text ends a piece after its last
//! line end.
inline std::vector<std::string_view> llama3_pretokenize(std::string_view text) {
  return detail::cl100k_family_pretokenize(text, false);
}

//! The pieces of `text` by pattern `p`, in order; together they are `text`.
inline std::vector<std::string_view> pretokenize(Pretokenizer p, std::string_view text) {
  switch (p) {
    case Pretokenizer::cl100k: return cl100k_pretokenize(text);
    case Pretokenizer::llama3: return llama3_pretokenize(text);
    case Pretokenizer::o200k: return o200k_pretokenize(text);
    case Pretokenizer::gpt2: break;
  }
  return gpt2_pretokenize(text);
}

//! Text to token ids for a byte-level BPE vocabulary: a pre-tokenizer (Pretokenizer), then the
//! merges within each piece. Two ways to rank the merges (see the file note):
//! - from the ids (GPT-2's llm.c file and vocab.json, a tiktoken file: the ids are the merge
//!   ranks): the adjacent pair whose concatenation is the token of lowest id merges first
//!   (tiktoken's rule);
//! - from a merge list (TokenizerRules, a Hugging Face tokenizer.json, whose ids need not be in
//!   merge order: RoBERTa's are not): the adjacent pair that is the earliest merge merges first
//!   (Hugging Face's rule).
//! Every byte needs a token of its own. Or, for a tokenizer.json whose model is WordPiece
//! (TokenizerRules::word_piece), BERT's normalizer, pre-tokenizer and WordPiece
//! (detail::WordPiece). Added tokens (the end-of-text token's text, or a tokenizer.json's
//! added_tokens) are matched in the text as it is first.
class TokenEncoder {
 public:
  //! Ranks from the ids: each byte string's lowest id. The end-of-text token is written as the
  //! literal `<|endoftext|>` in the text (as nanoGPT and llm.c write it between documents). Throws
  //! loom::Error naming the first byte that has no token.
  explicit TokenEncoder(const TokenDecoder& vocabulary) : TokenEncoder(vocabulary, {}, false) {}

  //! Ranks from the ids, as above, with the text split by `pretokenizer` (tiktoken's cl100k_base
  //! ranks with Pretokenizer::cl100k, say).
  TokenEncoder(const TokenDecoder& vocabulary, Pretokenizer pretokenizer)
      : TokenEncoder(vocabulary, split_by(pretokenizer), false) {}

  //! Ranks from `rules.merges`, whose tokens and results must be tokens of `vocabulary`, or
  //! WordPiece where `rules.word_piece` is set; the text split at `rules.added` first. Throws
  //! loom::Error naming a byte without a token (BPE), a merge of bytes that are not tokens, or an
  //! id outside `vocabulary`.
  TokenEncoder(const TokenDecoder& vocabulary, TokenizerRules rules) : TokenEncoder(vocabulary, std::move(rules), true) {}

  //! The encoder of any tokenizer file (read_tokenizer): the rules of a tokenizer.json, a
  //! vocab.json with its merges.txt or a vocab.txt (`options` apply to a vocab.txt only), or
  //! ranks from the ids of a tiktoken file (split by its encoding's pattern), llm.c's file or a
  //! vocab.json alone. The last two hold only where the ids are a BPE's merges in order, as
  //! GPT-2's are: a vocabulary with a token that is not two tokens of lower ids (RoBERTa's
  //! vocab.json alone) is refused, naming the token, rather than encoded otherwise than its own
  //! tokenizer would.
  static TokenEncoder read(const std::filesystem::path& path, const VocabTxtOptions& options = {}) {
    TokenizerFile file = read_tokenizer(path, options);
    if (file.rules) return TokenEncoder(file.decoder, std::move(*file.rules));
    TokenEncoder encoder(file.decoder, file.pretokenizer);
    // A tiktoken file's ranks are its merge ranks by definition: tiktoken encodes by them alone.
    if (!detail::is_tiktoken(path)) encoder.check_merge_ranks(file.decoder, "tokenizer " + detail::quoted(path));
    return encoder;
  }

  //! The ids of `text`: the added tokens where they stand, and between them the pre-tokenized
  //! pieces, each merged on its own.
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids;
    ids.reserve(text.size() / 3 + 1);
    // next[a]: where added token a next stands at or after `at` (npos: nowhere).
    std::vector<std::size_t> next(added_.size());
    for (std::size_t a = 0; a < added_.size(); ++a) next[a] = text.find(added_[a].text);
    std::size_t at = 0;
    while (at < text.size()) {
      std::size_t found = std::string_view::npos, which = 0;
      for (std::size_t a = 0; a < added_.size(); ++a) {
        if (next[a] != std::string_view::npos && next[a] < at) next[a] = text.find(added_[a].text, at);
        const bool longer = next[a] == found && found != std::string_view::npos &&
                            added_[a].text.size() > added_[which].text.size();
        if (next[a] < found || longer) {
          found = next[a];
          which = a;
        }
      }
      if (found == std::string_view::npos) {
        encode_text(text.substr(at), ids);
        break;
      }
      const AddedToken& token = added_[which];
      const std::size_t before = token.strip_left ? white_space_run_start(text, at, found) : found;
      encode_text(text.substr(at, before - at), ids);
      ids.push_back(token.id);
      at = found + token.text.size();
      if (token.strip_right) at = detail::class_run_end(text, at, detail::CharClass::space);
    }
    return ids;
  }

  //! Appends the ids of one piece to `out`. Ranked from the ids (or with ignore_merges), a piece
  //! that is a token is that token; otherwise it starts as its bytes and the best-ranked adjacent
  //! pair merges, the leftmost among equals, until no adjacent pair merges.
  void encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const {
    if (piece.empty()) return;
    if (!from_merges_ || ignore_merges_)
      if (const std::int32_t id = token_id(piece); id != none) {
        out.push_back(id);
        return;
      }
    if (from_merges_) return merge_by_list(piece, out);
    // starts[k] is where part k begins; ranks[k] the rank of parts k and k + 1 together.
    std::vector<std::size_t> starts(piece.size() + 1);
    for (std::size_t k = 0; k <= piece.size(); ++k) starts[k] = k;
    const auto pair_rank = [&](std::size_t k) {
      return k + 2 < starts.size() ? token_id(piece.substr(starts[k], starts[k + 2] - starts[k])) : none;
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
      out.push_back(part.size() == 1 ? byte_ids_[static_cast<unsigned char>(part[0])] : token_id(part));
    }
  }

  //! The ids of `text`, exactly as encode(text) gives them, the text encoded in up to `threads`
  //! parts at once. It is cut only just after a line end that follows a character other than
  //! white space and precedes one (for o200k_base, one other than a slash), where a piece (of
  //! each Pretokenizer's pattern) and a word (BERT's) end whatever the text around, and never
  //! where an added token that takes the white space before it starts. A tokenizer whose
  //! stretches of text each get a space (add_prefix_space), or with an added token that holds a
  //! line end, encodes in one part.
  std::vector<std::int32_t> encode(std::string_view text, int threads) const {
    const std::vector<std::size_t> cuts = cut_points(text, threads);
    if (cuts.size() <= 2) return encode(text);
    std::vector<std::vector<std::int32_t>> parts(cuts.size() - 1);
    std::vector<std::exception_ptr> errors(parts.size());
    {
      std::vector<std::jthread> workers;
      for (std::size_t k = 0; k < parts.size(); ++k)
        workers.emplace_back([&, k] {
          try {
            parts[k] = encode(text.substr(cuts[k], cuts[k + 1] - cuts[k]));
          } catch (...) {
            errors[k] = std::current_exception();
          }
        });
    }
    for (const std::exception_ptr& error : errors)
      if (error) std::rethrow_exception(error);
    std::size_t total = 0;
    for (const auto& part : parts) total += part.size();
    std::vector<std::int32_t> ids;
    ids.reserve(total);
    for (const auto& part : parts) ids.insert(ids.end(), part.begin(), part.end());
    return ids;
  }

  //! Where encode(text, threads) cuts `text`: 0, the cuts in order, text.size(). The parts are
  //! about text.size() / threads long; the cut after each part's share of the text is the first
  //! place that may be cut (see encode) from there on, so there may be fewer parts.
  std::vector<std::size_t> cut_points(std::string_view text, int threads) const {
    std::vector<std::size_t> cuts{0};
    const bool may_cut = !add_prefix_space_ && std::none_of(added_.begin(), added_.end(), [](const AddedToken& t) {
      return t.text.find('\n') != std::string::npos;
    });
    const std::size_t share = threads > 1 ? text.size() / static_cast<std::size_t>(threads) : text.size();
    for (std::size_t at = share; may_cut && share > 0 && at < text.size();) {
      const std::size_t line_end = text.find('\n', at);  // a cut past `at`: past the last one too
      if (line_end == std::string_view::npos) break;
      const std::size_t cut = line_end + 1;
      if (may_cut_at(text, cut)) cuts.push_back(cut);
      at = std::max(cut, cuts.size() * share);
    }
    cuts.push_back(text.size());
    return cuts;
  }

  //! The end-of-text id, or -1.
  std::int32_t end_of_text() const noexcept { return end_of_text_; }

  //! The pattern a byte-level BPE splits the text by (gpt2 for a WordPiece, which has its own).
  Pretokenizer pretokenizer() const noexcept { return pretokenizer_; }

  //! The vocabulary's size: every id encode gives is below it.
  std::int32_t vocab_size() const noexcept { return vocab_size_; }

 private:
  static constexpr std::int32_t none = std::numeric_limits<std::int32_t>::max();

  //! Rules with nothing but the pretokenizer.
  static TokenizerRules split_by(Pretokenizer pretokenizer) {
    TokenizerRules rules;
    rules.pretokenizer = pretokenizer;
    return rules;
  }

  TokenEncoder(const TokenDecoder& vocabulary, TokenizerRules rules, bool from_merges)
      : end_of_text_(vocabulary.end_of_text()),
        vocab_size_(static_cast<std::int32_t>(vocabulary.size())),
        from_merges_(from_merges),
        add_prefix_space_(rules.add_prefix_space),
        ignore_merges_(rules.ignore_merges),
        pretokenizer_(rules.pretokenizer),
        added_(std::move(rules.added)) {
    if (!from_merges && end_of_text_ >= 0) added_.push_back({vocabulary.bytes(end_of_text_), end_of_text_});
    for (const AddedToken& token : added_)
      LOOM_CHECK(!token.text.empty() && token.id >= 0 && token.id < vocabulary.size(), "token encoder: added token id",
                 token.id, "must be a token id below " + loom::detail::to_text(vocabulary.size()) + " with text");
    if (rules.word_piece) {
      for (const auto& [token, id] : rules.word_piece->vocab)
        LOOM_CHECK(id >= 0 && id < vocabulary.size(), "token encoder: id of WordPiece token " + json_quote(token), id,
                   "must be below " + loom::detail::to_text(vocabulary.size()));
      word_piece_.emplace(std::move(*rules.word_piece));
      return;
    }
    // Added tokens are matched in the text only: no merge makes one.
    std::vector<bool> added_id(static_cast<std::size_t>(vocabulary.size()), false);
    for (const AddedToken& token : added_) added_id[static_cast<std::size_t>(token.id)] = true;
    byte_ids_.fill(-1);
    token_ids_.reserve(static_cast<std::size_t>(vocabulary.size()));
    for (std::int32_t id = 0; id < vocabulary.size(); ++id) {
      const std::string& bytes = vocabulary.bytes(id);
      if (added_id[static_cast<std::size_t>(id)] || bytes.empty()) continue;
      token_ids_.try_emplace(bytes, id);
      if (bytes.size() == 1 && byte_ids_[static_cast<unsigned char>(bytes[0])] < 0)
        byte_ids_[static_cast<unsigned char>(bytes[0])] = id;
    }
    for (std::size_t b = 0; b < byte_ids_.size(); ++b)
      LOOM_CHECK(byte_ids_[b] >= 0, "token encoder: byte", b,
                 "has no token of its own: a byte-level BPE vocabulary has one for each of the 256 bytes");
    merge_results_.reserve(rules.merges.size());
    merge_ranks_.reserve(rules.merges.size());
    for (std::size_t r = 0; r < rules.merges.size(); ++r) {
      const std::string& left = rules.merges[r].first;
      const std::string& right = rules.merges[r].second;
      const auto what = [&] {
        return "token encoder: merge " + loom::detail::to_text(r) + " (" + json_quote(left) + ", " + json_quote(right) +
               ")";
      };
      const std::int32_t a = token_id(left), b = token_id(right), merged = token_id(left + right);
      LOOM_CHECK(a != none && b != none, what(), json_quote(a == none ? left : right), "is not a token");
      LOOM_CHECK(merged != none, what(), json_quote(left + right), "is not a token: a merge makes a token");
      if (merge_ranks_.try_emplace(pair_key(a, b), static_cast<std::int32_t>(r)).second)
        merge_results_.push_back(merged);
      else
        merge_results_.push_back(none);  // a repeated merge: its first rank stands
    }
  }

  //! Refuses `vocabulary` (named `name`), read for ranks from its ids, where they are not a
  //! byte-level BPE's merge ranks: where a token (the end-of-text one aside) of two bytes or more
  //! is not the concatenation of two tokens of lower ids. Every merge of a BPE joins two tokens
  //! made before it, so merge-ordered ids (GPT-2's: all 50,256 of its tokens pass) always are.
  void check_merge_ranks(const TokenDecoder& vocabulary, const std::string& name) const {
    const auto below = [&](std::string_view bytes, std::int32_t id) {
      const auto it = token_ids_.find(bytes);
      return it != token_ids_.end() && it->second < id;
    };
    for (std::int32_t id = 0; id < vocabulary.size(); ++id) {
      const std::string_view bytes = vocabulary.bytes(id);
      if (bytes.size() < 2 || id == end_of_text_) continue;
      bool made = false;
      for (std::size_t k = 1; k < bytes.size() && !made; ++k)
        made = below(bytes.substr(0, k), id) && below(bytes.substr(k), id);
      if (!made)
        throw Error(name + ": token " + loom::detail::to_text(id), json_quote(bytes),
                    "is not two tokens of lower ids, so the ids are not merge ranks (a RoBERTa vocab.json's are "
                    "not) and loom would encode otherwise than its tokenizer: put its merges.txt beside it, or give "
                    "its tokenizer.json");
    }
  }

  //! merge_ranks_'s key of the adjacent tokens a, b.
  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) noexcept {
    return static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32 | static_cast<std::uint32_t>(b);
  }

  //! The lowest id of the token with these bytes, or none (added tokens are not looked up).
  std::int32_t token_id(std::string_view bytes) const {
    const auto it = token_ids_.find(bytes);
    return it == token_ids_.end() ? none : it->second;
  }

  //! The rank of the merge of tokens a and b, or none.
  std::int32_t merge_rank(std::int32_t a, std::int32_t b) const {
    const auto it = merge_ranks_.find(pair_key(a, b));
    return it == merge_ranks_.end() ? none : it->second;
  }

  //! encode_piece by the merge list: the parts are tokens from the start, and each merge of two
  //! adjacent ones is the merge list's result.
  void merge_by_list(std::string_view piece, std::vector<std::int32_t>& out) const {
    std::vector<std::int32_t> parts(piece.size());
    for (std::size_t k = 0; k < piece.size(); ++k) parts[k] = byte_ids_[static_cast<unsigned char>(piece[k])];
    const auto pair_rank = [&](std::size_t k) { return k + 1 < parts.size() ? merge_rank(parts[k], parts[k + 1]) : none; };
    std::vector<std::int32_t> ranks(parts.size());
    for (std::size_t k = 0; k < ranks.size(); ++k) ranks[k] = pair_rank(k);
    while (parts.size() > 1) {
      const auto lowest = std::min_element(ranks.begin(), ranks.end() - 1);
      if (*lowest == none) break;
      const auto k = static_cast<std::size_t>(lowest - ranks.begin());
      parts[k] = merge_results_[static_cast<std::size_t>(*lowest)];
      parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(k) + 1);
      ranks.erase(ranks.begin() + static_cast<std::ptrdiff_t>(k) + 1);
      ranks[k] = pair_rank(k);
      if (k > 0) ranks[k - 1] = pair_rank(k - 1);
    }
    out.insert(out.end(), parts.begin(), parts.end());
  }

  //! Appends the ids of a stretch of text between added tokens: its pieces, with a space before
  //! it where add_prefix_space asks for one.
  void encode_text(std::string_view text, std::vector<std::int32_t>& out) const {
    if (text.empty()) return;
    if (word_piece_) return word_piece_->encode(text, out);
    if (add_prefix_space_ && text.front() != ' ') {
      const std::string spaced = " " + std::string(text);
      for (const std::string_view piece : pretokenize(pretokenizer_, spaced)) encode_piece(piece, out);
      return;
    }
    for (const std::string_view piece : pretokenize(pretokenizer_, text)) encode_piece(piece, out);
  }

  //! Where the white space that ends text[from, to) starts (to where it ends in none).
  static std::size_t white_space_run_start(std::string_view text, std::size_t from, std::size_t to) {
    std::size_t run = from;
    for (std::size_t at = from; at < to;) {
      const detail::TextChar ch = detail::char_at(text.substr(0, to), at);
      at += ch.bytes;
      if (ch.kind != detail::CharClass::space) run = at;
    }
    return run;
  }

  //! Whether `text` may be cut at `cut`, just after a line end (cut_points): a character other
  //! than white space before the line end and at the cut (other than a slash for o200k_base,
  //! whose punctuation takes the line ends and slashes after it), and no added token that takes
  //! the white space before it starting there.
  bool may_cut_at(std::string_view text, std::size_t cut) const {
    if (cut < 2 || cut >= text.size() || text[cut - 1] != '\n') return false;
    if (detail::char_at(text, cut).kind == detail::CharClass::space) return false;
    if (pretokenizer_ == Pretokenizer::o200k && text[cut] == '/') return false;
    // The character that ends at the line end: the last one starting within 4 bytes before it
    // whose length reaches it (a stray byte is a character of its own).
    std::size_t before = cut - 2;
    while (before > 0 && cut - 1 - before < 4 && (static_cast<unsigned char>(text[before]) & 0xc0) == 0x80) --before;
    if (before + detail::char_at(text, before).bytes != cut - 1) before = cut - 2;
    if (detail::char_at(text, before).kind == detail::CharClass::space) return false;
    return std::none_of(added_.begin(), added_.end(),
                        [&](const AddedToken& t) { return t.strip_left && text.substr(cut).starts_with(t.text); });
  }

  std::unordered_map<std::string, std::int32_t, detail::BytesHash, std::equal_to<>> token_ids_;
  std::unordered_map<std::uint64_t, std::int32_t> merge_ranks_;  // (left, right) -> rank
  std::vector<std::int32_t> merge_results_;                      // rank -> the merged token
  std::array<std::int32_t, 256> byte_ids_{};
  std::int32_t end_of_text_ = -1;
  std::int32_t vocab_size_ = 0;
  bool from_merges_ = false, add_prefix_space_ = false, ignore_merges_ = false;
  Pretokenizer pretokenizer_ = Pretokenizer::gpt2;
  std::vector<AddedToken> added_;
  std::optional<detail::WordPiece> word_piece_;  // a WordPiece model, in place of the BPE above
};

}  // namespace loom::io
