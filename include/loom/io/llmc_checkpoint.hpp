#pragma once
//! \file GPT-2 weights in llm.c's checkpoint format (the `gpt2_124M.bin` that llm.c's
//! train_gpt2.py writes and train_gpt2.c/.cu read), to and from a loom ParameterLayout.
//!
//! Format: a header of 256 little-endian int32 {20240326, version, max_seq_len, vocab_size,
//! num_layers, num_heads, channels, padded_vocab_size, 0...}, then 16 tensors back to back:
//! wte[Vp,C] wpe[T,C] ln1w[L,C] ln1b[L,C] qkvw[L,3C,C] qkvb[L,3C] attprojw[L,C,C] attprojb[L,C]
//! ln2w[L,C] ln2b[L,C] fcw[L,4C,C] fcb[L,4C] fcprojw[L,C,4C] fcprojb[L,C] lnfw[C] lnfb[C].
//! Version 3 stores float32, version 5 bfloat16 (read only). Linear weights are [out, in], as in
//! loom; an [L, ...] tensor is the L per-block loom parameters h.{l}.* one after another.

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/parameters.hpp"
#include "loom/io/token_file.hpp"
#include "loom/models/gpt2/config.hpp"

namespace loom::io {

//! Magic number in word 0 of an llm.c model checkpoint.
inline constexpr std::int32_t llmc_model_magic = 20240326;
//! Version word: float32 parameters (padded vocabulary).
inline constexpr std::int32_t llmc_model_version_fp32 = 3;
//! Version word: bfloat16 parameters (padded vocabulary); loom reads it, widening exactly.
inline constexpr std::int32_t llmc_model_version_bf16 = 5;

namespace detail {

//! One tensor of an llm.c checkpoint and the loom parameter(s) it holds.
struct LlmcTensor {
  const char* llmc_name;  //!< name in llm.c's ParameterTensors
  const char* loom_name;  //!< loom name (of each block's parameter when per_layer)
  bool per_layer;         //!< [L, ...]: block l's parameter is h.{l}.<loom_name>
};

//! The tensors of an llm.c checkpoint, in file order.
inline constexpr std::array<LlmcTensor, 16> llmc_tensors{{
    {"wte", "wte", false},
    {"wpe", "wpe", false},
    {"ln1w", "ln_1.weight", true},
    {"ln1b", "ln_1.bias", true},
    {"qkvw", "attn.qkv.weight", true},
    {"qkvb", "attn.qkv.bias", true},
    {"attprojw", "attn.proj.weight", true},
    {"attprojb", "attn.proj.bias", true},
    {"ln2w", "ln_2.weight", true},
    {"ln2b", "ln_2.bias", true},
    {"fcw", "mlp.fc.weight", true},
    {"fcb", "mlp.fc.bias", true},
    {"fcprojw", "mlp.proj.weight", true},
    {"fcprojb", "mlp.proj.bias", true},
    {"lnfw", "ln_f.weight", false},
    {"lnfb", "ln_f.bias", false},
}};

//! A run of consecutive file values that lands in one loom parameter.
struct LlmcRange {
  std::string name;         //!< loom parameter name
  std::int64_t offset = 0;  //!< first element in the flat buffer
  std::int64_t numel = 0;
};

//! Where every value of a checkpoint of `config` goes in `layout`, in file order. Checks that
//! the layout has each GPT-2 parameter with its global shape; `who` prefixes messages.
inline std::vector<LlmcRange> llmc_ranges(const gpt2::Config& config,
                                          const ParameterLayout& layout, const std::string& who) {
  const ParameterLayout reference(gpt2::parameter_specs(config));  // validates config
  std::vector<LlmcRange> ranges;
  for (const LlmcTensor& tensor : llmc_tensors) {
    const std::int64_t copies = tensor.per_layer ? config.num_layers : 1;
    for (std::int64_t l = 0; l < copies; ++l) {
      const std::string name =
          tensor.per_layer ? gpt2::block_param(l, tensor.loom_name) : tensor.loom_name;
      LOOM_CHECK(layout.contains(name), who + ": parameter layout", name,
                 "has no parameter of this name; use the layout of gpt2::parameter_specs(config)");
      const ParameterLayout::Entry& entry = layout.find(name);
      const Shape& shape = reference.find(name).spec.shape;
      if (!(entry.spec.shape == shape))
        throw Error(who + ": shape of parameter " + name, entry.spec.shape,
                    "expected " + detail::to_text(shape) + " for config " +
                        detail::to_text(config) + " (the global, unsharded shape)");
      ranges.push_back({name, entry.offset, entry.numel()});
    }
  }
  return ranges;
}

//! The config fields stored in header words 2..7, in header order.
struct LlmcHeaderField {
  const char* name;
  int word;
  std::int64_t gpt2::Config::*field;
};
inline constexpr std::array<LlmcHeaderField, 6> llmc_header_fields{{
    {"max_seq_len", 2, &gpt2::Config::max_seq_len},
    {"vocab_size", 3, &gpt2::Config::vocab_size},
    {"num_layers", 4, &gpt2::Config::num_layers},
    {"num_heads", 5, &gpt2::Config::num_heads},
    {"channels", 6, &gpt2::Config::channels},
    {"padded_vocab_size", 7, &gpt2::Config::padded_vocab_size},
}};

//! Opens a checkpoint, reads its header and checks the magic and version.
inline Header read_llmc_header(BinaryFile& file, std::uint64_t file_bytes) {
  const Header header = read_header(file, file_bytes);
  if (header[0] != llmc_model_magic)
    throw Error(file.name() + ": magic number", header[0],
                "expected 20240326 (an llm.c GPT-2 checkpoint)" +
                    std::string(header[0] == 20240520 ? "; this is an llm.c token file" : ""));
  LOOM_CHECK(header[1] == llmc_model_version_fp32 || header[1] == llmc_model_version_bf16,
             file.name() + ": version", header[1],
             "expected 3 (float32) or 5 (bfloat16), as written by llm.c's train_gpt2.py");
  return header;
}

//! The config a header describes (not yet validated).
inline gpt2::Config llmc_config(const Header& header) {
  gpt2::Config config;
  for (const LlmcHeaderField& f : llmc_header_fields) config.*f.field = header[f.word];
  return config;
}

}  // namespace detail

//! The GPT-2 config in the header of llm.c checkpoint `path` (magic, version and the config's
//! rules are checked). Build the model from it, then call load_llmc_checkpoint.
inline gpt2::Config read_llmc_config(const std::filesystem::path& path) {
  detail::BinaryFile file(path, "rb", "llm.c checkpoint");
  const detail::Header header = detail::read_llmc_header(file, file.size());
  const gpt2::Config config = detail::llmc_config(header);
  try {
    config.validate();
  } catch (const Error& e) {
    throw Error(file.name() + ": header " + e.subject(), e.value(), e.rule());
  }
  return config;
}

//! Loads llm.c checkpoint `path` into `flat`, a buffer laid out by `layout` (the global layout
//! of gpt2::parameter_specs(expected); other parameters in it are left alone). Rejects, before
//! writing anything, a header that differs from `expected` (naming the field and both values)
//! and a file whose size is not exactly header + parameters (truncated or oversized). Rows
//! vocab_size .. padded_vocab_size-1 of wte are set to 0 whatever the file holds.
inline void load_llmc_checkpoint(const std::filesystem::path& path, const gpt2::Config& expected,
                                 const ParameterLayout& layout, float* flat) {
  detail::BinaryFile file(path, "rb", "llm.c checkpoint");
  const std::vector<detail::LlmcRange> ranges = detail::llmc_ranges(expected, layout, file.name());
  const std::uint64_t file_bytes = file.size();
  const detail::Header header = detail::read_llmc_header(file, file_bytes);
  for (const detail::LlmcHeaderField& f : detail::llmc_header_fields) {
    const std::int64_t want = expected.*f.field;
    LOOM_CHECK(header[f.word] == want, file.name() + ": header " + f.name, header[f.word],
               "expected " + detail::to_text(want) + " (the config the model was built with: " +
                   detail::to_text(expected) + ")");
  }
  const bool bf16 = header[1] == llmc_model_version_bf16;
  const std::uint64_t value_bytes = bf16 ? 2 : 4;
  const auto count = static_cast<std::uint64_t>(expected.stored_parameter_count());
  const std::uint64_t want_bytes = detail::header_bytes + count * value_bytes;
  if (file_bytes != want_bytes)
    throw Error(file.name() + (file_bytes < want_bytes ? ": truncated" : ": size"),
                detail::to_text(file_bytes) + " bytes",
                "expected " + detail::to_text(want_bytes) + " bytes (1024-byte header + " +
                    detail::to_text(count) + (bf16 ? " bfloat16" : " float32") +
                    " parameters)" + (file_bytes < want_bytes ? "" : "; the file has extra bytes"));

  std::vector<std::uint16_t> staging;  // bfloat16 values on their way to float32
  for (const detail::LlmcRange& range : ranges) {
    float* out = flat + range.offset;
    const auto n = static_cast<std::size_t>(range.numel);
    if (!bf16) {
      file.read(out, n * sizeof(float), range.name);
      continue;
    }
    staging.resize(std::min<std::size_t>(n, std::size_t{1} << 16));
    for (std::size_t done = 0; done < n;) {
      const std::size_t chunk = std::min(staging.size(), n - done);
      file.read(staging.data(), chunk * 2, range.name);
      for (std::size_t k = 0; k < chunk; ++k)  // bfloat16 is the high half of a float32
        out[done + k] = std::bit_cast<float>(static_cast<std::uint32_t>(staging[k]) << 16);
      done += chunk;
    }
  }
  const ParameterLayout::Entry& wte = layout.find("wte");
  std::fill(flat + wte.offset + expected.vocab_size * expected.channels,
            flat + wte.offset + wte.numel(), 0.0f);
}

//! Saves the GPT-2 parameters in `flat` (laid out by `layout`, the global layout of
//! gpt2::parameter_specs(config)) as an llm.c float32 checkpoint (version 3) that llm.c can
//! read. wte's padding rows are written as zeros. The file is written to `path + ".tmp"` and
//! renamed over `path`, so a failure never leaves a partial file where a good one was.
inline void save_llmc_checkpoint(const std::filesystem::path& path, const gpt2::Config& config,
                                 const ParameterLayout& layout, const float* flat) {
  const std::string who = "llm.c checkpoint " + detail::quoted(path);
  const std::vector<detail::LlmcRange> ranges = detail::llmc_ranges(config, layout, who);
  detail::Header header{};
  header[0] = llmc_model_magic;
  header[1] = llmc_model_version_fp32;
  for (const detail::LlmcHeaderField& f : detail::llmc_header_fields) {
    const std::int64_t value = config.*f.field;
    LOOM_CHECK(value <= std::numeric_limits<std::int32_t>::max(), who + ": " + f.name, value,
               "must fit the header's int32");
    header[f.word] = static_cast<std::int32_t>(value);
  }
  detail::write_file_replacing(path, "llm.c checkpoint", [&](detail::BinaryFile& file) {
    file.write(header.data(), detail::header_bytes);
    for (const detail::LlmcRange& range : ranges) {
      std::int64_t n = range.numel;
      if (range.name == "wte") n = config.vocab_size * config.channels;  // real rows only
      file.write(flat + range.offset, static_cast<std::size_t>(n) * sizeof(float));
      if (range.name == "wte") {
        std::int64_t padding = (config.padded_vocab_size - config.vocab_size) * config.channels;
        const std::vector<float> zeros(
            static_cast<std::size_t>(std::min<std::int64_t>(padding, 1 << 16)), 0.0f);
        while (padding > 0) {
          const auto chunk = std::min(padding, static_cast<std::int64_t>(zeros.size()));
          file.write(zeros.data(), static_cast<std::size_t>(chunk) * sizeof(float));
          padding -= chunk;
        }
      }
    }
  });
}

}  // namespace loom::io
