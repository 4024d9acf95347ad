#pragma once
//! \file Token ids back to text, each id's bytes, read from any tokenizer file loom knows:
//! llm.c's tokenizer file (`gpt2_tokenizer.bin`), a Hugging Face `vocab.json` or `tokenizer.json`,
//! a BERT `vocab.txt`, or a tiktoken file (`cl100k_base.tiktoken`: a line per token, its bytes in
//! base64 and its rank). The last two also give the rules TokenEncoder (token_encoder.hpp)
//! encodes with (TokenizerRules): a byte-level BPE's merges and added tokens, or a WordPiece.
//!
//! llm.c's format: a header of 256 little-endian int32 {20240328, version, vocab_size,
//! end-of-text id (version 2), 0...}, then for each id its length in bytes (one uint8) and the
//! bytes. `vocab.json` maps each token, written through GPT-2's byte-to-character table, to its id.
//! `tokenizer.json` holds such a map as `model.vocab`, the merges in rank order as
//! `model.merges`, and the tokens matched in the text as they are as `added_tokens`. `vocab.txt`
//! holds a WordPiece vocabulary, a token a line.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <unordered_map>
#include <utility>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/io/json.hpp"
#include "loom/io/token_file.hpp"

namespace loom::io {

//! Magic number in word 0 of llm.c's tokenizer file.
inline constexpr std::int32_t llmc_tokenizer_magic = 20240328;

namespace detail {

//! GPT-2's byte-to-character table (byte-level BPE): the bytes that print as themselves (`!` to
//! `~`, U+00A1 to U+00AC, U+00AE to U+00FF) are their own code point; the other 68, in increasing
//! order, are U+0100 onwards. Returns the byte of code point `c`, or -1 for one outside the table.
inline int byte_of_code_point(char32_t c) noexcept {
  const auto prints = [](unsigned b) { return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae); };
  if (c < 0x100) return prints(static_cast<unsigned>(c)) ? static_cast<int>(c) : -1;
  unsigned index = static_cast<unsigned>(c) - 0x100;  // the index-th byte that does not print
  for (unsigned b = 0; b < 0x100; ++b)
    if (!prints(b) && index-- == 0) return static_cast<int>(b);
  return -1;
}

//! The code points of valid UTF-8 `text` (Json strings are checked when parsed).
inline std::vector<char32_t> code_points(std::string_view text) {
  std::vector<char32_t> out;
  for (std::size_t i = 0; i < text.size();) {
    const auto byte = static_cast<unsigned char>(text[i]);
    const std::size_t length = byte < 0x80 ? 1 : byte < 0xe0 ? 2 : byte < 0xf0 ? 3 : 4;
    char32_t c = length == 1 ? byte : byte & (0x7f >> length);
    for (std::size_t k = 1; k < length; ++k) c = (c << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3f);
    out.push_back(c);
    i += length;
  }
  return out;
}

//! Unicode's White_Space property (PropList.txt): 25 code points.
constexpr bool is_white_space(char32_t c) noexcept {
  return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

//! A character of a byte string: its code point (U+FFFD where the bytes are not well-formed
//! UTF-8, one byte then), its length in bytes, and whether it was well-formed.
struct CodePointAt {
  char32_t c;
  std::size_t bytes;
  bool valid;
};

//! The character at byte `at` of `text`: a well-formed UTF-8 sequence (no overlong forms, no
//! surrogates, at most U+10FFFF), or else one byte.
inline CodePointAt code_point_at(std::string_view text, std::size_t at) noexcept {
  constexpr CodePointAt invalid{0xfffd, 1, false};
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(text[at + k]); };
  const unsigned lead = byte(0);
  if (lead < 0x80) return {lead, 1, true};
  const std::size_t length = lead >= 0xc2 && lead <= 0xdf ? 2 : lead >= 0xe0 && lead <= 0xef ? 3
                             : lead >= 0xf0 && lead <= 0xf4                                   ? 4
                                                                                              : 0;
  if (length == 0 || text.size() - at < length) return invalid;
  char32_t c = lead & (0x7fu >> length);
  for (std::size_t k = 1; k < length; ++k) {
    if ((byte(k) & 0xc0) != 0x80) return invalid;
    c = (c << 6) | (byte(k) & 0x3f);
  }
  const bool overlong = (length == 3 && c < 0x800) || (length == 4 && c < 0x10000);
  if (overlong || (c >= 0xd800 && c <= 0xdfff) || c > 0x10ffff) return invalid;
  return {c, length, true};
}

//! The bytes of `token`, written through GPT-2's byte-to-character table; throws loom::Error
//! naming `file` and the token for a character outside the table.
inline std::string token_bytes(const std::string& token, const std::string& file) {
  std::string bytes;
  for (const char32_t c : code_points(token)) {
    const int b = byte_of_code_point(c);
    LOOM_CHECK(b >= 0, file + ": token " + json_quote(token) + " character", static_cast<std::uint32_t>(c),
               "is not in GPT-2's byte-to-character table: this is not a byte-level BPE vocabulary");
    bytes.push_back(static_cast<char>(b));
  }
  return bytes;
}

//! The JSON file at `path`, parsed; `name` becomes its name in messages (`kind` and the path).
inline Json read_json_file(const std::filesystem::path& path, const std::string& kind, std::string& name) {
  name = kind + " " + quoted(path);
  return Json::parse(read_text_file(path, kind), name);
}

}  // namespace detail

//! A token that a Hugging Face tokenizer matches in the text as it is, before pre-tokenizing
//! (`added_tokens`: GPT-2's <|endoftext|>, RoBERTa's <s>, </s> and <mask>, ...).
struct AddedToken {
  std::string text;  //!< its bytes in the text
  std::int32_t id = 0;
  bool strip_left = false;   //!< takes the white space before it too (Hugging Face's `lstrip`)
  bool strip_right = false;  //!< takes the white space after it too (`rstrip`)
  //! Matched in the normalized text (Hugging Face's `normalized`): read, and refused where there
  //! is a normalizer, since loom matches added tokens before it.
  bool normalized = false;
};

//! BERT's WordPiece (Devlin et al. 2019; a tokenizer.json whose model is WordPiece): its
//! vocabulary as text, and the options of its normalizer (Hugging Face's BertNormalizer; all off
//! where the file has none). Its pre-tokenizer is BertPreTokenizer: pieces at white space and at
//! each punctuation character.
struct WordPieceRules {
  std::vector<std::pair<std::string, std::int32_t>> vocab;  //!< each token's text (UTF-8) and id
  std::int32_t unknown = 0;      //!< the id of a word it cannot spell ([UNK])
  std::string prefix = "##";     //!< what starts a piece that continues a word
  std::int64_t max_chars = 100;  //!< a longer word is unknown whole
  bool clean_text = false;       //!< drop control characters, make white space spaces
  bool chinese_chars = false;    //!< a space before and after each CJK ideograph
  bool strip_accents = false;    //!< decompose (NFD) and drop the nonspacing marks
  bool lowercase = false;
};

