// Adafactor: its kernels against plain loops (whole tensors and tensor-parallel slices, one and
// two threads), its steps on one rank against a host reference of the paper's formulas in
// double, and every layout (DDP, ZeRO-1/2/3, DP x TP meshes, pipelines) against one rank.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/io/training_state.hpp"
#include "loom/loom.hpp"
#include "support/parity.hpp"
#include "support/pipeline_parity.hpp"
#include "support/temp_path.hpp"
#include "support/training.hpp"
#include "support/weight_runs.hpp"

namespace test_adafactor {

using namespace loom;
using namespace loom::test;

namespace {

//! Deterministic values in about [-1, 1].
std::vector<double> values(std::int64_t n, std::uint64_t seed) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[static_cast<std::size_t>(i)] = std::sin(0.37 * static_cast<double>(i) + static_cast<double>(seed)) *
                                     (1.0 + 0.5 * std::cos(0.011 * static_cast<double>(i * static_cast<std::int64_t>(seed))));
  return v;
}

template <class T>
std::vector<T> as(const std::vector<double>& v) {
  std::vector<T> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = static_cast<T>(v[i]);
  return out;
}

//! A slice of a [rows, cols] parameter for tensor-parallel rank `rank` of `ranks`.
ParameterSpec slice(Partition partition, std::int64_t rows, std::int64_t cols, std::int64_t groups, std::int64_t ranks,
                    std::int64_t rank) {
  ParameterSpec whole{.name = "w", .shape = Shape{rows, cols}, .partition = partition};
  whole.shard.groups = groups;
  return tensor_parallel_slice(whole, ranks, rank);
}

struct SliceCase {
  const char* name;
  ParameterSpec spec;
};

std::vector<SliceCase> slice_cases() {
  return {{"whole matrix", slice(Partition::replicated, 37, 29, 1, 1, 0)},
          {"split rows, 3 groups, rank 1 of 2", slice(Partition::split_rows, 3 * 24, 13, 3, 2, 1)},
          {"split cols, rank 2 of 4", slice(Partition::split_cols, 19, 4 * 9, 1, 4, 2)},
          {"vector", ParameterSpec{.name = "b", .shape = Shape{1001}}}};
}

}  // namespace

TEST_CASE("whole_index places every element of a slice where ParameterSpec::global_index does") {
  for (const SliceCase& c : slice_cases()) {
    CAPTURE(c.name);
    const std::int64_t n = c.spec.shape.numel();
    for (std::int64_t first : {std::int64_t{0}, std::int64_t{5}, n / 3}) {
      const WholeIndex w = whole_index(c.spec, first);
      std::int64_t run_end = 0;
      for (std::int64_t i = 0; first + i < n; ++i) {
        CHECK(w.flat(i) == c.spec.global_index(first + i));
        // consecutive(): the stretch it names lies at consecutive whole indices.
        if (i >= run_end) {
          const std::int64_t k = std::min(w.consecutive(i), n - first - i);
          REQUIRE(k >= 1);
          run_end = i + k;
        } else {
          CHECK(w.flat(i) == w.flat(i - 1) + 1);
        }
      }
    }
  }
}

