// fp32 gradients of bf16 models (TrainerOptions::fp32_gradients, Megatron-LM's
// accumulate_allreduce_grads_in_fp32): the kernels that move a micro-batch's bf16 gradient into
// the fp32 sums and step AdamW and SGD from fp32 gradients; many micro-batches add up closer to
// fp32 training's gradient than in bf16, and closer still where the layers add their gradients
// to the fp32 sums themselves (TrainerOptions::fp32_gradient_fusion, on by default, so every
// layout below runs it; GPT-2 and BERT fuse every gradient, and a model that fuses some layers
// only is drained for the rest); DDP, ZeRO 1/2/3 and DP x PP pipelines (the tied embedding's
// gradient exchanged in fp32) train as one rank; the memory it costs, and saves where nothing
// is left to drain (no bf16 gradient buffer).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/io/masked_lm.hpp"
#include "loom/loom.hpp"
#include "support/masked_lm_training.hpp"
#include "support/parity_check.hpp"
#include "support/training.hpp"
#include "support/weight_runs.hpp"

namespace test_fp32_gradients {

using namespace loom;
using namespace loom::test;

namespace {

using Bf = gpt2::Model<cpu, bf16>;
using Fp = gpt2::Model<cpu, float>;
using BertBf = bert::Model<cpu, bf16>;
constexpr std::int64_t seq = 16;

using Run = WeightRun;

//! GPT-2 that fuses its blocks' gradients only: the embedding and the head get no fp32 sums and
//! write bf16 gradients, which the engines drain (a model that fuses some layers).
struct BlocksFused : Bf {
  using Bf::Bf;
  bool fuses(int layer) const noexcept { return layer > 0 && layer + 1 < num_layers(); }
  std::vector<ElementRange> fp32_gradient_parameters(int layer) const {
    return fuses(layer) ? Bf::fp32_gradient_parameters(layer) : std::vector<ElementRange>{};
  }
  BackwardArgs<bf16> args(int layer, const BackwardArgs<bf16>& a) const {
    BackwardArgs<bf16> out = a;
    if (!fuses(layer)) out.fp32_grads = {};
    return out;
  }
  void backward(cpu& be, int layer, ParameterView<const bf16> p, ParameterView<bf16> g,
                const BackwardArgs<bf16>& a) const {
    Bf::backward(be, layer, p, g, args(layer, a));
  }
  void backward_input(cpu& be, int layer, ParameterView<const bf16> p, ParameterView<bf16> g,
                      const BackwardArgs<bf16>& a, Tensor<bf16> stash) const {
    Bf::backward_input(be, layer, p, g, args(layer, a), stash);
  }
  void backward_weight(cpu& be, int layer, ParameterView<const bf16> p, ParameterView<bf16> g,
                       const BackwardArgs<bf16>& a, Tensor<bf16> stash) const {
    Bf::backward_weight(be, layer, p, g, args(layer, a), stash);
  }
};

TrainerOptions options(std::int64_t micro_batch, bool fp32_gradients, bool fusion = true) {
  return {.micro_batch_size = micro_batch, .seed = 5, .fp32_gradients = fp32_gradients, .fp32_gradient_fusion = fusion};
}

//! The config of a model of type M (GPT-2's or BERT's) for these tests, the model, and batch
//! `step` of `global_batch` sequences of its task.
template <class M>
auto test_config() {
  if constexpr (requires { M(small_test_config()); })
    return small_test_config();
  else
    return bert_test_config();
}
template <class M>
M test_model() {
  return M(test_config<M>());
}
template <class M>
auto test_batch(std::int64_t global_batch, int step = 0) {
  if constexpr (requires { M(small_test_config()); })
    return make_batch(step, global_batch, seq, small_test_config().vocab_size);
  else
    return masked_test_source().batch_at(step, global_batch, seq);
}

//! The losses of parity_steps steps and the whole model's fp32 master weights (gather_state(0),
//! in one rank's layout): the bf16 parameters would hide differences under their rounding, or
//! magnify one that moves a master weight across a rounding boundary (a layernorm weight near 1
//! by 2^-7).
template <class Tr>
Run train(Tr& trainer, std::int64_t global_batch) {
  Run run;
  for (int s = 0; s < parity_steps; ++s)
    run.losses.push_back(trainer.step(test_batch<typename Tr::model_type>(global_batch, s)).loss);
  run.weights = trainer.gather_state(0);
  return run;
}

//! The flat gradient of one step on one rank, widened to double: `global_batch` sequences in
//! micro-batches of one.
template <class M>
std::vector<double> one_step_gradient(std::int64_t global_batch, bool fp32_gradients, bool fusion = true) {
  cpu be(1);
  Trainer<M, AdamW> trainer(be, test_model<M>(), AdamW(), ConstantLr{.lr = 0.0}, options(1, fp32_gradients, fusion));
  trainer.step(test_batch<M>(global_batch));
  const auto n = static_cast<std::size_t>(trainer.model().layout().total());
  std::vector<double> g(n);
  if constexpr (is_narrow_storage<typename M::scalar_type>) {
    if (fp32_gradients) {
      REQUIRE(trainer.fp32_gradients() != nullptr);
      for (std::size_t i = 0; i < n; ++i) g[i] = trainer.fp32_gradients()[i];
      return g;
    }
    CHECK(trainer.fp32_gradients() == nullptr);
  }
  for (std::size_t i = 0; i < n; ++i) g[i] = static_cast<double>(static_cast<float>(trainer.gradients()[i]));
  return g;
}

double relative_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, norm = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff / norm);
}

}  // namespace

