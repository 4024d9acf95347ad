// loom_optimizer_bench: one optimizer step over a whole GPT-2's parameters on one rank, for
// AdamW, SGD with momentum and Adafactor, in float and bf16 (fp32 master weights): the median
// time, the state each keeps, and each step's time over AdamW's.
//
//   loom_optimizer_bench                          # GPT-2 small (124M), 2 threads, 5 calls each
//   loom_optimizer_bench --model tiny --json optimizers.json
//
// The gradients are fixed random values (the step's time does not depend on them). AdamW and SGD
// run through the element-wise path the strategies use (detail::apply_optimizer over the whole
// layout); Adafactor through its tensor-wise update with no ranks to reduce over. The optimizers
// take turns, call by call, so a slow phase of the machine falls on all of them.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "loom/loom.hpp"
#include "loom/parallel/detail/flat_update.hpp"

namespace {

struct Options {
  std::string model = "small";
  int threads = 2;
  int calls = 5;  // timed calls per optimizer, after one untimed
  std::string json;
};

//! One optimizer to time: its name, the optimizer-state bytes it holds, one step.
struct Step {
  std::string name;
  std::size_t state_bytes;
  std::function<void()> call;
};

//! The float or bf16 model's parameters, gradients and each optimizer's state, kept alive by the
//! returned steps' captures.
template <class T>
std::vector<Step> steps_of(loom::cpu& be, const loom::ParameterLayout& layout) {
  using A = loom::accumulate_t<T>;
  const std::int64_t n = layout.total();
  const std::string type = loom::is_narrow_storage<T> ? "bf16" : "float";
  struct Buffers {
    std::vector<T> params, grads;
    std::vector<A> master, adamw_state, sgd_state;
  };
  auto b = std::make_shared<Buffers>();
  const std::vector<float> init = loom::bench::uniform_values(n, 1, "params", -0.05f, 0.05f);
  const std::vector<float> grad = loom::bench::uniform_values(n, 2, "grads", -1e-3f, 1e-3f);
  for (float x : init) b->params.push_back(static_cast<T>(x));
  for (float g : grad) b->grads.push_back(static_cast<T>(g));
  if constexpr (loom::is_narrow_storage<T>) b->master.assign(init.begin(), init.end());
  b->adamw_state.assign(static_cast<std::size_t>(2 * n), A(0));
  b->sgd_state.assign(static_cast<std::size_t>(n), A(0));
  const std::size_t master_bytes = b->master.size() * sizeof(A);
  const auto range = [b, n](A* state) {
    return loom::detail::FlatRange<T>{.begin = 0, .end = n, .params = b->params.data(), .grads = b->grads.data(),
                                      .state = state, .state_stride = n,
                                      .master = b->master.empty() ? nullptr : b->master.data()};
  };
  auto adafactor_state = std::make_shared<loom::Adafactor::State<loom::cpu, T>>(be, layout);
  auto step = std::make_shared<std::int64_t>(0);
  std::vector<Step> out;
  out.push_back({type + " AdamW", b->adamw_state.size() * sizeof(A) + master_bytes, [&be, &layout, b, range, step] {
                   loom::detail::apply_optimizer(loom::AdamW(), be, layout, range(b->adamw_state.data()), 1e-4, ++*step);
                 }});
  if constexpr (!loom::is_narrow_storage<T>)
    out.push_back({type + " SGD (momentum)", b->sgd_state.size() * sizeof(A) + master_bytes, [&be, &layout, b, range] {
                     loom::detail::apply_optimizer(loom::SgdMomentum(), be, layout, range(b->sgd_state.data()), 1e-4, 1);
                   }});
  out.push_back({type + " Adafactor", static_cast<std::size_t>(adafactor_state->bytes()) + master_bytes,
                 [&be, &layout, b, range, adafactor_state, step] {
                   const loom::detail::FlatRange<T> r = range(nullptr);
                   const std::vector<loom::TensorSegment<T>> segments =
                       loom::detail::tensor_segments(layout, std::span<const loom::detail::FlatRange<T>>(&r, 1));
                   loom::Adafactor().update(be, layout, std::span<const loom::TensorSegment<T>>(segments),
                                            *adafactor_state, 1e-2, ++*step, true, [](std::span<double>) {});
                 }});
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"One optimizer step over a whole GPT-2 (AdamW, SGD, Adafactor; float and bf16)"};
  app.add_option("--model", o.model, "GPT-2 config: tiny, small, medium, large, xl, 2.7B")->capture_default_str();
  app.add_option("--threads", o.threads, "Threads")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--calls", o.calls, "Timed calls per optimizer (the median is reported)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--json", o.json, "Also write the results to this JSON file");
  CLI11_PARSE(app, argc, argv);

  const loom::gpt2::Config config = loom::gpt2::config_by_name(o.model);
  const loom::gpt2::Model<loom::cpu, float> model(config);
  const loom::ParameterLayout& layout = model.layout();
  const double load = loom::bench::load_average();
  std::printf("loom_optimizer_bench: GPT-2 %s (%lld parameters), %d threads, median of %d calls\n%s\n",
              o.model.c_str(), static_cast<long long>(layout.total()), o.threads, o.calls,
              loom::bench::machine_line(o.threads).c_str());
  if (const std::string w = loom::bench::load_warning(load); !w.empty()) std::printf("%s\n", w.c_str());

  loom::cpu be(o.threads);
  std::vector<Step> all = steps_of<float>(be, layout);
  for (Step& s : steps_of<loom::bf16>(be, layout)) all.push_back(std::move(s));
  std::vector<std::vector<double>> samples(all.size());
  for (const Step& s : all) s.call();  // untimed: first touch, thread start-up
  for (int c = 0; c < o.calls; ++c)
    for (std::size_t i = 0; i < all.size(); ++i) samples[i].push_back(loom::bench::time_seconds(all[i].call));

  nlohmann::json report = {{"benchmark", "loom_optimizer_bench"},
                           {"model", o.model},
                           {"parameters", layout.total()},
                           {"calls", o.calls},
                           {"machine", loom::bench::machine_json(o.threads, load)},
                           {"optimizers", nlohmann::json::array()}};
  std::printf("\n%-24s %12s %14s %16s %12s\n", "optimizer", "median ms", "vs AdamW", "state MiB", "state B/param");
  double adamw = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const double median = loom::bench::summarize(samples[i]).median;
    if (all[i].name.ends_with("AdamW")) adamw = median;
    const double per_param = static_cast<double>(all[i].state_bytes) / static_cast<double>(layout.total());
    std::printf("%-24s %12.1f %13.2fx %16.2f %12.3f\n", all[i].name.c_str(), 1e3 * median, median / adamw,
                static_cast<double>(all[i].state_bytes) / (1 << 20), per_param);
    report["optimizers"].push_back({{"optimizer", all[i].name},
                                    {"median_s", median},
                                    {"over_adamw", median / adamw},
                                    {"state_bytes", all[i].state_bytes}});
  }
  loom::bench::write_json(o.json, report);
  return 0;
}
