// Hugging Face tokenizer.json: io::read_tokenizer_json, TokenEncoder's merge-list rule and its
// WordPiece, against Hugging Face's `tokenizers` (tests/data/tokenizer, made by its
// make_tokenizer_json.py): two 600-token byte-level BPEs whose ids are shuffled away from their
// merge ranks (added tokens with lstrip and rstrip, add_prefix_space, ignore_merges, both forms of
// merges) and two 492-token BERT WordPieces (uncased and cased); BERT vocab.txt files (made by
// make_vocab_txt.py) against `tokenizers`' BertWordPieceTokenizer; and every file loom would
// encode otherwise refused by name.

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "loom/io/json.hpp"
#include "loom/io/token_decoder.hpp"
#include "loom/io/token_encoder.hpp"
#include "support/error_of.hpp"
#include "support/temp_path.hpp"

namespace test_io_tokenizer_json {

using namespace loom;
using namespace loom::test;

namespace {

const std::string data_dir = std::string(LOOM_TEST_DATA_DIR) + "/tokenizer";

std::string read_text(const std::string& path) { return io::detail::read_text_file(path, "test data"); }

void write_text(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

struct Example {
  std::string text;
  std::vector<std::int32_t> ids;
};

//! The texts and ids for `file` in `expected` (tokenizer_json_expected.json by default).
std::vector<Example> expected_for(const std::string& file,
                                  const std::string& expected = "tokenizer_json_expected.json") {
  const io::Json all = io::Json::parse(read_text(data_dir + "/" + expected), "expected");
  std::vector<Example> out;
  for (const io::Json& item : all.find(file)->array(file)) {
    Example e{item.find("text")->string("text"), {}};
    for (const io::Json& id : item.find("ids")->array("ids")) e.ids.push_back(static_cast<std::int32_t>(id.integer("id")));
    out.push_back(std::move(e));
  }
  return out;
}

//! The 256 byte tokens through GPT-2's byte-to-character table, as a tokenizer.json's vocab
//! members ("\"!\": 0, ..."), ids 0..255 in byte order; `more` members after them.
std::string byte_vocab(const std::string& more = "") {
  std::string members;
  for (int b = 0; b < 256; ++b) {
    const bool prints = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    int extra = 0;
    for (int x = 0; x < b; ++x) extra += (x >= 0x21 && x <= 0x7e) || (x >= 0xa1 && x <= 0xac) || x >= 0xae ? 0 : 1;
    const char32_t c = prints ? static_cast<char32_t>(b) : static_cast<char32_t>(0x100 + extra);
    std::string utf8 = c < 0x80 ? std::string(1, static_cast<char>(c))
                                : std::string{static_cast<char>(0xc0 | (c >> 6)), static_cast<char>(0x80 | (c & 0x3f))};
    members += (b == 0 ? "" : ", ") + io::json_quote(utf8) + ": " + std::to_string(b);
  }
  return members + more;
}

//! A tokenizer.json of the 256 bytes plus `vocab` (members after them), `merges`, and the
//! model, normalizer and pre-tokenizer members given.
std::string tokenizer(const std::string& vocab, const std::string& merges, const std::string& added = "[]",
                      const std::string& pre = R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})",
                      const std::string& model_extra = "", const std::string& normalizer = "null") {
  return R"({"version": "1.0", "added_tokens": )" + added + R"(, "normalizer": )" + normalizer +
         R"(, "pre_tokenizer": )" + pre + R"(, "model": {"type": "BPE")" + model_extra +
         R"(, "vocab": {)" + byte_vocab(vocab) + R"(}, "merges": )" + merges + "}}";
}

}  // namespace

