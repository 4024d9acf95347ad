// CheckpointSeries: a pattern's file names, which names are the series' own, the newest file,
// and pruning to the newest few without touching anything that is not the series'.

#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "loom/io/checkpoint_series.hpp"
#include "support/error_of.hpp"
#include "support/temp_path.hpp"

namespace {

namespace fs = std::filesystem;
using loom::io::CheckpointSeries;
using loom::test::contains;
using loom::test::error_of;

void touch(const fs::path& path) { std::ofstream(path) << "x"; }

std::vector<std::int64_t> steps_of(const std::vector<CheckpointSeries::File>& files) {
  std::vector<std::int64_t> steps;
  for (const CheckpointSeries::File& f : files) steps.push_back(f.step);
  return steps;
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("a checkpoint series names a step's file by zero-padding the step into {step}") {
  CHECK(CheckpointSeries::is_pattern("ckpt/step{step}.state"));
  CHECK_FALSE(CheckpointSeries::is_pattern("ckpt/run.state"));
  const CheckpointSeries s("ckpt/step{step}.state");
  CHECK(s.path_for(400) == fs::path("ckpt/step00000400.state"));
  CHECK(s.path_for(0) == fs::path("ckpt/step00000000.state"));
  CHECK(s.path_for(123456789) == fs::path("ckpt/step123456789.state"));
  CHECK(s.directory() == fs::path("ckpt"));
  const CheckpointSeries bare("{step}");
  CHECK(bare.path_for(7) == fs::path("00000007"));
  CHECK(bare.directory() == fs::path("."));
  CHECK(contains(error_of([&] { (void)s.path_for(-1); }), "step: got -1; must be 0 or more"));
}

TEST_CASE("a checkpoint series' own names are exactly those it writes") {
  const CheckpointSeries s("dir/step{step}.state");
  CHECK(s.step_of("step00000400.state") == 400);
  CHECK(s.step_of("step123456789.state") == 123456789);
  CHECK(s.step_of("step00000000.state") == 0);
  for (const char* other : {"step400.state", "step000000400.state", "step00000400.state.tmp", "step+0000400.state",
                            "step-0000400.state", "stepabcdefgh.state", "step.state", "xstep00000400.state",
                            "step00000400.statex", "step0000 400.state", ""})
    CHECK_MESSAGE(!s.step_of(other), other);
  // Neighbouring words of the pattern are the series' only where they match whole.
  const CheckpointSeries digits_after("a{step}1");
  CHECK(digits_after.step_of("a000000051") == 5);
  CHECK_FALSE(digits_after.step_of("a00000005"));
}

TEST_CASE("a checkpoint series refuses a pattern without {step} in its file name once") {
  CHECK(contains(error_of([] { CheckpointSeries("ckpt/run.state", "--save-state"); }),
                 "loom: --save-state: got ckpt/run.state; a checkpoint series' pattern must hold {step}"));
  CHECK(contains(error_of([] { CheckpointSeries("ckpt{step}/run.state"); }), "not in a directory"));
  CHECK(contains(error_of([] { CheckpointSeries("ckpt{step}/s{step}.state"); }), "must appear once"));
  CHECK(contains(error_of([] { CheckpointSeries("ckpt/s{step}{step}.state"); }), "must appear once"));
  CHECK(contains(error_of([] { CheckpointSeries("ckpt/{step}/"); }), "not in a directory"));
}

TEST_CASE("a checkpoint series lists its files by step and finds the newest") {
  const loom::test::TempPath dir("series_list");
  const CheckpointSeries s(dir.path / "step{step}.state");
  // No directory yet: a series not begun.
  CHECK(s.list().empty());
  CHECK_FALSE(s.latest());
  fs::create_directories(dir.path);
  CHECK_FALSE(s.latest());
  // Written out of order, with strangers around them: a sort by name would put 100000000 first.
  for (std::int64_t step : {200, 100000000, 50, 1000}) touch(s.path_for(step));
  for (const char* stranger : {"step300.state", "step00000300.state.tmp", "step00000301.bak", "notes.txt"})
    touch(dir.path / stranger);
  fs::create_directory(dir.path / "step00000999.state");  // a directory is no checkpoint
  CHECK(steps_of(s.list()) == std::vector<std::int64_t>{50, 200, 1000, 100000000});
  REQUIRE(s.latest());
  CHECK(s.latest()->step == 100000000);
  CHECK(s.latest()->path == s.path_for(100000000));
}

TEST_CASE("pruning a checkpoint series keeps the newest and deletes nothing but the series' own") {
  const loom::test::TempPath dir("series_prune");
  fs::create_directories(dir.path);
  const CheckpointSeries s(dir.path / "step{step}.state");
  for (std::int64_t step : {100, 200, 300, 400, 500}) touch(s.path_for(step));
  touch(s.path_for(250).string() + ".tmp");  // a save killed before its rename
  touch(s.path_for(600).string() + ".tmp");  // a later save's, under way or not this run's
  for (const char* stranger : {"step300.state", "step00000100.state.bak", "other00000100.state"})
    touch(dir.path / stranger);
  CHECK(contains(error_of([&] { (void)s.prune(0, 500); }), "checkpoints to keep: got 0; must be at least 1"));

  // Saved after step 400 of a run resumed from 300: 500 is not this run's to judge.
  CheckpointSeries::Pruned pruned = s.prune(2, 400);
  CHECK(pruned.failures.empty());
  CHECK(pruned.removed.size() == 3);  // 100, 200 and 250's .tmp
  CHECK(names_in(dir.path) == std::vector<std::string>{"other00000100.state", "step00000100.state.bak",
                                                       "step00000300.state", "step00000400.state",
                                                       "step00000500.state", "step00000600.state.tmp",
                                                       "step300.state"});
  pruned = s.prune(1, 500);
  CHECK(pruned.removed == std::vector<fs::path>{s.path_for(300), s.path_for(400)});
  CHECK(steps_of(s.list()) == std::vector<std::int64_t>{500});
  // Nothing left to delete: nothing removed, nothing failed.
  pruned = s.prune(3, 500);
  CHECK(pruned.removed.empty());
  CHECK(pruned.failures.empty());
}
