// PipelineStage on GPT-2 as the Trainer builds it: the stages (and their chunks) cover the
// model's layers once, each rank holds exactly its layers' parameters plus the tied wte copy on
// the last stage, the split follows layer costs, the activation memory a schedule keeps, the
// forward-only loss, and the configurations rejected before the first step.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/loom.hpp"
#include "support/pipeline_parity.hpp"
#include "support/training.hpp"

namespace test_pipeline_stage {

using namespace loom;
using namespace loom::test;

namespace {

using Gpt = gpt2::Model<cpu, float>;

//! One parameter of a stage's layout, copied out of the rank's thread.
struct StageEntry {
  std::string name;
  std::int64_t offset = 0, numel = 0;
  int layer = 0;
  bool tied_copy = false;
};

//! What one pipeline rank's Trainer::stage() says about itself.
struct StageView {
  int stage = 0;
  std::vector<int> global_layers;  // of each local layer
  std::vector<StageLayers> chunk_layers, chunk_model_layers;
  std::vector<StageEntry> layout;
  std::vector<TiedParameter> tied;
};

//! The stages of a Trainer with schedule `schedule` on a {1, 1, pp} mesh, by pipeline rank.
template <class S>
std::vector<StageView> stages_of(const gpt2::Config& config, int pp, S schedule) {
  std::vector<StageView> out(static_cast<std::size_t>(pp));
  threads::run(pp, [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, {.dp = 1, .tp = 1, .pp = pp});
    cpu be(1);
    Trainer<Gpt, AdamW, S, DataParallel> trainer(be, mesh, Gpt(config, mesh.tensor_parallel()), AdamW(),
                                                 ConstantLr{}, {}, {}, schedule);
    const auto& stage = trainer.stage();
    StageView v;
    v.stage = trainer.pipeline_rank();
    for (int l = 0; l < stage.num_layers(); ++l) v.global_layers.push_back(stage.global_layer(l));
    for (int c = 0; c < stage.chunks(); ++c) {
      v.chunk_layers.push_back(stage.chunk_layers(c));
      v.chunk_model_layers.push_back(stage.chunk_model_layers(c));
    }
    for (const auto& e : stage.layout().entries())
      v.layout.push_back({e.spec.name, e.offset, e.numel(), e.spec.layer, e.spec.tied_copy});
    v.tied = stage.tied();
    out[static_cast<std::size_t>(v.stage)] = std::move(v);
  });
  return out;
}

//! The checks of the first test case on one (pp, schedule).
void check_stages(const std::vector<StageView>& stages, int chunks) {
  const Gpt model(pipeline_config());
  const int pp = static_cast<int>(stages.size());
  const int layers = model.num_layers();

  // Virtual stage k = c·pp + s is chunk c of rank s; in k order they tile 0..layers-1.
  int next = 0;
  for (int k = 0; k < pp * chunks; ++k) {
    CAPTURE(k);
    const StageView& s = stages[static_cast<std::size_t>(k % pp)];
    REQUIRE(static_cast<int>(s.chunk_model_layers.size()) == chunks);
    const StageLayers& g = s.chunk_model_layers[static_cast<std::size_t>(k / pp)];
    CHECK(g.first == next);
    CHECK(g.last >= g.first);
    next = g.last + 1;
  }
  CHECK(next == layers);

  // Each model layer runs on exactly one rank, as the local layer its chunk says.
  std::vector<int> runs(static_cast<std::size_t>(layers), 0);
  for (const StageView& s : stages) {
    CAPTURE(s.stage);
    int local = 0;
    for (std::size_t c = 0; c < s.chunk_layers.size(); ++c) {
      CHECK(s.chunk_layers[c].first == local);
      CHECK(s.chunk_layers[c].count() == s.chunk_model_layers[c].count());
      for (int j = 0; j < s.chunk_layers[c].count(); ++j)
        CHECK(s.global_layers[static_cast<std::size_t>(local + j)] == s.chunk_model_layers[c].first + j);
      local += s.chunk_layers[c].count();
    }
    CHECK(local == static_cast<int>(s.global_layers.size()));
    for (int g : s.global_layers) ++runs[static_cast<std::size_t>(g)];
  }
  CHECK(std::all_of(runs.begin(), runs.end(), [](int n) { return n == 1; }));

  // Each rank's layout: its layers' parameters (renumbered to local layers) and, on the last
  // stage, a tied copy of wte (the embedding's, read by the head); every element owned once.
  std::int64_t owned = 0;
  for (const StageView& s : stages) {
    CAPTURE(s.stage);
    const bool first = s.stage == 0, last = s.stage == pp - 1;
    std::set<std::string> want, got;
    for (const auto& e : model.layout().entries())
      if (std::find(s.global_layers.begin(), s.global_layers.end(), e.spec.layer) != s.global_layers.end())
        want.insert(e.spec.name);
    if (last) want.insert("wte");
    std::int64_t offset = 0;
    for (const StageEntry& e : s.layout) {
      CAPTURE(e.name);
      CHECK(got.insert(e.name).second);  // no parameter twice
      CHECK(e.offset == offset);          // one flat buffer, in layout order
      offset += e.numel;
      const auto& m = model.layout().find(e.name);
      CHECK(e.numel == m.numel());
      CHECK(e.tied_copy == (last && !first && e.name == "wte"));
      if (e.name == "wte") {
        CHECK(e.layer == 0);  // local layer 0 owns the tied parameter on every holder
      } else {
        REQUIRE(e.layer >= 0);
        REQUIRE(e.layer < static_cast<int>(s.global_layers.size()));
        CHECK(s.global_layers[static_cast<std::size_t>(e.layer)] == m.spec.layer);
      }
      if (!e.tied_copy) owned += e.numel;
    }
    CHECK(got == want);

    if (first || last) {
      REQUIRE(s.tied.size() == 1);
      CHECK(s.tied[0].name == "wte");
      CHECK(s.tied[0].holders == std::vector<int>{0, pp - 1});
      CHECK(s.tied[0].numel == model.layout().find("wte").numel());
      const auto it = std::find_if(s.layout.begin(), s.layout.end(), [](const StageEntry& e) { return e.name == "wte"; });
      REQUIRE(it != s.layout.end());
      CHECK(s.tied[0].offset == it->offset);
    } else {
      CHECK(s.tied.empty());
    }
  }
  CHECK(owned == model.layout().total());
}

//! The largest stage cost of the best split of `costs` into `stages` contiguous ranges, by
//! trying every split (independent of balance_stages' dynamic programme).
double best_split_cost(const std::vector<double>& costs, int stages) {
  const int n = static_cast<int>(costs.size());
  double best = std::numeric_limits<double>::infinity();
  std::vector<int> cut(static_cast<std::size_t>(stages) + 1);  // stage s is [cut[s], cut[s+1])
  const auto search = [&](auto&& self, int s, int begin, double worst) -> void {
    if (s == stages - 1) {
      double c = 0;
      for (int l = begin; l < n; ++l) c += costs[static_cast<std::size_t>(l)];
      best = std::min(best, std::max(worst, c));
      return;
    }
    double c = 0;
    for (int end = begin + 1; end <= n - (stages - 1 - s); ++end) {
      c += costs[static_cast<std::size_t>(end - 1)];
      self(self, s + 1, end, std::max(worst, c));
    }
  };
  search(search, 0, 0, 0.0);
  return best;
}

//! Catches loom::Error on every rank of `ranks` running `body`, and returns the messages.
template <class Body>
std::vector<std::string> errors_on_every_rank(int ranks, Body body) {
  std::mutex mutex;
  std::vector<std::string> messages;
  threads::run(ranks, [&](threads::Communicator& world) {
    try {
      body(world);
    } catch (const Error& e) {
      std::lock_guard lock(mutex);
      messages.push_back(e.what());
    }
  });
  return messages;
}

}  // namespace