TEST_CASE("tokenizer.json vocabularies with shuffled ids encode as Hugging Face's tokenizers does") {
  for (const std::string file : {"roberta_like.json", "prefix_space.json"}) {
    CAPTURE(file);
    const io::TokenizerJson spec = io::read_tokenizer_json(data_dir + "/" + file);
    REQUIRE(spec.decoder.size() == 600);
    CHECK(spec.decoder.end_of_text() == 2);  // </s>
    CHECK(spec.rules.merges.size() == 339);
    const io::TokenEncoder encoder(spec.decoder, spec.rules), from_file = io::TokenEncoder::read(data_dir + "/" + file);
    // The ids alone rank otherwise: the same vocabulary without its merges encodes other ids.
    const io::TokenEncoder by_ids(spec.decoder);
    std::size_t checked = 0, ranked_otherwise = 0;
    for (const Example& e : expected_for(file)) {
      CAPTURE(e.text);
      CHECK(encoder.encode(e.text) == e.ids);
      CHECK(from_file.encode(e.text) == e.ids);
      ranked_otherwise += by_ids.encode(e.text) != e.ids ? 1 : 0;
      checked += e.ids.size();
    }
    CHECK(checked > 1000);
    CHECK(ranked_otherwise > 5);
  }
}

TEST_CASE("tokenizer.json: both forms of merges, the decoder's bytes, and added tokens' own text") {
  const io::TokenizerJson roberta = io::read_tokenizer_json(data_dir + "/roberta_like.json");
  const io::TokenizerJson prefix = io::read_tokenizer_json(data_dir + "/prefix_space.json");
  CHECK(roberta.rules.merges == prefix.rules.merges);  // ["a", "b"] and "a b"
  CHECK(roberta.rules.merges.front() == std::pair<std::string, std::string>{" ", "t"});
  CHECK(!roberta.rules.add_prefix_space);
  CHECK(prefix.rules.add_prefix_space);
  CHECK(prefix.rules.ignore_merges);
  REQUIRE(roberta.rules.added.size() == 5);
  CHECK(roberta.rules.added[4].text == "<mask>");
  CHECK(roberta.rules.added[4].strip_left);
  CHECK(!roberta.rules.added[4].strip_right);
  CHECK(roberta.decoder.bytes(4) == "<mask>");
  // TokenDecoder::read tells a tokenizer.json from a vocab.json; read_vocab_json refuses one.
  CHECK(io::TokenDecoder::read(data_dir + "/roberta_like.json").bytes(2) == "</s>");
  CHECK(contains(error_of([&] { (void)io::TokenDecoder::read_vocab_json(data_dir + "/roberta_like.json"); }),
                 "got a tokenizer.json (it has a \"model\" member); expected a vocab.json"));
  for (const Example& e : expected_for("roberta_like.json")) {
    CAPTURE(e.text);
    // lstrip takes white space into <mask>: the decoded text lacks it there and nowhere else.
    if (e.text.find("<mask>") == std::string::npos) CHECK(roberta.decoder.decode(e.ids) == e.text);
  }
}

