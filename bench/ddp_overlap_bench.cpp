// loom_ddp_overlap_bench: how much of DDP's gradient all-reduce the overlap with backward hides.
//
//   loom_ddp_overlap_bench                                 # GPT-2 small, 2 thread ranks, seq 64
//   loom_ddp_overlap_bench --seq 128 --micro-batch 2 --bucket-bytes 8M --json ddp.json
//   mpiexec -n 2 loom_ddp_overlap_bench --comm mpi        # 2 MPI processes
//
// On every rank it builds three trainers of the same model from the same seed and runs them on
// the same batches, step by step in turn (so that other load on the machine hits all three):
//   compute      Trainer<..., SingleRank> over a SelfCommunicator on the rank's own slice of
//                the global batch: the same per-rank work with no communication, the ranks
//                computing at the same time as in the real run;
//   overlap      Trainer<..., DataParallel{.overlap = true}> on the global batch: each bucket's
//                all-reduce starts during backward as soon as its layers are done;
//   no overlap   Trainer<..., DataParallel{.overlap = false}>: every bucket reduced after backward.
// A step's time is the slowest rank's (each rank times its own step after a barrier); the
// figures are medians over --steps steps after --warmup. Then
//   exposed communication without overlap = t_no_overlap − t_compute
//   exposed communication with overlap     = t_overlap − t_compute
//   hidden share = 1 − exposed_with / exposed_without,
// and the same from the medians of step-by-step differences (robust to load that drifts).
// It also times the gradient's all-reduce alone (the same buckets, nothing else running), and
// checks that the two DDP trainers computed the same losses (they do the same arithmetic).

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "comm_bench_common.hpp"
#include "loom/comm/self.hpp"
#include "loom/comm/threads.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"
#if LOOM_BENCH_WITH_MPI
#include <mpi.h>

#include "loom/comm/mpi.hpp"
#endif

