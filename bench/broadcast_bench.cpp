// loom_broadcast_bench: moving one tensor from a source rank to every rank, three ways built on
// the communicator's send and recv, beside the communicator's own broadcast.
//
//   loom_broadcast_bench                                   # 4 thread ranks, 1, 16, 64, 256 MiB
//   loom_broadcast_bench --ranks 8 --sizes 64M --chunks 256K,1M,4M --json bcast.json
//   mpiexec -n 4 loom_broadcast_bench --comm mpi           # the same over MPI, with MPI_Bcast too
//
// The strategies (reproducing a user study of broadcasting a tensor):
//   naive      the root sends the whole tensor to each other rank in turn (blocking sends);
//   chunked    a chain root -> root+1 -> ... in chunks: each rank receives a whole chunk, then
//              forwards it, then receives the next (store and forward, blocking);
//   pipelined  the same chain with asynchronous send and recv: chunk k+1 is already being
//              received while chunk k is forwarded (two chunks in flight each way).
// and `broadcast`, the communicator's collective (plus MPI_Bcast with --comm mpi). Every
// variant's result is checked on every rank before it is timed (receivers start from a
// sentinel) and again after. Times are medians over --iters calls (the slowest rank's time per
// call; the variants take turns call by call); GB/s is tensor bytes / time, "moved GB/s" the
// bytes delivered to all receivers, (ranks − 1) × tensor bytes, over the time.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "comm_bench_common.hpp"
#include "loom/comm/request.hpp"
#include "loom/comm/threads.hpp"
#include "loom/core/error.hpp"
#if LOOM_BENCH_WITH_MPI
#include <mpi.h>

#include "loom/comm/mpi.hpp"
#endif

