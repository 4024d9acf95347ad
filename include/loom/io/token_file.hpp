#pragma once
//! \file Token data from files: llm.c token files (a 1024-byte header, then uint16 tokens, or
//! uint32 tokens in llm.c's Llama 3 form) and raw byte files (vocabulary 256). Both are
//! TokenSources whose windows tile the data.

#include <array>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <variant>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/io/batch.hpp"

namespace loom::io {

namespace detail {

// The file formats are little-endian; so far every host loom targets is too.
static_assert(std::endian::native == std::endian::little,
              "loom: io reads and writes little-endian files and supports little-endian hosts "
              "only");

//! "'path'" for messages.
inline std::string quoted(const std::filesystem::path& path) {
  std::string text(1, '\'');  // appended piecewise: "'" + string&& trips GCC 12's -Wrestrict
  text += path.string();
  text += '\'';
  return text;
}

//! Text of the current errno.
inline std::string errno_text(int code) { return std::error_code(code, std::generic_category()).message(); }

//! A FILE* that closes itself; every failure is a loom::Error naming the file and the reason.
class BinaryFile {
 public:
  //! Opens `path` with fopen `mode`; `kind` ("token file", ...) names the format in messages.
  BinaryFile(std::filesystem::path path, const char* mode, std::string kind)
      : path_(std::move(path)), kind_(std::move(kind)) {
    errno = 0;
    file_ = std::fopen(path_.string().c_str(), mode);
    if (file_ == nullptr) {
      const bool writing = mode[0] != 'r';
      throw Error(kind_ + ": cannot open " + quoted(path_) + (writing ? " for writing" : ""),
                  errno_text(errno),
                  writing ? "the directory must exist and be writable"
                          : "the file must exist and be readable");
    }
  }
  BinaryFile(const BinaryFile&) = delete;
  BinaryFile& operator=(const BinaryFile&) = delete;
  ~BinaryFile() {
    if (file_ != nullptr) std::fclose(file_);
  }

  const std::filesystem::path& path() const noexcept { return path_; }
  //! "token file 'path'": the subject of messages about this file.
  std::string name() const { return kind_ + " " + quoted(path_); }

  //! Size in bytes (a directory or special file is an error).
  std::uint64_t size() const {
    std::error_code ec;
    const auto bytes = std::filesystem::file_size(path_, ec);
    if (ec) throw Error(name() + ": cannot read size", ec.message(), "must be a regular file");
    return bytes;
  }

  //! Reads exactly `bytes` bytes of `what` into `data`.
  void read(void* data, std::size_t bytes, std::string_view what) {
    errno = 0;
    const std::size_t got = std::fread(data, 1, bytes, file_);
    if (got != bytes) {
      const bool eof = std::feof(file_) != 0;
      throw Error(name() + ": reading " + std::string(what),
                  eof ? detail::to_text(got) + " bytes" : errno_text(errno),
                  eof ? "expected " + detail::to_text(bytes) + " bytes (the file ended early)"
                      : "read failed");
    }
  }

  //! Moves to byte `offset` from the start.
  void seek(std::uint64_t offset) {
    errno = 0;
    if (offset > static_cast<std::uint64_t>(std::numeric_limits<long>::max()) ||
        std::fseek(file_, static_cast<long>(offset), SEEK_SET) != 0)
      throw Error(name() + ": seek to byte", offset, errno_text(errno));
  }

  //! Writes `bytes` bytes from `data`.
  void write(const void* data, std::size_t bytes) {
    errno = 0;
    if (bytes != 0 && std::fwrite(data, 1, bytes, file_) != bytes)
      throw Error(name() + ": write", errno_text(errno), "write failed (disk full?)");
  }

  //! Flushes and closes, reporting errors that a destructor would swallow.
  void close() {
    errno = 0;
    std::FILE* f = std::exchange(file_, nullptr);
    const bool flushed = std::fflush(f) == 0 && std::ferror(f) == 0;
    const int flush_errno = errno;
    const bool closed = std::fclose(f) == 0;
    if (!flushed || !closed)
      throw Error(name() + ": close", errno_text(flushed ? errno : flush_errno),
                  "flushing the file failed (disk full?)");
  }

