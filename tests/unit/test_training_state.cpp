// Training-state checkpoints (io/training_state.hpp): a run saved after step 3 and resumed
// trains the same model as one that never stopped, bit for bit on the same mesh and within the
// parity tolerance (DESIGN.md invariant 3) on any other mesh and strategy; and a file that is
// not the right one fails with a message before anything is loaded from it.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/io/training_state.hpp"
#include "loom/loom.hpp"
#include "support/state_mesh.hpp"
#include "support/temp_path.hpp"
#include "support/training.hpp"

namespace test_training_state {

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t global_batch = state_batch, seq = state_seq, total_steps = state_steps,
                       saved_at = state_saved_at;

//! What a stretch of training did: its losses and, at its end, every training-state array of the
//! whole model (parameters, then the two AdamW moments).
template <class V>
struct Leg {
  std::vector<double> losses;
  std::vector<std::vector<V>> state;
};

template <class Trainer>
auto run_steps(Trainer& trainer, std::int64_t first, std::int64_t last) {
  Leg<typename Trainer::state_type> leg;
  for (std::int64_t s = first; s < last; ++s)
    leg.losses.push_back(trainer.step(make_batch(s, global_batch, seq, state_config().vocab_size)).loss);
  for (int a = 0; a < Trainer::state_arrays; ++a) leg.state.push_back(trainer.gather_state(a));
  return leg;
}

//! Trains steps [first, last) on thread ranks of `shape` with schedule `Sc` and strategy `St`,
//! after loading `load` (if any) and before saving `save` (if any); rank 0's leg. Every rank must
//! gather the same state.
template <class Sc, class St, class T = float>
Leg<accumulate_t<T>> train_leg(MeshShape shape, std::int64_t first, std::int64_t last, const std::string& load,
                               const std::string& save, St strategy = {}, Sc schedule = {}, std::uint64_t seed = 5) {
  Leg<accumulate_t<T>> out;
  std::mutex mutex;
  std::vector<std::string> mismatched;
  on_state_mesh<Sc, St, T>(shape, strategy, schedule, seed, [&](auto& trainer, int rank) {
    if (!load.empty()) {
      const io::TrainingStateInfo info = io::load_training_state(trainer, load);
      CHECK(info.steps == first);
      CHECK(trainer.steps() == first);
    }
    auto leg = run_steps(trainer, first, last);
    if (!save.empty()) io::save_training_state(trainer, save, "{\"test\": true}");
    std::lock_guard lock(mutex);
    if (rank == 0)
      out = leg;
    else if (out.state.size() == leg.state.size() && out.state != leg.state)
      mismatched.push_back(std::to_string(rank));
  });
  CHECK(mismatched == std::vector<std::string>{});
  return out;
}

constexpr MeshShape one_rank{.dp = 1, .tp = 1, .pp = 1};

//! The whole run on one rank, uninterrupted.
template <class T = float>
Leg<accumulate_t<T>> uninterrupted() {
  return train_leg<GradientAccumulation, SingleRank, T>(one_rank, 0, total_steps, "", "");
}

template <class V>
void check_close(const Leg<V>& resumed, const Leg<V>& reference, double tolerance) {
  REQUIRE(resumed.state.size() == reference.state.size());
  for (std::size_t s = 0; s < resumed.losses.size(); ++s) {
    CAPTURE(s);
    CHECK(std::abs(resumed.losses[s] - reference.losses[saved_at + s]) <= tolerance * reference.losses[saved_at + s]);
  }
  for (std::size_t a = 0; a < resumed.state.size(); ++a) {
    CAPTURE(a);
    REQUIRE(resumed.state[a].size() == reference.state[a].size());
    CHECK(relative_difference(resumed.state[a].data(), reference.state[a].data(),
                              static_cast<std::int64_t>(resumed.state[a].size())) <= tolerance);
  }
}


//! A one-rank float trainer of `config`, for the error cases.
template <class O = AdamW>
struct OneRank {
  using Gpt = gpt2::Model<cpu, float>;
  cpu be{1};
  Trainer<Gpt, O> trainer;
  explicit OneRank(gpt2::Config config = state_config(), O optimizer = O{})
      : trainer(be, Gpt(config), optimizer, state_lr(), {.micro_batch_size = global_batch, .seed = 5}) {}
};

}  // namespace