namespace {

using loom::bench::bytes_text;

struct Options {
  int ranks = 4;
  std::vector<std::size_t> sizes = {std::size_t{1} << 20, std::size_t{16} << 20, std::size_t{64} << 20,
                                    std::size_t{256} << 20};
  std::vector<std::size_t> chunks = {std::size_t{256} << 10, std::size_t{1} << 20, std::size_t{4} << 20};
  int root = 0;
  int iters = 20;
  int warmup = 2;
  std::size_t budget_bytes = std::size_t{2} << 30;  //!< larger tensors get fewer calls (>= 3)
  std::string comm = "threads";
  std::string json;
};

//! Tags repeat after this many chunks (MPI guarantees at least 32767; messages between two
//! ranks with the same tag arrive in order, so reuse is safe).
constexpr int tag_period = 4096;

//! The rank after and before `rank` in the chain that starts at `root`.
int next_rank(int rank, int n) { return (rank + 1) % n; }
int previous_rank(int rank, int n) { return (rank + n - 1) % n; }
//! `rank`'s place in the chain (the root is 0).
int position(int rank, int root, int n) { return (rank - root + n) % n; }

//! Naive: the root sends the whole tensor to every other rank in turn.
template <class Comm>
void broadcast_naive(Comm& comm, std::span<float> data, int root) {
  if (comm.rank() != root) {
    comm.recv(data, root, 0);
    return;
  }
  for (int r = 0; r < comm.size(); ++r)
    if (r != root) comm.send(data, r, 0);
}

//! Chunked: store and forward along the chain, one whole chunk at a time.
template <class Comm>
void broadcast_chunked(Comm& comm, std::span<float> data, int root, std::size_t chunk) {
  const int n = comm.size(), rank = comm.rank(), place = position(rank, root, n);
  for (std::size_t begin = 0, k = 0; begin < data.size(); begin += chunk, ++k) {
    const std::span<float> part = data.subspan(begin, std::min(chunk, data.size() - begin));
    const int tag = static_cast<int>(k % tag_period);
    if (place > 0) comm.recv(part, previous_rank(rank, n), tag);
    if (place < n - 1) comm.send(part, next_rank(rank, n), tag);
  }
}

//! Pipelined: the chain with chunk k+1 in flight (received) while chunk k is forwarded; at most
//! two receives and two sends outstanding per rank.
template <class Comm>
void broadcast_pipelined(Comm& comm, std::span<float> data, int root, std::size_t chunk) {
  const int n = comm.size(), rank = comm.rank(), place = position(rank, root, n);
  const std::size_t chunks = (data.size() + chunk - 1) / chunk;
  auto part = [&](std::size_t k) { return data.subspan(k * chunk, std::min(chunk, data.size() - k * chunk)); };
  auto tag = [](std::size_t k) { return static_cast<int>(k % tag_period); };
  loom::Request receives[2], sends[2];
  if (place > 0) receives[0] = comm.recv_async(part(0), previous_rank(rank, n), tag(0));
  for (std::size_t k = 0; k < chunks; ++k) {
    if (place > 0) {
      if (k + 1 < chunks) receives[(k + 1) % 2] = comm.recv_async(part(k + 1), previous_rank(rank, n), tag(k + 1));
      receives[k % 2].wait();
    }
    if (place < n - 1) {
      sends[k % 2].wait();  // the send of chunk k-2
      sends[k % 2] = comm.send_async(part(k), next_rank(rank, n), tag(k));
    }
  }
  sends[0].wait();
  sends[1].wait();
}

//! One way of broadcasting.
struct Variant {
  std::string strategy;
  std::size_t chunk = 0;  //!< 0: not chunked
  std::function<void(std::span<float>)> run;
  std::string label() const { return chunk ? strategy + " " + bytes_text(chunk) : strategy; }
};

float pattern(std::size_t i) { return static_cast<float>(i % 1021) + 0.5f; }
constexpr float sentinel = -1.0f;

//! The index of the first element of `data` that is not the pattern, or data.size().
std::size_t first_wrong(std::span<const float> data) {
  for (std::size_t i = 0; i < data.size(); ++i)
    if (data[i] != pattern(i)) return i;
  return data.size();
}

struct Row {
  std::size_t bytes = 0, chunk = 0;
  std::string strategy;
  int iterations = 0;
  std::vector<double> seconds;
  loom::bench::Stats stats;
  double gbps = 0;
};

int iterations_for(const Options& o, std::size_t bytes) {
  const auto fit = static_cast<long long>(o.budget_bytes / std::max<std::size_t>(bytes, 1));
  return static_cast<int>(std::clamp<long long>(fit, std::min(3, o.iters), o.iters));
}

//! Checks `data` against the pattern on every rank; throws on all ranks if one is wrong.
template <class Group>
void verify(Group& group, std::span<const float> data, const std::string& what) {
  const std::size_t wrong = first_wrong(data);
  if (wrong < data.size())
    std::fprintf(stderr, "rank %d: %s: element %zu is %g, expected %g\n", group.rank(), what.c_str(), wrong,
                 static_cast<double>(data[wrong]), static_cast<double>(pattern(wrong)));
  const std::vector<double> bad = loom::bench::max_over_ranks(group, {wrong < data.size() ? 1.0 : 0.0});
  LOOM_CHECK(bad[0] == 0.0, what, "a wrong tensor on some rank", "every rank must receive the root's bytes");
}

/// Times every variant on every size; `sync` is the barrier before each call. Rank 0 prints.
template <class Group, class Sync>
std::vector<Row> run_all(const Options& o, Group& group, Sync&& sync, const std::vector<Variant>& variants,
                         const std::string& ranks_text) {
  const int rank = group.rank();
  const bool lead = rank == 0;
  const std::size_t largest = *std::max_element(o.sizes.begin(), o.sizes.end());
  std::vector<float> buffer(largest / sizeof(float));
  std::vector<Row> rows;
  for (std::size_t bytes : o.sizes) {
    const std::span<float> data(buffer.data(), bytes / sizeof(float));
    // The variants that apply: a chunk must split the tensor into at least two pieces.
    std::vector<const Variant*> active;
    for (const Variant& v : variants)
      if (v.chunk == 0 || v.chunk < bytes) active.push_back(&v);
    auto fill = [&] {
      if (rank == o.root)
        for (std::size_t i = 0; i < data.size(); ++i) data[i] = pattern(i);
      else
        std::fill(data.begin(), data.end(), sentinel);
    };
    for (const Variant* v : active) {
      fill();
      sync();
      v->run(data);
      verify(group, data, v->label() + " of " + bytes_text(bytes));
    }
    const int iterations = iterations_for(o, bytes);
    for (int w = 0; w < o.warmup; ++w)
      for (const Variant* v : active) {
        sync();
        v->run(data);
      }
    std::vector<double> samples(active.size() * static_cast<std::size_t>(iterations));
    for (int it = 0; it < iterations; ++it)
      for (std::size_t v = 0; v < active.size(); ++v)
        samples[v * iterations + it] = loom::bench::time_on_rank(sync, [&] { active[v]->run(data); });
    samples = loom::bench::max_over_ranks(group, std::move(samples));
    // The timed calls overwrote the receivers' copies with the same bytes; check them again.
    verify(group, data, "after the timed calls, " + bytes_text(bytes));

    std::vector<Row> size_rows;
    for (std::size_t v = 0; v < active.size(); ++v) {
      Row r;
      r.bytes = bytes;
      r.chunk = active[v]->chunk;
      r.strategy = active[v]->strategy;
      r.iterations = iterations;
      r.seconds.assign(samples.begin() + v * iterations, samples.begin() + (v + 1) * iterations);
      r.stats = loom::bench::summarize(r.seconds);
      r.gbps = static_cast<double>(bytes) / r.stats.median / 1e9;
      size_rows.push_back(std::move(r));
    }
    if (lead) {
      const Row& naive = size_rows.front();
      std::printf("\ntensor %s, %s, root %d, %d timed calls (median ms; GB/s = tensor bytes / time; moved: "
                  "bytes delivered to all receivers / time)\n",
                  bytes_text(bytes).c_str(), ranks_text.c_str(), o.root, iterations);
      std::printf("  %-12s %9s %10s %8s %10s %9s\n", "strategy", "chunk", "median ms", "GB/s", "moved GB/s", "vs naive");
      for (const Row& r : size_rows)
        std::printf("  %-12s %9s %10.2f %8.2f %10.2f %8.2fx\n", r.strategy.c_str(),
                    r.chunk ? bytes_text(r.chunk).c_str() : "-", 1e3 * r.stats.median, r.gbps,
                    r.gbps * (group.size() - 1), naive.stats.median / r.stats.median);
      // The fastest, and by how much it beats the best of each other strategy.
      const Row* fastest = &size_rows.front();
      for (const Row& r : size_rows)
        if (r.stats.median < fastest->stats.median) fastest = &r;
      std::string against;
      std::vector<std::string> seen;
      for (const Row& r : size_rows) {
        if (r.strategy == fastest->strategy || std::find(seen.begin(), seen.end(), r.strategy) != seen.end()) continue;
        seen.push_back(r.strategy);
        const Row* best = &r;
        for (const Row& q : size_rows)
          if (q.strategy == r.strategy && q.stats.median < best->stats.median) best = &q;
        char text[96];
        std::snprintf(text, sizeof text, "%s%.2fx vs %s%s%s", against.empty() ? "" : ", ",
                      best->stats.median / fastest->stats.median, best->strategy.c_str(),
                      best->chunk ? " " : "", best->chunk ? bytes_text(best->chunk).c_str() : "");
        against += text;
      }
      std::printf("  fastest: %s%s%s, %.2f ms (%s)\n", fastest->strategy.c_str(), fastest->chunk ? " " : "",
                  fastest->chunk ? bytes_text(fastest->chunk).c_str() : "", 1e3 * fastest->stats.median,
                  against.c_str());
      std::fflush(stdout);
    }
    for (Row& r : size_rows) rows.push_back(std::move(r));
  }
  return rows;
}

//! The strategies over communicator `comm`, one variant per chunk size for the chunked ones.
template <class Comm>
std::vector<Variant> strategies(const Options& o, Comm& comm) {
  std::vector<Variant> variants = {
      {"naive", 0, [&comm, root = o.root](std::span<float> d) { broadcast_naive(comm, d, root); }},
      {"broadcast", 0, [&comm, root = o.root](std::span<float> d) { comm.broadcast(d, root); }}};
  for (std::size_t chunk : o.chunks)
    variants.push_back({"chunked", chunk, [&comm, root = o.root, c = chunk / sizeof(float)](std::span<float> d) {
                          broadcast_chunked(comm, d, root, c);
                        }});
  for (std::size_t chunk : o.chunks)
    variants.push_back({"pipelined", chunk, [&comm, root = o.root, c = chunk / sizeof(float)](std::span<float> d) {
                          broadcast_pipelined(comm, d, root, c);
                        }});
  return variants;
}

nlohmann::json report_json(const Options& o, int ranks, double load, const std::vector<Row>& rows) {
  nlohmann::json report = {{"benchmark", "loom_broadcast_bench"},
                           {"date", loom::bench::utc_now()},
                           {"machine", loom::bench::machine_json(ranks, load)},
                           {"settings",
                            {{"comm", o.comm}, {"ranks", ranks}, {"root", o.root}, {"sizes", o.sizes},
                             {"chunks", o.chunks}, {"iters", o.iters}, {"warmup", o.warmup},
                             {"budget_bytes", o.budget_bytes}, {"dtype", "float32"}}},
                           {"results", nlohmann::json::array()}};
  for (const Row& r : rows)
    report["results"].push_back({{"bytes", r.bytes},
                                 {"strategy", r.strategy},
                                 {"chunk_bytes", r.chunk},
                                 {"iterations", r.iterations},
                                 {"seconds", r.seconds},
                                 {"median_ms", 1e3 * r.stats.median},
                                 {"mean_ms", 1e3 * r.stats.mean},
                                 {"min_ms", 1e3 * r.stats.min},
                                 {"gbps", r.gbps}});
  return report;
}

std::string title(const Options& o, const std::string& comm, int ranks) {
  std::string sizes, chunks;
  for (std::size_t s : o.sizes) sizes += (sizes.empty() ? "" : ", ") + bytes_text(s);
  for (std::size_t c : o.chunks) chunks += (chunks.empty() ? "" : ", ") + bytes_text(c);
  return "loom_broadcast_bench: " + comm + ", " + std::to_string(ranks) + " ranks, tensors " + sizes +
         "; chunks " + chunks;
}

int run_threads(const Options& o) {
  const double load = loom::bench::print_header(true, title(o, "threads communicator", o.ranks), o.ranks);
  std::vector<Row> rows;
  loom::threads::run(o.ranks, [&](loom::threads::Communicator& comm) {
    const std::vector<Variant> variants = strategies(o, comm);
    std::vector<Row> mine =
        run_all(o, comm, [&] { comm.barrier(); }, variants, std::to_string(comm.size()) + " thread ranks");
    if (comm.rank() == 0) rows = std::move(mine);
  });
  const std::string warning = loom::bench::load_warning(load);
  if (!warning.empty()) std::printf("\n%s\n", warning.c_str());
  loom::bench::write_json(o.json, report_json(o, o.ranks, load, rows));
  return 0;
}

#if LOOM_BENCH_WITH_MPI
int run_mpi(const Options& o, int& argc, char**& argv) {
  return loom::mpi::run(argc, argv, [&](loom::mpi::Communicator& comm) {
    const int n = comm.size();
    const bool lead = comm.rank() == 0;
    LOOM_CHECK(n >= 2, "--comm mpi: ranks", n, "must be >= 2 (run under mpiexec -n 2 or more)");
    LOOM_CHECK(o.root < n, "--root", o.root, "must be a rank of the MPI world (size " + std::to_string(n) + ")");
    const double load = loom::bench::print_header(lead, title(o, "MPI communicator", n), n);
    MPI_Comm raw = MPI_COMM_NULL;
    MPI_Comm_dup(MPI_COMM_WORLD, &raw);
    std::vector<Variant> variants = strategies(o, comm);
    variants.insert(variants.begin() + 2, Variant{"MPI_Bcast", 0, [raw, root = o.root](std::span<float> d) {
                                                    MPI_Bcast(d.data(), static_cast<int>(d.size()), MPI_FLOAT, root, raw);
                                                  }});
    const std::vector<Row> rows =
        run_all(o, comm, [&] { MPI_Barrier(raw); }, variants, std::to_string(n) + " MPI processes");
    MPI_Comm_free(&raw);
    if (!lead) return 0;
    const std::string warning = loom::bench::load_warning(load);
    if (!warning.empty()) std::printf("\n%s\n", warning.c_str());
    loom::bench::write_json(o.json, report_json(o, n, load, rows));
    return 0;
  });
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Naive, chunked and pipelined broadcast over send/recv, beside the communicator's broadcast."};
  app.add_option("--ranks", o.ranks, "Thread ranks (--comm threads)")->capture_default_str()->check(CLI::Range(2, 256));
  app.add_option("--sizes", o.sizes, "Tensor sizes (1M, 64M, ...)")
      ->delimiter(',')
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--chunks", o.chunks, "Chunk sizes of the chunked and pipelined strategies")
      ->delimiter(',')
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--root", o.root, "The source rank")->capture_default_str()->check(CLI::NonNegativeNumber);
  app.add_option("--iters", o.iters, "Timed calls per variant and size (fewer for large tensors)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "Untimed calls per variant and size")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--budget-bytes", o.budget_bytes,
                 "Tensors whose --iters calls would move more than this get fewer calls (at least 3)")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--comm", o.comm, "threads, or mpi (under mpiexec)")
      ->capture_default_str()
      ->check(CLI::IsMember({"threads", "mpi"}));
  app.add_option("--json", o.json, "Also write the results to this JSON file");
  CLI11_PARSE(app, argc, argv);
  try {
    for (std::size_t s : o.sizes)
      LOOM_CHECK(s >= sizeof(float) && s % sizeof(float) == 0, "--sizes", s, "must be positive multiples of 4 bytes");
    for (std::size_t c : o.chunks)
      LOOM_CHECK(c >= sizeof(float) && c % sizeof(float) == 0, "--chunks", c, "must be positive multiples of 4 bytes");
    if (o.comm == "mpi") {
#if LOOM_BENCH_WITH_MPI
      return run_mpi(o, argc, argv);
#else
      throw loom::Error("--comm", o.comm, "this build has no MPI (loom::mpi was not found)");
#endif
    }
    LOOM_CHECK(o.root < o.ranks, "--root", o.root, "must be < --ranks (" + std::to_string(o.ranks) + ")");
    return run_threads(o);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
