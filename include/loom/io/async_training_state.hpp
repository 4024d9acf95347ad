#pragma once
//! \file Training-state saves that write in the background while training goes on (Megatron-LM's
//! --async-save, PyTorch DCP's async_save): the step that starts a save pays for a copy of this
//! rank's owned state in host memory, not for the writes, the checksums and the flush to the disk.
//! The file is the one save_training_state writes, byte for byte, and it appears only by the
//! rename of a complete file: until then the last good one stays.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/io/training_state.hpp"

namespace loom::io {

//! A save in the background, its trainer's type erased (AsyncTrainingStateSaver is one): for a
//! program that drives trainers of many types through one interface. Members as there.
class BackgroundSave {
 public:
  virtual ~BackgroundSave() = default;
  virtual void start(const std::filesystem::path& path, std::string_view meta = {}) = 0;
  virtual bool poll() = 0;
  virtual void wait() = 0;
  virtual bool pending() const noexcept = 0;
  virtual const std::filesystem::path& path() const noexcept = 0;
  virtual std::int64_t steps() const noexcept = 0;
  virtual std::uint64_t snapshot_bytes() const noexcept = 0;
  virtual double seconds() const = 0;
  virtual std::uint64_t buffer_bytes() const noexcept = 0;
  virtual void release_buffers() = 0;
};

//! How an AsyncTrainingStateSaver holds its copies of the state.
struct AsyncSaveOptions {
  //! Keep the host buffers that hold a save's copy for the next save (PyTorch DCP's cached staged
  //! state dict). A fresh buffer costs the first touch of its pages, several times the copy
  //! itself, in the step that starts the save; a kept one costs its memory between saves (about
  //! the rank's owned state: 12 bytes per owned parameter for fp32 AdamW).
  bool keep_buffers = true;
};

namespace detail {

//! One rank's side of background saves, for one state element type (compiled once per type, as
//! save_state is).
template <class V>
class AsyncSave {
 public:
  AsyncSave(std::unique_ptr<TrainingStateAccess<V>> trainer, AsyncSaveOptions options)
      : trainer_(std::move(trainer)), options_(options) {}
  AsyncSave(const AsyncSave&) = delete;
  AsyncSave& operator=(const AsyncSave&) = delete;
  ~AsyncSave() { abandon(); }

  bool pending() const noexcept { return state_ != State::idle; }
  const std::filesystem::path& path() const noexcept { return path_; }
  std::int64_t steps() const noexcept { return steps_; }
  std::uint64_t snapshot_bytes() const noexcept { return snapshot_bytes_; }
  double seconds() const { return std::chrono::duration<double>(Clock::now() - started_).count(); }
  std::uint64_t buffer_bytes() const noexcept {
    std::uint64_t bytes = tensor_snapshot_.capacity() * sizeof(double);
    for (const std::vector<V>& a : arrays_snapshot_) bytes += a.capacity() * sizeof(V);
    return bytes;
  }
  void release_buffers() {
    LOOM_CHECK(!pending(), "background training-state save: release_buffers", "called while " + quoted(path_) +
               " is still being saved", "wait() for the save to finish first");
    free_buffers();
  }

