// loom_pipeline_bench: the pipeline study our Megatron/DeepSpeed users know. For p pipeline
// stages on thread ranks and each schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1), the number of
// micro-batches m per step against the measured throughput and idle fraction, beside the bubble
// formula (or, for ZB-H1, the schedule simulator); then what one slow stage costs each schedule.
//
//   loom_pipeline_bench                                     # both modes, ~2.5 min on a quiet machine
//   loom_pipeline_bench --mode timed --stages 4 --micro-batches 8,32 --schedules 1f1b,zb-h1
//   loom_pipeline_bench --quick                             # the smoke test (seconds)
//   loom_pipeline_bench --json pipeline.json
//
// Two modes, because this machine has 2 cores:
//
// - "timed layers (sleep)": a Model whose layers compute nothing worth timing and sleep a fixed
//   time per pass (F, B, and for ZB-H1 I and W, per micro-batch per stage), with tiny real
//   tensors and the Trainer's real pipeline communication. A sleeping rank needs no core, so
//   p = 4 ranks on 2 cores measure the schedule and the executor as p devices would.
// - "GPT-2": real compute on p = 2 ranks × 1 thread (one core each). With more ranks than cores
//   a waiting rank lends its core to the others and both throughput and idle time are distorted.
//
// Per step: `wait` = StepMetrics::pipeline_wait_seconds / seconds (time blocked on other stages'
// messages, as the Trainer reports it), the mean over ranks; `idle` = the simulator's idle
// fraction measured: 1 − Σ over ranks of the time inside the layers' passes / (p × span), the
// span running from the common start of the step to the end of the last pass on any rank;
// `rest` = step time − span (optimizer update, loss and gradient-norm all-reduces). Medians over
// steps; the step time is the slowest rank's.

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "bench_common.hpp"
#include "loom/comm/threads.hpp"
#include "loom/io/synthetic.hpp"
#include "loom/loom.hpp"

namespace {

using Clock = std::chrono::steady_clock;

//! Time one rank spent inside its layers' passes, by kind, since the last reset, and when the
//! last pass ended.
struct ComputeClock {
  double forward = 0, backward = 0, backward_input = 0, backward_weight = 0;
  Clock::time_point last_end{};
  double total() const { return forward + backward + backward_input + backward_weight; }
};

//! `M` with every forward and backward pass timed into a ComputeClock (the rank's own): the
//! busy time that the idle fraction is measured against. Everything else passes through.
template <loom::Model M>
class Clocked {
 public:
  using loom_model = void;
  using backend_type = typename M::backend_type;
  using scalar_type = typename M::scalar_type;
  using T = scalar_type;

  Clocked(M inner, ComputeClock* clock) : inner_(std::move(inner)), clock_(clock) {}

  const M& inner() const noexcept { return inner_; }
  const loom::ParameterLayout& layout() const noexcept { return inner_.layout(); }
  int num_layers() const { return inner_.num_layers(); }
  double layer_cost(int layer) const { return inner_.layer_cost(layer); }
  std::vector<loom::ElementRange> layer_parameters(int layer) const { return inner_.layer_parameters(layer); }
  std::int64_t hidden_elements(loom::MicroBatchShape s) const { return inner_.hidden_elements(s); }
  std::int64_t activation_elements(int layer, loom::MicroBatchShape s) const {
    return inner_.activation_elements(layer, s);
  }
  std::int64_t workspace_elements(int layer, loom::MicroBatchShape s) const {
    return inner_.workspace_elements(layer, s);
  }
  double flops_per_token(std::int64_t seq) const { return inner_.flops_per_token(seq); }
  std::int64_t tensor_parallel_size() const
    requires requires(const M& m) { m.tensor_parallel_size(); }
  {
    return inner_.tensor_parallel_size();
  }

  double forward(backend_type& be, int layer, loom::ParameterView<const T> params,
                 const loom::ForwardArgs<T>& a) const {
    const auto start = Clock::now();
    const double loss = inner_.forward(be, layer, params, a);
    clock_->forward += seconds_since(start);
    return loss;
  }
  void backward(backend_type& be, int layer, loom::ParameterView<const T> params, loom::ParameterView<T> grads,
                const loom::BackwardArgs<T>& a) const {
    const auto start = Clock::now();
    inner_.backward(be, layer, params, grads, a);
    clock_->backward += seconds_since(start);
  }
  std::int64_t stash_elements(int layer, loom::MicroBatchShape s) const
    requires loom::SplitBackwardModel<M>
  {
    return inner_.stash_elements(layer, s);
  }
  void backward_input(backend_type& be, int layer, loom::ParameterView<const T> params, loom::ParameterView<T> grads,
                      const loom::BackwardArgs<T>& a, loom::Tensor<T> stash) const
    requires loom::SplitBackwardModel<M>
  {
    const auto start = Clock::now();
    inner_.backward_input(be, layer, params, grads, a, stash);
    clock_->backward_input += seconds_since(start);
  }
  void backward_weight(backend_type& be, int layer, loom::ParameterView<const T> params, loom::ParameterView<T> grads,
                       const loom::BackwardArgs<T>& a, loom::Tensor<T> stash) const
    requires loom::SplitBackwardModel<M>
  {
    const auto start = Clock::now();
    inner_.backward_weight(be, layer, params, grads, a, stash);
    clock_->backward_weight += seconds_since(start);
  }

