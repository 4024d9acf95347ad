#pragma once
//! \file Training-state checkpoints: what a run needs to go on exactly where it stopped (the
//! parameters at the optimizer's precision, the optimizer's state, the steps done), written in
//! the whole model's layout (Trainer::whole_layout), so that a state saved on one mesh and
//! strategy resumes on any other: DP x TP x PP, DDP or ZeRO-1/2/3, one rank or many.
//!
//! The file (little-endian):
//!
//!     "LOOMSTAT" u32 version=3 u32 scalar_bytes (4: fp32, 8: double) i64 steps i32 state_slots
//!     i32 0  string optimizer  string meta  u64 parameters, each: string name, u32 rank,
//!     i64 extents[rank]  i64 elements  i64 tensor_elements
//!     then 1 + state_slots arrays of `elements` scalars (the parameters, then each state slot)
//!     then the per-tensor optimizer state: `tensor_elements` doubles (Adafactor's row and column
//!     moments, parameter after parameter; none for element-wise optimizers)
//!     then the trailer: u64 checksum of the header, u64 checksum of each array, u64 checksum of
//!     the per-tensor state, "LOOMSTAT"
//!
//! where a string is a u64 byte count and the bytes. The header's checksum is 64-bit FNV-1a over
//! 8-byte words. An array's checksum is the sum, mod 2^64, of one term per element that mixes
//! the element's bits with its index (element_term), so that a flipped, moved or truncated byte
//! is found before anything is loaded from it, and so that ranks can each add up their own
//! elements. Version 1 files, whose array checksums were FNV-1a too, and version 2 files, which
//! have no per-tensor state (nor its count and checksum), are still read.
//!
//! Every rank writes the elements it owns into their places in the file, and reads the elements
//! it holds (Trainer::owned_state_runs, needed_state_runs): no rank gathers the whole model, and
//! no rank reads more of the file than it holds.

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <iterator>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/parameters.hpp"
#include "loom/io/checkpoint_series.hpp"
#include "loom/io/token_file.hpp"

namespace loom::io {

//! What a training-state file says about itself.
struct TrainingStateInfo {
  std::int64_t steps = 0;  //!< steps done when it was saved; a resumed run goes on with steps + 1
  std::string optimizer;   //!< the optimizer's name (AdamW::name); its state slots mean nothing to another
  int state_slots = 0;     //!< optimizer state arrays after the parameters
  int scalar_bytes = 4;    //!< 4 (fp32: float and bf16 models) or 8 (double)
  std::string meta;        //!< the saving program's text about the run (gpt2_train: JSON of the model config)
  std::vector<std::pair<std::string, Shape>> parameters;  //!< names and whole shapes, in layout order
  std::int64_t elements = 0;  //!< of each array
  //! Numbers (doubles) of the optimizer's per-tensor state (Trainer::whole_tensor_state_size).
  std::int64_t tensor_elements = 0;
  int version = 3;  //!< of the format: 1 (FNV-1a array checksums), 2, or 3 (per-tensor state)
};

//! The Error a training-state file whose bytes are wrong raises: a checksum, magic, size or
//! header field that no save writes (a file truncated, overwritten or damaged on the disk). A
//! file that is intact but not the trainer's (another model or optimizer, a newer format), or
//! that cannot be opened or read, raises a plain Error. load_newest_training_state falls back to
//! an older file of a series from this one only.
class CorruptCheckpoint : public Error {
 public:
  using Error::Error;
};

namespace detail {

//! Throws CorruptCheckpoint(what, value, rule) unless `intact`.
template <class V>
void check_intact(bool intact, std::string what, const V& value, std::string rule) {
  if (!intact) [[unlikely]]
    throw CorruptCheckpoint(std::move(what), loom::detail::to_text(value), std::move(rule));
}

inline constexpr std::array<char, 8> training_state_magic{'L', 'O', 'O', 'M', 'S', 'T', 'A', 'T'};
//! The version this loom writes; it reads 1 as well.
inline constexpr std::uint32_t training_state_version = 3;

//! 64-bit FNV-1a over 8-byte words (a final partial word zero-padded), continuing from `hash`.
inline std::uint64_t checksum(const void* data, std::size_t bytes,
                              std::uint64_t hash = 0xcbf29ce484222325ull) {
  constexpr std::uint64_t prime = 0x100000001b3ull;
  const auto* p = static_cast<const unsigned char*>(data);
  std::size_t i = 0;
  for (; i + 8 <= bytes; i += 8) {
    std::uint64_t word;
    std::memcpy(&word, p + i, 8);
    hash = (hash ^ word) * prime;
  }
  if (i < bytes) {
    std::uint64_t word = 0;
    std::memcpy(&word, p + i, bytes - i);
    hash = (hash ^ word) * prime;
  }
  return hash;
}

//! One element's term of a version-2 array checksum: its bits (a 4- or 8-byte scalar, zero-extended)
//! mixed with its index in the array by splitmix64's finaliser, so that a changed element, or two
//! swapped ones, change the sum.
inline std::uint64_t element_term(std::uint64_t index, std::uint64_t bits) noexcept {
  std::uint64_t z = bits ^ (index * 0x9e3779b97f4a7c15ull) ^ 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

//! The sum of element_term over `count` scalars of type Bits (the bits of a 4- or 8-byte scalar)
//! at `bytes`, the first of which is element `first` of its array. A sum mod 2^64 is the same in
//! any order, so the threads may split it.
template <class Bits>
std::uint64_t elements_checksum_of(const unsigned char* bytes, std::int64_t first, std::int64_t count) {
  std::uint64_t sum = 0;
#pragma omp parallel for reduction(+ : sum) schedule(static) if (count > (1 << 16))
  for (std::int64_t i = 0; i < count; ++i) {
    Bits bits;
    std::memcpy(&bits, bytes + static_cast<std::size_t>(i) * sizeof(Bits), sizeof(Bits));
    sum += element_term(static_cast<std::uint64_t>(first + i), bits);
  }
  return sum;
}
//! elements_checksum_of for scalars of `width` bytes (4 or 8).
inline std::uint64_t elements_checksum(const void* bytes, std::size_t width, std::int64_t first, std::int64_t count) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  return width == 4 ? elements_checksum_of<std::uint32_t>(p, first, count)
                    : elements_checksum_of<std::uint64_t>(p, first, count);
}

//! 64-bit sums exactly over the ranks of a mesh, through Trainer::sum_over_ranks, whose doubles
//! hold integers exactly below 2^53: a value travels as four 16-bit limbs (their sums stay below
//! 2^53 for up to 2^37 ranks), and the limbs' sums are put back together mod 2^64.
inline constexpr int limbs = 4;
inline void put_limbs(std::uint64_t value, double* out) noexcept {
  for (int k = 0; k < limbs; ++k) out[k] = static_cast<double>((value >> (16 * k)) & 0xffffu);
}
inline std::uint64_t get_limbs(const double* in) noexcept {
  std::uint64_t value = 0;
  for (int k = 0; k < limbs; ++k) value += static_cast<std::uint64_t>(in[k]) << (16 * k);
  return value;
}

//! The header's bytes, built in memory so that its checksum is taken before it is written.
class HeaderBytes {
 public:
  template <class V>
  void put(const V& value) {
    append(&value, sizeof(V));
  }
  void put_string(std::string_view text) {
    put(static_cast<std::uint64_t>(text.size()));
    append(text.data(), text.size());
  }
  const std::string& bytes() const noexcept { return bytes_; }

