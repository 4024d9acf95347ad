#pragma once
//! \file Token ids back to text for a byte-level BPE (GPT-2's and its kin): each id's bytes, read
//! from llm.c's tokenizer file (`gpt2_tokenizer.bin`), a Hugging Face `vocab.json`, or a Hugging
//! Face `tokenizer.json`, which also gives the merges and added tokens that TokenEncoder
//! (token_encoder.hpp) encodes with (TokenizerRules).
//!
//! llm.c's format: a header of 256 little-endian int32 {20240328, version, vocab_size,
//! end-of-text id (version 2), 0...}, then for each id its length in bytes (one uint8) and the
//! bytes. `vocab.json` maps each token, written through GPT-2's byte-to-character table, to its id.
//! `tokenizer.json` holds such a map as `model.vocab`, the merges in rank order as
//! `model.merges`, and the tokens matched in the text as they are as `added_tokens`.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <string_view>
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
  //! where present, is the end-of-text id. Throws loom::Error naming the file and the token.
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
    std::int32_t end = -1;
    for (const auto& [token, value] : entries) {
      const std::string what = name + ": id of token " + json_quote(token);
      const std::int64_t id = value.integer(what);
      LOOM_CHECK(id >= 0 && id < static_cast<std::int64_t>(entries.size()), what, id,
                 "must be in [0, " + loom::detail::to_text(entries.size()) + "): the ids must be 0..n-1, each once");
      LOOM_CHECK(!seen[static_cast<std::size_t>(id)], what, id, "is another token's id too");
      seen[static_cast<std::size_t>(id)] = true;
      tokens[static_cast<std::size_t>(id)] = detail::token_bytes(token, name);
      if (token == "<|endoftext|>") end = static_cast<std::int32_t>(id);
    }
    return TokenDecoder(std::move(tokens), end);
  }

  //! Any of the three files: llm.c's (told by its magic number), a tokenizer.json (JSON with a
  //! `model` member) or a vocab.json (other JSON).
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
  const Json* pre = spec.find("pre_tokenizer");
  const std::string p = name + ": pre_tokenizer";
  if (pre == nullptr || pre->kind() != Json::Kind::object || component_type(*pre) != "ByteLevel")
    throw Error(p, pre == nullptr ? std::string("none") : component_type(*pre),
                "expected ByteLevel: loom's byte-level BPE splits text by GPT-2's pattern only");
  if (!flag(*pre, "use_regex", true, p))
    throw Error(p + ".use_regex", "false", "expected true: loom's encoder always splits by GPT-2's pattern");
  rules.add_prefix_space = flag(*pre, "add_prefix_space", false, p);
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

  const auto shown = [&](const std::string& token) {
    return token.starts_with(wp.prefix) && token.size() > wp.prefix.size() ? token.substr(wp.prefix.size())
                                                                           : " " + token;
  };
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
  for (const char* text : {"[SEP]", "</s>", "<|endoftext|>"})
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

namespace detail {

//! Whether the file at `path` starts with llm.c's tokenizer magic number (else it is JSON).
inline bool is_llmc_tokenizer(const std::filesystem::path& path) {
  std::int32_t magic = 0;
  BinaryFile file(path, "rb", "tokenizer");
  if (file.size() >= sizeof magic) file.read(&magic, sizeof magic, "the first word");
  return magic == llmc_tokenizer_magic;
}

}  // namespace detail

inline TokenDecoder TokenDecoder::read(const std::filesystem::path& path) {
  if (detail::is_llmc_tokenizer(path)) return read_llmc(path);
  std::string name;
  const Json spec = detail::read_json_file(path, "tokenizer", name);
  return spec.find("model") != nullptr ? tokenizer_json(spec, name).decoder : from_vocab_json(spec, name);
}

}  // namespace loom::io
