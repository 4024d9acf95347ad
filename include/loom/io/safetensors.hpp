#pragma once
//! \file The safetensors format (https://github.com/huggingface/safetensors), as Hugging Face
//! models are stored: a little-endian uint64 N, N bytes of JSON header, then the data section.
//! The header maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (byte
//! offsets within the data section), plus an optional "__metadata__" object of strings.
//!
//! SafetensorsReader checks the whole header when it opens a file and reads tensors on demand,
//! through the file position (files can be many GB). save_safetensors writes float32 tensors.

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "loom/core/bf16.hpp"
#include "loom/core/error.hpp"
#include "loom/io/json.hpp"
#include "loom/io/token_file.hpp"

namespace loom::io {

//! One tensor in a safetensors header.
struct SafetensorsEntry {
  std::string name;
  std::string dtype;  //!< as in the file: "F32", "BF16", ...
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  //!< byte offsets within the data section

  //! Product of shape (1 for a scalar []); the reader has checked that it fits int64.
  std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (const std::int64_t d : shape) n *= d;
    return n;
  }
};

namespace detail {

//! A safetensors dtype and the bits one element takes (F4 and F6 pack below a byte).
struct SafetensorsDtype {
  std::string_view name;
  std::uint64_t bits;
};

//! Every dtype of the format (safetensors 0.8), so that files holding tensors loom does not read
//! (int64 position ids, fp8 weights) still open.
inline constexpr std::array<SafetensorsDtype, 22> safetensors_dtypes{{
    {"BOOL", 8},        {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6}, {"U8", 8},
    {"I8", 8},          {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},
    {"F8_E5M2FNUZ", 8}, {"I16", 16},    {"U16", 16},    {"F16", 16},    {"BF16", 16},
    {"I32", 32},        {"U32", 32},    {"F32", 32},    {"C64", 64},    {"F64", 64},
    {"I64", 64},        {"U64", 64},
}};

//! The format's limit on the header (safetensors refuses larger ones).
inline constexpr std::uint64_t safetensors_max_header_bytes = 100'000'000;

inline const SafetensorsDtype* find_safetensors_dtype(std::string_view name) noexcept {
  for (const SafetensorsDtype& dtype : safetensors_dtypes)
    if (dtype.name == name) return &dtype;
  return nullptr;
}

//! "[2, 3]".
inline std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string text = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i != 0) text += ", ";
    text += loom::detail::to_text(shape[i]);
  }
  return text + "]";
}

//! "[begin, end]" (built piecewise: "[" + string&& trips GCC 12's -Wrestrict).
inline std::string range_text(std::uint64_t begin, std::uint64_t end) {
  std::string text(1, '[');
  text += loom::detail::to_text(begin);
  text += ", ";
  text += loom::detail::to_text(end);
  text += ']';
  return text;
}

//! The element count of `shape`, refusing negative dimensions and a count beyond int64.
inline std::int64_t checked_numel(const std::vector<std::int64_t>& shape,
                                  const std::string& subject) {
  std::int64_t n = 1;
  for (std::size_t i = 0; i < shape.size(); ++i)
    LOOM_CHECK(shape[i] >= 0, subject + ": shape[" + loom::detail::to_text(i) + "]", shape[i],
               "dimensions must be >= 0");
  for (const std::int64_t d : shape) {
    if (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d)
      throw Error(subject + ": shape", shape_text(shape),
                  "the element count (the product of the dimensions) overflows int64");
    n *= d;
  }
  return n;
}

//! Refuses `text` (a name or metadata string) unless it is UTF-8, which JSON requires.
inline void check_utf8(std::string_view text, const std::string& subject) {
  const std::size_t bad = utf8_error(text);
  if (bad != std::string_view::npos)
    throw Error(subject, json_quote(text),
                "must be UTF-8 (JSON text is); byte " + loom::detail::to_text(bad) + " is not");
}