TEST_CASE("drain_into: sum += part widened, part = 0") {
  cpu be(1);
  std::vector<bf16> part = {bf16(1.5f), bf16(-0.25f), bf16(3.0f)};
  std::vector<float> sum = {1e-3f, 2.0f, -3.0f};
  drain_into<bf16>(be, Tensor<float>(sum.data(), Shape{3}), Tensor<bf16>(part.data(), Shape{3}));
  CHECK(sum == std::vector<float>{1.5f + 1e-3f, 1.75f, 0.0f});
  for (const bf16 p : part) CHECK(static_cast<float>(p) == 0.0f);
  CHECK_THROWS_AS(drain_into<bf16>(be, Tensor<float>(sum.data(), Shape{2}), Tensor<bf16>(part.data(), Shape{3})),
                  Error);
}

TEST_CASE("subtract_ranges: what a layer drains is what it reads less what it fuses") {
  const std::vector<ElementRange> reads = {{0, 10}, {20, 30}};
  CHECK(subtract_ranges(reads, {}) == reads);
  CHECK(subtract_ranges(reads, {{0, 10}, {20, 30}}).empty());
  // Cuts out of order, inside, across both ends and between the ranges.
  CHECK(subtract_ranges(reads, {{25, 27}, {2, 4}, {8, 22}}) ==
        std::vector<ElementRange>{{0, 2}, {4, 8}, {22, 25}, {27, 30}});
  CHECK(subtract_ranges(reads, {{10, 20}}) == reads);
  CHECK(subtract_ranges(reads, {{-5, 3}, {29, 40}}) == std::vector<ElementRange>{{3, 10}, {20, 29}});
}

TEST_CASE("AdamW and SGD step bf16 parameters from fp32 gradients as from the same values in bf16") {
  // Gradients that bf16 holds exactly: the fp32 overloads must give the bits of the bf16 ones.
  cpu be(1);
  constexpr std::int64_t n = 37;
  std::vector<bf16> params(n), grads(n);
  std::vector<float> wide(n), master(n);
  for (std::int64_t i = 0; i < n; ++i) {
    master[static_cast<std::size_t>(i)] = 0.01f * static_cast<float>(i - 18);
    params[static_cast<std::size_t>(i)] = bf16(master[static_cast<std::size_t>(i)]);
    grads[static_cast<std::size_t>(i)] = bf16(0.003f * static_cast<float>((i * 7) % 11) - 0.015f);
    wide[static_cast<std::size_t>(i)] = static_cast<float>(grads[static_cast<std::size_t>(i)]);
  }
  const auto t = [](auto& v) { return Tensor<std::remove_reference_t<decltype(v[0])>>(v.data(), Shape{n}); };
  const auto c = [](const auto& v) { return Tensor<const std::remove_cvref_t<decltype(v[0])>>(v.data(), Shape{n}); };
  {
    std::vector<bf16> p1 = params, p2 = params;
    std::vector<float> master1 = master, master2 = master, m1(n), v1(n), m2(n), v2(n);
    const AdamWUpdate h{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = 3};
    adamw_update<bf16>(be, t(p1), c(grads), t(master1), t(m1), t(v1), h);
    adamw_update<bf16>(be, t(p2), c(wide), t(master2), t(m2), t(v2), h);
    CHECK(master2 == master1);
    CHECK(m2 == m1);
    CHECK(v2 == v1);
    for (std::int64_t i = 0; i < n; ++i) CHECK(p2[static_cast<std::size_t>(i)] == p1[static_cast<std::size_t>(i)]);
    CHECK(master1 != master);
  }
  {
    std::vector<bf16> p1 = params, p2 = params;
    std::vector<float> master1 = master, master2 = master, b1(n), b2(n);
    const SgdUpdate h{.lr = 1e-2, .momentum = 0.9, .weight_decay = 0.1, .nesterov = true};
    sgd_momentum_update<bf16>(be, t(p1), c(grads), t(master1), t(b1), h);
    sgd_momentum_update<bf16>(be, t(p2), c(wide), t(master2), t(b2), h);
    CHECK(master2 == master1);
    CHECK(b2 == b1);
    CHECK(master1 != master);
  }
}

