// loom_zero_bench: our users' DDP-versus-FSDP study on this machine. GPT-2 (small by default)
// on 2 thread ranks (or under mpiexec with --comm mpi): DDP, ZeRO-1, ZeRO-2 and ZeRO-3 at two
// global batch sizes, in one run and one table: step time, tokens/s, and per rank the peak
// memory, the parameters + gradients + optimizer state held next to the ZeRO formula, the padding
// and the working set (gathered parameters, per-unit gradients).
//
//   loom_zero_bench                                   # GPT-2 small, 2 ranks, batches 2 and 4 x 128
//   loom_zero_bench --model tiny --seq 64 --steps 2   # quick look
//   loom_zero_bench --json zero.json
//   loom_zero_bench --ranks 4 --replicas 2            # also ZeRO-2/3 as 2 copies sharded over 2 ranks (HSDP)
//
// Formulas (DESIGN.md, fp32 AdamW: 4 + 4 + 8 bytes per parameter): DDP 16Ψ; ZeRO-1 8Ψ + 8Ψ/N;
// ZeRO-2 4Ψ + 12Ψ/N; ZeRO-3 16Ψ/N.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "loom/comm/threads.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"

namespace {

struct Options {
  std::string model = "small";
  int ranks = 2;
  std::int64_t seq = 128;
  std::vector<std::int64_t> batches{2, 4};  // global batch sizes (sequences)
  std::int64_t micro_batch = 1;
  int warmup = 1, steps = 3;
  int threads = 0;  // per rank; 0 = cores / ranks
  int replicas = 1;  // > 1: also hybrid-sharded ZeRO-2 and ZeRO-3 rows (Zero::replicas)
  std::string json;
};

struct Row {
  std::string strategy;
  std::int64_t batch = 0;
  loom::bench::Stats seconds;
  double tokens_per_second = 0;
  double peak_mib = 0, held_mib = 0, formula_mib = 0, padding_mib = 0, working_mib = 0;
  double loss = 0;
};

using Gpt = loom::gpt2::Model<loom::cpu, float>;

//! Bytes of parameters + gradients + AdamW state per rank for `stage` (0 = DDP), fp32.
double formula_bytes(int stage, double psi, double n) {
  switch (stage) {
    case 1: return 8 * psi + 8 * psi / n;
    case 2: return 4 * psi + 12 * psi / n;
    case 3: return 16 * psi / n;
    default: return 16 * psi;
  }
}

template <class St>
Row measure(const Options& o, const loom::gpt2::Config& config, std::int64_t batch, int stage, St strategy,
            const std::string& name, int replicas = 1) {
  Row row;
  row.strategy = name;
  row.batch = batch;
  const int threads = o.threads > 0 ? o.threads
                                     : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / o.ranks);
  std::vector<double> seconds;
  loom::threads::run(o.ranks, [&](loom::threads::Communicator& comm) {
    loom::cpu backend(threads);
    loom::Trainer<Gpt, loom::AdamW, loom::GradientAccumulation, St> trainer(
        backend, comm, Gpt(config), loom::AdamW(), loom::ConstantLr{.lr = 1e-4},
        {.micro_batch_size = o.micro_batch}, strategy);
    const loom::io::SyntheticMarkov data({.vocab_size = config.vocab_size});
    for (int s = 0; s < o.warmup + o.steps; ++s) {
      comm.barrier();  // every rank starts the step together
      loom::StepMetrics m;
      const double t = loom::bench::time_seconds([&] { m = trainer.step(data.batch_at(s, batch, o.seq)); });
      if (comm.rank() == 0 && s >= o.warmup) seconds.push_back(t);
      if (comm.rank() == 0) row.loss = m.loss;
    }
    if (comm.rank() != 0) return;
    const loom::MemoryTracker& mem = backend.memory();
    using loom::MemoryCategory;
    const double held = static_cast<double>(mem.current(MemoryCategory::parameters) +
                                            mem.current(MemoryCategory::gradients) +
                                            mem.current(MemoryCategory::optimizer_state));
    const double psi = static_cast<double>(config.stored_parameter_count());
    row.peak_mib = loom::MemoryTracker::mib(mem.peak_total());
    row.held_mib = held / (1 << 20);
    row.formula_mib = formula_bytes(stage, psi, o.ranks / replicas) / (1 << 20);  // sharded over one copy
    row.padding_mib = row.held_mib - row.formula_mib;
    row.working_mib = loom::MemoryTracker::mib(mem.peak(MemoryCategory::communication));
  });
  row.seconds = loom::bench::summarize(seconds);
  row.tokens_per_second = static_cast<double>(batch * o.seq) / row.seconds.median;
  return row;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"DDP versus ZeRO-1/2/3 (FSDP): throughput and memory per rank"};
  app.add_option("--model", o.model, "GPT-2 config: tiny, small, medium, ...")->capture_default_str();
  app.add_option("--ranks", o.ranks, "Data-parallel thread ranks")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "Tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batches", o.batches, "Global batch sizes (sequences)")->capture_default_str();
  app.add_option("--micro-batch", o.micro_batch, "Sequences per micro-batch on each rank")->capture_default_str();
  app.add_option("--warmup", o.warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--steps", o.steps, "Timed steps (median reported)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--threads", o.threads, "Threads per rank (0 = cores / ranks)")->capture_default_str();
  app.add_option("--replicas", o.replicas,
                 "Also run ZeRO-2 and ZeRO-3 as this many copies of the model, each sharded over ranks / replicas "
                 "(hybrid sharding; must divide --ranks)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--json", o.json, "Write the table as JSON here");
  CLI11_PARSE(app, argc, argv);
  if (o.ranks % o.replicas != 0) {
    std::fprintf(stderr, "loom_zero_bench: --replicas: got %d; must divide --ranks (%d)\n", o.replicas, o.ranks);
    return 2;
  }

  const double load = loom::bench::load_average();
  try {
    loom::gpt2::Config config = loom::gpt2::config_by_name(o.model);
    config.max_seq_len = std::max(config.max_seq_len, o.seq);
    config.validate();
    const int threads = o.threads > 0 ? o.threads
                                      : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / o.ranks);
    std::printf("loom_zero_bench: GPT-2 %s (%lld parameters stored), %d thread ranks x %d threads, seq %lld, "
                "micro-batch %lld, fp32 AdamW; medians of %d steps after %d\n%s\n",
                o.model.c_str(), static_cast<long long>(config.stored_parameter_count()), o.ranks, threads,
                static_cast<long long>(o.seq), static_cast<long long>(o.micro_batch), o.steps, o.warmup,
                loom::bench::machine_line(threads).c_str());
    if (const std::string w = loom::bench::load_warning(load); !w.empty()) std::printf("%s\n", w.c_str());

    std::vector<Row> rows;
    for (std::int64_t batch : o.batches) {
      rows.push_back(measure(o, config, batch, 0, loom::DataParallel{}, "DDP"));
      rows.push_back(measure(o, config, batch, 1, loom::Zero<1>{}, "ZeRO-1"));
      rows.push_back(measure(o, config, batch, 2, loom::Zero<2>{}, "ZeRO-2"));
      rows.push_back(measure(o, config, batch, 3, loom::Zero<3>{}, "ZeRO-3"));
      if (o.replicas > 1) {
        const std::string copies = "x" + std::to_string(o.replicas);
        rows.push_back(measure(o, config, batch, 2, loom::Zero<2>{.replicas = o.replicas}, "ZeRO-2" + copies,
                               o.replicas));
        rows.push_back(measure(o, config, batch, 3, loom::Zero<3>{.replicas = o.replicas}, "ZeRO-3" + copies,
                               o.replicas));
      }
    }

    std::printf("\n%-9s %6s | %9s %9s %8s | %10s | %10s %10s %8s | %10s\n", "strategy", "batch", "step s",
                "tok/s", "vs DDP", "peak MiB", "held MiB", "formula", "padding", "working");
    double ddp_tokens = 0;
    for (const Row& r : rows) {
      if (r.strategy == "DDP") ddp_tokens = r.tokens_per_second;
      std::printf("%-9s %6lld | %9.3f %9.0f %7.0f%% | %10.1f | %10.1f %10.1f %8.3f | %10.1f\n", r.strategy.c_str(),
                  static_cast<long long>(r.batch), r.seconds.median, r.tokens_per_second,
                  100.0 * r.tokens_per_second / ddp_tokens, r.peak_mib, r.held_mib, r.formula_mib, r.padding_mib,
                  r.working_mib);
    }
    std::printf("\nheld = parameters + gradients + optimizer state on rank 0; formula = DESIGN.md's ZeRO formula for "
                "Psi = %lld, N = %d (N = %d in each copy of the xR rows: R copies, hybrid sharding); padding = held - "
                "formula; working = peak of the communication category (ZeRO-2/3 per-unit gradients, ZeRO-3 gathered "
                "parameters); peak = everything at once, activations included.\n",
                static_cast<long long>(config.stored_parameter_count()), o.ranks, o.ranks / o.replicas);

    nlohmann::json report;
    report["benchmark"] = "loom_zero_bench";
    report["machine"] = loom::bench::machine_json(threads, load);
    report["model"] = o.model;
    report["ranks"] = o.ranks;
    report["replicas"] = o.replicas;
    report["seq"] = o.seq;
    for (const Row& r : rows)
      report["rows"].push_back({{"strategy", r.strategy}, {"batch", r.batch}, {"step_seconds_median", r.seconds.median},
                                {"tokens_per_second", r.tokens_per_second}, {"peak_mib", r.peak_mib},
                                {"held_mib", r.held_mib}, {"formula_mib", r.formula_mib}, {"padding_mib", r.padding_mib},
                                {"working_set_mib", r.working_mib}, {"loss", r.loss}});
    loom::bench::write_json(o.json, report);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
