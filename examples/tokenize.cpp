// loom_tokenize: text to GPT-2 token ids, printed or written as an llm.c token file that
// gpt2_train --data reads.
//
//   loom_tokenize --tokenizer gpt2_tokenizer.bin --text "Hello, world"
//   loom_tokenize --tokenizer vocab.json --end-of-text --output train.bin a.txt b.txt
//
// The tokenizer is llm.c's gpt2_tokenizer.bin or a Hugging Face vocab.json of a byte-level BPE
// whose ids are its merge ranks (GPT-2's); see docs/data.md, "Tokenizers".

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "loom/core/error.hpp"
#include "loom/io/token_decoder.hpp"
#include "loom/io/token_encoder.hpp"
#include "loom/io/token_file.hpp"

namespace {

//! The bytes of file `name`, or of standard input for "-".
std::string read_input(const std::string& name) {
  if (name == "-") return {std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
  std::ifstream in(name, std::ios::binary);
  if (!in) throw loom::Error("input", name, "cannot be opened for reading");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw loom::Error("input", name, "could not be read to its end");
  return std::move(text).str();
}

}  // namespace

int main(int argc, char** argv) {
  std::string tokenizer, text, output;
  std::vector<std::string> inputs;
  bool end_of_text = false;
  CLI::App app{"Text to GPT-2 token ids (GPT-2's pre-tokenizer and byte-level BPE), printed or written as an "
               "llm.c token file for gpt2_train --data."};
  app.add_option("--tokenizer", tokenizer,
                 "llm.c's tokenizer file (gpt2_tokenizer.bin) or a Hugging Face vocab.json whose ids are its merge "
                 "ranks (GPT-2's)")
      ->required();
  app.add_option("inputs", inputs, "Text files, each one document; - reads standard input");
  app.add_option("--text", text, "Encode this text (one more document, after the files)");
  app.add_option("--output", output,
                 "Write the ids as an llm.c token file (uint16, written whole to FILE.tmp, then renamed); "
                 "without it they are printed, separated by commas");
  app.add_flag("--end-of-text", end_of_text,
               "Put the end-of-text token before each document, as llm.c's data scripts do");
  CLI11_PARSE(app, argc, argv);
  try {
    if (inputs.empty() && app.count("--text") == 0)
      throw loom::Error("inputs", "none", "give text files, - for standard input, or --text");
    const loom::io::TokenDecoder vocabulary = loom::io::TokenDecoder::read(tokenizer);
    const loom::io::TokenEncoder encoder(vocabulary);
    if (end_of_text)
      LOOM_CHECK(encoder.end_of_text() >= 0, "--end-of-text: the tokenizer " + tokenizer, "has no end-of-text token",
                 "a vocab.json needs <|endoftext|>, an llm.c file version 2");
    std::vector<std::string> documents;
    for (const std::string& name : inputs) documents.push_back(read_input(name));
    if (app.count("--text") > 0) documents.push_back(text);

    const auto begin = std::chrono::steady_clock::now();
    std::vector<std::int32_t> ids;
    std::size_t bytes = 0;
    for (const std::string& document : documents) {
      if (end_of_text) ids.push_back(encoder.end_of_text());
      const std::vector<std::int32_t> part = encoder.encode(document);
      ids.insert(ids.end(), part.begin(), part.end());
      bytes += document.size();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();

    if (output.empty()) {
      for (std::size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i == 0 ? "" : ",", ids[i]);
      std::printf("\n");
      std::fflush(stdout);  // the ids before the summary on stderr
    } else {
      std::vector<std::uint16_t> narrow(ids.size());
      for (std::size_t i = 0; i < ids.size(); ++i) {
        LOOM_CHECK(ids[i] < 65536, "--output " + output + ": token id", ids[i],
                   "must be below 65536: llm.c's token files store uint16");
        narrow[i] = static_cast<std::uint16_t>(ids[i]);
      }
      loom::io::write_token_file(output, narrow);
    }
    std::fprintf(stderr, "%zu document%s, %zu bytes -> %zu tokens (%.2f bytes a token) in %.3f s (%.1f MB/s)%s%s\n",
                 documents.size(), documents.size() == 1 ? "" : "s", bytes, ids.size(),
                 ids.empty() ? 0.0 : static_cast<double>(bytes) / static_cast<double>(ids.size()), seconds,
                 seconds > 0 ? static_cast<double>(bytes) / seconds / 1e6 : 0.0, output.empty() ? "" : "; wrote ",
                 output.c_str());
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