TEST_CASE_TEMPLATE("Adafactor kernels: row and column sums, the update's norm and the update against plain loops", T,
                   float, double, bf16) {
  using A = accumulate_t<T>;
  for (int threads : {1, 2})
    for (const SliceCase& c : slice_cases()) {
      CAPTURE(threads);
      CAPTURE(c.name);
      cpu be(threads);
      const MatrixView v = matrix_view(c.spec.whole_shape());
      // A run from an odd offset to the end, long enough for both threads to take part.
      const std::int64_t local = c.spec.shape.numel(), first = 7, n = local - first;
      const std::vector<T> g = as<T>(values(n, 3));
      const WholeIndex w = whole_index(c.spec, first);

      std::vector<double> rows(static_cast<std::size_t>(v.rows), 0.5), cols(static_cast<std::size_t>(v.cols), 0.25);
      std::vector<double> want_rows = rows, want_cols = cols;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t at = c.spec.global_index(first + i);
        const double x = static_cast<double>(to_accumulate(g[static_cast<std::size_t>(i)]));
        want_rows[static_cast<std::size_t>(at / v.cols)] += x * x;
        want_cols[static_cast<std::size_t>(at % v.cols)] += x * x;
      }
      adafactor_square_sums<T>(be, Tensor<const T>(g.data(), Shape{n}), w, v.rows, rows.data(), cols.data());
      for (std::size_t k = 0; k < rows.size(); ++k) CHECK(rows[k] == doctest::Approx(want_rows[k]).epsilon(1e-12));
      for (std::size_t k = 0; k < cols.size(); ++k) CHECK(cols[k] == doctest::Approx(want_cols[k]).epsilon(1e-12));

      const std::vector<A> row_scale = as<A>(values(v.rows, 5)), col_scale = as<A>(values(v.cols, 6));
      double want_norm = 0;
      std::vector<A> p = as<A>(values(n, 8)), want_p = p;
      const AdafactorUpdate h{.decay = 0.999, .step = 0.01};
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t at = c.spec.global_index(first + i);
        const A u = to_accumulate(g[static_cast<std::size_t>(i)]) * row_scale[static_cast<std::size_t>(at / v.cols)] *
                    col_scale[static_cast<std::size_t>(at % v.cols)];
        want_norm += static_cast<double>(u) * static_cast<double>(u);
        auto& q = want_p[static_cast<std::size_t>(i)];
        q = q * static_cast<A>(h.decay) - static_cast<A>(h.step) * u;
      }
      CHECK(adafactor_update_square_sum<T, A>(be, Tensor<const T>(g.data(), Shape{n}), w, row_scale.data(),
                                               col_scale.data()) == doctest::Approx(want_norm).epsilon(1e-12));
      if constexpr (is_narrow_storage<T>) {
        std::vector<T> rounded(static_cast<std::size_t>(n));
        adafactor_update<T>(be, Tensor<T>(rounded.data(), Shape{n}), Tensor<const T>(g.data(), Shape{n}),
                            Tensor<A>(p.data(), Shape{n}), w, row_scale.data(), col_scale.data(), h);
        for (std::int64_t i = 0; i < n; ++i) {
          const auto k = static_cast<std::size_t>(i);
          CHECK(p[k] == want_p[k]);
          CHECK(rounded[k] == static_cast<T>(want_p[k]));
        }
      } else {
        adafactor_update<T>(be, Tensor<T>(p.data(), Shape{n}), Tensor<const T>(g.data(), Shape{n}), w,
                            row_scale.data(), col_scale.data(), h);
        CHECK(p == want_p);
      }
    }
}

namespace {

//! The paper's Adafactor on the host in double, a tensor at a time, for the one-rank check.
struct ReferenceAdafactor {
  Adafactor::Options o;
  std::vector<std::vector<double>> r, c;  // per parameter: R and C (a vector: V in R)

  void step(const ParameterLayout& layout, std::vector<double>& params, const std::vector<double>& grads, double lr,
            std::int64_t t) {
    const auto& entries = layout.entries();
    if (r.empty()) {
      r.resize(entries.size());
      c.resize(entries.size());
    }
    const double beta2 = 1.0 - std::pow(static_cast<double>(t), -o.decay_rate);
    const double rho = o.relative_step ? std::min(lr, 1.0 / std::sqrt(static_cast<double>(t))) : lr;
    for (std::size_t p = 0; p < entries.size(); ++p) {
      const auto& e = entries[p];
      const MatrixView v = matrix_view(e.spec.shape);
      const double* g = grads.data() + e.offset;
      double* x = params.data() + e.offset;
      const std::int64_t n = e.numel();
      auto& R = r[p];
      auto& C = c[p];
      R.resize(static_cast<std::size_t>(v.rows), 0.0);
      C.resize(static_cast<std::size_t>(v.cols), 0.0);
      std::vector<double> rowsum(R.size(), 0.0), colsum(C.size(), 0.0);
      for (std::int64_t i = 0; i < n; ++i) {
        rowsum[static_cast<std::size_t>(i / v.cols)] += g[i] * g[i] + o.eps1;
        colsum[static_cast<std::size_t>(i % v.cols)] += g[i] * g[i] + o.eps1;
      }
      for (std::size_t i = 0; i < R.size(); ++i) R[i] = beta2 * R[i] + (1 - beta2) * rowsum[i];
      for (std::size_t j = 0; j < C.size(); ++j) C[j] = beta2 * C[j] + (1 - beta2) * colsum[j];
      double total = 0;
      for (double x_r : R) total += x_r;
      std::vector<double> u(static_cast<std::size_t>(n));
      double u2 = 0, p2 = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const double vhat = v.matrix ? R[static_cast<std::size_t>(i / v.cols)] * C[static_cast<std::size_t>(i % v.cols)] / total
                                     : R[static_cast<std::size_t>(i)];
        u[static_cast<std::size_t>(i)] = g[i] / std::sqrt(vhat);
        u2 += u[static_cast<std::size_t>(i)] * u[static_cast<std::size_t>(i)];
        p2 += x[i] * x[i];
      }
      const double clip = std::max(1.0, std::sqrt(u2 / static_cast<double>(n)) / o.clip_threshold);
      const double size = o.scale_parameter ? std::max(o.eps2, std::sqrt(p2 / static_cast<double>(n))) * rho : rho;
      const double decay = 1.0 - (e.spec.weight_decay ? rho * o.weight_decay : 0.0);
      for (std::int64_t i = 0; i < n; ++i) x[i] = x[i] * decay - size / clip * u[static_cast<std::size_t>(i)];
    }
  }
};

}  // namespace