 private:
  double seconds_since(Clock::time_point start) const {
    clock_->last_end = Clock::now();
    return std::chrono::duration<double>(clock_->last_end - start).count();
  }
  M inner_;
  ComputeClock* clock_;
};

//! How long each pass of one layer sleeps, per micro-batch.
struct LayerTimes {
  std::chrono::nanoseconds forward{}, backward{}, backward_input{}, backward_weight{};
};

//! A Model whose layers sleep instead of computing: each pass does a trivial elementwise
//! computation on small real tensors (so gradients, the stash and the pipeline's messages are
//! real) and then sleeps until its fixed time is up. Layer 0 embeds tokens, middle layers scale
//! their input by a per-channel weight, the last layer's loss is Σ_c x_c·w_c / C per target.
//! Every layer has the same cost estimate, so balance_stages cuts the layers evenly whatever
//! they sleep: a slow stage is slow hardware, not a badly balanced model.
class TimedLayers {
 public:
  using loom_model = void;
  using backend_type = loom::cpu;
  using scalar_type = float;
  using T = float;

  TimedLayers(std::vector<LayerTimes> times, std::int64_t channels) : times_(std::move(times)), channels_(channels) {
    LOOM_CHECK(times_.size() >= 2, "timed layers: layers", times_.size(), "need at least 2 (first and last)");
    std::vector<loom::ParameterSpec> specs;
    for (std::size_t l = 0; l < times_.size(); ++l)
      specs.push_back({.name = "layer." + std::to_string(l) + ".scale",
                       .shape = loom::Shape{channels_},
                       .layer = static_cast<int>(l),
                       .init = loom::Init::ones()});
    layout_ = loom::ParameterLayout(std::move(specs));
  }

  const loom::ParameterLayout& layout() const noexcept { return layout_; }
  int num_layers() const noexcept { return static_cast<int>(times_.size()); }
  double layer_cost(int) const noexcept { return 1.0; }
  std::vector<loom::ElementRange> layer_parameters(int layer) const {
    const auto& e = layout_.entries()[static_cast<std::size_t>(layer)];
    return {{e.offset, e.offset + e.numel()}};
  }
  std::int64_t hidden_elements(loom::MicroBatchShape s) const noexcept { return s.batch * s.seq * channels_; }
  std::int64_t activation_elements(int, loom::MicroBatchShape) const noexcept { return 0; }  // reads its input
  std::int64_t workspace_elements(int, loom::MicroBatchShape) const noexcept { return 0; }
  double flops_per_token(std::int64_t) const noexcept { return 0; }
  //! The W pass needs the output gradient, which the Trainer does not keep: stash a copy.
  std::int64_t stash_elements(int layer, loom::MicroBatchShape s) const noexcept {
    return last(layer) ? 0 : hidden_elements(s);
  }

  double forward(loom::cpu&, int layer, loom::ParameterView<const T> params, const loom::ForwardArgs<T>& a) const {
    const auto deadline = Clock::now() + times(layer).forward;
    const T* w = weight(params, layer);
    const std::int64_t tokens = a.tokens.numel();
    double loss = 0;
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t c = 0; c < channels_; ++c) {
        const std::int64_t i = t * channels_ + c;
        if (layer == 0) a.output[i] = w[c] * embed(a.tokens[t]);
        else if (!last(layer)) a.output[i] = w[c] * a.input[i];
        else if (a.targets[t] >= 0) loss += static_cast<double>(w[c] * a.input[i]) / static_cast<double>(channels_);
      }
    std::this_thread::sleep_until(deadline);
    return loss;
  }
  void backward(loom::cpu&, int layer, loom::ParameterView<const T> params, loom::ParameterView<T> grads,
                const loom::BackwardArgs<T>& a) const {
    const auto deadline = Clock::now() + times(layer).backward;
    input_gradient(layer, params, a, a.output_grad);
    weight_gradient(layer, grads, a, a.output_grad);
    std::this_thread::sleep_until(deadline);
  }
  void backward_input(loom::cpu&, int layer, loom::ParameterView<const T> params, loom::ParameterView<T>,
                      const loom::BackwardArgs<T>& a, loom::Tensor<T> stash) const {
    const auto deadline = Clock::now() + times(layer).backward_input;
    input_gradient(layer, params, a, a.output_grad);
    if (!last(layer)) std::copy(a.output_grad.begin(), a.output_grad.end(), stash.data());
    std::this_thread::sleep_until(deadline);
  }
  void backward_weight(loom::cpu&, int layer, loom::ParameterView<const T>, loom::ParameterView<T> grads,
                       const loom::BackwardArgs<T>& a, loom::Tensor<T> stash) const {
    const auto deadline = Clock::now() + times(layer).backward_weight;
    weight_gradient(layer, grads, a, loom::Tensor<const T>(stash));
    std::this_thread::sleep_until(deadline);
  }

