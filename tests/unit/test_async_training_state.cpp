// Training-state saves in the background (io/async_training_state.hpp): the file is
// save_training_state's, byte for byte, though the trainer moves on while it is written; every
// rank hears of a failure on any rank; a save given up leaves the last good file. Under the tsan
// preset too (CI): the writer threads run beside the thread ranks' training.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/io/async_training_state.hpp"
#include "loom/io/training_state.hpp"
#include "loom/loom.hpp"
#include "support/state_mesh.hpp"
#include "support/temp_path.hpp"
#include "support/training.hpp"

namespace test_async_training_state {

using namespace loom;
using namespace loom::test;

namespace {

constexpr std::int64_t saved_at = state_saved_at;

//! Calls f(trainer, world rank) on every thread rank of `shape`, each with a trainer of strategy
//! `St` (support/state_mesh.hpp).
template <class St, class F>
void on_mesh(MeshShape shape, F&& f) {
  on_state_mesh<GradientAccumulation, St>(shape, St{}, GradientAccumulation{}, 5, std::forward<F>(f));
}

template <class Trainer>
void step(Trainer& trainer, std::int64_t s) {
  trainer.step(make_batch(s, state_batch, state_seq, state_config().vocab_size));
}

//! The bytes of the file at `path`.
std::vector<char> file_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

template <class St>
void check_same_file(MeshShape shape) {
  TempPath now("state_sync"), background("state_async");
  std::mutex mutex;
  std::vector<int> finished_at;  // the step after which each rank's poll said "in place"
  on_mesh<St>(shape, [&](auto& trainer, int) {
    io::AsyncTrainingStateSaver saver(trainer);
    CHECK_FALSE(saver.poll());  // nothing under way
    for (std::int64_t s = 0; s < saved_at; ++s) step(trainer, s);
    io::save_training_state(trainer, now.path, "{\"test\": true}");
    saver.start(background.path, "{\"test\": true}");
    CHECK(saver.pending());
    CHECK(saver.steps() == saved_at);
    CHECK_THROWS_WITH(saver.start(background.path), doctest::Contains("wait() for one save to finish"));
    // The trainer moves on while the copy is written: the file must hold step 3's state.
    int finished = -1;
    for (std::int64_t s = saved_at; s < state_steps; ++s) {
      step(trainer, s);
      if (saver.poll()) finished = static_cast<int>(s + 1);
    }
    if (finished < 0) {
      saver.wait();
      finished = 0;
    }
    CHECK_FALSE(saver.pending());
    std::lock_guard lock(mutex);
    finished_at.push_back(finished);
  });
  // Every rank heard that the file was in place after the same step.
  CHECK(std::adjacent_find(finished_at.begin(), finished_at.end(), std::not_equal_to<>()) == finished_at.end());
  CHECK(file_bytes(background.path) == file_bytes(now.path));
  CHECK(io::read_training_state_info(background.path).steps == saved_at);
  CHECK_FALSE(std::filesystem::exists(background.str() + ".tmp"));
}

}  // namespace

TEST_CASE("a background save writes save_training_state's file, byte for byte, while training goes on") {
  SUBCASE("Zero<1> on DP2 x TP2: every rank writes its part") { check_same_file<Zero<1>>({.dp = 2, .tp = 2, .pp = 1}); }
  SUBCASE("DDP on DP2: the second replica owns nothing") { check_same_file<DataParallel>({.dp = 2, .tp = 1, .pp = 1}); }
  SUBCASE("one rank") { check_same_file<SingleRank>({.dp = 1, .tp = 1, .pp = 1}); }
}

TEST_CASE("a background save that fails leaves the good file, and every rank hears of it") {
  TempPath file("state_async_keep"), blocked("state_async_blocked");
  on_mesh<SingleRank>({.dp = 1, .tp = 1, .pp = 1}, [&](auto& trainer, int) { io::save_training_state(trainer, file.path); });
  const auto good = file_bytes(file.path);
  on_mesh<Zero<1>>({.dp = 2, .tp = 1, .pp = 1}, [&](auto& trainer, int rank) {
    std::vector<double> nothing{0.0};
    const auto barrier = [&] { trainer.sum_over_ranks(nothing); };
    step(trainer, 0);
    io::AsyncTrainingStateSaver saver(trainer);

    // The file cannot be created (a directory is in the way): every rank throws from start.
    if (rank == 0) std::filesystem::create_directory(file.str() + ".tmp");
    barrier();
    CHECK_THROWS_WITH(saver.start(file.path), doctest::Contains(rank == 0 ? "cannot open" : "not saved"));
    CHECK_FALSE(saver.pending());
    barrier();
    if (rank == 0) std::filesystem::remove(file.str() + ".tmp");

    // The rename fails in the background (a directory where the file goes; rank 0 puts it there
    // before its wait, whose first poll every rank must pass before the rename is tried): every
    // rank throws from wait, and the temporary file goes.
    saver.start(blocked.path);
    if (rank == 0) std::filesystem::create_directories(blocked.path / "inside");
    CHECK_THROWS_WITH(saver.wait(), doctest::Contains(rank == 0 ? "renaming" : "another rank failed"));
    CHECK_FALSE(saver.pending());
    barrier();
    CHECK_FALSE(std::filesystem::exists(blocked.str() + ".tmp"));

    // Destroyed with a save under way: given up, with no temporary file left and the good file
    // as it was.
    {
      io::AsyncTrainingStateSaver doomed(trainer);
      doomed.start(file.path);
    }
    barrier();
    CHECK_FALSE(std::filesystem::exists(file.str() + ".tmp"));
  });
  CHECK(file_bytes(file.path) == good);
}

}  // namespace test_async_training_state