TEST_CASE("Adafactor on one rank steps GPT-2 as the paper's formulas do, in double") {
  using Gpt = gpt2::Model<cpu, double>;
  const std::vector<Adafactor::Options> cases{
      {},
      {.clip_threshold = 0.05, .weight_decay = 0.1},
      {.weight_decay = 0.1, .relative_step = false, .scale_parameter = false},
      {.decay_rate = 0.5, .eps2 = 0.05, .relative_step = true, .scale_parameter = true}};
  for (const Adafactor::Options& o : cases) {
    CAPTURE(o);
    cpu be(2);
    const WarmupCosineLr lr{.lr = 1e-2, .warmup = 1, .total_steps = 4, .min_lr_factor = 0.1};
    Trainer<Gpt, Adafactor> trainer(be, Gpt(small_test_config()), Adafactor(o), lr,
                                    {.micro_batch_size = 2, .clip_grad_norm = 0.5, .seed = 5});
    const ParameterLayout& layout = trainer.model().layout();
    const auto n = static_cast<std::size_t>(layout.total());
    ReferenceAdafactor reference{.o = o, .r = {}, .c = {}};
    std::vector<double> want(trainer.parameters(), trainer.parameters() + n);
    for (int s = 0; s < 4; ++s) {
      CAPTURE(s);
      const StepMetrics m = trainer.step(make_batch(s, 4, 16, small_test_config().vocab_size));
      // The gradients the step used (after clipping), the reference's step from them.
      const std::vector<double> grads(trainer.gradients(), trainer.gradients() + n);
      reference.step(layout, want, grads, m.lr, s + 1);
      double diff = 0, norm = 0;
      for (std::size_t i = 0; i < n; ++i) {
        diff += (trainer.parameters()[i] - want[i]) * (trainer.parameters()[i] - want[i]);
        norm += want[i] * want[i];
      }
      CHECK(std::sqrt(diff / norm) <= 1e-12);
      // Continue both from the trainer's weights, so that each step is checked on its own.
      want.assign(trainer.parameters(), trainer.parameters() + n);
    }
  }
}

TEST_CASE("Adafactor refuses options outside their ranges, naming the value") {
  CHECK_THROWS_WITH_AS(Adafactor({.decay_rate = 0.0}), doctest::Contains("decay_rate"), Error);
  CHECK_THROWS_WITH_AS(Adafactor({.eps1 = 0.0}), doctest::Contains("eps1"), Error);
  CHECK_THROWS_WITH_AS(Adafactor({.clip_threshold = -1.0}), doctest::Contains("clip_threshold"), Error);
  CHECK_THROWS_WITH_AS(Adafactor({.weight_decay = -0.1}), doctest::Contains("weight_decay"), Error);
}

