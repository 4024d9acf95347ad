// loom_mesh_3d_bench: a table in the style of the BigScience GPT-2 experiments. One GPT-2 model on
// 8 thread ranks, every DP × TP × PP mesh whose axes the model divides (8x1x1 ... 1x1x8): step
// time, TFLOP/s per rank and peak memory per rank, and the same model on one rank as the
// reference line.
//
//   loom_mesh_3d_bench                                   # 12 x 256, 8 heads, seq 128, batch 16 (~2.5 min)
//   loom_mesh_3d_bench --shapes 2x2x2,1x2x4 --steps 5
//   loom_mesh_3d_bench --quick                           # the smoke test (seconds)
//   loom_mesh_3d_bench --json mesh.json
//   loom_mesh_3d_bench --shapes 2x1x4,2x2x2 --strategies ddp,zero1,zero3   # strategies side by side
//
// Every rank is a thread with 1 CPU thread. On a machine with fewer cores than ranks the ranks
// share the cores (8 ranks on 2 cores: each gets a quarter of a core on average), so TFLOP/s per
// rank is about cores / ranks of what a rank would reach alone; the one-rank reference line says
// what that is. Step time is the slowest rank's, median over the timed steps (each started by a
// barrier); TFLOP/s per rank = the step's training FLOPs (DESIGN.md: 6·N + 12·l·h·s per token) /
// step seconds / ranks; peak memory is the largest MemoryTracker::peak_total() over the ranks.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "loom/comm/threads.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"

