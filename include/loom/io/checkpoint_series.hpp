#pragma once
//! \file Checkpoint series: one file per saved step, named by a pattern such as
//! "ckpt/step{step}.state", so that a run keeps several checkpoints instead of one it overwrites,
//! finds the newest to resume from, and deletes all but the newest few of its own.
//!
//! A pattern holds "{step}" once, in its file name (not in a directory); a step's file replaces
//! it with the step zero-padded to 8 digits ("ckpt/step00000400.state"), so that the files sort
//! by name in step order up to step 99,999,999 and by the number after. Only names a series
//! itself would write are its own: "step400.state" or "step00000400.state.bak" are not
//! "ckpt/step{step}.state"'s, and nothing but its own is ever listed or deleted.

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "loom/core/error.hpp"

namespace loom::io {

//! The checkpoint files of one run, one per saved step, named by a pattern holding "{step}".
class CheckpointSeries {
 public:
  //! What a pattern holds where a file's step goes.
  static constexpr std::string_view placeholder = "{step}";
  //! The fewest digits a step is written with (zero-padded).
  static constexpr int min_digits = 8;

  //! One file of the series.
  struct File {
    std::int64_t step;           //!< the step it was saved after
    std::filesystem::path path;  //!< the pattern's directory joined with its name
  };

  //! Whether `path` is a pattern (holds "{step}") rather than one file's name.
  static bool is_pattern(std::string_view path) noexcept { return path.find(placeholder) != std::string_view::npos; }

  //! A series named by `pattern`, which must hold "{step}" exactly once, in its file name.
  //! `flag` names where the pattern came from in error messages (e.g. "--save-state").
  explicit CheckpointSeries(const std::filesystem::path& pattern, std::string flag = "checkpoint series")
      : pattern_(pattern), flag_(std::move(flag)) {
    const std::string text = pattern.string();
    const std::string name = pattern.filename().string();
    const std::size_t at = name.find(placeholder);
    LOOM_CHECK(is_pattern(text), flag_, text, "a checkpoint series' pattern must hold {step}, where a file's step goes");
    LOOM_CHECK(at != std::string::npos, flag_, text,
               "{step} must be in the file's name, not in a directory (one directory holds the series)");
    LOOM_CHECK(name.find(placeholder, at + placeholder.size()) == std::string::npos &&
                   text.find(placeholder) == text.size() - name.size() + at,
               flag_, text, "{step} must appear once");
    directory_ = pattern.has_parent_path() ? pattern.parent_path() : std::filesystem::path(".");
    prefix_ = name.substr(0, at);
    suffix_ = name.substr(at + placeholder.size());
  }

  //! The pattern, as given.
  const std::filesystem::path& pattern() const noexcept { return pattern_; }
  //! The directory the series' files are in ("." for a pattern without one).
  const std::filesystem::path& directory() const noexcept { return directory_; }

  //! The file of the checkpoint saved after `step` (>= 0).
  std::filesystem::path path_for(std::int64_t step) const {
    LOOM_CHECK(step >= 0, flag_ + ": step", step, "must be 0 or more");
    return pattern_.has_parent_path() ? pattern_.parent_path() / file_name(step) : std::filesystem::path(file_name(step));
  }

  //! The step of a file name this series writes (a name alone, no directory), if it is one.
  std::optional<std::int64_t> step_of(std::string_view name) const {
    if (name.size() <= prefix_.size() + suffix_.size() || !name.starts_with(prefix_) || !name.ends_with(suffix_))
      return std::nullopt;
    const std::string_view digits = name.substr(prefix_.size(), name.size() - prefix_.size() - suffix_.size());
    std::int64_t step = 0;
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
    if (ec != std::errc() || end != digits.data() + digits.size() || step < 0) return std::nullopt;
    // Exactly as this series would write it: no sign, no missing or extra zeros.
    if (file_name(step) != name) return std::nullopt;
    return step;
  }

  //! The series' files that exist, by step, oldest first; none when the directory does not exist.
  //! A save's unfinished ".tmp" file is not one of them.
  std::vector<File> list() const { return scan(suffix_); }

  //! The file with the highest step, if there is any.
  std::optional<File> latest() const {
    std::vector<File> files = list();
    if (files.empty()) return std::nullopt;
    return files.back();
  }

  //! What prune removed, or failed to.
  struct Pruned {
    std::vector<std::filesystem::path> removed;  //!< files deleted
    std::vector<std::string> failures;           //!< "path: reason" for each file that could not be
  };

  //! Deletes the series' files older than the newest `keep` of those saved at or before
  //! `newest_step` (the step just saved), and the ".tmp" files that saves before it left
  //! unfinished (a process killed mid-save). Files after `newest_step` are not this run's to
  //! judge and are left alone. Never throws for a file it cannot delete: a run must not stop
  //! because an old checkpoint stays; the failure is reported instead.
  Pruned prune(std::int64_t keep, std::int64_t newest_step) const {
    LOOM_CHECK(keep >= 1, flag_ + ": checkpoints to keep", keep, "must be at least 1 (the one just saved)");
    std::vector<File> doomed;
    std::vector<File> files = list();
    std::erase_if(files, [&](const File& f) { return f.step > newest_step; });
    if (files.size() > static_cast<std::size_t>(keep))
      doomed.assign(files.begin(), files.end() - static_cast<std::ptrdiff_t>(keep));
    for (File& f : scan(suffix_ + ".tmp"))
      if (f.step < newest_step) doomed.push_back(std::move(f));
    Pruned out;
    for (const File& f : doomed) {
      std::error_code ec;
      if (std::filesystem::remove(f.path, ec) && !ec)
        out.removed.push_back(f.path);
      else if (ec)
        out.failures.push_back(f.path.string() + ": " + ec.message());
    }
    return out;
  }

 private:
  std::string file_name(std::int64_t step) const {
    std::string digits = std::to_string(step);
    if (digits.size() < static_cast<std::size_t>(min_digits))
      digits.insert(0, static_cast<std::size_t>(min_digits) - digits.size(), '0');
    return prefix_ + digits + suffix_;
  }

  // The directory's regular files named prefix, step, `suffix`, by step.
  std::vector<File> scan(const std::string& suffix) const {
    std::vector<File> files;
    std::error_code ec;
    std::filesystem::directory_iterator it(directory_, ec);
    if (ec) {
      // A series not begun has no directory yet; any other failure would hide checkpoints.
      if (ec == std::errc::no_such_file_or_directory) return files;
      throw Error(flag_ + ": listing " + directory_.string(), ec.message(), "the directory must be readable");
    }
    for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
      if (ec) throw Error(flag_ + ": listing " + directory_.string(), ec.message(), "the directory must be readable");
      const std::string name = it->path().filename().string();
      if (!name.ends_with(suffix)) continue;
      const std::string base = name.substr(0, name.size() - suffix.size()) + suffix_;
      const std::optional<std::int64_t> step = step_of(base);
      std::error_code type_ec;
      if (step && it->is_regular_file(type_ec)) files.push_back(File{*step, it->path()});
    }
    std::sort(files.begin(), files.end(), [](const File& a, const File& b) { return a.step < b.step; });
    return files;
  }

  std::filesystem::path pattern_;
  std::string flag_;
  std::filesystem::path directory_;
  std::string prefix_, suffix_;
};

}  // namespace loom::io