namespace {

using Gpt = gpt2::Model<cpu, float>;
constexpr std::int64_t global_batch = 8, seq = 16;
// eps1 = 1e-12, not the paper's 1e-30, so that the key bias's rounding-noise gradient is not
// normalized into +-1 updates (see the test on the paper's eps1 below).
const Adafactor::Options parity_options{.eps1 = 1e-12, .weight_decay = 0.1};

gpt2::Config mesh_config() {
  gpt2::Config c = small_test_config();
  c.num_heads = 4;
  return c;
}

ParityRun one_rank(const gpt2::Config& config, double clip, std::int64_t batch = global_batch) {
  cpu be(1);
  Trainer<Gpt, Adafactor> trainer(be, Gpt(config), Adafactor(parity_options), parity_lr(),
                                  {.micro_batch_size = 1, .clip_grad_norm = clip, .seed = 5});
  return train_steps(trainer, batch, seq);
}

//! Every rank of `shape` trains with strategy `St` under schedule `S`; returns the failures
//! against `reference`, one line per failing rank (each rank's tensor-parallel slice against the one-rank weights).
template <class S, class St>
std::string mesh_failures(MeshShape shape, const gpt2::Config& config, double clip, St strategy,
                                       const ParityRun& reference, std::int64_t batch = global_batch) {
  const Gpt global_model(config);
  std::mutex mutex;
  std::vector<std::string> failures;
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<Gpt, Adafactor, S, St> trainer(be, mesh, Gpt(config, mesh.tensor_parallel()), Adafactor(parity_options),
                                           parity_lr(), {.micro_batch_size = 1, .clip_grad_norm = clip, .seed = 5},
                                           strategy);
    const ParityRun run = train_steps(trainer, batch, seq);
    const std::string failure = parity_failures(trainer, run, reference, global_model.layout());
    if (!failure.empty()) {
      std::lock_guard lock(mutex);
      failures.push_back("rank " + std::to_string(world.rank()) + ":" + failure);
    }
  });
  std::string report;
  for (const std::string& f : failures) report += "\n  " + f;
  return report;
}

}  // namespace

TEST_CASE("Adafactor: DDP and ZeRO 1, 2, 3 on 2 and 3 ranks train as one rank") {
  for (double clip : {0.0, 0.05}) {
    CAPTURE(clip);
    const ParityRun reference = one_rank(small_test_config(), clip, 12);
    for (int ranks : {2, 3}) {
      CAPTURE(ranks);
      const MeshShape shape{.dp = ranks, .tp = 1, .pp = 1};
      CHECK(mesh_failures<GradientAccumulation>(shape, small_test_config(), clip, DataParallel{.bucket_bytes = 4096},
                                                reference, 12) == "");
      CHECK(mesh_failures<GradientAccumulation>(shape, small_test_config(), clip, Zero<1>{.bucket_bytes = 2048},
                                                reference, 12) == "");
      CHECK(mesh_failures<GradientAccumulation>(shape, small_test_config(), clip, Zero<2>{.bucket_bytes = 2048},
                                                reference, 12) == "");
      CHECK(mesh_failures<GradientAccumulation>(shape, small_test_config(), clip, Zero<3>{}, reference, 12) == "");
    }
  }
}

TEST_CASE("Adafactor: DP x TP meshes (slices of factored matrices) train as one rank") {
  const ParityRun reference = one_rank(mesh_config(), 0.05);
  for (const MeshShape shape : {MeshShape{.dp = 1, .tp = 2, .pp = 1}, MeshShape{.dp = 1, .tp = 4, .pp = 1},
                                MeshShape{.dp = 2, .tp = 2, .pp = 1}}) {
    CAPTURE(shape);
    CHECK(mesh_failures<GradientAccumulation>(shape, mesh_config(), 0.05, DataParallel{.bucket_bytes = 4096},
                                              reference) == "");
    CHECK(mesh_failures<GradientAccumulation>(shape, mesh_config(), 0.05, Zero<2>{.bucket_bytes = 2048}, reference) == "");
  }
  CHECK(mesh_failures<GradientAccumulation>(MeshShape{.dp = 2, .tp = 2, .pp = 1}, mesh_config(), 0.05, Zero<3>{},
                                            reference) == "");
}