 private:
  // A std::string: GCC 12 warns falsely (-Wstringop-overflow) on growing a vector<char> here.
  void append(const void* data, std::size_t n) { bytes_.append(static_cast<const char*>(data), n); }
  std::string bytes_;
};

//! Reads the header's fields from a file, counting the bytes and their checksum as it goes.
class HeaderReader {
 public:
  HeaderReader(BinaryFile& file, std::uint64_t file_bytes) : file_(&file), file_bytes_(file_bytes) {}
  template <class V>
  V get(std::string_view what) {
    V value;
    read(&value, sizeof(V), what);
    return value;
  }
  std::string get_string(std::string_view what) {
    const auto n = get<std::uint64_t>(what);
    const std::uint64_t rest = file_bytes_ - bytes_read();
    check_intact(n <= rest, file_->name() + ": length of " + std::string(what), n,
                 "longer than the rest of the file (" + loom::detail::to_text(rest) + " bytes): the header is corrupt");
    std::string text(n, '\0');
    read(text.data(), n, what);
    return text;
  }
  std::uint64_t bytes_read() const noexcept { return bytes_.size(); }
  std::uint64_t hash() const noexcept { return checksum(bytes_.data(), bytes_.size()); }

 private:
  void read(void* data, std::size_t bytes, std::string_view what) {
    // The end of the file inside the header is damage, not a failed read.
    if (bytes > file_bytes_ - std::min<std::uint64_t>(bytes_read(), file_bytes_))
      throw CorruptCheckpoint(file_->name() + ": " + std::string(what),
                              "the end of the file at byte " + loom::detail::to_text(file_bytes_),
                              "the header runs past it: the file is truncated or corrupt");
    file_->read(data, bytes, what);
    const std::size_t at = bytes_.size();
    bytes_.resize(at + bytes);
    if (bytes > 0) std::memcpy(bytes_.data() + at, data, bytes);
  }
  BinaryFile* file_;
  std::uint64_t file_bytes_;
  std::vector<char> bytes_;
};

//! Bytes of the trailer: the checksums (the header's, each array's, and from version 3 the
//! per-tensor state's), then the closing magic.
inline std::uint64_t trailer_bytes(int state_slots, int version = training_state_version) {
  return 8 * (2 + static_cast<std::uint64_t>(state_slots) + (version >= 3 ? 1 : 0)) + training_state_magic.size();
}

//! Eight bytes as text where they are printable, else as hex ("4c 4f ...").
inline std::string printable(const std::array<char, 8>& bytes) {
  std::string text, hex;
  bool plain = true;
  for (char c : bytes) {
    plain = plain && c >= 0x20 && c < 0x7f;
    text += c;
    constexpr char digits[] = "0123456789abcdef";
    const auto u = static_cast<unsigned char>(c);
    if (!hex.empty()) hex += ' ';
    hex += digits[u >> 4];
    hex += digits[u & 15];
  }
  return plain ? text : "bytes " + hex;
}

template <class O>
std::string optimizer_name() {
  if constexpr (requires { O::name; })
    return O::name;
  else
    return {};
}

//! Throws an Error naming the first difference between the file's parameters and `layout`'s.
inline void check_parameters(const std::string& file, const TrainingStateInfo& info, const ParameterLayout& layout) {
  const auto entries = layout.entries();
  const std::size_t common = std::min(entries.size(), info.parameters.size());
  for (std::size_t i = 0; i < common; ++i) {
    const auto& [name, shape] = info.parameters[i];
    const ParameterSpec& spec = entries[i].spec;
    if (name != spec.name)
      throw Error(file + ": parameter " + loom::detail::to_text(i), name,
                  "the model's parameter " + loom::detail::to_text(i) + " is " + spec.name +
                      " (the checkpoint is of another model)");
    if (!(shape == spec.shape))
      throw Error(file + ": shape of " + name, shape,
                  "the model's is " + loom::detail::to_text(spec.shape) +
                      " (another model config; the file holds whole, unsharded tensors)");
  }
  if (info.parameters.size() != entries.size())
    throw Error(file + ": parameters", info.parameters.size(),
                "the model has " + loom::detail::to_text(entries.size()) + " (the checkpoint is of another model)");
}

//! Reads and checks the header and the trailer of `file`; returns the info and the checksums.
inline TrainingStateInfo read_training_state_header(BinaryFile& file, std::vector<std::uint64_t>& array_sums) {
  const std::uint64_t size = file.size();
  HeaderReader in(file, size);
  const auto magic = in.get<std::array<char, 8>>("magic");
  check_intact(magic == training_state_magic, file.name() + ": magic", printable(magic),
               "expected LOOMSTAT (a loom training-state checkpoint; llm.c weight files are read by --init)");
  const auto version = in.get<std::uint32_t>("version");
  LOOM_CHECK(version >= 1 && version <= training_state_version, file.name() + ": version", version,
             "this loom reads versions 1 to " + loom::detail::to_text(training_state_version));
  TrainingStateInfo info;
  info.version = static_cast<int>(version);
  info.scalar_bytes = static_cast<int>(in.get<std::uint32_t>("scalar bytes"));
  check_intact(info.scalar_bytes == 4 || info.scalar_bytes == 8, file.name() + ": scalar bytes", info.scalar_bytes,
               "must be 4 (fp32) or 8 (double)");
  info.steps = in.get<std::int64_t>("steps");
  check_intact(info.steps >= 0, file.name() + ": steps", info.steps, "must be >= 0");
  info.state_slots = in.get<std::int32_t>("state slots");
  check_intact(info.state_slots >= 0 && info.state_slots <= 8, file.name() + ": state slots", info.state_slots,
               "must be in [0, 8]");
  (void)in.get<std::int32_t>("reserved");
  info.optimizer = in.get_string("optimizer name");
  info.meta = in.get_string("meta");
  const auto count = in.get<std::uint64_t>("parameter count");
  check_intact(count <= size / 16, file.name() + ": parameter count", count, "more than the file can hold: corrupt");
  std::int64_t elements = 0;
  for (std::uint64_t p = 0; p < count; ++p) {
    std::string name = in.get_string("parameter name");
    const auto rank = in.get<std::uint32_t>("rank of " + name);
    check_intact(rank <= 4, file.name() + ": rank of " + name, rank, "must be <= 4: corrupt");
    std::vector<std::int64_t> extents;
    for (std::uint32_t d = 0; d < rank; ++d) {
      extents.push_back(in.get<std::int64_t>("shape of " + name));
      check_intact(extents.back() >= 0 && extents.back() <= (std::int64_t{1} << 40),
                   file.name() + ": shape of " + name, extents.back(), "must be in [0, 2^40]: corrupt");
    }
    Shape shape = Shape::of(extents);
    elements += shape.numel();
    info.parameters.emplace_back(std::move(name), shape);
  }
  info.elements = in.get<std::int64_t>("elements");
  check_intact(info.elements == elements, file.name() + ": elements", info.elements,
               "the parameters' shapes add up to " + loom::detail::to_text(elements) + ": corrupt");
  if (info.version >= 3) {
    info.tensor_elements = in.get<std::int64_t>("tensor elements");
    check_intact(info.tensor_elements >= 0 && static_cast<std::uint64_t>(info.tensor_elements) <= size / 8,
                 file.name() + ": tensor elements", info.tensor_elements, "more than the file can hold: corrupt");
  }
  const std::uint64_t header_sum = in.hash();
  const std::uint64_t arrays = 1 + static_cast<std::uint64_t>(info.state_slots);
  const std::uint64_t expected =
      in.bytes_read() + arrays * static_cast<std::uint64_t>(elements) * static_cast<std::uint64_t>(info.scalar_bytes) +
      8 * static_cast<std::uint64_t>(info.tensor_elements) + trailer_bytes(info.state_slots, info.version);
  check_intact(size == expected, file.name() + ": size", loom::detail::to_text(size) + " bytes",
               "expected " + loom::detail::to_text(expected) + " for its header (" +
                   (size < expected ? "the file is truncated: an interrupted copy?" : "extra bytes at the end") + ")");
  const std::uint64_t arrays_begin = in.bytes_read();
  file.seek(size - trailer_bytes(info.state_slots, info.version));
  std::uint64_t stored_header_sum = 0;
  file.read(&stored_header_sum, 8, "header checksum");
  // The per-tensor state's checksum (0 before version 3, which had none) after the arrays'.
  array_sums.assign(arrays + 1, 0);
  file.read(array_sums.data(), 8 * (arrays + (info.version >= 3 ? 1 : 0)), "array checksums");
  std::array<char, 8> end{};
  file.read(end.data(), end.size(), "closing magic");
  check_intact(end == training_state_magic, file.name() + ": closing magic", printable(end),
               "expected LOOMSTAT: the file is corrupt");
  check_intact(stored_header_sum == header_sum, file.name() + ": header checksum", header_sum,
               "the trailer records " + loom::detail::to_text(stored_header_sum) + ": the header is corrupt");
  file.seek(arrays_begin);
  return info;
}

//! A file read and written at byte offsets (POSIX pread and pwrite), so that every rank of a mesh
//! can write and read its own pieces of one checkpoint at the same time; every failure is a
//! loom::Error naming the file, what was being done and the reason.
class PositionalFile {
 public:
  enum class Mode { read, write, create };
  //! Opens `path` to read, to write (it must exist), or creates it (truncating what was there).
  PositionalFile(std::filesystem::path path, Mode mode, std::string kind)
      : path_(std::move(path)), kind_(std::move(kind)) {
    const int flags = mode == Mode::read ? O_RDONLY : mode == Mode::write ? O_RDWR : O_RDWR | O_CREAT | O_TRUNC;
    fd_ = ::open(path_.c_str(), flags | O_CLOEXEC, 0644);
    if (fd_ < 0)
      throw Error(kind_ + ": cannot open " + quoted(path_) + (mode == Mode::read ? "" : " for writing"),
                  errno_text(errno),
                  mode == Mode::create ? "the directory must exist and be writable"
                  : mode == Mode::write
                      ? "the file must exist and be writable (every rank writes its part of one file, so all of them "
                        "must see the same directory: a shared filesystem across machines)"
                      : "the file must exist and be readable");
  }
  PositionalFile(const PositionalFile&) = delete;
  PositionalFile& operator=(const PositionalFile&) = delete;
  ~PositionalFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  std::string name() const { return kind_ + " " + quoted(path_); }

