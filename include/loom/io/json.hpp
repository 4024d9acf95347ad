#pragma once
//! \file A strict JSON (RFC 8259) parser for file headers (safetensors, model configs), typed
//! access whose errors name what was read, and json_quote for writers. No extensions: no
//! comments, trailing commas, NaN, leading zeros, unescaped control characters, invalid UTF-8,
//! lone surrogates or duplicate object keys.

#include <algorithm>
#include <array>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <variant>
#include <vector>

#include "loom/core/error.hpp"

namespace loom::io {

namespace detail {
class JsonParser;
}  // namespace detail

//! A parsed JSON value (RFC 8259): null, boolean, number, string, array, object.
class Json {
 public:
  enum class Kind { null, boolean, number, string, array, object };

  //! Most nested arrays and objects `parse` accepts (deeper text is refused, not a stack overflow).
  static constexpr int max_depth = 256;

  //! null.
  Json() = default;

  //! Parses `text` (whole text must be one value, whitespace around allowed); throws loom::Error
  //! naming `what`, the byte offset and what was expected. Duplicate object keys are refused,
  //! as is nesting deeper than max_depth.
  static Json parse(std::string_view text, const std::string& what);

  Kind kind() const noexcept { return static_cast<Kind>(value_.index()); }

  // Typed access; a wrong kind throws loom::Error naming `what`, the value found and the kind
  // expected.
  bool boolean(const std::string& what) const { return get<bool>(what, Kind::boolean); }
  double number(const std::string& what) const { return get<Number>(what, Kind::number).value; }
  //! The number as int64: it must be written as an integer (no fraction or exponent, as serde
  //! and Python's json read integers) in [-2^63, 2^63). Read exactly, not through double.
  std::int64_t integer(const std::string& what) const {
    const Number& n = get<Number>(what, Kind::number);
    if (!n.exact_integer)
      throw Error(what, describe(),
                  "expected an integer (no fraction or exponent) in [-9223372036854775808, "
                  "9223372036854775807]");
    return n.integer;
  }
  //! Decoded: escapes and \uXXXX (surrogate pairs included) are UTF-8.
  const std::string& string(const std::string& what) const {
    return get<std::string>(what, Kind::string);
  }
  const std::vector<Json>& array(const std::string& what) const {
    return get<std::vector<Json>>(what, Kind::array);
  }
  //! Members in text order.
  const std::vector<std::pair<std::string, Json>>& object(const std::string& what) const {
    return get<std::vector<std::pair<std::string, Json>>>(what, Kind::object);
  }
  //! Member `key` of an object (a linear search), nullptr if absent or not an object.
  const Json* find(std::string_view key) const noexcept {
    const auto* members = std::get_if<std::vector<std::pair<std::string, Json>>>(&value_);
    if (members == nullptr) return nullptr;
    for (const auto& [name, value] : *members)
      if (name == key) return &value;
    return nullptr;
  }

  //! "array", "string", ...: a kind in messages.
  static const char* kind_name(Kind kind) noexcept {
    constexpr std::array<const char*, 6> names{"null",   "boolean", "number",
                                               "string", "array",   "object"};
    return names[static_cast<std::size_t>(kind)];
  }

  //! The value in a few words for messages: "null", "true", "the number 1.5", "the string
  //! \"F32\"", "an array of 3 values", "an object of 2 members".
  std::string describe() const;

 private:
  friend class detail::JsonParser;

  struct Number {
    double value = 0;
    bool exact_integer = false;  //!< written as an integer that int64 holds
    std::int64_t integer = 0;
  };
  // Alternatives in the order of Kind, so that index() is the kind.
  using Value = std::variant<std::monostate, bool, Number, std::string, std::vector<Json>,
                             std::vector<std::pair<std::string, Json>>>;

  explicit Json(Value value) : value_(std::move(value)) {}

  template <class T>
  const T& get(const std::string& what, Kind expected) const {
    const T* value = std::get_if<T>(&value_);
    if (value == nullptr)
      throw Error(what, describe(), std::string("expected a JSON ") + kind_name(expected));
    return *value;
  }

  Value value_;
};

//! `text` as a JSON string literal with quotes and escapes (for writers). Bytes from 0x80 up are
//! copied as they are: the caller passes UTF-8 (detail::utf8_error finds where it is not).
inline std::string json_quote(std::string_view text) {
  std::string out;
  out.reserve(text.size() + 2);
  out += '"';
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          constexpr std::string_view hex = "0123456789abcdef";
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 15];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
  return out;
}

