// loom_tokenize: text to token ids of a byte-level BPE (GPT-2's and its kin) or a BERT WordPiece,
// printed or written as an llm.c token file that gpt2_train --data and bert_train --data read.
//
//   loom_tokenize --tokenizer gpt2_tokenizer.bin --text "Hello, world"
//   loom_tokenize --tokenizer vocab.json --end-of-text --output train.bin a.txt b.txt
//   loom_tokenize --tokenizer roberta/tokenizer.json --end-of-text --output train.bin a.txt
//   loom_tokenize --tokenizer bert-base-cased/vocab.txt --lowercase false --output train.bin a.txt
//   loom_tokenize --tokenizer cl100k_base.tiktoken --end-of-text --output train.bin a.txt
//
// The tokenizer is llm.c's gpt2_tokenizer.bin, a Hugging Face vocab.json with its merges.txt
// beside it, or alone where its ids are its merge ranks (GPT-2's), a Hugging Face tokenizer.json
// of a byte-level BPE (its merges ranked by their list; split by GPT-2's, Llama 3's or
// o200k_base's pattern) or of a WordPiece, a BERT vocab.txt, or a tiktoken file (r50k_base,
// p50k_base, cl100k_base, o200k_base); see docs/data.md, "Tokenizers".

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <iostream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "loom/core/error.hpp"
#include "loom/io/token_decoder.hpp"
#include "loom/io/token_encoder.hpp"
#include "loom/io/token_file.hpp"

namespace {

//! The bytes of file `name`, or of standard input for "-".
std::string read_input(const std::string& name) {
  if (name != "-") return loom::io::detail::read_text_file(name, "input");
  std::string text{std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>()};
  if (std::cin.bad()) throw loom::Error("input", "standard input", "could not be read to its end");
  return text;
}

//! The ids of each document: with at least as many documents as threads, the threads take
//! documents in turn, each encoding its own whole; otherwise each document is encoded in parts
//! on all of them (TokenEncoder::encode(text, threads)). Either way the ids are encode's.
std::vector<std::vector<std::int32_t>> encode_all(const loom::io::TokenEncoder& encoder,
                                                  const std::vector<std::string>& documents, int threads) {
  std::vector<std::vector<std::int32_t>> encoded(documents.size());
  if (documents.size() < static_cast<std::size_t>(threads)) {
    for (std::size_t d = 0; d < documents.size(); ++d) encoded[d] = encoder.encode(documents[d], threads);
    return encoded;
  }
  std::atomic<std::size_t> next{0};
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(threads));
  {
    std::vector<std::jthread> workers;
    for (int t = 0; t < threads; ++t)
      workers.emplace_back([&, t] {
        try {
          for (std::size_t d = next++; d < documents.size(); d = next++) encoded[d] = encoder.encode(documents[d]);
        } catch (...) {
          errors[static_cast<std::size_t>(t)] = std::current_exception();
        }
      });
  }
  for (const std::exception_ptr& error : errors)
    if (error) std::rethrow_exception(error);
  return encoded;
}

}  // namespace