  //! Reads exactly `bytes` bytes of `what` from byte `offset`.
  void read_at(std::uint64_t offset, void* data, std::size_t bytes, std::string_view what) const {
    auto* p = static_cast<char*>(data);
    for (std::size_t done = 0; done < bytes;) {
      const ::ssize_t got = ::pread(fd_, p + done, bytes - done, static_cast<::off_t>(offset + done));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0)
        throw Error(name() + ": reading " + std::string(what) + " at byte " + loom::detail::to_text(offset + done),
                    got == 0 ? std::string("end of file") : errno_text(errno),
                    got == 0 ? "the file ended early" : "read failed");
      done += static_cast<std::size_t>(got);
    }
  }
  //! Writes `bytes` bytes of `what` at byte `offset`.
  void write_at(std::uint64_t offset, const void* data, std::size_t bytes, std::string_view what) const {
    const auto* p = static_cast<const char*>(data);
    for (std::size_t done = 0; done < bytes;) {
      const ::ssize_t put = ::pwrite(fd_, p + done, bytes - done, static_cast<::off_t>(offset + done));
      if (put < 0 && errno == EINTR) continue;
      if (put <= 0)
        throw Error(name() + ": writing " + std::string(what) + " at byte " + loom::detail::to_text(offset + done),
                    errno_text(errno), "write failed (disk full?)");
      done += static_cast<std::size_t>(put);
    }
  }
  //! Gives the file `bytes` bytes of disk space, so that a full disk shows here, before any rank
  //! writes its part.
  void reserve(std::uint64_t bytes) const {
    const int code = ::posix_fallocate(fd_, 0, static_cast<::off_t>(bytes));
    if (code != 0)
      throw Error(name() + ": reserving " + loom::detail::to_text(bytes) + " bytes", errno_text(code),
                  "the file's whole size must fit on the disk");
  }
  //! Waits until the file's contents are on the disk (every rank's writes, not only this one's).
  void sync() const {
    if (::fsync(fd_) != 0) throw Error(name() + ": fsync", errno_text(errno), "flushing the file failed (disk full?)");
  }
  //! Closes the file, reporting errors a destructor would swallow (on a network filesystem, the
  //! last of this rank's writes).
  void close() {
    if (::close(std::exchange(fd_, -1)) != 0)
      throw Error(name() + ": close", errno_text(errno), "writing the file failed (disk full?)");
  }