 private:
  bool last(int layer) const noexcept { return layer + 1 == num_layers(); }
  const LayerTimes& times(int layer) const { return times_[static_cast<std::size_t>(layer)]; }
  static T embed(std::int32_t token) noexcept { return static_cast<T>(token % 8 + 1) / T(8); }
  const T* weight(loom::ParameterView<const T> params, int layer) const {
    const auto& e = layout_.entries()[static_cast<std::size_t>(layer)];
    return params.at(e.offset, e.numel());
  }

  // input_grad += d loss / d input (nothing for layer 0, whose input is the tokens).
  void input_gradient(int layer, loom::ParameterView<const T> params, const loom::BackwardArgs<T>& a,
                      loom::Tensor<const T> output_grad) const {
    if (layer == 0) return;
    const T* w = weight(params, layer);
    const std::int64_t tokens = a.tokens.numel();
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t c = 0; c < channels_; ++c) {
        const std::int64_t i = t * channels_ + c;
        if (!last(layer)) a.input_grad[i] += output_grad[i] * w[c];
        else if (a.targets[t] >= 0) a.input_grad[i] += a.loss_scale * w[c] / static_cast<T>(channels_);
      }
  }
  // grads of the layer's weight += d loss / d weight.
  void weight_gradient(int layer, loom::ParameterView<T> grads, const loom::BackwardArgs<T>& a,
                       loom::Tensor<const T> output_grad) const {
    const auto& e = layout_.entries()[static_cast<std::size_t>(layer)];
    T* g = grads.at(e.offset, e.numel());
    const std::int64_t tokens = a.tokens.numel();
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t c = 0; c < channels_; ++c) {
        const std::int64_t i = t * channels_ + c;
        if (layer == 0) g[c] += output_grad[i] * embed(a.tokens[t]);
        else if (!last(layer)) g[c] += output_grad[i] * a.input[i];
        else if (a.targets[t] >= 0) g[c] += a.loss_scale * a.input[i] / static_cast<T>(channels_);
      }
  }

  std::vector<LayerTimes> times_;
  std::int64_t channels_;
  loom::ParameterLayout layout_;
};
static_assert(loom::SplitBackwardModel<TimedLayers>);
static_assert(loom::SplitBackwardModel<Clocked<TimedLayers>>);

using Gpt = loom::gpt2::Model<loom::cpu, float>;

struct Options {
  std::vector<std::string> modes{"timed", "gpt2"};
  std::vector<int> stages{2, 4};
  std::vector<std::int64_t> micro_batches{1, 2, 4, 8, 16, 32, 64};
  std::vector<std::string> schedules{"gpipe", "1f1b", "interleaved", "zb-h1"};
  int virtual_stages = 2;
  int warmup = 1, steps = 5;
  // Timed layers: milliseconds per micro-batch through one whole stage.
  double forward_ms = 2, backward_ms = 4, input_ms = 2, weight_ms = 2;
  std::int64_t timed_channels = 16, timed_seq = 16;
  int slow_stage = 1;
  double slow_factor = 2;
  std::int64_t slow_micro_batches = 8;  // 0 = no slow-stage study
  // GPT-2: real compute.
  int gpt2_stages = 2;
  int gpt2_steps = 3;
  std::vector<std::int64_t> gpt2_micro_batches{1, 2, 4, 8, 16, 32, 64};
  std::int64_t gpt2_layers = 8, gpt2_channels = 256, gpt2_heads = 8, gpt2_vocab = 8192, seq = 64;
  bool quick = false;
  std::string json;
};