namespace {

using GptModel = loom::gpt2::Model<loom::cpu, float>;
using loom::bench::bytes_text;

struct Options {
  std::string config = "small";
  std::int64_t layers = 0;  //!< 0: the config's own
  std::int64_t seq = 64;
  std::int64_t micro_batch = 1;   //!< sequences per micro-batch on each rank
  std::int64_t accumulation = 1;  //!< micro-batches per rank per step
  int ranks = 2;
  int threads_per_rank = 0;  //!< 0: the cores divided by the ranks (at least 1)
  std::size_t bucket_bytes = std::size_t{25} << 20;
  std::int64_t warmup = 2;
  std::int64_t steps = 12;
  double lr = 3e-4;
  std::string comm = "threads";
  std::string json;
};

constexpr const char* variant_names[] = {"compute", "overlap", "no overlap"};
constexpr int variant_count = 3;

struct Result {
  std::vector<double> seconds[variant_count];  //!< slowest rank's step time, timed steps only
  loom::bench::Stats stats[variant_count];
  std::vector<double> losses[variant_count];   //!< every step's loss (compute: this rank's slice)
  std::vector<double> allreduce_seconds;       //!< the gradient's all-reduce alone
  loom::bench::Stats allreduce;
  std::int64_t parameters = 0, buckets = 0;
  std::size_t gradient_bytes = 0, largest_bucket_bytes = 0;
  double loss_difference = 0;  //!< largest relative difference of overlap and no-overlap losses
};

loom::gpt2::Config model_config(const Options& o) {
  loom::gpt2::Config c = loom::gpt2::config_by_name(o.config);
  if (o.layers > 0) c.num_layers = o.layers;
  c.max_seq_len = std::max(c.max_seq_len, o.seq);
  return c;
}

//! The benchmark on one rank of `group` (threads or MPI); every rank returns the same Result.
template <class Group>
Result run_rank(const Options& o, Group& group, int threads) {
  const int ranks = group.size(), rank = group.rank();
  const loom::gpt2::Config config = model_config(o);
  const std::int64_t local_rows = o.micro_batch * o.accumulation, global_rows = local_rows * ranks;
  const loom::TrainerOptions trainer_options{.micro_batch_size = o.micro_batch, .clip_grad_norm = 1.0};
  const loom::ConstantLr lr{.lr = o.lr};

  loom::cpu backend(threads);
  loom::SelfCommunicator self;
  loom::Trainer<GptModel, loom::AdamW> compute(backend, self, GptModel(config), loom::AdamW(), lr, trainer_options);
  using Ddp = loom::Trainer<GptModel, loom::AdamW, loom::GradientAccumulation, loom::DataParallel>;
  Ddp overlap(backend, group, GptModel(config), loom::AdamW(), lr, trainer_options,
              loom::DataParallel{.bucket_bytes = o.bucket_bytes, .overlap = true});
  Ddp no_overlap(backend, group, GptModel(config), loom::AdamW(), lr, trainer_options,
                 loom::DataParallel{.bucket_bytes = o.bucket_bytes, .overlap = false});

  const loom::io::SyntheticMarkov data({.vocab_size = config.vocab_size});
  const std::int64_t total_steps = o.warmup + o.steps;
  std::vector<loom::io::Batch> global, local;
  for (std::int64_t s = 0; s < total_steps; ++s) {
    global.push_back(data.batch_at(s, global_rows, o.seq));
    local.push_back(global.back().rows(rank * local_rows, local_rows));
  }

  Result result;
  result.parameters = overlap.model().layout().total();
  result.gradient_bytes = static_cast<std::size_t>(result.parameters) * sizeof(float);
  result.buckets = static_cast<std::int64_t>(overlap.engine().buckets().size());
  for (const loom::GradientBucket& b : overlap.engine().buckets())
    result.largest_bucket_bytes = std::max(result.largest_bucket_bytes, static_cast<std::size_t>(b.end - b.begin) * sizeof(float));

  std::vector<double> samples;  // [variant][timed step]
  samples.resize(static_cast<std::size_t>(variant_count * o.steps));
  auto sync = [&] { group.barrier(); };
  for (std::int64_t s = 0; s < total_steps; ++s) {
    const std::int64_t t = s - o.warmup;
    double times[variant_count] = {};
    for (int v = 0; v < variant_count; ++v) {
      loom::StepMetrics m;
      times[v] = loom::bench::time_on_rank(sync, [&] {
        m = v == 0 ? compute.step(local[s]) : v == 1 ? overlap.step(global[s]) : no_overlap.step(global[s]);
      });
      result.losses[v].push_back(m.loss);
      if (t >= 0) samples[static_cast<std::size_t>(v * o.steps + t)] = times[v];
    }
    if (rank == 0) {
      std::printf("  step %lld%s: compute %.0f ms, overlap %.0f ms, no overlap %.0f ms (rank 0)\n",
                  static_cast<long long>(s + 1), t < 0 ? " (warm-up)" : "", 1e3 * times[0], 1e3 * times[1],
                  1e3 * times[2]);
      std::fflush(stdout);
    }
  }
  samples = loom::bench::max_over_ranks(group, std::move(samples));
  for (int v = 0; v < variant_count; ++v) {
    result.seconds[v].assign(samples.begin() + v * o.steps, samples.begin() + (v + 1) * o.steps);
    result.stats[v] = loom::bench::summarize(result.seconds[v]);
  }
  for (std::size_t s = 0; s < result.losses[1].size(); ++s)
    result.loss_difference = std::max(result.loss_difference, std::abs(result.losses[1][s] - result.losses[2][s]) /
                                                                  std::abs(result.losses[2][s]));

  // The gradient's all-reduce alone: the same buckets, all started, then all waited for (what
  // DDP without overlap does after backward), with nothing else running.
  std::vector<float> gradient(static_cast<std::size_t>(result.parameters), 0.0f);
  std::vector<loom::Request> requests(overlap.engine().buckets().size());
  std::vector<double> alone;
  for (std::int64_t s = 0; s < std::max<std::int64_t>(o.steps, 3) + 1; ++s) {
    const double seconds = loom::bench::time_on_rank(sync, [&] {
      std::size_t i = 0;
      for (const loom::GradientBucket& b : overlap.engine().buckets())
        requests[i++] = group.all_reduce_async(
            std::span<float>(gradient.data() + b.begin, static_cast<std::size_t>(b.end - b.begin)), loom::ReduceOp::sum);
      for (loom::Request& r : requests) r.wait();
    });
    if (s > 0) alone.push_back(seconds);  // the first is a warm-up
  }
  result.allreduce_seconds = loom::bench::max_over_ranks(group, std::move(alone));
  result.allreduce = loom::bench::summarize(result.allreduce_seconds);
  return result;
}

//! Prints the summary (rank 0) and returns the JSON report.
nlohmann::json report(const Options& o, const std::string& comm_text, int ranks, int threads, double load,
                      const Result& r) {
  const double t_compute = r.stats[0].median, t_overlap = r.stats[1].median, t_no_overlap = r.stats[2].median;
  const double exposed_without = t_no_overlap - t_compute, exposed_with = t_overlap - t_compute;
  const bool meaningful = exposed_without > 0;
  const double hidden = meaningful ? 1.0 - exposed_with / exposed_without : 0.0;
  // The same from step-by-step differences (the three variants of a step run back to back, so
  // load that drifts over the run cancels out of each difference).
  auto paired = [&](int v) {
    std::vector<double> d;
    for (std::size_t s = 0; s < r.seconds[0].size(); ++s) d.push_back(r.seconds[v][s] - r.seconds[0][s]);
    return loom::bench::summarize(d).median;
  };
  const double paired_without = paired(2), paired_with = paired(1);
  const loom::gpt2::Config config = model_config(o);

  std::printf("\nGPT-2 %s (%lld layers, %.1fM parameters, gradient %s in %lld buckets of <= %s), %d ranks (%s), "
              "%d threads per rank,\nseq %lld, micro-batch %lld x %lld per rank, medians of %lld steps after %lld warm-up\n",
              o.config.c_str(), static_cast<long long>(config.num_layers), static_cast<double>(r.parameters) / 1e6,
              bytes_text(r.gradient_bytes).c_str(), static_cast<long long>(r.buckets), bytes_text(r.largest_bucket_bytes).c_str(),
              ranks, comm_text.c_str(), threads, static_cast<long long>(o.seq), static_cast<long long>(o.micro_batch),
              static_cast<long long>(o.accumulation), static_cast<long long>(o.steps), static_cast<long long>(o.warmup));
  std::printf("  %-46s %9s %9s %9s\n", "", "median ms", "min ms", "mean ms");
  const char* what[] = {"t_compute    (SingleRank on each rank's slice)", "t_overlap    (DataParallel, overlap on)",
                        "t_no_overlap (DataParallel, overlap off)"};
  for (int v = 0; v < variant_count; ++v)
    std::printf("  %-46s %9.1f %9.1f %9.1f\n", what[v], 1e3 * r.stats[v].median, 1e3 * r.stats[v].min,
                1e3 * r.stats[v].mean);
  std::printf("  %-46s %9.1f %9.1f %9.1f\n", "gradient all-reduce alone (same buckets)", 1e3 * r.allreduce.median,
              1e3 * r.allreduce.min, 1e3 * r.allreduce.mean);
  std::printf("  communication exposed without overlap = t_no_overlap - t_compute = %.1f ms (%.1f%% of t_no_overlap)\n",
              1e3 * exposed_without, 100.0 * exposed_without / t_no_overlap);
  std::printf("  communication exposed with overlap    = t_overlap - t_compute    = %.1f ms (%.1f%% of t_overlap)\n",
              1e3 * exposed_with, 100.0 * exposed_with / t_overlap);
  if (meaningful)
    std::printf("  hidden share = 1 - exposed_with / exposed_without = %.0f%%; overlap step %.1f%% %s than no overlap\n",
                100.0 * hidden, 100.0 * std::abs(t_overlap / t_no_overlap - 1.0),
                t_overlap <= t_no_overlap ? "faster" : "slower");
  else
    std::printf("  hidden share: not defined (no communication exposed without overlap: the step is not slower "
                "than compute alone)\n");
  std::printf("  the same from step-by-step differences (medians): exposed without %.1f ms, with %.1f ms%s",
              1e3 * paired_without, 1e3 * paired_with, paired_without > 0 ? ", hidden share " : "\n");
  if (paired_without > 0) std::printf("%.0f%%\n", 100.0 * (1.0 - paired_with / paired_without));
  std::printf("  overlap and no-overlap losses agree to %.1e (relative; they do the same arithmetic)\n",
              r.loss_difference);

  return {{"benchmark", "loom_ddp_overlap_bench"},
          {"date", loom::bench::utc_now()},
          {"machine", loom::bench::machine_json(ranks * threads, load)},
          {"settings",
           {{"comm", o.comm}, {"ranks", ranks}, {"threads_per_rank", threads}, {"config", o.config},
            {"layers", config.num_layers}, {"seq", o.seq}, {"micro_batch", o.micro_batch},
            {"accumulation", o.accumulation}, {"bucket_bytes", o.bucket_bytes}, {"warmup", o.warmup},
            {"steps", o.steps}, {"lr", o.lr}, {"optimizer", "AdamW"}, {"dtype", "float32"}}},
          {"model", {{"parameters", r.parameters}, {"gradient_bytes", r.gradient_bytes}, {"buckets", r.buckets},
                     {"largest_bucket_bytes", r.largest_bucket_bytes}}},
          {"step_seconds",
           {{"compute", r.seconds[0]}, {"overlap", r.seconds[1]}, {"no_overlap", r.seconds[2]}}},
          {"losses", {{"compute_rank0_slice", r.losses[0]}, {"overlap", r.losses[1]}, {"no_overlap", r.losses[2]}}},
          {"allreduce_alone_seconds", r.allreduce_seconds},
          {"summary_ms",
           {{"t_compute", 1e3 * t_compute}, {"t_overlap", 1e3 * t_overlap}, {"t_no_overlap", 1e3 * t_no_overlap},
            {"allreduce_alone", 1e3 * r.allreduce.median}, {"exposed_without_overlap", 1e3 * exposed_without},
            {"exposed_with_overlap", 1e3 * exposed_with}, {"paired_exposed_without_overlap", 1e3 * paired_without},
            {"paired_exposed_with_overlap", 1e3 * paired_with}}},
          {"hidden_share", meaningful ? nlohmann::json(hidden) : nlohmann::json(nullptr)},
          {"loss_difference_overlap_vs_no_overlap", r.loss_difference}};
}

std::string title(const Options& o, const std::string& comm, int ranks, int threads) {
  return "loom_ddp_overlap_bench: GPT-2 " + o.config + ", " + std::to_string(ranks) + " ranks (" + comm + "), " +
         std::to_string(threads) + " threads per rank, seq " + std::to_string(o.seq) + ", micro-batch " +
         std::to_string(o.micro_batch) + " x " + std::to_string(o.accumulation) + " per rank, buckets " +
         bytes_text(o.bucket_bytes);
}

int threads_per_rank(const Options& o, int ranks) {
  if (o.threads_per_rank > 0) return o.threads_per_rank;
  return std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / ranks);
}