 private:
  std::filesystem::path path_;
  std::string kind_;
  int fd_ = -1;
};

//! Calls fn(data, n, done) for bytes [offset, offset + bytes) of `file`, read 8 MiB at a time
//! (`done` bytes before these n): a multiple of 8, so that no 8-byte word or scalar straddles two reads.
template <class Fn>
void for_each_chunk(const PositionalFile& file, std::uint64_t offset, std::uint64_t bytes, std::string_view what,
                    Fn&& fn) {
  std::vector<char> buffer(static_cast<std::size_t>(std::min<std::uint64_t>(std::uint64_t{8} << 20, bytes)));
  for (std::uint64_t done = 0; done < bytes;) {
    const auto n = static_cast<std::size_t>(std::min<std::uint64_t>(buffer.size(), bytes - done));
    file.read_at(offset + done, buffer.data(), n, what);
    fn(buffer.data(), n, done);
    done += n;
  }
}

//! checksum() of bytes [offset, offset + bytes) of `file` (the array checksums of version 1 files).
inline std::uint64_t checksum_of(const PositionalFile& file, std::uint64_t offset, std::uint64_t bytes,
                                 std::string_view what) {
  std::uint64_t hash = 0xcbf29ce484222325ull;
  for_each_chunk(file, offset, bytes, what,
                 [&](const char* data, std::size_t n, std::uint64_t) { hash = checksum(data, n, hash); });
  return hash;
}

//! elements_checksum of `count` scalars of `width` bytes at byte `offset` of `file`, element 0 first.
inline std::uint64_t elements_checksum_of(const PositionalFile& file, std::uint64_t offset, std::size_t width,
                                          std::int64_t count, std::string_view what) {
  std::uint64_t sum = 0;
  for_each_chunk(file, offset, static_cast<std::uint64_t>(count) * width, what,
                 [&](const char* data, std::size_t n, std::uint64_t done) {
                   sum += elements_checksum(data, width, static_cast<std::int64_t>(done / width),
                                            static_cast<std::int64_t>(n / width));
                 });
  return sum;
}

//! Where array 0 begins in a training-state file of `file_bytes` with header `info` (read_training_state_header
//! has checked that the sizes add up): the arrays, the per-tensor state and the trailer end the file.
inline std::uint64_t arrays_begin_of(const TrainingStateInfo& info, std::uint64_t file_bytes) {
  return file_bytes - trailer_bytes(info.state_slots, info.version) -
         8 * static_cast<std::uint64_t>(info.tensor_elements) -
         (1 + static_cast<std::uint64_t>(info.state_slots)) * static_cast<std::uint64_t>(info.elements) *
             static_cast<std::uint64_t>(info.scalar_bytes);
}

//! "array 1 (optimizer state slot 0)": how messages name training-state array `array`.
inline std::string array_name(int array) {
  return "array " + loom::detail::to_text(array) +
         (array == 0 ? " (parameters)" : " (optimizer state slot " + loom::detail::to_text(array - 1) + ")");
}

//! Throws unless `sum` is the checksum the trailer records for `array` (in `sums`).
inline void check_array_sum(const std::string& file, int array, const std::vector<std::uint64_t>& sums,
                            std::uint64_t sum) {
  const std::uint64_t recorded = sums[static_cast<std::size_t>(array)];
  check_intact(sum == recorded, file + ": checksum of " + array_name(array), sum,
               "the trailer records " + loom::detail::to_text(recorded) + ": the file is corrupt");
}

//! Throws unless `sum` is the checksum the trailer records for the per-tensor state (the last of
//! `sums`, after the `arrays` arrays').
inline void check_tensor_state_sum(const std::string& file, int arrays, const std::vector<std::uint64_t>& sums,
                                   std::uint64_t sum) {
  const std::uint64_t recorded = sums[static_cast<std::size_t>(arrays)];
  check_intact(sum == recorded, file + ": checksum of the per-tensor optimizer state", sum,
               "the trailer records " + loom::detail::to_text(recorded) + ": the file is corrupt");
}

//! Whether `runs` are the whole of an array of `elements`, in order.
inline bool whole_array(const std::vector<WholeRun>& runs, std::int64_t elements) {
  return runs.size() == 1 && runs[0].local == 0 && runs[0].whole == 0 && runs[0].count == elements;
}

//! Calls f(local, whole, count) for the pieces of the `owned` runs' whole ranges as they lie in
//! the `held` runs (whose local positions are a buffer's): where to find each owned element
//! among the held ones. Every owned element must be held.
template <class F>
void for_each_held(const std::vector<WholeRun>& owned, std::vector<WholeRun> held, F&& f) {
  std::sort(held.begin(), held.end(), [](const WholeRun& a, const WholeRun& b) { return a.whole < b.whole; });
  for (const WholeRun& o : owned) {
    for (std::int64_t at = o.whole, end = o.whole + o.count; at < end;) {
      auto it = std::upper_bound(held.begin(), held.end(), at,
                                 [](std::int64_t x, const WholeRun& r) { return x < r.whole; });
      LOOM_CHECK(it != held.begin() && at < std::prev(it)->whole + std::prev(it)->count,
                 "training state: owned element", at, "is not among the elements this rank holds");
      const WholeRun& h = *std::prev(it);
      const std::int64_t n = std::min(end, h.whole + h.count) - at;
      f(h.local + (at - h.whole), at, n);
      at += n;
    }
  }
}

//! What saving and loading need of a trainer, its type erased: the collective save and load
//! below are compiled once per state element type (float, double) instead of once per Trainer
//! type (a program with every strategy, schedule and optimizer has dozens), at the cost of a
//! virtual call per array. The members are the Trainer's of the same names.
template <class V>
class TrainingStateAccess {
 public:
  TrainingStateAccess(std::string optimizer_name, int state_slots)
      : optimizer_name(std::move(optimizer_name)), state_slots(state_slots) {}
  virtual ~TrainingStateAccess() = default;
  TrainingStateAccess(const TrainingStateAccess&) = delete;
  TrainingStateAccess& operator=(const TrainingStateAccess&) = delete;

  const std::string optimizer_name;  //!< Optimizer::name, or empty
  const int state_slots;             //!< Optimizer::state_slots
  int arrays() const noexcept { return 1 + state_slots; }

  //! Whether this rank is at data-parallel, tensor-parallel and pipeline position 0.
  virtual bool first_rank() const = 0;
  virtual std::int64_t steps() const = 0;
  virtual void set_steps(std::int64_t steps) = 0;
  virtual void sum_over_ranks(std::span<double> values) = 0;
  virtual const ParameterLayout& whole_layout() const = 0;
  virtual std::int64_t whole_tensor_state_size() const = 0;
  virtual std::vector<WholeRun> owned_state_runs() const = 0;
  virtual std::vector<WholeRun> needed_state_runs(int array) const = 0;
  //! Trainer::copy_owned_state into `out`, resized to the owned elements (its capacity kept).
  virtual void copy_owned_state(int array, std::vector<V>& out) = 0;
  virtual void load_needed_state(int array, std::span<const V> values) = 0;
  virtual std::vector<WholeRun> owned_tensor_state_runs() const = 0;
  virtual std::vector<WholeRun> needed_tensor_state_runs() const = 0;
  virtual std::vector<double> copy_tensor_state() const = 0;
  virtual void load_tensor_state(std::span<const double> values) = 0;
};

//! TrainingStateAccess over a Trainer (which must outlive it).
template <class Trainer>
class TrainerStateAccess final : public TrainingStateAccess<typename Trainer::state_type> {
  using V = typename Trainer::state_type;
  using O = typename Trainer::optimizer_type;

 public:
  explicit TrainerStateAccess(Trainer& trainer)
      : TrainingStateAccess<V>(detail::optimizer_name<O>(), O::state_slots), trainer_(trainer) {}