//! One measured (schedule, p, m) point.
struct Row {
  std::string mode, schedule;
  int stages = 0, virtual_stages = 1;
  std::int64_t micro_batches = 0, tokens = 0;
  int slow_stage = -1;
  double slow_factor = 1;
  loom::bench::Stats step_seconds;
  double wait = 0, idle = 0;           // medians over steps (see the file comment)
  double rest_seconds = 0;             // median over steps of step time − span
  double model = 0;                    // formula or simulated idle fraction
  std::string model_kind;              // "formula" or "simulated"
  double slow_rank_busy = 0;           // median busy fraction of the slow (or last) rank
  std::vector<double> stage_ms;        // per rank: compute ms per micro-batch (median over steps)
  loom::Costs measured_costs;          // per stage per micro-batch, mean over ranks, seconds
  double loss = 0;
};

std::string display_name(const std::string& schedule, int v) {
  if (schedule == "gpipe") return "GPipe";
  if (schedule == "1f1b") return "1F1B";
  if (schedule == "interleaved") return "Interleaved v=" + std::to_string(v);
  return "ZB-H1";
}

//! Calls `f` with the schedule named `name`.
template <class F>
void with_schedule(const std::string& name, int virtual_stages, F&& f) {
  if (name == "gpipe") return f(loom::GPipe{});
  if (name == "1f1b") return f(loom::OneFOneB{});
  if (name == "interleaved") return f(loom::Interleaved1F1B{.virtual_stages = virtual_stages});
  if (name == "zb-h1") return f(loom::ZeroBubbleH1{});
  throw loom::Error("--schedules", name, "expected gpipe, 1f1b, interleaved or zb-h1");
}

//! The idle fraction the theory gives: DESIGN.md's formulas for GPipe, 1F1B and interleaved;
//! for ZB-H1 (whose bubble depends on F, I and W) the schedule simulator with `costs`.
template <class S>
std::pair<double, std::string> model_idle(const S& schedule, int p, std::int64_t m, loom::Costs costs) {
  const double pm1 = p - 1;
  if constexpr (std::is_same_v<S, loom::ZeroBubbleH1>) {
    const loom::ScheduleShape shape{.stages = p, .micro_batches = m};
    return {loom::simulate(schedule, shape, costs).idle_fraction(), "simulated"};
  } else if constexpr (std::is_same_v<S, loom::Interleaved1F1B>) {
    return {pm1 / (static_cast<double>(schedule.virtual_stages * m) + pm1), "formula"};
  } else {
    return {pm1 / (static_cast<double>(m) + pm1), "formula"};
  }
}

//! What one rank measured in one step.
struct Sample {
  double seconds = 0, wait = 0;
  Clock::time_point start;
  ComputeClock compute;
  double loss = 0;
};

//! Runs `warmup + steps` steps of a p-stage pipeline on thread ranks (1 thread each) and
//! summarizes the timed ones. `make_model(clock)` builds a rank's Clocked model; `batch_at(step)`
//! returns the global batch (an io::Batch).
template <class S, class MakeModel, class BatchAt>
Row measure(int p, std::int64_t m, const S& schedule, int warmup, int steps, MakeModel&& make_model,
            BatchAt&& batch_at) {
  std::vector<std::vector<Sample>> samples(static_cast<std::size_t>(p));
  loom::threads::run(p, [&](loom::threads::Communicator& world) {
#if defined(__linux__)
    prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);  // sleeps end on time (default slack: 50 µs)
#endif
    loom::Mesh<loom::threads::Communicator> mesh(world, {.dp = 1, .tp = 1, .pp = p});
    loom::cpu backend(1);
    ComputeClock clock;
    using Model = decltype(make_model(&clock));
    loom::Trainer<Model, loom::AdamW, S> trainer(backend, mesh, make_model(&clock), loom::AdamW(),
                                                  loom::ConstantLr{.lr = 1e-4}, {.micro_batch_size = 1},
                                                  loom::SingleRank{}, schedule);
    auto& mine = samples[static_cast<std::size_t>(world.rank())];
    for (int s = 0; s < warmup + steps; ++s) {
      const auto batch = batch_at(s);
      world.barrier();  // every rank starts the step together
      clock = {};
      const auto start = Clock::now();
      const loom::StepMetrics metrics = trainer.step(batch);
      if (s >= warmup) mine.push_back({metrics.seconds, metrics.pipeline_wait_seconds, start, clock, metrics.loss});
    }
  });

  Row row;
  row.stages = p;
  row.virtual_stages = loom::chunks_per_rank(schedule);
  row.micro_batches = m;
  std::vector<double> step, wait, idle, rest;
  std::vector<std::vector<double>> busy_of(static_cast<std::size_t>(p)), stage_ms(static_cast<std::size_t>(p));
  double forward = 0, backward = 0, input = 0, weight = 0;
  for (int s = 0; s < steps; ++s) {
    double slowest = 0, wait_sum = 0, compute_sum = 0;
    Clock::time_point first_start = Clock::time_point::max(), last_end = Clock::time_point::min();
    for (int r = 0; r < p; ++r) {
      const Sample& x = samples[static_cast<std::size_t>(r)][static_cast<std::size_t>(s)];
      slowest = std::max(slowest, x.seconds);
      wait_sum += x.wait / x.seconds;
      compute_sum += x.compute.total();
      first_start = std::min(first_start, x.start);
      last_end = std::max(last_end, x.compute.last_end);
      busy_of[static_cast<std::size_t>(r)].push_back(x.compute.total() / x.seconds);
      stage_ms[static_cast<std::size_t>(r)].push_back(1e3 * x.compute.total() / static_cast<double>(m));
      forward += x.compute.forward, backward += x.compute.backward;
      input += x.compute.backward_input, weight += x.compute.backward_weight;
    }
    const double span = std::chrono::duration<double>(last_end - first_start).count();
    step.push_back(slowest);
    wait.push_back(wait_sum / p);
    idle.push_back(1.0 - compute_sum / (p * span));
    rest.push_back(slowest - span);
  }
  row.step_seconds = loom::bench::summarize(step);
  row.wait = loom::bench::summarize(wait).median;
  row.idle = loom::bench::summarize(idle).median;
  row.rest_seconds = loom::bench::summarize(rest).median;
  for (int r = 0; r < p; ++r) row.stage_ms.push_back(loom::bench::summarize(stage_ms[static_cast<std::size_t>(r)]).median);
  row.slow_rank_busy = loom::bench::summarize(busy_of.back()).median;
  // Per micro-batch through one stage, mean over ranks and steps (each rank runs m of each).
  const double per = static_cast<double>(p) * steps * static_cast<double>(m);
  row.measured_costs = {forward / per, backward / per, input / per, weight / per};
  row.loss = samples[0].back().loss;
  return row;
}

