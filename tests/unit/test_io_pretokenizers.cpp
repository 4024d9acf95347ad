// io::cl100k_pretokenize, io::llama3_pretokenize and io::o200k_pretokenize (and GPT-2's, through
// io::pretokenize): the pieces Python's `regex` module finds with each one's pattern
// (io::pretokenizer_patterns, io::cl100k_pattern); tiktoken files named cl100k_base and
// o200k_base (556 ranks) encoded as OpenAI's tiktoken does with those encodings; and
// tokenizer.json files with a Split by Llama 3's or o200k_base's pattern before a ByteLevel, as
// Llama 3's is written, encoded as Hugging Face's `tokenizers` does. Reference data:
// tests/data/tokenizer/make_pretokenizers.py.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loom/io/json.hpp"
#include "loom/io/token_decoder.hpp"
#include "loom/io/token_encoder.hpp"
#include "support/error_of.hpp"
#include "support/temp_path.hpp"

namespace test_io_pretokenizers {

using namespace loom;
using namespace loom::test;

namespace {

const std::string data_dir = std::string(LOOM_TEST_DATA_DIR) + "/tokenizer";

std::string read_text(const std::string& path) { return io::detail::read_text_file(path, "test data"); }

using Strings = std::vector<std::string>;

Strings pieces_of(io::Pretokenizer p, std::string_view text) {
  const std::vector<std::string_view> views = io::pretokenize(p, text);
  return {views.begin(), views.end()};
}

std::vector<std::int32_t> ids_of(const io::Json& item) {
  std::vector<std::int32_t> ids;
  for (const io::Json& id : item.find("ids")->array("ids")) ids.push_back(static_cast<std::int32_t>(id.integer("id")));
  return ids;
}

}  // namespace

TEST_CASE("each pretokenizer splits 83 texts as Python's regex does with its pattern") {
  const io::Json all = io::Json::parse(read_text(data_dir + "/pretokenizers_expected.json"), "expected");
  const std::pair<const char*, io::Pretokenizer> patterns[] = {{"gpt2", io::Pretokenizer::gpt2},
                                                               {"gpt2_possessive", io::Pretokenizer::gpt2},
                                                               {"cl100k", io::Pretokenizer::cl100k},
                                                               {"llama3", io::Pretokenizer::llama3},
                                                               {"o200k", io::Pretokenizer::o200k}};
  for (const auto& pattern : patterns) {
    const char* key = pattern.first;
    const io::Pretokenizer p = pattern.second;
    CAPTURE(key);
    std::size_t checked = 0, texts = 0;
    for (const io::Json& item : all.find(key)->array(key)) {
      const std::string& text = item.find("text")->string("text");
      Strings expected;
      for (const io::Json& piece : item.find("pieces")->array("pieces")) expected.push_back(piece.string("piece"));
      CAPTURE(text);
      CHECK(pieces_of(p, text) == expected);
      checked += expected.size();
      ++texts;
    }
    CHECK(texts == 83);
    CHECK(checked > 3000);
  }
  // The patterns are the ones the files hold, and the pretokenizers they name.
  CHECK(io::pretokenizer_patterns[2].pretokenizer == io::Pretokenizer::llama3);
  CHECK(io::pretokenizer_patterns[2].regex.starts_with("(?i:'s|'t|'re|'ve|'m|'ll|'d)|"));
  CHECK(io::pretokenizer_patterns[3].regex == io::o200k_pattern);
  CHECK(io::cl100k_pattern.starts_with("'(?i:[sdmt]|ll|ve|re)|"));
  CHECK(io::name(io::Pretokenizer::llama3) == "llama3");
  CHECK(io::name(io::Pretokenizer::o200k) == "o200k");
}

TEST_CASE("cl100k_base's pieces, case by case") {
  constexpr auto cl100k = io::Pretokenizer::cl100k;
  // Contractions in any case (the long s folds to s), and only from the apostrophe.
  CHECK(pieces_of(cl100k, "IT'S they'RE 'Ll") == Strings{"IT", "'S", " they", "'RE", " '", "Ll"});
  CHECK(pieces_of(cl100k, "'\xc5\xbf") == Strings{"'\xc5\xbf"});  // 'ſ
  CHECK(pieces_of(cl100k, "x'ver") == Strings{"x", "'ve", "r"});
  // One character that is not a line end, letter or number before a letter run.
  CHECK(pieces_of(cl100k, "\"hi\" \thi (hi") == Strings{"\"hi", "\"", " ", "\thi", " (", "hi"});
  CHECK(pieces_of(cl100k, "\nhi") == Strings{"\n", "hi"});
  // Numbers three digits at a time, with no space before them.
  CHECK(pieces_of(cl100k, "x 1234567") == Strings{"x", " ", "123", "456", "7"});
  // Punctuation takes the line ends after it.
  CHECK(pieces_of(cl100k, "a.\r\n\nb") == Strings{"a", ".\r\n\n", "b"});
  // White space: up to its last line end; less its last character before text; whole at the end.
  CHECK(pieces_of(cl100k, "a  \n \nb") == Strings{"a", "  \n \n", "b"});
  CHECK(pieces_of(cl100k, "a   b") == Strings{"a", "  ", " b"});
  CHECK(pieces_of(cl100k, "a \n ") == Strings{"a", " \n "});
  CHECK(pieces_of(io::Pretokenizer::llama3, "a \n ") == Strings{"a", " \n", " "});
  // A byte that is not UTF-8 is a character of its own, before a letter run too.
  CHECK(pieces_of(cl100k, "\xffhi\xfe") == Strings{"\xffhi", "\xfe"});
  CHECK(pieces_of(cl100k, "").empty());
}

TEST_CASE("o200k_base's pieces, case by case") {
  constexpr auto o200k = io::Pretokenizer::o200k;
  // Letter runs split where lower case falls back to upper; an upper-case run keeps the lower
  // case after it; the contraction joins the run before it.
  CHECK(pieces_of(o200k, "loomWeavesThreads HTTPServer") == Strings{"loom", "Weaves", "Threads", " HTTPServer"});
  CHECK(pieces_of(o200k, "HELLOworld I'M they'RE") == Strings{"HELLOworld", " I'M", " they'RE"});
  CHECK(pieces_of(o200k, "'s ABC's") == Strings{"'s", " ABC's"});
  // Title case (ǅ) counts as upper, modifier letters (ʰ) and marks as either.
  CHECK(pieces_of(o200k, "\xc7\x85ungla x\xca\xb0" "A") == Strings{"\xc7\x85ungla", " x\xca\xb0", "A"});
  CHECK(pieces_of(o200k, "A\xcc\x81" "b \xcc\x81x") == Strings{"A\xcc\x81" "b", " \xcc\x81x"});
  // Numbers in threes; punctuation takes line ends and slashes; white space as Llama 3's.
  CHECK(pieces_of(o200k, "a/b 12345 .\n/x") == Strings{"a", "/b", " ", "123", "45", " .\n/", "x"});
  CHECK(pieces_of(o200k, "a \n ") == Strings{"a", " \n", " "});
}

TEST_CASE("every pretokenizer's pieces are the text, in order, for any bytes") {
  std::mt19937 draw(20261128);
  const Strings parts = {"a", "Z", "7", " ", "  ", "\n", "\r", "\t", "'", "'s", "'S", "\xc5\xbf", ".", "é", "٣", "東",
                         "\xe3\x80\x80", "👋", "\xc2\xa0"};
  for (int i = 0; i < 3000; ++i) {
    std::string text;
    const int length = static_cast<int>(draw() % 40);
    for (int k = 0; k < length; ++k)
      text += draw() % 3 == 0 ? std::string(1, static_cast<char>(draw() % 256)) : parts[draw() % parts.size()];
    for (const io::Pretokenizer p :
         {io::Pretokenizer::gpt2, io::Pretokenizer::cl100k, io::Pretokenizer::llama3, io::Pretokenizer::o200k}) {
      std::string joined;
      for (const std::string_view piece : io::pretokenize(p, text)) {
        CHECK_FALSE(piece.empty());
        joined += piece;
      }
      CHECK(joined == text);
    }
  }
}

TEST_CASE("encode(text, threads) cuts only where every pretokenizer's pieces end") {
  // Lines that end in punctuation, white space, letters, digits and marks, with the next line
  // starting with a slash (o200k_base's punctuation takes it across the line end), a letter, a
  // space, a digit or a quote.
  std::mt19937 draw(20261128);
  const Strings ends = {".", "!", " ", "a", "Z", "7", "\xcc\x81", "/", "\r", "\xe6\x9d\xb1"};
  const Strings starts = {"/", "x", " ", "9", "'s", "\"", "\t", "\xcc\x81", "/usr", "A"};
  std::string text;
  for (int line = 0; line < 4000; ++line)
    text += starts[draw() % starts.size()] + "word" + ends[draw() % ends.size()] + "\n";
  const io::TokenDecoder vocabulary = io::TokenDecoder::read(data_dir + "/vocab.json");
  for (const io::Pretokenizer p :
       {io::Pretokenizer::gpt2, io::Pretokenizer::cl100k, io::Pretokenizer::llama3, io::Pretokenizer::o200k}) {
    CAPTURE(io::name(p));
    std::vector<std::size_t> boundaries{0};
    for (const std::string_view piece : io::pretokenize(p, text)) boundaries.push_back(boundaries.back() + piece.size());
    const io::TokenEncoder encoder(vocabulary, p);
    const std::vector<std::size_t> cuts = encoder.cut_points(text, 64);
    CHECK(cuts.size() > 40);
    for (const std::size_t cut : cuts) {
      CAPTURE(cut);
      CHECK(std::binary_search(boundaries.begin(), boundaries.end(), cut));
    }
    CHECK(encoder.encode(text, 64) == encoder.encode(text));
  }
}

TEST_CASE("tiktoken files named cl100k_base and o200k_base encode as OpenAI's tiktoken does with those encodings") {
  // vocab.json's 556 ranks under each name: that encoding's pattern and special tokens.
  const io::TokenDecoder vocabulary = io::TokenDecoder::read(data_dir + "/vocab.json");
  const io::TokenEncoder gpt2(vocabulary);
  CHECK(gpt2.pretokenizer() == io::Pretokenizer::gpt2);
  struct Encoding {
    std::string name;
    io::Pretokenizer pretokenizer;
    std::int64_t vocab_size;
    std::int32_t end_of_text, last_special;
  };
  for (const Encoding& e : {Encoding{"cl100k", io::Pretokenizer::cl100k, 100277, 100257, 100276},
                            Encoding{"o200k", io::Pretokenizer::o200k, 200019, 199999, 200018}}) {
    CAPTURE(e.name);
    const std::string path = data_dir + "/tiktoken/" + e.name + "_base.tiktoken";
    const io::TokenizerFile file = io::read_tokenizer(path);
    CHECK(!file.rules);
    CHECK(file.pretokenizer == e.pretokenizer);
    REQUIRE(file.decoder.size() == e.vocab_size);
    CHECK(file.decoder.end_of_text() == e.end_of_text);
    CHECK(file.decoder.bytes(e.last_special) == "<|endofprompt|>");
    CHECK(file.decoder.bytes(556).empty());  // no token has that id
    const io::TokenEncoder encoder = io::TokenEncoder::read(path);
    CHECK(encoder.pretokenizer() == e.pretokenizer);
    CHECK(encoder.vocab_size() == e.vocab_size);
    // The same ranks from vocab.json, given the pattern.
    const io::TokenEncoder by_ranks(vocabulary, e.pretokenizer);
    const io::Json expected = io::Json::parse(read_text(data_dir + "/" + e.name + "_expected.json"), "expected");
    std::size_t checked = 0, split_otherwise = 0;
    for (const io::Json& item : expected.array("expected")) {
      const std::string& text = item.find("text")->string("text");
      const std::vector<std::int32_t> ids = ids_of(item);
      CAPTURE(text);
      CHECK(encoder.encode(text) == ids);
      CHECK(encoder.encode(text, 2) == ids);  // cut after line ends, encoded on two threads
      CHECK(file.decoder.decode(ids) == text);
      if (text.find("<|endoftext|>") == std::string::npos) {  // vocab.json's end-of-text id is 556
        CHECK(by_ranks.encode(text) == ids);
        split_otherwise += gpt2.encode(text) != ids ? 1 : 0;
      }
      checked += ids.size();
    }
    CHECK(checked > 10000);
    CHECK(split_otherwise > 15);  // GPT-2's pattern gives other ids for 24 of the texts (cl100k_base)
  }
}

TEST_CASE("tiktoken files: the name says the encoding; a malformed line or rank is refused by name") {
  const io::TokenizerFile r50k = io::read_tokenizer(data_dir + "/tiktoken/r50k_base.tiktoken");
  CHECK(r50k.pretokenizer == io::Pretokenizer::gpt2);
  CHECK(r50k.decoder.size() == 50257);
  CHECK(r50k.decoder.end_of_text() == 50256);
  CHECK(io::TokenEncoder::read(data_dir + "/tiktoken/r50k_base.tiktoken").encode("It'S") ==
        io::TokenEncoder(io::TokenDecoder::read(data_dir + "/vocab.json")).encode("It'S"));

  TempPath folder("tiktoken_files");
  fs::create_directories(folder.path);
  const auto message = [&](const std::string& name, const std::string& text) {
    std::ofstream(folder.path / name, std::ios::binary) << text;
    return error_of([&] { (void)io::TokenEncoder::read(folder.path / name); });
  };
  CHECK(contains(message("mine.tiktoken", "IQ== 0\n"),
                 "encoding: got mine; expected r50k_base, p50k_base, cl100k_base or o200k_base (the file's name "
                 "says which: a tiktoken file holds neither its pattern nor its special tokens)"));
  CHECK(contains(message("r50k_base.tiktoken", "IQ== 0\nIg==1\n"),
                 "line 2: got \"Ig==1\"; expected a token's bytes in base64, a space and its rank"));
  CHECK(contains(message("r50k_base.tiktoken", "I!== 0\n"), "line 1: got \"I!== 0\"; expected a token's bytes"));
  CHECK(contains(message("r50k_base.tiktoken", "IQ== 0\nIg== -1\n"), "line 2: got \"Ig== -1\""));
  CHECK(contains(message("r50k_base.tiktoken", "IQ== 0\nIg== 0\n"), "line 2: rank: got 0; is another token's already"));
  CHECK(contains(message("r50k_base.tiktoken", "IQ== 50257\n"),
                 "line 1: rank: got 50257; must be below 50257, r50k_base's vocabulary"));
  CHECK(contains(message("r50k_base.tiktoken", "IQ== 50256\n"),
                 "rank: got 50256; is <|endoftext|>'s id in r50k_base, not a token's of the file"));
  CHECK(contains(message("cl100k_base.tiktoken", "IQ== 0\n"), "token encoder: byte: got 0; has no token of its own"));
}

TEST_CASE("tokenizer.json with a Split by Llama 3's or o200k_base's pattern encodes as Hugging Face's tokenizers does") {
  const io::Json all = io::Json::parse(read_text(data_dir + "/split_expected.json"), "expected");
  for (const auto& split : {std::pair{"llama3_like.json", io::Pretokenizer::llama3},
                            std::pair{"o200k_like.json", io::Pretokenizer::o200k}}) {
    const std::string file = split.first;
    const io::Pretokenizer p = split.second;
    CAPTURE(file);
    const io::TokenizerJson spec = io::read_tokenizer_json(data_dir + "/" + file);
    CHECK(spec.rules.pretokenizer == p);
    CHECK(!spec.rules.add_prefix_space);
    CHECK(spec.decoder.end_of_text() == 1);  // <|end_of_text|>
    const io::TokenEncoder encoder = io::TokenEncoder::read(data_dir + "/" + file);
    CHECK(encoder.pretokenizer() == p);
    std::size_t checked = 0;
    for (const io::Json& item : all.find(file)->array(file)) {
      const std::string& text = item.find("text")->string("text");
      const std::vector<std::int32_t> ids = ids_of(item);
      CAPTURE(text);
      CHECK(encoder.encode(text) == ids);
      CHECK(encoder.encode(text, 2) == ids);
      checked += ids.size();
    }
    CHECK(checked > 10000);
  }
}

TEST_CASE("tokenizer.json: a Split loom does not know, or a Sequence of other steps, is refused by name") {
  TempPath file("pretokenizer_json");
  const std::string spec = read_text(data_dir + "/llama3_like.json");
  const auto message = [&](const std::string& from, const std::string& to) {
    std::string edited = spec;
    const std::size_t at = edited.find(from);
    REQUIRE(at != std::string::npos);
    edited.replace(at, from.size(), to);
    std::ofstream(file.path, std::ios::binary) << edited;
    return error_of([&] { (void)io::TokenEncoder::read(file.path); });
  };
  const std::string other_pattern = message("\\\\s*[\\\\r\\\\n]+", "\\\\s*[\\\\r]+");
  // tiktoken's own cl100k_base pattern: Oniguruma would split its digit runs otherwise.
  const std::string llama3 = io::json_quote(std::string(io::pretokenizer_patterns[2].regex));
  CHECK(contains(message(llama3, io::json_quote(std::string(io::cl100k_pattern))),
                 "pretokenizers[0].pattern.Regex: got tiktoken's cl100k_base pattern; expected Llama 3's form of it"));
  CHECK(contains(other_pattern, "pre_tokenizer.pretokenizers[0].pattern.Regex: got \"(?i:'s|'t|'re|'ve|'m|'ll|'d)|"));
  CHECK(contains(other_pattern,
                 "expected GPT-2's, Llama 3's or o200k_base's pattern, as io::pretokenizer_patterns writes them"));
  CHECK(contains(message("\"Isolated\"", "\"Removed\""),
                 "pre_tokenizer.pretokenizers[0].behavior: got the string \"Removed\"; expected Isolated"));
  CHECK(contains(message("\"invert\": false", "\"invert\": true"), "pretokenizers[0].invert: got true; expected false"));
  CHECK(contains(message("\"use_regex\": false", "\"use_regex\": true"),
                 "pretokenizers[1].use_regex: got true; expected false: the Split before it has split the text"));
  CHECK(contains(message("\"type\": \"Split\"", "\"type\": \"Digits\""),
                 "pre_tokenizer: got a Sequence of [Digits, ByteLevel]; expected ByteLevel, or a Sequence of a Split"));
  CHECK(contains(message("\"Regex\":", "\"String\":"), "pretokenizers[0].pattern: got"));
}

}  // namespace test_io_pretokenizers