//! The pattern a byte-level BPE splits text into pieces by before it merges within each
//! (TokenEncoder; the scanners are in token_encoder.hpp):
//! - `gpt2`: GPT-2's (Radford et al. 2019); tiktoken's r50k_base and p50k_base split alike;
//! - `cl100k`: tiktoken's cl100k_base (GPT-3.5, GPT-4): contractions in either case, a letter
//!   run with one character before it that is not a line end, number, or letter, numbers three
//!   digits at a time, punctuation with the line ends after it;
//! - `llama3`: Meta Llama 3's (its tokenizer.json's Split), which is cl100k_base's first form:
//!   the same pieces, except that white space holding a line end at the end of a text splits
//!   after its last line end where cl100k_base keeps it whole;
//! - `o200k`: tiktoken's o200k_base (GPT-4o): as llama3, but letter runs split where case falls
//!   from lower to upper and take the contraction after them, and punctuation takes slashes too.
enum class Pretokenizer : unsigned char { gpt2, cl100k, llama3, o200k };

//! The pretokenizer's name: gpt2, cl100k, llama3 or o200k.
constexpr std::string_view name(Pretokenizer p) noexcept {
  switch (p) {
    case Pretokenizer::gpt2: return "gpt2";
    case Pretokenizer::cl100k: return "cl100k";
    case Pretokenizer::llama3: return "llama3";
    case Pretokenizer::o200k: return "o200k";
  }
  return "?";
}

//! tiktoken 0.14's o200k_base pattern (Pretokenizer::o200k): its seven alternatives joined by `|`.
//! Oniguruma (Hugging Face's `tokenizers`) reads it as tiktoken does.
inline constexpr std::string_view o200k_pattern =
    R"re([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)re"
    R"re(|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)re"
    R"re(|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

//! tiktoken 0.14's cl100k_base pattern (Pretokenizer::cl100k). Not read from a tokenizer.json:
//! `tokenizers` runs Oniguruma, where `\p{N}{1,3}+` is `(\p{N}{1,3})+`, not possessive, so its
//! digit runs would not be cut in threes as tiktoken cuts them.
inline constexpr std::string_view cl100k_pattern =
    R"re('(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s)re";

