// loom_generate_bench: text generation with a GPT-2 on the CPU, with the key/value cache
// (gpt2::Decoding::key_value_cache, Generator's default) against a forward pass over the whole
// context for every token (Decoding::full_context, llm.c's sampling): new tokens a second, the
// cache's speed-up and memory, and whether the two greedy texts agree. With --batch S, also S
// texts generated together (Generator::generate_batch: one GEMM a weight for all S each step)
// against one text at a time with the cache.
//
//   loom_generate_bench                              # GPT-2 small, float, 16 + 64 tokens, 2 threads
//   loom_generate_bench --batch 8                    # and 8 texts together
//   loom_generate_bench --model tiny --prompt 200 --tokens 300 --json generate.json
//
// The weights are the model's initialization (the time does not depend on what they say). The
// two decodings take turns, call by call, so a slow phase of the machine falls on both.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "loom/loom.hpp"
#include "loom/models/gpt2/generate.hpp"

namespace {

struct Options {
  std::string model = "small";
  std::string dtype = "float";
  std::int64_t prompt = 16;
  std::int64_t tokens = 64;
  int threads = 2;
  int calls = 3;  // timed calls per decoding
  std::int64_t batch = 1;  // texts generated together, beside one at a time
  std::string json;
};

//! One decoding's seconds for the whole text (or texts), and its (last) first text.
struct Timed {
  std::string name;
  loom::gpt2::Decoding decoding;
  std::int64_t texts;  // generated together
  std::vector<double> seconds;
  std::vector<std::int32_t> text;
};

template <class T>
int run(const Options& o) {
  const loom::gpt2::Config config = loom::gpt2::config_by_name(o.model);
  const loom::gpt2::Model<loom::cpu, T> model(config);
  std::vector<T> params(static_cast<std::size_t>(model.layout().total()));
  model.layout().initialize(params.data(), 1);
  const loom::CounterRng ids(2, "bench.prompt");
  std::vector<std::int32_t> prompt;
  for (std::int64_t i = 0; i < o.prompt; ++i)
    prompt.push_back(static_cast<std::int32_t>(ids.uniform(static_cast<std::uint64_t>(i)) * static_cast<double>(config.vocab_size)));
  const loom::gpt2::SamplingOptions sampling{.max_new_tokens = o.tokens, .temperature = 0};
  const std::int64_t cache_bytes =
      2 * config.num_layers * config.max_seq_len * config.channels * static_cast<std::int64_t>(sizeof(T));

  const double load = loom::bench::load_average();
  std::printf("loom_generate_bench: GPT-2 %s (%lld parameters), %s, %lld-token prompt + %lld greedy tokens, "
              "%d threads, median of %d calls\n%s\n",
              o.model.c_str(), static_cast<long long>(model.layout().total()), o.dtype.c_str(),
              static_cast<long long>(o.prompt), static_cast<long long>(o.tokens), o.threads, o.calls,
              loom::bench::machine_line(o.threads).c_str());
  if (const std::string w = loom::bench::load_warning(load); !w.empty()) std::printf("%s\n", w.c_str());
  if (o.prompt + o.tokens > config.max_seq_len)
    std::printf("note: the text outgrows max_seq_len = %lld: past it each token's window runs whole, cache or not\n",
                static_cast<long long>(config.max_seq_len));

  loom::cpu be(o.threads);
  std::vector<Timed> runs{{"key/value cache", loom::gpt2::Decoding::key_value_cache, 1, {}, {}},
                          {"full context", loom::gpt2::Decoding::full_context, 1, {}, {}}};
  if (o.batch > 1)
    runs.push_back({"cache, " + std::to_string(o.batch) + " together", loom::gpt2::Decoding::key_value_cache, o.batch, {}, {}});
  for (int c = 0; c < o.calls; ++c)
    for (Timed& r : runs) {
      // A generator a call, so that each call starts with an empty cache.
      loom::gpt2::Generator<loom::cpu, T> generator(be, model, loom::ParameterView<const T>(params.data()), r.decoding);
      const std::vector<std::vector<std::int32_t>> prompts(static_cast<std::size_t>(r.texts), prompt);
      r.seconds.push_back(loom::bench::time_seconds([&] { r.text = generator.generate_batch(prompts, sampling)[0]; }));
    }

  std::size_t agree = 0;
  while (agree < runs[0].text.size() && agree < runs[1].text.size() && runs[0].text[agree] == runs[1].text[agree])
    ++agree;
  const bool same = runs[0].text == runs[1].text;
  nlohmann::json report = {{"benchmark", "loom_generate_bench"},
                           {"model", o.model},
                           {"dtype", o.dtype},
                           {"prompt_tokens", o.prompt},
                           {"new_tokens", o.tokens},
                           {"calls", o.calls},
                           {"cache_bytes", cache_bytes},
                           {"same_text", same},
                           {"machine", loom::bench::machine_json(o.threads, load)},
                           {"decodings", nlohmann::json::array()}};
  std::printf("\n%-22s %12s %14s %14s %12s\n", "decoding", "median s", "new tokens/s", "ms per token", "speed-up");
  // Speed-ups in new tokens a second, over the full context's.
  const double full_rate = static_cast<double>(o.tokens) / loom::bench::summarize(runs[1].seconds).median;
  for (const Timed& r : runs) {
    const double median = loom::bench::summarize(r.seconds).median;
    const double rate = static_cast<double>(o.tokens * r.texts) / median;
    std::printf("%-22s %12.3f %14.1f %14.2f %11.2fx\n", r.name.c_str(), median, rate, 1e3 / rate, rate / full_rate);
    report["decodings"].push_back({{"decoding", r.name},
                                   {"texts", r.texts},
                                   {"median_s", median},
                                   {"new_tokens_per_s", rate},
                                   {"speedup_over_full_context", rate / full_rate}});
  }
  if (o.batch > 1) {
    const double one = static_cast<double>(o.tokens) / loom::bench::summarize(runs[0].seconds).median;
    const double together = static_cast<double>(o.tokens * o.batch) / loom::bench::summarize(runs[2].seconds).median;
    std::printf("\n%lld texts together: %.2fx the new tokens a second of one text at a time with the cache\n",
                static_cast<long long>(o.batch), together / one);
    report["batch_speedup_over_one_at_a_time"] = together / one;
  }
  std::printf("\ncache: %.1f MiB (2 x %lld layers x %lld positions x %lld channels)\n",
              static_cast<double>(cache_bytes) / (1 << 20), static_cast<long long>(config.num_layers),
              static_cast<long long>(config.max_seq_len), static_cast<long long>(config.channels));
  if (same)
    std::printf("greedy texts: the same %zu tokens\n", runs[0].text.size());
  else
    std::printf("greedy texts: part after %zu of %zu tokens (a near-tie that the two roundings break apart)\n",
                agree, runs[0].text.size());
  loom::bench::write_json(o.json, report);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"GPT-2 text generation on the CPU: the key/value cache against the whole context every token"};
  app.add_option("--model", o.model, "GPT-2 config: tiny, small, medium, large, xl, 2.7B")->capture_default_str();
  app.add_option("--dtype", o.dtype, "float or bf16")->capture_default_str()->check(CLI::IsMember({"float", "bf16"}));
  app.add_option("--prompt", o.prompt, "Prompt tokens")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--tokens", o.tokens, "New tokens to generate")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--threads", o.threads, "Threads")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--calls", o.calls, "Timed calls per decoding (the median is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "Also time this many texts generated together (1: none)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--json", o.json, "Also write the results to this JSON file");
  CLI11_PARSE(app, argc, argv);
  return o.dtype == "bf16" ? run<loom::bf16>(o) : run<float>(o);
}
