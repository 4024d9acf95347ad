// loom_checkpoint_bench: what a training-state save costs the run. GPT-2 (small by default) on
// thread ranks, saving every --save-every steps, four ways in one run, alternated --repeats
// times: no save, save_training_state (the step waits for the file), and AsyncTrainingStateSaver
// (the step pays for a copy of each rank's owned state; threads write it while training goes on),
// its copy in buffers kept from the save before (the default) or in fresh ones each time.
// Reported: the median step without a save, the median extra time of a step that saves (its
// stall), the whole run's time (the last background save waited for), the background saves
// against the blocking ones, and kept buffers against fresh ones.
//
//   loom_checkpoint_bench                                  # GPT-2 small, 1 rank, save every 4 steps
//   loom_checkpoint_bench --ranks 2                        # ZeRO-1 on 2 thread ranks
//   loom_checkpoint_bench --model tiny --steps 4 --save-every 2 --repeats 1   # quick look

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.hpp"
#include "loom/comm/threads.hpp"
#include "loom/io/async_training_state.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/io/training_state.hpp"
#include "loom/loom.hpp"

namespace {

struct Options {
  std::string model = "small";
  int ranks = 1;
  std::int64_t batch = 4, seq = 64;
  int steps = 12, save_every = 4, repeats = 2;
  int threads = 0;  // per rank; 0 = cores / ranks
  std::string dir = std::filesystem::temp_directory_path().string();
  std::string json;
};

enum class Mode { none, blocking, background, background_fresh };
constexpr int mode_count = 4;
const char* name(Mode m) {
  switch (m) {
    case Mode::none: return "no save";
    case Mode::blocking: return "blocking";
    case Mode::background: return "background";
    case Mode::background_fresh: return "bg, fresh";
  }
  return "";
}

//! One run's timings on rank 0: every step's seconds (a save step's include its save call), which
//! steps saved, and the run's whole time.
struct Run {
  std::vector<double> plain, saving;
  double total = 0, drain = 0;
  std::uint64_t file_bytes = 0;
};

using Gpt = loom::gpt2::Model<loom::cpu, float>;

template <class St>
Run run(const Options& o, const loom::gpt2::Config& config, Mode mode, St strategy, int threads) {
  Run out;
  const std::filesystem::path file = std::filesystem::path(o.dir) / "loom_checkpoint_bench.state";
  loom::threads::run(o.ranks, [&](loom::threads::Communicator& comm) {
    loom::cpu backend(threads);
    loom::Trainer<Gpt, loom::AdamW, loom::GradientAccumulation, St> trainer(
        backend, comm, Gpt(config), loom::AdamW(), loom::ConstantLr{.lr = 1e-4},
        {.micro_batch_size = o.batch / o.ranks}, strategy);
    loom::io::AsyncTrainingStateSaver saver(trainer, {.keep_buffers = mode != Mode::background_fresh});
    const loom::io::SyntheticMarkov data({.vocab_size = config.vocab_size});
    trainer.step(data.batch_at(0, o.batch, o.seq));  // untimed: first-touch of every buffer
    comm.barrier();
    const auto begin = std::chrono::steady_clock::now();
    for (int s = 1; s <= o.steps; ++s) {
      const bool save = s % o.save_every == 0 && mode != Mode::none;
      const double t = loom::bench::time_seconds([&] {
        trainer.step(data.batch_at(s, o.batch, o.seq));
        if (saver.pending()) saver.poll();
        if (save && mode == Mode::blocking) loom::io::save_training_state(trainer, file);
        if (save && (mode == Mode::background || mode == Mode::background_fresh)) {
          saver.wait();  // the one before, if it is still under way
          saver.start(file);
        }
      });
      if (comm.rank() == 0) (save ? out.saving : out.plain).push_back(t);
    }
    const double drain = loom::bench::time_seconds([&] { saver.wait(); });
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    if (comm.rank() == 0) {
      out.total = total;
      out.drain = drain;
    }
  });
  std::error_code ec;
  out.file_bytes = std::filesystem::exists(file, ec) ? std::filesystem::file_size(file) : 0;
  std::filesystem::remove(file, ec);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"The cost of a training-state save to the run: blocking against in the background"};
  app.add_option("--model", o.model, "GPT-2 config: tiny, small, medium, ...")->capture_default_str();
  app.add_option("--ranks", o.ranks, "Thread ranks (more than 1: ZeRO-1, each rank writing its shard)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "Global batch (sequences)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "Tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "Timed steps per run")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--save-every", o.save_every, "Save after every N steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--repeats", o.repeats, "Runs of each way, alternated")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--threads", o.threads, "Threads per rank (0 = cores / ranks)")->capture_default_str();
  app.add_option("--dir", o.dir, "Where the file is written (and removed after each run)")->capture_default_str();
  app.add_option("--json", o.json, "Write the table as JSON here");
  CLI11_PARSE(app, argc, argv);

