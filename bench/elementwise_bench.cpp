// loom_elementwise_bench: loom's memory-bound CPU kernels in float and bf16, in GB/s, against the
// machine's measured bandwidth for the same thread count.
//
//   loom_elementwise_bench                              # 64 Mi elements, 2 threads, 7 calls each
//   loom_elementwise_bench --elements 16777216 --threads 1 --json elementwise.json
//
// Reference: a plain loop `a[i] += b[i]` over floats (12 bytes an element, read-modify-write as
// most of the kernels are; a separate output would also be read before it is written) on the
// same threads, the rate an element-wise kernel can reach here. Then, for float and
// bf16: add_to, residual_forward, residual_backward, scale, drain_into (bf16 into fp32 sums),
// SGD with momentum and AdamW (bf16: with fp32 master weights), and the cross-entropy of a
// training step over rows of GPT-2's 50,304 columns: the statistics, losses and backward kernels
// (two reads and a write of the logits, the exps taken twice) against
// cross_entropy_forward_backward (one read and a write, the exps once). Each kernel's bytes are
// what it must read and write once (listed in the table); GB/s is bytes / median time, "vs add"
// that rate over the reference's. The kernels take turns, call by call, so a slow phase of the
// machine falls on all of them.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "loom/loom.hpp"

namespace {

struct Options {
  std::int64_t elements = std::int64_t{64} << 20;
  int threads = 2;
  int calls = 7;  // timed calls per kernel, after one untimed
  std::string json;
};

//! One kernel to time: its name, the bytes it moves per element, and one call.
struct Kernel {
  std::string name;
  double bytes_per_element;
  std::function<void()> call;
};

//! Medians of `calls` timed calls of each kernel, the kernels taking turns.
std::vector<double> median_seconds(const std::vector<Kernel>& kernels, int calls) {
  std::vector<std::vector<double>> samples(kernels.size());
  for (const Kernel& k : kernels) k.call();  // untimed: first touch, thread start-up
  for (int c = 0; c < calls; ++c)
    for (std::size_t i = 0; i < kernels.size(); ++i) samples[i].push_back(loom::bench::time_seconds(kernels[i].call));
  std::vector<double> medians;
  for (auto& s : samples) medians.push_back(loom::bench::summarize(s).median);
  return medians;
}

//! The kernels of element type T over `n` elements (buffers allocated here, kept alive by the
//! returned callables' captures).
template <class T>
std::vector<Kernel> kernels_of(const loom::cpu& be, std::int64_t n) {
  using loom::Shape;
  using loom::Tensor;
  const double t = sizeof(T);
  auto a = std::make_shared<std::vector<T>>(n, T(0.5f)), b = std::make_shared<std::vector<T>>(n, T(0.25f)),
       c = std::make_shared<std::vector<T>>(n, T(0.0f));
  auto master = std::make_shared<std::vector<float>>(n, 0.5f), m = std::make_shared<std::vector<float>>(n, 0.0f),
       v = std::make_shared<std::vector<float>>(n, 0.0f), sums = std::make_shared<std::vector<float>>(n, 0.0f);
  const auto view = [n](auto& x) { return Tensor<typename std::decay_t<decltype(*x)>::value_type>(x->data(), Shape{n}); };
  const auto cview = [n](auto& x) {
    return Tensor<const typename std::decay_t<decltype(*x)>::value_type>(x->data(), Shape{n});
  };
  std::vector<Kernel> k;
  k.push_back({"add_to", 3 * t, [=, &be] { loom::add_to<T>(be, view(a), cview(b)); }});
  k.push_back({"residual_forward", 3 * t, [=, &be] { loom::residual_forward<T>(be, view(c), cview(a), cview(b)); }});
  k.push_back({"residual_backward", 5 * t, [=, &be] { loom::residual_backward<T>(be, view(a), view(c), cview(b)); }});
  k.push_back({"scale", 2 * t, [=, &be] { loom::scale<T>(be, view(a), 1.0); }});
  const loom::SgdUpdate sgd{.lr = 1e-3, .momentum = 0.9, .weight_decay = 0.0, .nesterov = false};
  const loom::AdamWUpdate adamw{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 1};
  if constexpr (loom::is_narrow_storage<T>) {
    // bf16 read and zeroed, fp32 sum read and written.
    k.push_back({"drain_into", 2 * t + 8, [=, &be] { loom::drain_into<T>(be, view(sums), view(b)); }});
    // gradient read; master and momentum read and written; parameters written.
    k.push_back({"sgd_momentum_update", 2 * t + 16,
                 [=, &be] { loom::sgd_momentum_update<T>(be, view(a), cview(b), view(master), view(m), sgd); }});
    k.push_back({"adamw_update", 2 * t + 24, [=, &be] {
                   loom::adamw_update<T>(be, view(a), cview(b), view(master), view(m), view(v), adamw);
                 }});
  } else {
    k.push_back({"sgd_momentum_update", 5 * t,
                 [=, &be] { loom::sgd_momentum_update<T>(be, view(a), cview(b), view(m), sgd); }});
    k.push_back({"adamw_update", 7 * t,
                 [=, &be] { loom::adamw_update<T>(be, view(a), cview(b), view(m), view(v), adamw); }});
  }
  // The cross-entropy over [rows, 50304] (every target valid), written over the logits.
  constexpr std::int64_t columns = 50304, vocab = 50257;
  const std::int64_t rows = std::max<std::int64_t>(n / columns, 1);
  using A = loom::accumulate_t<T>;
  auto targets = std::make_shared<std::vector<std::int32_t>>(rows);
  for (std::int64_t r = 0; r < rows; ++r) (*targets)[r] = static_cast<std::int32_t>(r * 7919 % vocab);
  auto stats = std::make_shared<std::vector<double>>(3 * rows + 1);
  auto losses = std::make_shared<std::vector<A>>(rows);
  auto logits = std::make_shared<std::vector<T>>(rows * columns);
  for (std::int64_t i = 0; i < rows * columns; ++i) (*logits)[i] = T(static_cast<float>(i % 97) / 16.0f - 3.0f);
  const A scale = A(1) / static_cast<A>(rows);
  const double ce_bytes = static_cast<double>(rows * columns) / static_cast<double>(n) * t;  // per element of n
  k.push_back({"cross-entropy, 3 kernels", 3 * ce_bytes, [=, &be] {
                 const Tensor<const std::int32_t> target_view(targets->data(), Shape{rows});
                 const Tensor<double> row_max(stats->data(), Shape{rows}), partials(stats->data() + rows, Shape{2, rows});
                 const Tensor<T> x(logits->data(), Shape{rows, columns});
                 loom::vocab_parallel_cross_entropy_statistics<T>(be, row_max, partials, x, target_view, 0, vocab);
                 loom::vocab_parallel_cross_entropy_losses<T>(be, Tensor<A>(losses->data(), Shape{rows}), row_max,
                                                              partials, target_view);
                 loom::vocab_parallel_cross_entropy_backward<T>(be, x, x, row_max, partials, target_view, 0, vocab,
                                                                scale);
               }});
  k.push_back({"cross_entropy_forward_backward", 2 * ce_bytes, [=, &be] {
                 loom::cross_entropy_forward_backward<T>(
                     be, Tensor<A>(losses->data(), Shape{rows}), Tensor<double>(stats->data(), Shape{rows}),
                     Tensor<double>(stats->data() + rows, Shape{2, rows}), Tensor<T>(logits->data(), Shape{rows, columns}),
                     Tensor<const std::int32_t>(targets->data(), Shape{rows}), vocab, scale,
                     Tensor<double>(stats->data() + 3 * rows, Shape{1}));
               }});
  return k;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"loom's element-wise CPU kernels (float, bf16) in GB/s against a plain in-place float add"};
  app.add_option("--elements", o.elements, "Elements per tensor")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--threads", o.threads, "Threads per kernel")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--calls", o.calls, "Timed calls per kernel (the median is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--json", o.json, "Also write the results to this JSON file");
  CLI11_PARSE(app, argc, argv);

  const double load = loom::bench::load_average();
  std::printf("loom_elementwise_bench: %lld elements, %d threads, median of %d calls\n%s\n",
              static_cast<long long>(o.elements), o.threads, o.calls, loom::bench::machine_line(o.threads).c_str());
  if (const std::string w = loom::bench::load_warning(load); !w.empty()) std::printf("%s\n", w.c_str());

  const std::int64_t n = o.elements;
  std::vector<float> x(n, 1.0f), y(n, 0.0f);
  const int threads = o.threads;
  const Kernel reference{"plain float a += b", 12.0, [&] {
                           float* out = x.data();
                           const float* in = y.data();
#pragma omp parallel for num_threads(threads) schedule(static)
                           for (std::int64_t i = 0; i < n; ++i) out[i] += in[i];
                         }};
  loom::cpu be(o.threads);
  nlohmann::json report = {{"benchmark", "loom_elementwise_bench"},
                           {"elements", n},
                           {"calls", o.calls},
                           {"machine", loom::bench::machine_json(o.threads, load)},
                           {"kernels", nlohmann::json::array()}};

  std::vector<Kernel> all{reference};
  std::vector<std::string> types{"float"};
  for (Kernel& k : kernels_of<float>(be, n)) {
    all.push_back(std::move(k));
    types.push_back("float");
  }
  for (Kernel& k : kernels_of<loom::bf16>(be, n)) {
    all.push_back(std::move(k));
    types.push_back("bf16");
  }
  const std::vector<double> medians = median_seconds(all, o.calls);
  const double reference_rate = 12.0 * static_cast<double>(n) / medians[0] / 1e9;
  std::printf("\n%-6s %-30s %12s %10s %10s %8s\n", "type", "kernel", "bytes/elem", "median ms", "GB/s", "vs add");
  for (std::size_t i = 0; i < all.size(); ++i) {
    const double rate = all[i].bytes_per_element * static_cast<double>(n) / medians[i] / 1e9;
    std::printf("%-6s %-30s %12.0f %10.2f %10.1f %7.0f%%\n", types[i].c_str(), all[i].name.c_str(),
                all[i].bytes_per_element, 1e3 * medians[i], rate, 100.0 * rate / reference_rate);
    report["kernels"].push_back({{"type", types[i]},
                                 {"kernel", all[i].name},
                                 {"bytes_per_element", all[i].bytes_per_element},
                                 {"median_s", medians[i]},
                                 {"gb_per_s", rate},
                                 {"fraction_of_reference", rate / reference_rate}});
  }
  loom::bench::write_json(o.json, report);
  return 0;
}