 private:
  std::filesystem::path path_;
  std::string kind_;
  std::FILE* file_ = nullptr;
};

//! Writes a file through `path + ".tmp"` and a rename, so that a failure (of `fill`, of the
//! disk, of the rename) never leaves a partial file where `path` was: the old file, if any,
//! stays as it was. `fill(BinaryFile&)` writes the contents.
template <class Fill>
void write_file_replacing(const std::filesystem::path& path, const std::string& kind,
                          Fill&& fill) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  {
    BinaryFile file(tmp, "wb", kind);  // throws before creating anything
    try {
      fill(file);
      file.close();
    } catch (...) {
      std::error_code ignored;
      std::filesystem::remove(tmp, ignored);
      throw;
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::error_code ignored;
    std::filesystem::remove(tmp, ignored);
    throw Error(kind + ": cannot move " + quoted(tmp) + " to " + quoted(path), ec.message(),
                "the destination must be a replaceable file; it was left as it was");
  }
}

//! An llm.c file header: 256 little-endian int32.
using Header = std::array<std::int32_t, 256>;
inline constexpr std::uint64_t header_bytes = sizeof(Header);

//! Reads the header of `file`, after checking the file can hold one.
inline Header read_header(BinaryFile& file, std::uint64_t file_bytes) {
  if (file_bytes < header_bytes)
    throw Error(file.name() + ": size", detail::to_text(file_bytes) + " bytes",
                "too short for the 1024-byte header (256 int32) that llm.c files start with");
  Header header{};
  file.read(header.data(), header_bytes, "header");
  return header;
}

//! (a * b) mod m for 0 <= a, b < m, without overflow.
inline std::uint64_t mul_mod(std::uint64_t a, std::uint64_t b, std::uint64_t m) {
#if defined(__SIZEOF_INT128__)
  __extension__ using Wide = unsigned __int128;
  return static_cast<std::uint64_t>(static_cast<Wide>(a) * b % m);
#else
  std::uint64_t result = 0;
  a %= m;
  for (; b != 0; b >>= 1) {
    if (b & 1) result = (result >= m - a) ? result - (m - a) : result + a;
    a = (a >= m - a) ? a - (m - a) : a + a;
  }
  return result;
#endif
}

//! The whole of file `path` as text (a config, an index, a tokenizer), `kind` naming the format
//! in messages (BinaryFile's).
inline std::string read_text_file(const std::filesystem::path& path, const std::string& kind) {
  BinaryFile file(path, "rb", kind);
  std::string text(static_cast<std::size_t>(file.size()), '\0');
  file.read(text.data(), text.size(), "the whole file");
  return text;
}

}  // namespace detail

//! Magic number in word 0 of an llm.c token file header (GPT-2's form: uint16 tokens).
inline constexpr std::int32_t llmc_tokens_magic = 20240520;
//! Version in word 1 of an llm.c token file header (uint16 tokens).
inline constexpr std::int32_t llmc_tokens_version = 1;
//! Magic number and version of llm.c's token files for vocabularies past 65536 tokens (its
//! "llama-3" form, dev/data/data_common.py: uint32 tokens).
inline constexpr std::int32_t llmc_wide_tokens_magic = 20240801;
inline constexpr std::int32_t llmc_wide_tokens_version = 7;

namespace detail {

//! write_token_file for tokens of either width, under header {magic, version, count, 0...}.
template <class T>
void write_token_file(const std::filesystem::path& path, std::span<const T> tokens, std::int32_t magic,
                      std::int32_t version) {
  LOOM_CHECK(tokens.size() <= static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()),
             "token file " + detail::quoted(path) + ": token count", tokens.size(),
             "the header stores the count as int32: at most 2147483647 tokens per file");
  detail::write_file_replacing(path, "token file", [&](detail::BinaryFile& file) {
    detail::Header header{};
    header[0] = magic;
    header[1] = version;
    header[2] = static_cast<std::int32_t>(tokens.size());
    file.write(header.data(), detail::header_bytes);
    file.write(tokens.data(), tokens.size_bytes());
  });
}

}  // namespace detail