TEST_CASE("fp32 gradients: 32 micro-batches add up closer to fp32 training's gradient than in bf16") {
  // Each micro-batch's bf16 gradient is the same either way; what differs is the sum. Added in
  // bf16, the running sum of 32 terms keeps 8 significant bits, so each term loses the bits
  // below the sum's: errors of 2^-9 of the sum per addition. Added in fp32 (drained), only each
  // term's own rounding remains. Fused, the linear layers' terms are not rounded at all: what is
  // left is the bf16 activations and input gradients they are computed from. Measured on this
  // model (relative L2 from fp32 training's gradient): 7.2e-3 summed in bf16, 3.4e-3 drained into
  // fp32, 3.2e-3 fused.
  constexpr std::int64_t micro_batches = 32;
  const std::vector<double> reference = one_step_gradient<Fp>(micro_batches, false);
  const double in_bf16 = relative_l2(one_step_gradient<Bf>(micro_batches, false), reference);
  const double in_fp32 = relative_l2(one_step_gradient<Bf>(micro_batches, true, false), reference);
  const double fused = relative_l2(one_step_gradient<Bf>(micro_batches, true, true), reference);
  MESSAGE("relative L2 from fp32 training's gradient: bf16 sums ", in_bf16, ", fp32 sums ", in_fp32, ", fused ",
          fused);
  CHECK(in_fp32 < 0.75 * in_bf16);
  CHECK(in_fp32 < 1e-2);
  CHECK(fused < in_fp32);
}

TEST_CASE_TEMPLATE("fp32 gradient fusion: the fused sums round to the drained bf16 gradients; every other gradient "
                   "is the same bits",
                   M, Bf, BertBf, BlocksFused) {
  // One micro-batch: a fused layer adds its float results (GEMMs, bias and layernorm column sums,
  // embedding rows) to zeros, an unfused one rounds the same float values to bf16 and the drain
  // widens them. The input gradients, so everything upstream, are the same bits either way, and
  // so are the gradients of layers that do not fuse (BlocksFused's embedding and head). wte, the
  // head's GEMM plus the embedding's rows, differs by the rounding of each share where fused.
  const std::vector<double> drained = one_step_gradient<M>(1, true, false);
  const std::vector<double> fused = one_step_gradient<M>(1, true, true);
  const M model = test_model<M>();
  std::vector<int> kind(drained.size(), 0);  // 0: written in bf16, 1: fused, 2: wte
  for (int l = 0; l < model.num_layers(); ++l)
    for (const ElementRange& r : model.fp32_gradient_parameters(l))
      for (std::int64_t i = r.begin; i < r.end; ++i) kind[static_cast<std::size_t>(i)] = 1;
  const auto& wte = model.layout().find("wte");
  for (std::int64_t i = wte.offset; i < wte.offset + wte.numel(); ++i) kind[static_cast<std::size_t>(i)] = 2;
  std::int64_t counts[3] = {0, 0, 0}, mismatches[3] = {0, 0, 0};
  double wte_diff = 0, wte_norm = 0;
  for (std::size_t i = 0; i < drained.size(); ++i) {
    ++counts[kind[i]];
    if (kind[i] == 0 && fused[i] != drained[i]) ++mismatches[0];
    if (kind[i] == 1 && static_cast<double>(static_cast<float>(bf16(static_cast<float>(fused[i])))) != drained[i])
      ++mismatches[1];
    if (kind[i] == 2) {
      wte_diff += (fused[i] - drained[i]) * (fused[i] - drained[i]);
      wte_norm += drained[i] * drained[i];
    }
  }
  INFO("elements written in bf16 ", counts[0], ", fused ", counts[1], ", of wte ", counts[2]);
  if constexpr (std::is_same_v<M, BlocksFused>)
    CHECK(counts[0] > 0);  // wpe and ln_f
  else
    CHECK(counts[0] == 0);  // GPT-2 and BERT fuse every gradient, the layernorms' too
  CHECK(counts[1] > counts[0]);
  CHECK(mismatches[0] == 0);
  CHECK(mismatches[1] == 0);
  CHECK(wte_norm > 0);
  CHECK(std::sqrt(wte_diff / wte_norm) < std::ldexp(1.0, -8));
  CHECK(fused != drained);  // the fusion ran: fp32 values bf16 cannot hold
}