TEST_CASE("whole_layout and scatter_to_whole: the tensor-parallel slices assemble the one-rank tensors") {
  using Gpt = gpt2::Model<cpu, float>;
  const Gpt single(state_config());
  std::vector<float> expected(static_cast<std::size_t>(single.layout().total()));
  single.layout().initialize(expected.data(), 7);
  for (int tp : {2, 4}) {
    CAPTURE(tp);
    std::vector<float> assembled(expected.size(), 0.0f);
    threads::run(tp, [&](threads::Communicator& comm) {
      const Gpt model(state_config(), comm);
      const ParameterLayout whole = whole_layout(model.layout());
      // The same names, shapes and offsets as the one-rank layout.
      REQUIRE(whole.total() == single.layout().total());
      for (std::size_t p = 0; p < whole.entries().size(); ++p) {
        CHECK(whole.entries()[p].spec.name == single.layout().entries()[p].spec.name);
        CHECK(whole.entries()[p].spec.shape == single.layout().entries()[p].spec.shape);
        CHECK(whole.entries()[p].offset == single.layout().entries()[p].offset);
      }
      std::vector<float> local(static_cast<std::size_t>(model.layout().total()));
      model.layout().initialize(local.data(), 7);
      std::vector<float> mine(expected.size(), 0.0f);
      scatter_to_whole(model.layout(), local.data(), whole, mine.data(), comm.rank() == 0);
      comm.all_reduce(std::span<float>(mine), ReduceOp::sum);
      // And back: each rank's slice is its elements of the whole tensors.
      std::vector<float> back(local.size());
      gather_from_whole(model.layout(), mine.data(), whole, back.data());
      CHECK(back == local);
      if (comm.rank() == 0) assembled = mine;
    });
    CHECK(assembled == expected);
  }
}

//! Checks what checkpoints rely on to write and read in parallel: the ranks' owned_state_runs
//! cover the whole layout once, each within its copy_owned_state; each rank's needed_state_runs
//! fill its needed values once, and loading them back changes nothing.
template <class Sc, class St>
void check_state_runs(MeshShape shape, St strategy = {}, Sc schedule = {}) {
  const std::int64_t total = gpt2::Model<cpu, float>(state_config()).layout().total();
  std::vector<int> owners(static_cast<std::size_t>(total), 0);
  std::vector<std::int64_t> owned_counts;
  std::mutex mutex;
  on_state_mesh<Sc, St>(shape, strategy, schedule, 5, [&](auto& trainer, int rank) {
    CAPTURE(rank);
    trainer.step(make_batch(0, global_batch, seq, state_config().vocab_size));
    const std::vector<WholeRun> owned = trainer.owned_state_runs();
    const auto owned_values = static_cast<std::int64_t>(trainer.copy_owned_state(0).size());
    std::int64_t claimed = 0;
    for (const WholeRun& r : owned) {
      CHECK(r.local + r.count <= owned_values);
      CHECK(r.whole + r.count <= total);
      claimed += r.count;
    }
    {
      std::lock_guard lock(mutex);
      owned_counts.push_back(claimed);
      for (const WholeRun& r : owned)
        for (std::int64_t i = 0; i < r.count; ++i) ++owners[static_cast<std::size_t>(r.whole + i)];
    }
    for (int a = 0; a < 3; ++a) {
      CAPTURE(a);
      const std::vector<float> before = trainer.gather_state(a);
      const std::vector<WholeRun> needed = trainer.needed_state_runs(a);
      std::int64_t elements = 0;
      for (const WholeRun& r : needed) elements = std::max(elements, r.local + r.count);
      std::vector<int> filled(static_cast<std::size_t>(elements), 0);
      std::vector<float> mine(static_cast<std::size_t>(elements));
      for (const WholeRun& r : needed)
        for (std::int64_t i = 0; i < r.count; ++i) {
          ++filled[static_cast<std::size_t>(r.local + i)];
          mine[static_cast<std::size_t>(r.local + i)] = before[static_cast<std::size_t>(r.whole + i)];
        }
      CHECK(std::count(filled.begin(), filled.end(), 1) == elements);
      trainer.load_needed_state(a, mine);
      CHECK(trainer.gather_state(a) == before);
    }
  });
  CHECK(std::count(owners.begin(), owners.end(), 1) == total);
  // Each rank writes only its own part: under sharding a fraction of the model, not all of it.
  if (shape.size() > 1) {
    for (std::int64_t n : owned_counts) CHECK(n < total);
  }
}

TEST_CASE("every element of the training state has one owner, and each rank reads what it holds") {
  const MeshShape dp2_tp2{.dp = 2, .tp = 2, .pp = 1}, tp2_pp2{.dp = 1, .tp = 2, .pp = 2},
      dp2_pp2{.dp = 2, .tp = 1, .pp = 2};
  SUBCASE("one rank") { check_state_runs<GradientAccumulation, SingleRank>(one_rank); }
  SUBCASE("Zero<1> on DP2 x TP2") { check_state_runs<GradientAccumulation, Zero<1>>(dp2_tp2); }
  SUBCASE("Zero<3> on DP2 x TP2") { check_state_runs<GradientAccumulation, Zero<3>>(dp2_tp2); }
  SUBCASE("Zero<3> as 2 replicas on DP4: the second replica owns nothing, reads its shard") {
    check_state_runs<GradientAccumulation, Zero<3>>({.dp = 4, .tp = 1, .pp = 1}, {.replicas = 2});
  }
  SUBCASE("1F1B and DDP on TP2 x PP2: the tied embedding's copy on the last stage is not its") {
    check_state_runs<OneFOneB, DataParallel>(tp2_pp2);
  }
  SUBCASE("interleaved 1F1B with Zero<1> on DP2 x PP2") {
    check_state_runs<Interleaved1F1B, Zero<1>>(dp2_pp2, {.bucket_bytes = 4096}, {.virtual_stages = 2});
  }
}