int main(int argc, char** argv) {
  std::string tokenizer, text, output, lowercase;
  std::vector<std::string> inputs;
  bool end_of_text = false;
  int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  CLI::App app{"Text to the token ids of a byte-level BPE (GPT-2's, cl100k_base's, o200k_base's or Llama 3's "
               "pre-tokenizer, then the merges) or a BERT WordPiece, printed or written as an llm.c token file for "
               "gpt2_train --data and bert_train --data."};
  app.add_option("--tokenizer", tokenizer,
                 "llm.c's tokenizer file (gpt2_tokenizer.bin), a Hugging Face vocab.json with its merges.txt beside "
                 "it, or alone where its ids are its merge ranks (GPT-2's), a Hugging Face tokenizer.json of a "
                 "byte-level BPE or a WordPiece, a BERT vocab.txt, or a tiktoken file named for its encoding "
                 "(r50k_base.tiktoken, p50k_base.tiktoken, cl100k_base.tiktoken, o200k_base.tiktoken)")
      ->required();
  app.add_option("--lowercase", lowercase,
                 "A vocab.txt only: lowercase the text (and strip accents), true for an uncased BERT; default: "
                 "tokenizer_config.json's do_lower_case beside the file, else true unless the vocabulary has capitals")
      ->check(CLI::IsMember({"true", "false"}));
  app.add_option("inputs", inputs, "Text files, each one document; - reads standard input");
  app.add_option("--text", text, "Encode this text (one more document, after the files)");
  app.add_option("--output", output,
                 "Write the ids as an llm.c token file (uint16; uint32 for a vocabulary past 65536 tokens, as "
                 "cl100k_base's and Llama 3's are; written whole to FILE.tmp, then renamed); without it they are "
                 "printed, separated by commas");
  app.add_option("--threads", threads,
                 "Threads: on as many documents at once, or on parts of each document, cut at line ends where the ids "
                 "cannot change (the ids are those of one thread; default: the hardware threads)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_flag("--end-of-text", end_of_text,
               "Put the end-of-text token before each document, as llm.c's data scripts do");
  CLI11_PARSE(app, argc, argv);
  try {
    if (inputs.empty() && app.count("--text") == 0)
      throw loom::Error("inputs", "none", "give text files, - for standard input, or --text");
    loom::io::VocabTxtOptions options;
    if (!lowercase.empty()) options.lowercase = lowercase == "true";
    const loom::io::TokenEncoder encoder = loom::io::TokenEncoder::read(tokenizer, options);
    if (end_of_text)
      LOOM_CHECK(encoder.end_of_text() >= 0, "--end-of-text: the tokenizer " + tokenizer, "has no end-of-text token",
                 "a vocab.json needs <|endoftext|> or </s>, a tokenizer.json an added <|endoftext|>, </s> or [SEP], a "
                 "vocab.txt [SEP], an llm.c file version 2");
    std::vector<std::string> documents;
    for (const std::string& name : inputs) documents.push_back(read_input(name));
    if (app.count("--text") > 0) documents.push_back(text);

    const auto begin = std::chrono::steady_clock::now();
    const std::vector<std::vector<std::int32_t>> encoded = encode_all(encoder, documents, threads);
    std::vector<std::int32_t> ids;
    std::size_t bytes = 0;
    for (std::size_t d = 0; d < documents.size(); ++d) {
      if (end_of_text) ids.push_back(encoder.end_of_text());
      ids.insert(ids.end(), encoded[d].begin(), encoded[d].end());
      bytes += documents[d].size();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();

    if (output.empty()) {
      for (std::size_t i = 0; i < ids.size(); ++i) std::printf("%s%d", i == 0 ? "" : ",", ids[i]);
      std::printf("\n");
      std::fflush(stdout);  // the ids before the summary on stderr
    } else if (encoder.vocab_size() <= 65536) {  // GPT-2's form: every id fits uint16
      loom::io::write_token_file(output, std::vector<std::uint16_t>(ids.begin(), ids.end()));
    } else {  // llm.c's form for larger vocabularies: uint32
      loom::io::write_token_file(output, std::vector<std::uint32_t>(ids.begin(), ids.end()));
    }
    std::fprintf(stderr,
                 "%zu document%s, %zu bytes -> %zu tokens (%.2f bytes a token) in %.3f s (%.1f MB/s, %d thread%s)%s%s\n",
                 documents.size(), documents.size() == 1 ? "" : "s", bytes, ids.size(),
                 ids.empty() ? 0.0 : static_cast<double>(bytes) / static_cast<double>(ids.size()), seconds,
                 seconds > 0 ? static_cast<double>(bytes) / seconds / 1e6 : 0.0, threads, threads == 1 ? "" : "s",
                 output.empty() ? "" : "; wrote ",
                 output.c_str());
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