//! The entry `name` describes, with every field's kind, dtype, shape and size checked.
inline SafetensorsEntry safetensors_entry(const std::string& file, const std::string& name,
                                          const Json& value) {
  const std::string subject = file + ": tensor " + json_quote(name);
  static_cast<void>(value.object(subject));  // refuses anything but an object
  const auto field = [&](std::string_view key) -> const Json& {
    const Json* found = value.find(key);
    if (found == nullptr)
      throw Error(subject, value.describe() + " without \"" + std::string(key) + "\"",
                  "each tensor needs \"dtype\", \"shape\" and \"data_offsets\"");
    return *found;
  };
  SafetensorsEntry entry;
  entry.name = name;
  entry.dtype = field("dtype").string(subject + ": dtype");
  const SafetensorsDtype* dtype = find_safetensors_dtype(entry.dtype);
  if (dtype == nullptr) {
    std::string known;
    for (const SafetensorsDtype& d : safetensors_dtypes)
      known.append(known.empty() ? "" : " ").append(d.name);
    throw Error(subject + ": dtype", json_quote(entry.dtype),
                "not a safetensors dtype (they are " + known + ")");
  }
  const std::vector<Json>& dims = field("shape").array(subject + ": shape");
  for (std::size_t i = 0; i < dims.size(); ++i)
    entry.shape.push_back(dims[i].integer(subject + ": shape[" + loom::detail::to_text(i) + "]"));
  const std::int64_t numel = checked_numel(entry.shape, subject);

  const std::vector<Json>& offsets = field("data_offsets").array(subject + ": data_offsets");
  LOOM_CHECK(offsets.size() == 2, subject + ": data_offsets", field("data_offsets").describe(),
             "expected [begin, end]");
  std::array<std::int64_t, 2> range{};
  for (std::size_t i = 0; i < 2; ++i) {
    range[i] = offsets[i].integer(subject + ": data_offsets[" + loom::detail::to_text(i) + "]");
    LOOM_CHECK(range[i] >= 0, subject + ": data_offsets[" + loom::detail::to_text(i) + "]",
               range[i], "byte offsets must be >= 0");
  }
  entry.begin = static_cast<std::uint64_t>(range[0]);
  entry.end = static_cast<std::uint64_t>(range[1]);
  const std::string offsets_text = range_text(entry.begin, entry.end);
  LOOM_CHECK(entry.end >= entry.begin, subject + ": data_offsets", offsets_text,
             "end must be >= begin");

  const auto count = static_cast<std::uint64_t>(numel);
  const std::string size_rule = "shape " + shape_text(entry.shape) + " of " + entry.dtype + " (" +
                                loom::detail::to_text(dtype->bits) + " bits an element)";
  if (count > std::numeric_limits<std::uint64_t>::max() / dtype->bits)
    throw Error(subject + ": shape", shape_text(entry.shape),
                "the byte size of " + size_rule + " overflows uint64");
  LOOM_CHECK(count * dtype->bits % 8 == 0, subject + ": shape", shape_text(entry.shape),
             "the elements of " + size_rule + " must fill whole bytes");
  const std::uint64_t bytes = count * dtype->bits / 8;
  LOOM_CHECK(entry.end - entry.begin == bytes, subject + ": data_offsets",
             offsets_text + " (" + loom::detail::to_text(entry.end - entry.begin) + " bytes)",
             "expected " + loom::detail::to_text(bytes) + " bytes for " + size_rule);
  return entry;
}

//! Refuses entries (sorted by offsets) that overlap, leave a hole, or do not end exactly at the
//! end of a data section of `data_bytes`.
inline void check_safetensors_coverage(const std::string& file,
                                       const std::vector<SafetensorsEntry>& entries,
                                       std::uint64_t data_bytes, const std::string& layout) {
  std::uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& entry : entries) {
    const std::string subject = file + ": tensor " + json_quote(entry.name) + ": data_offsets";
    const std::string offsets_text = range_text(entry.begin, entry.end);
    if (entry.begin < covered)
      throw Error(subject, offsets_text,
                  "overlaps tensor " + json_quote(previous->name) + " at " +
                      range_text(previous->begin, previous->end) +
                      "; tensors must not share bytes");
    if (entry.begin > covered)
      throw Error(subject, offsets_text,
                  "leaves bytes [" + loom::detail::to_text(covered) + ", " +
                      loom::detail::to_text(entry.begin) +
                      ") of the data section unused; tensors must cover it without holes");
    LOOM_CHECK(entry.end <= data_bytes, subject, offsets_text,
               "ends past the data section, which is " + loom::detail::to_text(data_bytes) +
                   " bytes (" + layout + "; truncated?)");
    covered = entry.end;
    previous = &entry;
  }
  LOOM_CHECK(covered == data_bytes, file + ": data section",
             loom::detail::to_text(data_bytes) + " bytes (" + layout + ")",
             "the tensors cover only its first " + loom::detail::to_text(covered) +
                 " bytes; they must cover it exactly");
}