namespace detail {

//! Length of the well-formed UTF-8 sequence at `text[pos]` (1 to 4), or 0 if it is not one
//! (stray continuation byte, overlong form, surrogate, above U+10FFFF, cut short).
inline std::size_t utf8_sequence_length(std::string_view text, std::size_t pos) noexcept {
  const auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[pos + i]); };
  const unsigned char lead = byte(0);
  if (lead < 0x80) return 1;
  std::size_t length = 0;
  unsigned char low = 0x80, high = 0xbf;  // range of the second byte
  if (lead >= 0xc2 && lead <= 0xdf) {
    length = 2;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    length = 3;
    if (lead == 0xe0) low = 0xa0;   // no overlong forms
    if (lead == 0xed) high = 0x9f;  // no surrogates
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    length = 4;
    if (lead == 0xf0) low = 0x90;   // no overlong forms
    if (lead == 0xf4) high = 0x8f;  // nothing above U+10FFFF
  } else {
    return 0;
  }
  if (text.size() - pos < length || byte(1) < low || byte(1) > high) return 0;
  for (std::size_t i = 2; i < length; ++i)
    if (byte(i) < 0x80 || byte(i) > 0xbf) return 0;
  return length;
}

//! Appends the UTF-8 of code point `code` (at most U+10FFFF) to `out`.
inline void append_utf8(std::string& out, std::uint32_t code) {
  const auto put = [&](std::uint32_t byte) { out += static_cast<char>(byte); };
  if (code < 0x80) {
    put(code);
  } else if (code < 0x800) {
    put(0xc0 | (code >> 6));
    put(0x80 | (code & 0x3f));
  } else if (code < 0x10000) {
    put(0xe0 | (code >> 12));
    put(0x80 | ((code >> 6) & 0x3f));
    put(0x80 | (code & 0x3f));
  } else {
    put(0xf0 | (code >> 18));
    put(0x80 | ((code >> 12) & 0x3f));
    put(0x80 | ((code >> 6) & 0x3f));
    put(0x80 | (code & 0x3f));
  }
}

//! Byte offset of the first byte of `text` that is not well-formed UTF-8, or npos.
inline std::size_t utf8_error(std::string_view text) noexcept {
  for (std::size_t pos = 0; pos < text.size();) {
    const std::size_t length = utf8_sequence_length(text, pos);
    if (length == 0) return pos;
    pos += length;
  }
  return std::string_view::npos;
}

//! Shortest text that reads back as `value` ("0.1", "1e+300").
inline std::string number_text(double value) {
  std::array<char, 32> buffer{};
  const auto result = std::to_chars(buffer.data(), buffer.data() + buffer.size(), value);
  return std::string(buffer.data(), result.ptr);
}