namespace {

using Gpt = loom::gpt2::Model<loom::cpu, float>;

struct Options {
  int ranks = 8;
  std::vector<std::string> shapes;  // "DPxTPxPP"; empty = every factorization of --ranks that fits
  std::int64_t layers = 12, channels = 256, heads = 8, vocab = 50257, seq = 128;
  std::int64_t batch = 16;  // global batch, sequences
  std::int64_t micro_batch = 1;
  int warmup = 1, steps = 3;
  bool overlap = false;
  std::vector<std::string> strategies{"ddp"};  // ddp, zero1, zero2, zero3 over the data-parallel axis
  bool reference = true;
  bool quick = false;
  std::string json;
};

struct Row {
  loom::MeshShape shape;
  std::string strategy = "ddp";
  std::string schedule;
  std::int64_t micro_batches = 0;  // per pipeline
  loom::bench::Stats seconds;
  double flops = 0;                // per step, whole model
  double peak_mib = 0;             // max over ranks
  double state_mib = 0;            // parameters + gradients + optimizer state, max over ranks
  double loss = 0;
  int ranks = 0;
};

loom::MeshShape parse_shape(const std::string& text) {
  loom::MeshShape s;
  char x1 = 0, x2 = 0;
  std::istringstream in(text);
  in >> s.dp >> x1 >> s.tp >> x2 >> s.pp;
  LOOM_CHECK(in && !in.rdbuf()->in_avail() && x1 == 'x' && x2 == 'x', "--shapes", text, "expected DPxTPxPP, e.g. 2x2x2");
  return s;
}

std::string shape_text(const loom::MeshShape& s) {
  return std::to_string(s.dp) + "x" + std::to_string(s.tp) + "x" + std::to_string(s.pp);
}

//! Why `shape` cannot run this model and batch ("" when it can).
std::string unfit(const loom::MeshShape& s, const loom::gpt2::Config& c, const Options& o) {
  if (s.size() != o.ranks) return "dp*tp*pp != " + std::to_string(o.ranks);
  if (c.num_heads % s.tp || c.channels % s.tp || c.padded_vocab_size % s.tp) return "the model does not split over tp";
  if (c.num_layers + 2 < s.pp) return "fewer layers than stages";
  if (o.batch % (o.micro_batch * s.dp)) return "the global batch does not split over dp";
  if (s.pp > 1 && o.batch / (o.micro_batch * s.dp) < s.pp) return "fewer micro-batches than stages";
  return "";
}

//! Every (dp, tp, pp) with dp·tp·pp = ranks, dp descending, then pp ascending.
std::vector<loom::MeshShape> all_shapes(int ranks) {
  std::vector<loom::MeshShape> out;
  for (int dp = ranks; dp >= 1; --dp)
    for (int pp = 1; pp <= ranks; ++pp)
      if (ranks % (dp * pp) == 0) out.push_back({.dp = dp, .tp = ranks / (dp * pp), .pp = pp});
  return out;
}

//! Steps of `config` on a mesh of `shape` over thread ranks: schedule `S` (GradientAccumulation
//! without pipeline stages, OneFOneB with), strategy `St` over the data-parallel axis.
template <class S, class St>
Row measure(const Options& o, const loom::gpt2::Config& config, loom::MeshShape shape, const std::string& schedule,
            St strategy, const std::string& strategy_name) {
  Row row;
  row.shape = shape;
  row.strategy = strategy_name;
  row.schedule = schedule;
  row.ranks = shape.size();
  row.micro_batches = o.batch / (o.micro_batch * shape.dp);
  const int steps = o.warmup + o.steps;
  std::vector<std::vector<double>> seconds(static_cast<std::size_t>(shape.size()));
  std::vector<double> peak(static_cast<std::size_t>(shape.size())), state(static_cast<std::size_t>(shape.size()));
  const loom::io::SyntheticMarkov data({.vocab_size = config.vocab_size});
  loom::threads::run(shape.size(), [&](loom::threads::Communicator& world) {
    loom::Mesh<loom::threads::Communicator> mesh(world, shape);
    loom::cpu backend(1);
    loom::Trainer<Gpt, loom::AdamW, S, St> trainer(backend, mesh, Gpt(config, mesh.tensor_parallel()),
                                                   loom::AdamW({.weight_decay = 0.1}), loom::ConstantLr{.lr = 3e-4},
                                                   {.micro_batch_size = o.micro_batch, .clip_grad_norm = 1.0}, strategy);
    const auto r = static_cast<std::size_t>(world.rank());
    for (int s = 0; s < steps; ++s) {
      const loom::io::Batch batch = data.batch_at(s, o.batch, o.seq);
      world.barrier();  // every rank starts the step together
      const loom::StepMetrics m = trainer.step(batch);
      if (s >= o.warmup) seconds[r].push_back(m.seconds);
      if (r == 0) row.flops = m.flops, row.loss = m.loss;
    }
    using loom::MemoryCategory;
    const loom::MemoryTracker& mem = backend.memory();
    peak[r] = loom::MemoryTracker::mib(mem.peak_total());
    state[r] = loom::MemoryTracker::mib(mem.current(MemoryCategory::parameters) + mem.current(MemoryCategory::gradients) +
                                        mem.current(MemoryCategory::optimizer_state));
  });
  std::vector<double> slowest;
  for (int s = 0; s < o.steps; ++s) {
    double t = 0;
    for (const auto& rank : seconds) t = std::max(t, rank[static_cast<std::size_t>(s)]);
    slowest.push_back(t);
  }
  row.seconds = loom::bench::summarize(slowest);
  row.peak_mib = *std::max_element(peak.begin(), peak.end());
  row.state_mib = *std::max_element(state.begin(), state.end());
  return row;
}

//! The same model and global batch on one rank with 1 thread (gradient accumulation).
Row measure_reference(const Options& o, const loom::gpt2::Config& config) {
  Row row;
  row.shape = {1, 1, 1};
  row.schedule = "GA";
  row.ranks = 1;
  row.micro_batches = o.batch / o.micro_batch;
  const loom::io::SyntheticMarkov data({.vocab_size = config.vocab_size});
  loom::cpu backend(1);
  loom::Trainer<Gpt, loom::AdamW> trainer(backend, Gpt(config), loom::AdamW({.weight_decay = 0.1}),
                                          loom::ConstantLr{.lr = 3e-4},
                                          {.micro_batch_size = o.micro_batch, .clip_grad_norm = 1.0});
  std::vector<double> seconds;
  for (int s = 0; s < o.warmup + o.steps; ++s) {
    const loom::StepMetrics m = trainer.step(data.batch_at(s, o.batch, o.seq));
    if (s >= o.warmup) seconds.push_back(m.seconds);
    row.flops = m.flops, row.loss = m.loss;
  }
  row.seconds = loom::bench::summarize(seconds);
  const loom::MemoryTracker& mem = backend.memory();
  row.peak_mib = loom::MemoryTracker::mib(mem.peak_total());
  row.state_mib = loom::MemoryTracker::mib(mem.current(loom::MemoryCategory::parameters) +
                                           mem.current(loom::MemoryCategory::gradients) +
                                           mem.current(loom::MemoryCategory::optimizer_state));
  return row;
}

//! measure() with the strategy named `name` (ddp, zero1, zero2 or zero3).
template <class S>
Row measure_named(const Options& o, const loom::gpt2::Config& config, loom::MeshShape shape, const std::string& schedule,
                  const std::string& name) {
  if (name == "zero1") return measure<S>(o, config, shape, schedule, loom::Zero<1>{.overlap = o.overlap}, name);
  if (name == "zero2") return measure<S>(o, config, shape, schedule, loom::Zero<2>{.overlap = o.overlap}, name);
  if (name == "zero3") return measure<S>(o, config, shape, schedule, loom::Zero<3>{.overlap = o.overlap}, name);
  return measure<S>(o, config, shape, schedule, loom::DataParallel{.overlap = o.overlap}, name);
}

double tflops_per_rank(const Row& r) { return r.flops / r.seconds.median / r.ranks / 1e12; }

void print_row(const Row& r, const Options& o, std::int64_t parameters, const char* label) {
  std::printf("%-9s %9.2fM %3d %3d %3d  %-5s %-5s %6lld %4lld %6lld | %8.3f %8.3f %9.0f %9.4f | %9.1f %9.1f\n", label,
              static_cast<double>(parameters) / 1e6, r.shape.dp, r.shape.tp, r.shape.pp, r.strategy.c_str(),
              r.schedule.c_str(),
              static_cast<long long>(o.micro_batch), static_cast<long long>(r.micro_batches),
              static_cast<long long>(o.batch), r.seconds.median, r.seconds.min,
              static_cast<double>(o.batch * o.seq) / r.seconds.median, tflops_per_rank(r), r.peak_mib, r.state_mib);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"GPT-2 on every DP x TP x PP mesh of 8 thread ranks: step time, TFLOP/s and peak memory per rank"};
  app.add_option("--ranks", o.ranks, "Thread ranks (dp*tp*pp)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--shapes", o.shapes, "Meshes DPxTPxPP (default: every factorization the model divides)")->delimiter(',');
  app.add_option("--layers", o.layers, "GPT-2 blocks")->capture_default_str();
  app.add_option("--channels", o.channels, "Hidden size")->capture_default_str();
  app.add_option("--heads", o.heads, "Attention heads")->capture_default_str();
  app.add_option("--vocab", o.vocab, "Vocabulary (padded to a multiple of 128)")->capture_default_str();
  app.add_option("--seq", o.seq, "Tokens per sequence")->capture_default_str();
  app.add_option("--batch", o.batch, "Global batch (sequences), the same for every mesh")->capture_default_str();
  app.add_option("--micro-batch", o.micro_batch, "Sequences per micro-batch")->capture_default_str();
  app.add_option("--warmup", o.warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--steps", o.steps, "Timed steps (median reported)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--overlap", o.overlap, "The strategy overlaps its gradient reduction with backward");
  app.add_option("--strategies", o.strategies, "Strategies over dp, each on every mesh: ddp, zero1, zero2, zero3")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::IsMember({"ddp", "zero1", "zero2", "zero3"}));
  app.add_flag("!--no-reference", o.reference, "Skip the one-rank reference line");
  app.add_flag("--quick", o.quick, "A few seconds in all: the smoke test");
  app.add_option("--json", o.json, "Write the table as JSON here");
  CLI11_PARSE(app, argc, argv);
  if (o.quick) {
    o.layers = 6, o.channels = 64, o.heads = 8, o.vocab = 256, o.seq = 16, o.batch = 8;
    o.warmup = 0, o.steps = 1;
    if (o.shapes.empty()) o.shapes = {"2x2x2", "1x1x8"};
  }

