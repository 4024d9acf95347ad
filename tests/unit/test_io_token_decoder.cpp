// io::TokenDecoder: GPT-2's byte-to-character table, llm.c's tokenizer file and Hugging Face's
// vocab.json read into each id's bytes, text decoded across tokens that split a character, and
// every malformed file refused by name.

#include <doctest/doctest.h>

#include <cstdint>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include "loom/io/token_decoder.hpp"
#include "support/error_of.hpp"
#include "support/llmc_tokenizer.hpp"
#include "support/temp_path.hpp"

namespace test_io_token_decoder {

using namespace loom;
using namespace loom::test;

namespace {

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

//! UTF-8 of code point `c` (below U+0800, all the table uses).
std::string utf8(char32_t c) {
  if (c < 0x80) return std::string(1, static_cast<char>(c));
  return {static_cast<char>(0xc0 | (c >> 6)), static_cast<char>(0x80 | (c & 0x3f))};
}

// "é" is two bytes, c3 a9; GPT-2 may put them in two tokens.
const std::string e_acute = "\xc3\xa9";

}  // namespace

TEST_CASE("GPT-2's byte-to-character table maps 256 characters onto the 256 bytes") {
  std::set<int> bytes;
  for (char32_t c = 0; c < 0x200; ++c)
    if (const int b = io::detail::byte_of_code_point(c); b >= 0) CHECK(bytes.insert(b).second);
  CHECK(bytes.size() == 256);
  // The published table's landmarks: printable bytes are themselves; space is U+0120 ("Ġ"),
  // newline U+010A ("Ċ"); the soft hyphen 0xAD is the 68th and last byte moved, U+0143.
  CHECK(io::detail::byte_of_code_point(U'A') == 'A');
  CHECK(io::detail::byte_of_code_point(0xe9) == 0xe9);
  CHECK(io::detail::byte_of_code_point(0x120) == ' ');
  CHECK(io::detail::byte_of_code_point(0x10a) == '\n');
  CHECK(io::detail::byte_of_code_point(0x100) == 0);
  CHECK(io::detail::byte_of_code_point(0x143) == 0xad);
  CHECK(io::detail::byte_of_code_point(0x144) == -1);
  CHECK(io::detail::byte_of_code_point(U' ') == -1);
  CHECK(io::detail::byte_of_code_point(0xad) == -1);
}

TEST_CASE("llm.c's tokenizer file: each id's bytes, the end-of-text id, and text across split characters") {
  const TempPath file("tokenizer");
  const std::vector<std::string> tokens{"Hello", " world", "\n", e_acute.substr(0, 1), e_acute.substr(1), "<|endoftext|>"};
  write_llmc_tokenizer(file.path, tokens, 2, 5);
  const io::TokenDecoder decoder = io::TokenDecoder::read_llmc(file.path);
  CHECK(decoder.size() == 6);
  CHECK(decoder.end_of_text() == 5);
  CHECK(decoder.bytes(1) == " world");
  CHECK(decoder.decode(std::vector<std::int32_t>{0, 1, 2, 3, 4}) == "Hello world\n" + e_acute);
  CHECK(io::TokenDecoder::read(file.path).decode(std::vector<std::int32_t>{4, 3}) == "\xa9\xc3");
  CHECK(contains(error_of([&] { (void)decoder.bytes(6); }), "token decoder: token id: got 6; must be in [0, 6)"));

  write_llmc_tokenizer(file.path, tokens, 1, 99);  // version 1 has no end-of-text word
  CHECK(io::TokenDecoder::read_llmc(file.path).end_of_text() == -1);
}

TEST_CASE("llm.c's tokenizer file: a malformed file is refused by name") {
  const TempPath file("tokenizer");
  const std::vector<std::string> tokens{"a", "bc"};
  const auto message = [&] { return error_of([&] { (void)io::TokenDecoder::read_llmc(file.path); }); };
  write_llmc_tokenizer(file.path, tokens, 2, -1, 20240326);
  CHECK(contains(message(), "magic number: got 20240326; expected 20240328 (llm.c's tokenizer file); this is an llm.c "
                            "model checkpoint"));
  write_llmc_tokenizer(file.path, tokens, 3);
  CHECK(contains(message(), "version: got 3; expected 1, or 2 (with the end-of-text id)"));
  write_llmc_tokenizer(file.path, tokens, 2, -1, io::llmc_tokenizer_magic, 3);
  CHECK(contains(message(), "token 2: got no length byte; the file ends before it does (the header says 3 tokens)"));
  write_llmc_tokenizer(file.path, {"a", "bc"}, 2, -1, io::llmc_tokenizer_magic, -1, "x");
  CHECK(contains(message(), "size: got 1030 bytes; expected the file to end after its 2 tokens, at byte 1029"));
  write_llmc_tokenizer(file.path, tokens, 2, 2);
  CHECK(contains(message(), "end-of-text id: got 2; must be a token id below 2"));
  write_llmc_tokenizer(file.path, tokens, 2, -1, io::llmc_tokenizer_magic, 0);
  CHECK(contains(message(), "vocabulary size: got 0; must be >= 1"));
  write_text(file.path, "short");
  CHECK(contains(message(), "too short for the 1024-byte header"));
  // A length byte that runs past the end.
  {
    write_llmc_tokenizer(file.path, {"a"}, 2, -1, io::llmc_tokenizer_magic, 2, std::string(1, '\x05') + "xy");
    CHECK(contains(message(), "token 1: got 5 bytes; the file ends before it does"));
  }
}

TEST_CASE("Hugging Face vocab.json: tokens through the byte-to-character table, <|endoftext|> found") {
  const TempPath file("vocab");
  // "Ġworld" is " world"; "Ċ" a newline; "Ã" and "©" the two bytes of "é".
  write_text(file.path, "{\"Hello\": 0, \"" + utf8(0x120) + "world\": 1, \"" + utf8(0x10a) + "\": 2, \"" + utf8(0xc3) +
                            "\": 3, \"" + utf8(0xa9) + "\": 4, \"<|endoftext|>\": 5}");
  const io::TokenDecoder decoder = io::TokenDecoder::read_vocab_json(file.path);
  CHECK(decoder.size() == 6);
  CHECK(decoder.end_of_text() == 5);
  CHECK(decoder.decode(std::vector<std::int32_t>{0, 1, 2, 3, 4, 5}) == "Hello world\n" + e_acute + "<|endoftext|>");
  CHECK(io::TokenDecoder::read(file.path).bytes(1) == " world");
  // Without <|endoftext|> there is no end-of-text id.
  write_text(file.path, "{\"a\": 1, \"b\": 0}");
  CHECK(io::TokenDecoder::read_vocab_json(file.path).end_of_text() == -1);
  CHECK(io::TokenDecoder::read_vocab_json(file.path).decode(std::vector<std::int32_t>{0, 1}) == "ba");
}

TEST_CASE("Hugging Face vocab.json: a malformed vocabulary is refused by name") {
  const TempPath file("vocab");
  const auto message = [&](const std::string& text) {
    write_text(file.path, text);
    return error_of([&] { (void)io::TokenDecoder::read_vocab_json(file.path); });
  };
  CHECK(contains(message("{\"a\": 0, \"b\": 2}"), "id of token \"b\": got 2; must be in [0, 2)"));
  CHECK(contains(message("{\"a\": 0, \"b\": 0}"), "id of token \"b\": got 0; is another token's id too"));
  CHECK(contains(message("{\"a\": 0.5}"), "id of token \"a\""));
  CHECK(contains(message("{\"a\": 0, \"" + utf8(0x200) + "\": 1}"),
                 "character: got 512; is not in GPT-2's byte-to-character table"));
  CHECK(contains(message("{}"), "tokens: got 0; must be at least one"));
  CHECK(contains(message("[1, 2]"), "vocab.json"));
  CHECK(contains(message("{\"a\": 0"), "vocab.json"));
  CHECK(contains(error_of([&] { (void)io::TokenDecoder::read(file.path / "missing"); }), "tokenizer: cannot open"));
}

}  // namespace test_io_token_decoder