TEST_CASE("Zero<3> ranks write and read only their shard") {
  const std::int64_t total = gpt2::Model<cpu, float>(state_config()).layout().total();
  on_state_mesh<GradientAccumulation, Zero<3>>({.dp = 4, .tp = 1, .pp = 1}, {}, {}, 5, [&](auto& trainer, int) {
    const std::int64_t shard = trainer.engine().plan().owned_elements();
    CHECK(static_cast<std::int64_t>(trainer.copy_owned_state(0).size()) == shard);
    for (int a = 0; a < 3; ++a) {
      std::int64_t needed = 0;
      for (const WholeRun& r : trainer.needed_state_runs(a)) needed += r.count;
      CHECK(needed == shard);
    }
    CHECK(shard <= total / 4 + 64);
  });
}

TEST_CASE("a run saved after step 3 and resumed on one rank is bit-identical to one that never stopped") {
  const auto reference = uninterrupted();
  TempPath file("state");
  const auto first = train_leg<GradientAccumulation, SingleRank>(one_rank, 0, saved_at, "", file.str());
  CHECK(first.losses == std::vector<double>(reference.losses.begin(), reference.losses.begin() + saved_at));
  // Another seed: the weights must come from the file.
  const auto resumed =
      train_leg<GradientAccumulation, SingleRank>(one_rank, saved_at, total_steps, file.str(), "", {}, {}, 99);
  CHECK(resumed.losses == std::vector<double>(reference.losses.begin() + saved_at, reference.losses.end()));
  CHECK(resumed.state == reference.state);

  const io::TrainingStateInfo info = io::read_training_state_info(file.path);
  CHECK(info.steps == saved_at);
  CHECK(info.optimizer == "AdamW");
  CHECK(info.state_slots == 2);
  CHECK(info.scalar_bytes == 4);
  CHECK(info.meta == "{\"test\": true}");
  CHECK(info.elements == gpt2::Model<cpu, float>(state_config()).layout().total());
  CHECK(info.parameters.front().first == "wte");
  CHECK(!std::filesystem::exists(file.str() + ".tmp"));
}

TEST_CASE("a bf16 run resumes bit for bit: the file holds its fp32 master weights") {
  TempPath file("state_bf16");
  SUBCASE("one rank") {
    const auto reference = uninterrupted<bf16>();
    (void)train_leg<GradientAccumulation, SingleRank, bf16>(one_rank, 0, saved_at, "", file.str());
    const auto resumed = train_leg<GradientAccumulation, SingleRank, bf16>(one_rank, saved_at, total_steps,
                                                                            file.str(), "", {}, {}, 99);
    CHECK(resumed.losses == std::vector<double>(reference.losses.begin() + saved_at, reference.losses.end()));
    CHECK(resumed.state == reference.state);
  }
  SUBCASE("Zero<2> on DP2 x TP2: master weights and moments sharded over data-parallel ranks") {
    const MeshShape dp2_tp2{.dp = 2, .tp = 2, .pp = 1};
    const auto reference = train_leg<GradientAccumulation, Zero<2>, bf16>(dp2_tp2, 0, total_steps, "", "");
    (void)train_leg<GradientAccumulation, Zero<2>, bf16>(dp2_tp2, 0, saved_at, "", file.str());
    const auto resumed = train_leg<GradientAccumulation, Zero<2>, bf16>(dp2_tp2, saved_at, total_steps, file.str(),
                                                                         "", {}, {}, 99);
    CHECK(resumed.losses == std::vector<double>(reference.losses.begin() + saved_at, reference.losses.end()));
    CHECK(resumed.state == reference.state);
  }
}