  const double load = loom::bench::load_average();
  try {
    LOOM_CHECK(o.batch % o.ranks == 0, "--batch", o.batch, "must be a multiple of --ranks");
    loom::gpt2::Config config = loom::gpt2::config_by_name(o.model);
    config.max_seq_len = std::max(config.max_seq_len, o.seq);
    config.validate();
    const int threads = o.threads > 0 ? o.threads
                                      : std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / o.ranks);
    std::printf("loom_checkpoint_bench: GPT-2 %s (%lld parameters), %d thread rank(s)%s x %d threads, batch %lld x "
                "%lld, fp32 AdamW, a save every %d of %d steps, %d run(s) of each way alternated; files in %s\n%s\n",
                o.model.c_str(), static_cast<long long>(config.stored_parameter_count()), o.ranks,
                o.ranks > 1 ? " (ZeRO-1)" : "", threads, static_cast<long long>(o.batch),
                static_cast<long long>(o.seq), o.save_every, o.steps, o.repeats, o.dir.c_str(),
                loom::bench::machine_line(threads).c_str());
    if (const std::string w = loom::bench::load_warning(load); !w.empty()) std::printf("%s\n", w.c_str());

    const Mode modes[mode_count] = {Mode::none, Mode::blocking, Mode::background, Mode::background_fresh};
    std::vector<Run> runs[mode_count];
    for (int r = 0; r < o.repeats; ++r)
      for (int m = 0; m < mode_count; ++m)
        runs[m].push_back(o.ranks > 1 ? run(o, config, modes[m], loom::Zero<1>{}, threads)
                                      : run(o, config, modes[m], loom::SingleRank{}, threads));

    struct Row {
      double step = 0, stall = 0, total = 0, drain = 0;
      std::uint64_t bytes = 0;
    };
    Row rows[mode_count];
    for (int m = 0; m < mode_count; ++m) {
      std::vector<double> plain, saving, totals, drains;
      for (const Run& r : runs[m]) {
        plain.insert(plain.end(), r.plain.begin(), r.plain.end());
        saving.insert(saving.end(), r.saving.begin(), r.saving.end());
        totals.push_back(r.total);
        drains.push_back(r.drain);
        rows[m].bytes = std::max(rows[m].bytes, r.file_bytes);
      }
      rows[m].step = loom::bench::summarize(plain).median;
      rows[m].stall = saving.empty() ? 0 : loom::bench::summarize(saving).median - rows[m].step;
      rows[m].total = loom::bench::summarize(totals).median;
      rows[m].drain = loom::bench::summarize(drains).median;
    }
    std::printf("\n%-11s | %12s %14s | %11s %12s | %9s\n", "save", "step s", "stall/save s", "run s",
                "last wait s", "file MiB");
    for (int m = 0; m < mode_count; ++m)
      std::printf("%-11s | %12.3f %14.3f | %11.2f %12.3f | %9.1f\n", name(modes[m]), rows[m].step, rows[m].stall,
                  rows[m].total, rows[m].drain, static_cast<double>(rows[m].bytes) / (1 << 20));
    const double saves = o.steps / o.save_every;
    const double blocking_cost = rows[1].total - rows[0].total, background_cost = rows[2].total - rows[0].total;
    std::printf("\nstall per save: background %.3f s against blocking %.3f s (%.2fx); the run's time over no saves: "
                "background +%.2f s against blocking +%.2f s for %.0f saves\n",
                rows[2].stall, rows[1].stall, rows[1].stall > 0 ? rows[2].stall / rows[1].stall : 0.0, background_cost,
                blocking_cost, saves);
    std::printf("background copies into kept buffers: stall %.3f s against %.3f s into fresh ones (%.2fx); the "
                "first save of a run allocates them either way\n",
                rows[2].stall, rows[3].stall, rows[3].stall > 0 ? rows[2].stall / rows[3].stall : 0.0);
    std::printf("step s: median of the steps that do not save; stall/save: the median step that saves, less that; "
                "run s: median whole run, the last background save waited for (last wait)\n");

    nlohmann::json report;
    report["benchmark"] = "loom_checkpoint_bench";
    report["machine"] = loom::bench::machine_json(threads, load);
    report["model"] = o.model;
    report["ranks"] = o.ranks;
    report["batch"] = o.batch;
    report["seq"] = o.seq;
    report["steps"] = o.steps;
    report["save_every"] = o.save_every;
    for (int m = 0; m < mode_count; ++m)
      report["rows"].push_back({{"save", name(modes[m])}, {"step_seconds_median", rows[m].step},
                                {"stall_seconds_median", rows[m].stall}, {"run_seconds_median", rows[m].total},
                                {"last_wait_seconds", rows[m].drain}, {"file_bytes", rows[m].bytes}});
    loom::bench::write_json(o.json, report);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