//! Recursive descent over `text`; every error names `what` and a byte offset.
class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& what) : text_(text), what_(what) {}

  Json parse_document() {
    Json value = parse_value(0);
    skip_whitespace();
    if (pos_ != text_.size()) fail("the end of the text after the JSON value");
    return value;
  }

 private:
  using Object = std::vector<std::pair<std::string, Json>>;

  [[noreturn]] void fail_at(std::size_t pos, std::string found, const std::string& expected) {
    throw Error(what_ + ": JSON at byte " + loom::detail::to_text(pos), std::move(found), expected);
  }
  //! "expected `expected`", naming the byte at the current position.
  [[noreturn]] void fail(const std::string& expected) {
    fail_at(pos_, found_at(pos_), "expected " + expected);
  }
  std::string found_at(std::size_t pos) const {
    if (pos >= text_.size()) return "the end of the text";
    const auto c = static_cast<unsigned char>(text_[pos]);
    if (c > 0x20 && c < 0x7f) return std::string("'") + static_cast<char>(c) + "'";
    constexpr std::string_view hex = "0123456789abcdef";
    return std::string("byte 0x") + hex[c >> 4] + hex[c & 15];
  }

  bool at_end() const noexcept { return pos_ >= text_.size(); }
  //! The current byte, '\0' at the end (no grammar rule accepts '\0', so the end and a NUL
  //! byte both fail where the parser then looks).
  char peek() const noexcept { return at_end() ? '\0' : text_[pos_]; }
  static bool is_digit(char c) noexcept { return c >= '0' && c <= '9'; }

  void skip_whitespace() noexcept {
    while (!at_end() && (text_[pos_] == ' ' || text_[pos_] == '\t' || text_[pos_] == '\n' ||
                         text_[pos_] == '\r'))
      ++pos_;
  }

  void expect(char c, const char* context) {
    if (peek() != c) fail(std::string("'") + c + "' " + context);
    ++pos_;
  }

  Json parse_value(int depth) {
    skip_whitespace();
    const char c = peek();
    if (!(c == '{' || c == '[' || c == '"' || c == 't' || c == 'f' || c == 'n' || c == '-' ||
          is_digit(c)))
      fail("a JSON value (null, true, false, a number, a string, an array or an object)");
    if (c == '{' || c == '[') {
      if (depth == Json::max_depth)
        fail_at(pos_, "an array or object nested " + loom::detail::to_text(depth + 1) + " deep",
                "at most " + loom::detail::to_text(Json::max_depth) + " nested arrays and objects");
      return c == '{' ? parse_object(depth + 1) : parse_array(depth + 1);
    }
    if (c == '"') return Json(parse_string());
    if (c == 't') return literal("true", Json(true));
    if (c == 'f') return literal("false", Json(false));
    if (c == 'n') return literal("null", Json());
    return parse_number();
  }

  Json literal(std::string_view word, Json value) {
    if (text_.substr(pos_, word.size()) != word)
      fail("a JSON value (did you mean " + std::string(word) + "?)");
    pos_ += word.size();
    return value;
  }

  Json parse_array(int depth) {
    ++pos_;  // '['
    std::vector<Json> values;
    skip_whitespace();
    if (peek() == ']') {
      ++pos_;
      return Json(std::move(values));
    }
    for (;;) {
      values.push_back(parse_value(depth));
      skip_whitespace();
      if (peek() == ']') break;
      expect(',', "or ']' after an array element");
    }
    ++pos_;
    return Json(std::move(values));
  }

  Json parse_object(int depth) {
    ++pos_;  // '{'
    Object members;
    std::vector<std::size_t> key_offsets;
    skip_whitespace();
    if (peek() != '}') {
      for (;;) {
        skip_whitespace();
        if (peek() != '"') fail("'\"' to start an object key");
        key_offsets.push_back(pos_);
        std::string key = parse_string();
        skip_whitespace();
        expect(':', "after an object key");
        members.emplace_back(std::move(key), parse_value(depth));
        skip_whitespace();
        if (peek() == '}') break;
        expect(',', "or '}' after an object member");
      }
    }
    ++pos_;
    check_unique_keys(members, key_offsets);
    return Json(std::move(members));
  }

  //! Refuses a key that appears twice, naming the later place (sorting, not a quadratic scan:
  //! headers of large models have thousands of keys).
  void check_unique_keys(const Object& members, const std::vector<std::size_t>& offsets) {
    if (members.size() < 2) return;
    std::vector<std::size_t> order(members.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return members[a].first != members[b].first ? members[a].first < members[b].first : a < b;
    });
    for (std::size_t i = 1; i < order.size(); ++i)
      if (members[order[i]].first == members[order[i - 1]].first)
        fail_at(offsets[order[i]], "the key " + json_quote(members[order[i]].first) + " again",
                "object keys must be unique (it is first at byte " +
                    loom::detail::to_text(offsets[order[i - 1]]) + ")");
  }

  unsigned hex_digit() {
    const char c = peek();
    unsigned value = 16;
    if (c >= '0' && c <= '9') value = static_cast<unsigned>(c - '0');
    if (c >= 'a' && c <= 'f') value = static_cast<unsigned>(c - 'a' + 10);
    if (c >= 'A' && c <= 'F') value = static_cast<unsigned>(c - 'A' + 10);
    if (value == 16) fail("a hexadecimal digit in a \\u escape");
    ++pos_;
    return value;
  }
  unsigned hex4() {
    unsigned value = 0;
    for (int i = 0; i < 4; ++i) value = value * 16 + hex_digit();
    return value;
  }

  //! The code point of a \u escape (pos_ after the 'u'), joining a surrogate pair.
  std::uint32_t unicode_escape(std::size_t escape_start) {
    const std::uint32_t first = hex4();
    if (first >= 0xdc00 && first <= 0xdfff)
      fail_at(escape_start, "the low surrogate \\u" + std::string(text_.substr(pos_ - 4, 4)),
              "a low surrogate may only follow a high surrogate (\\ud800-\\udbff)");
    if (first < 0xd800 || first > 0xdbff) return first;
    if (text_.substr(pos_, 2) != "\\u")
      fail_at(escape_start, "the high surrogate \\u" + std::string(text_.substr(pos_ - 4, 4)),
              "expected a low surrogate escape (\\udc00-\\udfff) right after it");
    pos_ += 2;
    const std::uint32_t second = hex4();
    if (second < 0xdc00 || second > 0xdfff)
      fail_at(pos_ - 6, "\\u" + std::string(text_.substr(pos_ - 4, 4)),
              "expected a low surrogate (\\udc00-\\udfff) after the high surrogate at byte " +
                  loom::detail::to_text(escape_start));
    return 0x10000 + ((first - 0xd800) << 10) + (second - 0xdc00);
  }

  std::string parse_string() {
    const std::size_t start = pos_;
    ++pos_;  // '"'
    std::string out;
    for (;;) {
      if (at_end())
        fail_at(pos_, "the end of the text",
                "expected a '\"' to close the string at byte " + loom::detail::to_text(start));
      const auto c = static_cast<unsigned char>(text_[pos_]);
      if (c == '"') break;
      if (c < 0x20)
        fail("a string character: control characters must be escaped (\\n, \\u001f, ...)");
      if (c >= 0x80) {
        const std::size_t length = utf8_sequence_length(text_, pos_);
        if (length == 0) fail("well-formed UTF-8");
        out.append(text_.substr(pos_, length));
        pos_ += length;
        continue;
      }
      ++pos_;
      if (c != '\\') {
        out += static_cast<char>(c);
        continue;
      }
      const std::size_t escape_start = pos_ - 1;
      if (at_end()) fail("an escape character after '\\'");
      const char escape = text_[pos_++];
      constexpr std::string_view escaped = "\"\\/bfnrt", meant = "\"\\/\b\f\n\r\t";
      if (escape == 'u') {
        append_utf8(out, unicode_escape(escape_start));
      } else if (const auto k = escaped.find(escape); k != std::string_view::npos) {
        out += meant[k];
      } else {
        --pos_;
        fail("an escape: \\\" \\\\ \\/ \\b \\f \\n \\r \\t or \\uXXXX");
      }
    }
    ++pos_;  // '"'
    return out;
  }

  Json parse_number() {
    const std::size_t start = pos_;
    if (peek() == '-') ++pos_;
    if (!is_digit(peek())) fail("a digit in a number");
    if (peek() == '0') {
      ++pos_;
      if (is_digit(peek()))
        fail_at(start, "a number with a leading zero", "JSON numbers have no leading zeros");
    }
    while (is_digit(peek())) ++pos_;
    bool integer_literal = true;
    if (peek() == '.') {
      integer_literal = false;
      ++pos_;
      if (!is_digit(peek())) fail("a digit after the decimal point");
      while (is_digit(peek())) ++pos_;
    }
    if (peek() == 'e' || peek() == 'E') {
      integer_literal = false;
      ++pos_;
      if (peek() == '-' || peek() == '+') ++pos_;
      if (!is_digit(peek())) fail("a digit in the exponent");
      while (is_digit(peek())) ++pos_;
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    Json::Number number;
    const auto as_double = std::from_chars(first, last, number.value);
    if (as_double.ec != std::errc() || as_double.ptr != last)
      fail_at(start, "the number " + std::string(first, last),
              "expected a number that double can hold (magnitude at most about 1.8e308 and, unless "
              "0, at "
              "least about 4.9e-324)");
    if (integer_literal) {  // exactly, not through double; out of int64's range stays inexact
      const auto as_integer = std::from_chars(first, last, number.integer);
      number.exact_integer = as_integer.ec == std::errc() && as_integer.ptr == last;
    }
    return Json(number);
  }

  std::string_view text_;
  const std::string& what_;
  std::size_t pos_ = 0;
};

}  // namespace detail

