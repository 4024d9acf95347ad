// loom_collectives_bench: loom's collectives in the style of nccl-tests, against a memcpy of the
// same bytes and, under MPI, against the raw MPI calls, in the same run.
//
//   loom_collectives_bench                                    # threads, 2 ranks, 1 KiB .. 256 MiB
//   loom_collectives_bench --ranks 4 --ops all_reduce --json threads.json
//   mpiexec -n 2 loom_collectives_bench --comm mpi            # loom's MPI communicator vs raw MPI
//
// For each operation and message size (doubling from --min-bytes to --max-bytes) it prints the
// median time of --iters timed calls after --warmup untimed ones (fewer for large messages, so
// that the default run takes about a minute), the algorithm bandwidth (bytes / time) and the bus
// bandwidth (algbw × 2(n−1)/n for all_reduce, (n−1)/n for reduce_scatter and all_gather, 1 for
// broadcast; "bytes" is the whole buffer: the input of reduce_scatter, the output of
// all_gather). Beside loom it times, in rounds that give each variant an untimed call and then
// --block timed ones in a row: a single-thread memcpy of the same bytes on rank 0 (its bandwidth
// is bytes / time) and, with --comm mpi, MPI_Allreduce, MPI_Reduce_scatter_block, MPI_Allgather and
// MPI_Bcast on a duplicate of MPI_COMM_WORLD, their nonblocking forms followed by MPI_Wait (what
// loom's MPI communicator posts), and loom's MPI communicator with agreement checking on and off.
// Every variant's result is checked once per size before it is timed. It ends with the two targets:
//   threads all_reduce 64 MiB busbw X GB/s = Y% of memcpy (target >= 70%)
//   mpi all_reduce 64 MiB: loom X µs vs raw MPI Y µs = Z% slower (target <= 5%)

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "comm_bench_common.hpp"
#include "loom/comm/threads.hpp"
#include "loom/core/error.hpp"
#if LOOM_BENCH_WITH_MPI
#include <mpi.h>

#include "loom/comm/mpi.hpp"
#endif