TEST_CASE("Adafactor: pipelines (the tied embedding on two stages) train as one rank") {
  const ParityRun reference = one_rank(pipeline_config(), 0.05, pipeline_global_batch);
  for (const MeshShape shape : {MeshShape{.dp = 1, .tp = 1, .pp = 2}, MeshShape{.dp = 2, .tp = 1, .pp = 2},
                                MeshShape{.dp = 1, .tp = 2, .pp = 2}}) {
    CAPTURE(shape);
    CHECK(mesh_failures<OneFOneB>(shape, pipeline_config(), 0.05, DataParallel{.bucket_bytes = 4096}, reference,
                                  pipeline_global_batch) == "");
    CHECK(mesh_failures<ZeroBubbleH1>(shape, pipeline_config(), 0.05, Zero<1>{.bucket_bytes = 2048}, reference,
                                      pipeline_global_batch) == "");
  }
}

TEST_CASE("Adafactor keeps no state per parameter: a few numbers per row and column") {
  cpu be(1);
  const gpt2::Config config = small_test_config();
  Trainer<Gpt, Adafactor> adafactor(be, Gpt(config), Adafactor(), ConstantLr{});
  std::size_t moments = 0;
  for (const auto& e : adafactor.model().layout().entries()) {
    const MatrixView v = matrix_view(e.spec.shape);
    moments += static_cast<std::size_t>(v.rows + v.cols);
  }
  // Moments and the sums being reduced in double, the scales in float.
  CHECK(be.memory().current(MemoryCategory::optimizer_state) == moments * (8 + 8 + 4));
  // GPT-2 small (124M): 321,762 moments, 0.26% of a number per parameter, against AdamW's two.
  const Gpt small(gpt2::small());
  std::int64_t small_moments = 0;
  for (const auto& e : small.layout().entries()) {
    const MatrixView v = matrix_view(e.spec.shape);
    small_moments += v.rows + v.cols;
  }
  MESSAGE("GPT-2 small: ", small_moments, " moments for ", small.layout().total(), " parameters");
  CHECK(small_moments * 300 < small.layout().total());
}
TEST_CASE("Adafactor with the paper's eps1: only the qkv bias, whose key part's gradient is rounding noise, differs across layouts") {
  // Softmax ignores a shift shared by every key, so the key bias's gradient is zero in exact
  // arithmetic and rounding noise in float; eps1 = 1e-30 divides it by its own size, making
  // +-1 updates whose signs follow each layout's summation order. The key bias changes no
  // output, so the losses still agree; it leaks into the query bias's gradient only as rounding
  // (the softmax gradient's sum is zero). Every other tensor agrees as closely as under AdamW.
  const Adafactor::Options o{.weight_decay = 0.1};
  const auto run = [&](auto& trainer) { return train_steps(trainer, 12, seq); };
  ParityRun reference, ddp;
  {
    cpu be(1);
    Trainer<Gpt, Adafactor> trainer(be, Gpt(small_test_config()), Adafactor(o), parity_lr(),
                                    {.micro_batch_size = 1, .seed = 5});
    reference = run(trainer);
  }
  threads::run(2, [&](threads::Communicator& world) {
    cpu be(1);
    Trainer<Gpt, Adafactor, GradientAccumulation, DataParallel> trainer(be, world, Gpt(small_test_config()), Adafactor(o),
                                                                        parity_lr(), {.micro_batch_size = 1, .seed = 5});
    const ParityRun mine = run(trainer);
    if (world.rank() == 0) ddp = mine;
  });
  for (std::size_t s = 0; s < reference.losses.size(); ++s)
    CHECK(ddp.losses[s] == doctest::Approx(reference.losses[s]).epsilon(1e-6));
  const Gpt model(small_test_config());
  double bias_difference = 0;
  for (const auto& e : model.layout().entries()) {
    CAPTURE(e.spec.name);
    double diff = 0, norm = 0;
    for (std::int64_t i = 0; i < e.numel(); ++i) {
      const double a = ddp.weights[static_cast<std::size_t>(e.offset + i)];
      const double b = reference.weights[static_cast<std::size_t>(e.offset + i)];
      diff += (a - b) * (a - b);
      norm += b * b;
    }
    if (e.spec.name.ends_with("attn.qkv.bias"))
      bias_difference = std::max(bias_difference, std::sqrt(diff / norm));
    else
      CHECK(std::sqrt(diff) <= 1e-5 * std::sqrt(norm));
  }
  MESSAGE("qkv bias: relative difference ", bias_difference);
}