  void start(const std::filesystem::path& path, std::string_view meta) {
    LOOM_CHECK(!pending(), "background training-state save of " + quoted(path), "started while " + quoted(path_) +
               " is still being saved", "wait() for one save to finish before the next starts");
    started_ = Clock::now();
    path_ = path;
    tmp_ = temporary_of(path);
    steps_ = trainer_->steps();
    creator_ = trainer_->first_rank();
    arrays_ = trainer_->arrays();
    geometry_ = save_geometry(*trainer_, meta);
    // One phase: the creating rank makes the file, and every rank copies what it owns, so that
    // the trainer may change from the next step on. A failure anywhere fails every rank here.
    std::vector<double> shared(1);
    const bool failed_elsewhere = agreed_phase(
        *trainer_, shared, true,
        [&] {
          if (creator_) create_state_file(tmp_, geometry_);
          runs_ = trainer_->owned_state_runs();
          tensor_runs_ = trainer_->owned_tensor_state_runs();
          snapshot_bytes_ = 0;
          if (!runs_.empty() || !tensor_runs_.empty()) {
            arrays_snapshot_.resize(static_cast<std::size_t>(arrays_));
            for (int array = 0; array < arrays_; ++array) {
              std::vector<V>& copy = arrays_snapshot_[static_cast<std::size_t>(array)];
              trainer_->copy_owned_state(array, copy);
              snapshot_bytes_ += copy.size() * sizeof(V);
            }
            tensor_snapshot_ = trainer_->copy_tensor_state();
            snapshot_bytes_ += tensor_snapshot_.size() * sizeof(double);
          }
        },
        [&] { clear(); });
    if (failed_elsewhere)
      throw Error("training state " + quoted(path), "not saved",
                  "another rank failed to start its part; its error says why");
    state_ = State::writing;
    launch([this] {
      sums_ = write_owned_part<V>(
          tmp_, geometry_, arrays_, runs_,
          [&](int array) -> const std::vector<V>& { return arrays_snapshot_[static_cast<std::size_t>(array)]; },
          tensor_runs_, tensor_snapshot_);
    });
  }

  bool poll() {
    if (!pending()) return false;
    // Slot 0 counts the ranks whose thread failed, slot 1 those whose thread is still at work;
    // then the checksums' limbs (each array's and the per-tensor state's), as save_state sums them.
    std::vector<double> shared(2 + static_cast<std::size_t>(arrays_ + 1) * limbs, 0.0);
    const bool mine = state_ == State::writing || creator_;
    if (mine && !done_.load(std::memory_order_acquire)) {
      shared[1] = 1;
    } else if (mine) {
      if (worker_.joinable()) worker_.join();
      if (error_)
        shared[0] = 1;
      else if (state_ == State::writing)
        for (int a = 0; a <= arrays_; ++a) put_limbs(sums_[static_cast<std::size_t>(a)], shared.data() + 2 + a * limbs);
    }
    trainer_->sum_over_ranks(shared);
    if (shared[0] > 0) fail();
    if (shared[1] > 0) return false;
    if (state_ == State::finishing) {
      state_ = State::idle;
      return true;
    }
    // Every rank's part is in the file: the copies go, and the creating rank writes the trailer,
    // flushes the file and renames it, in the background too.
    std::vector<std::uint64_t> sums;
    for (int a = 0; a <= arrays_; ++a) sums.push_back(get_limbs(shared.data() + 2 + a * limbs));
    if (!options_.keep_buffers) free_buffers();
    state_ = State::finishing;
    if (creator_) launch([this, sums = std::move(sums)] { finish_state_file(tmp_, path_, geometry_, sums); });
    return false;
  }

  void wait() {
    while (pending()) {
      // This rank's own work first, so that each poll moves the save on by a phase.
      if (worker_.joinable()) worker_.join();
      if (poll()) return;
    }
  }

 private:
  using Clock = std::chrono::steady_clock;
  enum class State { idle, writing, finishing };

  template <class Work>
  void launch(Work&& work) {
    done_.store(false, std::memory_order_relaxed);
    error_ = nullptr;
    worker_ = std::thread([this, work = std::forward<Work>(work)]() mutable {
      try {
        work();
      } catch (...) {
        error_ = std::current_exception();
      }
      done_.store(true, std::memory_order_release);
    });
  }

  // Every rank has heard that a rank failed: this one's thread is stopped, the file removed, and
  // every rank throws (the failing rank its own error).
  [[noreturn]] void fail() {
    if (worker_.joinable()) worker_.join();
    const std::exception_ptr error = std::exchange(error_, nullptr);
    clear();
    if (error) std::rethrow_exception(error);
    throw Error("training state " + quoted(path_), "not saved",
                "another rank failed to write its part in the background; its error says why");
  }

  // Without the other ranks (a destructor, an exception unwinding): the save is given up, and
  // the last good file stays where it was.
  void abandon() noexcept {
    if (worker_.joinable()) worker_.join();
    if (state_ != State::idle) clear();
  }

