// io::TokenEncoder and io::gpt2_pretokenize: GPT-2's pre-tokenizing pattern piece by piece, the
// merges of the ranks rule, and a 557-token vocabulary's encodings against OpenAI's tiktoken
// (tests/data/tokenizer, made by its make_reference.py); every byte string round-trips.

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "loom/io/json.hpp"
#include "loom/io/token_decoder.hpp"
#include "loom/io/token_encoder.hpp"
#include "support/error_of.hpp"
#include "support/llmc_tokenizer.hpp"
#include "support/temp_path.hpp"

namespace test_io_token_encoder {

using namespace loom;
using namespace loom::test;

namespace {

const std::string data_dir = std::string(LOOM_TEST_DATA_DIR) + "/tokenizer";

std::string read_text(const std::string& path) { return io::detail::read_text_file(path, "test data"); }

std::vector<std::string> pieces_of(std::string_view text) {
  const std::vector<std::string_view> views = io::gpt2_pretokenize(text);
  return {views.begin(), views.end()};
}

//! The 256 bytes as tokens 0..255 (token b is byte b), then `merged`.
io::TokenDecoder bytes_then(const std::vector<std::string>& merged, std::int32_t end = -1) {
  std::vector<std::string> tokens;
  for (int b = 0; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  tokens.insert(tokens.end(), merged.begin(), merged.end());
  return io::TokenDecoder(std::move(tokens), end);
}

//! `count` random strings of up to 40 bytes: ASCII letters, digits, spaces, apostrophes and any
//! byte at all (so invalid UTF-8 too), and pieces of valid multi-byte characters.
std::vector<std::string> random_texts(int count) {
  std::mt19937 draw(20261127);
  const std::vector<std::string> parts = {"a",  "Z",  "7",  " ",  "  ", "\n", "\t",           "'",      "'s",
                                          ".",  "é",  "٣",  "東", "\xe3\x80\x80" /* U+3000 */, "👋",
                                          "\xc2\xa0" /* U+00A0 */, "<|endoftext|>"};
  std::vector<std::string> texts;
  for (int i = 0; i < count; ++i) {
    std::string text;
    const int length = static_cast<int>(draw() % 40);
    for (int k = 0; k < length; ++k)
      text += draw() % 3 == 0 ? std::string(1, static_cast<char>(draw() % 256)) : parts[draw() % parts.size()];
    texts.push_back(text);
  }
  return texts;
}

}  // namespace

TEST_CASE("GPT-2's pre-tokenizer splits as its pattern does") {
  // Each expectation is what Python's `regex` finds with GPT-2's pattern.
  CHECK(pieces_of("Hello world") == std::vector<std::string>{"Hello", " world"});
  CHECK(pieces_of("I'm") == std::vector<std::string>{"I", "'m"});
  CHECK(pieces_of("don't") == std::vector<std::string>{"don", "'t"});
  CHECK(pieces_of("'ll've'd're") == std::vector<std::string>{"'ll", "'ve", "'d", "'re"});
  CHECK(pieces_of("'s's") == std::vector<std::string>{"'s", "'s"});
  CHECK(pieces_of("'S") == std::vector<std::string>{"'", "S"});  // the contractions are lower case
  CHECK(pieces_of("?'s") == std::vector<std::string>{"?'", "s"});  // an apostrophe inside punctuation
  CHECK(pieces_of("a  b") == std::vector<std::string>{"a", " ", " b"});
  CHECK(pieces_of("a \n\nb") == std::vector<std::string>{"a", " \n", "\n", "b"});
  CHECK(pieces_of("\t\tx") == std::vector<std::string>{"\t", "\t", "x"});
  CHECK(pieces_of("x   ") == std::vector<std::string>{"x", "   "});  // trailing white space stays whole
  CHECK(pieces_of("3.14") == std::vector<std::string>{"3", ".", "14"});
  CHECK(pieces_of(" !!") == std::vector<std::string>{" !!"});
  CHECK(pieces_of("caf\xc3\xa9 au lait") == std::vector<std::string>{"caf\xc3\xa9", " au", " lait"});
  CHECK(pieces_of("\xd9\xa1\xd9\xa2 \xd9\xa3") ==  // Arabic-Indic digits are \p{N}
        std::vector<std::string>{"\xd9\xa1\xd9\xa2", " \xd9\xa3"});
  CHECK(pieces_of("a\xe3\x80\x80\xe3\x80\x80" "b") ==  // U+3000 is white space, but only U+0020 prefixes
        std::vector<std::string>{"a", "\xe3\x80\x80", "\xe3\x80\x80", "b"});
  CHECK(pieces_of("x\xc2\xa0y") == std::vector<std::string>{"x", "\xc2\xa0", "y"});
  CHECK(pieces_of("").empty());
}

TEST_CASE("characters are classed by Unicode 16's tables, and bytes that are not UTF-8 count one each") {
  using io::detail::CharClass;
  const auto kind = [](std::string_view s) {
    const io::detail::TextChar c = io::detail::char_at(s, 0);
    CHECK(c.bytes == s.size());
    return c.kind;
  };
  CHECK(kind("\xc3\xa9") == CharClass::letter);           // é
  CHECK(kind("\xe6\x9d\xb1") == CharClass::letter);       // 東
  CHECK(kind("\xf0\x93\x91\xa0") == CharClass::letter);   // U+13460, Egyptian hieroglyph added in Unicode 16
  CHECK(kind("\xd9\xa3") == CharClass::number);           // ٣
  CHECK(kind("\xc2\xbd") == CharClass::number);           // ½ (No)
  CHECK(kind("\xe2\x85\xab") == CharClass::number);       // Ⅻ (Nl)
  CHECK(kind("\xe2\x80\x83") == CharClass::space);        // U+2003 em space
  CHECK(kind("\xc2\x85") == CharClass::space);            // U+0085 next line
  CHECK(kind("\xe2\x82\xac") == CharClass::other);        // €
  CHECK(kind("\xf0\x9f\x91\x8b") == CharClass::other);    // 👋
  CHECK(kind("\x1c") == CharClass::other);                // not White_Space, though Python's isspace says so
  // Malformed: a lone continuation byte, an overlong '/', a surrogate, past U+10FFFF, a cut sequence.
  for (const std::string_view bad : {std::string_view("\x80"), std::string_view("\xc0\xaf"), std::string_view("\xed\xa0\x80"),
                                     std::string_view("\xf4\x90\x80\x80"), std::string_view("\xe3\x80")}) {
    const io::detail::TextChar c = io::detail::char_at(bad, 0);
    CHECK(c.kind == CharClass::other);
    CHECK(c.bytes == 1);
  }
}

TEST_CASE("the pieces are the text, in order, for any bytes") {
  for (const std::string& text : random_texts(2000)) {
    std::string joined;
    for (const std::string_view piece : io::gpt2_pretokenize(text)) {
      CHECK_FALSE(piece.empty());
      joined += piece;
    }
    CHECK(joined == text);
  }
}

TEST_CASE("pairs merge lowest rank first, leftmost among equals, and any adjacent pair that is a token merges") {
  // 256 = "ab", 257 = "bc", 258 = "abc".
  const io::TokenEncoder ab_first(bytes_then({"ab", "bc", "abc"}));
  CHECK(ab_first.encode("abcd") == std::vector<std::int32_t>{258, 'd'});  // ab, then ab+c
  CHECK(ab_first.encode("abc") == std::vector<std::int32_t>{258});          // a whole piece is its token
  CHECK(ab_first.encode("bcab") == std::vector<std::int32_t>{257, 256});
  // 256 = "bc", 257 = "ab", 258 = "abc": bc first, then a+bc, which is a token though no merge
  // listed (a, bc): the ranks rule, as tiktoken has it.
  const io::TokenEncoder bc_first(bytes_then({"bc", "ab", "abc"}));
  CHECK(bc_first.encode("abcd") == std::vector<std::int32_t>{258, 'd'});
  CHECK(bc_first.encode("abab") == std::vector<std::int32_t>{257, 257});
  // Equal ranks: the leftmost pair first, so "aaaaa" is aa, aa, a and not a, aa, aa.
  const io::TokenEncoder pairs(bytes_then({"aa"}));
  CHECK(pairs.encode("aaaaa") == std::vector<std::int32_t>{256, 256, 'a'});
  // No token crosses a piece: "a b" is "a" and " b" even with "a " in the vocabulary.
  const io::TokenEncoder spaced(bytes_then({"a ", " b"}));
  CHECK(spaced.encode("a b") == std::vector<std::int32_t>{'a', 257});
  // A repeated token's lowest id is its rank.
  const io::TokenEncoder repeated(bytes_then({"xy", "xy"}));
  CHECK(repeated.encode("xyxy") == std::vector<std::int32_t>{256, 256});
}

TEST_CASE("a 557-token vocabulary encodes as OpenAI's tiktoken does, from vocab.json and from llm.c's file") {
  const io::TokenDecoder from_json = io::TokenDecoder::read(data_dir + "/vocab.json");
  REQUIRE(from_json.size() == 557);
  REQUIRE(from_json.end_of_text() == 556);
  // The same tokens written as llm.c's tokenizer file.
  std::vector<std::string> tokens;
  for (std::int32_t id = 0; id < from_json.size(); ++id) tokens.push_back(from_json.bytes(id));
  TempPath file("encoder_vocab");
  write_llmc_tokenizer(file.path, tokens, 2, 556);
  const io::TokenDecoder from_llmc = io::TokenDecoder::read(file.path);
  const io::TokenEncoder json_encoder(from_json), llmc_encoder(from_llmc);

  const io::Json expected = io::Json::parse(read_text(data_dir + "/expected.json"), "expected.json");
  std::size_t checked = 0;
  for (const io::Json& item : expected.array("expected.json")) {
    const std::string& text = item.find("text")->string("text");
    std::vector<std::int32_t> ids;
    for (const io::Json& id : item.find("ids")->array("ids")) ids.push_back(static_cast<std::int32_t>(id.integer("id")));
    CAPTURE(text);
    CHECK(json_encoder.encode(text) == ids);
    CHECK(llmc_encoder.encode(text) == ids);
    CHECK(from_json.decode(ids) == text);
    checked += ids.size();
  }
  CHECK(checked > 900);
  // The end-of-text token is the literal's, and only there.
  CHECK(json_encoder.encode("<|endoftext|>") == std::vector<std::int32_t>{556});
  CHECK(json_encoder.encode("<|endoftext|") != std::vector<std::int32_t>{556});
}

TEST_CASE("decode(encode(s)) == s for any bytes, invalid UTF-8 and literal end-of-text included") {
  const io::TokenDecoder vocabulary = io::TokenDecoder::read(data_dir + "/vocab.json");
  const io::TokenEncoder encoder(vocabulary);
  // Without an end-of-text token the literal is text like any other.
  std::vector<std::string> tokens;
  for (std::int32_t id = 0; id < vocabulary.size(); ++id) tokens.push_back(vocabulary.bytes(id));
  const io::TokenDecoder no_end(tokens);
  const io::TokenEncoder plain(no_end);
  for (const std::string& text : random_texts(2000)) {
    CAPTURE(text);
    const std::vector<std::int32_t> ids = encoder.encode(text);
    CHECK(vocabulary.decode(ids) == text);
    const std::vector<std::int32_t> plain_ids = plain.encode(text);
    CHECK(no_end.decode(plain_ids) == text);
    for (const std::int32_t id : plain_ids) CHECK(id != 556);
  }
}

TEST_CASE("a vocabulary without a token for some byte is refused by name") {
  std::vector<std::string> tokens;
  for (int b = 1; b < 256; ++b) tokens.emplace_back(1, static_cast<char>(b));
  const io::TokenDecoder missing_zero(tokens);
  CHECK(error_of([&] { io::TokenEncoder{missing_zero}; }) ==
        "loom: token encoder: byte: got 0; has no token of its own: a byte-level BPE vocabulary has one for each "
        "of the 256 bytes");
  // The decoder-only vocabulary of the gpt2_train demo (token i is "t<i>_") cannot encode.
  std::vector<std::string> named;
  for (int i = 0; i < 256; ++i) named.push_back(std::to_string(i).insert(0, 1, 't').append(1, '_'));
  CHECK(contains(error_of([&] { io::TokenEncoder{io::TokenDecoder(named)}; }), "token encoder: byte: got 0"));
}

}  // namespace test_io_token_encoder