//! IEEE binary16 to float, exactly.
inline float half_to_float(std::uint16_t half) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(half & 0x8000u) << 16;
  const std::uint32_t exponent = (half >> 10) & 0x1fu;
  const std::uint32_t mantissa = half & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa × 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    return std::bit_cast<float>(sign | std::bit_cast<std::uint32_t>(magnitude));
  }
  if (exponent == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mantissa << 13));
  return std::bit_cast<float>(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
}

//! Reads `n` values stored as `Stored` from `file`'s position into `out`, through `convert`,
//! in chunks (so that a large tensor needs no second full-size buffer).
template <class Stored, class Convert>
void read_converted(BinaryFile& file, float* out, std::size_t n, std::string_view what,
                    Convert convert) {
  std::vector<Stored> staging(std::min<std::size_t>(n, std::size_t{1} << 16));
  for (std::size_t done = 0; done < n;) {
    const std::size_t chunk = std::min(staging.size(), n - done);
    file.read(staging.data(), chunk * sizeof(Stored), what);
    for (std::size_t k = 0; k < chunk; ++k) out[done + k] = convert(staging[k]);
    done += chunk;
  }
}

}  // namespace detail

//! Reads a safetensors file: the header is read and checked when constructed; tensors are read
//! on demand. Opening refuses (naming the file, the value and the rule) a file too short for the
//! length word, a header longer than the file or than 100,000,000 bytes, a header that is not a
//! JSON object, an entry without dtype, shape or data_offsets or with a wrong kind, an unknown
//! dtype, a negative dimension or an element count beyond int64, end < begin, a byte range that
//! disagrees with shape × dtype size, entries that overlap or leave holes or do not cover the
//! data section exactly, and "__metadata__" that is not an object of strings. Members of an
//! entry other than the three are ignored, as the reference implementation does.
class SafetensorsReader {
 public:
  explicit SafetensorsReader(const std::filesystem::path& path) : path_(path) {
    detail::BinaryFile file(path_, "rb", "safetensors file");
    name_ = file.name();
    file_bytes_ = file.size();
    LOOM_CHECK(file_bytes_ >= 8, name_ + ": size", loom::detail::to_text(file_bytes_) + " bytes",
               "too short for the 8-byte header length that safetensors files start with");
    std::uint64_t header_bytes = 0;
    file.read(&header_bytes, 8, "header length");
    LOOM_CHECK(header_bytes <= detail::safetensors_max_header_bytes, name_ + ": header length",
               header_bytes, "the format allows at most 100000000 bytes");
    LOOM_CHECK(header_bytes <= file_bytes_ - 8, name_ + ": header length", header_bytes,
               "the file has only " + loom::detail::to_text(file_bytes_ - 8) +
                   " bytes after the length word (truncated, or not a safetensors file?)");
    std::string text(static_cast<std::size_t>(header_bytes), '\0');
    file.read(text.data(), text.size(), "header");
    data_start_ = 8 + header_bytes;

    const Json header = Json::parse(text, name_ + ": header");
    for (const auto& [key, value] : header.object(name_ + ": header")) {
      if (key == "__metadata__") {
        for (const auto& [meta_key, meta_value] : value.object(name_ + ": __metadata__"))
          metadata_.emplace_back(
              meta_key, meta_value.string(name_ + ": __metadata__ value " + json_quote(meta_key)));
      } else {
        entries_.push_back(detail::safetensors_entry(name_, key, value));
      }
    }
    std::stable_sort(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    detail::check_safetensors_coverage(name_, entries_, file_bytes_ - data_start_,
                                       "a file of " + loom::detail::to_text(file_bytes_) +
                                           " bytes with an 8 + " +
                                           loom::detail::to_text(header_bytes) + "-byte header");
    by_name_.resize(entries_.size());
    for (std::size_t i = 0; i < by_name_.size(); ++i) by_name_[i] = i;
    std::sort(by_name_.begin(), by_name_.end(),
              [&](std::size_t a, std::size_t b) { return entries_[a].name < entries_[b].name; });
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  //! The tensors in the order of their data offsets.
  const std::vector<SafetensorsEntry>& entries() const noexcept { return entries_; }
  //! The entry named `name`, nullptr if absent.
  const SafetensorsEntry* find(std::string_view name) const noexcept {
    const auto it = std::lower_bound(
        by_name_.begin(), by_name_.end(), name,
        [&](std::size_t i, std::string_view key) { return entries_[i].name < key; });
    return it != by_name_.end() && entries_[*it].name == name ? &entries_[*it] : nullptr;
  }
  //! "__metadata__", in file order (empty without it).
  const std::vector<std::pair<std::string, std::string>>& metadata() const noexcept {
    return metadata_;
  }

  //! Reads `entry`'s values into out[0, entry.numel()) as float: F32 exactly, BF16 and F16
  //! widened exactly, F64 rounded to nearest. Other dtypes are refused (naming the tensor, its
  //! dtype and the dtypes supported), as is an entry that is not this file's.
  void read(const SafetensorsEntry& entry, float* out) const {
    const std::string subject = name_ + ": tensor " + json_quote(entry.name);
    const SafetensorsEntry* own = find(entry.name);
    if (own == nullptr || own->dtype != entry.dtype || own->shape != entry.shape ||
        own->begin != entry.begin || own->end != entry.end)
      throw Error(subject,
                  entry.dtype + " " + detail::shape_text(entry.shape) + " at " +
                      detail::range_text(entry.begin, entry.end),
                  "is not an entry of this file; pass one from its entries() or find()");
    const std::string& dtype = entry.dtype;
    LOOM_CHECK(dtype == "F32" || dtype == "BF16" || dtype == "F16" || dtype == "F64",
               subject + ": dtype", dtype, "read converts F32, BF16, F16 and F64 to float only");

    detail::BinaryFile file(path_, "rb", "safetensors file");
    LOOM_CHECK(file.size() == file_bytes_, name_ + ": size",
               loom::detail::to_text(file.size()) + " bytes",
               "it was " + loom::detail::to_text(file_bytes_) +
                   " bytes when its header was read; the file changed since it was opened");
    const auto n = static_cast<std::size_t>(entry.numel());
    if (n == 0) return;
    file.seek(data_start_ + entry.begin);
    const std::string what = "tensor " + json_quote(entry.name);
    if (dtype == "F32") {
      file.read(out, n * sizeof(float), what);
    } else if (dtype == "BF16") {
      detail::read_converted<std::uint16_t>(file, out, n, what, [](std::uint16_t bits) {
        return static_cast<float>(bf16::from_bits(bits));
      });
    } else if (dtype == "F16") {
      detail::read_converted<std::uint16_t>(file, out, n, what, detail::half_to_float);
    } else {
      detail::read_converted<double>(file, out, n, what,
                                     [](double value) { return static_cast<float>(value); });
    }
  }

  //! The values of tensor `name` (refused, naming the file and the tensor, if absent).
  std::vector<float> read(std::string_view name) const {
    const SafetensorsEntry* entry = find(name);
    if (entry == nullptr) {
      std::string some;
      for (std::size_t i = 0; i < entries_.size() && i < 8; ++i)
        some.append(i == 0 ? "" : ", ").append(json_quote(entries_[i].name));
      if (entries_.size() > 8) some += ", ...";
      throw Error(name_ + ": tensor", json_quote(name),
                  "the file has no tensor of this name (it has " +
                      loom::detail::to_text(entries_.size()) + ": " + some + ")");
    }
    std::vector<float> values(static_cast<std::size_t>(entry->numel()));
    read(*entry, values.data());
    return values;
  }

 private:
  std::filesystem::path path_;
  std::string name_;  // "safetensors file 'path'"
  std::uint64_t file_bytes_ = 0;
  std::uint64_t data_start_ = 0;  // 8 + header length
  std::vector<SafetensorsEntry> entries_;
  std::vector<std::size_t> by_name_;  // indices into entries_, sorted by name
  std::vector<std::pair<std::string, std::string>> metadata_;
};

//! A tensor to write: its name, shape, and values (numel(shape) of them), stored as F32.
struct SafetensorsTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::span<const float> values;
};

//! Writes `tensors` (in the given order, data back to back) and `metadata` to `path` as
//! safetensors with F32 data; the header is padded with spaces to a multiple of 8 bytes so the
//! data is aligned. Written to path + ".tmp" and renamed, so a failure leaves an existing file
//! intact. Refuses (before writing) empty or duplicate names, "__metadata__" as a name, names
//! and metadata that are not UTF-8, duplicate metadata keys, negative dimensions, and values
//! whose count differs from the shape's product.
inline void save_safetensors(
    const std::filesystem::path& path, std::span<const SafetensorsTensor> tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata = {}) {
  const std::string file = "safetensors file " + detail::quoted(path);
  const auto check_unique = [&](std::vector<std::string_view> names, const std::string& subject) {
    std::sort(names.begin(), names.end());
    const auto twice = std::adjacent_find(names.begin(), names.end());
    if (twice != names.end())
      throw Error(subject, json_quote(*twice), "appears twice; names must be unique");
  };

  std::vector<std::string_view> names;
  for (const SafetensorsTensor& tensor : tensors) {
    const std::string subject = file + ": tensor " + json_quote(tensor.name);
    LOOM_CHECK(!tensor.name.empty(), file + ": tensor name", "\"\"", "names must not be empty");
    LOOM_CHECK(tensor.name != "__metadata__", file + ": tensor name", "\"__metadata__\"",
               "the name is reserved for the header's metadata");
    detail::check_utf8(tensor.name, file + ": tensor name");
    const std::int64_t numel = detail::checked_numel(tensor.shape, subject);
    LOOM_CHECK(tensor.values.size() == static_cast<std::uint64_t>(numel), subject + ": values",
               tensor.values.size(),
               "shape " + detail::shape_text(tensor.shape) + " holds " +
                   loom::detail::to_text(numel) + " values");
    names.push_back(tensor.name);
  }
  check_unique(std::move(names), file + ": tensor name");
  std::vector<std::string_view> keys;
  for (const auto& [key, value] : metadata) {
    detail::check_utf8(key, file + ": metadata key");
    detail::check_utf8(value, file + ": metadata value of " + json_quote(key));
    keys.push_back(key);
  }
  check_unique(std::move(keys), file + ": metadata key");

  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    for (std::size_t i = 0; i < metadata.size(); ++i) {
      if (i != 0) header += ",";
      header += json_quote(metadata[i].first) + ":" + json_quote(metadata[i].second);
    }
    header += "}";
  }
  std::uint64_t offset = 0;
  for (const SafetensorsTensor& tensor : tensors) {
    const std::uint64_t end = offset + tensor.values.size_bytes();
    if (header.size() > 1) header += ",";
    header += json_quote(tensor.name) +
              ":{\"dtype\":\"F32\",\"shape\":" + detail::shape_text(tensor.shape) +
              ",\"data_offsets\":[" + loom::detail::to_text(offset) + "," +
              loom::detail::to_text(end) + "]}";
    offset = end;
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');  // 8 + header: the data starts aligned

  detail::write_file_replacing(path, "safetensors file", [&](detail::BinaryFile& out) {
    const std::uint64_t header_bytes = header.size();
    out.write(&header_bytes, 8);
    out.write(header.data(), header.size());
    for (const SafetensorsTensor& tensor : tensors)
      out.write(tensor.values.data(), tensor.values.size_bytes());
  });
}

}  // namespace loom::io
