// Token files (llm.c format and raw bytes), Batch slicing and the TokenSource concept.

#include <doctest/doctest.h>

#include "support/error_of.hpp"
#include "support/temp_path.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "loom/io/batch.hpp"
#include "loom/io/token_file.hpp"

namespace test_io_token_file {

namespace {

namespace fs = std::filesystem;
using loom::io::Batch;
using loom::io::TokenFile;
using loom::test::error_of;

//! A unique path under the temp directory, removed (with anything at path + ".tmp") at scope end.
using loom::test::TempPath;

void write_bytes(const fs::path& path, const void* data, std::size_t n) {
  std::ofstream out(path, std::ios::binary);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}

//! An llm.c token file with an arbitrary header and payload.
void write_raw_token_file(const fs::path& path, std::int32_t magic, std::int32_t version,
                          std::int32_t count, const std::vector<std::uint16_t>& tokens) {
  std::vector<std::int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  out.write(reinterpret_cast<const char*>(tokens.data()),
            static_cast<std::streamsize>(tokens.size() * 2));
}

std::vector<std::uint16_t> iota_tokens(std::size_t n) {
  std::vector<std::uint16_t> t(n);
  std::iota(t.begin(), t.end(), std::uint16_t{0});
  return t;
}

}  // namespace

TEST_CASE("Batch: views, target_count, rows") {
  Batch b = Batch::zeros(4, 3);
  std::iota(b.tokens.begin(), b.tokens.end(), 0);
  std::iota(b.targets.begin(), b.targets.end(), 100);
  b.targets[1] = -1;
  b.targets[11] = -100;
  CHECK(b.tokens_view().shape() == loom::Shape{4, 3});
  CHECK(b.targets_view().shape() == loom::Shape{4, 3});
  CHECK(b.targets_view()[2] == 102);
  CHECK(b.target_count() == 10);

  const Batch middle = b.rows(1, 2);
  CHECK(middle.batch == 2);
  CHECK(middle.seq == 3);
  CHECK(middle.tokens == std::vector<std::int32_t>{3, 4, 5, 6, 7, 8});
  CHECK(middle.targets == std::vector<std::int32_t>{103, 104, 105, 106, 107, 108});
  CHECK(b.rows(0, 4) == b);
  CHECK(b.rows(3, 1).target_count() == 2);

  // Two ranks, two micro-batches each: the four slices put back together are the global batch.
  std::vector<std::int32_t> joined;
  for (int rank = 0; rank < 2; ++rank) {
    const Batch share = b.rows(rank * 2, 2);
    for (int micro = 0; micro < 2; ++micro) {
      const Batch mb = share.rows(micro, 1);
      joined.insert(joined.end(), mb.tokens.begin(), mb.tokens.end());
    }
  }
  CHECK(joined == b.tokens);

  CHECK_THROWS_WITH_AS(b.rows(-1, 1), doctest::Contains("first: got -1"), loom::Error);
  CHECK_THROWS_WITH_AS(b.rows(4, 1), doctest::Contains("first: got 4"), loom::Error);
  CHECK_THROWS_WITH_AS(b.rows(3, 2), doctest::Contains("count: got 2"), loom::Error);
  CHECK_THROWS_WITH_AS(b.rows(0, 0), doctest::Contains("count: got 0"), loom::Error);
}

namespace {
struct ArchetypeSource {
  std::int64_t vocab_size() const { return 2; }
  Batch batch_at(std::int64_t, std::int64_t b, std::int64_t t) const { return Batch::zeros(b, t); }
};
struct MutableBatchAt {  // near miss: batch_at is not const
  std::int64_t vocab_size() const { return 2; }
  Batch batch_at(std::int64_t, std::int64_t b, std::int64_t t) { return Batch::zeros(b, t); }
};
struct NoVocab {  // near miss: no vocab_size
  Batch batch_at(std::int64_t, std::int64_t b, std::int64_t t) const { return Batch::zeros(b, t); }
};
}  // namespace

TEST_CASE("TokenSource concept") {
  static_assert(loom::io::TokenSource<ArchetypeSource>);
  static_assert(loom::io::TokenSource<TokenFile>);
  static_assert(!loom::io::TokenSource<MutableBatchAt>);
  static_assert(!loom::io::TokenSource<NoVocab>);
  static_assert(!loom::io::TokenSource<int>);
}

TEST_CASE("token file: write and open round trip") {
  TempPath file("tokens_roundtrip");
  std::vector<std::uint16_t> tokens = {0, 1, 50256, 65535, 7, 7, 300, 2};
  loom::io::write_token_file(file.path, tokens);
  CHECK(fs::file_size(file.path) == 1024 + 2 * tokens.size());
  CHECK_FALSE(fs::exists(file.str() + ".tmp"));

  const TokenFile read = TokenFile::open(file.path, 65536);
  CHECK(read.size() == 8);
  CHECK(read.vocab_size() == 65536);
  CHECK(read.token_bytes() == 2);
  for (std::size_t i = 0; i < tokens.size(); ++i) CHECK(read.token(static_cast<std::int64_t>(i)) == tokens[i]);

  // Header words as llm.c writes them.
  std::ifstream in(file.path, std::ios::binary);
  std::int32_t header[3];
  in.read(reinterpret_cast<char*>(header), sizeof header);
  CHECK(header[0] == 20240520);
  CHECK(header[1] == 1);
  CHECK(header[2] == 8);

  // An empty file of tokens is valid; it only cannot make a batch.
  loom::io::write_token_file(file.path, std::span<const std::uint16_t>{});
  CHECK(TokenFile::open(file.path, 10).size() == 0);
}

TEST_CASE("token file: bad files are rejected with the offending values") {
  TempPath file("tokens_bad");

  SUBCASE("missing file names the path and the system's reason") {
    const std::string msg = error_of([&] { TokenFile::open(file.path, 256); });
    CHECK(msg.find(file.str()) != std::string::npos);
    CHECK(msg.find("No such file or directory") != std::string::npos);
  }
  SUBCASE("too short for a header") {
    const std::vector<char> junk(100, 'x');
    write_bytes(file.path, junk.data(), junk.size());
    const std::string msg = error_of([&] { TokenFile::open(file.path, 256); });
    CHECK(msg.find("100 bytes") != std::string::npos);
    CHECK(msg.find("1024-byte header") != std::string::npos);
  }
  SUBCASE("wrong magic") {
    write_raw_token_file(file.path, 12345, 1, 4, iota_tokens(4));
    CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 256),
                         doctest::Contains("magic number: got 12345; expected 20240520"),
                         loom::Error);
  }
  SUBCASE("a model checkpoint is recognised as such") {
    write_raw_token_file(file.path, 20240326, 3, 4, iota_tokens(4));
    CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 256),
                         doctest::Contains("llm.c model checkpoint"), loom::Error);
  }
  SUBCASE("wrong version") {
    write_raw_token_file(file.path, 20240520, 2, 4, iota_tokens(4));
    CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 256),
                         doctest::Contains("version: got 2; expected 1"), loom::Error);
  }
  SUBCASE("truncated: fewer tokens than the header says") {
    write_raw_token_file(file.path, 20240520, 1, 100, iota_tokens(60));
    const std::string msg = error_of([&] { TokenFile::open(file.path, 256); });
    CHECK(msg.find("truncated") != std::string::npos);
    CHECK(msg.find("got 60 tokens") != std::string::npos);
    CHECK(msg.find("header says 100 tokens") != std::string::npos);
  }
  SUBCASE("odd trailing byte counts as truncated") {
    loom::io::write_token_file(file.path, iota_tokens(10));
    fs::resize_file(file.path, 1024 + 19);
    CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 256), doctest::Contains("9 tokens (19 bytes)"),
                         loom::Error);
  }
  SUBCASE("more tokens than the header says") {
    write_raw_token_file(file.path, 20240520, 1, 10, iota_tokens(12));
    const std::string msg = error_of([&] { TokenFile::open(file.path, 256); });
    CHECK(msg.find("got 12 tokens") != std::string::npos);
    CHECK(msg.find("header says 10 tokens") != std::string::npos);
    CHECK(msg.find("extra bytes") != std::string::npos);
  }
  SUBCASE("negative count") {
    write_raw_token_file(file.path, 20240520, 1, -5, {});
    CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 256), doctest::Contains("got -5"),
                         loom::Error);
  }
  SUBCASE("token out of the vocabulary names its position and value") {
    std::vector<std::uint16_t> tokens = iota_tokens(10);
    tokens[7] = 300;
    loom::io::write_token_file(file.path, tokens);
    CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 256),
                         doctest::Contains("token at position 7: got 300; tokens must be < "
                                           "vocab_size (256)"),
                         loom::Error);
    CHECK(TokenFile::open(file.path, 301).size() == 10);
  }
  SUBCASE("bad vocab_size") {
    loom::io::write_token_file(file.path, iota_tokens(4));
    CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 0), doctest::Contains("vocab_size: got 0"),
                         loom::Error);
    CHECK_THROWS_WITH_AS(TokenFile::open(file.path, std::int64_t{1} << 31),
                         doctest::Contains("vocab_size: got 2147483648; must be in [1, 2147483647]"), loom::Error);
    CHECK(TokenFile::open(file.path, 100277).vocab_size() == 100277);  // uint16 tokens, a larger vocabulary
  }
  SUBCASE("a directory is not a token file") {
    fs::create_directory(file.path);
    CHECK_THROWS_AS(TokenFile::open(file.path, 256), loom::Error);
  }
}