TEST_CASE("the merge list ranks pairs, not their concatenations; added tokens are matched leftmost, longest") {
  // 256 = "ab", 257 = "bc", 258 = "abc" (= a + bc). Merges: (b, c) first, then (a, b), then (a, bc).
  const std::string vocab = R"(, "ab": 256, "bc": 257, "abc": 258, "xy": 259, "<x>": 260, "<x>y": 261)";
  TempPath file("tokenizer_json");
  write_text(file.path, tokenizer(vocab, R"([["b", "c"], ["a", "b"], ["a", "bc"]])"));
  io::TokenEncoder merges = io::TokenEncoder::read(file.path);
  CHECK(merges.encode("abc") == std::vector<std::int32_t>{258});        // bc, then a + bc
  CHECK(merges.encode("abab") == std::vector<std::int32_t>{256, 256});
  CHECK(merges.encode("xy") == std::vector<std::int32_t>{'x', 'y'});  // a token, but no merge makes it
  // Without (a, bc), "abc" stays a + bc though "abc" is a token (the ranks rule would merge it).
  write_text(file.path, tokenizer(vocab, R"(["b c", "a b"])"));
  CHECK(io::TokenEncoder::read(file.path).encode("abc") == std::vector<std::int32_t>{'a', 257});
  // ignore_merges: a piece that is a token is that token.
  write_text(file.path, tokenizer(vocab, R"(["b c", "a b"])", "[]",
                                  R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})",
                                  R"(, "ignore_merges": true)"));
  const io::TokenEncoder whole = io::TokenEncoder::read(file.path);
  CHECK(whole.encode("abc") == std::vector<std::int32_t>{258});
  CHECK(whole.encode("xy") == std::vector<std::int32_t>{259});
  CHECK(whole.encode(" xy") == std::vector<std::int32_t>{' ', 'x', 'y'});  // not a token: merged as it may be
  // Added tokens: the leftmost match, the longest of those at one place; strips of white space.
  write_text(file.path, tokenizer(vocab, "[]",
                                  R"([{"id": 260, "content": "<x>", "lstrip": true},)"
                                  R"( {"id": 261, "content": "<x>y", "rstrip": true}])"));
  const io::TokenEncoder added = io::TokenEncoder::read(file.path);
  CHECK(added.encode("a <x>y  b<x>") == std::vector<std::int32_t>{'a', ' ', 261, 'b', 260});
  CHECK(added.encode("a \t<x>b") == std::vector<std::int32_t>{'a', 260, 'b'});
  CHECK(added.encode("<x") == std::vector<std::int32_t>{'<', 'x'});
}