//! Writes `tokens` as an llm.c token file: header {20240520, 1, count, 0...} then the tokens as
//! little-endian uint16. Writes `path + ".tmp"` and renames it, so a failure leaves any old file
//! at `path` intact.
inline void write_token_file(const std::filesystem::path& path,
                             std::span<const std::uint16_t> tokens) {
  detail::write_token_file(path, tokens, llmc_tokens_magic, llmc_tokens_version);
}

//! Writes `tokens` as llm.c's token file for large vocabularies (Llama 3's 128,256, tiktoken's
//! cl100k_base): header {20240801, 7, count, 0...} then the tokens as little-endian uint32, by
//! way of `path + ".tmp"` as above.
inline void write_token_file(const std::filesystem::path& path,
                             std::span<const std::uint32_t> tokens) {
  detail::write_token_file(path, tokens, llmc_wide_tokens_magic, llmc_wide_tokens_version);
}

//! A whole file of tokens held in memory, as a TokenSource.
//!
//! Sequence `i` of step `s` (global sequence `j = s * batch + i`) is the window of `seq + 1`
//! tokens starting at `(j * seq) mod (n - seq)`: its first `seq` tokens are the inputs, its last
//! `seq` the targets. Consecutive windows tile the data and wrap around at the end.
class TokenFile {
 public:
  //! Reads an llm.c token file: GPT-2's form (magic 20240520, version 1, uint16 tokens) or the
  //! one for large vocabularies (20240801, version 7, uint32 tokens), kept at the file's width.
  //! Rejects a missing file, a file too short for the header, a wrong magic or version, a token
  //! count that disagrees with the file size, and any token >= `vocab_size` (naming its position).
  static TokenFile open(const std::filesystem::path& path, std::int64_t vocab_size) {
    check_vocab(vocab_size);
    detail::BinaryFile file(path, "rb", "token file");
    const std::uint64_t bytes = file.size();
    const detail::Header header = detail::read_header(file, bytes);
    const bool wide = header[0] == llmc_wide_tokens_magic;
    if (header[0] != llmc_tokens_magic && !wide)
      throw Error(file.name() + ": magic number", header[0],
                  "expected 20240520 (an llm.c token file, uint16 tokens) or 20240801 (one of uint32 tokens)" +
                      std::string(header[0] == 20240326 ? "; this is an llm.c model checkpoint"
                                                        : ""));
    if (wide)
      LOOM_CHECK(header[1] == llmc_wide_tokens_version, file.name() + ": version", header[1],
                 "expected 7 with magic 20240801 (uint32 tokens)");
    else
      LOOM_CHECK(header[1] == llmc_tokens_version, file.name() + ": version", header[1],
                 "expected 1 with magic 20240520 (uint16 tokens)");
    const std::int64_t count = header[2];
    LOOM_CHECK(count >= 0, file.name() + ": token count in the header", count, "must be >= 0");
    const std::uint64_t width = wide ? 4 : 2;
    const std::uint64_t payload = bytes - detail::header_bytes;
    const std::uint64_t expected = width * static_cast<std::uint64_t>(count);
    if (payload != expected) {
      const std::string found = detail::to_text(payload / width) + " tokens (" +
                                detail::to_text(payload) + " bytes) after the header";
      throw Error(file.name() + (payload < expected ? ": truncated" : ": size"), found,
                  "the header says " + detail::to_text(count) + " tokens (" +
                      detail::to_text(expected) + " bytes)" +
                      (payload < expected ? "" : "; the file has extra bytes"));
    }
    if (wide) {
      std::vector<std::uint32_t> tokens(static_cast<std::size_t>(count));
      file.read(tokens.data(), expected, "tokens");
      return TokenFile(std::move(tokens), vocab_size, file.name());
    }
    std::vector<std::uint16_t> tokens(static_cast<std::size_t>(count));
    file.read(tokens.data(), expected, "tokens");
    return TokenFile(std::move(tokens), vocab_size, file.name());
  }

  //! Reads any file as bytes: token = byte value, vocabulary 256 (text, binaries).
  static TokenFile bytes(const std::filesystem::path& path) {
    detail::BinaryFile file(path, "rb", "byte file");
    const std::uint64_t size = file.size();
    std::vector<unsigned char> raw(static_cast<std::size_t>(size));
    file.read(raw.data(), raw.size(), "bytes");
    return TokenFile(std::vector<std::uint16_t>(raw.begin(), raw.end()), 256, file.name());
  }