TEST_CASE("pipeline stages cover GPT-2's layers once; each rank holds its layers' parameters and the tied wte") {
  for (int pp : {2, 4, 8}) {
    CAPTURE(pp);
    {
      INFO("OneFOneB (one chunk per rank)");
      check_stages(stages_of(pipeline_config(), pp, OneFOneB{}), 1);
    }
    {
      INFO("Interleaved1F1B, 2 chunks per rank");
      check_stages(stages_of(pipeline_config(), pp, Interleaved1F1B{.virtual_stages = 2}), 2);
    }
  }
}

TEST_CASE("one pipeline stage is the model itself: its layout unchanged, no tied parameters") {
  const Gpt model(pipeline_config());
  const PipelineStage<Gpt> whole{Gpt(pipeline_config())};
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(pipeline_config()), AdamW(), ConstantLr{});
  for (const PipelineStage<Gpt>* stage : {&whole, &trainer.stage()}) {
    CHECK(stage->stages() == 1);
    CHECK(stage->chunks() == 1);
    CHECK(stage->tied().empty());
    REQUIRE(stage->num_layers() == model.num_layers());
    for (int l = 0; l < model.num_layers(); ++l) CHECK(stage->global_layer(l) == l);
    const auto mine = stage->layout().entries(), theirs = model.layout().entries();
    REQUIRE(mine.size() == theirs.size());
    CHECK(stage->layout().total() == model.layout().total());
    for (std::size_t i = 0; i < mine.size(); ++i) {
      CAPTURE(theirs[i].spec.name);
      CHECK(mine[i].spec.name == theirs[i].spec.name);
      CHECK(mine[i].offset == theirs[i].offset);
      CHECK(mine[i].spec.shape == theirs[i].spec.shape);
      CHECK(mine[i].spec.layer == theirs[i].spec.layer);
      CHECK_FALSE(mine[i].spec.tied_copy);
    }
    for (int l = 0; l < model.num_layers(); ++l) {
      // The same ranges (the stage lists them in layout order, the head's wte first).
      auto a = stage->layer_parameters(l), b = model.layer_parameters(l);
      const auto by_begin = [](const ElementRange& x, const ElementRange& y) { return x.begin < y.begin; };
      std::sort(a.begin(), a.end(), by_begin);
      std::sort(b.begin(), b.end(), by_begin);
      REQUIRE(a.size() == b.size());
      for (std::size_t i = 0; i < a.size(); ++i) {
        CHECK(a[i].begin == b[i].begin);
        CHECK(a[i].end == b[i].end);
      }
    }
  }
}