//! `ranks` data-parallel thread ranks of model M with strategy `St` and fp32 gradients (fused
//! unless `fusion` is false); rank 0's run, after checking that every rank has the same losses
//! and weights.
template <class St, class M = Bf>
Run data_parallel(int ranks, std::int64_t global_batch, St strategy, bool fusion = true) {
  std::vector<Run> runs(static_cast<std::size_t>(ranks));
  threads::run(ranks, [&](threads::Communicator& comm) {
    cpu be(1);
    Trainer<M, AdamW, GradientAccumulation, St> trainer(be, comm, M(small_test_config()), AdamW({.weight_decay = 0.1}),
                                                        parity_lr(), options(1, true, fusion), strategy);
    runs[static_cast<std::size_t>(comm.rank())] = train(trainer, global_batch);
  });
  return same_on_every_rank(runs);
}

//! Every rank of a `shape` mesh of thread ranks runs `train_rank(be, mesh)`, which returns its
//! Run; rank 0's run, after checking that every rank has the same losses and weights.
template <class F>
Run mesh_run(MeshShape shape, F&& train_rank) {
  std::vector<Run> runs(static_cast<std::size_t>(shape.dp * shape.tp * shape.pp));
  threads::run(static_cast<int>(runs.size()), [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, shape);
    cpu be(1);
    runs[static_cast<std::size_t>(world.rank())] = train_rank(be, mesh);
  });
  return same_on_every_rank(runs);
}