int run_threads(const Options& o) {
  const int threads = threads_per_rank(o, o.ranks);
  const double load = loom::bench::print_header(true, title(o, "threads", o.ranks, threads), o.ranks * threads);
  std::printf("building 3 trainers per rank...\n");
  std::fflush(stdout);
  Result result;
  loom::threads::run(o.ranks, [&](loom::threads::Communicator& comm) {
    Result mine = run_rank(o, comm, threads);
    if (comm.rank() == 0) result = std::move(mine);
  });
  const nlohmann::json j = report(o, "threads", o.ranks, threads, load, result);
  const std::string warning = loom::bench::load_warning(load);
  if (!warning.empty()) std::printf("%s\n", warning.c_str());
  loom::bench::write_json(o.json, j);
  return 0;
}

#if LOOM_BENCH_WITH_MPI
int run_mpi(const Options& o, int& argc, char**& argv) {
  return loom::mpi::run(argc, argv, [&](loom::mpi::Communicator& world) {
    const int ranks = world.size(), threads = threads_per_rank(o, ranks);
    const bool lead = world.rank() == 0;
    LOOM_CHECK(ranks >= 2, "--comm mpi: ranks", ranks, "must be >= 2 (run under mpiexec -n 2 or more)");
    const double load = loom::bench::print_header(lead, title(o, "MPI", ranks, threads), ranks * threads);
    if (lead) {
      std::printf("building 3 trainers per rank...\n");
      std::fflush(stdout);
    }
    const Result result = run_rank(o, world, threads);
    if (!lead) return 0;
    const nlohmann::json j = report(o, "MPI", ranks, threads, load, result);
    const std::string warning = loom::bench::load_warning(load);
    if (!warning.empty()) std::printf("%s\n", warning.c_str());
    loom::bench::write_json(o.json, j);
    return 0;
  });
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"A DDP step against compute alone and against DDP without overlap."};
  app.add_option("--config", o.config, "GPT-2 config: tiny, small, medium, ...")->capture_default_str();
  app.add_option("--layers", o.layers, "Layers (0 = the config's)")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--seq", o.seq, "Tokens per sequence")->capture_default_str()->check(CLI::Range(1, 1024));
  app.add_option("--micro-batch", o.micro_batch, "Sequences per micro-batch on each rank")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--accumulation", o.accumulation, "Micro-batches per rank per step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--ranks", o.ranks, "Thread ranks (--comm threads)")->capture_default_str()->check(CLI::Range(2, 64));
  app.add_option("--threads-per-rank", o.threads_per_rank, "CPU threads per rank (0 = cores / ranks)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--bucket-bytes", o.bucket_bytes, "DataParallel bucket size (25M = PyTorch's default)")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--warmup", o.warmup, "Untimed steps per variant")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--steps", o.steps, "Timed steps per variant")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "AdamW's constant learning rate")->capture_default_str();
  app.add_option("--comm", o.comm, "threads, or mpi (under mpiexec)")
      ->capture_default_str()
      ->check(CLI::IsMember({"threads", "mpi"}));
  app.add_option("--json", o.json, "Also write the results to this JSON file");
  CLI11_PARSE(app, argc, argv);
  try {
    (void)model_config(o);  // an unknown config fails here
    LOOM_CHECK(o.bucket_bytes > 0, "--bucket-bytes", o.bucket_bytes, "must be > 0");
    if (o.comm == "mpi") {
#if LOOM_BENCH_WITH_MPI
      return run_mpi(o, argc, argv);
#else
      throw loom::Error("--comm", o.comm, "this build has no MPI (loom::mpi was not found)");
#endif
    }
    return run_threads(o);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