namespace {

constexpr std::int64_t total_steps = 6, saved_at = 3;

//! A stretch of Adafactor training on `shape`: rank 0's losses and whole parameters (fp32,
//! whole_layout order) at its end, after loading `load` and before saving `save` (if given).
struct Leg {
  std::vector<double> losses;
  std::vector<float> weights;
};

template <class S, class St>
Leg adafactor_leg(MeshShape shape, std::int64_t first, std::int64_t last, const std::string& load,
                  const std::string& save, St strategy = {}) {
  Leg out;
  std::mutex mutex;
  threads::run(shape.size(), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    Trainer<Gpt, Adafactor, S, St> trainer(be, mesh, Gpt(mesh_config(), mesh.tensor_parallel()),
                                           Adafactor(parity_options), parity_lr(),
                                           {.micro_batch_size = 1, .clip_grad_norm = 0.05, .seed = 5}, strategy);
    if (!load.empty()) {
      const io::TrainingStateInfo info = io::load_training_state(trainer, load);
      CHECK(info.steps == first);
    }
    Leg leg;
    for (std::int64_t s = first; s < last; ++s)
      leg.losses.push_back(trainer.step(make_batch(s, pipeline_global_batch, seq, mesh_config().vocab_size)).loss);
    leg.weights = trainer.gather_state(0);
    if (!save.empty()) io::save_training_state(trainer, save);
    std::lock_guard lock(mutex);
    if (world.rank() == 0) out = leg;
  });
  return out;
}

constexpr MeshShape one{.dp = 1, .tp = 1, .pp = 1};


}  // namespace

TEST_CASE("Adafactor checkpoints keep the per-tensor moments: a resumed run is the uninterrupted one") {
  const Leg whole = adafactor_leg<GradientAccumulation, SingleRank>(one, 0, total_steps, "", "");
  TempPath file("adafactor_state");
  adafactor_leg<GradientAccumulation, SingleRank>(one, 0, saved_at, "", file.str());
  const io::TrainingStateInfo info = io::read_training_state_info(file.path);
  CHECK(info.optimizer == "Adafactor");
  CHECK(info.state_slots == 0);
  std::int64_t moments = 0;
  const Gpt model(mesh_config());
  for (const auto& e : model.layout().entries()) moments += Adafactor::State<cpu, float>::numbers(e.spec.shape);
  CHECK(info.tensor_elements == moments);

  SUBCASE("on one rank, bit for bit") {
    const Leg resumed = adafactor_leg<GradientAccumulation, SingleRank>(one, saved_at, total_steps, file.str(), "");
    CHECK(resumed.losses == std::vector<double>(whole.losses.begin() + saved_at, whole.losses.end()));
    CHECK(resumed.weights == whole.weights);
  }
  SUBCASE("on DP 2 x TP 2 under ZeRO-3 and on TP 2 x PP 2 under 1F1B") {
    for (const Leg& resumed :
         {adafactor_leg<GradientAccumulation, Zero<3>>({.dp = 2, .tp = 2, .pp = 1}, saved_at, total_steps, file.str(), ""),
          adafactor_leg<OneFOneB, DataParallel>({.dp = 1, .tp = 2, .pp = 2}, saved_at, total_steps, file.str(), "")}) {
      const auto n = static_cast<std::int64_t>(whole.weights.size());
      REQUIRE(resumed.weights.size() == whole.weights.size());
      CHECK(relative_difference(resumed.weights.data(), whole.weights.data(), n) <= 1e-5);
    }
  }
  SUBCASE("saved on DP 2 x TP 2 x PP 2 (each stage writes its tensors once), resumed on one rank") {
    TempPath mesh_file("adafactor_state_mesh");
    adafactor_leg<OneFOneB, Zero<1>>({.dp = 2, .tp = 2, .pp = 2}, 0, saved_at, "", mesh_file.str());
    const Leg resumed = adafactor_leg<GradientAccumulation, SingleRank>(one, saved_at, total_steps, mesh_file.str(), "");
    const auto n = static_cast<std::int64_t>(whole.weights.size());
    CHECK(relative_difference(resumed.weights.data(), whole.weights.data(), n) <= 1e-5);
  }
  SUBCASE("a flipped byte in the moments is found before anything loads") {
    // The moments end where the trailer (3 checksums and the magic: 32 bytes) begins.
    flip_byte(file.path, std::filesystem::file_size(file.path) - 32 - 100);
    const auto resume = [&] { adafactor_leg<GradientAccumulation, SingleRank>(one, saved_at, total_steps, file.str(), ""); };
    CHECK_THROWS_WITH_AS(resume(), doctest::Contains("checksum of the per-tensor optimizer state"), Error);
  }
}