TEST_CASE("fp32 gradients: DDP on 2 and 3 ranks trains as one rank, fused or drained") {
  // Each micro-batch's gradient is bit-for-bit the same on any number of ranks; only the order of
  // the fp32 sums differs (each rank's micro-batches, then the all-reduce). Drained, the sums add
  // bf16 values, and sums of a few of those are mostly exact in fp32: measured, the same master
  // weights (relative difference 0). Fused, the terms are fp32 results, whose sums round in fp32,
  // so their order shows: measured 1.3e-8 on 2 ranks. On 3, 4.6e-4, nearly all of it in the
  // attention's key biases: their exact gradient is 0 (adding one constant to a query's scores
  // leaves its softmax alone), so theirs is rounding noise, which AdamW's normalised step turns
  // into moves of about the learning rate whatever its size; a different order of the sums, a
  // different noise (3.0e-8 everywhere after the first step, 2.5e-3 in block 1's qkv bias after
  // the second). Allowed 1e-3, as against 1e-2 for bf16 gradients.
  constexpr std::int64_t global_batch = 12;
  for (const bool fusion : {true, false}) {
    CAPTURE(fusion);
    cpu one(1);
    Trainer<Bf, AdamW> single(one, Bf(small_test_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
                              options(1, true, fusion));
    const Run reference = train(single, global_batch);
    CHECK(reference.losses.back() < reference.losses.front());
    for (const int ranks : {2, 3}) {
      CAPTURE(ranks);
      check_close(data_parallel(ranks, global_batch, DataParallel{.bucket_bytes = 4096}, fusion), reference, 1e-3);
    }
  }
}

TEST_CASE("fp32 gradients: ZeRO 1, 2 and 3 train as DDP") {
  // ZeRO-1 reduce-scatters the fp32 sums DDP all-reduces. ZeRO-2 and 3 add each layer's terms to
  // an fp32 buffer per unit (fused, or drained), reduce-scatter it in every micro-batch and add
  // the pieces up in an fp32 shard: the same terms, summed in another order. Measured (fused,
  // fp32 master weights): ZeRO-1 the same as DDP, ZeRO-2 1.4e-8 from them (with and without
  // overlap), ZeRO-3 on 3 ranks 4.6e-4 (the key biases' noise, as in the DDP test above).
  constexpr std::int64_t global_batch = 8;
  const Run ddp = data_parallel(2, global_batch, DataParallel{.bucket_bytes = 4096});
  check_close(data_parallel(2, global_batch, Zero<1>{.bucket_bytes = 2048}), ddp, 1e-3);
  check_close(data_parallel(2, global_batch, Zero<2>{.bucket_bytes = 2048}), ddp, 1e-3);
  check_close(data_parallel(2, global_batch, Zero<2>{.bucket_bytes = 2048, .overlap = false}), ddp, 1e-3);
  check_close(data_parallel(3, global_batch + 4, Zero<3>{}), data_parallel(3, global_batch + 4, DataParallel{}), 1e-3);
}

TEST_CASE("fp32 gradient fusion: a model that fuses some layers keeps bf16 gradients for the rest, drained, and "
          "trains as one rank") {
  // BlocksFused's embedding and head write bf16 gradients, which every engine drains after their
  // backwards (wte after both); its blocks add theirs to the fp32 sums. Under ZeroBubbleH1 the
  // head's weight pass writes dwte in bf16 after other micro-batches' work, and it waits there for
  // the head's next drain. Measured (fp32 master weights, relative L2): DDP, ZeRO-1 and the
  // pipelines 1.3e-8 from one rank, ZeRO-2 and 3 1.9e-8 (the sums' order).
  constexpr std::int64_t global_batch = 8;
  cpu one(1);
  Trainer<BlocksFused, AdamW> single(one, BlocksFused(small_test_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
                                     options(1, true));
  REQUIRE(single.gradients() != nullptr);  // the bf16 buffer the embedding and the head write
  const Run reference = train(single, global_batch);
  CHECK(reference.losses.back() < reference.losses.front());
  check_close(data_parallel<DataParallel, BlocksFused>(2, global_batch, DataParallel{.bucket_bytes = 4096}), reference,
              1e-3);
  check_close(data_parallel<Zero<1>, BlocksFused>(2, global_batch, Zero<1>{.bucket_bytes = 2048}), reference, 1e-3);
  check_close(data_parallel<Zero<2>, BlocksFused>(2, global_batch, Zero<2>{.bucket_bytes = 2048}), reference, 1e-3);
  check_close(data_parallel<Zero<3>, BlocksFused>(2, global_batch, Zero<3>{}), reference, 1e-3);
  const Run pipelines = mesh_run({.dp = 2, .tp = 1, .pp = 2}, [&](cpu& be, Mesh<threads::Communicator>& mesh) {
    Trainer<BlocksFused, AdamW, ZeroBubbleH1, DataParallel> trainer(
        be, mesh, BlocksFused(small_test_config(), mesh.tensor_parallel()), AdamW({.weight_decay = 0.1}), parity_lr(),
        options(1, true));
    return train(trainer, global_batch);
  });
  check_close(pipelines, reference, 1e-3);
}

TEST_CASE_TEMPLATE("fp32 gradients: DP 2 x PP 2 pipelines, the tied embedding exchanged in fp32, train as one rank",
                   S, OneFOneB, ZeroBubbleH1, Interleaved1F1B) {
  // Both uses of the tied embedding add up in fp32 on every holder (fused here, the default; a
  // drained run drains it after the head's backward and again after the embedding's), and the two
  // stages' sums are exchanged in fp32. Under ZeroBubbleH1 the weight passes come after other
  // micro-batches' work and add to the fp32 sums in their GEMMs. Measured (fp32 master weights):
  // 1.3e-8 from one rank.
  constexpr std::int64_t global_batch = 8;
  cpu one(1);
  Trainer<Bf, AdamW> single(one, Bf(small_test_config()), AdamW({.weight_decay = 0.1}), parity_lr(),
                            options(1, true));
  const Run reference = train(single, global_batch);
  const auto pipelines = [&](auto strategy) {
    return mesh_run({.dp = 2, .tp = 1, .pp = 2}, [&](cpu& be, Mesh<threads::Communicator>& mesh) {
      Trainer<Bf, AdamW, S, decltype(strategy)> trainer(be, mesh, Bf(small_test_config(), mesh.tensor_parallel()),
                                                        AdamW({.weight_decay = 0.1}), parity_lr(), options(1, true),
                                                        strategy);
      return train(trainer, global_batch);
    });
  };
  if constexpr (std::is_same_v<S, OneFOneB>) {
    // Zero<1>'s full fp32 buffer is padded: the tied exchange reads it through a view.
    check_close(pipelines(Zero<1>{.bucket_bytes = 2048}), reference, 1e-3);
    // Zero<3> keeps the tied unit's fp32 sums open across the micro-batches, exchanges them, then
    // reduce-scatters them once.
    check_close(pipelines(Zero<3>{}), reference, 1e-3);
  } else if constexpr (std::is_same_v<S, ZeroBubbleH1>) {
    check_close(pipelines(DataParallel{}), reference, 1e-3);
    // Input passes drain into units that a later weight pass reduce-scatters.
    check_close(pipelines(Zero<2>{.bucket_bytes = 2048}), reference, 1e-3);
  } else {
    check_close(pipelines(DataParallel{}), reference, 1e-3);
    // Chunks reopen units whose earlier micro-batch's reduction is still on the way.
    check_close(pipelines(Zero<2>{.bucket_bytes = 2048, .replicas = 2}), reference, 1e-3);
  }
}

TEST_CASE_TEMPLATE("fp32 gradients: DP 2 x TP 2 with sequence parallelism trains as one rank", M, Bf, BertBf) {
  // Under sequence parallelism each rank's layernorm gradients are partial sums over its rows
  // (GPT-2's blocks and ln_f, BERT's embedding and blocks; BERT's head normalises whole rows),
  // which the layers sum over the group inside their backward, in fp32 where fused (the default
  // here). The row-parallel GEMMs' partial sums are added in another order than on one rank and
  // rounded to bf16, so the bits differ: allowed bf16 training's 1e-2. Measured (fp32 master
  // weights): GPT-2 5.1e-3 in relative L2 (4.8e-3 with the layernorms drained, 4.2e-3 with
  // nothing fused, 4.4e-3 with the gradients summed in bf16 on the mesh: what is left is the
  // partial sums' bf16 roundings), BERT 1.3e-3.
  constexpr std::int64_t global_batch = 8;
  auto config = test_config<M>();
  config.sequence_parallel = true;
  cpu one(1);
  Trainer<M, AdamW> single(one, M(config), AdamW({.weight_decay = 0.1}), parity_lr(), options(1, true));
  const Run reference = train(single, global_batch);
  const Run mesh = mesh_run({.dp = 2, .tp = 2, .pp = 1}, [&](cpu& be, Mesh<threads::Communicator>& m) {
    Trainer<M, AdamW, GradientAccumulation, Zero<1>> trainer(be, m, M(config, m.tensor_parallel()),
                                                             AdamW({.weight_decay = 0.1}), parity_lr(),
                                                             options(1, true), Zero<1>{.bucket_bytes = 2048});
    REQUIRE(trainer.model().sequence_parallel());
    REQUIRE(trainer.engine().fp32_gradients());
    CHECK(!trainer.layers_write_gradients());
    return train(trainer, global_batch);
  });
  check_close(mesh, reference, 1e-2);
}

TEST_CASE("fp32 gradients: memory per rank under ZeRO (fp32 gradient shards; bf16 gradients only where drained)") {
  for (int n = 1; n <= 3; ++n) {
    CAPTURE(n);
    const auto N = static_cast<std::size_t>(n);
    // After one step of `micro_batches` micro-batches, fused or drained.
    const auto check = [&](auto strategy, auto formula, bool fusion = true, std::int64_t micro_batches = 0) {
      threads::run(n, [&](threads::Communicator& comm) {
        cpu be(1);
        Trainer<Bf, AdamW, GradientAccumulation, decltype(strategy)> trainer(
            be, comm, Bf(small_test_config()), AdamW(), ConstantLr{.lr = 1e-3}, options(1, true, fusion), strategy);
        if (micro_batches > 0) trainer.step(test_batch<Bf>(micro_batches * n));
        const std::size_t padded = N * static_cast<std::size_t>(trainer.engine().plan().shard_size());
        formula(padded, be.memory());
      });
    };
    check(Zero<1>{.bucket_bytes = 2048}, [&](std::size_t padded, const MemoryTracker& m) {
      CHECK(m.current(MemoryCategory::parameters) == 2 * padded);
      CHECK(m.current(MemoryCategory::gradients) == 4 * padded);  // fp32, full: every gradient fused
      CHECK(m.current(MemoryCategory::optimizer_state) == 12 * padded / N);
    });
    check(
        Zero<1>{.bucket_bytes = 2048},
        [&](std::size_t padded, const MemoryTracker& m) {
          CHECK(m.current(MemoryCategory::gradients) == 6 * padded);  // bf16 + fp32, full
        },
        false);
    // Under ZeRO-2 and 3 an open unit has an fp32 buffer, and a bf16 one beside it only where
    // drained: the pools' peak over a step (communication: the units' buffers, the gathers and
    // reductions) shrinks.
    const auto pools_shrink = [&](auto strategy) {
      std::size_t pools[2] = {0, 0};  // fused, drained: the largest over the ranks
      std::mutex pools_mutex;
      for (const bool fusion : {true, false})
        check(
            strategy,
            [&](std::size_t, const MemoryTracker& m) {
              const std::lock_guard lock(pools_mutex);
              std::size_t& pool = pools[fusion ? 0 : 1];
              pool = std::max(pool, m.peak(MemoryCategory::communication));
            },
            fusion, 2);
      CHECK(pools[0] > 0);
      CHECK(pools[0] < pools[1]);
    };
    pools_shrink(Zero<2>{.bucket_bytes = 2048});
    pools_shrink(Zero<3>{});
    check(Zero<2>{.bucket_bytes = 2048}, [&](std::size_t padded, const MemoryTracker& m) {
      CHECK(m.current(MemoryCategory::parameters) == 2 * padded);
      CHECK(m.current(MemoryCategory::gradients) == 4 * padded / N);  // an fp32 shard
    });
    check(Zero<3>{}, [&](std::size_t padded, const MemoryTracker& m) {
      CHECK(m.current(MemoryCategory::parameters) + m.current(MemoryCategory::gradients) +
                m.current(MemoryCategory::optimizer_state) ==
            18 * padded / N);
    });
  }
}

TEST_CASE("fp32 gradients: 2 more bytes of gradient per parameter on one rank, 4 where drained; nothing for float "
          "models") {
  const auto psi = static_cast<std::size_t>(small_test_config().stored_parameter_count());
  {
    // Every gradient fused: the fp32 sums and no bf16 buffer (Megatron-LM's main_grad alone).
    cpu be(1);
    Trainer<Bf, AdamW> trainer(be, Bf(small_test_config()), AdamW(), ConstantLr{.lr = 1e-3}, options(1, true));
    CHECK(be.memory().current(MemoryCategory::parameters) == 2 * psi);
    CHECK(be.memory().current(MemoryCategory::gradients) == 4 * psi);
    CHECK(be.memory().current(MemoryCategory::optimizer_state) == 12 * psi);
    CHECK(trainer.gradients() == nullptr);
    trainer.step(test_batch<Bf>(2));
    CHECK(be.memory().current(MemoryCategory::gradients) == 4 * psi);
  }
  {
    // Drained (no fusion), or fused in some layers only: the bf16 part and the fp32 sums.
    cpu be(1);
    Trainer<Bf, AdamW> drained(be, Bf(small_test_config()), AdamW(), ConstantLr{.lr = 1e-3}, options(1, true, false));
    CHECK(be.memory().current(MemoryCategory::gradients) == 6 * psi);
  }
  {
    cpu be(1);
    Trainer<BlocksFused, AdamW> some(be, BlocksFused(small_test_config()), AdamW(), ConstantLr{.lr = 1e-3},
                                     options(1, true));
    CHECK(be.memory().current(MemoryCategory::gradients) == 6 * psi);
  }
  {
    // Float gradients are fp32 already: the option changes nothing.
    cpu be(1);
    Trainer<Fp, AdamW> trainer(be, Fp(small_test_config()), AdamW(), ConstantLr{.lr = 1e-3}, options(1, true));
    CHECK(be.memory().current(MemoryCategory::gradients) == 4 * psi);
    CHECK(trainer.fp32_gradients() == nullptr);
  }
}

}  // namespace test_fp32_gradients