TEST_CASE("a state saved on one mesh and strategy resumes on another and trains the same model") {
  const auto reference = uninterrupted();
  const MeshShape dp2_tp2{.dp = 2, .tp = 2, .pp = 1}, tp2_pp2{.dp = 1, .tp = 2, .pp = 2},
      dp2_pp2{.dp = 2, .tp = 1, .pp = 2}, dp4{.dp = 4, .tp = 1, .pp = 1}, tp4{.dp = 1, .tp = 4, .pp = 1};
  SUBCASE("Zero<1> on DP2 x TP2, resumed on one rank") {
    TempPath file("state_mesh");
    train_leg<GradientAccumulation, Zero<1>>(dp2_tp2, 0, saved_at, "", file.str());
    check_close(train_leg<GradientAccumulation, SingleRank>(one_rank, saved_at, total_steps, file.str(), ""),
                reference, 1e-5);
  }
  SUBCASE("one rank, resumed with 1F1B and DDP on TP2 x PP2") {
    TempPath file("state_mesh");
    train_leg<GradientAccumulation, SingleRank>(one_rank, 0, saved_at, "", file.str());
    check_close(train_leg<OneFOneB, DataParallel>(tp2_pp2, saved_at, total_steps, file.str(), ""), reference, 1e-5);
  }
  SUBCASE("Zero<1> with GPipe on DP2 x PP2, resumed with Zero<3> on DP4") {
    TempPath file("state_mesh");
    train_leg<GPipe, Zero<1>>(dp2_pp2, 0, saved_at, "", file.str(), {.bucket_bytes = 4096});
    check_close(train_leg<GradientAccumulation, Zero<3>>(dp4, saved_at, total_steps, file.str(), ""), reference,
                1e-5);
  }
  SUBCASE("interleaved 1F1B (2 chunks per rank) on PP2, resumed with ZB-H1 and Zero<1> on DP2 x PP2") {
    TempPath file("state_mesh");
    const MeshShape pp2{.dp = 1, .tp = 1, .pp = 2};
    train_leg<Interleaved1F1B, DataParallel>(pp2, 0, saved_at, "", file.str(), {}, {.virtual_stages = 2});
    check_close(train_leg<ZeroBubbleH1, Zero<1>>(dp2_pp2, saved_at, total_steps, file.str(), ""), reference, 1e-5);
  }
  SUBCASE("Zero<3> as 2 replicas on DP4, resumed with Zero<1> as 2 replicas on DP2 x TP2") {
    TempPath file("state_mesh");
    train_leg<GradientAccumulation, Zero<3>>(dp4, 0, saved_at, "", file.str(), {.replicas = 2});
    check_close(train_leg<GradientAccumulation, Zero<1>>(dp2_tp2, saved_at, total_steps, file.str(), "",
                                                         {.replicas = 2}),
                reference, 1e-5);
  }
  SUBCASE("Zero<3> on DP2 x TP2, resumed with Zero<2> on TP4") {
    TempPath file("state_mesh");
    train_leg<GradientAccumulation, Zero<3>>(dp2_tp2, 0, saved_at, "", file.str());
    check_close(train_leg<GradientAccumulation, Zero<2>>(tp4, saved_at, total_steps, file.str(), ""), reference,
                1e-5);
  }
}

TEST_CASE("an fp32 state loads into a double model, and the values are the file's") {
  TempPath file("state_double");
  const auto saved = train_leg<GradientAccumulation, SingleRank>(one_rank, 0, saved_at, "", file.str());
  using Gpt = gpt2::Model<cpu, double>;
  cpu be(1);
  Trainer<Gpt, AdamW> trainer(be, Gpt(state_config()), AdamW({.weight_decay = 0.1}), state_lr(),
                              {.micro_batch_size = global_batch, .seed = 5});
  io::load_training_state(trainer, file.path);
  for (int a = 0; a < 3; ++a) {
    const std::vector<double> values = trainer.gather_state(a);
    CHECK(std::vector<double>(saved.state[a].begin(), saved.state[a].end()) == values);
  }
}

//! Rewrites the current-version state file at `path` (an AdamW state: 3 arrays of
//! `scalar_bytes`-byte scalars, no per-tensor state) as version `version` (1 or 2) wrote it:
//! the version field, no per-tensor state count in the header nor its checksum in the trailer,
//! and for version 1 FNV-1a checksums of each array.
void make_version(const std::filesystem::path& path, std::uint32_t version) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  in.close();
  const io::TrainingStateInfo info = io::read_training_state_info(path);
  REQUIRE(info.tensor_elements == 0);
  const std::size_t array_bytes = static_cast<std::size_t>(info.elements) * static_cast<std::size_t>(info.scalar_bytes);
  const std::size_t trailer = bytes.size() - (8 * (3 + info.state_slots) + 8);
  const std::size_t arrays = trailer - 3 * array_bytes;
  std::vector<std::uint64_t> stored(static_cast<std::size_t>(2 + info.state_slots));
  std::memcpy(stored.data(), bytes.data() + trailer, 8 * stored.size());
  // The header without its last field (the per-tensor state's count), then the arrays.
  std::string old = bytes.substr(0, arrays - 8) + bytes.substr(arrays, 3 * array_bytes);
  std::memcpy(old.data() + 8, &version, 4);
  const std::size_t header = arrays - 8;
  std::vector<std::uint64_t> sums{io::detail::checksum(old.data(), header)};
  for (std::size_t a = 0; a < 3; ++a)
    sums.push_back(version == 1 ? io::detail::checksum(old.data() + header + a * array_bytes, array_bytes)
                                : stored[1 + a]);
  old.append(reinterpret_cast<const char*>(sums.data()), 8 * sums.size());
  old.append(io::detail::training_state_magic.data(), io::detail::training_state_magic.size());
  std::ofstream(path, std::ios::binary | std::ios::trunc) << old;
}