//! The timed-layers model of `p` stages for `schedule`: one layer per virtual stage (p·v
//! layers), each sleeping its stage's time / v; the layers on rank `slow_stage` sleep
//! `slow_factor` times longer.
template <class S>
TimedLayers timed_model(const Options& o, int p, const S& schedule, int slow_stage, double slow_factor) {
  const int v = loom::chunks_per_rank(schedule);
  const auto ms = [&](double milliseconds, bool slow) {
    return std::chrono::nanoseconds(static_cast<std::int64_t>(1e6 * milliseconds / v * (slow ? slow_factor : 1.0)));
  };
  std::vector<LayerTimes> times;
  for (int layer = 0; layer < p * v; ++layer) {
    const bool slow = layer % p == slow_stage;  // virtual stage k runs on rank k mod p
    times.push_back({ms(o.forward_ms, slow), ms(o.backward_ms, slow), ms(o.input_ms, slow), ms(o.weight_ms, slow)});
  }
  return TimedLayers(std::move(times), o.timed_channels);
}

template <class S>
Row measure_timed(const Options& o, int p, std::int64_t m, const S& schedule, const std::string& name, int slow_stage,
                  double slow_factor) {
  const loom::io::SyntheticMarkov data({.vocab_size = 64});
  Row row = measure(
      p, m, schedule, o.warmup, o.steps,
      [&](ComputeClock* clock) { return Clocked<TimedLayers>(timed_model(o, p, schedule, slow_stage, slow_factor), clock); },
      [&](int step) { return data.batch_at(step, m, o.timed_seq); });
  row.mode = "timed";
  row.schedule = name;
  row.tokens = m * o.timed_seq;
  row.slow_stage = slow_stage;
  row.slow_factor = slow_factor;
  const loom::Costs nominal{.forward = o.forward_ms, .backward = o.backward_ms, .backward_input = o.input_ms,
                            .backward_weight = o.weight_ms};
  std::tie(row.model, row.model_kind) = model_idle(schedule, p, m, nominal);
  return row;
}

loom::gpt2::Config gpt2_config(const Options& o) {
  loom::gpt2::Config c{.max_seq_len = o.seq,
                       .vocab_size = o.gpt2_vocab,
                       .padded_vocab_size = loom::gpt2::pad_vocab(o.gpt2_vocab),
                       .num_layers = o.gpt2_layers,
                       .num_heads = o.gpt2_heads,
                       .channels = o.gpt2_channels};
  c.validate();
  return c;
}

