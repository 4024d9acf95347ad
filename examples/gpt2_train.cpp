// gpt2_train: trains GPT-2 with loom, on one rank or data-parallel over several.
//
//   gpt2_train --demo                                   # the README demo: < 2 minutes on 2 cores
//   gpt2_train --model small --data tokens.bin --batch 8 --micro-batch 4 --seq 1024 --steps 100
//   gpt2_train --init gpt2_124M.bin --data tokens.bin --save tuned.bin --metrics run.jsonl
//   gpt2_train --demo --dp 4                            # DDP over 4 thread ranks, one process
//   mpirun -n 2 gpt2_train --demo --comm mpi            # DDP over 2 MPI processes
//   gpt2_train --demo --dp 2 --zero 3                   # ZeRO-3 (FSDP FULL_SHARD) over 2 ranks
//   gpt2_train --demo --dp 2 --tp 2                     # 4 ranks: 2 replicas of a 2-way TP model
//
// One idea: a Trainer composed of a Model, an Optimizer, a Schedule and a Strategy runs a step on
// a global batch; every rank passes the same global batch and trains on its slice; everything
// printed comes from the step's metrics and the backends' memory reports (rank 0 prints).

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <type_traits>
#include <span>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/io/llmc_checkpoint.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/io/token_file.hpp"
#include "loom/loom.hpp"
#if LOOM_EXAMPLE_WITH_MPI
#include "loom/comm/mpi.hpp"
#endif