TEST_CASE("an AdamW checkpoint does not load into an Adafactor trainer") {
  TempPath file("adamw_state");
  {
    cpu be(1);
    Trainer<Gpt, AdamW> trainer(be, Gpt(mesh_config()), AdamW(), parity_lr());
    trainer.step(make_batch(0, 4, seq, mesh_config().vocab_size));
    io::save_training_state(trainer, file.path);
  }
  const auto resume = [&] { adafactor_leg<GradientAccumulation, SingleRank>(one, 1, 2, file.str(), ""); };
  CHECK_THROWS_WITH_AS(resume(), doctest::Contains("AdamW (2 state slots)"), Error);
}

namespace {

using Bf = gpt2::Model<cpu, bf16>;

//! bf16 GPT-2 trained with Adafactor on `ranks` thread ranks under strategy `St`; rank 0's run.
template <class St>
WeightRun bf16_run(int ranks, bool fp32_gradients, St strategy = {}) {
  WeightRun out;
  std::mutex mutex;
  threads::run(ranks, [&](threads::Communicator& world) {
    cpu be(1);
    Trainer<Bf, Adafactor, GradientAccumulation, St> trainer(
        be, world, Bf(small_test_config()), Adafactor(parity_options), parity_lr(),
        {.micro_batch_size = 1, .seed = 5, .fp32_gradients = fp32_gradients}, strategy);
    const WeightRun run = train_run(trainer, 12, seq);
    std::lock_guard lock(mutex);
    if (world.rank() == 0) out = run;
  });
  return out;
}

}  // namespace

TEST_CASE("Adafactor on bf16 models: fp32 master weights; DDP and ZeRO train as one rank, with and without fp32 gradients") {
  for (bool fp32_gradients : {false, true}) {
    CAPTURE(fp32_gradients);
    const WeightRun reference = bf16_run<SingleRank>(1, fp32_gradients);
    check_close(bf16_run<DataParallel>(2, fp32_gradients, {.bucket_bytes = 4096}), reference, 1e-3);
    check_close(bf16_run<Zero<1>>(2, fp32_gradients, {.bucket_bytes = 2048}), reference, 1e-3);
    check_close(bf16_run<Zero<2>>(3, fp32_gradients, {.bucket_bytes = 2048}), reference, 1e-3);
    check_close(bf16_run<Zero<3>>(2, fp32_gradients), reference, 1e-3);
    check_close(bf16_run<Zero<3>>(4, fp32_gradients, {.replicas = 2}), reference, 1e-3);
  }
  // And close to the float model's training: bf16 rounding, not a different optimizer.
  cpu be(1);
  Trainer<Gpt, Adafactor> fp(be, Gpt(small_test_config()), Adafactor(parity_options), parity_lr(),
                             {.micro_batch_size = 1, .seed = 5});
  check_close(bf16_run<SingleRank>(1, true), train_run(fp, 12, seq), 1e-2);
}

TEST_CASE("Adafactor on a bf16 model holds 4 bytes of fp32 master weights per parameter and its per-tensor state") {
  cpu be(1);
  Trainer<Bf, Adafactor> trainer(be, Bf(small_test_config()), Adafactor(), ConstantLr{});
  const auto psi = static_cast<std::size_t>(trainer.model().layout().total());
  CHECK(be.memory().current(MemoryCategory::optimizer_state) ==
        4 * psi + static_cast<std::size_t>(trainer.tensor_state_bytes()));
  CHECK(be.memory().current(MemoryCategory::parameters) == 2 * psi);
}

}  // namespace test_adafactor
