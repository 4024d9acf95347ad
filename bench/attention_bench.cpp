// loom_attention_bench: the two CPU attention pairs side by side, on one layer's shape:
// attention_forward/backward (the probabilities [B,H,T,T] kept) against
// attention_forward_lse/backward_lse (only the rows' log-sum-exp [B,H,T] kept, the
// probabilities recomputed in the backward). Prints the median time of each kernel, the lse
// pair's ratio to the stored pair, and what each keeps per layer.
//
//   loom_attention_bench                                   # B=4, T=256, C=768 (GPT-2 small), 12 heads, 2 threads
//   loom_attention_bench --seq 1024 --batch 1 --calls 11 --json attention.json
//
// The four kernels take turns (forward, backward, forward_lse, backward_lse, then again), so
// that a change in the machine's load falls on all of them alike; the first round is not timed.
// A call's FLOPs: 2 GEMMs of the causal half in the forward (2·2·B·H·hs·T²/2), 4 in the stored
// backward, 5 in the lse backward.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "loom/loom.hpp"

namespace {

struct Options {
  int threads = 2;
  std::int64_t batch = 4, seq = 256, channels = 768;
  int heads = 12;
  int calls = 9;  // timed calls per kernel
  std::string json;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace loom;
  Options o;
  CLI::App app("loom_attention_bench: stored-probability attention against log-sum-exp attention (CPU, float)");
  app.add_option("--threads", o.threads, "OpenMP threads of the cpu backend")->capture_default_str();
  app.add_option("--batch", o.batch, "B")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "T")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--channels", o.channels, "C")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--heads", o.heads, "H (must divide C)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--calls", o.calls, "Timed calls per kernel")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--json", o.json, "Also write the figures to this file");
  CLI11_PARSE(app, argc, argv);

  const double load = bench::load_average();
  const std::int64_t B = o.batch, T = o.seq, C = o.channels, H = o.heads;
  const std::vector<float> qkv = bench::uniform_values(B * T * 3 * C, 7, "qkv"),
                           dout = bench::uniform_values(B * T * C, 7, "dout");
  std::vector<float> out(static_cast<std::size_t>(B * T * C)), att(static_cast<std::size_t>(B * H * T * T)),
      lse(static_cast<std::size_t>(B * H * T)), dqkv(qkv.size());
  const cpu be(o.threads);
  const Tensor<const float> q(qkv.data(), {B, T, 3 * C}), g(dout.data(), {B, T, C});
  const Tensor<float> o_t(out.data(), {B, T, C}), att_t(att.data(), {B, H, T, T}), lse_t(lse.data(), {B, H, T}),
      dq_t(dqkv.data(), {B, T, 3 * C});

  struct Kernel {
    const char* name;
    std::function<void()> run;
    std::vector<double> ms;
  };
  std::vector<Kernel> kernels;
  kernels.push_back({"attention_forward", [&] { attention_forward<float>(be, o_t, att_t, q, o.heads); }, {}});
  kernels.push_back({"attention_backward", [&] { attention_backward<float>(be, dq_t, g, q, att_t, o.heads); }, {}});
  kernels.push_back({"attention_forward_lse", [&] { attention_forward_lse<float>(be, o_t, lse_t, q, o.heads); }, {}});
  kernels.push_back(
      {"attention_backward_lse", [&] { attention_backward_lse<float>(be, dq_t, g, q, o_t, lse_t, o.heads); }, {}});
  for (int round = 0; round <= o.calls; ++round)
    for (Kernel& k : kernels) {
      const double seconds = bench::time_seconds(k.run);
      if (round > 0) k.ms.push_back(1e3 * seconds);
    }

  const double hs = static_cast<double>(C / H), causal_gemm = 2.0 * B * H * hs * T * T / 2;
  const double gemms[] = {2, 4, 2, 5};
  std::printf("%s\n", bench::machine_line(o.threads).c_str());
  const std::string warning = bench::load_warning(load);
  if (!warning.empty()) std::printf("%s\n", warning.c_str());
  std::printf("B=%lld T=%lld C=%lld H=%lld, float, %d timed calls per kernel (median)\n", static_cast<long long>(B),
              static_cast<long long>(T), static_cast<long long>(C), static_cast<long long>(H), o.calls);
  nlohmann::json report;
  report["machine"] = bench::machine_json(o.threads, load);
  report["shape"] = {{"batch", B}, {"seq", T}, {"channels", C}, {"heads", H}};
  std::vector<double> medians;
  for (std::size_t i = 0; i < kernels.size(); ++i) {
    const bench::Stats s = bench::summarize(kernels[i].ms);
    medians.push_back(s.median);
    const double gflops = gemms[i] * causal_gemm / (s.median * 1e6);
    std::printf("  %-24s %9.2f ms  (min %.2f)  %7.1f GFLOP/s\n", kernels[i].name, s.median, s.min, gflops);
    report["kernels"][kernels[i].name] = {{"median_ms", s.median}, {"min_ms", s.min}, {"gflops", gflops}};
  }
  const double forward_ratio = medians[2] / medians[0], backward_ratio = medians[3] / medians[1],
               step_ratio = (medians[2] + medians[3]) / (medians[0] + medians[1]);
  std::printf("lse / stored: forward %.2fx, backward %.2fx, forward + backward %.2fx\n", forward_ratio,
              backward_ratio, step_ratio);
  const double att_mib = static_cast<double>(B * H * T * T) * sizeof(float) / (1 << 20),
               lse_mib = static_cast<double>(B * H * T) * sizeof(float) / (1 << 20);
  std::printf("kept per layer: att %.2f MiB, lse %.4f MiB (%.0fx less)\n", att_mib, lse_mib, att_mib / lse_mib);
  report["ratios"] = {{"forward", forward_ratio}, {"backward", backward_ratio}, {"forward_backward", step_ratio}};
  report["kept_mib"] = {{"att", att_mib}, {"lse", lse_mib}};
  bench::write_json(o.json, report);
  return 0;
}
