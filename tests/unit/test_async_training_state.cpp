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
#include <span>
#include <string>
#include <type_traits>
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

TEST_CASE("the buffers of one background save serve the next, and it writes the state as it is then") {
  TempPath first("state_async_first"), second("state_async_second"), now("state_async_now");
  on_mesh<DataParallel>({.dp = 2, .tp = 1, .pp = 1}, [&](auto& trainer, int rank) {
    using Tr = std::decay_t<decltype(trainer)>;
    using V = typename Tr::state_type;
    const std::uint64_t owned_bytes =
        static_cast<std::uint64_t>(trainer.owned_state_elements()) * sizeof(V) * static_cast<std::uint64_t>(Tr::state_arrays);
    CHECK(owned_bytes == (rank == 0 ? static_cast<std::uint64_t>(trainer.whole_layout().total()) * sizeof(V) * 3 : 0));
    std::vector<V> wrong(1);
    if (rank == 0)
      CHECK_THROWS_WITH(trainer.copy_owned_state(0, std::span<V>(wrong)), doctest::Contains("owned_state_elements"));

    io::AsyncTrainingStateSaver kept(trainer);
    io::AsyncTrainingStateSaver fresh(trainer, {.keep_buffers = false});
    CHECK(kept.buffer_bytes() == 0);
    step(trainer, 0);
    kept.start(first.path);
    CHECK(kept.snapshot_bytes() == owned_bytes);
    CHECK(kept.buffer_bytes() == owned_bytes);
    CHECK_THROWS_WITH(kept.release_buffers(), doctest::Contains("still being saved"));
    kept.wait();
    CHECK(kept.buffer_bytes() == owned_bytes);  // kept for the next save

    // The trainer moves on; the next save into the same buffers must hold the new state, not the
    // last save's: the same bytes as a blocking save of it.
    step(trainer, 1);
    io::save_training_state(trainer, now.path);
    kept.start(second.path);
    kept.wait();
    CHECK(file_bytes(second.path) == file_bytes(now.path));
    CHECK(file_bytes(second.path) != file_bytes(first.path));
    CHECK(io::read_training_state_info(second.path).steps == 2);
    CHECK(kept.buffer_bytes() == owned_bytes);
    kept.release_buffers();
    CHECK(kept.buffer_bytes() == 0);

    // Without keep_buffers the copy lives only while the save is under way.
    fresh.start(second.path);
    CHECK(fresh.buffer_bytes() == owned_bytes);
    fresh.wait();
    CHECK(fresh.buffer_bytes() == 0);
    CHECK(file_bytes(second.path) == file_bytes(now.path));
  });
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
