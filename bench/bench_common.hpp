#pragma once
// What every loom benchmark reports besides its own numbers: summary statistics of repeated
// timings, the date, and the machine and build that produced them (so a JSON file can be read
// without the command line that made it).

#include <Eigen/Core>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/rng.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace loom::bench {

//! Mean, sample standard deviation, median and minimum of repeated timings (any unit).
struct Stats {
  double mean = 0, stddev = 0, median = 0, min = 0;
};

//! `n` values uniform in [lo, hi), keyed by `seed` and `name` (loom's counter-based generator, so
//! a benchmark's inputs are the same on every machine).
inline std::vector<float> uniform_values(std::int64_t n, std::uint64_t seed, const char* name, float lo = -1.0f,
                                         float hi = 1.0f) {
  const loom::CounterRng rng(seed, name);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[static_cast<std::size_t>(i)] = lo + (hi - lo) * static_cast<float>(rng.uniform(i));
  return v;
}

inline Stats summarize(std::vector<double> samples) {
  Stats s;
  if (samples.empty()) return s;
  const double n = static_cast<double>(samples.size());
  s.mean = std::accumulate(samples.begin(), samples.end(), 0.0) / n;
  double squares = 0;
  for (double x : samples) squares += (x - s.mean) * (x - s.mean);
  s.stddev = samples.size() > 1 ? std::sqrt(squares / (n - 1)) : 0.0;
  std::sort(samples.begin(), samples.end());
  const std::size_t mid = samples.size() / 2;
  s.median = samples.size() % 2 ? samples[mid] : 0.5 * (samples[mid - 1] + samples[mid]);
  s.min = samples.front();
  return s;
}

//! Seconds `work()` takes, by the steady clock.
template <class Work>
double time_seconds(Work&& work) {
  const auto start = std::chrono::steady_clock::now();
  work();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

//! Now in UTC, ISO 8601 ("2025-01-31T12:00:00Z").
inline std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return text;
}

//! The CPU's model name from /proc/cpuinfo ("unknown" elsewhere).
inline std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  for (std::string line; std::getline(in, line);)
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(line.find_first_not_of(" \t", colon + 1));
    }
  return "unknown";
}

//! The 1-minute load average (-1 where /proc/loadavg is missing). Read before a benchmark
//! starts, it counts the other processes that will share the cores with it.
inline double load_average() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return in ? load : -1.0;
}

//! A warning when other work is using the cores (load above a quarter of them), else "".
inline std::string load_warning(double load) {
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  if (load < 0.25 * cores) return "";
  char text[200];
  std::snprintf(text, sizeof text,
                "warning: load average %.2f on %.0f hardware threads before the run: other processes "
                "share the cores, so these timings understate the machine",
                load, cores);
  return text;
}

//! The widest vector extension this binary was compiled for (what Eigen's kernels use).
constexpr const char* compiled_isa() {
#if defined(__AVX512F__)
  return "avx512f";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2+fma";
#elif defined(__AVX__)
  return "avx";
#else
  return "sse2";
#endif
}

//! The machine and the build, for the JSON reports.
inline nlohmann::json machine_json(int threads, double load) {
  return {{"cpu", cpu_model()},
          {"load_average_at_start", load},
          {"hardware_threads", std::thread::hardware_concurrency()},
          {"threads_used", threads},
          {"compiled_isa", compiled_isa()},
          {"compiler", __VERSION__},
          {"eigen", std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) +
                        "." + std::to_string(EIGEN_MINOR_VERSION)},
#if defined(_OPENMP)
          {"openmp", true}
#else
          {"openmp", false}
#endif
  };
}

//! One line saying what the numbers below were measured on.
inline std::string machine_line(int threads) {
  return cpu_model() + ", " + std::to_string(std::thread::hardware_concurrency()) +
         " hardware threads, " + std::to_string(threads) + " used, compiled for " +
         compiled_isa() + ", Eigen " + std::to_string(EIGEN_WORLD_VERSION) + "." +
         std::to_string(EIGEN_MAJOR_VERSION) + "." + std::to_string(EIGEN_MINOR_VERSION);
}

//! Writes `report` to `path` (if not empty), pretty-printed, and says so.
inline void write_json(const std::string& path, const nlohmann::json& report) {
  if (path.empty()) return;
  std::ofstream out(path);
  LOOM_CHECK(out.good(), "--json", path, "the file must be writable");
  out << report.dump(2) << '\n';
  std::printf("wrote %s\n", path.c_str());
}

}  // namespace loom::bench
