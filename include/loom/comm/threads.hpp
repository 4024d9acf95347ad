#pragma once
//! \file loom::threads: a Communicator whose ranks are threads of one process, sharing memory.
//! The embedded default: no setup, and the reference every other communicator is tested
//! against.
//!
//!     loom::threads::run(8, [](loom::threads::Communicator& comm) {
//!       std::vector<float> gradients(1 << 20, 1.0f);
//!       comm.all_reduce(std::span(gradients), loom::ReduceOp::average);
//!     });
//!
//! Collectives are bandwidth-optimal: each rank reduces its own chunk of every rank's buffer and
//! writes the result into every rank's buffer (reduce-scatter and all-gather fused, in
//! cache-sized blocks), in the fixed order rank 0, 1, ..., so every rank gets bit-identical
//! results that do not depend on timing; no allocation per call. Asynchronous collectives run
//! in order on a worker thread per communicator object; send and recv match in mailboxes and
//! need no worker. Failures are loud: an exception on one rank, ranks that disagree on a call,
//! or a rank missing for longer than CommOptions::timeout become a loom::Error on every rank,
//! and the world stays poisoned so later calls throw at once.

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "loom/comm/collectives.hpp"
#include "loom/comm/concepts.hpp"
#include "loom/comm/detail/threads_group.hpp"
#include "loom/comm/request.hpp"
#include "loom/core/error.hpp"

namespace loom::threads {

namespace detail {
struct Launcher;
}

//! One rank's handle on a group of ranks that are threads of one process. Made by
//! loom::threads::run (the world) and by split (sub-groups). Use it from one thread at a time;
//! move it freely (requests and the worker do not refer to the object itself).
class Communicator : public CollectiveInterface<Communicator> {
 public:
  //! Opts in to the loom::Communicator concept.
  using loom_communicator = void;

  //! Takes over `other`'s place in the group, its worker and its requests in flight; `other`
  //! may then only be destroyed or assigned to.
  Communicator(Communicator&& other) noexcept
      : group_(std::move(other.group_)), executor_(std::move(other.executor_)), rank_(other.rank_) {}
  //! Finishes this object's asynchronous collectives, then takes over `other` as above.
  Communicator& operator=(Communicator&& other) noexcept {
    if (this != &other) {
      stop();
      group_ = std::move(other.group_);
      executor_ = std::move(other.executor_);
      rank_ = other.rank_;
    }
    return *this;
  }
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;
  //! Finishes this object's asynchronous collectives, then stops its worker.
  ~Communicator() { stop(); }

  //! This rank in the group, in [0, size()).
  int rank() const noexcept { return rank_; }
  //! Ranks in the group.
  int size() const noexcept { return group_->size(); }
  //! The options given to loom::threads::run (shared by every group of that world).
  const CommOptions& options() const noexcept { return group_->world().options(); }

  //! Runs `call` and returns when it has completed on this rank. Runs after the asynchronous
  //! collectives already started on this object (issue order is kept).
  void run(const CollectiveCall& call) {
    check(call);
    if (is_point_to_point(call)) {
      Request request = start_point_to_point(call);
      request.wait();
      return;
    }
    if (executor_ && !executor_->idle()) executor_->drain();
    group_->run(rank_, call);
  }

  //! Starts `call` and returns its Request at once. Collectives run in issue order on this
  //! object's worker thread; send and recv are matched in the peers' mailboxes (whichever
  //! side arrives second copies). The buffers must stay alive until the request completes.
  Request start(const CollectiveCall& call) {
    check(call);
    group_->world().throw_if_poisoned();
    if (is_point_to_point(call)) return start_point_to_point(call);
    if (!executor_) executor_ = std::make_shared<loom::threads::detail::Executor>(group_, rank_);
    return Request(CollectiveState{executor_, executor_->submit(call)});
  }

  //! Collective over the group: the ranks that pass the same `color` (>= 0) form a new group,
  //! ranked by `key`, then by rank in this group.
  Communicator split(int color, int key) {
    LOOM_CHECK(color >= 0, "threads communicator: split color", color, "must be >= 0");
    if (executor_ && !executor_->idle()) executor_->drain();
    auto [group, rank] = group_->split(rank_, color, key);
    return Communicator(std::move(group), rank);
  }

 private:
  friend struct detail::Launcher;

  Communicator(std::shared_ptr<loom::threads::detail::Group> group, int rank) noexcept
      : group_(std::move(group)), rank_(rank) {}

  //! A started collective: its place in the worker's queue.
  struct CollectiveState {
    std::shared_ptr<loom::threads::detail::Executor> executor;
    std::uint64_t ticket = 0;
    void wait() { executor->wait(ticket); }
    bool test() { return executor->test(ticket); }
  };
  //! A posted send or recv that its peer has not matched yet.
  struct PointToPointState {
    std::shared_ptr<loom::threads::detail::Group> group;
    loom::threads::detail::PointToPointRecord* record = nullptr;
    int rank = 0;

