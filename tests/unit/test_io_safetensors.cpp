// JSON parsing, and safetensors files: round trips, a reference file written by Python's
// safetensors library, other dtypes, and every malformed file the reader refuses.

#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loom/core/bf16.hpp"
#include "loom/io/json.hpp"
#include "loom/io/safetensors.hpp"
#include "support/error_of.hpp"
#include "support/temp_path.hpp"

namespace test_io_safetensors {

namespace {

namespace fs = std::filesystem;
using loom::io::Json;
using loom::io::SafetensorsEntry;
using loom::io::SafetensorsReader;
using loom::io::SafetensorsTensor;
using loom::test::contains;
using loom::test::error_of;
using loom::test::TempPath;
using Metadata = std::vector<std::pair<std::string, std::string>>;

const fs::path data_dir = fs::path(LOOM_TEST_DATA_DIR) / "safetensors";

//! The message of parsing `text`, which must fail.
std::string parse_error(std::string_view text) {
  return error_of([&] { Json::parse(text, "test.json"); });
}

//! The raw bytes of `values`.
template <class T>
std::string bytes_of(const std::vector<T>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

//! A header member: "name":{"dtype":..,"shape":..,"data_offsets":[begin,end]}.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  std::uint64_t begin, std::uint64_t end) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(end) + "]}";
}

//! Writes a safetensors file by hand: the length word (`length`, or the header's size), the
//! header text, then `data`.
void write_raw(const fs::path& path, std::string_view header, std::string_view data = {},
               std::optional<std::uint64_t> length = std::nullopt) {
  const std::uint64_t n = length.value_or(header.size());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
}

//! The message of opening a hand-built file ("" if it opens).
std::string open_error(std::string_view header, std::string_view data = {},
                       std::optional<std::uint64_t> length = std::nullopt) {
  const TempPath file("st_bad");
  write_raw(file.path, header, data, length);
  const std::string message = error_of([&] { SafetensorsReader reader(file.path); });
  if (!message.empty()) CHECK(contains(message, "safetensors file '" + file.str() + "'"));
  return message;
}

std::string file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// JSON

TEST_CASE("json: every kind of value, members in text order") {
  const Json json = Json::parse(
      " {\"n\": null, \"t\": true, \"f\": false, \"i\": -42, \"x\": 1.5e2, \"s\": \"hi\",\n"
      "  \"a\": [1, [2, []], {}], \"o\": {\"k\": \"v\"}} \r\n\t",
      "test.json");
  REQUIRE(json.kind() == Json::Kind::object);
  const auto& members = json.object("root");
  REQUIRE(members.size() == 8);
  const char* keys[] = {"n", "t", "f", "i", "x", "s", "a", "o"};
  for (std::size_t i = 0; i < members.size(); ++i) CHECK(members[i].first == keys[i]);

  CHECK(json.find("n")->kind() == Json::Kind::null);
  CHECK(json.find("t")->boolean("t") == true);
  CHECK(json.find("f")->boolean("f") == false);
  CHECK(json.find("i")->integer("i") == -42);
  CHECK(json.find("i")->number("i") == -42.0);
  CHECK(json.find("x")->number("x") == 150.0);
  CHECK(json.find("s")->string("s") == "hi");
  const auto& a = json.find("a")->array("a");
  REQUIRE(a.size() == 3);
  CHECK(a[0].integer("a[0]") == 1);
  CHECK(a[1].array("a[1]")[1].array("a[1][1]").empty());
  CHECK(a[2].object("a[2]").empty());
  CHECK(json.find("o")->find("k")->string("o.k") == "v");

  CHECK(json.find("missing") == nullptr);
  CHECK(json.find("s")->find("s") == nullptr);  // not an object
  CHECK(Json().kind() == Json::Kind::null);

  // Any value may be the whole text.
  CHECK(Json::parse("  7 ", "t").integer("t") == 7);
  CHECK(Json::parse("\"x\"", "t").string("t") == "x");
  CHECK(Json::parse("null", "t").kind() == Json::Kind::null);
  CHECK(Json::parse("-0.25E-2", "t").number("t") == -0.0025);
}

TEST_CASE("json: escapes, \\u escapes with surrogate pairs, UTF-8 as it is") {
  const Json s = Json::parse(R"("\"\\\/\b\f\n\r\t|\u0041\u00e9\u20AC\ud83d\ude00|\u0000|)"
                             "caf\xc3\xa9 \xf0\x9f\x98\x80\"",
                             "t");
  const std::string expected = "\"\\/\b\f\n\r\t|A\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80|" +
                               std::string(1, '\0') + "|caf\xc3\xa9 \xf0\x9f\x98\x80";
  CHECK(s.string("t") == expected);
  // Keys are decoded too.
  CHECK(Json::parse(R"({"\u0061b": 1})", "t").find("ab") != nullptr);
}

TEST_CASE("json: integers are exact in int64; other numbers are not integers") {
  CHECK(Json::parse("9223372036854775807", "t").integer("t") ==
        std::numeric_limits<std::int64_t>::max());
  CHECK(Json::parse("-9223372036854775808", "t").integer("t") ==
        std::numeric_limits<std::int64_t>::min());
  // 2^53 + 1: a double would read 2^53.
  CHECK(Json::parse("9007199254740993", "t").integer("t") == 9007199254740993);
  CHECK(Json::parse("-0", "t").integer("t") == 0);

  const std::string too_big =
      error_of([] { Json::parse("9223372036854775808", "n").integer("n"); });
  CHECK(contains(too_big, "n: got the number 9223372036854775808; expected an integer"));
  CHECK(Json::parse("9223372036854775808", "n").number("n") == 9223372036854775808.0);
  CHECK(contains(error_of([] { Json::parse("-9223372036854775809", "n").integer("n"); }),
                 "expected an integer"));

  const std::string fraction = error_of([] { Json::parse("1.5", "shape[0]").integer("shape[0]"); });
  CHECK(fraction ==
        "loom: shape[0]: got the number 1.5; expected an integer (no fraction or exponent) in "
        "[-9223372036854775808, 9223372036854775807]");
  // As in serde and Python's json, a fraction or exponent makes a number a float.
  CHECK(contains(error_of([] { Json::parse("2.0", "n").integer("n"); }), "expected an integer"));
  CHECK(contains(error_of([] { Json::parse("1e3", "n").integer("n"); }), "expected an integer"));
  CHECK(Json::parse("1e3", "n").number("n") == 1000.0);
}

TEST_CASE("json: typed access names what was read, the value found and the kind expected") {
  const Json json = Json::parse(R"({"s": "x", "a": [1, 2], "o": {"k": 1}})", "t");
  CHECK(error_of([&] { json.find("s")->number("config: n_embd"); }) ==
        "loom: config: n_embd: got the string \"x\"; expected a JSON number");
  CHECK(error_of([&] { json.find("a")->object("a"); }) ==
        "loom: a: got an array of 2 values; expected a JSON object");
  CHECK(error_of([&] { json.find("o")->array("o"); }) ==
        "loom: o: got an object of 1 member; expected a JSON array");
  CHECK(error_of([&] { json.string("root"); }) ==
        "loom: root: got an object of 3 members; expected a JSON string");
  CHECK(error_of([] { Json().boolean("flag"); }) ==
        "loom: flag: got null; expected a JSON boolean");
  CHECK(error_of([] { Json::parse("true", "t").integer("i"); }) ==
        "loom: i: got true; expected a JSON number");
  const std::string long_string =
      error_of([] { Json::parse("\"" + std::string(100, 'z') + "\"", "t").integer("i"); });
  CHECK(contains(long_string, "... (64 of its 100 bytes)"));
  const std::string cut = error_of([] {  // never inside a UTF-8 sequence: é is bytes 63 and 64
    Json::parse("\"" + std::string(63, 'z') + "\xc3\xa9zz\"", "t").integer("i");
  });
  CHECK(contains(cut, "zz\"... (63 of its 67 bytes)"));
}

TEST_CASE("json: malformed text is refused, naming the byte offset and what was expected") {
  struct Case {
    std::string text;
    std::string message;  // a part of the message
  };
  const std::vector<Case> cases{
      {"", "test.json: JSON at byte 0: got the end of the text; expected a JSON value"},
      {"   ", "JSON at byte 3: got the end of the text; expected a JSON value"},
      {"[1,]", "JSON at byte 3: got ']'; expected a JSON value"},
      {"[1 2]", "JSON at byte 3: got '2'; expected ',' or ']' after an array element"},
      {"[1", "JSON at byte 2: got the end of the text; expected ',' or ']'"},
      {"{\"a\" 1}", "JSON at byte 5: got '1'; expected ':' after an object key"},
      {"{\"a\":1,}", "JSON at byte 7: got '}'; expected '\"' to start an object key"},
      {"{a:1}", "JSON at byte 1: got 'a'; expected '\"' to start an object key"},
      {"{\"a\":1 \"b\":2}", "JSON at byte 7: got '\"'; expected ',' or '}' after an object member"},
      {"01", "JSON at byte 0: got a number with a leading zero"},
      {"-", "JSON at byte 1: got the end of the text; expected a digit in a number"},
      {"-a", "JSON at byte 1: got 'a'; expected a digit in a number"},
      {"+1", "JSON at byte 0: got '+'; expected a JSON value"},
      {".5", "JSON at byte 0: got '.'"},
      {"1.", "JSON at byte 2: got the end of the text; expected a digit after the decimal point"},
      {"1.e5", "JSON at byte 2: got 'e'; expected a digit after the decimal point"},
      {"1e", "JSON at byte 2: got the end of the text; expected a digit in the exponent"},
      {"1e+", "JSON at byte 3"},
      {"1e400", "JSON at byte 0: got the number 1e400; expected a number that double can hold"},
      {"NaN", "JSON at byte 0: got 'N'; expected a JSON value"},
      {"tru", "JSON at byte 0: got 't'; expected a JSON value (did you mean true?)"},
      {"nul", "(did you mean null?)"},
      {"True", "JSON at byte 0: got 'T'"},
      {"\"abc",
       "JSON at byte 4: got the end of the text; expected a '\"' to close the string "
       "at byte 0"},
      {"\"a\tb\"",
       "JSON at byte 2: got byte 0x09; expected a string character: control "
       "characters must be escaped"},
      {"\"a\nb\"", "JSON at byte 2: got byte 0x0a"},
      {"\"\\x\"", "JSON at byte 2: got 'x'; expected an escape"},
      {"\"\\", "JSON at byte 2: got the end of the text; expected an escape character"},
      {"\"\\u12G4\"", "JSON at byte 5: got 'G'; expected a hexadecimal digit in a \\u escape"},
      {"\"\\udc00\"",
       "JSON at byte 1: got the low surrogate \\udc00; a low surrogate may only "
       "follow a high surrogate"},
      {"\"\\ud800\"",
       "JSON at byte 1: got the high surrogate \\ud800; expected a low surrogate "
       "escape (\\udc00-\\udfff) right after it"},
      {"\"\\ud800\\u0041\"",
       "JSON at byte 7: got \\u0041; expected a low surrogate "
       "(\\udc00-\\udfff) after the high surrogate at byte 1"},
      {"\"\xff\"", "JSON at byte 1: got byte 0xff; expected well-formed UTF-8"},
      {"\"\xc0\xaf\"", "JSON at byte 1: got byte 0xc0; expected well-formed UTF-8"},  // overlong
      {"\"\xed\xa0\x80\"", "JSON at byte 1: got byte 0xed"},      // an encoded surrogate
      {"\"\xf4\x90\x80\x80\"", "JSON at byte 1: got byte 0xf4"},  // above U+10FFFF
      {"\"\xe2\x82\"", "JSON at byte 1: got byte 0xe2"},          // cut short
      {"\"\x80\"", "JSON at byte 1: got byte 0x80"},              // a stray continuation byte
      {"{\"a\":1,\"b\":2,\"a\":3}",
       "JSON at byte 13: got the key \"a\" again; object keys must "
       "be unique (it is first at byte 1)"},
      {"[1] x", "JSON at byte 4: got 'x'; expected the end of the text after the JSON value"},
      {"{} {}", "JSON at byte 3: got '{'"},
      {"// c\n1", "JSON at byte 0: got '/'"},
      {"\xef\xbb\xbf{}", "JSON at byte 0: got byte 0xef"},  // a byte order mark
  };
  for (const Case& c : cases) {
    CAPTURE(c.text);
    const std::string message = parse_error(c.text);
    CHECK(contains(message, c.message));
    CHECK(message.rfind("loom: test.json: JSON at byte ", 0) == 0);
  }
  // The text passed as a string_view may hold a NUL that is not its end.
  CHECK(contains(parse_error(std::string_view("[1]\0", 4)), "JSON at byte 3: got byte 0x00"));
}

TEST_CASE("json: nesting deeper than 256 is refused, without exhausting the stack") {
  const auto nested = [](int depth) {
    return std::string(static_cast<std::size_t>(depth), '[') +
           std::string(static_cast<std::size_t>(depth), ']');
  };
  CHECK(Json::parse(nested(256), "t").kind() == Json::Kind::array);
  CHECK(parse_error(nested(257)) ==
        "loom: test.json: JSON at byte 256: got an array or object nested 257 deep; at most 256 "
        "nested arrays and objects");
  CHECK(contains(parse_error(nested(1'000'000)), "at most 256 nested"));
  std::string objects;
  for (int i = 0; i < 257; ++i) objects += "{\"k\":";
  CHECK(contains(parse_error(objects), "JSON at byte 1280: got an array or object nested 257"));
}

TEST_CASE("json: json_quote escapes what JSON requires, and parses back") {
  CHECK(loom::io::json_quote("a\"b\\c") == R"("a\"b\\c")");
  CHECK(loom::io::json_quote("\n\t\x01\x1f/\x7f") == "\"\\n\\t\\u0001\\u001f/\x7f\"");
  CHECK(loom::io::json_quote("") == "\"\"");
  std::string all;
  for (int c = 0; c < 128; ++c) all += static_cast<char>(c);
  all += "caf\xc3\xa9 \xf0\x9f\x98\x80";
  CHECK(Json::parse(loom::io::json_quote(all), "t").string("t") == all);
}

// ---------------------------------------------------------------------------------------------
// safetensors

TEST_CASE("safetensors: save then read is bit-exact, with scalars, empty tensors and metadata") {
  const std::vector<float> w{1.0f,
                             -0.0f,
                             3.5f,
                             std::numeric_limits<float>::infinity(),
                             std::numeric_limits<float>::denorm_min(),
                             -1e30f};
  const std::vector<float> scalar{42.25f};
  const std::vector<float> none;
  std::vector<float> large(70'000);
  for (std::size_t i = 0; i < large.size(); ++i) large[i] = static_cast<float>(i) * 0.5f - 7.0f;
  const std::vector<SafetensorsTensor> tensors{
      {"h.0.attn.weight", {2, 3}, w},
      {"scalar", {}, scalar},
      {"empty", {0, 4}, none},
      {"large", {700, 100}, large},
  };
  const Metadata metadata{{"format", "pt"}, {"note", "caf\xc3\xa9 \"quoted\"\n"}};
  const TempPath file("st_roundtrip");
  loom::io::save_safetensors(file.path, tensors, metadata);
  CHECK_FALSE(fs::exists(file.str() + ".tmp"));

  // The header is padded with spaces so that the data starts at a multiple of 8.
  const std::string raw = file_bytes(file.path);
  std::uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, raw.data(), 8);
  CHECK(header_bytes % 8 == 0);
  CHECK(raw.size() == 8 + header_bytes + (6 + 1 + 0 + 70'000) * 4);
  CHECK(raw[8] == '{');

  const SafetensorsReader reader(file.path);
  CHECK(reader.path() == file.path);
  CHECK(reader.metadata() == metadata);
  const auto& entries = reader.entries();
  REQUIRE(entries.size() == 4);
  std::uint64_t offset = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    CAPTURE(i);
    CHECK(entries[i].name == tensors[i].name);
    CHECK(entries[i].dtype == "F32");
    CHECK(entries[i].shape == tensors[i].shape);
    CHECK(entries[i].begin == offset);
    CHECK(entries[i].end == offset + tensors[i].values.size() * 4);
    CHECK(entries[i].numel() == static_cast<std::int64_t>(tensors[i].values.size()));
    offset = entries[i].end;
    CHECK(reader.find(tensors[i].name) == &entries[i]);
  }
  CHECK(entries[1].numel() == 1);  // a scalar: shape []
  CHECK(reader.find("absent") == nullptr);
  CHECK(reader.find("h.0.attn") == nullptr);

  CHECK(same_bits(reader.read("h.0.attn.weight"), w));
  CHECK(same_bits(reader.read("scalar"), scalar));
  CHECK(reader.read("empty").empty());
  CHECK(same_bits(reader.read("large"), large));
  std::vector<float> out(6, 99.0f);
  reader.read(*reader.find("h.0.attn.weight"), out.data());
  CHECK(same_bits(out, w));
}

TEST_CASE("safetensors: no tensors, no metadata") {
  const TempPath file("st_nothing");
  loom::io::save_safetensors(file.path, {});
  CHECK(file_bytes(file.path) == std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  const SafetensorsReader reader(file.path);
  CHECK(reader.entries().empty());
  CHECK(reader.metadata().empty());
}

TEST_CASE("safetensors: the reference file written by Python's safetensors reads back") {
  // tests/data/safetensors/make_reference.py wrote it with safetensors.numpy.save_file.
  const SafetensorsReader reader(data_dir / "reference.safetensors");
  // Rust's HashMap orders the metadata differently each run: compare it sorted.
  Metadata metadata = reader.metadata();
  std::sort(metadata.begin(), metadata.end());
  CHECK(metadata == Metadata{{"format", "np"},
                             {"note", "na\xc3\xafve \xe2\x9c\x93"},
                             {"source", "make_reference.py"}});
  std::vector<std::string> names;
  for (const SafetensorsEntry& e : reader.entries()) names.push_back(e.name);
  CHECK(names == std::vector<std::string>{"position_ids", "f64", "empty", "f32", "scalar", "bf16",
                                          "f16"});  // by offset, as the library laid them out

  const SafetensorsEntry& f32 = *reader.find("f32");
  CHECK(f32.dtype == "F32");
  CHECK(f32.shape == std::vector<std::int64_t>{3, 4});
  std::vector<float> expected;
  for (int k = 0; k < 12; ++k) expected.push_back(static_cast<float>(k) / 4 - 1);
  CHECK(same_bits(reader.read("f32"), expected));

  CHECK(reader.find("f16")->dtype == "F16");
  CHECK(reader.find("f16")->shape == std::vector<std::int64_t>{2, 4});
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(same_bits(reader.read("f16"),
                  {0.333251953125f, -2.5f, 65504.0f, 0x1p-24f, -0x1p-14f, 0.0f, -0.0f, inf}));

  CHECK(reader.find("bf16")->dtype == "BF16");
  CHECK(same_bits(reader.read("bf16"), {-1.5f, -1.125f, -0.75f, -0.375f, 0.0f, 0.375f, 0.75f,
                                        static_cast<float>(loom::bf16::from_bits(0x3eab))}));
  CHECK(reader.read("bf16")[7] == 0.333984375f);

  CHECK(reader.find("f64")->dtype == "F64");
  std::vector<float> thirds;
  for (int k = 0; k < 5; ++k) thirds.push_back(static_cast<float>(k / 3.0));
  CHECK(same_bits(reader.read("f64"), thirds));

  CHECK(same_bits(reader.read("scalar"), {3.25f}));
  CHECK(reader.find("scalar")->shape.empty());
  CHECK(reader.find("empty")->shape == std::vector<std::int64_t>{0, 3});
  CHECK(reader.read("empty").empty());

  const SafetensorsEntry& ids = *reader.find("position_ids");
  CHECK(ids.dtype == "I64");
  CHECK(ids.shape == std::vector<std::int64_t>{1, 8});
  CHECK(ids.end - ids.begin == 64);
  CHECK(contains(error_of([&] { reader.read("position_ids"); }),
                 "tensor \"position_ids\": dtype: got I64; read converts F32, BF16, F16 and F64 "
                 "to float only"));
}

TEST_CASE("safetensors: BF16, F16 and F64 widen or round to float; other dtypes still open") {
  std::vector<std::uint16_t> bf16_bits{0x3f80, 0xc020, 0x7f80, 0x0001, 0x3eab};
  std::vector<std::uint16_t> f16_bits{0x3c00, 0xc100, 0x7bff, 0x0001,
                                      0x03ff, 0x8400, 0xfc00, 0x7e00};
  for (std::uint16_t k = 0; k < 40'000; ++k) f16_bits.push_back(static_cast<std::uint16_t>(k));
  const std::vector<double> f64{0.1, -1e300, 1e-50, 16777217.0};
  const std::vector<std::int64_t> i64{1, -2};
  const std::vector<std::uint8_t> u8{7, 8, 9};
  const std::string data =
      bytes_of(i64) + bytes_of(bf16_bits) + bytes_of(f16_bits) + bytes_of(f64) + bytes_of(u8);
  std::uint64_t at = 0;
  const auto next = [&](std::uint64_t bytes) {
    const std::uint64_t begin = at;
    at += bytes;
    return std::pair{begin, at};
  };
  const auto [i_begin, i_end] = next(16);
  const auto [b_begin, b_end] = next(10);
  const auto [h_begin, h_end] = next(f16_bits.size() * 2);
  const auto [d_begin, d_end] = next(32);
  const auto [u_begin, u_end] = next(3);
  const std::string header =
      "{" + entry("ids", "I64", "[2]", i_begin, i_end) + "," +
      entry("b", "BF16", "[5]", b_begin, b_end) + "," +
      entry("h", "F16", "[" + std::to_string(f16_bits.size()) + "]", h_begin, h_end) + "," +
      entry("d", "F64", "[2,2]", d_begin, d_end) + "," + entry("u", "U8", "[3]", u_begin, u_end) +
      "}";
  const TempPath file("st_dtypes");
  write_raw(file.path, header, data);
  const SafetensorsReader reader(file.path);
  REQUIRE(reader.entries().size() == 5);

  const float inf = std::numeric_limits<float>::infinity();
  CHECK(same_bits(reader.read("b"),
                  {1.0f, -2.5f, inf, std::bit_cast<float>(0x00010000u), 0.333984375f}));
  const std::vector<float> h = reader.read("h");
  CHECK(h[0] == 1.0f);
  CHECK(h[1] == -2.5f);
  CHECK(h[2] == 65504.0f);
  CHECK(h[3] == 0x1p-24f);         // smallest subnormal
  CHECK(h[4] == 1023 * 0x1p-24f);  // largest subnormal
  CHECK(h[5] == -0x1p-14f);        // smallest normal
  CHECK(h[6] == -inf);
  CHECK(std::isnan(h[7]));
  // Every finite half below 0x9c40 against the formula (-1)^s 2^(e-15) (1 + m/1024).
  for (std::size_t k = 0; k < 40'000; ++k) {
    const auto bits = static_cast<unsigned>(k);
    const int e = static_cast<int>((bits >> 10) & 31);
    const double m = bits & 1023;
    if (e == 31) continue;
    const double magnitude = e == 0 ? std::ldexp(m, -24) : std::ldexp(1 + m / 1024, e - 15);
    const double value = (bits & 0x8000) ? -magnitude : magnitude;
    if (h[8 + k] != static_cast<float>(value) ||
        std::signbit(h[8 + k]) != static_cast<bool>(bits & 0x8000)) {
      FAIL_CHECK("half 0x" << std::hex << bits << " read as " << h[8 + k]);
      break;
    }
  }
  CHECK(same_bits(reader.read("d"), {0.1f, -inf, 0.0f, 16777216.0f}));  // rounded to nearest
  CHECK(contains(error_of([&] { reader.read("u"); }), "tensor \"u\": dtype: got U8"));
}

TEST_CASE("safetensors: a file with one tensor of every dtype of the format opens") {
  const std::vector<std::pair<std::string, int>> dtypes{
      {"BOOL", 1},    {"U8", 1},          {"I8", 1},          {"F8_E5M2", 1}, {"F8_E4M3", 1},
      {"F8_E8M0", 1}, {"F8_E4M3FNUZ", 1}, {"F8_E5M2FNUZ", 1}, {"I16", 2},     {"U16", 2},
      {"F16", 2},     {"BF16", 2},        {"I32", 4},         {"U32", 4},     {"F32", 4},
      {"C64", 8},     {"F64", 8},         {"I64", 8},         {"U64", 8}};
  std::string header = "{";
  std::uint64_t at = 0;
  for (const auto& [dtype, bytes] : dtypes) {
    header +=
        entry("t_" + dtype, dtype, "[3]", at, at + 3 * static_cast<std::uint64_t>(bytes)) + ",";
    at += 3 * static_cast<std::uint64_t>(bytes);
  }
  header += entry("t_F4", "F4", "[2, 3]", at, at + 3) + ",";             // 4 bits each
  header += entry("t_F6_E2M3", "F6_E2M3", "[4]", at + 3, at + 6) + ",";  // 6 bits each
  header += entry("t_F6_E3M2", "F6_E3M2", "[4]", at + 6, at + 9) + "}";
  const TempPath file("st_all_dtypes");
  write_raw(file.path, header, std::string(at + 9, '\x01'));
  const SafetensorsReader reader(file.path);
  CHECK(reader.entries().size() == dtypes.size() + 3);
  CHECK(reader.find("t_F4")->numel() == 6);

  CHECK(contains(open_error("{" + entry("a", "F4", "[3]", 0, 2) + "}", "xx"),
                 "tensor \"a\": shape: got [3]; the elements of shape [3] of F4 (4 bits an "
                 "element) must fill whole bytes"));
}

TEST_CASE("safetensors: read refuses absent tensors, entries of other files, changed files") {
  const std::vector<float> v{1, 2, 3, 4};
  const std::vector<SafetensorsTensor> tensors{{"a", {4}, v}, {"b", {2, 2}, v}};
  const TempPath file("st_read");
  loom::io::save_safetensors(file.path, tensors);
  const SafetensorsReader reader(file.path);

  const std::string absent = error_of([&] { reader.read("c"); });
  CHECK(absent == "loom: safetensors file '" + file.str() +
                      "': tensor: got \"c\"; the file has no tensor of this name (it has 2: \"a\", "
                      "\"b\")");

  SafetensorsEntry forged = *reader.find("a");
  forged.end += 4;
  std::vector<float> out(8);
  CHECK(contains(error_of([&] { reader.read(forged, out.data()); }),
                 "tensor \"a\": got F32 [4] at [0, 20]; is not an entry of this file"));

  const auto size = fs::file_size(file.path);
  { std::ofstream(file.path, std::ios::binary | std::ios::app) << 'x'; }
  CHECK(contains(error_of([&] { reader.read("a"); }), "': size: got " + std::to_string(size + 1) +
                                                          " bytes; it was " + std::to_string(size) +
                                                          " bytes when its header was read"));
}

TEST_CASE("safetensors: save refuses bad tensors before touching the file") {
  const std::vector<float> v{1, 2, 3, 4, 5, 6};
  const TempPath file("st_save_bad");
  loom::io::save_safetensors(file.path, std::vector<SafetensorsTensor>{{"kept", {6}, v}});
  const std::string before = file_bytes(file.path);
  const std::string name = "safetensors file '" + file.str() + "'";

  struct Case {
    std::string label;
    std::vector<SafetensorsTensor> tensors;
    Metadata metadata;
    std::string message;
  };
  const std::vector<Case> cases{
      {"empty name", {{"", {6}, v}}, {}, name + ": tensor name: got \"\"; names must not be empty"},
      {"reserved name",
       {{"__metadata__", {6}, v}},
       {},
       name +
           ": tensor name: got \"__metadata__\"; the name is reserved for the header's metadata"},
      {"duplicate",
       {{"a", {6}, v}, {"b", {6}, v}, {"a", {2, 3}, v}},
       {},
       name + ": tensor name: got \"a\"; appears twice; names must be unique"},
      {"count",
       {{"a", {2, 2}, v}},
       {},
       name + ": tensor \"a\": values: got 6; shape [2, 2] holds 4 values"},
      {"negative dimension",
       {{"a", {-2, -3}, v}},
       {},
       name + ": tensor \"a\": shape[0]: got -2; dimensions must be >= 0"},
      {"overflow",
       {{"a", {1LL << 62, 4}, v}},
       {},
       name + ": tensor \"a\": shape: got [4611686018427387904, 4]; the element count (the "
              "product of the dimensions) overflows int64"},
      {"name not UTF-8",
       {{"caf\xe9", {6}, v}},
       {},
       name + ": tensor name: got \"caf\xe9\"; must be UTF-8 (JSON text is); byte 3 is not"},
      {"metadata key twice",
       {{"a", {6}, v}},
       {{"k", "1"}, {"k", "2"}},
       name + ": metadata key: got \"k\"; appears twice; names must be unique"},
      {"metadata value not UTF-8",
       {{"a", {6}, v}},
       {{"k", "\xff"}},
       name + ": metadata value of \"k\": got \"\xff\"; must be UTF-8 (JSON text is); byte 0 is "
              "not"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.label);
    CHECK(error_of([&] { loom::io::save_safetensors(file.path, c.tensors, c.metadata); }) ==
          "loom: " + c.message);
    CHECK(file_bytes(file.path) == before);
    CHECK_FALSE(fs::exists(file.str() + ".tmp"));
  }

  // A failed write (the destination is a directory) leaves nothing behind either.
  const TempPath dir("st_save_dir");
  fs::create_directories(dir.path);
  CHECK(contains(
      error_of([&] {
        loom::io::save_safetensors(dir.path, std::vector<SafetensorsTensor>{{"a", {6}, v}});
      }),
      "cannot move"));
  CHECK_FALSE(fs::exists(dir.str() + ".tmp"));
}

TEST_CASE("safetensors: the length word and the header are checked") {
  const TempPath file("st_short");
  {
    std::ofstream out(file.path, std::ios::binary);
    out << "abcde";
  }
  CHECK(error_of([&] { SafetensorsReader r(file.path); }) ==
        "loom: safetensors file '" + file.str() +
            "': size: got 5 bytes; too short for the 8-byte header length that safetensors files "
            "start with");
  CHECK(contains(error_of([] { SafetensorsReader r("/nonexistent/model.safetensors"); }),
                 "safetensors file: cannot open '/nonexistent/model.safetensors'"));

  CHECK(contains(open_error("{}", "", 100'000'001),
                 "': header length: got 100000001; the format allows at most 100000000 bytes"));
  CHECK(contains(open_error("{}      ", "", 20),
                 "': header length: got 20; the file has only 8 bytes after the length word"));
  CHECK(contains(open_error("{\"a\":", ""), "': header: JSON at byte 5: got the end of the text"));
  CHECK(contains(open_error(std::string_view("{}\0\0\0\0\0\0", 8)),
                 "': header: JSON at byte 2: got byte 0x00"));
  CHECK(contains(open_error("[]      "),
                 "': header: got an array of 0 values; expected a JSON object"));
  CHECK(contains(open_error(""), "': header: JSON at byte 0: got the end of the text"));
  CHECK(open_error("  {}  \n ").empty());  // whitespace around the object is fine
  const std::string twice =
      "{" + entry("a", "F32", "[1]", 0, 4) + "," + entry("a", "F32", "[1]", 4, 8) + "}";
  CHECK(contains(open_error(twice, std::string(8, '\0')), "got the key \"a\" again"));
}

TEST_CASE("safetensors: malformed entries are refused, naming the tensor, the value and the rule") {
  const std::string data(24, '\0');
  struct Case {
    std::string label;
    std::string entries;  // header members
    std::string message;
  };
  const std::vector<Case> cases{
      {"entry not an object", "\"a\":[1]",
       "tensor \"a\": got an array of 1 value; expected a JSON object"},
      {"no dtype", "\"a\":{\"shape\":[6],\"data_offsets\":[0,24]}",
       "tensor \"a\": got an object of 2 members without \"dtype\"; each tensor needs \"dtype\", "
       "\"shape\" and \"data_offsets\""},
      {"no shape", "\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,24]}", "without \"shape\""},
      {"no data_offsets", "\"a\":{\"dtype\":\"F32\",\"shape\":[6]}", "without \"data_offsets\""},
      {"dtype not a string", "\"a\":{\"dtype\":4,\"shape\":[6],\"data_offsets\":[0,24]}",
       "tensor \"a\": dtype: got the number 4; expected a JSON string"},
      {"unknown dtype", "\"a\":{\"dtype\":\"F128\",\"shape\":[6],\"data_offsets\":[0,24]}",
       "tensor \"a\": dtype: got \"F128\"; not a safetensors dtype (they are BOOL F4 F6_E2M3"},
      {"dtype in lower case", "\"a\":{\"dtype\":\"f32\",\"shape\":[6],\"data_offsets\":[0,24]}",
       "dtype: got \"f32\"; not a safetensors dtype"},
      {"shape not an array", "\"a\":{\"dtype\":\"F32\",\"shape\":6,\"data_offsets\":[0,24]}",
       "tensor \"a\": shape: got the number 6; expected a JSON array"},
      {"fractional dimension",
       "\"a\":{\"dtype\":\"F32\",\"shape\":[1.5,4],\"data_offsets\":[0,24]}",
       "tensor \"a\": shape[0]: got the number 1.5; expected an integer"},
      {"dimension as a string",
       "\"a\":{\"dtype\":\"F32\",\"shape\":[2,\"3\"],\"data_offsets\":[0,24]}",
       "tensor \"a\": shape[1]: got the string \"3\"; expected a JSON number"},
      {"negative dimension", "\"a\":{\"dtype\":\"F32\",\"shape\":[2,-3],\"data_offsets\":[0,24]}",
       "tensor \"a\": shape[1]: got -3; dimensions must be >= 0"},
      {"element count overflows",
       "\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,24]}",
       "tensor \"a\": shape: got [4294967296, 4294967296]; the element count (the product of the "
       "dimensions) overflows int64"},
      {"byte size overflows",
       "\"a\":{\"dtype\":\"F64\",\"shape\":[4611686018427387904],\"data_offsets\":[0,24]}",
       "tensor \"a\": shape: got [4611686018427387904]; the byte size of shape "
       "[4611686018427387904] of F64 (64 bits an element) overflows uint64"},
      {"data_offsets not a pair", "\"a\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0]}",
       "tensor \"a\": data_offsets: got an array of 1 value; expected [begin, end]"},
      {"offset as a string", "\"a\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[\"0\",24]}",
       "tensor \"a\": data_offsets[0]: got the string \"0\"; expected a JSON number"},
      {"negative offset", "\"a\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0,-24]}",
       "tensor \"a\": data_offsets[1]: got -24; byte offsets must be >= 0"},
      {"end before begin", "\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[24,0]}",
       "tensor \"a\": data_offsets: got [24, 0]; end must be >= begin"},
      {"size disagrees with the shape",
       "\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}",
       "tensor \"a\": data_offsets: got [0, 20] (20 bytes); expected 24 bytes for shape [2, 3] of "
       "F32 (32 bits an element)"},
      {"size disagrees with the dtype",
       "\"a\":{\"dtype\":\"F16\",\"shape\":[6],\"data_offsets\":[0,24]}",
       "expected 12 bytes for shape [6] of F16 (16 bits an element)"},
      {"overlap", entry("a", "F32", "[4]", 0, 16) + "," + entry("b", "F32", "[4]", 8, 24),
       "tensor \"b\": data_offsets: got [8, 24]; overlaps tensor \"a\" at [0, 16]; tensors must "
       "not share bytes"},
      {"same bytes twice", entry("a", "F32", "[6]", 0, 24) + "," + entry("b", "I32", "[6]", 0, 24),
       "tensor \"b\": data_offsets: got [0, 24]; overlaps tensor \"a\" at [0, 24]"},
      {"hole", entry("a", "F32", "[2]", 0, 8) + "," + entry("b", "F32", "[3]", 12, 24),
       "tensor \"b\": data_offsets: got [12, 24]; leaves bytes [8, 12) of the data section unused; "
       "tensors must cover it without holes"},
      {"hole at the start", entry("a", "F32", "[5]", 4, 24),
       "tensor \"a\": data_offsets: got [4, 24]; leaves bytes [0, 4)"},
      {"bytes left at the end", entry("a", "F32", "[5]", 0, 20),
       "': data section: got 24 bytes (a file of "},
      {"past the end", entry("a", "F32", "[8]", 0, 32),
       "tensor \"a\": data_offsets: got [0, 32]; ends past the data section, which is 24 bytes"},
      {"metadata not an object", "\"__metadata__\":[]," + entry("a", "F32", "[6]", 0, 24),
       "': __metadata__: got an array of 0 values; expected a JSON object"},
      {"metadata value not a string",
       "\"__metadata__\":{\"ok\":\"x\",\"n\":1}," + entry("a", "F32", "[6]", 0, 24),
       "': __metadata__ value \"n\": got the number 1; expected a JSON string"},
      {"metadata value null", "\"__metadata__\":{\"n\":null}," + entry("a", "F32", "[6]", 0, 24),
       "': __metadata__ value \"n\": got null; expected a JSON string"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.label);
    const std::string message = open_error("{" + c.entries + "}", data);
    CHECK(contains(message, c.message));
  }
  const std::string tail = open_error("{" + entry("a", "F32", "[5]", 0, 20) + "}", data);
  CHECK(contains(tail,
                 "-byte header); the tensors cover only its first 20 bytes; they must cover "
                 "it exactly"));

  // Accepted: members other than the three (the reference ignores them too), zero-size tensors
  // where a tensor starts, and offsets listed out of order.
  CHECK(open_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[6],\"data_offsets\":[0,24],\"x\":[1]}}",
                   data)
            .empty());
  CHECK(open_error("{" + entry("b", "F32", "[3]", 12, 24) + "," +
                       entry("z", "F32", "[0,5]", 12, 12) + "," + entry("a", "F32", "[3]", 0, 12) +
                       "," + entry("e", "BF16", "[0]", 24, 24) + "}",
                   data)
            .empty());
  CHECK(contains(open_error("{" + entry("a", "F32", "[6]", 0, 24) + "," +
                                entry("z", "F32", "[0]", 12, 12) + "}",
                            data),
                 "tensor \"z\": data_offsets: got [12, 12]; overlaps tensor \"a\""));
}

TEST_CASE("safetensors: entries come in the order of their offsets") {
  const std::string data(24, '\0');
  const TempPath file("st_order");
  write_raw(file.path,
            "{" + entry("c", "F32", "[2]", 16, 24) + "," + entry("a", "F32", "[2]", 8, 16) + "," +
                entry("b", "F32", "[2]", 0, 8) + "}",
            data);
  const SafetensorsReader reader(file.path);
  std::vector<std::string> names;
  for (const SafetensorsEntry& e : reader.entries()) names.push_back(e.name);
  CHECK(names == std::vector<std::string>{"b", "a", "c"});
  CHECK(reader.find("c")->begin == 16);
}

}  // namespace test_io_safetensors