  const double load = loom::bench::load_average();
  try {
    loom::gpt2::Config config{.max_seq_len = o.seq,
                              .vocab_size = o.vocab,
                              .padded_vocab_size = loom::gpt2::pad_vocab(o.vocab),
                              .num_layers = o.layers,
                              .num_heads = o.heads,
                              .channels = o.channels};
    config.validate();
    const Gpt whole(config);
    const double flops_per_step = whole.flops_per_token(o.seq) * static_cast<double>(o.batch * o.seq);
    std::printf("loom_mesh_3d_bench: GPT-2 %lld layers x %lld channels, %lld heads, vocabulary %lld (padded %lld), "
                "seq %lld: %lld parameters (%.2f GFLOP per step of %lld sequences); %d thread ranks x 1 thread, fp32 "
                "AdamW, the strategy (overlap %s) over dp, 1F1B when pp > 1; medians of %d steps after %d\n%s\n",
                static_cast<long long>(o.layers), static_cast<long long>(o.channels), static_cast<long long>(o.heads),
                static_cast<long long>(o.vocab), static_cast<long long>(config.padded_vocab_size),
                static_cast<long long>(o.seq), static_cast<long long>(config.parameter_count()), flops_per_step / 1e9,
                static_cast<long long>(o.batch), o.ranks, o.overlap ? "on" : "off", o.steps, o.warmup,
                loom::bench::machine_line(1).c_str());
    std::printf("load average before the run: %.2f\n", load);
    if (const std::string w = loom::bench::load_warning(load); !w.empty()) std::printf("%s\n", w.c_str());
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    if (static_cast<unsigned>(o.ranks) > cores)
      std::printf("note: %d ranks share %u hardware threads: each rank gets about %.2f of a core, so TFLOP/s per rank "
                  "is about %.2f of what one rank reaches alone (the reference line)\n",
                  o.ranks, cores, static_cast<double>(cores) / o.ranks, static_cast<double>(cores) / o.ranks);

    std::vector<loom::MeshShape> shapes;
    if (o.shapes.empty()) shapes = all_shapes(o.ranks);
    for (const std::string& s : o.shapes) shapes.push_back(parse_shape(s));

    std::printf("\n%-9s %10s %3s %3s %3s  %-5s %-5s %6s %4s %6s | %8s %8s %9s %9s | %9s %9s\n", "", "params", "DP",
                "TP", "PP", "strat", "sched", "micro", "m", "global", "step s", "(min)", "tokens/s", "TFLOP/s",
                "peak MiB", "state MiB");
    std::vector<Row> rows;
    std::vector<std::string> skipped;
    for (const loom::MeshShape& shape : shapes) {
      if (const std::string why = unfit(shape, config, o); !why.empty()) {
        skipped.push_back(shape_text(shape) + ": " + why);
        continue;
      }
      for (const std::string& strategy : o.strategies) {
        if (shape.pp == 1)
          rows.push_back(measure_named<loom::GradientAccumulation>(o, config, shape, "GA", strategy));
        else
          rows.push_back(measure_named<loom::OneFOneB>(o, config, shape, "1F1B", strategy));
        print_row(rows.back(), o, config.parameter_count(), "mesh");
        std::fflush(stdout);
      }
    }
    Row reference;
    if (o.reference) {
      reference = measure_reference(o, config);
      print_row(reference, o, config.parameter_count(), "1 rank");
    }
    for (const std::string& s : skipped) std::printf("skipped %s\n", s.c_str());
    std::printf("\nm = micro-batches per pipeline (global / (micro x dp)); GA = gradient accumulation (no pipeline); "
                "TFLOP/s per rank = FLOPs / step s / ranks; peak = MemoryTracker peak_total, max over ranks; state = "
                "parameters + gradients + AdamW state, max over ranks\n");

    nlohmann::json report;
    report["benchmark"] = "loom_mesh_3d_bench";
    report["date"] = loom::bench::utc_now();
    report["machine"] = loom::bench::machine_json(1, load);
    report["model"] = {{"layers", o.layers}, {"channels", o.channels}, {"heads", o.heads}, {"vocab", o.vocab},
                       {"padded_vocab", config.padded_vocab_size}, {"seq", o.seq},
                       {"parameters", config.parameter_count()}};
    report["global_batch"] = o.batch;
    report["micro_batch"] = o.micro_batch;
    auto entry = [&](const Row& r) {
      return nlohmann::json{{"dp", r.shape.dp}, {"tp", r.shape.tp}, {"pp", r.shape.pp}, {"ranks", r.ranks},
                            {"strategy", r.strategy}, {"schedule", r.schedule}, {"micro_batches_per_pipeline", r.micro_batches},
                            {"step_seconds_median", r.seconds.median}, {"step_seconds_min", r.seconds.min},
                            {"flops_per_step", r.flops}, {"tflops_per_rank", tflops_per_rank(r)},
                            {"peak_mib_max_over_ranks", r.peak_mib}, {"state_mib_max_over_ranks", r.state_mib},
                            {"loss", r.loss}};
    };
    for (const Row& r : rows) report["rows"].push_back(entry(r));
    if (o.reference) report["reference_one_rank"] = entry(reference);
    loom::bench::write_json(o.json, report);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