TEST_CASE("token file of uint32 tokens (llm.c's form for large vocabularies): write and open round trip") {
  TempPath file("tokens_wide");
  const std::vector<std::uint32_t> tokens = {0, 1, 65535, 65536, 100257, 128255, 7, 300};
  loom::io::write_token_file(file.path, std::span<const std::uint32_t>(tokens));
  CHECK(fs::file_size(file.path) == 1024 + 4 * tokens.size());
  std::int32_t header[3];
  std::ifstream(file.path, std::ios::binary).read(reinterpret_cast<char*>(header), sizeof header);
  CHECK(header[0] == 20240801);
  CHECK(header[1] == 7);
  CHECK(header[2] == 8);

  const TokenFile read = TokenFile::open(file.path, 128256);  // Llama 3's vocabulary
  CHECK(read.token_bytes() == 4);
  REQUIRE(read.size() == 8);
  for (std::size_t i = 0; i < tokens.size(); ++i) CHECK(read.token(static_cast<std::int64_t>(i)) == tokens[i]);
  const Batch b = read.batch_at(0, 1, 7);
  CHECK(b.tokens == std::vector<std::int32_t>{0, 1, 65535, 65536, 100257, 128255, 7});
  CHECK(b.targets == std::vector<std::int32_t>{1, 65535, 65536, 100257, 128255, 7, 300});
  // The same windows as the same tokens in memory, and as uint16 ones where they fit.
  const TokenFile memory(std::vector<std::uint32_t>(tokens), 128256);
  CHECK(memory.batch_at(3, 2, 3).tokens == read.batch_at(3, 2, 3).tokens);
  const std::vector<std::uint16_t> narrow_tokens = iota_tokens(20);
  const std::vector<std::uint32_t> wide_tokens(narrow_tokens.begin(), narrow_tokens.end());
  CHECK(TokenFile(narrow_tokens, 20).batch_at(2, 3, 4).targets == TokenFile(wide_tokens, 20).batch_at(2, 3, 4).targets);

  CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 128255),
                       doctest::Contains("token at position 5: got 128255; tokens must be < vocab_size (128255)"),
                       loom::Error);
  // A wide header with GPT-2's version, a narrow one with the wide version, a payload of the other width.
  std::fstream edit(file.path, std::ios::binary | std::ios::in | std::ios::out);
  const std::int32_t version_one = 1;
  edit.seekp(4);
  edit.write(reinterpret_cast<const char*>(&version_one), 4);
  edit.close();
  CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 128256),
                       doctest::Contains("version: got 1; expected 7 with magic 20240801 (uint32 tokens)"), loom::Error);
  loom::io::write_token_file(file.path, std::span<const std::uint32_t>(tokens.data(), 4));
  std::vector<char> bytes(fs::file_size(file.path));
  std::ifstream(file.path, std::ios::binary).read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const std::int32_t narrow[2] = {20240520, 1};
  std::copy_n(reinterpret_cast<const char*>(narrow), sizeof narrow, bytes.begin());
  std::ofstream(file.path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  CHECK_THROWS_WITH_AS(TokenFile::open(file.path, 128256),
                       doctest::Contains("size: got 8 tokens (16 bytes) after the header; the header says 4 tokens "
                                         "(8 bytes); the file has extra bytes"),
                       loom::Error);
}

