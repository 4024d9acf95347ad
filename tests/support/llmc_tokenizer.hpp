#pragma once
// Test support: an llm.c tokenizer file written from a list of tokens, well formed or not.

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "loom/io/token_decoder.hpp"

namespace loom::test {

//! An llm.c tokenizer file: the header {magic, version, count, end}, then each token's length
//! byte and bytes, then `trailing` extra bytes.
inline void write_llmc_tokenizer(const std::filesystem::path& path, const std::vector<std::string>& tokens,
                                 std::int32_t version = 2, std::int32_t end = -1,
                                 std::int32_t magic = io::llmc_tokenizer_magic, std::int32_t count = -1,
                                 const std::string& trailing = "") {
  std::array<std::int32_t, 256> header{};
  header[0] = magic;
  header[1] = version;
  header[2] = count >= 0 ? count : static_cast<std::int32_t>(tokens.size());
  header[3] = end;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), sizeof header);
  for (const std::string& t : tokens) {
    out.put(static_cast<char>(t.size()));
    out.write(t.data(), static_cast<std::streamsize>(t.size()));
  }
  out << trailing;
}

}  // namespace loom::test