namespace {

using loom::bench::bytes_text;

struct Options {
  int ranks = 2;
  std::size_t min_bytes = std::size_t{1} << 10;
  std::size_t max_bytes = std::size_t{256} << 20;
  int iters = 50;
  int warmup = 5;
  //! Timed calls of one variant in a row, per round (run_all).
  int block = 10;
  //! Above this many bytes moved per size, large messages get fewer iterations (at least 5).
  std::size_t budget_bytes = std::size_t{2} << 30;
  std::vector<std::string> ops = {"all_reduce", "reduce_scatter", "all_gather", "broadcast"};
  std::string comm = "threads";
  bool no_check_agreement = false;
  std::string json;
};

enum class Op { all_reduce, reduce_scatter, all_gather, broadcast };

Op op_by_name(const std::string& name) {
  if (name == "all_reduce") return Op::all_reduce;
  if (name == "reduce_scatter") return Op::reduce_scatter;
  if (name == "all_gather") return Op::all_gather;
  if (name == "broadcast") return Op::broadcast;
  throw loom::Error("--ops", name, "must be all_reduce, reduce_scatter, all_gather or broadcast");
}
const char* op_name(Op op) {
  switch (op) {
    case Op::all_reduce: return "all_reduce";
    case Op::reduce_scatter: return "reduce_scatter";
    case Op::all_gather: return "all_gather";
    case Op::broadcast: return "broadcast";
  }
  return "?";
}

//! nccl-tests' bus bandwidth factor: what turns algbw into the bandwidth each link carries.
double bus_factor(Op op, int n) {
  switch (op) {
    case Op::all_reduce: return 2.0 * (n - 1) / n;
    case Op::reduce_scatter:
    case Op::all_gather: return static_cast<double>(n - 1) / n;
    case Op::broadcast: return 1.0;
  }
  return 1.0;
}
const char* bus_formula(Op op) {
  return op == Op::all_reduce ? "2(n-1)/n" : op == Op::broadcast ? "1" : "(n-1)/n";
}

//! Elements of one size: `total` in the whole buffer, `per_rank` of it each rank owns.
struct Shape {
  std::size_t total = 0, per_rank = 0;
  std::size_t bytes() const { return total * sizeof(float); }
};
Shape shape_of(Op op, std::size_t bytes, int n) {
  std::size_t total = std::max<std::size_t>(1, bytes / sizeof(float));
  if (op == Op::reduce_scatter || op == Op::all_gather) {
    total = std::max<std::size_t>(total / n, 1) * n;
    return {total, total / n};
  }
  return {total, total};
}

//! The two buffers every rank holds for the whole run (sizes are prefixes of them).
struct Buffers {
  std::vector<float> a, b;
};

//! One way of doing an operation on this rank's buffers, e.g. loom's threads communicator, raw
//! MPI, or the memcpy reference (`copy`: rank 0 copies, the others do nothing).
struct Variant {
  std::string name;
  bool copy = false;
  std::function<void(Op, Shape, Buffers&)> run;
};

// Values whose sums are exact in float, so results are checked for equality.
float reduce_input(int rank, std::size_t i) { return static_cast<float>(rank + 1 + static_cast<int>(i % 7)); }
float reduce_result(int n, std::size_t i) { return static_cast<float>(n * (n + 1) / 2 + n * static_cast<int>(i % 7)); }
float gather_input(int rank, std::size_t j) { return static_cast<float>(8 * rank + static_cast<int>(j % 7)); }
float broadcast_value(std::size_t i) { return static_cast<float>(i % 251); }

//! Fills this rank's inputs for `op`.
void fill_inputs(Op op, Shape s, int rank, Buffers& buf) {
  switch (op) {
    case Op::all_reduce:
    case Op::reduce_scatter:
      for (std::size_t i = 0; i < s.total; ++i) buf.a[i] = reduce_input(rank, i);
      if (op == Op::reduce_scatter) std::fill_n(buf.b.begin(), s.per_rank, -1.0f);
      return;
    case Op::all_gather:
      for (std::size_t j = 0; j < s.per_rank; ++j) buf.a[j] = gather_input(rank, j);
      std::fill_n(buf.b.begin(), s.total, -1.0f);
      return;
    case Op::broadcast:
      for (std::size_t i = 0; i < s.total; ++i) buf.a[i] = rank == 0 ? broadcast_value(i) : -1.0f;
      return;
  }
}

//! The first wrong element of this rank's result, as text; empty when all are right.
std::string check_result(Op op, Shape s, int rank, int n, const Buffers& buf) {
  auto wrong = [&](const char* where, std::size_t i, float got, float want) {
    char text[200];
    std::snprintf(text, sizeof text, "rank %d: %s[%zu] is %g, expected %g", rank, where, i,
                  static_cast<double>(got), static_cast<double>(want));
    return std::string(text);
  };
  switch (op) {
    case Op::all_reduce:
      for (std::size_t i = 0; i < s.total; ++i)
        if (buf.a[i] != reduce_result(n, i)) return wrong("data", i, buf.a[i], reduce_result(n, i));
      return "";
    case Op::reduce_scatter:
      for (std::size_t j = 0; j < s.per_rank; ++j) {
        const float want = reduce_result(n, static_cast<std::size_t>(rank) * s.per_rank + j);
        if (buf.b[j] != want) return wrong("output", j, buf.b[j], want);
      }
      return "";
    case Op::all_gather:
      for (std::size_t k = 0; k < s.total; ++k) {
        const float want = gather_input(static_cast<int>(k / s.per_rank), k % s.per_rank);
        if (buf.b[k] != want) return wrong("output", k, buf.b[k], want);
      }
      return "";
    case Op::broadcast:
      for (std::size_t i = 0; i < s.total; ++i)
        if (buf.a[i] != broadcast_value(i)) return wrong("data", i, buf.a[i], broadcast_value(i));
      return "";
  }
  return "";
}

//! The memcpy reference: rank 0 copies the bytes one op moves per rank (the whole buffer).
void memcpy_reference(int rank, Shape s, Buffers& buf) {
  if (rank == 0) std::memcpy(buf.b.data(), buf.a.data(), s.bytes());
}

//! loom's collective `op` on communicator `comm`, on this rank's buffers.
template <class Comm>
void run_loom(Comm& comm, Op op, Shape s, Buffers& buf) {
  switch (op) {
    case Op::all_reduce: comm.all_reduce(std::span<float>(buf.a.data(), s.total), loom::ReduceOp::sum); return;
    case Op::reduce_scatter:
      comm.reduce_scatter(std::span<const float>(buf.a.data(), s.total), std::span<float>(buf.b.data(), s.per_rank),
                          loom::ReduceOp::sum);
      return;
    case Op::all_gather:
      comm.all_gather(std::span<const float>(buf.a.data(), s.per_rank), std::span<float>(buf.b.data(), s.total));
      return;
    case Op::broadcast: comm.broadcast(std::span<float>(buf.a.data(), s.total), 0); return;
  }
}

#if LOOM_BENCH_WITH_MPI
//! The same operation through the MPI call it corresponds to.
void run_raw_mpi(MPI_Comm comm, Op op, Shape s, Buffers& buf) {
  const int count = static_cast<int>(s.per_rank);
  switch (op) {
    case Op::all_reduce:
      MPI_Allreduce(MPI_IN_PLACE, buf.a.data(), static_cast<int>(s.total), MPI_FLOAT, MPI_SUM, comm);
      return;
    case Op::reduce_scatter:
      MPI_Reduce_scatter_block(buf.a.data(), buf.b.data(), count, MPI_FLOAT, MPI_SUM, comm);
      return;
    case Op::all_gather:
      MPI_Allgather(buf.a.data(), count, MPI_FLOAT, buf.b.data(), count, MPI_FLOAT, comm);
      return;
    case Op::broadcast: MPI_Bcast(buf.a.data(), static_cast<int>(s.total), MPI_FLOAT, 0, comm); return;
  }
}

//! The nonblocking MPI call and MPI_Wait: what loom's MPI communicator posts (it then polls
//! MPI_Test), so this column tells MPI's nonblocking algorithms apart from loom's own overhead.
void run_raw_mpi_nonblocking(MPI_Comm comm, Op op, Shape s, Buffers& buf) {
  const int count = static_cast<int>(s.per_rank);
  MPI_Request request = MPI_REQUEST_NULL;
  switch (op) {
    case Op::all_reduce:
      MPI_Iallreduce(MPI_IN_PLACE, buf.a.data(), static_cast<int>(s.total), MPI_FLOAT, MPI_SUM, comm, &request);
      break;
    case Op::reduce_scatter:
      MPI_Ireduce_scatter_block(buf.a.data(), buf.b.data(), count, MPI_FLOAT, MPI_SUM, comm, &request);
      break;
    case Op::all_gather:
      MPI_Iallgather(buf.a.data(), count, MPI_FLOAT, buf.b.data(), count, MPI_FLOAT, comm, &request);
      break;
    case Op::broadcast: MPI_Ibcast(buf.a.data(), static_cast<int>(s.total), MPI_FLOAT, 0, comm, &request); break;
  }
  MPI_Wait(&request, MPI_STATUS_IGNORE);
}
#endif

//! One variant's timing of one op and size.
struct Row {
  std::string op, variant;
  bool copy = false;
  std::size_t bytes = 0, count = 0;
  int iterations = 0;
  std::vector<double> seconds;  //!< slowest rank's time per call
  loom::bench::Stats stats;
  double algbw = 0, busbw = 0;  //!< GB/s (1e9 bytes)
};

//! How a variant's figures are compared with another's, in the table's last columns.
struct Comparison {
  std::string label;
  std::size_t variant, reference;
  bool bus_vs_copy;  //!< busbw / the reference's bandwidth; otherwise time over the reference's − 1
};

//! The sizes to run: --min-bytes doubling to --max-bytes.
std::vector<std::size_t> sizes_of(const Options& o) {
  std::vector<std::size_t> sizes;
  for (std::size_t b = o.min_bytes; b <= o.max_bytes; b *= 2) sizes.push_back(b);
  return sizes;
}

//! Timed calls for a size: --iters, fewer when that would move more than the budget (>= 5).
int iterations_for(const Options& o, std::size_t bytes) {
  const auto fit = static_cast<long long>(o.budget_bytes / std::max<std::size_t>(bytes, 1));
  return static_cast<int>(std::clamp<long long>(fit, std::min(5, o.iters), o.iters));
}
int warmup_for(const Options& o, std::size_t bytes) {
  return std::min(o.warmup, std::max(1, iterations_for(o, bytes) / 4));
}

/// Runs every op and size on `group` (whose collectives also gather the timings) with the given
/// variants; `sync` is the barrier before each timed call. Rank 0 prints and returns the rows.
template <class Group, class Sync>
std::vector<Row> run_all(const Options& o, Group& group, Sync&& sync, std::vector<Variant>& variants,
                         const std::vector<Comparison>& comparisons, const std::string& ranks_text) {
  const int rank = group.rank(), n = group.size();
  const bool lead = rank == 0;
  const std::vector<std::size_t> sizes = sizes_of(o);
  Buffers buf;
  buf.a.assign(o.max_bytes / sizeof(float) + n, 0.0f);
  buf.b.assign(o.max_bytes / sizeof(float) + n, 0.0f);

  std::vector<Row> rows;
  for (const std::string& op_text : o.ops) {
    const Op op = op_by_name(op_text);
    if (lead) {
      std::printf("\n%s: %s, float32%s, busbw = algbw x %s = %.2f; times are medians in us, GB/s = 1e9 B/s\n",
                  op_name(op), ranks_text.c_str(), op == Op::broadcast ? ", root 0" : op == Op::all_gather ? "" : " sum", bus_formula(op),
                  bus_factor(op, n));
      std::printf("%10s %10s %5s", "size", "count", "iters");
      for (const Variant& v : variants)
        std::printf(v.copy ? " | %-16s" : " | %-24s", v.name.c_str());
      for (const Comparison& c : comparisons) std::printf(" | %s", c.label.c_str());
      std::printf("\n%10s %10s %5s", "", "", "");
      for (const Variant& v : variants)
        if (v.copy) std::printf(" | %8s %7s", "time", "GB/s");
        else std::printf(" | %8s %7s %7s", "time", "algbw", "busbw");
      std::printf("\n");
      std::fflush(stdout);
    }
    for (std::size_t bytes : sizes) {
      const Shape s = shape_of(op, bytes, n);
      // Check each variant's result once, with every rank agreeing on the verdict (a rank that
      // threw alone would leave the others waiting in the next collective).
      for (Variant& v : variants) {
        fill_inputs(op, s, rank, buf);
        sync();
        v.run(op, s, buf);
        std::string error = v.copy ? (lead && std::memcmp(buf.a.data(), buf.b.data(), s.bytes()) != 0
                                          ? "rank 0: memcpy copied wrong bytes"
                                          : "")
                                   : check_result(op, s, rank, n, buf);
        std::vector<double> bad{error.empty() ? 0.0 : 1.0};
        bad = loom::bench::max_over_ranks(group, bad);
        if (!error.empty()) std::fprintf(stderr, "%s %s %s: %s\n", op_name(op), bytes_text(s.bytes()).c_str(),
                                         v.name.c_str(), error.c_str());
        LOOM_CHECK(bad[0] == 0.0, std::string(op_name(op)) + " of " + bytes_text(s.bytes()) + " by " + v.name,
                   "a wrong result", "every rank must receive the expected values (see stderr)");
      }
      // Repeated sums would grow without bound; zeros cost the same to add.
      if (op == Op::all_reduce) std::fill_n(buf.a.begin(), s.total, 0.0f);

      const int iterations = iterations_for(o, s.bytes()), warmup = warmup_for(o, s.bytes());
      const auto untimed = [&](Variant& v) {
        sync();
        v.run(op, s, buf);
      };
      for (int w = 0; w < warmup; ++w)
        for (Variant& v : variants) untimed(v);
      // Rounds of blocks: in each round every variant makes an untimed call, then --block timed
      // ones in a row. Each timed call finds the state the variant's own calls leave, as OSU's and
      // nccl-tests' loops time one call repeated, and the rounds spread other processes' bursts
      // over all the variants. Call by call in turn (--block 1), what one variant left behind
      // changed the next one's time: on 2 MPI processes MPI_Allreduce ran up to 30% faster in
      // turn with the others at 256 KiB-1 MiB than in a row of its own (docs/benchmarks.md).
      std::vector<double> samples(variants.size() * static_cast<std::size_t>(iterations));
      const int block = std::min(o.block, iterations);
      for (int first = 0; first < iterations; first += block)
        for (std::size_t v = 0; v < variants.size(); ++v) {
          if (block > 1) untimed(variants[v]);
          for (int it = first; it < std::min(first + block, iterations); ++it)
            samples[v * iterations + it] = loom::bench::time_on_rank(sync, [&] { variants[v].run(op, s, buf); });
        }
      samples = loom::bench::max_over_ranks(group, std::move(samples));

      std::vector<Row> size_rows;
      for (std::size_t v = 0; v < variants.size(); ++v) {
        Row r;
        r.op = op_name(op);
        r.variant = variants[v].name;
        r.copy = variants[v].copy;
        r.bytes = s.bytes();
        r.count = s.total;
        r.iterations = iterations;
        r.seconds.assign(samples.begin() + v * iterations, samples.begin() + (v + 1) * iterations);
        r.stats = loom::bench::summarize(r.seconds);
        r.algbw = static_cast<double>(r.bytes) / r.stats.median / 1e9;
        r.busbw = r.copy ? r.algbw : r.algbw * bus_factor(op, n);
        size_rows.push_back(std::move(r));
      }
      if (lead) {
        std::printf("%10s %10zu %5d", bytes_text(s.bytes()).c_str(), s.total, iterations);
        for (const Row& r : size_rows)
          if (r.copy) std::printf(" | %8.2f %7.2f", 1e6 * r.stats.median, r.algbw);
          else std::printf(" | %8.2f %7.2f %7.2f", 1e6 * r.stats.median, r.algbw, r.busbw);
        for (const Comparison& c : comparisons) {
          const Row &a = size_rows[c.variant], &ref = size_rows[c.reference];
          const double value = c.bus_vs_copy ? 100.0 * a.busbw / ref.busbw
                                             : 100.0 * (a.stats.median / ref.stats.median - 1.0);
          std::printf(c.bus_vs_copy ? " | %*.0f%%" : " | %+*.1f%%", static_cast<int>(c.label.size()) - 1, value);
        }
        std::printf("\n");
        std::fflush(stdout);
      }
      for (Row& r : size_rows) rows.push_back(std::move(r));
    }
  }
  return rows;
}

nlohmann::json row_json(const Row& r) {
  return {{"op", r.op},
          {"variant", r.variant},
          {"bytes", r.bytes},
          {"count", r.count},
          {"iterations", r.iterations},
          {"seconds", r.seconds},
          {"median_us", 1e6 * r.stats.median},
          {"mean_us", 1e6 * r.stats.mean},
          {"min_us", 1e6 * r.stats.min},
          {"std_us", 1e6 * r.stats.stddev},
          {"algbw_gbps", r.algbw},
          {"busbw_gbps", r.busbw}};
}

const Row* find_row(const std::vector<Row>& rows, const std::string& op, const std::string& variant,
                    std::size_t bytes) {
  for (const Row& r : rows)
    if (r.op == op && r.variant == variant && r.bytes == bytes) return &r;
  return nullptr;
}

constexpr std::size_t target_bytes = std::size_t{64} << 20;

//! "threads all_reduce 64 MiB busbw X GB/s = Y% of memcpy (target >= 70%)", and its JSON.
//! With `target` false the line is for reference only (the 70% target is the threads communicator's).
nlohmann::json busbw_target(const std::vector<Row>& rows, const std::string& variant, bool target = true) {
  const Row* loom_row = find_row(rows, "all_reduce", variant, target_bytes);
  const Row* copy_row = find_row(rows, "all_reduce", "memcpy", target_bytes);
  if (!loom_row || !copy_row) {
    std::printf("%s all_reduce 64 MiB: not measured (needs all_reduce and --max-bytes >= 64M)\n", variant.c_str());
    return nullptr;
  }
  const double share = loom_row->busbw / copy_row->busbw;
  if (target)
    std::printf("%s all_reduce 64 MiB busbw %.2f GB/s = %.0f%% of memcpy (target >= 70%%): %s\n", variant.c_str(),
                loom_row->busbw, 100.0 * share, share >= 0.7 ? "met" : "NOT met");
  else
    std::printf("(for reference) %s all_reduce 64 MiB busbw %.2f GB/s = %.0f%% of memcpy\n", variant.c_str(),
                loom_row->busbw, 100.0 * share);
  nlohmann::json j = {{"variant", variant}, {"busbw_gbps", loom_row->busbw}, {"memcpy_gbps", copy_row->busbw},
                      {"share_of_memcpy", share}};
  if (target) j.update({{"target", 0.7}, {"met", share >= 0.7}});
  return j;
}

int run_threads(const Options& o) {
  const loom::CommOptions comm_options{.check_agreement = !o.no_check_agreement};
  const double load = loom::bench::print_header(
      true, "loom_collectives_bench: threads communicator, " + std::to_string(o.ranks) + " ranks, " +
                bytes_text(o.min_bytes) + " .. " + bytes_text(o.max_bytes) + ", check_agreement " +
                (comm_options.check_agreement ? "on" : "off"),
      o.ranks);
  std::vector<Row> rows;
  loom::threads::run(
      o.ranks,
      [&](loom::threads::Communicator& comm) {
        const int rank = comm.rank();
        std::vector<Variant> variants = {
            {"memcpy", true, [&](Op, Shape s, Buffers& b) { memcpy_reference(rank, s, b); }},
            {"threads", false, [&](Op op, Shape s, Buffers& b) { run_loom(comm, op, s, b); }}};
        std::vector<Row> mine = run_all(o, comm, [&] { comm.barrier(); }, variants,
                                        {{"busbw/memcpy", 1, 0, true}},
                                        std::to_string(comm.size()) + " thread ranks");
        if (rank == 0) rows = std::move(mine);
      },
      comm_options);
  std::printf("\n");
  nlohmann::json targets = {{"threads_all_reduce_64MiB", busbw_target(rows, "threads")}};
  const std::string warning = loom::bench::load_warning(load);
  if (!warning.empty()) std::printf("%s\n", warning.c_str());
  nlohmann::json report = {{"benchmark", "loom_collectives_bench"},
                           {"date", loom::bench::utc_now()},
                           {"machine", loom::bench::machine_json(o.ranks, load)},
                           {"settings",
                            {{"comm", "threads"}, {"ranks", o.ranks}, {"min_bytes", o.min_bytes},
                             {"max_bytes", o.max_bytes}, {"iters", o.iters}, {"warmup", o.warmup},
                             {"block", o.block}, {"budget_bytes", o.budget_bytes}, {"ops", o.ops},
                             {"check_agreement", comm_options.check_agreement}, {"dtype", "float32"}}},
                           {"targets", targets},
                           {"results", nlohmann::json::array()}};
  for (const Row& r : rows) report["results"].push_back(row_json(r));
  loom::bench::write_json(o.json, report);
  return 0;
}

#if LOOM_BENCH_WITH_MPI
//! "mpi all_reduce 64 MiB: loom X µs vs raw MPI Y µs = Z% slower (target <= 5%)", and its JSON.
nlohmann::json raw_mpi_target(const std::vector<Row>& rows, const std::string& variant, const char* check) {
  const Row* loom_row = find_row(rows, "all_reduce", variant, target_bytes);
  const Row* raw_row = find_row(rows, "all_reduce", "raw MPI", target_bytes);
  if (!loom_row || !raw_row) {
    std::printf("mpi all_reduce 64 MiB: not measured (needs all_reduce and --max-bytes >= 64M)\n");
    return nullptr;
  }
  const double slower = loom_row->stats.median / raw_row->stats.median - 1.0;
  std::printf("mpi all_reduce 64 MiB: loom %.0f µs vs raw MPI %.0f µs = %.1f%% %s (target <= 5%%), "
              "check_agreement %s: %s\n",
              1e6 * loom_row->stats.median, 1e6 * raw_row->stats.median, 100.0 * std::abs(slower),
              slower >= 0 ? "slower" : "faster", check, slower <= 0.05 ? "met" : "NOT met");
  return {{"variant", variant}, {"check_agreement", std::string(check) == "on"},
          {"loom_median_us", 1e6 * loom_row->stats.median}, {"raw_mpi_median_us", 1e6 * raw_row->stats.median},
          {"slower", slower}, {"target", 0.05}, {"met", slower <= 0.05}};
}

//! Under mpiexec: loom's MPI communicator with agreement checking on and off, raw MPI on a
//! duplicate of MPI_COMM_WORLD, and the memcpy reference, in rounds of blocks (run_all).
int run_mpi(const Options& o, int& argc, char**& argv) {
  return loom::mpi::run(
      argc, argv,
      [&](loom::mpi::Communicator& checked) {
        const int rank = checked.rank(), n = checked.size();
        const bool lead = rank == 0;
        LOOM_CHECK(n >= 2, "--comm mpi: ranks", n, "must be >= 2 (run under mpiexec -n 2 or more)");
        loom::mpi::Communicator unchecked = loom::mpi::Communicator::world({.check_agreement = false});
        MPI_Comm raw = MPI_COMM_NULL;
        MPI_Comm_dup(MPI_COMM_WORLD, &raw);
        const double load = loom::bench::print_header(
            lead, "loom_collectives_bench: MPI communicator, " + std::to_string(n) + " processes, " +
                      bytes_text(o.min_bytes) + " .. " + bytes_text(o.max_bytes),
            n);
        std::vector<Variant> variants = {
            {"memcpy", true, [&](Op, Shape s, Buffers& b) { memcpy_reference(rank, s, b); }},
            {"loom mpi", false, [&](Op op, Shape s, Buffers& b) { run_loom(checked, op, s, b); }},
            {"loom mpi nocheck", false, [&](Op op, Shape s, Buffers& b) { run_loom(unchecked, op, s, b); }},
            {"raw MPI", false, [&](Op op, Shape s, Buffers& b) { run_raw_mpi(raw, op, s, b); }},
            {"raw MPI_I* + Wait", false, [&](Op op, Shape s, Buffers& b) { run_raw_mpi_nonblocking(raw, op, s, b); }}};
        const std::vector<Comparison> comparisons = {{"loom vs raw", 1, 3, false},
                                                     {"nocheck vs raw", 2, 3, false},
                                                     {"nocheck vs raw_I", 2, 4, false},
                                                     {"raw/memcpy", 3, 0, true}};
        const std::vector<Row> rows = run_all(o, checked, [&] { MPI_Barrier(raw); }, variants, comparisons,
                                              std::to_string(n) + " MPI processes");
        MPI_Comm_free(&raw);
        if (!lead) return 0;
        std::printf("\n");
        nlohmann::json targets = {{"mpi_all_reduce_64MiB_check_on", raw_mpi_target(rows, "loom mpi", "on")},
                                  {"mpi_all_reduce_64MiB_check_off", raw_mpi_target(rows, "loom mpi nocheck", "off")},
                                  {"raw_mpi_all_reduce_64MiB_vs_memcpy", busbw_target(rows, "raw MPI", false)}};
        if (const Row *nb = find_row(rows, "all_reduce", "raw MPI_I* + Wait", target_bytes),
            *raw_row = find_row(rows, "all_reduce", "raw MPI", target_bytes);
            nb && raw_row) {
          std::printf("(for reference) raw MPI_Iallreduce + MPI_Wait 64 MiB: %.0f µs = %.1f%% %s than MPI_Allreduce\n",
                      1e6 * nb->stats.median, 100.0 * std::abs(nb->stats.median / raw_row->stats.median - 1.0),
                      nb->stats.median >= raw_row->stats.median ? "slower" : "faster");
          targets["raw_mpi_nonblocking_all_reduce_64MiB_us"] = 1e6 * nb->stats.median;
        }
        const std::string warning = loom::bench::load_warning(load);
        if (!warning.empty()) std::printf("%s\n", warning.c_str());
        int version = 0, subversion = 0;
        MPI_Get_version(&version, &subversion);
        char library[MPI_MAX_LIBRARY_VERSION_STRING];
        int length = 0;
        MPI_Get_library_version(library, &length);
        nlohmann::json report = {
            {"benchmark", "loom_collectives_bench"},
            {"date", loom::bench::utc_now()},
            {"machine", loom::bench::machine_json(n, load)},
            {"mpi", {{"standard", std::to_string(version) + "." + std::to_string(subversion)},
                     {"library", std::string(library, static_cast<std::size_t>(length))}}},
            {"settings",
             {{"comm", "mpi"}, {"ranks", n}, {"min_bytes", o.min_bytes}, {"max_bytes", o.max_bytes},
              {"iters", o.iters}, {"warmup", o.warmup}, {"block", o.block}, {"budget_bytes", o.budget_bytes},
              {"ops", o.ops}, {"dtype", "float32"}}},
            {"targets", targets},
            {"results", nlohmann::json::array()}};
        for (const Row& r : rows) report["results"].push_back(row_json(r));
        loom::bench::write_json(o.json, report);
        return 0;
      },
      {.check_agreement = true});
}
#endif

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"loom's collectives against memcpy and raw MPI, in the style of nccl-tests."};
  app.add_option("--ranks", o.ranks, "Thread ranks (--comm threads)")->capture_default_str()->check(CLI::Range(2, 256));
  app.add_option("--min-bytes", o.min_bytes, "Smallest message (1K, 64M, ...)")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--max-bytes", o.max_bytes, "Largest message; sizes double from --min-bytes")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--iters", o.iters, "Timed calls per size (fewer for large messages)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", o.warmup, "Untimed calls per size before the timed ones")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--block", o.block,
                 "Timed calls of one variant in a row: in each round every variant makes this many calls, "
                 "after an untimed one; 1 = the variants take turns call by call")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--budget-bytes", o.budget_bytes,
                 "Sizes whose --iters calls would move more than this get fewer calls (at least 5)")
      ->capture_default_str()
      ->transform(CLI::AsSizeValue(false));
  app.add_option("--ops", o.ops, "Operations: all_reduce, reduce_scatter, all_gather, broadcast")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--comm", o.comm, "threads, or mpi (under mpiexec)")
      ->capture_default_str()
      ->check(CLI::IsMember({"threads", "mpi"}));
  app.add_flag("--no-check-agreement", o.no_check_agreement,
               "Threads: turn the communicator's agreement check off (MPI always shows both)");
  app.add_option("--json", o.json, "Also write the results to this JSON file");
  CLI11_PARSE(app, argc, argv);
  try {
    LOOM_CHECK(o.min_bytes >= 4 && o.min_bytes <= o.max_bytes, "--min-bytes", o.min_bytes,
               "must be >= 4 and <= --max-bytes (" + std::to_string(o.max_bytes) + ")");
    for (const std::string& op : o.ops) op_by_name(op);
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