//! The errors of the ranks of `shape` (Zero<3>) that failed to load `path`.
std::vector<std::string> zero3_load_errors(MeshShape shape, const std::filesystem::path& path) {
  std::mutex mutex;
  std::vector<std::string> errors;
  on_state_mesh<GradientAccumulation, Zero<3>>(shape, {}, {}, 5, [&](auto& trainer, int) {
    try {
      io::load_training_state(trainer, path);
    } catch (const Error& e) {
      std::lock_guard lock(mutex);
      errors.emplace_back(e.what());
    }
  });
  return errors;
}

TEST_CASE("version 1 (FNV-1a array checksums) and 2 (no per-tensor state) files still load on one rank and on a mesh") {
  const auto reference = uninterrupted();
  for (const std::uint32_t version : {1u, 2u}) {
    CAPTURE(version);
    TempPath file("state_v" + std::to_string(version));
    train_leg<GradientAccumulation, SingleRank>(one_rank, 0, saved_at, "", file.str());
    make_version(file.path, version);
    const io::TrainingStateInfo info = io::read_training_state_info(file.path);
    CHECK(info.version == static_cast<int>(version));
    CHECK(info.tensor_elements == 0);
    const auto resumed =
        train_leg<GradientAccumulation, SingleRank>(one_rank, saved_at, total_steps, file.str(), "", {}, {}, 99);
    CHECK(resumed.state == reference.state);
    // ZeRO-3 ranks read only their shards (version 1: the first rank reads the arrays through
    // for their sums).
    check_close(train_leg<GradientAccumulation, Zero<3>>({.dp = 2, .tp = 2, .pp = 1}, saved_at, total_steps,
                                                         file.str(), ""),
                reference, 1e-5);
    if (version != 1) continue;
    flip_byte(file.path, std::filesystem::file_size(file.path) - 200);
    const std::vector<std::string> errors = zero3_load_errors({.dp = 2, .tp = 1, .pp = 1}, file.path);
    REQUIRE(errors.size() == 2);
    const bool named = errors[0].find("checksum of array 2") != std::string::npos ||
                       errors[1].find("checksum of array 2") != std::string::npos;
    CHECK(named);
  }
}

TEST_CASE("a flipped byte is found by the ranks together, each adding up the elements it owns") {
  TempPath file("state_flip");
  train_leg<GradientAccumulation, SingleRank>(one_rank, 0, saved_at, "", file.str());
  const auto bytes = std::filesystem::file_size(file.path);
  flip_byte(file.path, bytes - 200);
  const std::vector<std::string> errors = zero3_load_errors({.dp = 2, .tp = 2, .pp = 1}, file.path);
  // Every rank names the array: the sums are compared on every rank.
  REQUIRE(errors.size() == 4);
  for (const std::string& e : errors)
    CHECK(e.find("checksum of array 2 (optimizer state slot 1)") != std::string::npos);
}

TEST_CASE("an array checksum term changes with an element's bits and with its place") {
  const std::vector<float> values{1.0f, 2.0f, 3.0f, -0.0f};
  const std::uint64_t sum = io::detail::elements_checksum(values.data(), 4, 0, 4);
  // Split at any point, the parts add up to the whole: ranks can sum their own elements.
  for (std::int64_t cut = 0; cut <= 4; ++cut)
    CHECK(io::detail::elements_checksum(values.data(), 4, 0, cut) +
              io::detail::elements_checksum(values.data() + cut, 4, cut, 4 - cut) ==
          sum);
  std::vector<float> swapped{2.0f, 1.0f, 3.0f, -0.0f}, zero{1.0f, 2.0f, 3.0f, 0.0f};
  CHECK(io::detail::elements_checksum(swapped.data(), 4, 0, 4) != sum);
  CHECK(io::detail::elements_checksum(zero.data(), 4, 0, 4) != sum);
  CHECK(io::detail::elements_checksum(values.data(), 4, 1, 4) != sum);
  // The limbs carry any 64-bit sum exactly.
  double limbs[io::detail::limbs];
  for (const std::uint64_t v : {std::uint64_t{0}, sum, ~std::uint64_t{0}}) {
    io::detail::put_limbs(v, limbs);
    CHECK(io::detail::get_limbs(limbs) == v);
  }
}