  bool first_rank() const override {
    return trainer_.data_parallel_rank() == 0 && trainer_.tensor_parallel_rank() == 0 && trainer_.pipeline_rank() == 0;
  }
  std::int64_t steps() const override { return trainer_.steps(); }
  void set_steps(std::int64_t steps) override { trainer_.set_steps(steps); }
  void sum_over_ranks(std::span<double> values) override { trainer_.sum_over_ranks(values); }
  const ParameterLayout& whole_layout() const override { return trainer_.whole_layout(); }
  std::int64_t whole_tensor_state_size() const override { return trainer_.whole_tensor_state_size(); }
  std::vector<WholeRun> owned_state_runs() const override { return trainer_.owned_state_runs(); }
  std::vector<WholeRun> needed_state_runs(int array) const override { return trainer_.needed_state_runs(array); }
  void copy_owned_state(int array, std::vector<V>& out) override {
    out.resize(static_cast<std::size_t>(trainer_.owned_state_elements()));
    trainer_.copy_owned_state(array, std::span<V>(out));
  }
  void load_needed_state(int array, std::span<const V> values) override { trainer_.load_needed_state(array, values); }
  std::vector<WholeRun> owned_tensor_state_runs() const override { return trainer_.owned_tensor_state_runs(); }
  std::vector<WholeRun> needed_tensor_state_runs() const override { return trainer_.needed_tensor_state_runs(); }
  std::vector<double> copy_tensor_state() const override { return trainer_.copy_tensor_state(); }
  void load_tensor_state(std::span<const double> values) override { trainer_.load_tensor_state(values); }

 private:
  Trainer& trainer_;
};

//! One phase of a collective save or load: runs `work` where `mine`, then sums `shared` (zeroed
//! first; slot 0 counts the ranks that failed, and with `count_other_failures` slot 1 those whose
//! failure was not a CorruptCheckpoint) over the trainer's mesh, so that no rank goes on alone. A
//! rank whose work throws still takes part in the sum, calls `cleanup` and rethrows. Returns
//! whether another rank failed (after calling `cleanup`).
template <class V, class Work, class Cleanup>
bool agreed_phase(TrainingStateAccess<V>& trainer, std::vector<double>& shared, bool mine, Work&& work,
                  Cleanup&& cleanup, bool count_other_failures = false) {
  std::fill(shared.begin(), shared.end(), 0.0);
  if (mine) {
    try {
      work();
    } catch (...) {
      shared.assign(shared.size(), 0.0);
      shared[0] = 1;
      if (count_other_failures) {
        try {
          throw;
        } catch (const CorruptCheckpoint&) {
        } catch (...) {
          shared[1] = 1;
        }
      }
      trainer.sum_over_ranks(shared);
      cleanup();
      throw;
    }
  }
  trainer.sum_over_ranks(shared);
  if (shared[0] == 0) return false;
  cleanup();
  return true;
}

//! The header of `trainer`'s training state, with `meta`.
template <class V>
HeaderBytes training_state_header(const TrainingStateAccess<V>& trainer, std::string_view meta) {
  HeaderBytes h;
  h.put(training_state_magic);
  h.put(training_state_version);
  h.put(static_cast<std::uint32_t>(sizeof(V)));
  h.put(static_cast<std::int64_t>(trainer.steps()));
  h.put(static_cast<std::int32_t>(trainer.state_slots));
  h.put(std::int32_t{0});
  h.put_string(trainer.optimizer_name);
  h.put_string(meta);
  const ParameterLayout& layout = trainer.whole_layout();
  h.put(static_cast<std::uint64_t>(layout.entries().size()));
  for (const ParameterLayout::Entry& e : layout.entries()) {
    h.put_string(e.spec.name);
    h.put(static_cast<std::uint32_t>(e.spec.shape.rank()));
    for (int d = 0; d < e.spec.shape.rank(); ++d) h.put(static_cast<std::int64_t>(e.spec.shape[d]));
  }
  h.put(static_cast<std::int64_t>(layout.total()));
  h.put(static_cast<std::int64_t>(trainer.whole_tensor_state_size()));
  return h;
}

}  // namespace detail

//! Reads the header of the training-state file at `path` (and checks its size and trailer)
//! without reading the arrays: what a program looks at before it builds the model.
inline TrainingStateInfo read_training_state_info(const std::filesystem::path& path) {
  detail::BinaryFile file(path, "rb", "training state");
  std::vector<std::uint64_t> sums;
  return detail::read_training_state_header(file, sums);
}

namespace detail {

//! Where the parts of a training-state file go: the header's bytes and the offsets after it.
struct SaveGeometry {
  HeaderBytes header;
  std::uint64_t header_bytes = 0;  //!< where array 0 begins
  std::uint64_t array_bytes = 0;   //!< bytes of each array
  std::uint64_t tensor_begin = 0;  //!< where the per-tensor state begins
  std::uint64_t trailer = 0;       //!< where the trailer begins
  std::uint64_t file_bytes = 0;    //!< the whole file
};

template <class V>
SaveGeometry save_geometry(const TrainingStateAccess<V>& trainer, std::string_view meta) {
  SaveGeometry g{.header = training_state_header(trainer, meta)};
  g.header_bytes = g.header.bytes().size();
  g.array_bytes = static_cast<std::uint64_t>(trainer.whole_layout().total()) * sizeof(V);
  g.tensor_begin = g.header_bytes + static_cast<std::uint64_t>(trainer.arrays()) * g.array_bytes;
  g.trailer = g.tensor_begin + 8 * static_cast<std::uint64_t>(trainer.whole_tensor_state_size());
  g.file_bytes = g.trailer + trailer_bytes(trainer.state_slots);
  return g;
}

//! The first phase of a save, on the creating rank: `tmp` created at the file's whole size (a
//! full disk fails here, before any rank writes) with the header in place.
inline void create_state_file(const std::filesystem::path& tmp, const SaveGeometry& g) {
  PositionalFile file(tmp, PositionalFile::Mode::create, "training state");
  file.reserve(g.file_bytes);
  file.write_at(0, g.header.bytes().data(), g.header_bytes, "header");
  file.close();
}

//! The second phase, on every rank: writes the elements this rank owns into `tmp` (array `a`'s
//! owned values from values_of(a), at `runs`; the per-tensor state from `tensor`, at
//! `tensor_runs`) and returns the checksum terms' sums, one per array and one for the per-tensor
//! state. A rank that owns nothing (a DDP replica other than the first) does not open the file.
template <class V, class ValuesOf>
std::vector<std::uint64_t> write_owned_part(const std::filesystem::path& tmp, const SaveGeometry& g, int arrays,
                                            const std::vector<WholeRun>& runs, ValuesOf&& values_of,
                                            const std::vector<WholeRun>& tensor_runs,
                                            const std::vector<double>& tensor) {
  std::vector<std::uint64_t> sums(static_cast<std::size_t>(arrays) + 1, 0);
  if (runs.empty() && tensor_runs.empty()) return sums;
  PositionalFile file(tmp, PositionalFile::Mode::write, "training state");
  for (int array = 0; array < arrays; ++array) {
    const std::vector<V>& values = values_of(array);
    const std::uint64_t begin = g.header_bytes + static_cast<std::uint64_t>(array) * g.array_bytes;
    for (const WholeRun& r : runs) {
      file.write_at(begin + static_cast<std::uint64_t>(r.whole) * sizeof(V), values.data() + r.local,
                    static_cast<std::size_t>(r.count) * sizeof(V), array_name(array));
      sums[static_cast<std::size_t>(array)] += elements_checksum(values.data() + r.local, sizeof(V), r.whole, r.count);
    }
  }
  for (const WholeRun& r : tensor_runs) {
    file.write_at(g.tensor_begin + static_cast<std::uint64_t>(r.whole) * 8, tensor.data() + r.local,
                  static_cast<std::size_t>(r.count) * 8, "per-tensor optimizer state");
    sums.back() += elements_checksum(tensor.data() + r.local, 8, r.whole, r.count);
  }
  file.close();
  return sums;
}

//! The last phase, on the creating rank: the trailer (the header's checksum, then `sums`, the
//! ranks' summed checksums) and the closing magic written, the file flushed to the disk and
//! renamed from `tmp` over `path`.
inline void finish_state_file(const std::filesystem::path& tmp, const std::filesystem::path& path,
                              const SaveGeometry& g, const std::vector<std::uint64_t>& sums) {
  std::vector<std::uint64_t> trailer{checksum(g.header.bytes().data(), g.header_bytes)};
  trailer.insert(trailer.end(), sums.begin(), sums.end());
  PositionalFile file(tmp, PositionalFile::Mode::write, "training state");
  file.write_at(g.trailer, trailer.data(), trailer.size() * sizeof(std::uint64_t), "checksums");
  file.write_at(g.trailer + trailer.size() * sizeof(std::uint64_t), training_state_magic.data(),
                training_state_magic.size(), "closing magic");
  file.sync();  // every rank's part, before the rename: a crash must not leave a renamed empty file
  file.close();
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec)
    throw Error("training state: renaming " + quoted(tmp) + " to " + quoted(path), ec.message(),
                "the directory must be writable");
}