TEST_CASE("the stages follow layer costs: an expensive head leaves the last stage fewer blocks") {
  // A 1024-row vocabulary over 16 channels makes the head cost 2·1024·16 = 32768 FLOPs per
  // token against a block's 24·16² + 4·16·16 = 7168: about four and a half blocks.
  gpt2::Config config = pipeline_config();
  config.vocab_size = 1000;
  config.padded_vocab_size = 1024;
  const Gpt model(config);
  std::vector<double> costs;
  for (int l = 0; l < model.num_layers(); ++l) costs.push_back(model.layer_cost(l));
  CHECK(costs.back() > 4 * costs[1]);
  for (int pp : {2, 4}) {
    CAPTURE(pp);
    const std::vector<StageView> stages = stages_of(config, pp, OneFOneB{});
    double slowest = 0;
    for (const StageView& s : stages) {
      double c = 0;
      for (int g : s.global_layers) c += costs[static_cast<std::size_t>(g)];
      slowest = std::max(slowest, c);
    }
    CHECK(slowest == doctest::Approx(best_split_cost(costs, pp)).epsilon(1e-12));
    // The head's stage takes fewer layers than the embedding's.
    CHECK(stages.back().global_layers.size() < stages.front().global_layers.size());
    CHECK(stages.back().global_layers.size() < static_cast<std::size_t>(model.num_layers() / pp));
  }
  // pp = 2 by hand: stage 0 = embedding + 9 blocks (64528), stage 1 = 5 blocks + head (68608).
  const std::vector<StageView> two = stages_of(config, 2, OneFOneB{});
  CHECK(two[0].chunk_model_layers[0] == StageLayers{0, 9});
  CHECK(two[1].chunk_model_layers[0] == StageLayers{10, 15});
}

