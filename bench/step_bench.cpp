// loom_step_bench: how long GPT-2 small .. 2.7B take per step on loom's CPU backend.
//
//   loom_step_bench                                        # small, medium, large, xl, 2.7B
//   loom_step_bench --configs small --warmup 2 --steps 10 --json small.json
//   loom_step_bench --configs xl,2.7B --max-gib 8          # scaled down in layers to fit 8 GiB
//
// For each config it times forward only (Trainer::evaluate: embedding, blocks, head and loss)
// and a training step (Trainer::step: forward, backward, gradient norm, AdamW update) on one
// global batch of synthetic tokens, after --warmup untimed calls. A config whose estimated
// memory exceeds --max-gib loses layers (width, heads and vocabulary stay) until it fits, and
// the output says so. FLOPs follow DESIGN.md: 6N + 12·l·h·s per token for training, a third
// of it (2N + 4·l·h·s) for forward only, with N the parameter count of the layers used.
// --recompute recomputes every block's activations in the backward (docs/recompute.md); the
// FLOPs stay the model's, so the rate falls by the recomputation's share of the time.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"

namespace {

using GptModel = loom::gpt2::Model<loom::cpu, float>;
constexpr double gib = 1024.0 * 1024.0 * 1024.0;

struct Options {
  std::vector<std::string> configs = {"small", "medium", "large", "xl", "2.7B"};
  std::int64_t warmup = 1;
  std::int64_t steps = 3;
  std::int64_t batch = 4;
  std::int64_t micro_batch = 0;  // 0 = the whole batch in one micro-batch
  std::int64_t seq = 64;
  int threads = 2;
  double max_gib = 16;
  double lr = 3e-4;
  double clip = 1.0;
  std::string json;
  bool plan_only = false;
  bool recompute = false;  // TrainerOptions::recompute_layers = all_layers
};

//! Bytes a single-rank Trainer holds for `config` (fp32, AdamW, one live micro-batch).
struct MemoryEstimate {
  double state = 0;        //!< parameters + gradients + AdamW moments: 16 bytes per stored element
  double activations = 0;  //!< saved activations, hidden states, workspace (as Trainer allocates)
  double init = 0;         //!< the host copy of the initial weights, alive only in the constructor
  //! Peak: the init copy is freed before the activations are allocated.
  double total() const { return state + std::max(activations, init); }
};

MemoryEstimate estimate_memory(const loom::gpt2::Config& config, loom::MicroBatchShape shape) {
  const GptModel model(config);
  const auto elements = static_cast<double>(model.layout().total());
  const int layers = model.num_layers();
  std::int64_t saved = 0, workspace = 0;
  for (int l = 0; l < layers; ++l) {
    saved += model.activation_elements(l, shape);
    workspace = std::max(workspace, model.workspace_elements(l, shape));
  }
  const std::int64_t hidden = model.hidden_elements(shape);
  // Mirrors Trainer::allocate: saved activations, layers-1 hidden states, the largest backward
  // workspace and two hidden-state gradients.
  const std::int64_t activation_elements = saved + hidden * (layers - 1) + workspace + 2 * hidden;
  return {.state = 16.0 * elements,
          .activations = 4.0 * static_cast<double>(activation_elements),
          .init = 4.0 * elements};
}

//! What runs for one requested config: the published shape and the one that fits.
struct Plan {
  std::string name;
  loom::gpt2::Config published, used;
  MemoryEstimate memory;
  bool fits = true;
  std::string note;  //!< "xl: 48 layers -> 25 layers to fit 16 GiB", or empty
};

Plan plan_config(const std::string& name, const Options& o) {
  Plan p;
  p.name = name;
  p.published = loom::gpt2::config_by_name(name);
  p.published.max_seq_len = std::max(p.published.max_seq_len, o.seq);
  p.used = p.published;
  const loom::MicroBatchShape shape{o.micro_batch, o.seq};
  const double limit = o.max_gib * gib;
  p.memory = estimate_memory(p.used, shape);
  // Memory grows with every layer, so the first layer count from the top that fits is the largest.
  while (p.memory.total() > limit && p.used.num_layers > 1) {
    --p.used.num_layers;
    p.memory = estimate_memory(p.used, shape);
  }
  char text[256];
  if (p.memory.total() > limit) {
    p.fits = false;
    std::snprintf(text, sizeof text, "%s: does not fit %.3g GiB even with 1 layer (needs %.2f GiB); skipped",
                  name.c_str(), o.max_gib, p.memory.total() / gib);
    p.note = text;
  } else if (p.used.num_layers != p.published.num_layers) {
    std::snprintf(text, sizeof text, "%s: %lld layers -> %lld layers to fit %.3g GiB", name.c_str(),
                  static_cast<long long>(p.published.num_layers),
                  static_cast<long long>(p.used.num_layers), o.max_gib);
    p.note = text;
  }
  return p;
}

//! One timed mode of one config.
struct Row {
  std::string config, mode;
  std::int64_t layers = 0, published_layers = 0, params = 0;
  double flops_per_token = 0;
  std::vector<double> seconds;
  loom::bench::Stats stats;
  double tokens_per_second = 0, gflops = 0, first_loss = 0, last_loss = 0;
};

Row make_row(const Plan& p, const std::string& mode, double flops_per_token, std::int64_t tokens,
             std::vector<double> seconds, double first_loss, double last_loss) {
  Row r;
  r.config = p.name;
  r.mode = mode;
  r.layers = p.used.num_layers;
  r.published_layers = p.published.num_layers;
  r.params = p.used.parameter_count();
  r.flops_per_token = flops_per_token;
  r.stats = loom::bench::summarize(seconds);
  r.seconds = std::move(seconds);
  r.tokens_per_second = static_cast<double>(tokens) / r.stats.mean;
  r.gflops = flops_per_token * static_cast<double>(tokens) / r.stats.mean / 1e9;
  r.first_loss = first_loss;
  r.last_loss = last_loss;
  return r;
}

//! Runs forward only, then training steps, on one Trainer; returns the two rows.
//! `report` gets the setup time and the tracked memory peaks.
std::vector<Row> run_config(const Plan& p, const Options& o, nlohmann::json& report) {
  loom::cpu backend(o.threads);
  // Construction allocates and initializes every parameter (not part of a step's time).
  const auto setup_start = std::chrono::steady_clock::now();
  loom::Trainer<GptModel, loom::AdamW> trainer(
      backend, GptModel(p.used), loom::AdamW(), loom::ConstantLr{.lr = o.lr},
      {.micro_batch_size = o.micro_batch,
       .clip_grad_norm = o.clip,
       .recompute_layers = o.recompute ? loom::TrainerOptions::all_layers : 0});
  report["setup_seconds"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - setup_start).count();
  const loom::io::SyntheticMarkov data({.vocab_size = p.used.vocab_size});
  std::vector<loom::io::Batch> batches;
  for (std::int64_t s = 0; s < o.warmup + o.steps; ++s) batches.push_back(data.batch_at(s, o.batch, o.seq));

  const std::int64_t tokens = o.batch * o.seq;
  const double train_flops = trainer.model().flops_per_token(o.seq);
  std::vector<Row> rows;

  // Forward only: the same batches, nothing updated.
  std::vector<double> seconds;
  double first = 0, last = 0;
  for (std::int64_t s = 0; s < o.warmup + o.steps; ++s) {
    double loss = 0;
    const double t = loom::bench::time_seconds([&] { loss = trainer.evaluate(batches[s]); });
    if (s == o.warmup) first = loss;
    if (s >= o.warmup) seconds.push_back(t);
    last = loss;
  }
  rows.push_back(make_row(p, "forward", train_flops / 3.0, tokens, std::move(seconds), first, last));

  seconds.clear();
  for (std::int64_t s = 0; s < o.warmup + o.steps; ++s) {
    loom::StepMetrics m;
    const double t = loom::bench::time_seconds([&] { m = trainer.step(batches[s]); });
    if (s == o.warmup) first = m.loss;
    if (s >= o.warmup) seconds.push_back(t);
    last = m.loss;
  }
  rows.push_back(make_row(p, "train", train_flops, tokens, std::move(seconds), first, last));

  const loom::MemoryTracker& mem = trainer.memory();
  nlohmann::json& peaks = report["tracked_peak_bytes"];
  for (int i = 0; i < loom::memory_category_count; ++i) {
    const auto c = static_cast<loom::MemoryCategory>(i);
    peaks[std::string(loom::name(c))] = mem.peak(c);
  }
  peaks["total"] = mem.peak_total();
  return rows;
}

nlohmann::json row_json(const Row& r) {
  return {{"config", r.config},
          {"mode", r.mode},
          {"layers", r.layers},
          {"published_layers", r.published_layers},
          {"params", r.params},
          {"flops_per_token", r.flops_per_token},
          {"step_seconds", r.seconds},
          {"mean_ms", 1e3 * r.stats.mean},
          {"std_ms", 1e3 * r.stats.stddev},
          {"median_ms", 1e3 * r.stats.median},
          {"min_ms", 1e3 * r.stats.min},
          {"tokens_per_second", r.tokens_per_second},
          {"gflops", r.gflops},
          {"first_loss", r.first_loss},
          {"last_loss", r.last_loss}};
}

void print_table(const std::vector<Row>& rows) {
  std::printf("\n%-7s %7s %9s  %-8s %10s %9s %10s %10s %9s\n", "config", "layers", "params", "mode",
              "mean ms", "std ms", "median ms", "tokens/s", "GFLOP/s");
  for (const Row& r : rows) {
    char layers[32];
    std::snprintf(layers, sizeof layers, r.layers == r.published_layers ? "%lld" : "%lld/%lld",
                  static_cast<long long>(r.layers), static_cast<long long>(r.published_layers));
    std::printf("%-7s %7s %8.1fM  %-8s %10.1f %9.1f %10.1f %10.1f %9.1f\n", r.config.c_str(), layers,
                static_cast<double>(r.params) / 1e6, r.mode.c_str(), 1e3 * r.stats.mean,
                1e3 * r.stats.stddev, 1e3 * r.stats.median, r.tokens_per_second, r.gflops);
  }
}

double physical_memory_gib() {
  return static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE)) / gib;
}