  // After a failure the buffers go too, kept or not: the failure may have been a lack of memory.
  void clear() noexcept {
    state_ = State::idle;
    free_buffers();
    if (creator_) {
      std::error_code ignored;
      std::filesystem::remove(tmp_, ignored);
    }
  }

  void free_buffers() noexcept {
    std::vector<std::vector<V>>().swap(arrays_snapshot_);
    std::vector<double>().swap(tensor_snapshot_);
  }

  std::unique_ptr<TrainingStateAccess<V>> trainer_;
  AsyncSaveOptions options_;
  State state_ = State::idle;
  std::filesystem::path path_, tmp_;
  std::int64_t steps_ = 0;
  bool creator_ = false;
  int arrays_ = 0;
  SaveGeometry geometry_;
  std::vector<WholeRun> runs_, tensor_runs_;
  std::vector<std::vector<V>> arrays_snapshot_;
  std::vector<double> tensor_snapshot_;
  std::uint64_t snapshot_bytes_ = 0;
  Clock::time_point started_;
  // The thread at work (writing this rank's part; on the creating rank, then finishing the file),
  // what it found, and whether it is done. sums_ and error_ are read after done_ (acquire).
  std::thread worker_;
  std::atomic<bool> done_{true};
  std::exception_ptr error_;
  std::vector<std::uint64_t> sums_;
};

}  // namespace detail

//! Saves a trainer's training state in the background: one per rank, each rank's calls in the
//! same order (start, poll and wait are collective over the trainer's mesh). start() copies the
//! elements this rank owns (Trainer::owned_state_runs) into host memory and returns; a thread
//! writes them into the file while training goes on. poll(), called after each step, moves the
//! save on once every rank's thread is done: the creating rank's thread then writes the
//! checksums, flushes the file to the disk and renames it over the path. The file is
//! save_training_state's, byte for byte. A failure on any rank throws on every rank, from the
//! poll or wait that hears of it, and leaves the last good file. The trainer must outlive it;
//! destroyed with a save under way (no collective is possible then) it gives the save up. With
//! AsyncSaveOptions::keep_buffers (the default) the host buffers of one save's copy serve the next.
template <class Trainer>
class AsyncTrainingStateSaver final : public BackgroundSave {
 public:
  using state_type = typename Trainer::state_type;

  explicit AsyncTrainingStateSaver(Trainer& trainer, AsyncSaveOptions options = {})
      : save_(std::make_unique<detail::TrainerStateAccess<Trainer>>(trainer), options) {}

  //! Starts saving the trainer's state as it is now to `path`, with `meta` (as
  //! save_training_state). Collective. A save must not be under way (wait() for it).
  void start(const std::filesystem::path& path, std::string_view meta = {}) override { save_.start(path, meta); }
  //! Moves the save under way on: collective (one small all-reduce). Returns true on the call at
  //! which the file is in place, on every rank; false while there is more to do, or none.
  bool poll() override { return save_.poll(); }
  //! Returns once the save under way, if any, is in place. Collective.
  void wait() override { save_.wait(); }
  //! Whether a save is under way.
  bool pending() const noexcept override { return save_.pending(); }
  //! The file of the save under way, or of the last one.
  const std::filesystem::path& path() const noexcept override { return save_.path(); }
  //! The steps done when the save under way (or the last one) started.
  std::int64_t steps() const noexcept override { return save_.steps(); }
  //! The bytes of this rank's copy of its owned state (0 for a rank that owns none).
  std::uint64_t snapshot_bytes() const noexcept override { return save_.snapshot_bytes(); }
  //! Seconds since the save under way (or the last one) started.
  double seconds() const override { return save_.seconds(); }
  //! The bytes of host memory this rank holds for copies: the save under way's, or with
  //! keep_buffers the last save's, kept for the next.
  std::uint64_t buffer_bytes() const noexcept override { return save_.buffer_bytes(); }
  //! Frees the buffers kept for the next save (it allocates them again). Not while a save is under way.
  void release_buffers() override { save_.release_buffers(); }

 private:
  detail::AsyncSave<state_type> save_;
};

}  // namespace loom::io