namespace {

//! Runs one step of schedule `S` on a {1, 1, 4} mesh with m = 8 micro-batches and checks, on
//! every stage, the activation slots (`slots(stage)`) and that the activations category holds
//! exactly those slots, each of the elements the stage's layers keep (computed from the model).
template <class S, class Slots>
void check_activation_memory(S schedule, Slots slots) {
  constexpr int pp = 4;
  constexpr std::int64_t m = 8;
  std::mutex mutex;
  std::vector<std::string> failures;
  threads::run(pp, [&](threads::Communicator& world) {
    Mesh<threads::Communicator> mesh(world, {.dp = 1, .tp = 1, .pp = pp});
    cpu be(1);
    Trainer<Gpt, AdamW, S, DataParallel> trainer(be, mesh, Gpt(pipeline_config(), mesh.tensor_parallel()), AdamW(),
                                                 ConstantLr{.lr = 1e-3}, {.micro_batch_size = 1}, {}, schedule);
    const bool nothing_before = trainer.memory().peak(MemoryCategory::activations) == 0;
    trainer.step(make_batch(0, m, pipeline_seq, pipeline_config().vocab_size));
    trainer.step(make_batch(1, m, pipeline_seq, pipeline_config().vocab_size));  // reuses the slots

    // One slot: what every local layer saves (each range starting 16-byte aligned: 4 floats),
    // the hidden states between its layers and from the neighbour stages, and (split backward)
    // the stash from I to W.
    const auto& stage = trainer.stage();
    const MicroBatchShape shape{1, pipeline_seq};
    std::int64_t saved = 0, stash = 0;
    for (int l = 0; l < stage.num_layers(); ++l) {
      saved += (stage.activation_elements(l, shape) + 3) / 4 * 4;
      if constexpr (requires { S::splits_backward; }) stash += stage.stash_elements(l, shape);
    }
    const int s = trainer.pipeline_rank();
    const std::int64_t hiddens = stage.num_layers() - 1 + (s > 0) + (s < pp - 1);
    const std::int64_t slot = saved + stash + hiddens * stage.hidden_elements(shape);
    const auto bytes = static_cast<std::size_t>(trainer.activation_slots() * slot) * sizeof(float);

    std::string failure;
    if (!nothing_before) failure += " activations before the first step";
    if (trainer.activation_slots() != slots(s, pp, m))
      failure += " slots " + std::to_string(trainer.activation_slots()) + " want " + std::to_string(slots(s, pp, m));
    if (trainer.activation_slot_elements() != slot)
      failure += " slot elements " + std::to_string(trainer.activation_slot_elements()) + " want " + std::to_string(slot);
    if (trainer.memory().peak(MemoryCategory::activations) != bytes)
      failure += " peak " + std::to_string(trainer.memory().peak(MemoryCategory::activations)) + " want " +
                 std::to_string(bytes);
    if (trainer.memory().current(MemoryCategory::activations) != bytes)
      failure += " current " + std::to_string(trainer.memory().current(MemoryCategory::activations));
    std::lock_guard lock(mutex);
    if (!failure.empty()) failures.push_back("stage " + std::to_string(s) + ":" + failure);
  });
  std::string report;
  for (const std::string& f : failures) report += "\n  " + f;
  CHECK_MESSAGE(failures.empty(), report);
}

}  // namespace

TEST_CASE("activation memory: 1F1B keeps min(pp - stage, m) micro-batches per stage, GPipe all m") {
  SUBCASE("OneFOneB") {
    check_activation_memory(OneFOneB{}, [](int s, int pp, std::int64_t m) { return std::min<std::int64_t>(pp - s, m); });
  }
  SUBCASE("GPipe") {
    check_activation_memory(GPipe{}, [](int, int, std::int64_t m) { return m; });
  }
  SUBCASE("ZeroBubbleH1: min(pp, m) on every stage, stash included") {
    check_activation_memory(ZeroBubbleH1{}, [](int, int pp, std::int64_t m) { return std::min<std::int64_t>(pp, m); });
  }
}

TEST_CASE("evaluate() on a pipeline returns the one-rank loss, on every rank") {
  const TestBatch batch = make_batch(11, pipeline_global_batch, pipeline_seq, pipeline_config().vocab_size);
  cpu be(1);
  Trainer<Gpt, AdamW> one(be, Gpt(pipeline_config()), AdamW(), ConstantLr{}, pipeline_options(0, pipeline_global_batch));
  const double want = one.evaluate(batch);
  const auto check = [&]<class S>(MeshShape shape, S schedule) {
    CAPTURE(shape);
    std::vector<double> got(static_cast<std::size_t>(shape.size()));
    threads::run(shape.size(), [&](threads::Communicator& world) {
      Mesh<threads::Communicator> mesh(world, shape);
      cpu rank_be(1);
      Trainer<Gpt, AdamW, S, DataParallel> trainer(rank_be, mesh, Gpt(pipeline_config(), mesh.tensor_parallel()),
                                                   AdamW(), ConstantLr{}, pipeline_options(0), {}, schedule);
      got[static_cast<std::size_t>(world.rank())] = trainer.evaluate(batch);
      CHECK(trainer.steps() == 0);
    });
    for (double loss : got) CHECK(loss == doctest::Approx(want).epsilon(1e-5));
  };
  check(MeshShape{.dp = 1, .tp = 1, .pp = 4}, OneFOneB{});
  check(MeshShape{.dp = 1, .tp = 1, .pp = 8}, OneFOneB{});
  check(MeshShape{.dp = 2, .tp = 2, .pp = 2}, Interleaved1F1B{.virtual_stages = 2});
}

