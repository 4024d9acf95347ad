// loom_gemm_bench: the machine's measured single-precision GEMM rate, and loom's matmul kernels
// against it on the GEMMs of a GPT-2 small training step.
//
//   loom_gemm_bench                          # 2 threads
//   loom_gemm_bench --threads 1 --json gemm.json
//
// Reference: Eigen's GEMM (C = A·B, column-major, the library loom's CPU backend is built on)
// on square 1024³ and 2048³ and on the four GPT-2 small shapes at B·T = 256 tokens:
// [256,768]x[768,2304] (qkv), [256,768]x[768,3072] (fc), [256,3072]x[3072,768] (mlp proj),
// [256,768]x[768,50304] (logits through the padded wte). Then loom::kernels::matmul_forward
// (out = in·Wᵀ + b, with bias except for the logits, as the model calls it) and matmul_backward
// (din += dout·W, dW += doutᵀ·in, db += Σ dout) on the same shapes. A GEMM of M×K by K×N counts
// 2·M·K·N FLOPs; matmul_backward counts two of them (4·M·K·N), biases are not counted.
// "vs Eigen" is loom's rate over Eigen's on the same shape (target: >= 70%); "vs best" is
// loom's rate over the machine's measured rate (the best Eigen rate above). Each entry is the
// fastest of many calls, the kernels of a shape taking turns (see measure).

#include <CLI/CLI.hpp>
#include <Eigen/Core>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.hpp"
#include "loom/loom.hpp"

