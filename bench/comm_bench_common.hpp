#pragma once
// What the communication benchmarks (collectives, broadcast strategies, DDP overlap) share:
// timing one piece of work on every rank of a group, sizes in bytes as people write them, and
// the run header (machine line, load warning) printed by rank 0 only.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "loom/comm/concepts.hpp"

namespace loom::bench {

//! "1 KiB", "64 MiB", "1.5 GiB", "100 B".
inline std::string bytes_text(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[32];
  if (value == static_cast<double>(static_cast<std::uint64_t>(value)))
    std::snprintf(text, sizeof text, "%.0f %s", value, units[unit]);
  else
    std::snprintf(text, sizeof text, "%.3g %s", value, units[unit]);
  return text;
}

//! Seconds since an arbitrary epoch, from the steady clock.
inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

//! Times one piece of work the way collective benchmarks usually do (OSU, nccl-tests' per-rank
//! view): every rank synchronizes, times its own part, and an iteration's time is the slowest
//! rank's. `sync` is a barrier of the group (the communicator's, or MPI_Barrier for raw MPI).
//! Returns this rank's seconds; take the maximum over ranks with max_over_ranks afterwards (one
//! collective for all samples, outside the timed region).
template <class Sync, class Work>
double time_on_rank(Sync&& sync, Work&& work) {
  sync();
  const double start = now_seconds();
  work();
  return now_seconds() - start;
}

//! Element-wise maximum of `samples` over the ranks of `group` (every rank gets it).
template <class Group>
std::vector<double> max_over_ranks(Group& group, std::vector<double> samples) {
  if (group.size() > 1 && !samples.empty()) group.all_reduce(std::span<double>(samples), ReduceOp::max);
  return samples;
}

//! Prints what every benchmark prints before its numbers (rank 0 only): its title, the machine
//! and, when other processes use the cores, the load warning. Returns the load average.
inline double print_header(bool lead, const std::string& title, int threads_used) {
  const double load = load_average();
  if (!lead) return load;
  std::printf("%s\n", title.c_str());
  std::printf("machine: %s\n", machine_line(threads_used).c_str());
  const std::string warning = load_warning(load);
  if (!warning.empty()) std::printf("%s\n", warning.c_str());
  std::printf("load average before the run: %.2f\n", load);
  std::fflush(stdout);
  return load;
}

}  // namespace loom::bench