//! The Split patterns of a tokenizer.json that loom reads (exactly as written), and the
//! pretokenizer that splits as Hugging Face's `tokenizers` does with each.
struct PretokenizerPattern {
  Pretokenizer pretokenizer;
  std::string_view regex;
};
inline constexpr PretokenizerPattern pretokenizer_patterns[] = {
    {Pretokenizer::gpt2, R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re"},
    // tiktoken 0.14's r50k_base: possessive, the same pieces.
    {Pretokenizer::gpt2, R"re('(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s)re"},
    {Pretokenizer::llama3,
     R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re"},
    {Pretokenizer::o200k, o200k_pattern},
};

//! How a Hugging Face tokenizer.json encodes, beyond its tokens: TokenEncoder's second
//! constructor. A byte-level BPE (`word_piece` empty) ranks its merges by `merges`, where the ids
//! need not be in merge order; a WordPiece spells words from `word_piece`'s vocabulary.
struct TokenizerRules {
  //! Matched in the text before anything else, the leftmost first, the longest among those.
  std::vector<AddedToken> added;
  //! BPE: the merges in rank order, each the bytes of two tokens whose concatenation is a token.
  std::vector<std::pair<std::string, std::string>> merges;
  //! BPE: a space before each stretch of text between added tokens that does not start with one
  //! (the ByteLevel pre-tokenizer's `add_prefix_space`).
  bool add_prefix_space = false;
  //! BPE: a piece that is a token is that token, whatever the merges would make of it
  //! (`ignore_merges`).
  bool ignore_merges = false;
  //! BPE: the pattern that splits the text into pieces (ByteLevel's own, GPT-2's; or a Split's
  //! before a ByteLevel without one).
  Pretokenizer pretokenizer = Pretokenizer::gpt2;
  //! WordPiece, where the model is one.
  std::optional<WordPieceRules> word_piece;
};

//! Each token id's bytes, for printing what a model generates. Construct from the table, or read
//! one of the three files.
class TokenDecoder {
 public:
  //! `tokens[id]` is token id's bytes; `end_of_text` is the end-of-text id (GPT-2's
  //! <|endoftext|>, 50256), or -1 where the vocabulary has none.
  explicit TokenDecoder(std::vector<std::string> tokens, std::int32_t end_of_text = -1)
      : tokens_(std::move(tokens)), end_of_text_(end_of_text) {
    LOOM_CHECK(!tokens_.empty(), "token decoder: tokens", tokens_.size(), "must be at least one");
    LOOM_CHECK(end_of_text >= -1 && end_of_text < size(), "token decoder: end-of-text id", end_of_text,
               "must be a token id below " + loom::detail::to_text(size()) + ", or -1 for none");
  }

  //! llm.c's tokenizer file (version 1, or 2 with the end-of-text id). Throws loom::Error naming
  //! the file and what is wrong: the magic number, the version, a size, a token that runs past
  //! the end, bytes after the last token.
  static TokenDecoder read_llmc(const std::filesystem::path& path) {
    detail::BinaryFile file(path, "rb", "llm.c tokenizer");
    const std::uint64_t bytes = file.size();
    const detail::Header header = detail::read_header(file, bytes);
    if (header[0] != llmc_tokenizer_magic)
      throw Error(file.name() + ": magic number", header[0],
                  "expected 20240328 (llm.c's tokenizer file)" +
                      std::string(header[0] == 20240326   ? "; this is an llm.c model checkpoint"
                                  : header[0] == 20240520 ? "; this is an llm.c token file"
                                                          : ""));
    LOOM_CHECK(header[1] == 1 || header[1] == 2, file.name() + ": version", header[1],
               "expected 1, or 2 (with the end-of-text id)");
    const std::int64_t count = header[2];
    LOOM_CHECK(count >= 1, file.name() + ": vocabulary size", count, "must be >= 1");
    std::vector<unsigned char> body(static_cast<std::size_t>(bytes - detail::header_bytes));
    file.read(body.data(), body.size(), "tokens");
    std::vector<std::string> tokens(static_cast<std::size_t>(count));
    std::size_t at = 0;
    for (std::int64_t id = 0; id < count; ++id) {
      const std::size_t length = at < body.size() ? body[at] : 0;
      if (at >= body.size() || body.size() - at - 1 < length)
        throw Error(file.name() + ": token " + loom::detail::to_text(id),
                    at >= body.size() ? std::string("no length byte") : loom::detail::to_text(length) + " bytes",
                    "the file ends before it does (the header says " + loom::detail::to_text(count) + " tokens)");
      tokens[static_cast<std::size_t>(id)].assign(reinterpret_cast<const char*>(body.data() + at + 1), length);
      at += 1 + length;
    }
    if (at != body.size())
      throw Error(file.name() + ": size", loom::detail::to_text(detail::header_bytes + body.size()) + " bytes",
                  "expected the file to end after its " + loom::detail::to_text(count) + " tokens, at byte " +
                      loom::detail::to_text(detail::header_bytes + at));
    const std::int32_t end = header[1] == 2 ? header[3] : -1;
    LOOM_CHECK(end >= -1 && end < count, file.name() + ": end-of-text id", end,
               "must be a token id below " + loom::detail::to_text(count));
    return TokenDecoder(std::move(tokens), end);
  }

  //! A Hugging Face `vocab.json` of a byte-level BPE (GPT-2's): {token: id}, the ids 0..n-1
  //! each once, each token written through GPT-2's byte-to-character table. `<|endoftext|>`,
  //! where present, is the end-of-text id, else `</s>` (RoBERTa's). Throws loom::Error naming the
  //! file and the token.
  static TokenDecoder read_vocab_json(const std::filesystem::path& path) {
    std::string name;
    const Json vocab = detail::read_json_file(path, "vocab.json", name);
    return from_vocab_json(vocab, name);
  }

  //! read_vocab_json's parsed file, `name` naming it in messages.
  static TokenDecoder from_vocab_json(const Json& vocab, const std::string& name) {
    const auto& entries = vocab.object(name);
    if (vocab.find("model") != nullptr)
      throw Error(name, "a tokenizer.json (it has a \"model\" member)",
                  "expected a vocab.json, {token: id}: read a tokenizer.json with TokenDecoder::read or "
                  "read_tokenizer_json");
    LOOM_CHECK(!entries.empty(), name + ": tokens", entries.size(), "must be at least one");
    std::vector<std::string> tokens(entries.size());
    std::vector<bool> seen(entries.size(), false);
    std::int32_t end = -1, end_of_sequence = -1;
    for (const auto& [token, value] : entries) {
      const std::string what = name + ": id of token " + json_quote(token);
      const std::int64_t id = value.integer(what);
      LOOM_CHECK(id >= 0 && id < static_cast<std::int64_t>(entries.size()), what, id,
                 "must be in [0, " + loom::detail::to_text(entries.size()) + "): the ids must be 0..n-1, each once");
      LOOM_CHECK(!seen[static_cast<std::size_t>(id)], what, id, "is another token's id too");
      seen[static_cast<std::size_t>(id)] = true;
      tokens[static_cast<std::size_t>(id)] = detail::token_bytes(token, name);
      if (token == "<|endoftext|>") end = static_cast<std::int32_t>(id);
      if (token == "</s>") end_of_sequence = static_cast<std::int32_t>(id);
    }
    return TokenDecoder(std::move(tokens), end >= 0 ? end : end_of_sequence);
  }

  //! Any tokenizer file (read_tokenizer): llm.c's, a tokenizer.json, a vocab.json or a BERT
  //! vocab.txt.
  static TokenDecoder read(const std::filesystem::path& path);

  //! Ids the decoder knows: [0, size()).
  std::int64_t size() const noexcept { return static_cast<std::int64_t>(tokens_.size()); }
  //! The end-of-text id, or -1.
  std::int32_t end_of_text() const noexcept { return end_of_text_; }

  //! Token `id`'s bytes.
  const std::string& bytes(std::int32_t id) const {
    LOOM_CHECK(id >= 0 && id < size(), "token decoder: token id", id,
               "must be in [0, " + loom::detail::to_text(size()) + ")");
    return tokens_[static_cast<std::size_t>(id)];
  }

  //! The bytes of `ids`, one after another (GPT-2's tokens are pieces of UTF-8: a character may
  //! span two tokens, so decode a whole text, not token by token).
  std::string decode(std::span<const std::int32_t> ids) const {
    std::string out;
    for (const std::int32_t id : ids) out += bytes(id);
    return out;
  }

 private:
  std::vector<std::string> tokens_;
  std::int32_t end_of_text_ = -1;
};

//! A Hugging Face tokenizer.json, read (tokenizer_json): each id's bytes (TokenDecoder) and the
//! rules TokenEncoder encodes with.
struct TokenizerJson {
  TokenDecoder decoder;
  TokenizerRules rules;
};

namespace detail {

//! Member `key` of `object`, which must be of `kind` where present (null counts as absent).
inline const Json* optional_member(const Json& object, std::string_view key, Json::Kind kind,
                                   const std::string& what) {
  const Json* value = object.find(key);
  if (value == nullptr || value->kind() == Json::Kind::null) return nullptr;
  if (value->kind() != kind)
    throw Error(what + "." + std::string(key), value->describe(), std::string("expected a JSON ") + Json::kind_name(kind));
  return value;
}

//! The boolean member `key` of `object`, `otherwise` where absent or null.
inline bool flag(const Json& object, std::string_view key, bool otherwise, const std::string& what) {
  const Json* value = optional_member(object, key, Json::Kind::boolean, what);
  return value != nullptr ? value->boolean(what + "." + std::string(key)) : otherwise;
}

//! Refuses member `key` of `object` unless it is absent, null, or `allowed` (a boolean or a
//! string, as text), saying what loom does instead.
inline void refuse_unless(const Json& object, std::string_view key, std::string_view allowed, const std::string& what,
                          const std::string& why) {
  const Json* value = object.find(key);
  if (value == nullptr || value->kind() == Json::Kind::null) return;
  const bool fine = (value->kind() == Json::Kind::boolean && (value->boolean(what) ? "true" : "false") == allowed) ||
                    (value->kind() == Json::Kind::string && value->string(what) == allowed);
  if (!fine) throw Error(what + "." + std::string(key), value->describe(), why);
}

//! The type name of a tokenizer.json component (`{"type": ...}`), for messages.
inline std::string component_type(const Json& component) {
  const Json* type = component.find("type");
  return type != nullptr && type->kind() == Json::Kind::string ? type->string("type") : component.describe();
}

}  // namespace detail

namespace detail {

//! The pretokenizer of Split `split` (named `what`): the one whose pattern it is, exactly
//! (pretokenizer_patterns), with its pieces kept apart ("Isolated", not inverted).
inline Pretokenizer split_pretokenizer(const Json& split, const std::string& what) {
  refuse_unless(split, "behavior", "Isolated", what,
                "expected Isolated: each match a piece of its own, as byte-level BPEs split");
  refuse_unless(split, "invert", "false", what, "expected false: the matches are the pieces");
  const Json* pattern = optional_member(split, "pattern", Json::Kind::object, what);
  const Json* regex = pattern != nullptr ? pattern->find("Regex") : nullptr;
  if (regex == nullptr || regex->kind() != Json::Kind::string)
    throw Error(what + ".pattern", pattern == nullptr ? std::string("none") : pattern->describe(),
                "expected {\"Regex\": ...}, a pattern loom knows");
  const std::string& text = regex->string(what + ".pattern.Regex");
  for (const PretokenizerPattern& known : pretokenizer_patterns)
    if (text == known.regex) return known.pretokenizer;
  if (text == cl100k_pattern)
    throw Error(what + ".pattern.Regex", "tiktoken's cl100k_base pattern",
                "expected Llama 3's form of it: Hugging Face's tokenizers (Oniguruma) reads its \\p{N}{1,3}+ as "
                "(\\p{N}{1,3})+, so it splits digit runs otherwise than tiktoken, and loom would encode otherwise "
                "than one of them");
  throw Error(what + ".pattern.Regex", json_quote(text),
              "expected GPT-2's, Llama 3's or o200k_base's pattern, as io::pretokenizer_patterns writes them: loom "
              "splits text by those, written out as scanners");
}

//! The pre-tokenizer of a byte-level BPE tokenizer.json into `rules`: ByteLevel, which splits by
//! GPT-2's pattern (`use_regex`), or a Sequence of a Split by a pattern loom knows and a ByteLevel
//! that does not split again (Llama 3's).
inline void read_byte_level_split(const Json& spec, const std::string& name, TokenizerRules& rules) {
  const Json* pre = spec.find("pre_tokenizer");
  const std::string p = name + ": pre_tokenizer";
  const auto refused = [&](const std::string& got) {
    return Error(p, got,
                 "expected ByteLevel, or a Sequence of a Split by GPT-2's, Llama 3's or o200k_base's pattern and a "
                 "ByteLevel without use_regex: loom's byte-level BPE splits text by those patterns");
  };
  if (pre == nullptr || pre->kind() != Json::Kind::object) throw refused(pre == nullptr ? "none" : pre->describe());
  if (component_type(*pre) == "ByteLevel") {
    if (!flag(*pre, "use_regex", true, p))
      throw Error(p + ".use_regex", "false",
                  "expected true: a ByteLevel alone must split the text (GPT-2's pattern); put a Split before it "
                  "for another pattern");
    rules.add_prefix_space = flag(*pre, "add_prefix_space", false, p);
    rules.pretokenizer = Pretokenizer::gpt2;
    return;
  }
  if (component_type(*pre) != "Sequence") throw refused(component_type(*pre));
  const Json* steps = optional_member(*pre, "pretokenizers", Json::Kind::array, p);
  if (steps == nullptr) throw refused("a Sequence without pretokenizers");
  const auto& list = steps->array(p + ".pretokenizers");
  std::string types;
  for (const Json& step : list) types += (types.empty() ? "" : ", ") + component_type(step);
  if (list.size() != 2 || component_type(list[0]) != "Split" || component_type(list[1]) != "ByteLevel")
    throw refused("a Sequence of [" + types + "]");
  rules.pretokenizer = split_pretokenizer(list[0], p + ".pretokenizers[0]");
  const std::string b = p + ".pretokenizers[1]";
  if (flag(list[1], "use_regex", true, b))
    throw Error(b + ".use_regex", "true", "expected false: the Split before it has split the text already");
  rules.add_prefix_space = flag(list[1], "add_prefix_space", false, b);
}

//! The tokenizer.json's byte-level BPE model `model` (named `m`): its rules into `rules`, its
//! tokens' (id, bytes) into `ids`.
inline void read_byte_level_bpe(const Json& spec, const Json& model, const std::string& name, const std::string& m,
                                TokenizerRules& rules, std::vector<std::pair<std::int64_t, std::string>>& ids) {
  refuse_unless(model, "byte_fallback", "false", m, "expected false: a byte-level BPE needs no fallback");
  refuse_unless(model, "continuing_subword_prefix", "", m,
                "expected none: a byte-level BPE marks no subwords (that is WordPiece's way)");
  refuse_unless(model, "end_of_word_suffix", "", m, "expected none: a byte-level BPE marks no word ends");
  if (const Json* dropout = model.find("dropout"); dropout != nullptr && dropout->kind() != Json::Kind::null)
    throw Error(m + ".dropout", dropout->describe(), "expected null: loom encodes without BPE dropout");
  if (const Json* normalizer = spec.find("normalizer"); normalizer != nullptr && normalizer->kind() != Json::Kind::null)
    throw Error(name + ": normalizer", component_type(*normalizer),
                "expected null: loom's byte-level BPE normalizes nothing, so it would encode other text");
  read_byte_level_split(spec, name, rules);
  rules.ignore_merges = flag(model, "ignore_merges", false, m);

  for (const auto& [token, value] : model.find("vocab")->object(m + ".vocab"))
    ids.emplace_back(value.integer(m + ".vocab: id of token " + json_quote(token)), token_bytes(token, name));
  for (const AddedToken& token : rules.added) ids.emplace_back(token.id, token.text);

  const Json* merges = optional_member(model, "merges", Json::Kind::array, m);
  if (merges == nullptr) return;
  const auto& list = merges->array(m + ".merges");
  rules.merges.reserve(list.size());
  for (std::size_t k = 0; k < list.size(); ++k) {
    const std::string what = m + ".merges[" + loom::detail::to_text(k) + "]";
    const Json& merge = list[k];
    std::string left, right;
    if (merge.kind() == Json::Kind::string) {  // "a b": byte-level tokens hold no U+0020
      const std::string& text = merge.string(what);
      const std::size_t space = text.find(' ');
      LOOM_CHECK(space != std::string::npos && text.find(' ', space + 1) == std::string::npos && space > 0 &&
                     space + 1 < text.size(),
                 what, json_quote(text), "expected two tokens with one space between them");
      left = text.substr(0, space);
      right = text.substr(space + 1);
    } else {
      const auto& pair = merge.array(what);
      LOOM_CHECK(pair.size() == 2, what, merge.describe(), "expected \"a b\" or [\"a\", \"b\"]");
      left = pair[0].string(what + "[0]");
      right = pair[1].string(what + "[1]");
    }
    rules.merges.emplace_back(token_bytes(left, name), token_bytes(right, name));
  }
}

//! How WordPiece token `token` prints (TokenDecoder): a piece that continues a word (it starts
//! with `prefix`) without the prefix, any other token after a space.
inline std::string word_piece_text(const std::string& token, const std::string& prefix) {
  return token.starts_with(prefix) && token.size() > prefix.size() ? token.substr(prefix.size()) : " " + token;
}

//! The tokenizer.json's WordPiece model `model` (named `m`), with BERT's normalizer and
//! pre-tokenizer: its rules into `rules`, its tokens' (id, text to print) into `ids`: a piece
//! that continues a word prints without its prefix, any other token after a space.
inline void read_word_piece(const Json& spec, const Json& model, const std::string& name, const std::string& m,
                            TokenizerRules& rules, std::vector<std::pair<std::int64_t, std::string>>& ids) {
  WordPieceRules wp;
  if (const Json* prefix = optional_member(model, "continuing_subword_prefix", Json::Kind::string, m))
    wp.prefix = prefix->string(m + ".continuing_subword_prefix");
  if (const Json* chars = optional_member(model, "max_input_chars_per_word", Json::Kind::number, m))
    wp.max_chars = chars->integer(m + ".max_input_chars_per_word");
  LOOM_CHECK(wp.max_chars >= 1, m + ".max_input_chars_per_word", wp.max_chars, "must be >= 1");
  if (const Json* normalizer = spec.find("normalizer"); normalizer != nullptr && normalizer->kind() != Json::Kind::null) {
    const std::string n = name + ": normalizer";
    if (normalizer->kind() != Json::Kind::object || component_type(*normalizer) != "BertNormalizer")
      throw Error(n, component_type(*normalizer),
                  "expected BertNormalizer or none: loom's WordPiece normalizes as BERT does only");
    wp.clean_text = flag(*normalizer, "clean_text", true, n);
    wp.chinese_chars = flag(*normalizer, "handle_chinese_chars", true, n);
    wp.lowercase = flag(*normalizer, "lowercase", true, n);
    wp.strip_accents = flag(*normalizer, "strip_accents", wp.lowercase, n);  // null: as lowercase
    for (const AddedToken& token : rules.added)
      LOOM_CHECK(!token.normalized, name + ": added token " + json_quote(token.text) + ": normalized", "true",
                 "expected false: loom matches added tokens in the text as it is, before the normalizer");
  }
  const Json* pre = spec.find("pre_tokenizer");
  if (pre == nullptr || pre->kind() != Json::Kind::object || component_type(*pre) != "BertPreTokenizer")
    throw Error(name + ": pre_tokenizer", pre == nullptr ? std::string("none") : component_type(*pre),
                "expected BertPreTokenizer: loom's WordPiece splits text as BERT does only");

  const auto shown = [&](const std::string& token) { return word_piece_text(token, wp.prefix); };
  for (const auto& [token, value] : model.find("vocab")->object(m + ".vocab")) {
    const std::int64_t id = value.integer(m + ".vocab: id of token " + json_quote(token));
    LOOM_CHECK(id >= 0 && id < std::numeric_limits<std::int32_t>::max(), m + ".vocab: id of token " + json_quote(token),
               id, "must be >= 0");
    ids.emplace_back(id, shown(token));
    wp.vocab.emplace_back(token, static_cast<std::int32_t>(id));
  }
  for (const AddedToken& token : rules.added) ids.emplace_back(token.id, shown(token.text));
  const Json* unknown = optional_member(model, "unk_token", Json::Kind::string, m);
  if (unknown == nullptr) throw Error(m + ".unk_token", "none", "a WordPiece needs one, for the words it cannot spell");
  const std::string& unk = unknown->string(m + ".unk_token");
  const auto it = std::find_if(wp.vocab.begin(), wp.vocab.end(), [&](const auto& entry) { return entry.first == unk; });
  if (it == wp.vocab.end()) throw Error(m + ".unk_token", json_quote(unk), "must be a token of model.vocab");
  wp.unknown = it->second;
  rules.word_piece = std::move(wp);
}

//! The added tokens of tokenizer.json `spec`: their ids and text, `lstrip` and `rstrip`.
inline std::vector<AddedToken> added_tokens(const Json& spec, const std::string& name) {
  std::vector<AddedToken> out;
  const Json* added = optional_member(spec, "added_tokens", Json::Kind::array, name);
  if (added == nullptr) return out;
  for (const Json& entry : added->array(name + ": added_tokens")) {
    const std::string a = name + ": added token";
    const Json* content = entry.find("content");
    const Json* id = entry.find("id");
    if (content == nullptr || id == nullptr) throw Error(a, entry.describe(), "expected {\"id\": ..., \"content\": ...}");
    AddedToken token{content->string(a + " content"), 0, flag(entry, "lstrip", false, a), flag(entry, "rstrip", false, a),
                     flag(entry, "normalized", false, a)};
    const std::string t = a + " " + json_quote(token.text);
    const std::int64_t value = id->integer(t + ": id");
    LOOM_CHECK(!token.text.empty(), a + " " + loom::detail::to_text(value) + ": content", "\"\"", "must not be empty");
    LOOM_CHECK(!flag(entry, "single_word", false, t), t + ": single_word", "true",
               "expected false: loom matches added tokens wherever they stand");
    LOOM_CHECK(value >= 0 && value < std::numeric_limits<std::int32_t>::max(), t + ": id", value, "must be >= 0");
    token.id = static_cast<std::int32_t>(value);
    out.push_back(std::move(token));
  }
  return out;
}

}  // namespace detail

//! A Hugging Face tokenizer.json (`spec`, parsed; `name` names it in messages) whose model is a
//! byte-level BPE or BERT's WordPiece, and its `added_tokens` (their ids and text; `lstrip` and
//! `rstrip` honoured). The ids of the vocabulary and the added tokens together must be 0..n-1,
//! each once. The end-of-text id is the added `<|endoftext|>`'s, else `</s>`'s, else `[SEP]`'s.
//! - A byte-level BPE: `model.vocab` ({token: id}, through GPT-2's byte-to-character table) and
//!   `model.merges` (in rank order, each "a b" or ["a", "b"]); the ByteLevel pre-tokenizer's
//!   `add_prefix_space`, the model's `ignore_merges`.
//! - WordPiece: `model.vocab` ({token: id}, the tokens as text), `unk_token`,
//!   `continuing_subword_prefix`, `max_input_chars_per_word`; a BertNormalizer's options.
//! What loom's encoder would not reproduce is refused by name rather than encoded otherwise:
//! another model (Unigram), BPE dropout, byte fallback, a BPE's subword prefixes or suffixes or
//! normalizer, a pre-tokenizer other than ByteLevel with GPT-2's pattern (BPE) or
//! BertPreTokenizer (WordPiece), a normalizer other than BertNormalizer (WordPiece), and
//! `single_word` added tokens (and `normalized` ones where there is a normalizer). The
//! post-processor (RoBERTa's <s> ... </s>, BERT's [CLS] ... [SEP] around a sequence) is not
//! applied.
inline TokenizerJson tokenizer_json(const Json& spec, const std::string& name) {
  spec.object(name);
  const Json* model = detail::optional_member(spec, "model", Json::Kind::object, name);
  if (model == nullptr) throw Error(name + ": model", "none", "a tokenizer.json has a \"model\" object");
  const std::string m = name + ": model";
  const Json* type = model->find("type");
  const std::string model_type = type != nullptr ? type->string(m + ".type") : "none";
  if (model_type != "BPE" && model_type != "WordPiece")
    throw Error(m + ".type", model_type, "expected BPE (byte-level) or WordPiece: loom's encoder knows those two");
  if (model->find("vocab") == nullptr) throw Error(m + ".vocab", "none", "expected {token: id}");

  TokenizerRules rules;
  rules.added = detail::added_tokens(spec, name);
  std::vector<std::pair<std::int64_t, std::string>> ids;  // (id, bytes): the vocabulary's, then the added tokens'
  if (model_type == "BPE")
    detail::read_byte_level_bpe(spec, *model, name, m, rules, ids);
  else
    detail::read_word_piece(spec, *model, name, m, rules, ids);

  // By id, the vocabulary's before an added token's of the same id.
  std::stable_sort(ids.begin(), ids.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (const auto& [id, bytes] : ids) {
    if (!tokens.empty() && id == static_cast<std::int64_t>(tokens.size()) - 1) {
      // An added token that is in the vocabulary too (RoBERTa's <s>): the same text, once.
      LOOM_CHECK(bytes == tokens.back(), name + ": id " + loom::detail::to_text(id), json_quote(bytes),
                 "is token " + json_quote(tokens.back()) + " too: an id is one token");
      continue;
    }
    LOOM_CHECK(id == static_cast<std::int64_t>(tokens.size()), name + ": token ids",
               "no token with id " + loom::detail::to_text(tokens.size()),
               "the ids of model.vocab and added_tokens together must be 0..n-1 (" + loom::detail::to_text(id) +
                   " is the next)");
    tokens.push_back(bytes);
  }
  LOOM_CHECK(!tokens.empty(), name + ": tokens", 0, "must be at least one");

  std::int32_t end = -1;
  for (const char* text : {"[SEP]", "</s>", "<|endoftext|>", "<|end_of_text|>"})
    for (const AddedToken& token : rules.added)
      if (token.text == text) end = token.id;
  return {TokenDecoder(std::move(tokens), end), std::move(rules)};
}

//! Reads a Hugging Face tokenizer.json (tokenizer_json).
inline TokenizerJson read_tokenizer_json(const std::filesystem::path& path) {
  std::string name;
  const Json spec = detail::read_json_file(path, "tokenizer.json", name);
  return tokenizer_json(spec, name);
}

//! How a BERT `vocab.txt`'s text is normalized, which the file does not say (Hugging Face keeps
//! it in `tokenizer_config.json`). Each option left unset takes the value of
//! `tokenizer_config.json` beside the file, where it has one, else the default given.
struct VocabTxtOptions {
  //! Lowercase (an uncased BERT); `do_lower_case`. Default: true unless a token, other than one
  //! in brackets ([UNK], [unused0]), has an uppercase letter A-Z: an uncased vocabulary has
  //! none, and lowercasing the text would leave a cased vocabulary's capitals unreachable.
  std::optional<bool> lowercase{};
  //! Decompose and drop the nonspacing marks; `strip_accents` (null: unset). Default: lowercase.
  std::optional<bool> strip_accents{};
  //! A space before and after each CJK ideograph; `tokenize_chinese_chars`. Default: true.
  std::optional<bool> chinese_chars{};

  //! Whether any option is set.
  bool any() const noexcept { return lowercase || strip_accents || chinese_chars; }
  friend bool operator==(const VocabTxtOptions&, const VocabTxtOptions&) = default;
};

namespace detail {

//! Calls f(line, number) for each line of `text` (numbered from 1), without its '\n'; a final
//! '\n' starts no line.
template <class F>
void for_each_line(std::string_view text, F&& f) {
  std::size_t number = 0;
  for (std::size_t begin = 0; begin < text.size();) {
    const std::size_t newline = text.find('\n', begin);
    const std::size_t end = newline == std::string_view::npos ? text.size() : newline;
    f(text.substr(begin, end - begin), ++number);
    begin = end + 1;
  }
}

//! The file `name` in the folder of `path`, where it is a regular file.
inline std::optional<std::filesystem::path> file_beside(const std::filesystem::path& path, const char* name) {
  std::filesystem::path beside = path.parent_path() / name;
  std::error_code error;
  if (!std::filesystem::is_regular_file(beside, error)) return std::nullopt;
  return beside;
}

//! The tokens of a vocab.txt (`text`, named `name`): one a line, its line number from 0 its id,
//! white space at the end of a line trimmed (a Windows '\r' too), as `tokenizers` reads them.
//! Throws loom::Error naming the line whose bytes are not well-formed UTF-8.
inline std::vector<std::string> vocab_txt_tokens(std::string_view text, const std::string& name) {
  std::vector<std::string> tokens;
  for_each_line(text, [&](std::string_view line, std::size_t number) {
    std::size_t kept = 0;  // the end of the last character that is not white space
    for (std::size_t at = 0; at < line.size();) {
      const CodePointAt ch = code_point_at(line, at);
      LOOM_CHECK(ch.valid, name + ": line " + loom::detail::to_text(number), "a byte that is not UTF-8",
                 "expected UTF-8 text, a token a line (is this a BERT vocab.txt?)");
      at += ch.bytes;
      if (!is_white_space(ch.c)) kept = at;
    }
    tokens.emplace_back(line.substr(0, kept));
  });
  return tokens;
}

//! `options` with what is unset taken from `tokenizer_config.json` beside `vocab` (where there
//! is one).
inline VocabTxtOptions vocab_txt_config(const std::filesystem::path& vocab, VocabTxtOptions options) {
  const std::optional<std::filesystem::path> path = file_beside(vocab, "tokenizer_config.json");
  if (!path) return options;
  std::string name;
  const Json config = read_json_file(*path, "tokenizer_config.json", name);
  config.object(name);
  const auto take = [&](std::optional<bool>& option, std::string_view key) {
    if (const Json* value = optional_member(config, key, Json::Kind::boolean, name); value != nullptr && !option)
      option = value->boolean(name + "." + std::string(key));
  };
  take(options.lowercase, "do_lower_case");
  take(options.strip_accents, "strip_accents");
  take(options.chinese_chars, "tokenize_chinese_chars");
  return options;
}

}  // namespace detail

//! A BERT `vocab.txt` (`text`; `name` names it in messages), as Hugging Face's
//! `BertWordPieceTokenizer` and `transformers`' BERT tokenizers read it: one token a line, the
//! line number (from 0) its id; where a line repeats an earlier one, the later id is the token's
//! (the earlier id still decodes). WordPiece with the continuation prefix `##` and 100
//! characters a word at most, BERT's normalizer (`options`, their defaults resolved as
//! VocabTxtOptions says, no tokenizer_config.json read here) and pre-tokenizer; [UNK], [SEP],
//! [CLS], [PAD] and [MASK], those present, matched in the text as they are. The end-of-text id is
//! [SEP]'s. Throws loom::Error where there is no [UNK] line or a line is not UTF-8.
inline TokenizerJson vocab_txt(std::string_view text, const std::string& name, const VocabTxtOptions& options = {}) {
  std::vector<std::string> lines = detail::vocab_txt_tokens(text, name);
  LOOM_CHECK(!lines.empty(), name + ": tokens", 0, "must be at least one: a vocab.txt has a token a line");
  LOOM_CHECK(lines.size() < static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()), name + ": tokens",
             lines.size(), "must be fewer than 2^31 - 1");
  std::unordered_map<std::string, std::int32_t> id_of;
  for (std::size_t id = 0; id < lines.size(); ++id) id_of[lines[id]] = static_cast<std::int32_t>(id);  // later wins

  WordPieceRules wp;
  wp.clean_text = true;
  const auto unknown = id_of.find("[UNK]");
  if (unknown == id_of.end())
    throw Error(name + ": [UNK]", "no such line",
                "a WordPiece needs [UNK] for the words it cannot spell (is this a BERT vocab.txt?)");
  wp.unknown = unknown->second;
  const bool cased = std::any_of(lines.begin(), lines.end(), [](const std::string& token) {
    const bool bracketed = token.size() >= 2 && token.front() == '[' && token.back() == ']';
    return !bracketed && std::any_of(token.begin(), token.end(), [](char c) { return c >= 'A' && c <= 'Z'; });
  });
  wp.lowercase = options.lowercase.value_or(!cased);
  wp.strip_accents = options.strip_accents.value_or(wp.lowercase);
  wp.chinese_chars = options.chinese_chars.value_or(true);

  TokenizerRules rules;
  for (const char* special : {"[UNK]", "[SEP]", "[CLS]", "[PAD]", "[MASK]"})
    if (const auto it = id_of.find(special); it != id_of.end()) rules.added.push_back({special, it->second});
  wp.vocab.assign(id_of.begin(), id_of.end());
  for (std::string& line : lines) line = detail::word_piece_text(line, wp.prefix);
  const auto sep = id_of.find("[SEP]");
  const std::int32_t end = sep != id_of.end() ? sep->second : -1;
  rules.word_piece = std::move(wp);
  return {TokenDecoder(std::move(lines), end), std::move(rules)};
}

namespace detail {

//! The vocab.txt at `path`, whose bytes are `text` (vocab_txt), with what `options` leaves unset
//! taken from `tokenizer_config.json` beside it.
inline TokenizerJson vocab_txt_file(const std::filesystem::path& path, std::string_view text,
                                    const VocabTxtOptions& options) {
  return vocab_txt(text, "vocab.txt " + quoted(path), vocab_txt_config(path, options));
}

}  // namespace detail

//! Reads a BERT vocab.txt (vocab_txt), with what `options` leaves unset taken from
//! `tokenizer_config.json` beside it where there is one (VocabTxtOptions).
inline TokenizerJson read_vocab_txt(const std::filesystem::path& path, const VocabTxtOptions& options = {}) {
  return detail::vocab_txt_file(path, detail::read_text_file(path, "vocab.txt"), options);
}

//! The merges of a byte-level BPE's `merges.txt` (`text`; `name` names it in messages), as
//! `tokenizers` reads the file beside a `vocab.json`: in rank order, a merge a line, its two
//! tokens (through GPT-2's byte-to-character table) separated by one space; lines that start
//! with `#version` are skipped. Throws loom::Error naming a line that is not two tokens.
inline std::vector<std::pair<std::string, std::string>> merges_txt(std::string_view text, const std::string& name) {
  std::vector<std::pair<std::string, std::string>> merges;
  detail::for_each_line(text, [&](std::string_view merge, std::size_t line) {
    if (!merge.empty() && merge.back() == '\r') merge.remove_suffix(1);
    if (merge.starts_with("#version")) return;
    const std::size_t space = merge.find(' ');
    const std::string where = name + ": line " + loom::detail::to_text(line);
    LOOM_CHECK(space != std::string_view::npos && space > 0 && space + 1 < merge.size() &&
                   merge.find(' ', space + 1) == std::string_view::npos,
               where, json_quote(std::string(merge)), "expected two tokens with one space between them");
    merges.emplace_back(detail::token_bytes(std::string(merge.substr(0, space)), where),
                        detail::token_bytes(std::string(merge.substr(space + 1)), where));
  });
  return merges;
}

//! A byte-level BPE from a `vocab.json` (`vocab`, named `name`) and its `merges.txt` (`merges`,
//! named `merges_name`), as `transformers`' GPT-2 and RoBERTa tokenizers read the pair: ranks
//! from the merge list, and the special tokens of either that the vocabulary holds matched in
//! the text as they are first: `<|endoftext|>`, `<s>`, `<pad>`, `</s>`, `<unk>`, and `<mask>`,
//! which takes the white space before it (RoBERTa's). The end-of-text id is from_vocab_json's.
inline TokenizerJson vocab_json_merges(const Json& vocab, const std::string& name, std::string_view merges,
                                       const std::string& merges_name) {
  TokenDecoder decoder = TokenDecoder::from_vocab_json(vocab, name);
  TokenizerRules rules;
  rules.merges = merges_txt(merges, merges_name);
  for (const char* special : {"<|endoftext|>", "<s>", "<pad>", "</s>", "<unk>", "<mask>"})
    if (const Json* id = vocab.find(special); id != nullptr)
      rules.added.push_back(
          {special, static_cast<std::int32_t>(id->integer(name)), std::string_view(special) == "<mask>"});
  return {std::move(decoder), std::move(rules)};
}

//! A tokenizer file of any kind, read: each id's bytes, and the rules that a tokenizer.json, a
//! vocab.json with its merges.txt, or a vocab.txt encodes with (none for llm.c's file and a
//! vocab.json alone: ranks from the ids).
struct TokenizerFile {
  TokenDecoder decoder;
  std::optional<TokenizerRules> rules;
  //! Without rules: the pattern that splits the text (a tiktoken file's, by its name).
  Pretokenizer pretokenizer = Pretokenizer::gpt2;
};

//! What a tiktoken file does not say, which tiktoken takes from the encoding's name
//! (tiktoken_ext/openai_public.py): its pattern, and its special tokens' ids.
struct TiktokenEncoding {
  std::string_view name;  //!< the file's name without `.tiktoken`
  Pretokenizer pretokenizer;
  std::int32_t vocab_size;  //!< the ranks' and special tokens' ids are below it
  std::vector<std::pair<std::string_view, std::int32_t>> special;  //!< the end-of-text token first
};

//! The tiktoken encodings loom reads.
inline const std::vector<TiktokenEncoding>& tiktoken_encodings() {
  static const std::vector<TiktokenEncoding> encodings = {
      {"r50k_base", Pretokenizer::gpt2, 50257, {{"<|endoftext|>", 50256}}},
      {"p50k_base", Pretokenizer::gpt2, 50281, {{"<|endoftext|>", 50256}}},
      {"cl100k_base",
       Pretokenizer::cl100k,
       100277,
       {{"<|endoftext|>", 100257},
        {"<|fim_prefix|>", 100258},
        {"<|fim_middle|>", 100259},
        {"<|fim_suffix|>", 100260},
        {"<|endofprompt|>", 100276}}},
      {"o200k_base", Pretokenizer::o200k, 200019, {{"<|endoftext|>", 199999}, {"<|endofprompt|>", 200018}}},
  };
  return encodings;
}

namespace detail {

//! The bytes of base64 text `text` (RFC 4648's alphabet, `=` padding), or nullopt where it is not
//! base64.
inline std::optional<std::string> base64_decode(std::string_view text) {
  const auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  if (text.size() % 4 != 0) return std::nullopt;
  std::size_t padding = 0;
  while (padding < 2 && padding < text.size() && text[text.size() - 1 - padding] == '=') ++padding;
  std::string bytes;
  std::uint32_t bits = 0;
  int held = 0;
  for (std::size_t k = 0; k < text.size() - padding; ++k) {
    const int v = value(text[k]);
    if (v < 0) return std::nullopt;
    bits = bits << 6 | static_cast<std::uint32_t>(v);
    held += 6;
    if (held >= 8) {
      held -= 8;
      bytes.push_back(static_cast<char>(bits >> held & 0xff));
    }
  }
  if ((bits & ((1u << held) - 1)) != 0) return std::nullopt;  // bits past the last byte must be 0
  return bytes;
}

//! Reads a tiktoken file (`<name>.tiktoken`: a line per token, its bytes in base64, a space and
//! its rank) as the encoding `name` is: its ranks are the ids, its special tokens take theirs,
//! and ids no token has (cl100k_base's 100256 and 100261..100275, say) are tokens of no bytes,
//! which no text encodes to.
inline TokenizerFile read_tiktoken(const std::filesystem::path& path) {
  const std::string name = "tokenizer " + quoted(path);
  const std::string stem = path.stem().string();
  const auto& known = tiktoken_encodings();
  const auto encoding = std::find_if(known.begin(), known.end(), [&](const auto& e) { return e.name == stem; });
  if (encoding == known.end())
    throw Error(name + ": encoding", stem,
                "expected r50k_base, p50k_base, cl100k_base or o200k_base (the file's name says which: a tiktoken "
                "file holds neither its pattern nor its special tokens)");
  const std::string text = read_text_file(path, "tokenizer");
  std::vector<std::string> tokens(static_cast<std::size_t>(encoding->vocab_size));
  std::vector<bool> taken(tokens.size(), false);
  for_each_line(text, [&](std::string_view line, std::size_t number) {
    if (line.empty()) return;
    const std::string where = name + ": line " + loom::detail::to_text(number);
    const std::size_t space = line.find(' ');
    const std::optional<std::string> bytes =
        space == std::string_view::npos ? std::nullopt : base64_decode(line.substr(0, space));
    std::int64_t rank = -1;
    const std::string_view digits = space == std::string_view::npos ? std::string_view() : line.substr(space + 1);
    if (!digits.empty() && digits.size() <= 10 &&
        std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
      rank = std::stoll(std::string(digits));
    if (!bytes || bytes->empty() || rank < 0)
      throw Error(where, json_quote(std::string(line)), "expected a token's bytes in base64, a space and its rank");
    LOOM_CHECK(rank < encoding->vocab_size, where + ": rank", rank,
               "must be below " + loom::detail::to_text(encoding->vocab_size) + ", " + stem + "'s vocabulary");
    LOOM_CHECK(!taken[static_cast<std::size_t>(rank)], where + ": rank", rank, "is another token's already");
    taken[static_cast<std::size_t>(rank)] = true;
    tokens[static_cast<std::size_t>(rank)] = *bytes;
  });
  for (const auto& [special, id] : encoding->special) {
    LOOM_CHECK(!taken[static_cast<std::size_t>(id)], name + ": rank", id,
               "is " + std::string(special) + "'s id in " + stem + ", not a token's of the file");
    tokens[static_cast<std::size_t>(id)] = special;
  }
  return {TokenDecoder(std::move(tokens), encoding->special.front().second), std::nullopt, encoding->pretokenizer};
}

//! Whether `path` names a tiktoken file (read_tiktoken): its name ends in `.tiktoken`.
inline bool is_tiktoken(const std::filesystem::path& path) { return path.extension() == ".tiktoken"; }

//! Whether the file at `path` starts with llm.c's tokenizer magic number.
inline bool is_llmc_tokenizer(const std::filesystem::path& path) {
  std::int32_t magic = 0;
  BinaryFile file(path, "rb", "tokenizer");
  if (file.size() >= sizeof magic) file.read(&magic, sizeof magic, "the first word");
  return magic == llmc_tokenizer_magic;
}

//! Whether tokenizer file `path`, whose bytes are `text`, is a vocab.txt: its name ends in .txt,
//! or its first byte that is not white space is not a JSON object's '{'.
inline bool is_vocab_txt(const std::filesystem::path& path, std::string_view text) {
  if (path.extension() == ".txt") return true;
  const std::size_t first = text.find_first_not_of(" \t\r\n");
  return first == std::string_view::npos || text[first] != '{';
}

}  // namespace detail

//! Any tokenizer file loom reads, told apart by its content: llm.c's (its magic number), a
//! tiktoken file (its name ends in `.tiktoken`: detail::read_tiktoken), a tokenizer.json (JSON
//! with a `model` member), a vocab.json (other JSON; with the `merges.txt` beside it where there
//! is one: vocab_json_merges), or a BERT vocab.txt (detail::is_vocab_txt).
//! `options` apply to a vocab.txt (read_vocab_txt); set for another kind, they are refused: its
//! own file says how it normalizes.
inline TokenizerFile read_tokenizer(const std::filesystem::path& path, const VocabTxtOptions& options = {}) {
  const auto refuse_options = [&](const std::string& kind) {
    if (options.any())
      throw Error("tokenizer " + detail::quoted(path) + ": lowercase, strip_accents or tokenize_chinese_chars",
                  "set for " + kind, "only a vocab.txt takes them: other files say how they normalize");
  };
  if (detail::is_llmc_tokenizer(path)) {
    refuse_options("llm.c's tokenizer file");
    return {TokenDecoder::read_llmc(path), std::nullopt};
  }
  if (detail::is_tiktoken(path)) {
    refuse_options("a tiktoken file");
    return detail::read_tiktoken(path);
  }
  const std::string text = detail::read_text_file(path, "tokenizer");
  if (text.starts_with("#version"))
    throw Error("tokenizer " + detail::quoted(path), "a merges.txt (it starts with #version)",
                "expected the vocab.json beside it (loom reads the merges.txt next to it), or a tokenizer.json");
  if (detail::is_vocab_txt(path, text)) {
    TokenizerJson file = detail::vocab_txt_file(path, text, options);
    return {std::move(file.decoder), std::move(file.rules)};
  }
  const std::string name = "tokenizer " + detail::quoted(path);
  const Json spec = Json::parse(text, name);
  if (spec.find("model") == nullptr) {
    refuse_options("a vocab.json");
    const std::optional<std::filesystem::path> merges = detail::file_beside(path, "merges.txt");
    if (!merges) return {TokenDecoder::from_vocab_json(spec, name), std::nullopt};
    TokenizerJson file = vocab_json_merges(spec, name, detail::read_text_file(*merges, "merges.txt"),
                                           "merges.txt " + detail::quoted(*merges));
    return {std::move(file.decoder), std::move(file.rules)};
  }
  refuse_options("a tokenizer.json");
  TokenizerJson file = tokenizer_json(spec, name);
  return {std::move(file.decoder), std::move(file.rules)};
}

inline TokenDecoder TokenDecoder::read(const std::filesystem::path& path) { return read_tokenizer(path).decoder; }

}  // namespace loom::io