TEST_CASE("a training-state file that is not the trainer's fails with a message before anything loads") {
  TempPath file("state_bad");
  OneRank<> saver;
  saver.trainer.step(make_batch(0, global_batch, seq, state_config().vocab_size));
  io::save_training_state(saver.trainer, file.path);
  const auto bytes = std::filesystem::file_size(file.path);
  const std::vector<float> untouched = OneRank<>().trainer.gather_state(0);

  SUBCASE("a flipped byte in the optimizer state") {
    flip_byte(file.path, bytes - 200);
    OneRank<> loader;
    CHECK_THROWS_WITH(io::load_training_state(loader.trainer, file.path),
                      doctest::Contains("checksum of array 2 (optimizer state slot 1)"));
  }
  SUBCASE("a flipped byte in the header") {
    // The first parameter name, "wte", at byte 69: 8 magic, 4 + 4 + 8 + 4 + 4 of fields, the
    // optimizer's name (8 + 5), the empty meta (8), the parameter count (8) and the name's length (8).
    flip_byte(file.path, 69);
    OneRank<> loader;
    CHECK_THROWS_WITH(io::load_training_state(loader.trainer, file.path), doctest::Contains("header checksum"));
  }
  SUBCASE("a truncated file") {
    std::filesystem::resize_file(file.path, bytes - 1000);
    OneRank<> loader;
    CHECK_THROWS_WITH(io::load_training_state(loader.trainer, file.path), doctest::Contains("truncated"));
    CHECK(loader.trainer.gather_state(0) == untouched);
  }
  SUBCASE("another model config") {
    gpt2::Config other = state_config();
    other.num_layers = 3;
    OneRank<> loader(other);
    CHECK_THROWS_WITH(io::load_training_state(loader.trainer, file.path),
                      doctest::Contains("(the checkpoint is of another model)"));
    other = state_config();
    other.channels = 32;
    OneRank<> wider(other);
    CHECK_THROWS_WITH(io::load_training_state(wider.trainer, file.path),
                      doctest::Contains("shape of wte: got [64, 16]; the model's is [64, 32]"));
  }
  SUBCASE("another optimizer") {
    OneRank<SgdMomentum> loader(state_config());
    CHECK_THROWS_WITH(io::load_training_state(loader.trainer, file.path),
                      doctest::Contains("optimizer: got AdamW (2 state slots); the trainer's is SgdMomentum (1)"));
  }
  SUBCASE("not a training-state file") {
    std::ofstream(file.path, std::ios::binary) << std::string(2000, 'x');
    OneRank<> loader;
    CHECK_THROWS_WITH(io::load_training_state(loader.trainer, file.path), doctest::Contains("expected LOOMSTAT"));
  }
}

TEST_CASE("a save that fails leaves the good file where it was, and every rank hears of it") {
  TempPath file("state_keep");
  OneRank<> first;
  io::save_training_state(first.trainer, file.path);
  const auto good = std::filesystem::file_size(file.path);
  // The temporary file cannot be created: a directory is in its way.
  std::filesystem::create_directory(file.str() + ".tmp");
  threads::run(2, [&](threads::Communicator& comm) {
    using Gpt = gpt2::Model<cpu, float>;
    cpu be(1);
    Trainer<Gpt, AdamW, GradientAccumulation, DataParallel> trainer(be, comm, Gpt(state_config()), AdamW{},
                                                                     state_lr(), {.micro_batch_size = 4, .seed = 5});
    trainer.step(make_batch(0, global_batch, seq, state_config().vocab_size));
    if (comm.rank() == 0)
      CHECK_THROWS_WITH(io::save_training_state(trainer, file.path), doctest::Contains("cannot open"));
    else
      CHECK_THROWS_WITH(io::save_training_state(trainer, file.path), doctest::Contains("not saved"));
  });
  CHECK(std::filesystem::file_size(file.path) == good);
  CHECK(io::read_training_state_info(file.path).steps == 0);
}

TEST_CASE("a load that fails on one rank fails on every rank instead of leaving the others waiting") {
  TempPath file("state_one_rank");
  OneRank<> saver;
  io::save_training_state(saver.trainer, file.path);
  threads::run(2, [&](threads::Communicator& comm) {
    using Gpt = gpt2::Model<cpu, float>;
    cpu be(1);
    Trainer<Gpt, AdamW, GradientAccumulation, DataParallel> trainer(be, comm, Gpt(state_config()), AdamW{},
                                                                     state_lr(), {.micro_batch_size = 4, .seed = 5});
    if (comm.rank() == 0)
      CHECK_THROWS_WITH(io::load_training_state(trainer, file.path), doctest::Contains("another rank failed"));
    else
      CHECK_THROWS_WITH(io::load_training_state(trainer, file.str() + ".missing"), doctest::Contains("cannot open"));
  });
}

namespace {

//! A one-rank run's state saved after each of steps 1 to `last` into `series`; returns the
//! parameters after each step (index 0: after step 1).
std::vector<std::vector<float>> save_series(const io::CheckpointSeries& series, std::int64_t last) {
  OneRank<> run;
  std::vector<std::vector<float>> parameters;
  for (std::int64_t s = 0; s < last; ++s) {
    run.trainer.step(make_batch(s, global_batch, seq, state_config().vocab_size));
    io::save_training_state(run.trainer, series.path_for(s + 1));
    parameters.push_back(run.trainer.gather_state(0));
  }
  return parameters;
}

//! Whether f() throws a CorruptCheckpoint (true) or another loom::Error (false); fails if it
//! throws neither.
template <class F>
bool is_corrupt(F&& f) {
  try {
    f();
  } catch (const io::CorruptCheckpoint&) {
    return true;
  } catch (const Error&) {
    return false;
  }
  FAIL("no error");
  return false;
}

std::vector<std::int64_t> steps_of(const std::vector<io::CheckpointSeries::File>& files) {
  std::vector<std::int64_t> steps;
  for (const io::CheckpointSeries::File& f : files) steps.push_back(f.step);
  return steps;
}

}  // namespace