    PointToPointState(std::shared_ptr<loom::threads::detail::Group> g,
                      loom::threads::detail::PointToPointRecord* r, int owner) noexcept
        : group(std::move(g)), record(r), rank(owner) {}
    PointToPointState(PointToPointState&& other) noexcept
        : group(std::move(other.group)), record(std::exchange(other.record, nullptr)), rank(other.rank) {}
    PointToPointState& operator=(PointToPointState&&) = delete;
    ~PointToPointState() {
      if (record == nullptr) return;
      // Request waits before destroying its state; this covers any other path, because the
      // record must not be reused while a peer may still complete it.
      if (record->state.load(std::memory_order_acquire) == loom::threads::detail::PointToPointRecord::pending) {
        try {
          group->wait(rank, record);
        } catch (...) {
        }
      }
      group->release(rank, record);
    }
    void wait() { group->wait(rank, record); }
    bool test() { return group->test(rank, record); }
  };

  static bool is_point_to_point(const CollectiveCall& call) noexcept {
    return call.kind == Collective::send || call.kind == Collective::recv;
  }

  //! The checks CollectiveInterface cannot make for a CollectiveCall passed in directly.
  void check(const CollectiveCall& call) const {
    LOOM_CHECK(group_ != nullptr, "threads communicator", "a moved-from communicator", "must not be used");
    if (call.kind == Collective::broadcast || is_point_to_point(call))
      LOOM_CHECK(call.peer >= 0 && call.peer < size(), "threads communicator: peer of " + text(call), call.peer,
                 "must be a rank of the group, in [0, " + std::to_string(size()) + ")");
    if (is_point_to_point(call))
      LOOM_CHECK(call.peer != rank_, "threads communicator: peer of " + text(call), call.peer,
                 "must differ from this rank");
  }
  static std::string text(const CollectiveCall& call) { return loom::threads::detail::text(call); }

  Request start_point_to_point(const CollectiveCall& call) {
    loom::threads::detail::PointToPointRecord* record = group_->post(rank_, call);
    if (record == nullptr) return Request();
    return Request(PointToPointState(group_, record, rank_));
  }

  void stop() noexcept {
    if (executor_) executor_->stop();
    executor_.reset();
  }

  std::shared_ptr<loom::threads::detail::Group> group_;
  std::shared_ptr<loom::threads::detail::Executor> executor_;  //!< made at the first start()
  int rank_ = 0;
};

static_assert(loom::Communicator<Communicator>);

namespace detail {

//! The text of an exception, for the message the other ranks see.
inline std::string what_of(const std::exception_ptr& failure) {
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

//! Makes the world communicator of each rank (Communicator's constructor is private).
struct Launcher {
  static Communicator make(std::shared_ptr<Group> group, int rank) { return Communicator(std::move(group), rank); }
};

}  // namespace detail

//! Runs `fn(loom::threads::Communicator&)` on `ranks` threads, one per rank of a new world, and
//! joins them. If a rank throws, the others fail in their next (or current) operation with a
//! loom::Error "rank r failed: ...", and the first failure (the root cause, not the errors it
//! caused on the other ranks) is rethrown here once all ranks have returned.
template <class Fn>
void run(int ranks, Fn fn, CommOptions options = {}) {
  LOOM_CHECK(ranks >= 1, "threads::run: ranks", ranks, "must be >= 1");
  LOOM_CHECK(options.timeout.count() > 0, "threads::run: options.timeout (ms)", options.timeout.count(),
             "must be > 0");
  auto world = std::make_shared<detail::World>(ranks, options);
  std::vector<int> world_ranks(static_cast<std::size_t>(ranks));
  std::iota(world_ranks.begin(), world_ranks.end(), 0);
  auto group = std::make_shared<detail::Group>(world, std::move(world_ranks));
  std::vector<std::exception_ptr> failures(static_cast<std::size_t>(ranks));

  auto body = [&](int rank) {
    {
      // Made outside the try: if fn throws, the world is poisoned before this communicator's
      // worker is joined, so that the worker does not wait for peers that wait for this rank.
      Communicator comm = detail::Launcher::make(group, rank);
      try {
        fn(comm);
      } catch (...) {
        failures[static_cast<std::size_t>(rank)] = std::current_exception();
        world->poison(rank, "threads communicator: rank " + std::to_string(rank) + " failed: " +
                                detail::what_of(failures[static_cast<std::size_t>(rank)]));
        world->wake_all();
      }
    }
    world->mark_exited(rank);
  };

  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(ranks));
  try {
    for (int rank = 0; rank < ranks; ++rank) threads.emplace_back(body, rank);
  } catch (...) {
    world->poison(-1, "threads communicator: could not start a thread for every rank");
    world->wake_all();
    for (auto& thread : threads) thread.join();
    throw;
  }
  for (auto& thread : threads) thread.join();
  group.reset();

  const int root = world->root_cause_rank();
  if (root >= 0 && failures[static_cast<std::size_t>(root)]) std::rethrow_exception(failures[static_cast<std::size_t>(root)]);
  for (const auto& failure : failures)
    if (failure) std::rethrow_exception(failure);
}

}  // namespace loom::threads