TEST_CASE("tokenizer.json: what loom would encode otherwise is refused by name") {
  TempPath file("tokenizer_json");
  const auto message = [&](const std::string& text) {
    write_text(file.path, text);
    return error_of([&] { (void)io::TokenEncoder::read(file.path); });
  };
  const std::string pre = R"({"type": "ByteLevel", "add_prefix_space": false, "use_regex": true})";
  CHECK(contains(message(R"({"model": {"type": "Unigram", "vocab": []}})"),
                 "model.type: got Unigram; expected BPE (byte-level) or WordPiece"));
  CHECK(contains(message(tokenizer("", "[]", "[]", pre, "", R"({"type": "NFC"})")),
                 "normalizer: got NFC; expected null: loom's byte-level BPE normalizes nothing"));
  CHECK(contains(message(tokenizer("", "[]", "[]", R"({"type": "Sequence", "pretokenizers": []})")),
                 "pre_tokenizer: got a Sequence of []; expected ByteLevel, or a Sequence of a Split by GPT-2's, "
                 "Llama 3's or o200k_base's pattern and a ByteLevel without use_regex"));
  CHECK(contains(message(tokenizer("", "[]", "[]", R"({"type": "ByteLevel", "use_regex": false})")),
                 "pre_tokenizer.use_regex: got false; expected true: a ByteLevel alone must split the text"));
  CHECK(contains(message(tokenizer("", "[]", "[]", pre, R"(, "byte_fallback": true)")), "model.byte_fallback: got true"));
  CHECK(contains(message(tokenizer("", "[]", "[]", pre, R"(, "continuing_subword_prefix": "##")")),
                 "model.continuing_subword_prefix: got the string \"##\""));
  CHECK(contains(message(tokenizer("", "[]", "[]", pre, R"(, "dropout": 0.1)")), "model.dropout: got the number 0.1"));
  CHECK(contains(message(tokenizer("", "[]", R"([{"id": 256, "content": "<x>", "single_word": true}])")),
                 "added token \"<x>\": single_word: got true"));
  CHECK(contains(message(tokenizer(R"(, "ab": 257)", "[]")), "token ids: got no token with id 256"));
  CHECK(contains(message(tokenizer("", "[]", R"([{"id": 5, "content": "<x>"}])")),
                 "id 5: got \"<x>\"; is token \"\\u0005\" too: an id is one token"));
  CHECK(contains(message(tokenizer(R"(, "ab": 256)", R"(["a b c"])")),
                 "model.merges[0]: got \"a b c\"; expected two tokens with one space between them"));
  CHECK(contains(message(tokenizer(R"(, "ab": 256)", R"([["a"]])")), "model.merges[0]"));
  CHECK(contains(message(tokenizer(R"(, "ab": 256)", R"(["ab c"])")),
                 "merge 0 (\"ab\", \"c\"): got \"abc\"; is not a token: a merge makes a token"));
  CHECK(contains(message(tokenizer("", R"(["ab c"])")), "merge 0 (\"ab\", \"c\"): got \"ab\"; is not a token"));
  CHECK(contains(message(R"({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": )" + pre + "}"),
                 "token encoder: byte: got 0; has no token of its own"));
}

TEST_CASE("tokenizer.json WordPieces (BERT's normalizer and pre-tokenizer) encode as Hugging Face's tokenizers does") {
  const io::TokenizerJson uncased = io::read_tokenizer_json(data_dir + "/word_piece.json");
  const io::TokenizerJson cased = io::read_tokenizer_json(data_dir + "/word_piece_cased.json");
  REQUIRE(uncased.rules.word_piece);
  REQUIRE(cased.rules.word_piece);
  const io::WordPieceRules& u = *uncased.rules.word_piece;
  const io::WordPieceRules& c = *cased.rules.word_piece;
  CHECK((u.clean_text && u.chinese_chars && u.lowercase && u.strip_accents));  // strip_accents null: as lowercase
  CHECK((c.clean_text && c.chinese_chars && !c.lowercase && !c.strip_accents));
  CHECK(u.unknown == 1);
  CHECK(u.prefix == "##");
  CHECK(c.prefix == "@@");
  CHECK(u.max_chars == 100);
  CHECK(c.max_chars == 8);
  CHECK(uncased.decoder.size() == 492);  // the trainer stopped short of its 500
  CHECK(uncased.decoder.end_of_text() == 3);  // [SEP]
  CHECK(uncased.decoder.bytes(3) == " [SEP]");
  for (const std::string file : {"word_piece.json", "word_piece_cased.json"}) {
    CAPTURE(file);
    const io::TokenEncoder encoder = io::TokenEncoder::read(data_dir + "/" + file);
    std::size_t checked = 0, unknown = 0;
    for (const Example& e : expected_for(file)) {
      CAPTURE(e.text);
      CHECK(encoder.encode(e.text) == e.ids);
      checked += e.ids.size();
      unknown += static_cast<std::size_t>(std::count(e.ids.begin(), e.ids.end(), 1));
    }
    CHECK(checked > 550);
    CHECK(unknown < checked / 4);  // most words spelled, not [UNK]
  }
}

TEST_CASE("WordPiece: the longest piece first, unknown words whole, and BERT's normalizer a character at a time") {
  io::WordPieceRules rules;
  rules.vocab = {{"[UNK]", 0}, {"un", 1}, {"##aff", 2}, {"##able", 3}, {"unaff", 4}, {"a", 5}, {"##b", 6},
                 {"!", 7},     {"東", 8}, {"i", 9},     {"##\xcc\x87", 10} /* U+0307 */, {"ᄒ", 11}, {"##ᅡ", 12},
                 {"##ᆫ", 13},  {"cafe", 14}, {"café", 15}, {"σ", 16}, {"ς", 17}};
  rules.unknown = 0;
  rules.max_chars = 6;
  std::vector<std::string> tokens(18);
  const io::TokenDecoder decoder(tokens);
  const auto encoder = [&](bool clean, bool chinese, bool strip, bool lower) {
    io::TokenizerRules r;
    r.word_piece = rules;
    r.word_piece->clean_text = clean;
    r.word_piece->chinese_chars = chinese;
    r.word_piece->strip_accents = strip;
    r.word_piece->lowercase = lower;
    return io::TokenEncoder(decoder, r);
  };
  const io::TokenEncoder plain = encoder(false, false, false, false), bert = encoder(true, true, true, true);
  using Ids = std::vector<std::int32_t>;
  CHECK(plain.encode("unaffable") == Ids{0});  // 9 characters: more than max_chars, unknown whole
  CHECK(plain.encode("unaffa") == Ids{0});     // unaff, then nothing spells a: unknown whole
  CHECK(plain.encode("unaff") == Ids{4});       // the longest first: unaff, not un ##aff
  CHECK(plain.encode("abbb") == Ids{5, 6, 6, 6});
  CHECK(plain.encode("abx a") == Ids{0, 5});    // x spells nothing: the word is unknown whole
  CHECK(plain.encode("a!a") == Ids{5, 7, 5});   // punctuation is a word of its own
  CHECK(plain.encode(" a \t\n a ") == Ids{5, 5});
  CHECK(bert.encode("A東a") == Ids{5, 8, 5});   // CJK spaced out; lowercase
  CHECK(bert.encode("Café") == Ids{14});        // accents stripped (é is e + U+0301)
  CHECK(encoder(true, true, false, true).encode("Café") == Ids{15});
  CHECK(bert.encode("한") == Ids{11, 12, 13});  // a Hangul syllable decomposes: ᄒ ᅡ ᆫ
  CHECK(plain.encode("한") == Ids{0});
  CHECK(encoder(false, false, false, true).encode("İ") == Ids{9, 10});  // İ lowers to i + U+0307
  CHECK(bert.encode("İ") == Ids{9});            // stripped to I first, then lowered
  CHECK(bert.encode("ΣΣ") == Ids{0});           // a character at a time: σσ, no final sigma
  CHECK(bert.encode("Σ") == Ids{16});
  CHECK(bert.encode("a\x01\xef\xbf\xbd\xff a") == Ids{5, 5});  // control, U+FFFD and a bad byte dropped
  CHECK(plain.encode("a\x01") == Ids{0});
}

TEST_CASE("tokenizer.json WordPiece: what loom would encode otherwise is refused by name") {
  TempPath file("tokenizer_json");
  const auto message = [&](const std::string& normalizer, const std::string& pre, const std::string& model,
                           const std::string& added = "[]") {
    write_text(file.path, R"({"added_tokens": )" + added + R"(, "normalizer": )" + normalizer +
                              R"(, "pre_tokenizer": )" + pre + R"(, "model": {"type": "WordPiece")" + model + "}}");
    return error_of([&] { (void)io::TokenEncoder::read(file.path); });
  };
  const std::string bert = R"({"type": "BertNormalizer", "lowercase": true})", split = R"({"type": "BertPreTokenizer"})";
  const std::string model = R"(, "unk_token": "[UNK]", "vocab": {"[UNK]": 0, "a": 1})";
  CHECK(message(bert, split, model).empty());
  CHECK(contains(message(R"({"type": "Sequence", "normalizers": []})", split, model),
                 "normalizer: got Sequence; expected BertNormalizer or none"));
  CHECK(contains(message(bert, R"({"type": "Whitespace"})", model),
                 "pre_tokenizer: got Whitespace; expected BertPreTokenizer"));
  CHECK(contains(message(bert, split, R"(, "vocab": {"[UNK]": 0})"), "model.unk_token: got none"));
  CHECK(contains(message(bert, split, R"(, "unk_token": "<unk>", "vocab": {"[UNK]": 0})"),
                 "model.unk_token: got \"<unk>\"; must be a token of model.vocab"));
  CHECK(contains(message(bert, split, model + R"(, "max_input_chars_per_word": 0)"),
                 "model.max_input_chars_per_word: got 0; must be >= 1"));
  CHECK(contains(message(bert, split, model, R"([{"id": 0, "content": "[UNK]", "normalized": true}])"),
                 "added token \"[UNK]\": normalized: got true; expected false"));
  CHECK(message("null", split, model, R"([{"id": 0, "content": "[UNK]", "normalized": true}])").empty());
}

TEST_CASE("BERT vocab.txt files encode as tokenizers' BertWordPieceTokenizer does") {
  const std::string uncased = data_dir + "/vocab_txt/vocab.txt", cased = data_dir + "/vocab_txt_cased/vocab.txt";
  const auto check = [&](const io::TokenEncoder& encoder, const std::string& name) {
    CAPTURE(name);
    std::size_t checked = 0, unknown = 0;
    for (const Example& e : expected_for(name, "vocab_txt_expected.json")) {
      CAPTURE(e.text);
      CHECK(encoder.encode(e.text) == e.ids);
      checked += e.ids.size();
      unknown += static_cast<std::size_t>(std::count(e.ids.begin(), e.ids.end(), 1));
    }
    CHECK(checked > 700);
    CHECK(unknown < checked / 4);
  };
  check(io::TokenEncoder::read(uncased), "vocab_txt/vocab.txt");  // uncased: told by its vocabulary
  check(io::TokenEncoder::read(uncased, {.lowercase = false}), "vocab_txt/vocab.txt lowercase=false");
  check(io::TokenEncoder::read(cased), "vocab_txt_cased/vocab.txt");  // cased, no CJK spacing: its config

  // tokenizer_config.json beside the file says what the options leave unset.
  TempPath dir("vocab_txt");
  fs::create_directories(dir.path);
  fs::copy_file(uncased, dir.path / "vocab.txt");
  write_text(dir.path / "tokenizer_config.json", R"({"do_lower_case": false, "strip_accents": null, "model_max_length": 512})");
  check(io::TokenEncoder::read(dir.path / "vocab.txt"), "vocab_txt/vocab.txt lowercase=false");
  const io::WordPieceRules from_config = *io::read_vocab_txt(dir.path / "vocab.txt").rules.word_piece;
  CHECK((!from_config.lowercase && !from_config.strip_accents && from_config.chinese_chars && from_config.clean_text));
  const io::WordPieceRules given = *io::read_vocab_txt(cased, {.lowercase = true}).rules.word_piece;
  CHECK((given.lowercase && given.strip_accents && !given.chinese_chars));  // the rest from its config
  CHECK(given.prefix == "##");
  CHECK(given.max_chars == 100);

  // The decoder: a line an id, ## pieces joined to the word before them, [SEP] the end of text;
  // a repeated line's earlier id still decodes, and the later id is the one encoded.
  const io::TokenizerJson file = io::read_vocab_txt(uncased);
  const std::vector<std::string> lines = [&] {
    std::vector<std::string> out;
    std::ifstream in(uncased);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  }();
  REQUIRE(file.decoder.size() == static_cast<std::int64_t>(lines.size()));
  CHECK(file.decoder.end_of_text() == 3);
  CHECK(io::TokenDecoder::read(uncased).size() == file.decoder.size());
  const auto last = static_cast<std::int32_t>(lines.size() - 1);
  const auto first = static_cast<std::int32_t>(std::find(lines.begin(), lines.end(), lines.back()) - lines.begin());
  REQUIRE(first < last);
  CHECK(file.decoder.bytes(first) == " " + lines.back());
  CHECK(file.decoder.bytes(last) == " " + lines.back());
  CHECK(io::TokenEncoder::read(uncased).encode(lines.back()) == std::vector<std::int32_t>{last});
  CHECK(file.decoder.bytes(last - 1) == " weave");  // "weave \t": trailing white space trimmed
  CHECK(file.decoder.bytes(last - 2) == " ");        // an empty line is a token too
  const auto piece = std::find_if(lines.begin(), lines.end(), [](const std::string& t) { return t.starts_with("##"); });
  REQUIRE(piece != lines.end());
  CHECK(file.decoder.bytes(static_cast<std::int32_t>(piece - lines.begin())) == piece->substr(2));
  CHECK(file.decoder.decode(io::TokenEncoder::read(uncased).encode("The loom weaves.")) ==
        " the loom weaves .");
}

TEST_CASE("vocab.txt: lowercase inferred from the vocabulary, files told apart by content, bad files refused") {
  TempPath file("vocab_txt");
  fs::create_directories(file.path);
  const fs::path vocab = file.path / "vocab";  // no .txt: told apart by its content
  const auto rules = [&](const std::string& text) {
    write_text(vocab, text);
    return *io::read_tokenizer(vocab).rules->word_piece;
  };
  CHECK(rules("[PAD]\n[UNK]\n[unused0]\nhello\n##s\n").lowercase);  // bracketed tokens do not count
  CHECK(!rules("[UNK]\nhello\nHello\n").lowercase);
  CHECK(!rules("[UNK]\nhello\nHello\n").strip_accents);
  CHECK(rules("[UNK]\r\na\r\n").vocab.size() == 2);
  write_text(vocab, "[UNK]\r\na\r\n[SEP]");
  CHECK(io::TokenEncoder::read(vocab).encode("A [SEP]a") == std::vector<std::int32_t>{1, 2, 1});
  CHECK(io::TokenDecoder::read(vocab).end_of_text() == 2);

  const auto message = [&](const std::string& text, const io::VocabTxtOptions& options = {}) {
    write_text(vocab, text);
    return error_of([&] { (void)io::TokenEncoder::read(vocab, options); });
  };
  CHECK(contains(message("a\nb\n"), "[UNK]: got no such line; a WordPiece needs [UNK] for the words it cannot spell"));
  CHECK(contains(message("[UNK]\na\xff\n"), "line 2: got a byte that is not UTF-8; expected UTF-8 text"));
  CHECK(contains(message(""), "tokens: got 0; must be at least one"));
  CHECK(contains(message("{\"a\": 0, \"b\": 1}", {.lowercase = true}),
                 "set for a vocab.json; only a vocab.txt takes them"));
  CHECK(message("{\"a\": 0, \"b\": 1}").find("[UNK]") == std::string::npos);  // a vocab.json, not a vocab.txt
  CHECK(contains(error_of([&] { (void)io::TokenEncoder::read(data_dir + "/word_piece.json", {.lowercase = false}); }),
                 "set for a tokenizer.json; only a vocab.txt takes them"));
  write_text(file.path / "tokenizer_config.json", R"({"do_lower_case": "yes"})");
  CHECK(contains(message("[UNK]\n"), "tokenizer_config.json"));
  CHECK(contains(message("[UNK]\n"), ".do_lower_case: got the string \"yes\"; expected a JSON boolean"));
}

TEST_CASE("a vocab.json with its merges.txt encodes by the merges; a vocab.json alone whose ids are not ranks is refused") {
  const std::string pair = data_dir + "/vocab_merges/vocab.json";
  const io::TokenEncoder encoder = io::TokenEncoder::read(pair);
  std::size_t checked = 0;
  for (const Example& e : expected_for("roberta_like.json")) {  // the same vocabulary and merges
    CAPTURE(e.text);
    CHECK(encoder.encode(e.text) == e.ids);
    checked += e.ids.size();
  }
  CHECK(checked > 1000);
  CHECK(encoder.end_of_text() == 2);  // </s>
  const io::TokenizerFile file = io::read_tokenizer(pair);
  REQUIRE(file.rules);
  CHECK(file.rules->merges.size() == 339);  // the #version line skipped
  CHECK(file.rules->added.size() == 5);
  CHECK(file.decoder.end_of_text() == 2);

  // Alone, its ids (shuffled away from the merges) would rank otherwise: refused by name. The
  // decoder still reads it, and GPT-2-style vocabularies (ids in merge order) still encode.
  TempPath dir("vocab_merges");
  fs::create_directories(dir.path);
  fs::copy_file(pair, dir.path / "vocab.json");
  CHECK(contains(error_of([&] { (void)io::TokenEncoder::read(dir.path / "vocab.json"); }),
                 "is not two tokens of lower ids, so the ids are not merge ranks"));
  CHECK(io::TokenDecoder::read(dir.path / "vocab.json").end_of_text() == 2);
  CHECK(error_of([&] { (void)io::TokenEncoder::read(data_dir + "/vocab.json"); }).empty());
  CHECK(error_of([&] { (void)io::TokenEncoder::read(data_dir + "/bytes_vocab.json"); }).empty());

  const auto message = [&](const std::string& merges, const fs::path& read = {}) {
    write_text(dir.path / "merges.txt", merges);
    return error_of([&] { (void)io::TokenEncoder::read(read.empty() ? dir.path / "vocab.json" : read); });
  };
  CHECK(contains(message("#version: 0.2\nĠ t\nh e e\n"),
                 "merges.txt " + io::detail::quoted(dir.path / "merges.txt") +
                     ": line 3: got \"h e e\"; expected two tokens with one space between them"));
  CHECK(contains(message("Ġ t\n\n"), "line 2: got \"\"; expected two tokens"));
  CHECK(contains(message("Ġ t\r\nh e\r\n☃ e\n"), "line 3: token \"☃\" character"));  // CRLF read; ☃ is no byte
  CHECK(message("#version: 0.2\r\nĠ t\r\nh e\r\n").empty());
  CHECK(contains(message("#version: 0.2\n", dir.path / "merges.txt"),
                 "got a merges.txt (it starts with #version); expected the vocab.json beside it"));
}

TEST_CASE("encoding in parts on several threads gives encode's ids, for every kind of tokenizer") {
  // Lines of words, white space runs, CRLF, line ends after white space or before it, non-ASCII
  // line ends, added tokens (<mask> takes the white space before it) and stray bytes.
  std::mt19937 draw(20261128);
  const std::vector<std::string> parts = {"the", " loom", "Naïve", " 東京", "한국어", "  ", "\t", "\n", "\n", "\n\n",
                                          " \n", "\r\n", "'s", "!", "<mask>", " <mask>", "</s>", "[SEP]", "[MASK]",
                                          "\xe3\x80\x80", "\xff", "7", "é\n"};
  std::string text;
  while (text.size() < 60000) text += parts[draw() % parts.size()];
  for (const std::string file : {"vocab.json", "roberta_like.json", "prefix_space.json", "word_piece.json",
                                 "word_piece_cased.json", "vocab_txt/vocab.txt", "vocab_txt_cased/vocab.txt",
                                 "vocab_merges/vocab.json"}) {
    CAPTURE(file);
    const io::TokenEncoder encoder = io::TokenEncoder::read(data_dir + "/" + file);
    const std::vector<std::int32_t> whole = encoder.encode(text);
    for (const int threads : {1, 2, 3, 8}) {
      CAPTURE(threads);
      const std::vector<std::size_t> cuts = encoder.cut_points(text, threads);
      // prefix_space.json gives each stretch of text a space: it is never cut.
      CHECK(cuts.size() == (file == "prefix_space.json" || threads == 1 ? 2 : static_cast<std::size_t>(threads) + 1));
      for (std::size_t k = 1; k + 1 < cuts.size(); ++k) CHECK(text[cuts[k] - 1] == '\n');
      CHECK(encoder.encode(text, threads) == whole);
    }
  }
  // No line end: one part.
  const io::TokenEncoder bpe = io::TokenEncoder::read(data_dir + "/vocab.json");
  CHECK(bpe.cut_points(std::string(1000, 'a'), 4) == std::vector<std::size_t>{0, 1000});
  // A line end after white space, or before it, is not a cut: " \n" and "\n " pieces differ.
  CHECK(bpe.cut_points(std::string(500, 'a') + " \nb", 2).size() == 2);
  CHECK(bpe.cut_points(std::string(500, 'a') + "\n b", 2).size() == 2);
  CHECK(bpe.cut_points(std::string(500, 'a') + "\nb", 2) == std::vector<std::size_t>{0, 501, 502});
}

}  // namespace test_io_tokenizer_json