TEST_CASE("a damaged file raises CorruptCheckpoint; an intact file of another model a plain Error") {
  TempPath file("state_kind");
  OneRank<> saver;
  io::save_training_state(saver.trainer, file.path);
  const auto bytes = std::filesystem::file_size(file.path);
  SUBCASE("an array") {
    flip_byte(file.path, bytes - 200);
    OneRank<> loader;
    CHECK_THROWS_AS(io::load_training_state(loader.trainer, file.path), io::CorruptCheckpoint);
  }
  SUBCASE("the header") {
    flip_byte(file.path, 69);
    CHECK_THROWS_AS(io::read_training_state_info(file.path), io::CorruptCheckpoint);
  }
  SUBCASE("truncated inside the header") {
    std::filesystem::resize_file(file.path, 30);  // inside the reserved field after the state slots
    CHECK_THROWS_WITH_AS(io::read_training_state_info(file.path), doctest::Contains("the header runs past it"),
                         io::CorruptCheckpoint);
  }
  SUBCASE("another model, another optimizer, a missing file") {
    gpt2::Config other = state_config();
    other.num_layers = 3;
    OneRank<> smaller(other), loader;
    OneRank<SgdMomentum> sgd;
    CHECK_FALSE(is_corrupt([&] { io::load_training_state(smaller.trainer, file.path); }));
    CHECK_FALSE(is_corrupt([&] { io::load_training_state(sgd.trainer, file.path); }));
    CHECK_FALSE(is_corrupt([&] { io::load_training_state(loader.trainer, file.str() + ".missing"); }));
  }
}

TEST_CASE("a series resumes from its newest intact file on a mesh, and the corrupt newer ones leave the series") {
  TempPath dir("series_fallback");
  std::filesystem::create_directories(dir.path);
  const io::CheckpointSeries series(dir.path / "step{step}.state");
  const std::vector<std::vector<float>> parameters = save_series(series, 4);
  // Step 4's arrays fail their checksums only once loaded; step 3 is truncated (its header says so).
  flip_byte(series.path_for(4), std::filesystem::file_size(series.path_for(4)) - 200);
  std::filesystem::resize_file(series.path_for(3), std::filesystem::file_size(series.path_for(3)) - 1000);
  // A file already where step 4's would go aside: kept, and step 4 goes beside it.
  std::filesystem::path taken = series.path_for(4);
  taken += ".corrupt";
  std::ofstream(taken) << "kept";

  std::mutex mutex;
  std::vector<std::int64_t> accepted;
  on_state_mesh<GradientAccumulation, Zero<3>>({.dp = 2, .tp = 2, .pp = 1}, {}, {}, 5, [&](auto& trainer, int rank) {
    std::vector<std::int64_t> offered;
    const std::optional<io::SeriesCheckpoint> found =
        io::load_newest_training_state(trainer, series, [&](const io::SeriesCheckpoint& candidate) {
          offered.push_back(candidate.file.step);
          // Step 3's header was found corrupt before step 4 was offered to load.
          CHECK(candidate.skipped.size() == (candidate.file.step == 4 ? 0u : 2u));
        });
    const std::vector<float> loaded = trainer.gather_state(0);
    std::lock_guard lock(mutex);
    CAPTURE(rank);
    REQUIRE(found.has_value());
    CHECK(found->file.step == 2);
    CHECK(found->info.steps == 2);
    CHECK(trainer.steps() == 2);
    CHECK(loaded == parameters[1]);
    REQUIRE(found->skipped.size() == 2);
    CHECK(found->skipped[0].step == 4);
    CHECK(found->skipped[0].reason.find("checksum of array 2") != std::string::npos);
    CHECK(found->skipped[1].step == 3);
    CHECK(found->skipped[1].reason.find("truncated") != std::string::npos);
    if (rank == 0) {
      CHECK(found->skipped[0].moved_to.filename() == "step00000004.state.corrupt.2");
      CHECK(found->skipped[1].moved_to.filename() == "step00000003.state.corrupt");
      accepted = offered;
    }
  });
  // Steps 4 and 2 were offered to `accept`; step 3 never was.
  CHECK(accepted == std::vector<std::int64_t>{4, 2});
  CHECK(steps_of(series.list()) == std::vector<std::int64_t>{1, 2});
  CHECK(std::filesystem::exists(dir.path / "step00000003.state.corrupt"));
  CHECK(std::filesystem::exists(dir.path / "step00000004.state.corrupt.2"));
  CHECK(std::filesystem::file_size(taken) == 4);
  // The series' saves and pruning no longer see them.
  CHECK(series.prune(1, 2).removed == std::vector<std::filesystem::path>{series.path_for(1)});
}