int run(Options o) {
  if (o.micro_batch == 0) o.micro_batch = o.batch;
  LOOM_CHECK(o.batch % o.micro_batch == 0, "--batch", o.batch,
             "must be a multiple of --micro-batch (" + std::to_string(o.micro_batch) + ")");
  // Unknown config names fail here, before anything is printed or run.
  std::vector<Plan> plans;
  for (const std::string& name : o.configs) plans.push_back(plan_config(name, o));

  std::printf("loom_step_bench: batch %lld x seq %lld (micro-batch %lld), %d threads, %lld warm-up + %lld timed steps, "
              "max %.3g GiB\n",
              static_cast<long long>(o.batch), static_cast<long long>(o.seq),
              static_cast<long long>(o.micro_batch), o.threads, static_cast<long long>(o.warmup),
              static_cast<long long>(o.steps), o.max_gib);
  const double load = loom::bench::load_average();
  std::printf("machine: %s\n", loom::bench::machine_line(o.threads).c_str());
  const std::string load_warning = loom::bench::load_warning(load);
  if (!load_warning.empty()) std::printf("%s\n", load_warning.c_str());
  if (o.max_gib > physical_memory_gib())
    std::printf("warning: --max-gib %.3g exceeds this machine's %.1f GiB of memory\n", o.max_gib,
                physical_memory_gib());


  nlohmann::json report = {{"benchmark", "loom_step_bench"},
                           {"date", loom::bench::utc_now()},
                           {"machine", loom::bench::machine_json(o.threads, load)},
                           {"settings",
                            {{"batch", o.batch}, {"micro_batch", o.micro_batch}, {"seq", o.seq},
                             {"threads", o.threads}, {"warmup", o.warmup}, {"steps", o.steps},
                             {"max_gib", o.max_gib}, {"lr", o.lr}, {"clip_grad_norm", o.clip},
                             {"dtype", "float32"}, {"optimizer", "AdamW"}, {"recompute", o.recompute}}},
                           {"configs", nlohmann::json::array()},
                           {"results", nlohmann::json::array()}};
  std::vector<Row> rows;
  std::vector<std::string> notes;
  for (const Plan& p : plans) {
    if (!p.note.empty()) {
      std::printf("%s\n", p.note.c_str());
      notes.push_back(p.note);
    }
    nlohmann::json config_report = {
        {"config", p.name},
        {"published_layers", p.published.num_layers},
        {"layers", p.used.num_layers},
        {"channels", p.used.channels},
        {"heads", p.used.num_heads},
        {"vocab_size", p.used.vocab_size},
        {"padded_vocab_size", p.used.padded_vocab_size},
        {"params", p.used.parameter_count()},
        {"stored_params", p.used.stored_parameter_count()},
        {"ran", p.fits},
        {"note", p.note},
        {"estimated_bytes",
         {{"state", p.memory.state}, {"activations", p.memory.activations},
          {"init_copy", p.memory.init}, {"total", p.memory.total()}}}};
    if (p.fits && o.plan_only) {
      std::printf("%s: %lld layers, %.1fM params, estimated peak %.2f GiB (state %.2f, activations %.2f, "
                  "init copy %.2f)\n",
                  p.name.c_str(), static_cast<long long>(p.used.num_layers),
                  static_cast<double>(p.used.parameter_count()) / 1e6, p.memory.total() / gib,
                  p.memory.state / gib, p.memory.activations / gib, p.memory.init / gib);
    } else if (p.fits) {
      std::printf("%s (%lld layers, %.1fM params, estimated %.2f GiB): running...\n", p.name.c_str(),
                  static_cast<long long>(p.used.num_layers),
                  static_cast<double>(p.used.parameter_count()) / 1e6, p.memory.total() / gib);
      std::fflush(stdout);
      nlohmann::json run_report;
      for (Row& r : run_config(p, o, run_report)) {
        std::printf("  %-8s mean %9.1f ms  median %9.1f ms  loss %.3f\n", r.mode.c_str(),
                    1e3 * r.stats.mean, 1e3 * r.stats.median, r.last_loss);
        report["results"].push_back(row_json(r));
        rows.push_back(std::move(r));
      }
      std::printf("  setup %.1f s; memory: estimated peak %.2f GiB, tracked peak %.2f GiB (the tracker "
                  "does not see the init copy)\n",
                  static_cast<double>(run_report["setup_seconds"]), p.memory.total() / gib,
                  static_cast<double>(run_report["tracked_peak_bytes"]["total"]) / gib);
      std::fflush(stdout);
      config_report.update(run_report);
    }
    report["configs"].push_back(config_report);
  }
  report["notes"] = notes;

  if (o.plan_only) return 0;
  print_table(rows);
  for (const std::string& n : notes) std::printf("note: %s\n", n.c_str());
  if (!load_warning.empty()) std::printf("%s\n", load_warning.c_str());
  std::printf("FLOPs per token: train 6N + 12*l*h*s, forward 2N + 4*l*h*s (N, l of the layers used; "
              "s = seq %lld)\n",
              static_cast<long long>(o.seq));
  loom::bench::write_json(o.json, report);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Forward and training-step time of GPT-2 configs on loom's CPU backend."};
  app.add_option("--configs", o.configs, "Configs to run: small, medium, large, xl, 2.7B (and tiny)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--warmup", o.warmup, "Untimed calls before the timed ones, per mode")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--steps", o.steps, "Timed calls per mode")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "Sequences per global batch")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--micro-batch", o.micro_batch, "Sequences per micro-batch (0 = the whole batch)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seq", o.seq, "Tokens per sequence")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--threads", o.threads, "CPU threads (0 = all cores)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-gib", o.max_gib,
                 "Memory budget: larger configs are scaled down in layers to fit it")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "Constant learning rate of the timed steps")->capture_default_str();
  app.add_option("--clip", o.clip, "Gradient-norm clip of the training step (0 = off)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--json", o.json, "Also write the results to this JSON file");
  app.add_flag("--recompute", o.recompute,
               "Recompute every block's activations in the backward (TrainerOptions::recompute_layers)");
  app.add_flag("--plan", o.plan_only, "Print the layers and memory each config would use; run nothing");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