TEST_CASE("token file: failed write leaves the old file intact") {
  TempPath file("tokens_replace");
  loom::io::write_token_file(file.path, iota_tokens(5));
  fs::create_directory(file.str() + ".tmp");  // the temporary cannot be created
  CHECK_THROWS_AS(loom::io::write_token_file(file.path, iota_tokens(9)), loom::Error);
  CHECK(TokenFile::open(file.path, 256).size() == 5);
}

TEST_CASE("byte files: every byte is a token, vocabulary 256") {
  TempPath file("bytes");
  std::string with_nul = "ab";
  with_nul.push_back('\0');
  with_nul += "\xff" "cd";
  write_bytes(file.path, with_nul.data(), with_nul.size());
  const TokenFile bytes = TokenFile::bytes(file.path);
  CHECK(bytes.vocab_size() == 256);
  REQUIRE(bytes.size() == 6);
  CHECK(bytes.token(0) == 'a');
  CHECK(bytes.token(2) == 0);
  CHECK(bytes.token(3) == 255);

  const Batch b = bytes.batch_at(0, 1, 5);
  CHECK(b.tokens == std::vector<std::int32_t>{'a', 'b', 0, 255, 'c'});
  CHECK(b.targets == std::vector<std::int32_t>{'b', 0, 255, 'c', 'd'});

  TempPath missing("bytes_missing");
  const std::string msg = error_of([&] { TokenFile::bytes(missing.path); });
  CHECK(msg.find(missing.str()) != std::string::npos);
  CHECK(msg.find("No such file or directory") != std::string::npos);
}