  //! Tokens already in memory (e.g. from a tokenizer); each must be < `vocab_size`.
  TokenFile(std::vector<std::uint16_t> tokens, std::int64_t vocab_size)
      : TokenFile(std::move(tokens), vocab_size, "in-memory tokens") {}

  //! The same for a vocabulary past 65536 tokens.
  TokenFile(std::vector<std::uint32_t> tokens, std::int64_t vocab_size)
      : TokenFile(std::move(tokens), vocab_size, "in-memory tokens") {}

  //! The vocabulary the tokens were checked against.
  std::int64_t vocab_size() const noexcept { return vocab_size_; }
  //! Number of tokens.
  std::int64_t size() const noexcept {
    return std::visit([](const auto& t) { return static_cast<std::int64_t>(t.size()); }, tokens_);
  }
  //! Token `i` (0 <= i < size()).
  std::int64_t token(std::int64_t i) const noexcept {
    return std::visit([i](const auto& t) { return static_cast<std::int64_t>(t[static_cast<std::size_t>(i)]); },
                      tokens_);
  }
  //! Bytes a token takes in memory and in its file: 2, or 4 for a file of uint32 tokens.
  int token_bytes() const noexcept { return tokens_.index() == 0 ? 2 : 4; }
  //! "token file 'path'", "byte file 'path'" or "in-memory tokens".
  const std::string& name() const noexcept { return name_; }

  //! The global batch of step `step`: `batch` windows of `seq + 1` tokens (see the class note).
  Batch batch_at(std::int64_t step, std::int64_t batch, std::int64_t seq) const {
    detail::check_batch_request(name_, step, batch, seq);
    const std::int64_t n = size();
    LOOM_CHECK(n >= seq + 1, name_ + ": token count", n,
               "a sequence of seq = " + detail::to_text(seq) + " needs at least seq + 1 = " +
                   detail::to_text(seq + 1) + " tokens");
    const auto starts = static_cast<std::uint64_t>(n - seq);  // window starts 0 .. n-seq-1
    Batch out = Batch::zeros(batch, seq);
    for (std::int64_t i = 0; i < batch; ++i) {
      const auto sequence = static_cast<std::uint64_t>(step * batch + i);
      const auto start = static_cast<std::size_t>(
          detail::mul_mod(sequence % starts, static_cast<std::uint64_t>(seq) % starts, starts));
      std::int32_t* tokens = out.tokens.data() + i * seq;
      std::int32_t* targets = out.targets.data() + i * seq;
      std::visit(
          [&](const auto& all) {
            const auto* window = all.data() + start;
            for (std::int64_t t = 0; t < seq; ++t) {
              tokens[t] = static_cast<std::int32_t>(window[t]);
              targets[t] = static_cast<std::int32_t>(window[t + 1]);
            }
          },
          tokens_);
    }
    return out;
  }

 private:
  template <class T>
  TokenFile(std::vector<T> tokens, std::int64_t vocab_size, std::string name)
      : tokens_(std::move(tokens)), vocab_size_(vocab_size), name_(std::move(name)) {
    check_vocab(vocab_size_);
    const auto& all = std::get<std::vector<T>>(tokens_);
    for (std::size_t i = 0; i < all.size(); ++i)
      if (all[i] >= vocab_size_) [[unlikely]]
        throw Error(name_ + ": token at position " + detail::to_text(i), all[i],
                    "tokens must be < vocab_size (" + detail::to_text(vocab_size_) + ")");
  }

  static void check_vocab(std::int64_t vocab_size) {
    LOOM_CHECK(vocab_size >= 1 && vocab_size <= std::numeric_limits<std::int32_t>::max(), "token file: vocab_size",
               vocab_size, "must be in [1, 2147483647] (a batch holds tokens as int32)");
  }

  std::variant<std::vector<std::uint16_t>, std::vector<std::uint32_t>> tokens_;
  std::int64_t vocab_size_ = 0;
  std::string name_;
};

static_assert(TokenSource<TokenFile>);

}  // namespace loom::io