template <class S>
Row measure_gpt2(const Options& o, int p, std::int64_t m, const S& schedule, const std::string& name) {
  const loom::gpt2::Config config = gpt2_config(o);
  const loom::io::SyntheticMarkov data({.vocab_size = config.vocab_size});
  Row row = measure(
      p, m, schedule, o.warmup, o.gpt2_steps, [&](ComputeClock* clock) { return Clocked<Gpt>(Gpt(config), clock); },
      [&](int step) { return data.batch_at(step, m, o.seq); });
  row.mode = "gpt2";
  row.schedule = name;
  row.tokens = m * o.seq;
  // ZB-H1's bubble depends on the passes' costs: simulate it with the measured ones.
  loom::Costs costs = row.measured_costs;
  if (costs.backward <= 0) costs.backward = costs.backward_input + costs.backward_weight;
  if (costs.backward_input <= 0 || costs.backward_weight <= 0)
    costs.backward_input = costs.backward_weight = costs.backward / 2;
  std::tie(row.model, row.model_kind) = model_idle(schedule, p, m, costs);
  return row;
}

bool runs(const std::string& schedule, int p, std::int64_t m) {
  return schedule != "interleaved" || m % p == 0;  // Megatron's rule: m a multiple of p
}

void print_header(bool tokens) {
  std::printf("%3s %4s  %-16s | %9s %9s %10s | %6s %6s | %8s %-9s | %8s\n", "p", "m", "schedule", "step ms", "(min)",
              tokens ? "tokens/s" : "mb/s", "wait", "idle", "theory", "", "rest ms");
}

void print_row(const Row& r, bool tokens) {
  const double per_second = static_cast<double>(tokens ? r.tokens : r.micro_batches) / r.step_seconds.median;
  std::printf("%3d %4lld  %-16s | %9.2f %9.2f %10.1f | %6.3f %6.3f | %8.3f %-9s | %8.2f\n", r.stages,
              static_cast<long long>(r.micro_batches), display_name(r.schedule, r.virtual_stages).c_str(),
              1e3 * r.step_seconds.median, 1e3 * r.step_seconds.min, per_second, r.wait, r.idle, r.model,
              r.model_kind.c_str(), 1e3 * r.rest_seconds);
}

