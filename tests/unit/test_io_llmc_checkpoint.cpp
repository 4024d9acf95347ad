// GPT-2 checkpoints in llm.c's format: round trip, a hand-built file, bad files, safe saving.

#include <doctest/doctest.h>

#include "support/error_of.hpp"
#include "support/temp_path.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "loom/core/parameters.hpp"
#include "loom/io/llmc_checkpoint.hpp"
#include "loom/models/gpt2/config.hpp"

namespace test_io_llmc_checkpoint {

namespace {

namespace fs = std::filesystem;
using loom::ParameterLayout;
using loom::gpt2::Config;

using loom::test::TempPath;

using loom::test::contains;
using loom::test::error_of;

//! L=2, C=8, 2 heads, V=10 padded to 16, T=4.
Config tiny_config() {
  return {.max_seq_len = 4, .vocab_size = 10, .padded_vocab_size = 16, .num_layers = 2,
          .num_heads = 2, .channels = 8};
}

std::vector<std::int32_t> header_of(const Config& c, std::int32_t magic = 20240326,
                                    std::int32_t version = 3) {
  std::vector<std::int32_t> h(256, 0);
  h[0] = magic;
  h[1] = version;
  h[2] = static_cast<std::int32_t>(c.max_seq_len);
  h[3] = static_cast<std::int32_t>(c.vocab_size);
  h[4] = static_cast<std::int32_t>(c.num_layers);
  h[5] = static_cast<std::int32_t>(c.num_heads);
  h[6] = static_cast<std::int32_t>(c.channels);
  h[7] = static_cast<std::int32_t>(c.padded_vocab_size);
  return h;
}

//! Element counts of llm.c's 16 tensors, in file order (as in llm.c's fill_in_parameter_sizes).
std::vector<std::int64_t> llmc_sizes(const Config& c) {
  const std::int64_t C = c.channels, L = c.num_layers;
  return {c.padded_vocab_size * C, c.max_seq_len * C, L * C, L * C, L * 3 * C * C, L * 3 * C,
          L * C * C, L * C, L * C, L * C, L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C};
}

//! Value of element `position` of tensor `tensor` in the hand-built file.
float marker(std::int64_t tensor, std::int64_t position) {
  return static_cast<float>(tensor * 1000 + position);
}

//! Writes a checkpoint by hand: header, then each tensor filled with marker values. bf16 files
//! hold the bit pattern (tensor << 8 | position & 0xff) instead.
void write_hand_built(const fs::path& path, const Config& c, std::int32_t version = 3) {
  std::ofstream out(path, std::ios::binary);
  const auto header = header_of(c, 20240326, version);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  const auto sizes = llmc_sizes(c);
  for (std::size_t tensor = 0; tensor < sizes.size(); ++tensor)
    for (std::int64_t k = 0; k < sizes[tensor]; ++k) {
      if (version == 5) {
        const auto bits = static_cast<std::uint16_t>((tensor << 8) | (k & 0xff));
        out.write(reinterpret_cast<const char*>(&bits), 2);
      } else {
        const float v = marker(static_cast<std::int64_t>(tensor), k);
        out.write(reinterpret_cast<const char*>(&v), 4);
      }
    }
}

}  // namespace

TEST_CASE("llm.c checkpoint: save then load is bit-exact") {
  const Config c = tiny_config();
  const ParameterLayout layout(loom::gpt2::parameter_specs(c));
  std::vector<float> weights(static_cast<std::size_t>(layout.total()));
  layout.initialize(weights.data(), 2024);
  // Odd values too: negative zero, denormals, large numbers.
  weights[3] = -0.0f;
  weights[4] = 1e-40f;
  weights[layout.find("ln_f.bias").offset] = 3.4e38f;
  // Whatever sits in wte's padding rows is not saved.
  const auto& wte = layout.find("wte");
  for (std::int64_t k = c.vocab_size * c.channels; k < wte.numel(); ++k)
    weights[static_cast<std::size_t>(wte.offset + k)] = 7.0f;

  TempPath file("ckpt_roundtrip");
  loom::io::save_llmc_checkpoint(file.path, c, layout, weights.data());
  CHECK_FALSE(fs::exists(file.str() + ".tmp"));
  CHECK(fs::file_size(file.path) ==
        static_cast<std::uintmax_t>(1024 + 4 * c.stored_parameter_count()));
  CHECK(loom::io::read_llmc_config(file.path) == c);

  std::vector<float> loaded(weights.size(), 123.0f);
  loom::io::load_llmc_checkpoint(file.path, c, layout, loaded.data());
  for (std::int64_t k = c.vocab_size * c.channels; k < wte.numel(); ++k)
    weights[static_cast<std::size_t>(wte.offset + k)] = 0.0f;  // padding comes back as zeros
  CHECK(std::memcmp(loaded.data(), weights.data(), weights.size() * sizeof(float)) == 0);

  // The file is llm.c's layout: wte first, lnfb last.
  std::ifstream in(file.path, std::ios::binary);
  std::vector<float> raw(static_cast<std::size_t>(c.stored_parameter_count()));
  in.seekg(1024);
  in.read(reinterpret_cast<char*>(raw.data()), static_cast<std::streamsize>(raw.size() * 4));
  CHECK(raw[0] == weights[static_cast<std::size_t>(wte.offset)]);
  CHECK(raw.back() == weights[static_cast<std::size_t>(layout.find("ln_f.bias").offset + 7)]);
  CHECK(raw[static_cast<std::size_t>(c.vocab_size * c.channels)] == 0.0f);
}

TEST_CASE("llm.c checkpoint: a hand-built file lands in the right loom parameters") {
  const Config c = tiny_config();
  const std::int64_t C = c.channels;
  const ParameterLayout layout(loom::gpt2::parameter_specs(c));
  TempPath file("ckpt_hand");
  write_hand_built(file.path, c);
  CHECK(loom::io::read_llmc_config(file.path) == c);

  std::vector<float> flat(static_cast<std::size_t>(layout.total()), -1.0f);
  loom::io::load_llmc_checkpoint(file.path, c, layout, flat.data());
  auto at = [&](const std::string& name, std::int64_t k) {
    return layout.view(flat.data(), name)[k];
  };
  // wte (tensor 0): real rows hold the file, padding rows are zero.
  CHECK(at("wte", 0) == marker(0, 0));
  CHECK(at("wte", 9 * C + 7) == marker(0, 9 * C + 7));
  const auto wte = layout.view(flat.data(), "wte");
  CHECK(std::all_of(wte.begin() + 10 * C, wte.end(), [](float x) { return x == 0.0f; }));
  CHECK(at("wpe", 3 * C + 2) == marker(1, 3 * C + 2));
  // [L, ...] tensors: block l's parameter is the l-th slab.
  CHECK(at("h.0.ln_1.weight", 5) == marker(2, 5));
  CHECK(at("h.1.ln_1.weight", 5) == marker(2, C + 5));
  CHECK(at("h.1.ln_1.bias", 0) == marker(3, C));
  CHECK(at("h.0.attn.qkv.weight", 2 * C + 3) == marker(4, 2 * C + 3));  // [out=2, in=3]
  CHECK(at("h.1.attn.qkv.weight", 17 * C + 1) == marker(4, 3 * C * C + 17 * C + 1));
  CHECK(at("h.1.attn.qkv.bias", 23) == marker(5, 3 * C + 23));
  CHECK(at("h.0.attn.proj.weight", 63) == marker(6, 63));
  CHECK(at("h.1.attn.proj.bias", 4) == marker(7, C + 4));
  CHECK(at("h.1.ln_2.weight", 1) == marker(8, C + 1));
  CHECK(at("h.0.ln_2.bias", 6) == marker(9, 6));
  CHECK(at("h.1.mlp.fc.weight", 31 * C + 7) == marker(10, 4 * C * C + 31 * C + 7));
  CHECK(at("h.1.mlp.fc.bias", 0) == marker(11, 4 * C));
  CHECK(at("h.1.mlp.fc.bias", 31) == marker(11, 4 * C + 31));
  CHECK(at("h.0.mlp.proj.weight", 1 * 4 * C + 30) == marker(12, 4 * C + 30));  // [out=1, in=30]
  CHECK(at("h.1.mlp.proj.bias", 7) == marker(13, C + 7));
  CHECK(at("ln_f.weight", 3) == marker(14, 3));
  CHECK(at("ln_f.bias", 0) == marker(15, 0));
  CHECK(at("ln_f.bias", 7) == marker(15, 7));
  // Every element was written.
  CHECK(std::count(flat.begin(), flat.end(), -1.0f) == 0);
}

TEST_CASE("llm.c checkpoint: bfloat16 files (version 5) widen exactly") {
  const Config c = tiny_config();
  const ParameterLayout layout(loom::gpt2::parameter_specs(c));
  TempPath file("ckpt_bf16");
  write_hand_built(file.path, c, 5);
  CHECK(loom::io::read_llmc_config(file.path) == c);
  std::vector<float> flat(static_cast<std::size_t>(layout.total()), -1.0f);
  loom::io::load_llmc_checkpoint(file.path, c, layout, flat.data());
  auto expected = [](std::uint32_t tensor, std::int64_t k) {
    return std::bit_cast<float>(((tensor << 8) | static_cast<std::uint32_t>(k & 0xff)) << 16);
  };
  auto at = [&](const std::string& name, std::int64_t k) {
    return layout.view(flat.data(), name)[k];
  };
  CHECK(at("wpe", 5) == expected(1, 5));
  CHECK(at("h.1.mlp.fc.bias", 3) == expected(11, 4 * c.channels + 3));
  CHECK(at("ln_f.bias", 6) == expected(15, 6));
  CHECK(at("wte", 15 * c.channels) == 0.0f);
}

TEST_CASE("llm.c checkpoint: bad files are rejected, naming the value") {
  const Config c = tiny_config();
  const ParameterLayout layout(loom::gpt2::parameter_specs(c));
  std::vector<float> flat(static_cast<std::size_t>(layout.total()), 0.0f);
  TempPath file("ckpt_bad");
  auto load = [&] { loom::io::load_llmc_checkpoint(file.path, c, layout, flat.data()); };
  auto patch_word = [&](int word, std::int32_t value) {
    std::fstream io(file.path, std::ios::binary | std::ios::in | std::ios::out);
    io.seekp(word * 4);
    io.write(reinterpret_cast<const char*>(&value), 4);
  };
  write_hand_built(file.path, c);

  SUBCASE("missing file") {
    TempPath missing("ckpt_missing");
    const std::string msg =
        error_of([&] { loom::io::load_llmc_checkpoint(missing.path, c, layout, flat.data()); });
    CHECK(contains(msg, missing.str()));
    CHECK(contains(msg, "No such file or directory"));
    CHECK_THROWS_AS(loom::io::read_llmc_config(missing.path), loom::Error);
  }
  SUBCASE("wrong magic") {
    patch_word(0, 20240520);
    const std::string msg = error_of(load);
    CHECK(contains(msg, "magic number: got 20240520; expected 20240326"));
    CHECK(contains(msg, "token file"));
    CHECK_THROWS_WITH_AS(loom::io::read_llmc_config(file.path), doctest::Contains("got 20240520"),
                         loom::Error);
  }
  SUBCASE("wrong version") {
    patch_word(1, 4);
    CHECK_THROWS_WITH_AS(load(), doctest::Contains("version: got 4; expected 3 (float32) or 5"),
                         loom::Error);
    CHECK_THROWS_WITH_AS(loom::io::read_llmc_config(file.path),
                         doctest::Contains("version: got 4"), loom::Error);
  }
  SUBCASE("header differs from the expected config") {
    const Config other = {.max_seq_len = 4, .vocab_size = 10, .padded_vocab_size = 16,
                          .num_layers = 3, .num_heads = 2, .channels = 8};
    const ParameterLayout other_layout(loom::gpt2::parameter_specs(other));
    std::vector<float> other_flat(static_cast<std::size_t>(other_layout.total()));
    CHECK_THROWS_WITH_AS(
        loom::io::load_llmc_checkpoint(file.path, other, other_layout, other_flat.data()),
        doctest::Contains("header num_layers: got 2; expected 3"), loom::Error);
    patch_word(6, 16);  // channels
    CHECK_THROWS_WITH_AS(load(), doctest::Contains("header channels: got 16; expected 8"),
                         loom::Error);
  }
  SUBCASE("a header that breaks the config rules") {
    patch_word(5, 3);  // 3 heads do not divide 8 channels
    CHECK_THROWS_WITH_AS(loom::io::read_llmc_config(file.path),
                         doctest::Contains("header gpt2 config: channels: got 8"), loom::Error);
  }
  SUBCASE("truncated") {
    const auto full = fs::file_size(file.path);
    fs::resize_file(file.path, full - 4);
    const std::string msg = error_of(load);
    CHECK(contains(msg, "truncated: got " + std::to_string(full - 4) + " bytes"));
    CHECK(contains(msg, "expected " + std::to_string(full) + " bytes"));
    fs::resize_file(file.path, 1000);
    CHECK_THROWS_WITH_AS(load(), doctest::Contains("1000 bytes"), loom::Error);
  }
  SUBCASE("oversized") {
    const auto full = fs::file_size(file.path);
    fs::resize_file(file.path, full + 8);
    const std::string msg = error_of(load);
    CHECK(contains(msg, "got " + std::to_string(full + 8) + " bytes"));
    CHECK(contains(msg, "expected " + std::to_string(full) + " bytes"));
  }
  SUBCASE("a layout that is not GPT-2's") {
    std::vector<loom::ParameterSpec> specs = loom::gpt2::parameter_specs(c);
    specs.pop_back();  // no ln_f.bias
    const ParameterLayout partial(specs);
    CHECK_THROWS_WITH_AS(loom::io::load_llmc_checkpoint(file.path, c, partial, flat.data()),
                         doctest::Contains("parameter layout: got ln_f.bias"), loom::Error);
    specs = loom::gpt2::parameter_specs(c);
    specs[1].shape = {2, c.channels};  // a sharded wpe
    const ParameterLayout sharded(specs);
    CHECK_THROWS_WITH_AS(loom::io::save_llmc_checkpoint(file.path, c, sharded, flat.data()),
                         doctest::Contains("shape of parameter wpe: got [2, 8]; expected [4, 8]"),
                         loom::Error);
  }
}

TEST_CASE("llm.c checkpoint: a failed save leaves the old file intact") {
  const Config c = tiny_config();
  const ParameterLayout layout(loom::gpt2::parameter_specs(c));
  std::vector<float> good(static_cast<std::size_t>(layout.total()));
  layout.initialize(good.data(), 1);
  std::vector<float> other(good.size(), 0.5f);
  TempPath file("ckpt_safe");
  loom::io::save_llmc_checkpoint(file.path, c, layout, good.data());
  const auto size_before = fs::file_size(file.path);

  auto old_file_is_intact = [&] {
    std::vector<float> loaded(good.size());
    loom::io::load_llmc_checkpoint(file.path, c, layout, loaded.data());
    return std::memcmp(loaded.data(), good.data(), good.size() * sizeof(float)) == 0 &&
           fs::file_size(file.path) == size_before;
  };

  SUBCASE("the temporary file cannot be created") {
    fs::create_directory(file.str() + ".tmp");  // fopen(path.tmp, "wb") fails, even for root
    const std::string msg =
        error_of([&] { loom::io::save_llmc_checkpoint(file.path, c, layout, other.data()); });
    CHECK(contains(msg, "cannot open '" + file.str() + ".tmp' for writing"));
    CHECK(old_file_is_intact());
    CHECK(fs::is_directory(file.str() + ".tmp"));  // not ours to remove
  }
  SUBCASE("the directory does not exist") {
    const fs::path nowhere = file.path / "sub" / "model.bin";
    CHECK_THROWS_AS(loom::io::save_llmc_checkpoint(nowhere, c, layout, other.data()),
                    loom::Error);
    CHECK(old_file_is_intact());
  }
  SUBCASE("a bad config is rejected before any file is touched") {
    Config bad = c;
    bad.num_heads = 3;
    CHECK_THROWS_AS(loom::io::save_llmc_checkpoint(file.path, bad, layout, other.data()),
                    loom::Error);
    CHECK(old_file_is_intact());
  }
  SUBCASE("the destination is a directory: the rename fails, nothing is left behind") {
    TempPath dir("ckpt_dir");
    fs::create_directory(dir.path);
    fs::path inside = dir.path / "keep.txt";
    std::ofstream(inside) << "keep";
    const std::string msg =
        error_of([&] { loom::io::save_llmc_checkpoint(dir.path, c, layout, other.data()); });
    CHECK(contains(msg, "cannot move"));
    CHECK(fs::is_directory(dir.path));
    CHECK(fs::exists(inside));
    CHECK_FALSE(fs::exists(dir.str() + ".tmp"));
  }
  SUBCASE("a successful save replaces the file") {
    loom::io::save_llmc_checkpoint(file.path, c, layout, other.data());
    std::vector<float> loaded(good.size());
    loom::io::load_llmc_checkpoint(file.path, c, layout, loaded.data());
    CHECK(loaded[static_cast<std::size_t>(layout.find("wpe").offset)] == 0.5f);
    CHECK_FALSE(fs::exists(file.str() + ".tmp"));
  }
}

}  // namespace test_io_llmc_checkpoint