inline Json Json::parse(std::string_view text, const std::string& what) {
  return detail::JsonParser(text, what).parse_document();
}

inline std::string Json::describe() const {
  switch (kind()) {
    case Kind::null:
      return "null";
    case Kind::boolean:
      return std::get<bool>(value_) ? "true" : "false";
    case Kind::number:
      return "the number " + detail::number_text(std::get<Number>(value_).value);
    case Kind::string: {
      const std::string& text = std::get<std::string>(value_);
      if (text.size() <= 64) return "the string " + json_quote(text);
      std::size_t cut = 64;  // not inside a UTF-8 sequence
      while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xc0) == 0x80) --cut;
      return "the string " + json_quote(text.substr(0, cut)) + "... (" +
             loom::detail::to_text(cut) + " of its " + loom::detail::to_text(text.size()) +
             " bytes)";
    }
    case Kind::array: {
      const std::size_t n = std::get<std::vector<Json>>(value_).size();
      return "an array of " + loom::detail::to_text(n) + (n == 1 ? " value" : " values");
    }
    case Kind::object: {
      const std::size_t n = std::get<std::vector<std::pair<std::string, Json>>>(value_).size();
      return "an object of " + loom::detail::to_text(n) + (n == 1 ? " member" : " members");
    }
  }
  return "";
}

}  // namespace loom::io