nlohmann::json to_json(const Row& r) {
  return {{"mode", r.mode},
          {"schedule", r.schedule},
          {"stages", r.stages},
          {"virtual_stages", r.virtual_stages},
          {"micro_batches", r.micro_batches},
          {"tokens", r.tokens},
          {"slow_stage", r.slow_stage},
          {"slow_factor", r.slow_factor},
          {"step_seconds_median", r.step_seconds.median},
          {"step_seconds_min", r.step_seconds.min},
          {"step_seconds_mean", r.step_seconds.mean},
          {"micro_batches_per_second", static_cast<double>(r.micro_batches) / r.step_seconds.median},
          {"tokens_per_second", static_cast<double>(r.tokens) / r.step_seconds.median},
          {"wait_fraction", r.wait},
          {"idle_fraction", r.idle},
          {"rest_seconds", r.rest_seconds},
          {"theory_idle_fraction", r.model},
          {"theory", r.model_kind},
          {"last_rank_busy_fraction", r.slow_rank_busy},
          {"stage_compute_ms_per_micro_batch", r.stage_ms},
          {"measured_costs_ms",
           {{"forward", 1e3 * r.measured_costs.forward},
            {"backward", 1e3 * r.measured_costs.backward},
            {"backward_input", 1e3 * r.measured_costs.backward_input},
            {"backward_weight", 1e3 * r.measured_costs.backward_weight}}},
          {"loss", r.loss}};
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Pipeline schedules: throughput and idle fraction against micro-batches, beside the bubble formulas"};
  app.add_option("--mode", o.modes, "timed (sleeping layers, p from --stages) and/or gpt2 (real compute)")->delimiter(',')
      ->capture_default_str();
  app.add_option("--stages", o.stages, "Pipeline stages for the timed layers")->delimiter(',')->capture_default_str();
  app.add_option("--micro-batches", o.micro_batches, "Micro-batches per step (timed layers)")->delimiter(',')->capture_default_str();
  app.add_option("--schedules", o.schedules, "gpipe, 1f1b, interleaved, zb-h1")->delimiter(',')->capture_default_str();
  app.add_option("--virtual-stages", o.virtual_stages, "Chunks per rank of the interleaved schedule")
      ->capture_default_str()->check(CLI::Range(2, 8));
  app.add_option("--warmup", o.warmup, "Untimed steps first")->capture_default_str();
  app.add_option("--steps", o.steps, "Timed steps, timed layers (median reported)")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--forward-ms", o.forward_ms, "Timed layers: F per micro-batch per stage")->capture_default_str();
  app.add_option("--backward-ms", o.backward_ms, "Timed layers: B (GPipe, 1F1B, interleaved)")->capture_default_str();
  app.add_option("--input-ms", o.input_ms, "Timed layers: I, ZB-H1's input-gradient pass")->capture_default_str();
  app.add_option("--weight-ms", o.weight_ms, "Timed layers: W, ZB-H1's weight-gradient pass")->capture_default_str();
  app.add_option("--slow-stage", o.slow_stage, "The stage made slow in the slow-stage study")->capture_default_str();
  app.add_option("--slow-factor", o.slow_factor, "How many times slower it is")->capture_default_str();
  app.add_option("--slow-micro-batches", o.slow_micro_batches, "m of the slow-stage study (0 = skip it)")
      ->capture_default_str();
  app.add_option("--gpt2-stages", o.gpt2_stages, "Pipeline stages of the GPT-2 mode (one core each)")
      ->capture_default_str();
  app.add_option("--gpt2-micro-batches", o.gpt2_micro_batches, "Micro-batches per step, GPT-2 mode")->delimiter(',')
      ->capture_default_str();
  app.add_option("--gpt2-steps", o.gpt2_steps, "Timed steps, GPT-2 mode")->capture_default_str()
      ->check(CLI::PositiveNumber);
  app.add_option("--gpt2-layers", o.gpt2_layers, "GPT-2 blocks")->capture_default_str();
  app.add_option("--gpt2-channels", o.gpt2_channels, "GPT-2 hidden size")->capture_default_str();
  app.add_option("--gpt2-heads", o.gpt2_heads, "GPT-2 attention heads")->capture_default_str();
  app.add_option("--gpt2-vocab", o.gpt2_vocab, "GPT-2 vocabulary (padded to a multiple of 128)")
      ->capture_default_str();
  app.add_option("--seq", o.seq, "Tokens per sequence (one sequence per micro-batch), GPT-2 mode")
      ->capture_default_str();
  app.add_flag("--quick", o.quick, "A few seconds in all: the smoke test");
  app.add_option("--json", o.json, "Write every row as JSON here");
  CLI11_PARSE(app, argc, argv);
  if (o.quick) {
    o.stages = {2};
    o.micro_batches = {2, 4};
    o.warmup = 0;
    o.steps = 1;
    o.forward_ms = 0.5, o.backward_ms = 1, o.input_ms = 0.5, o.weight_ms = 0.5;
    o.slow_micro_batches = 4;
    o.gpt2_steps = 1;
    o.gpt2_micro_batches = {2};
    o.gpt2_layers = 2, o.gpt2_channels = 64, o.gpt2_heads = 4, o.gpt2_vocab = 256, o.seq = 16;
  }

  const double load = loom::bench::load_average();
  try {
    std::printf("loom_pipeline_bench: thread ranks, 1 CPU thread each; medians over steps, %d warm-up step(s)\n%s\n",
                o.warmup, loom::bench::machine_line(1).c_str());
    std::printf("load average before the run: %.2f\n", load);
    if (const std::string w = loom::bench::load_warning(load); !w.empty()) std::printf("%s\n", w.c_str());
    std::printf("wait = pipeline_wait_seconds / seconds (mean over ranks); idle = 1 - sum of the ranks' compute / "
                "(p x span from the step's start to the last pass's end), as the simulator defines it; rest = step - "
                "span (optimizer, all-reduces); medians over steps\ntheory = (p-1)/(m+p-1) for GPipe and 1F1B, "
                "(p-1)/(v*m+p-1) interleaved, the schedule simulator for ZB-H1\n");
    std::vector<Row> rows;
    const auto wants = [&](const std::string& mode) {
      return std::find(o.modes.begin(), o.modes.end(), mode) != o.modes.end();
    };

    if (wants("timed")) {
      std::printf("\n== timed layers (sleep): F = %.2f ms, B = %.2f ms (ZB-H1: I = %.2f ms, W = %.2f ms) per "
                  "micro-batch per stage; %d timed steps ==\n",
                  o.forward_ms, o.backward_ms, o.input_ms, o.weight_ms, o.steps);
      print_header(false);
      // The schedules take turns at each m, so a change in the machine's load hits them alike.
      for (int p : o.stages)
        for (std::int64_t m : o.micro_batches)
          for (const std::string& name : o.schedules) {
            if (!runs(name, p, m)) continue;
            with_schedule(name, o.virtual_stages, [&](auto schedule) {
              rows.push_back(measure_timed(o, p, m, schedule, name, -1, 1.0));
              print_row(rows.back(), false);
            });
          }

      if (o.slow_micro_batches > 0 && o.slow_factor != 1.0) {
        const std::int64_t m = o.slow_micro_batches;
        std::printf("\n== timed layers, one slow stage: stage %d sleeps %.1fx as long; m = %lld ==\n", o.slow_stage,
                    o.slow_factor, static_cast<long long>(m));
        std::printf("%3s  %-16s | %9s %9s %7s | %9s %7s | %s\n", "p", "schedule", "even mb/s", "slow mb/s", "slow/even",
                    "bound", "of bound", "slow rank busy");
        for (int p : o.stages) {
          if (o.slow_stage < 0 || o.slow_stage >= p) continue;
          for (const std::string& name : o.schedules) {
            if (!runs(name, p, m)) continue;
            with_schedule(name, o.virtual_stages, [&](auto schedule) {
              // Even and slow back to back, so the ratio comes from the same conditions.
              Row even = measure_timed(o, p, m, schedule, name, -1, 1.0);
              Row slow = measure_timed(o, p, m, schedule, name, o.slow_stage, o.slow_factor);
              // The slow stage alone needs m·k·(F+B) per step: no schedule can beat that.
              const double stage_seconds = 1e-3 * (o.forward_ms + (name == "zb-h1" ? o.input_ms + o.weight_ms
                                                                                  : o.backward_ms));
              const double bound = 1.0 / (o.slow_factor * stage_seconds);
              const double even_rate = static_cast<double>(m) / even.step_seconds.median;
              const double slow_rate = static_cast<double>(m) / slow.step_seconds.median;
              // The slow rank's busy fraction: its compute over the step.
              const double slow_busy = slow.stage_ms[static_cast<std::size_t>(o.slow_stage)] * 1e-3 * static_cast<double>(m) /
                          slow.step_seconds.median;
              std::printf("%3d  %-16s | %9.1f %9.1f %7.2f | %9.1f %6.0f%% | %.2f\n", p,
                          display_name(name, slow.virtual_stages).c_str(), even_rate, slow_rate, slow_rate / even_rate,
                          bound, 100.0 * slow_rate / bound, slow_busy);
              rows.push_back(even);
              rows.push_back(slow);
            });
          }
        }
        std::printf("bound = 1 / (k·(F+B)): micro-batches/s if the slow stage never waited\n");
      }
    }

    if (wants("gpt2")) {
      const loom::gpt2::Config config = gpt2_config(o);
      const int p = o.gpt2_stages;
      std::printf("\n== GPT-2 (real compute): %lld blocks, %lld channels, %lld heads, vocabulary %lld (padded %lld), "
                  "%lld parameters; p = %d ranks x 1 thread; micro-batch = 1 sequence of %lld tokens; %d timed steps "
                  "==\n",
                  static_cast<long long>(config.num_layers), static_cast<long long>(config.channels),
                  static_cast<long long>(config.num_heads), static_cast<long long>(config.vocab_size),
                  static_cast<long long>(config.padded_vocab_size), static_cast<long long>(config.parameter_count()), p,
                  static_cast<long long>(o.seq), o.gpt2_steps);
      if (p > static_cast<int>(std::thread::hardware_concurrency()))
        std::printf("note: %d ranks on %u hardware threads: ranks share cores, so waits and compute overlap\n", p,
                    std::thread::hardware_concurrency());
      print_header(true);
      for (std::int64_t m : o.gpt2_micro_batches)
        for (const std::string& name : o.schedules) {
          if (!runs(name, p, m)) continue;
          with_schedule(name, o.virtual_stages, [&](auto schedule) {
            rows.push_back(measure_gpt2(o, p, m, schedule, name));
            print_row(rows.back(), true);
          });
        }
      std::printf("compute per micro-batch per rank (ms, forward + backward, median over steps), at the largest m:\n");
      for (const std::string& name : o.schedules)
        for (auto it = rows.rbegin(); it != rows.rend(); ++it)
          if (it->mode == "gpt2" && it->schedule == name) {
            std::printf("  %-16s", display_name(name, it->virtual_stages).c_str());
            for (std::size_t r = 0; r < it->stage_ms.size(); ++r) std::printf("  rank %zu %.2f", r, it->stage_ms[r]);
            std::printf("   (F %.2f, B %.2f, I %.2f, W %.2f ms per stage)\n", 1e3 * it->measured_costs.forward,
                        1e3 * it->measured_costs.backward, 1e3 * it->measured_costs.backward_input,
                        1e3 * it->measured_costs.backward_weight);
            break;
          }
    }

    nlohmann::json report;
    report["benchmark"] = "loom_pipeline_bench";
    report["date"] = loom::bench::utc_now();
    report["machine"] = loom::bench::machine_json(1, load);
    report["timed_layers_ms"] = {{"forward", o.forward_ms}, {"backward", o.backward_ms}, {"backward_input", o.input_ms},
                                 {"backward_weight", o.weight_ms}};
    for (const Row& r : rows) report["rows"].push_back(to_json(r));
    loom::bench::write_json(o.json, report);
  } catch (const loom::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  return 0;
}