namespace {

struct Options {
  std::string model = "tiny";
  std::optional<std::int64_t> layers, heads, channels;
  std::int64_t steps = 100;
  std::int64_t batch = 8;  // sequences per global batch
  std::int64_t micro_batch = 0;  // 0 = the whole batch in one micro-batch
  std::int64_t accumulation = 0;  // 0 = batch / micro_batch
  std::int64_t seq = 64;
  double lr = 1e-3;
  std::int64_t warmup = 0;
  double min_lr_factor = 0.1;
  double clip = 1.0;
  double weight_decay = 0.1;
  std::string optimizer = "adamw";
  std::uint64_t seed = 1337;
  std::string data = "synthetic";
  double jump_probability = 0.1;
  std::string metrics;
  std::string init;
  std::string save;
  int threads = 0;
  double peak_tflops = 0;
  std::int64_t log_every = 1;
  int dp = 1;
  int tp = 1;
  int zero = 0;
  int prefetch = 1;
  std::string comm = "threads";
  std::size_t bucket_mib = 25;
  bool no_overlap = false;
  bool demo = false;
};

using Source = std::variant<loom::io::SyntheticMarkov, loom::io::TokenFile>;

Source open_data(const Options& o, std::int64_t model_vocab) {
  if (o.data == "synthetic")
    return loom::io::SyntheticMarkov({.vocab_size = model_vocab,
                                      .jump_probability = o.jump_probability,
                                      .seed = o.seed + 1});
  if (o.data.starts_with("bytes:")) return loom::io::TokenFile::bytes(o.data.substr(6));
  return loom::io::TokenFile::open(o.data, model_vocab);
}

std::int64_t source_vocab(const Source& s) {
  return std::visit([](const auto& src) { return src.vocab_size(); }, s);
}

loom::gpt2::Config model_config(const Options& o) {
  loom::gpt2::Config c = loom::gpt2::config_by_name(o.model);
  if (o.layers) c.num_layers = *o.layers;
  if (o.heads) c.num_heads = *o.heads;
  if (o.channels) c.channels = *o.channels;
  // Byte-level data and the synthetic task use a 256-token vocabulary.
  if (o.data == "synthetic" || o.data.starts_with("bytes:")) c.vocab_size = c.padded_vocab_size = 256;
  c.max_seq_len = std::max(c.max_seq_len, o.seq);
  if (!o.init.empty()) c = loom::io::read_llmc_config(o.init);
  c.validate();
  return c;
}

nlohmann::json memory_json(const loom::MemoryTracker& m) {
  nlohmann::json j;
  for (int i = 0; i < loom::memory_category_count; ++i) {
    const auto c = static_cast<loom::MemoryCategory>(i);
    j[std::string(loom::name(c))] = {{"bytes", m.current(c)}, {"peak_bytes", m.peak(c)}};
  }
  j["total"] = {{"bytes", m.current_total()}, {"peak_bytes", m.peak_total()}};
  return j;
}

//! Each rank's memory by category, gathered to rank 0 and printed there.
template <class Group>
void print_memory_per_rank(Group& group, const loom::MemoryTracker& m) {
  constexpr int fields = loom::memory_category_count + 1;
  std::vector<double> mine(fields), all(static_cast<std::size_t>(fields * group.size()));
  for (int i = 0; i < loom::memory_category_count; ++i)
    mine[i] = loom::MemoryTracker::mib(m.current(static_cast<loom::MemoryCategory>(i)));
  mine[fields - 1] = loom::MemoryTracker::mib(m.peak_total());
  group.all_gather(std::span<double>(mine), std::span<double>(all));
  if (group.rank() != 0) return;
  std::printf("memory per rank after step 1 (MiB):\n  rank");
  for (int i = 0; i < loom::memory_category_count; ++i)
    std::printf(" %15s", std::string(loom::name(static_cast<loom::MemoryCategory>(i))).c_str());
  std::printf(" %10s\n", "peak");
  for (int r = 0; r < group.size(); ++r) {
    std::printf("  %4d", r);
    for (int i = 0; i < fields; ++i) std::printf(" %*.2f", i + 1 < fields ? 15 : 10, all[r * fields + i]);
    std::printf("\n");
  }
}

//! The ZeRO formula for this rank's parameters + gradients + optimizer state (fp32, so 4 bytes
//! each and 4 per optimizer slot), beside what it holds; padding and the working set apart.
template <class Strategy>
void print_zero_memory(const loom::ShardPlan& plan, const loom::MemoryTracker& m, const Strategy&, int slots) {
  using loom::MemoryCategory;
  const double psi = static_cast<double>(plan.padded_total() - plan.padding()), n = plan.ranks();
  const double state = 4.0 * slots;
  const int stage = std::is_same_v<Strategy, loom::Zero<1>> ? 1 : std::is_same_v<Strategy, loom::Zero<2>> ? 2 : 3;
  const double formula = stage == 1 ? 8 * psi + state * psi / n
                       : stage == 2 ? 4 * psi + (4 + state) * psi / n
                                    : (8 + state) * psi / n;
  const double held = static_cast<double>(m.current(MemoryCategory::parameters) + m.current(MemoryCategory::gradients) +
                                          m.current(MemoryCategory::optimizer_state));
  std::printf("ZeRO-%d memory on rank 0: formula %.2f MiB (psi = %.0f parameters, N = %d, %d state slots), "
              "held %.2f MiB, of which padding %.2f MiB (%lld elements); working set (communication, peak) %.2f MiB\n",
              stage, formula / (1 << 20), psi, plan.ranks(), slots, held / (1 << 20), (held - formula) / (1 << 20),
              static_cast<long long>(plan.padding()), loom::MemoryTracker::mib(m.peak(MemoryCategory::communication)));
}

template <class Strategy, class Opt, class Group>
int train(const Options& o, Opt optimizer, loom::Mesh<Group>& mesh, Strategy strategy, int threads) {
  using namespace loom;
  Group& group = mesh.data_parallel();
  Group& world = mesh.world();
  const bool lead = world.rank() == 0;
  const gpt2::Config config = model_config(o);
  const Source data = open_data(o, config.vocab_size);
  LOOM_CHECK(source_vocab(data) <= config.vocab_size, "--data vocabulary", source_vocab(data),
             "must be <= the model's vocab_size (" + std::to_string(config.vocab_size) + ")");
  LOOM_CHECK(o.seq >= 1 && o.seq <= config.max_seq_len, "--seq", o.seq,
             "must be in [1, max_seq_len = " + std::to_string(config.max_seq_len) + "]");
  // --micro-batch 0: each rank's whole slice in one micro-batch.
  const std::int64_t micro = o.micro_batch == 0 ? std::max<std::int64_t>(1, o.batch / group.size()) : o.micro_batch;
  if (o.accumulation > 0)
    LOOM_CHECK(o.batch == micro * o.accumulation * group.size(), "--accumulation", o.accumulation,
               "--batch (" + std::to_string(o.batch) + ") must equal --micro-batch (" +
                   std::to_string(micro) + ") x --accumulation x data-parallel ranks (" +
                   std::to_string(group.size()) + ")");
  cpu backend(threads);
  const WarmupCosineLr schedule{.lr = o.lr, .warmup = o.warmup, .total_steps = o.steps,
                                .min_lr_factor = o.min_lr_factor};
  schedule.validate();
  Trainer<gpt2::Model<cpu, float>, Opt, GradientAccumulation, Strategy> trainer(
      backend, mesh, gpt2::Model<cpu, float>(config, mesh.tensor_parallel()), optimizer, schedule,
      {.micro_batch_size = micro, .clip_grad_norm = o.clip, .seed = o.seed}, strategy);
  if (!o.init.empty()) {
    // Every rank reads the file and keeps its part (the whole model, or its ZeRO shard).
    std::vector<float> weights(static_cast<std::size_t>(trainer.model().layout().total()));
    io::load_llmc_checkpoint(o.init, config, trainer.model().layout(), weights.data());
    trainer.load_parameters(weights);
  }

  if (lead) {
  std::printf("loom gpt2_train: model %s %s\n", o.model.c_str(),
              detail::to_text(config).c_str());
  std::printf("  parameters %lld (stored %lld), %d threads per rank, batch %lld x seq %lld, micro-batch %lld (%lld per step per rank)\n",
              static_cast<long long>(config.parameter_count()),
              static_cast<long long>(config.stored_parameter_count()), backend.threads(),
              static_cast<long long>(o.batch), static_cast<long long>(o.seq),
              static_cast<long long>(micro), static_cast<long long>(o.batch / (micro * group.size())));
  std::printf("  strategy %s over %d rank(s) (%s), mesh %s\n", detail::to_text(strategy).c_str(), world.size(),
              world.size() == 1 ? "one rank" : o.comm.c_str(), detail::to_text(mesh.shape()).c_str());
  std::visit([&](const auto& src) {
    if constexpr (std::is_same_v<std::decay_t<decltype(src)>, io::SyntheticMarkov>)
      std::printf("  data: synthetic Markov task %s, ln(vocab) %.3f, entropy floor %.3f nats\n",
                  detail::to_text(src.config()).c_str(), std::log(double(src.vocab_size())),
                  src.entropy_floor());
    else
      std::printf("  data: %s, %lld tokens, vocab %lld\n", src.name().c_str(),
                  static_cast<long long>(src.size()), static_cast<long long>(src.vocab_size()));
  }, data);
  }

  std::ofstream metrics;
  if (lead && !o.metrics.empty()) {
    metrics.open(o.metrics);
    LOOM_CHECK(metrics.good(), "--metrics", o.metrics, "the file must be writable");
  }
  double first_loss = 0, last_loss = 0;
  for (std::int64_t s = 0; s < o.steps; ++s) {
    const io::Batch batch = std::visit([&](const auto& src) { return src.batch_at(s, o.batch, o.seq); }, data);
    const StepMetrics m = trainer.step(batch);
    if (s == 0) first_loss = m.loss;
    last_loss = m.loss;
    const double tflops = m.flops / m.seconds / 1e12;
    const MemoryTracker& mem = trainer.memory();
    if (lead && (s % o.log_every == 0 || s + 1 == o.steps)) {
      std::printf("step %5lld | loss %.4f | lr %.2e | grad norm %.3f | %8.0f tok/s | %.3f TFLOP/s",
                  static_cast<long long>(m.step), m.loss, m.lr, m.grad_norm, m.tokens_per_second, tflops);
      if (o.peak_tflops > 0) std::printf(" | MFU %.1f%%", 100.0 * tflops / o.peak_tflops);
      std::printf(" | mem %.1f MiB (peak %.1f)\n", MemoryTracker::mib(mem.current_total()),
                  MemoryTracker::mib(mem.peak_total()));
      std::fflush(stdout);
    }
    if (s == 0 && lead) std::cout << "memory by category after step 1 (rank 0):\n" << mem;
    if (s == 0 && world.size() > 1) print_memory_per_rank(world, mem);
    if constexpr (requires { trainer.engine().plan(); })
      if (s == 0 && lead) print_zero_memory(trainer.engine().plan(), mem, strategy, Opt::state_slots);
    if (metrics.is_open()) {
      nlohmann::json j = {{"step", m.step}, {"loss", m.loss}, {"lr", m.lr},
                          {"grad_norm", m.grad_norm}, {"tokens", m.tokens},
                          {"seconds", m.seconds}, {"tokens_per_second", m.tokens_per_second},
                          {"tflops", tflops}, {"memory", memory_json(mem)}};
      if (o.peak_tflops > 0) j["mfu"] = tflops / o.peak_tflops;
      metrics << j.dump() << '\n';
      metrics.flush();
    }
  }
  if (lead)
    std::printf("loss %.4f -> %.4f over %lld steps\n", first_loss, last_loss, static_cast<long long>(o.steps));
  if (!o.save.empty()) {
    const std::vector<float> weights = trainer.gather_parameters();  // collective under ZeRO-3
    if (lead) io::save_llmc_checkpoint(o.save, config, trainer.model().layout(), weights.data());
  }
  if (lead && !o.save.empty()) {
    std::printf("saved %s\n", o.save.c_str());
  }
  return 0;
}

//! Picks the optimizer and the strategy (SingleRank on one rank, DataParallel on more).
template <class Group>
int train_on(const Options& o, Group& world, int threads) {
  LOOM_CHECK(world.size() % o.tp == 0, "--tp", o.tp,
             "must divide the number of ranks (" + std::to_string(world.size()) + ")");
  loom::Mesh<Group> mesh(world, {.dp = world.size() / o.tp, .tp = o.tp, .pp = 1});
  Group& group = mesh.data_parallel();
  const auto with_strategy = [&](auto optimizer) {
    const std::size_t bucket_bytes = o.bucket_mib << 20;
    switch (o.zero) {
      case 1: return train(o, optimizer, mesh, loom::Zero<1>{.bucket_bytes = bucket_bytes, .overlap = !o.no_overlap}, threads);
      case 2: return train(o, optimizer, mesh, loom::Zero<2>{.bucket_bytes = bucket_bytes, .overlap = !o.no_overlap}, threads);
      case 3:
        return train(o, optimizer, mesh,
                     loom::Zero<3>{.bucket_bytes = bucket_bytes, .overlap = !o.no_overlap, .prefetch = o.prefetch}, threads);
      default:
        if (group.size() == 1) return train(o, optimizer, mesh, loom::SingleRank{}, threads);
        return train(o, optimizer, mesh, loom::DataParallel{.bucket_bytes = bucket_bytes, .overlap = !o.no_overlap}, threads);
    }
  };
  if (o.optimizer == "sgd") return with_strategy(loom::SgdMomentum({.momentum = 0.9, .weight_decay = o.weight_decay}));
  return with_strategy(loom::AdamW({.weight_decay = o.weight_decay}));
}

int run(const Options& o, int& argc, char**& argv) {
  const int cores = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (o.comm == "mpi") {
#if LOOM_EXAMPLE_WITH_MPI
    return loom::mpi::run(argc, argv, [&](loom::mpi::Communicator& world) {
      LOOM_CHECK(o.dp == 1 || o.dp * o.tp == world.size(), "--dp", o.dp,
                 "x --tp must equal the MPI world size (" + std::to_string(world.size()) + ") with --comm mpi");
      // Each process uses --threads (0 = every core of its machine).
      const int code = train_on(o, world, o.threads);
      if (code != 0) throw loom::Error("gpt2_train", code, "training failed");
    });
#else
    throw loom::Error("--comm", o.comm, "this gpt2_train was built without MPI (install libopenmpi-dev and rebuild)");
#endif
  }
  const int ranks = o.dp * o.tp;
  if (ranks == 1) {
    loom::SelfCommunicator self;
    return train_on(o, self, o.threads);
  }
  // Thread ranks share the cores: each gets its share of --threads (at least one).
  const int per_rank = std::max(1, cores / ranks);
  int code = 0;
  loom::threads::run(ranks, [&](loom::threads::Communicator& comm) {
    const int c = train_on(o, comm, per_rank);
    if (comm.rank() == 0) code = c;
  });
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Train GPT-2 with loom (one rank, CPU backend)."};
  app.add_flag("--demo", o.demo,
               "The README demo: a 4-layer, 128-channel GPT-2 on the synthetic task; finishes in "
               "under 2 minutes on 2 cores. Other options given after it still apply.");
  app.add_option("--model", o.model, "Config: tiny, small (124M), medium (350M), large (774M), xl (1.5B), 2.7B")
      ->capture_default_str();
  app.add_option("--layers", o.layers, "Override the config's number of layers");
  app.add_option("--heads", o.heads, "Override the config's number of heads");
  app.add_option("--channels", o.channels, "Override the config's hidden size");
  app.add_option("--steps", o.steps, "Optimizer steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--batch", o.batch, "Sequences per global batch")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--micro-batch", o.micro_batch,
                 "Sequences per micro-batch; the batch is accumulated over batch/micro-batch of them (0 = batch)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--accumulation", o.accumulation,
                 "Micro-batches per step on each rank; sets --batch to micro-batch x accumulation x ranks (0 = from --batch)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--seq", o.seq, "Tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "Peak learning rate")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", o.warmup, "Linear warmup steps from 0")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--min-lr-factor", o.min_lr_factor, "Cosine decay ends at this fraction of --lr")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_option("--clip", o.clip, "Clip the global gradient norm to this (0 = off)")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--optimizer", o.optimizer, "adamw or sgd (momentum 0.9)")
      ->capture_default_str()->check(CLI::IsMember({"adamw", "sgd"}));
  app.add_option("--weight-decay", o.weight_decay, "Weight decay on matrices and embeddings")
      ->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--seed", o.seed, "Seed of the initial weights (and of the synthetic data)")->capture_default_str();
  app.add_option("--data", o.data,
                 "synthetic, an llm.c token file (uint16, magic 20240520), or bytes:FILE (any file, vocab 256)")
      ->capture_default_str();
  app.add_option("--jump-probability", o.jump_probability, "Synthetic task: chance a token breaks the chain")
      ->capture_default_str()->check(CLI::Range(0.0, 1.0));
  app.add_option("--metrics", o.metrics, "Write one JSON object per step to this file (JSON Lines)");
  app.add_option("--init", o.init, "Start from an llm.c GPT-2 checkpoint (its header sets the model config)");
  app.add_option("--save", o.save, "Write the trained weights as an llm.c checkpoint");
  app.add_option("--threads", o.threads, "CPU threads (0 = all cores)")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--peak-tflops", o.peak_tflops, "The machine's peak TFLOP/s, to print MFU")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--log-every", o.log_every, "Print every N steps")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--dp", o.dp,
                 "Data-parallel ranks (DDP). With --comm threads: thread ranks in this process, sharing "
                 "--threads; with --comm mpi: must equal the MPI world size (or be left at 1 to take it)")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--tp", o.tp,
                 "Tensor-parallel ranks per model replica (Megatron's split; heads, channels and the padded "
                 "vocabulary must divide by it). Ranks = dp x tp")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--comm", o.comm, "Communicator: threads (ranks as threads) or mpi (run under mpirun)")
      ->capture_default_str()->check(CLI::IsMember({"threads", "mpi"}));
  app.add_option("--bucket-mib", o.bucket_mib, "DDP gradient bucket size in MiB")
      ->capture_default_str()->check(CLI::PositiveNumber);
  app.add_flag("--no-overlap", o.no_overlap, "DDP/ZeRO: reduce all buckets after backward instead of during it");
  app.add_option("--zero", o.zero,
                 "ZeRO stage over the data-parallel ranks: 1 (optimizer state sharded), 2 (+ gradients), "
                 "3 (+ parameters, gathered per layer); 0 = DDP")
      ->capture_default_str()->check(CLI::Range(0, 3));
  app.add_option("--prefetch", o.prefetch, "ZeRO-3: layers whose parameters are gathered ahead")
      ->capture_default_str()->check(CLI::NonNegativeNumber);

  // --demo sets defaults first; explicit options on the command line win.
  for (int i = 1; i < argc; ++i)
    if (std::string(argv[i]) == "--demo") {
      o.model = "tiny";
      o.layers = 4;
      o.heads = 4;
      o.channels = 128;
      o.steps = 300;
      o.batch = 16;
      o.seq = 64;
      o.lr = 3e-3;
      o.warmup = 20;
      o.log_every = 10;
    }
  CLI11_PARSE(app, argc, argv);
  if (o.accumulation > 0 && o.micro_batch > 0 && !app.count("--batch"))
    o.batch = o.micro_batch * o.accumulation * (o.comm == "threads" ? o.dp : 1);
  try {
    return run(o, argc, argv);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
