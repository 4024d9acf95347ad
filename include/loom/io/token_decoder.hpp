#pragma once
//! \file Token ids back to text for GPT-2's byte-level BPE: each id's bytes, read from llm.c's
//! tokenizer file (`gpt2_tokenizer.bin`) or from a Hugging Face `vocab.json`. TokenEncoder
//! (token_encoder.hpp) turns text into ids with the same table.
//!
//! llm.c's format: a header of 256 little-endian int32 {20240328, version, vocab_size,
//! end-of-text id (version 2), 0...}, then for each id its length in bytes (one uint8) and the
//! bytes. `vocab.json` maps each token, written through GPT-2's byte-to-character table, to its id.

#include <cstdint>
#include <filesystem>
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

}  // namespace detail

//! Each token id's bytes, for printing what a GPT-2 generates. Construct from the table, or read
//! one of the two files.
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
    detail::BinaryFile file(path, "rb", "vocab.json");
    std::string text(static_cast<std::size_t>(file.size()), '\0');
    file.read(text.data(), text.size(), "the vocabulary");
    const std::string name = file.name();
    const Json vocab = Json::parse(text, name);
    const auto& entries = vocab.object(name);
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
      std::string& bytes = tokens[static_cast<std::size_t>(id)];
      for (const char32_t c : detail::code_points(token)) {
        const int b = detail::byte_of_code_point(c);
        LOOM_CHECK(b >= 0, name + ": token " + json_quote(token) + " character", static_cast<std::uint32_t>(c),
                   "is not in GPT-2's byte-to-character table: this is not a byte-level BPE vocabulary");
        bytes.push_back(static_cast<char>(b));
      }
      if (token == "<|endoftext|>") end = static_cast<std::int32_t>(id);
    }
    return TokenDecoder(std::move(tokens), end);
  }

  //! Either file, told apart by its first bytes: llm.c's magic number, or JSON.
  static TokenDecoder read(const std::filesystem::path& path) {
    std::int32_t magic = 0;
    {
      detail::BinaryFile file(path, "rb", "tokenizer");
      if (file.size() >= sizeof magic) file.read(&magic, sizeof magic, "the first word");
    }
    return magic == llmc_tokenizer_magic ? read_llmc(path) : read_vocab_json(path);
  }

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

}  // namespace loom::io