TEST_CASE("batch_at: windows tile the data and wrap") {
  const TokenFile source(iota_tokens(20), 20);  // token value == position
  const std::int64_t B = 2, T = 3, starts = 20 - T;
  for (std::int64_t step = 0; step < 10; ++step) {
    CAPTURE(step);
    const Batch b = source.batch_at(step, B, T);
    REQUIRE(b.batch == B);
    REQUIRE(b.seq == T);
    CHECK(b.target_count() == B * T);
    for (std::int64_t i = 0; i < B; ++i) {
      const std::int64_t start = ((step * B + i) * T) % starts;
      for (std::int64_t t = 0; t < T; ++t) {
        CHECK(b.tokens[i * T + t] == start + t);
        CHECK(b.targets[i * T + t] == start + t + 1);
      }
    }
  }
  // Step 2, sequence 1 is global sequence 5: it starts at 15 and its last target is token 18.
  CHECK(source.batch_at(2, B, T).rows(1, 1).tokens == std::vector<std::int32_t>{15, 16, 17});
  // Global sequence 6 wraps: 18 mod 17 = 1.
  CHECK(source.batch_at(3, B, T).rows(0, 1).tokens == std::vector<std::int32_t>{1, 2, 3});
  // The last token of the file is reachable as a target: n - T - 1 + T = n - 1.
  CHECK(source.batch_at(0, 1, 19).targets.back() == 19);
}

TEST_CASE("batch_at: deterministic and independent of how the batch is split") {
  std::vector<std::uint16_t> tokens(1000);
  std::mt19937 gen(7);
  for (auto& t : tokens) t = static_cast<std::uint16_t>(gen() % 500);
  const TokenFile source(tokens, 500);
  const Batch global = source.batch_at(5, 8, 16);
  CHECK(source.batch_at(5, 8, 16) == global);  // asking again changes nothing
  CHECK(source.batch_at(4, 8, 16) != global);
  // A data-parallel rank's slice is the same whoever computes it.
  CHECK(global.rows(4, 4) == source.batch_at(5, 8, 16).rows(4, 4));
  // Sequence j's window depends only on j: step 5 of batch 8 == steps 10 and 11 of batch 4.
  CHECK(global.rows(0, 4) == source.batch_at(10, 4, 16));
  CHECK(global.rows(4, 4) == source.batch_at(11, 4, 16));
  for (std::int64_t k = 0; k + 1 < 16; ++k)
    CHECK(global.targets[static_cast<std::size_t>(k)] == global.tokens[static_cast<std::size_t>(k + 1)]);
  // Very large steps do not overflow the window arithmetic.
  const Batch far = source.batch_at(std::int64_t{1} << 40, 8, 16);
  CHECK(far.batch == 8);
}

TEST_CASE("batch_at: bad requests") {
  const TokenFile source(iota_tokens(10), 10);
  CHECK_THROWS_WITH_AS(source.batch_at(0, 1, 10),
                       doctest::Contains("token count: got 10; a sequence of seq = 10 needs at "
                                         "least seq + 1 = 11 tokens"),
                       loom::Error);
  CHECK(source.batch_at(0, 1, 9).tokens.size() == 9);
  CHECK_THROWS_WITH_AS(source.batch_at(-1, 1, 2), doctest::Contains("step: got -1"), loom::Error);
  CHECK_THROWS_WITH_AS(source.batch_at(0, 0, 2), doctest::Contains("batch: got 0"), loom::Error);
  CHECK_THROWS_WITH_AS(source.batch_at(0, 1, 0), doctest::Contains("seq: got 0"), loom::Error);
  CHECK_THROWS_WITH_AS(TokenFile(iota_tokens(10), 5),
                       doctest::Contains("in-memory tokens: token at position 5: got 5"),
                       loom::Error);
}

}  // namespace test_io_token_file