//! `path` + ".tmp": where a save writes before its rename.
inline std::filesystem::path temporary_of(const std::filesystem::path& path) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  return tmp;
}

//! save_training_state, for one state element type.
template <class V>
void save_state(TrainingStateAccess<V>& trainer, const std::filesystem::path& path, std::string_view meta) {
  const int arrays = trainer.arrays();
  const bool creator = trainer.first_rank();
  const std::filesystem::path tmp = temporary_of(path);
  const SaveGeometry geometry = save_geometry(trainer, meta);
  // Each phase ends with the ranks summing `shared` over the mesh: slot 0 counts the ranks that
  // failed, so that none goes on alone; the others carry the checksums' limbs (each array's,
  // then the per-tensor state's).
  std::vector<double> shared(1 + (arrays + 1) * limbs);
  const auto remove_tmp = [&] {
    if (!creator) return;
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
  };
  auto phase = [&](bool mine, auto&& work) {
    if (!agreed_phase(trainer, shared, mine, work, remove_tmp)) return;
    throw Error("training state " + quoted(path), "not saved",
                "another rank failed to write its part; its error says why");
  };
  phase(creator, [&] { create_state_file(tmp, geometry); });
  phase(true, [&] {
    // One array at a time, in one buffer: a rank holds a copy of one array's owned elements,
    // not of all, and touches that buffer's pages once.
    std::vector<V> values;
    const std::vector<double> tensor = trainer.copy_tensor_state();
    const std::vector<std::uint64_t> sums = write_owned_part<V>(
        tmp, geometry, arrays, trainer.owned_state_runs(),
        [&](int array) -> const std::vector<V>& {
          trainer.copy_owned_state(array, values);
          return values;
        },
        trainer.owned_tensor_state_runs(), tensor);
    for (int array = 0; array <= arrays; ++array) put_limbs(sums[static_cast<std::size_t>(array)], shared.data() + 1 + array * limbs);
  });
  std::vector<std::uint64_t> sums;
  for (int array = 0; array <= arrays; ++array) sums.push_back(get_limbs(shared.data() + 1 + array * limbs));
  phase(creator, [&] { finish_state_file(tmp, path, geometry, sums); });
}

//! load_training_state, for one state element type.
template <class V>
TrainingStateInfo load_state(TrainingStateAccess<V>& trainer, const std::filesystem::path& path) {
  const int arrays = trainer.arrays();
  const bool first_rank = trainer.first_rank();
  // Each phase ends with the ranks summing `shared` over the mesh: slot 0 counts the ranks that
  // failed, slot 1 those whose failure was not a corrupt file; slots 2 to 5 carry an array's
  // checksum limbs. Every rank then throws a CorruptCheckpoint, or none does.
  std::vector<double> shared(2 + detail::limbs);
  double* const sum_limbs = shared.data() + 2;
  auto phase = [&](auto&& work) {
    if (!detail::agreed_phase(trainer, shared, true, work, [] {}, true)) return;
    if (shared[1] == 0)
      throw CorruptCheckpoint("training state " + detail::quoted(path), "not loaded",
                              "another rank found it corrupt; its error says why");
    throw Error("training state " + detail::quoted(path), "not loaded",
                "another rank failed to load it (a missing or different file there?); its error says why");
  };
  TrainingStateInfo info;
  std::vector<std::uint64_t> sums;
  std::uint64_t arrays_begin = 0;
  std::vector<std::vector<WholeRun>> runs(static_cast<std::size_t>(arrays));
  phase([&] {
    detail::BinaryFile header(path, "rb", "training state");
    info = detail::read_training_state_header(header, sums);
    detail::check_parameters(header.name(), info, trainer.whole_layout());
    const std::string& optimizer = trainer.optimizer_name;
    LOOM_CHECK(info.optimizer == optimizer && info.state_slots == trainer.state_slots, header.name() + ": optimizer",
               info.optimizer + " (" + loom::detail::to_text(info.state_slots) + " state slots)",
               "the trainer's is " + optimizer + " (" + loom::detail::to_text(trainer.state_slots) +
                   "); an optimizer's state means nothing to another");
    const std::uint64_t array_bytes = static_cast<std::uint64_t>(info.elements) * info.scalar_bytes;
    LOOM_CHECK(info.tensor_elements == trainer.whole_tensor_state_size(), header.name() + ": per-tensor state",
               loom::detail::to_text(info.tensor_elements) + " numbers",
               "the trainer's optimizer keeps " + loom::detail::to_text(trainer.whole_tensor_state_size()) +
                   " for this model: corrupt");
    arrays_begin = detail::arrays_begin_of(info, header.size());
    for (int array = 0; array < arrays; ++array)
      runs[static_cast<std::size_t>(array)] = trainer.needed_state_runs(array);
    if (info.version != 1 || !first_rank) return;
    // Version 1: FNV-1a sums need every byte of an array in order. A rank that reads all of an
    // array checks it as it goes (below); the first rank reads through those ranks read in part.
    const detail::PositionalFile file(path, detail::PositionalFile::Mode::read, "training state");
    for (int array = 0; array < arrays; ++array)
      if (!detail::whole_array(runs[static_cast<std::size_t>(array)], info.elements))
        detail::check_array_sum(
            file.name(), array, sums,
            detail::checksum_of(file, arrays_begin + static_cast<std::uint64_t>(array) * array_bytes, array_bytes,
                                detail::array_name(array)));
  });
  const auto width = static_cast<std::size_t>(info.scalar_bytes);
  const std::uint64_t array_bytes = static_cast<std::uint64_t>(info.elements) * width;
  const bool same_width = width == sizeof(V);
  // The file's bytes land in `values` when its scalars are V; otherwise in `raw`, then widened or
  // narrowed. Both are reused: each array's pages are touched once, not once per array.
  std::vector<V> values;
  std::vector<char> raw;
  // The runs this rank owns, and each one's place among the needed runs it reads: the elements
  // whose checksum terms it adds up (owned elements are held, and every element has one owner).
  const std::vector<WholeRun> owned = info.version == 1 ? std::vector<WholeRun>{} : trainer.owned_state_runs();
  std::unique_ptr<detail::PositionalFile> file;
  for (int array = 0; array < arrays; ++array) {
    const std::vector<WholeRun>& mine = runs[static_cast<std::size_t>(array)];
    phase([&] {
      if (!file)
        file = std::make_unique<detail::PositionalFile>(path, detail::PositionalFile::Mode::read, "training state");
      std::int64_t elements = 0;
      for (const WholeRun& r : mine) elements = std::max(elements, r.local + r.count);
      values.resize(static_cast<std::size_t>(elements));
      raw.resize(same_width ? 0 : static_cast<std::size_t>(elements) * width);
      char* const bytes = same_width ? reinterpret_cast<char*>(values.data()) : raw.data();
      const std::uint64_t begin = arrays_begin + static_cast<std::uint64_t>(array) * array_bytes;
      for (const WholeRun& r : mine)
        file->read_at(begin + static_cast<std::uint64_t>(r.whole) * width,
                      bytes + static_cast<std::size_t>(r.local) * width, static_cast<std::size_t>(r.count) * width,
                      detail::array_name(array));
      if (info.version == 1) {
        if (detail::whole_array(mine, info.elements))
          detail::check_array_sum(file->name(), array, sums, detail::checksum(bytes, array_bytes));
        return;
      }
      std::uint64_t sum = 0;
      detail::for_each_held(owned, mine, [&](std::int64_t local, std::int64_t whole, std::int64_t count) {
        sum += detail::elements_checksum(bytes + static_cast<std::size_t>(local) * width, width, whole, count);
      });
      detail::put_limbs(sum, sum_limbs);
    });
    if (info.version != 1)
      detail::check_array_sum("training state " + detail::quoted(path), array, sums,
                              detail::get_limbs(sum_limbs));
    if (!same_width) {
      for (std::size_t i = 0; i < values.size(); ++i) {
        if (width == 4) {
          float x;
          std::memcpy(&x, raw.data() + 4 * i, 4);
          values[i] = static_cast<V>(x);
        } else {
          double x;
          std::memcpy(&x, raw.data() + 8 * i, 8);
          values[i] = static_cast<V>(x);
        }
      }
    }
    trainer.load_needed_state(array, values);
  }
  // The per-tensor state (doubles after the arrays): every rank reads its stage's and adds up
  // the checksum terms of what it owns, as for the arrays.
  const std::vector<WholeRun> tensor_needed = trainer.needed_tensor_state_runs();
  const std::vector<WholeRun> tensor_owned = trainer.owned_tensor_state_runs();
  std::vector<double> tensor_values;
  phase([&] {
    std::int64_t numbers = 0;
    for (const WholeRun& r : tensor_needed) numbers = std::max(numbers, r.local + r.count);
    tensor_values.resize(static_cast<std::size_t>(numbers));
    const std::uint64_t begin = arrays_begin + static_cast<std::uint64_t>(arrays) * array_bytes;
    for (const WholeRun& r : tensor_needed)
      file->read_at(begin + static_cast<std::uint64_t>(r.whole) * 8, tensor_values.data() + r.local,
                    static_cast<std::size_t>(r.count) * 8, "per-tensor optimizer state");
    std::uint64_t sum = 0;
    detail::for_each_held(tensor_owned, tensor_needed, [&](std::int64_t local, std::int64_t whole, std::int64_t count) {
      sum += detail::elements_checksum(tensor_values.data() + local, 8, whole, count);
    });
    detail::put_limbs(sum, sum_limbs);
  });
  detail::check_tensor_state_sum("training state " + detail::quoted(path), arrays, sums, detail::get_limbs(sum_limbs));
  trainer.load_tensor_state(tensor_values);
  trainer.set_steps(info.steps);
  return info;
}

}  // namespace detail