namespace {

struct Options {
  int threads = 2;
  double seconds = 2.0;        // per shape, all its kernels together, after one untimed call each
  std::int64_t min_calls = 5;  // per kernel
  std::string json;
};

//! out[M,N] = in[M,K] · W[N,K]ᵀ: M rows (tokens), K inputs, N outputs.
struct GemmShape {
  std::string name;
  std::int64_t m, k, n;
  bool bias;  //!< loom's kernels run with a bias (all GPT-2 linears but the logits)
  double flops() const {
    return 2.0 * static_cast<double>(m) * static_cast<double>(k) * static_cast<double>(n);
  }
};

std::string shape_text(const GemmShape& s) {
  return "[" + std::to_string(s.m) + "," + std::to_string(s.k) + "]x[" + std::to_string(s.k) + "," +
         std::to_string(s.n) + "]";
}

//! A matrix of uniform values in [-1, 1), the same for every run.
Eigen::MatrixXf random_matrix(std::int64_t rows, std::int64_t cols, unsigned seed) {
  std::srand(seed);
  return Eigen::MatrixXf::Random(rows, cols);
}

//! The operands of one shape: Eigen's C = A·B, and loom's kernels on row-major flat tensors as
//! the model passes them (the Eigen matrices' storage read as row-major: only the values
//! differ, and values do not change the time).
struct Operands {
  Eigen::MatrixXf a, b, c, in, weight, bias, dout, out, din, dweight, dbias;
  explicit Operands(const GemmShape& s)
      : a(random_matrix(s.m, s.k, 1)), b(random_matrix(s.k, s.n, 2)), c(s.m, s.n),
        in(random_matrix(s.m, s.k, 3)), weight(random_matrix(s.n, s.k, 4)),
        bias(random_matrix(s.n, 1, 5)), dout(random_matrix(s.m, s.n, 6)), out(s.m, s.n),
        din(Eigen::MatrixXf::Zero(s.m, s.k)), dweight(Eigen::MatrixXf::Zero(s.n, s.k)),
        dbias(Eigen::MatrixXf::Zero(s.n, 1)) {}
};

//! GFLOP/s of Eigen's GEMM and of loom's two kernels on one shape (0 for what is not asked).
struct Rates {
  double eigen = 0, forward = 0, backward = 0;
};

//! Calls Eigen, loom forward and loom backward in turn, one call each, until `seconds` have
//! passed and each kernel ran `min_calls` times, and keeps each kernel's fastest call. The
//! fastest, not the median: on a shared machine other processes only ever slow a call down,
//! and taking turns call by call spreads their bursts over the three kernels evenly.
Rates measure(loom::cpu& be, const GemmShape& s, bool with_loom, const Options& o) {
  using loom::Shape;
  using loom::Tensor;
  Operands x(s);
  const Tensor<const float> in(x.in.data(), Shape{s.m, s.k}), weight(x.weight.data(), Shape{s.n, s.k}),
      dout(x.dout.data(), Shape{s.m, s.n}),
      bias = s.bias ? Tensor<const float>(x.bias.data(), Shape{s.n}) : Tensor<const float>{};
  const Tensor<float> out(x.out.data(), Shape{s.m, s.n}), din(x.din.data(), Shape{s.m, s.k}),
      dweight(x.dweight.data(), Shape{s.n, s.k}),
      dbias = s.bias ? Tensor<float>(x.dbias.data(), Shape{s.n}) : Tensor<float>{};

  auto eigen = [&] {
    be.bind_gemm_threads();
    x.c.noalias() = x.a * x.b;
  };
  auto forward = [&] { loom::kernels::matmul_forward<float>(be, out, in, weight, bias); };
  auto backward = [&] { loom::kernels::matmul_backward<float>(be, din, dweight, dbias, dout, in, weight); };

  // Warm-up: page faults, Eigen's packing buffers.
  eigen();
  if (with_loom) {
    forward();
    backward();
  }
  const double inf = std::numeric_limits<double>::infinity();
  double t_eigen = inf, t_forward = inf, t_backward = inf, total = 0;
  for (std::int64_t calls = 0; total < o.seconds || calls < o.min_calls; ++calls) {
    const double te = loom::bench::time_seconds(eigen);
    t_eigen = std::min(t_eigen, te);
    total += te;
    if (!with_loom) continue;
    const double tf = loom::bench::time_seconds(forward), tb = loom::bench::time_seconds(backward);
    t_forward = std::min(t_forward, tf);
    t_backward = std::min(t_backward, tb);
    total += tf + tb;
  }
  Rates rates{.eigen = s.flops() / t_eigen / 1e9};
  if (with_loom) {
    rates.forward = s.flops() / t_forward / 1e9;
    rates.backward = 2.0 * s.flops() / t_backward / 1e9;  // two GEMMs: din and dweight
  }
  return rates;
}

int run(const Options& o) {
  const double load = loom::bench::load_average();
  loom::cpu be(o.threads);
  std::printf("loom_gemm_bench: fp32, %d threads, fastest of >= %lld calls per kernel, kernels taking turns "
              "for >= %.2g s per shape\n",
              be.threads(), static_cast<long long>(o.min_calls), o.seconds);
  std::printf("machine: %s\n", loom::bench::machine_line(be.threads()).c_str());
  if (const std::string w = loom::bench::load_warning(load); !w.empty()) std::printf("%s\n", w.c_str());

  const std::vector<GemmShape> square = {{"square 1024", 1024, 1024, 1024, false},
                                         {"square 2048", 2048, 2048, 2048, false}};
  const std::vector<GemmShape> gpt2 = {{"qkv", 256, 768, 2304, true},
                                       {"fc", 256, 768, 3072, true},
                                       {"mlp proj", 256, 3072, 768, true},
                                       {"logits", 256, 768, 50304, false}};
  nlohmann::json report = {{"benchmark", "loom_gemm_bench"},
                           {"date", loom::bench::utc_now()},
                           {"machine", loom::bench::machine_json(be.threads(), load)},
                           {"settings", {{"threads", be.threads()}, {"seconds_per_shape", o.seconds},
                                         {"min_calls", o.min_calls}, {"statistic", "fastest call"},
                                         {"dtype", "float32"}}},
                           {"reference", nlohmann::json::array()},
                           {"loom", nlohmann::json::array()}};

  std::printf("\nReference: Eigen GEMM C = A*B\n%-12s %-24s %9s\n", "shape", "MxK x KxN", "GFLOP/s");
  double best = 0;
  for (const GemmShape& s : square) {
    const double rate = measure(be, s, false, o).eigen;
    best = std::max(best, rate);
    std::printf("%-12s %-24s %9.1f\n", s.name.c_str(), shape_text(s).c_str(), rate);
    std::fflush(stdout);
    report["reference"].push_back({{"shape", s.name}, {"m", s.m}, {"k", s.k}, {"n", s.n}, {"gflops", rate}});
  }
  std::vector<Rates> gpt2_rates;
  for (const GemmShape& s : gpt2) {
    gpt2_rates.push_back(measure(be, s, true, o));
    const double rate = gpt2_rates.back().eigen;
    best = std::max(best, rate);
    std::printf("%-12s %-24s %9.1f\n", s.name.c_str(), shape_text(s).c_str(), rate);
    std::fflush(stdout);
    report["reference"].push_back({{"shape", s.name}, {"m", s.m}, {"k", s.k}, {"n", s.n}, {"gflops", rate}});
  }
  std::printf("machine's measured rate (best of the above): %.1f GFLOP/s\n", best);
  report["measured_rate_gflops"] = best;

  std::printf("\nloom kernels on the GPT-2 small shapes (B*T = 256)\n");
  std::printf("%-10s %-24s %-9s %9s %9s %9s %9s\n", "shape", "MxK x KxN", "kernel", "GFLOP/s",
              "Eigen", "vs Eigen", "vs best");
  double worst_share = std::numeric_limits<double>::infinity();
  for (std::size_t i = 0; i < gpt2.size(); ++i) {
    const GemmShape& s = gpt2[i];
    const Rates& r = gpt2_rates[i];
    for (const auto& [kernel, rate] : {std::pair{"forward", r.forward}, std::pair{"backward", r.backward}}) {
      const double share = rate / r.eigen;
      worst_share = std::min(worst_share, share);
      std::printf("%-10s %-24s %-9s %9.1f %9.1f %8.0f%% %8.0f%%\n", s.name.c_str(), shape_text(s).c_str(),
                  kernel, rate, r.eigen, 100 * share, 100 * rate / best);
      report["loom"].push_back({{"shape", s.name}, {"m", s.m}, {"k", s.k}, {"n", s.n}, {"kernel", kernel},
                                {"bias", s.bias}, {"gflops", rate}, {"eigen_gflops", r.eigen},
                                {"share_of_eigen", share}, {"share_of_measured_rate", rate / best}});
    }
  }
  std::printf("\nvs Eigen: loom's rate over Eigen's GEMM on the same shape (target >= 70%%): worst %.0f%%, %s\n",
              100 * worst_share, worst_share >= 0.7 ? "met" : "NOT met");
  std::printf("vs best:  loom's rate over the machine's measured rate (%.1f GFLOP/s)\n", best);
  report["worst_share_of_eigen"] = worst_share;
  report["target_met"] = worst_share >= 0.7;
  loom::bench::write_json(o.json, report);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Measured fp32 GEMM rate (Eigen) and loom's matmul kernels on GPT-2 small shapes."};
  app.add_option("--threads", o.threads, "CPU threads (0 = all cores)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--seconds", o.seconds, "Time each shape at least this long (its kernels taking turns)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--min-calls", o.min_calls, "Time each kernel at least this many calls")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--json", o.json, "Also write the results to this JSON file");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(o);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