TEST_CASE("a series resume moves nothing when no file is intact, or when a file is intact but not the trainer's") {
  TempPath dir("series_no_fallback");
  std::filesystem::create_directories(dir.path);
  const io::CheckpointSeries series(dir.path / "s{step}");
  OneRank<> loader;
  SUBCASE("an empty series") { CHECK_FALSE(io::load_newest_training_state(loader.trainer, series).has_value()); }
  SUBCASE("every file corrupt") {
    save_series(series, 2);
    for (std::int64_t step : {1, 2})
      std::filesystem::resize_file(series.path_for(step), std::filesystem::file_size(series.path_for(step)) - 8);
    CHECK_THROWS_WITH(io::load_newest_training_state(loader.trainer, series),
                      doctest::Contains("every file corrupt (steps 2, 1); there is no intact one to resume from; "
                                        "nothing was moved"));
    CHECK(steps_of(series.list()) == std::vector<std::int64_t>{1, 2});
  }
  SUBCASE("the newest is another optimizer's") {
    save_series(series, 1);
    OneRank<SgdMomentum> other;
    io::save_training_state(other.trainer, series.path_for(2));
    CHECK_THROWS_WITH(io::load_newest_training_state(loader.trainer, series),
                      doctest::Contains("optimizer: got SgdMomentum"));
    CHECK(steps_of(series.list()) == std::vector<std::int64_t>{1, 2});
  }
  SUBCASE("accept refuses the newest") {
    save_series(series, 2);
    flip_byte(series.path_for(2), 69);
    CHECK_THROWS_WITH(io::load_newest_training_state(loader.trainer, series,
                                                     [](const io::SeriesCheckpoint& c) {
                                                       throw Error("accept", c.file.step, "refused");
                                                     }),
                      doctest::Contains("accept: got 1; refused"));
    CHECK(steps_of(series.list()) == std::vector<std::int64_t>{1, 2});
    CHECK(loader.trainer.steps() == 0);
  }
}

TEST_CASE("check_training_state reads a whole file without a trainer and names the part whose bytes are wrong") {
  TempPath file("state_check");
  const auto saved = [&](auto optimizer) {
    OneRank<decltype(optimizer)> saver(state_config(), optimizer);
    saver.trainer.step(make_batch(0, global_batch, seq, state_config().vocab_size));
    io::save_training_state(saver.trainer, file.path);
    return std::filesystem::file_size(file.path);
  };
  SUBCASE("AdamW: the arrays") {
    const auto bytes = saved(AdamW{});
    const io::TrainingStateInfo info = io::check_training_state(file.path);
    CHECK(info.steps == 1);
    CHECK(info.optimizer == "AdamW");
    // A byte of the last element of each array in turn (no per-tensor state between the arrays
    // and the trailer).
    const std::uintmax_t array_bytes = static_cast<std::uintmax_t>(info.elements) * 4;
    for (int array = 2; array >= 0; --array) {
      CAPTURE(array);
      const std::uintmax_t at =
          bytes - io::detail::trailer_bytes(info.state_slots) - static_cast<std::uintmax_t>(2 - array) * array_bytes - 2;
      flip_byte(file.path, at);
      CHECK_THROWS_WITH_AS(io::check_training_state(file.path),
                           doctest::Contains((io::detail::array_name(array) + ": got").c_str()), io::CorruptCheckpoint);
      flip_byte(file.path, at);
      CHECK(io::check_training_state(file.path).steps == 1);
    }
  }
  SUBCASE("Adafactor: the per-tensor state") {
    const auto bytes = saved(Adafactor{});
    const io::TrainingStateInfo info = io::check_training_state(file.path);
    REQUIRE(info.tensor_elements > 0);
    flip_byte(file.path, bytes - io::detail::trailer_bytes(info.state_slots) - 3);
    CHECK_THROWS_WITH_AS(io::check_training_state(file.path), doctest::Contains("checksum of the per-tensor optimizer state"),
                         io::CorruptCheckpoint);
  }
  SUBCASE("versions 1 and 2") {
    for (const std::uint32_t version : {1u, 2u}) {
      CAPTURE(version);
      saved(AdamW{});
      make_version(file.path, version);
      CHECK(io::check_training_state(file.path).version == static_cast<int>(version));
      flip_byte(file.path, std::filesystem::file_size(file.path) - 100);
      CHECK_THROWS_WITH_AS(io::check_training_state(file.path), doctest::Contains("checksum of array 2"),
                           io::CorruptCheckpoint);
    }
  }
  SUBCASE("a missing file is not a corrupt one") {
    CHECK_FALSE(is_corrupt([&] { io::check_training_state(file.str() + ".missing"); }));
    CHECK_THROWS_WITH(io::check_training_state(file.str() + ".missing"), doctest::Contains("cannot open"));
  }
}

}  // namespace test_training_state