//! Saves `trainer`'s training state to `path`: collective over the trainer's mesh. The rank at
//! data-parallel, tensor-parallel and pipeline position 0 creates `path + ".tmp"` at its whole
//! size; every rank writes the elements it owns (Trainer::owned_state_runs) into it at once and
//! adds up their checksum terms; the creating rank writes the summed checksums, flushes the file
//! to the disk and renames it over `path`. So no rank holds more than its own part, and a failure
//! never leaves a partial file where a good one was. The ranks must see one filesystem. A
//! failure on any rank throws on every rank (the failing rank's own error there, a pointer to it
//! elsewhere). `meta` is free text kept in the file (e.g. the model config as JSON).
template <class Trainer>
void save_training_state(Trainer& trainer, const std::filesystem::path& path, std::string_view meta = {}) {
  detail::TrainerStateAccess<Trainer> access(trainer);
  detail::save_state(access, path, meta);
}

//! Loads the training state at `path` into `trainer`: collective over the trainer's mesh. Every
//! rank reads the header and then only the elements it holds (Trainer::needed_state_runs), so no
//! rank holds more than its own part: the parameters, the optimizer state and the steps done, so
//! that the next step is the one after the saved run's last. The file must be of the same model
//! (names and whole shapes) and optimizer; mesh, strategy and schedule may differ, and so may the
//! precision (an fp32 state loads into a double model and back). Every array's checksum is
//! checked before any rank loads any of it: each rank adds up the terms of the elements it owns,
//! and the ranks compare the sum with the file's (version 1 files: the rank at position 0 reads
//! through the arrays ranks read only in part). A failure on any rank throws on every rank.
//! Returns the file's info.
template <class Trainer>
TrainingStateInfo load_training_state(Trainer& trainer, const std::filesystem::path& path) {
  detail::TrainerStateAccess<Trainer> access(trainer);
  return detail::load_state(access, path);
}


//! Reads all of the training-state file at `path` and compares every checksum its trailer
//! records with its bytes (the header's, each array's and the per-tensor state's): what a load
//! checks, without a trainer, a model or a mesh (for a file copied between machines, or one kept
//! to go back to). Returns its header; throws a CorruptCheckpoint naming the first part whose
//! bytes are wrong, or an Error when the file cannot be read.
inline TrainingStateInfo check_training_state(const std::filesystem::path& path) {
  std::vector<std::uint64_t> sums;
  TrainingStateInfo info;
  std::uint64_t size = 0;
  {
    detail::BinaryFile header(path, "rb", "training state");
    size = header.size();
    info = detail::read_training_state_header(header, sums);
  }
  const int arrays = 1 + info.state_slots;
  const auto width = static_cast<std::size_t>(info.scalar_bytes);
  const std::uint64_t array_bytes = static_cast<std::uint64_t>(info.elements) * width;
  const std::uint64_t arrays_begin = detail::arrays_begin_of(info, size);
  const std::uint64_t tensor_begin = arrays_begin + static_cast<std::uint64_t>(arrays) * array_bytes;
  const detail::PositionalFile file(path, detail::PositionalFile::Mode::read, "training state");
  for (int array = 0; array < arrays; ++array) {
    const std::uint64_t offset = arrays_begin + static_cast<std::uint64_t>(array) * array_bytes;
    const std::string what = detail::array_name(array);
    detail::check_array_sum(file.name(), array, sums,
                            info.version == 1 ? detail::checksum_of(file, offset, array_bytes, what)
                                              : detail::elements_checksum_of(file, offset, width, info.elements, what));
  }
  if (info.version >= 3) {
    const std::uint64_t sum =
        detail::elements_checksum_of(file, tensor_begin, 8, info.tensor_elements, "per-tensor optimizer state");
    detail::check_tensor_state_sum(file.name(), arrays, sums, sum);
  }
  return info;
}