TEST_CASE("pipeline configurations a Trainer rejects before the first step, naming the rule") {
  const gpt2::Config small = [] {  // 4 model layers
    gpt2::Config c = small_test_config();
    c.num_heads = 4;
    return c;
  }();
  SUBCASE("more pipeline stages x virtual stages than layers") {
    const auto two_by_four = errors_on_every_rank(2, [&](threads::Communicator& world) {
      Mesh<threads::Communicator> mesh(world, {.dp = 1, .tp = 1, .pp = 2});
      cpu be(1);
      Trainer<Gpt, AdamW, Interleaved1F1B, DataParallel> t(be, mesh, Gpt(small, mesh.tensor_parallel()), AdamW(),
                                                            ConstantLr{}, {}, {}, {.virtual_stages = 4});
    });
    REQUIRE(two_by_four.size() == 2);
    for (const auto& m : two_by_four)
      CHECK_MESSAGE(m.find("pipeline stages x virtual stages: got 2 x 4; the model has 4 layers") != std::string::npos, m);
    const auto eight = errors_on_every_rank(8, [&](threads::Communicator& world) {
      Mesh<threads::Communicator> mesh(world, {.dp = 1, .tp = 1, .pp = 8});
      cpu be(1);
      Trainer<Gpt, AdamW, OneFOneB, DataParallel> t(be, mesh, Gpt(small, mesh.tensor_parallel()), AdamW(), ConstantLr{});
    });
    REQUIRE(eight.size() == 8);
    for (const auto& m : eight)
      CHECK_MESSAGE(m.find("pipeline stages x virtual stages: got 8 x 1; the model has 4 layers") != std::string::npos, m);
  }
  SUBCASE("GradientAccumulation on two pipeline stages") {
    const auto messages = errors_on_every_rank(2, [&](threads::Communicator& world) {
      Mesh<threads::Communicator> mesh(world, {.dp = 1, .tp = 1, .pp = 2});
      cpu be(1);
      Trainer<Gpt, AdamW, GradientAccumulation, DataParallel> t(be, mesh, Gpt(small, mesh.tensor_parallel()),
                                                                 AdamW(), ConstantLr{});
    });
    REQUIRE(messages.size() == 2);
    for (const auto& m : messages)
      CHECK_MESSAGE(m.find("GradientAccumulation: pipeline stages: got 2; this schedule runs one stage") != std::string::npos,
                    m);
  }
  SUBCASE("Interleaved1F1B with micro-batches not a multiple of the stages (at the step, before any work)") {
    std::mutex mutex;
    std::vector<std::string> messages;
    threads::run(2, [&](threads::Communicator& world) {
      Mesh<threads::Communicator> mesh(world, {.dp = 1, .tp = 1, .pp = 2});
      cpu be(1);
      Trainer<Gpt, AdamW, Interleaved1F1B, DataParallel> t(be, mesh, Gpt(small, mesh.tensor_parallel()), AdamW(),
                                                            ConstantLr{.lr = 1e-2}, {.micro_batch_size = 1}, {},
                                                            {.virtual_stages = 2});
      const std::vector<float> before = t.gather_parameters();
      try {
        t.step(make_batch(0, 3, 16, small.vocab_size));  // m = 3 on 2 stages
      } catch (const Error& e) {
        std::lock_guard lock(mutex);
        messages.push_back(e.what());
      }
      CHECK(t.steps() == 0);
      CHECK(t.gather_parameters() == before);  // nothing changed, and the ranks still talk
    });
    REQUIRE(messages.size() == 2);
    for (const auto& m : messages)
      CHECK_MESSAGE(m.find("Interleaved1F1B: micro-batches: got 3; must be a multiple of pipeline stages (2)") !=
                        std::string::npos,
                    m);
  }
}

}  // namespace test_pipeline_stage