//! A file of a series that load_newest_training_state passed over: its bytes are wrong.
struct SkippedCheckpoint {
  std::int64_t step = 0;           //!< the step its name says it was saved after
  std::filesystem::path path;      //!< its name in the series
  std::filesystem::path moved_to;  //!< where the first rank moved it, once a file has loaded (empty elsewhere)
  std::string reason;              //!< the CorruptCheckpoint's message (or where to find it: another rank's)
};

//! A series' file that load_newest_training_state loads, and the newer ones it passed over.
struct SeriesCheckpoint {
  CheckpointSeries::File file;             //!< the file
  TrainingStateInfo info;                  //!< its header
  std::vector<SkippedCheckpoint> skipped;  //!< the corrupt files after it, newest first
};

namespace detail {

//! What a caught exception says.
inline std::string message_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

//! `path` + ".corrupt", or + ".corrupt.N" for the first N from 2 that names no file: where a
//! corrupt file of a series goes, out of the series and beside it.
inline std::filesystem::path corrupt_name(const std::filesystem::path& path) {
  for (int n = 1;; ++n) {
    std::filesystem::path aside = path;
    aside += n == 1 ? std::string(".corrupt") : ".corrupt." + std::to_string(n);
    std::error_code ec;
    if (!std::filesystem::exists(std::filesystem::symlink_status(aside, ec))) return aside;
  }
}

}  // namespace detail

//! Loads the newest intact file of `series` into `trainer`: collective over the trainer's mesh.
//! The first rank lists the series. For its newest file every rank reads the header, calls
//! `accept(candidate)` (which refuses a file by throwing, alike on every rank: a run with
//! nothing left to do, say) and loads it (load_training_state). A file found corrupt on any rank,
//! in its header or in its arrays (CorruptCheckpoint), is passed over for the next older one; any
//! other failure (a file that cannot be read, or is another model's) throws on every rank at
//! once, since an older file would fail alike or hide it. Once a file has loaded, the first rank
//! renames each file passed over to `path + ".corrupt"`: out of the series, so that its later
//! saves, pruning and resumes do not take it for this run's newest, and kept, since nothing
//! that was on the disk is deleted. Returns nothing when the series has no file; throws,
//! renaming nothing, when every file is corrupt. A file that fails its checksums part-way
//! through a load leaves the trainer part-loaded; the older file's load then replaces all of it.
template <class Trainer, class Accept>
std::optional<SeriesCheckpoint> load_newest_training_state(Trainer& trainer, const CheckpointSeries& series,
                                                           Accept&& accept) {
  detail::TrainerStateAccess<Trainer> access(trainer);
  const bool first = access.first_rank();
  const std::string subject = "checkpoint series " + series.pattern().string();
  // The first rank's list, newest last; a failure to list reaches every rank at the first offer.
  std::vector<CheckpointSeries::File> files;
  std::exception_ptr list_failure;
  if (first) {
    try {
      files = series.list();
    } catch (...) {
      list_failure = std::current_exception();
    }
  }
  std::vector<SkippedCheckpoint> skipped;
  for (std::size_t offered = 0;; ++offered) {
    // The first rank offers its next file, as its step + 1 (exact in a double below 2^53), or 0
    // when none is left.
    std::array<double, 2> offer{0, 0};
    if (list_failure)
      offer[0] = 1;
    else if (first && offered < files.size())
      offer[1] = static_cast<double>(files[files.size() - 1 - offered].step + 1);
    access.sum_over_ranks(offer);
    if (offer[0] > 0) {
      if (list_failure) std::rethrow_exception(list_failure);
      throw Error(subject, "not listed", "the first rank could not list it; its error says why");
    }
    if (offer[1] == 0) break;
    const auto step = static_cast<std::int64_t>(offer[1]) - 1;
    const std::filesystem::path path = series.path_for(step);

    // The header, on every rank: slot 0 counts the ranks that failed, slot 1 those whose failure
    // was not a corrupt file.
    SeriesCheckpoint candidate{.file = {step, path}, .info = {}, .skipped = skipped};
    std::exception_ptr failure;
    std::array<double, 2> failed{0, 0};
    try {
      candidate.info = read_training_state_info(path);
    } catch (const CorruptCheckpoint&) {
      failure = std::current_exception();
      failed[0] = 1;
    } catch (...) {
      failure = std::current_exception();
      failed = {1, 1};
    }
    access.sum_over_ranks(failed);
    if (failed[1] > 0) {
      if (failure) std::rethrow_exception(failure);
      throw Error(subject + ": " + detail::quoted(path), "not read",
                  "another rank could not read its header; its error says why");
    }
    const auto pass_over = [&](std::string reason) {
      skipped.push_back({.step = step, .path = path, .moved_to = {}, .reason = std::move(reason)});
    };
    if (failed[0] > 0) {
      pass_over(failure ? detail::message_of(failure) : "another rank found its header corrupt; its error says why");
      continue;
    }
    accept(std::as_const(candidate));
    try {
      // load_state throws a CorruptCheckpoint on every rank or on none.
      load_training_state(trainer, path);
    } catch (const CorruptCheckpoint& e) {
      pass_over(e.what());
      continue;
    }

    // Loaded: the files passed over leave the series, on the first rank.
    std::array<double, 1> move_failed{0};
    std::exception_ptr move_failure;
    if (first) {
      try {
        for (SkippedCheckpoint& s : skipped) {
          const std::filesystem::path aside = detail::corrupt_name(s.path);
          std::error_code ec;
          std::filesystem::rename(s.path, aside, ec);
          if (ec)
            throw Error(subject + ": moving the corrupt " + detail::quoted(s.path) + " to " + detail::quoted(aside),
                        ec.message(),
                        "the directory must be writable; move or delete it yourself, then resume again");
          s.moved_to = aside;
        }
      } catch (...) {
        move_failure = std::current_exception();
        move_failed[0] = 1;
      }
    }
    access.sum_over_ranks(move_failed);
    if (move_failed[0] > 0) {
      if (move_failure) std::rethrow_exception(move_failure);
      throw Error(subject, "corrupt files not moved out", "the first rank could not move them; its error says why");
    }
    candidate.skipped = std::move(skipped);
    return candidate;
  }
  if (skipped.empty()) return std::nullopt;
  std::string steps;
  for (const SkippedCheckpoint& s : skipped) steps += (steps.empty() ? "" : ", ") + std::to_string(s.step);
  throw Error(subject, "every file corrupt (steps " + steps + ")",
              "there is no intact one to resume from; nothing was moved. The newest's error: " +
                  skipped.front().reason);
}

//! load_newest_training_state accepting any file.
template <class Trainer>
std::optional<SeriesCheckpoint> load_newest_training_state(Trainer& trainer, const CheckpointSeries& series) {
  return load_newest_training_state(trainer, series, [](const SeriesCheckpoint&) {});
}

}  // namespace loom::io
