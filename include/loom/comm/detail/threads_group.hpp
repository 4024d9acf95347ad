#pragma once
//! \file The shared state behind loom::threads::Communicator: the World (one per
//! loom::threads::run: failure and exit records), the Group (one per communicator group: the
//! barrier, the posted calls, the point-to-point mailboxes) and the Executor (one per
//! communicator object: the worker thread of asynchronous collectives).
//!
//! Protocol of a collective: every rank posts its call in its slot and arrives at the group's
//! barrier; the last to arrive checks that the calls agree. Then each rank works on its own
//! part of the data straight in the other ranks' buffers (all of them are alive and posted),
//! and a second barrier keeps the buffers alive until every rank is done with them. Only the
//! first barrier may fail (failure of a peer, timeout, a peer that returned): once a rank is
//! past it, the data phase cannot block, so the second barrier always completes.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "loom/comm/concepts.hpp"
#include "loom/comm/detail/reduce.hpp"
#include "loom/core/error.hpp"

namespace loom::threads::detail {

using Clock = std::chrono::steady_clock;

//! Tells the processor that this thread is spinning (lets a sibling hyper-thread run).
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

//! Spinning before sleeping: short, because up to 8 ranks and their workers share few cores.
inline constexpr int relax_spins = 16;
inline constexpr int yield_spins = 16;

//! Throws loom::Error whose what() is "loom: " + message.
[[noreturn]] inline void raise(const std::string& message) { throw Error(message, "", ""); }

inline std::string text(const CollectiveCall& call) {
  std::ostringstream out;
  out << call;
  return out.str();
}

class Group;

//! What all ranks of one loom::threads::run share: the first failure (which poisons every
//! group, so that later operations throw at once), which ranks have returned from their
//! function, and the groups to wake when either changes.
class World {
 public:
  World(int size, CommOptions options)
      : size_(size), options_(options), exited_(std::make_unique<std::atomic<bool>[]>(static_cast<std::size_t>(size))) {}
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int size() const noexcept { return size_; }
  const CommOptions& options() const noexcept { return options_; }

  bool poisoned() const noexcept { return poison_state_.load(std::memory_order_acquire) != unpoisoned; }
  //! Records the first failure (later ones are consequences and are dropped); returns whether
  //! this one was the first. Lock-free, so that it may be called under a group's lock; call
  //! wake_all() afterwards, with no lock held.
  bool poison(int world_rank, std::string message) noexcept {
    int expected = unpoisoned;
    if (!poison_state_.compare_exchange_strong(expected, writing, std::memory_order_acq_rel)) return false;
    poison_message_ = std::move(message);
    root_cause_rank_ = world_rank;
    poison_state_.store(written, std::memory_order_release);
    return true;
  }
  //! The message of the first failure (waits for its writer, which is between two stores).
  const std::string& poison_message() const noexcept {
    while (poison_state_.load(std::memory_order_acquire) == writing) std::this_thread::yield();
    return poison_message_;
  }
  [[noreturn]] void throw_poisoned() const { raise(poison_message()); }
  void throw_if_poisoned() const {
    if (poisoned()) [[unlikely]]
      throw_poisoned();
  }
  //! The world rank whose failure came first, or -1.
  int root_cause_rank() const noexcept {
    if (!poisoned()) return -1;
    while (poison_state_.load(std::memory_order_acquire) == writing) std::this_thread::yield();
    return root_cause_rank_;
  }

  //! Called once rank `world_rank` has returned from its function: peers waiting for it fail.
  void mark_exited(int world_rank) {
    exited_[static_cast<std::size_t>(world_rank)].store(true, std::memory_order_release);
    wake_all();
  }
  bool exited(int world_rank) const noexcept {
    return exited_[static_cast<std::size_t>(world_rank)].load(std::memory_order_acquire);
  }

  //! Wakes every sleeper of every group so that it sees a failure or an exit.
  void wake_all();
  void enroll(Group* group) {
    std::lock_guard lock(registry_mutex_);
    groups_.push_back(group);
  }
  void withdraw(Group* group) noexcept {
    std::lock_guard lock(registry_mutex_);
    groups_.erase(std::find(groups_.begin(), groups_.end(), group));
  }

 private:
  static constexpr int unpoisoned = 0, writing = 1, written = 2;
  const int size_;
  const CommOptions options_;
  std::atomic<int> poison_state_{unpoisoned};
  std::string poison_message_;
  int root_cause_rank_ = -1;
  std::unique_ptr<std::atomic<bool>[]> exited_;
  std::mutex registry_mutex_;  // order: registry_mutex_, then a group's locks
  std::vector<Group*> groups_;
};

//! One pending send or recv, owned by the rank that posted it, completed by its peer.
struct PointToPointRecord {
  //! `withdrawn`: taken back by its owner after a failure; no peer will complete it.
  static constexpr int pending = 0, done = 1, failed = 2, withdrawn = 3;
  std::atomic<int> state{pending};
  std::string error;  //!< written before `state` becomes `failed`
  CollectiveCall call;
};

//! The ranks of one communicator group and what they share.
class Group {
 public:
  //! `world_ranks[r]` is the world rank of group rank r.
  Group(std::shared_ptr<World> world, std::vector<int> world_ranks)
      : world_(std::move(world)),
        world_ranks_(std::move(world_ranks)),
        size_(static_cast<int>(world_ranks_.size())),
        slots_(world_ranks_.size()),
        arrivals_(world_ranks_.size(), 0),
        pointers_(2 * world_ranks_.size() * world_ranks_.size()),
        channels_(std::make_unique<Channel[]>(world_ranks_.size() * world_ranks_.size())),
        inboxes_(std::make_unique<Inbox[]>(world_ranks_.size())) {
    world_->enroll(this);
  }
  ~Group() { world_->withdraw(this); }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  int size() const noexcept { return size_; }
  World& world() const noexcept { return *world_; }
  int world_rank(int rank) const noexcept { return world_ranks_[static_cast<std::size_t>(rank)]; }

  //! "rank 2", or "rank 2 (world rank 5)" in a group made by split.
  std::string describe_rank(int rank) const {
    std::string out = "rank " + std::to_string(rank);
    if (size_ != world_->size() || world_rank(rank) != rank)
      out += " (world rank " + std::to_string(world_rank(rank)) + ")";
    return out;
  }

  //! Runs collective `call` (not send or recv) as group rank `rank`, blocking.
  void run(int rank, const CollectiveCall& call) {
    world_->throw_if_poisoned();
    if (size_ == 1) return run_alone(call);
    Slot& slot = slots_[static_cast<std::size_t>(rank)];
    slot.call = call;
    slot.split = false;
    arrive(rank, Phase::arrive);
    if (call.kind == Collective::barrier) return;
    if (call.count > 0) execute(rank, call);
    arrive(rank, Phase::finish);
  }

  //! The collective part of Communicator::split: returns the new group and this rank in it.
  std::pair<std::shared_ptr<Group>, int> split(int rank, int color, int key) {
    world_->throw_if_poisoned();
    if (size_ == 1) return {std::make_shared<Group>(world_, world_ranks_), 0};
    Slot& mine = slots_[static_cast<std::size_t>(rank)];
    mine.split = true;
    mine.color = color;
    mine.key = key;
    arrive(rank, Phase::arrive);
    // The lowest rank of each color builds that color's group; the others pick it up from its slot.
    int leader = 0;
    while (slots_[static_cast<std::size_t>(leader)].color != color) ++leader;
    std::vector<int> members;
    for (int r = 0; r < size_; ++r)
      if (slots_[static_cast<std::size_t>(r)].color == color) members.push_back(r);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
      return slots_[static_cast<std::size_t>(a)].key < slots_[static_cast<std::size_t>(b)].key;
    });
    if (leader == rank) {
      try {
        std::vector<int> ranks;
        for (int r : members) ranks.push_back(world_rank(r));
        mine.split_group = std::make_shared<Group>(world_, std::move(ranks));
      } catch (...) {
        mine.split_group = nullptr;  // every member reports it below
      }
    }
    arrive(rank, Phase::finish);
    std::shared_ptr<Group> group = slots_[static_cast<std::size_t>(leader)].split_group;
    arrive(rank, Phase::finish);
    if (leader == rank) mine.split_group.reset();
    if (!group) raise("threads communicator: split could not create the group of color " + std::to_string(color));
    const int new_rank = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    return {std::move(group), new_rank};
  }

  //! Posts send or recv `call` of group rank `rank`. When the peer's matching call is already
  //! posted, copies at once and returns nullptr; otherwise returns the record to wait on (the
  //! peer copies when it arrives). A count or type mismatch fails both sides.
  PointToPointRecord* post(int rank, const CollectiveCall& call) {
    const bool sending = call.kind == Collective::send;
    Channel& channel = channel_of(rank, call);
    PointToPointRecord* match = nullptr;
    {
      std::lock_guard lock(channel.mutex);
      world_->throw_if_poisoned();
      auto& theirs = sending ? channel.receives : channel.sends;
      auto found = std::find_if(theirs.begin(), theirs.end(),
                                [&](const PointToPointRecord* r) { return r->call.tag == call.tag; });
      if (found == theirs.end()) {
        PointToPointRecord* mine = acquire_record(rank);
        mine->call = call;
        mine->error.clear();
        mine->state.store(PointToPointRecord::pending, std::memory_order_relaxed);
        (sending ? channel.sends : channel.receives).push_back(mine);
        return mine;
      }
      match = *found;
      theirs.erase(found);
    }
    const CollectiveCall& other = match->call;
    if (other.count != call.count || other.dtype != call.dtype) {
      const bool first = rank < call.peer;
      const std::string message = "threads communicator: send and recv disagree: " +
                                  describe_rank(first ? rank : call.peer) + " called " + text(first ? call : other) +
                                  ", " + describe_rank(first ? call.peer : rank) + " called " +
                                  text(first ? other : call);
      complete(call.peer, match, message);
      raise(message);
    }
    if (call.count > 0)
      std::memcpy(sending ? other.output : call.output, sending ? call.input : other.input, call.bytes());
    complete(call.peer, match, {});
    return nullptr;
  }

  //! Blocks until `record` of rank `rank` completes; fails on a peer's failure, on the timeout,
  //! or when the peer has returned from its function.
  void wait(int rank, PointToPointRecord* record) {
    Inbox& inbox = inboxes_[static_cast<std::size_t>(rank)];
    const auto deadline = Clock::now() + world_->options().timeout;
    bool matched = false;  // taken by the peer, who is copying: it will complete without blocking
    std::unique_lock lock(inbox.mutex);
    for (;;) {
      const int state = record->state.load(std::memory_order_acquire);
      if (state == PointToPointRecord::done) return;
      if (state == PointToPointRecord::failed) raise(record->error);
      if (state == PointToPointRecord::withdrawn) world_->throw_poisoned();
      if (matched) {
        inbox.cv.wait(lock);
        continue;
      }
      const bool poisoned = world_->poisoned();
      std::string failure;
      if (!poisoned) {
        if (world_->exited(world_rank(record->call.peer)))
          failure = point_to_point_failure(rank, record->call, "returned from its function without");
        else if (Clock::now() >= deadline)
          failure = point_to_point_failure(rank, record->call, "did not") + " within " +
                    std::to_string(world_->options().timeout.count()) + " ms";
      }
      if (!poisoned && failure.empty()) {
        inbox.cv.wait_until(lock, deadline);
        continue;
      }
      lock.unlock();
      if (cancel(rank, record)) {
        if (poisoned) world_->throw_poisoned();
        world_->poison(world_rank(rank), failure);
        world_->wake_all();
        raise(failure);
      }
      matched = true;
      lock.lock();
    }
  }

  //! Whether `record` has completed, without blocking; throws if it failed or the world is
  //! poisoned (then the record is withdrawn).
  bool test(int rank, PointToPointRecord* record) {
    const int state = record->state.load(std::memory_order_acquire);
    if (state == PointToPointRecord::done) return true;
    if (state == PointToPointRecord::failed) raise(record->error);
    if (state == PointToPointRecord::withdrawn) world_->throw_poisoned();
    if (world_->poisoned() && cancel(rank, record)) world_->throw_poisoned();
    return false;
  }

  //! Gives a completed (or withdrawn) record back to rank `rank`'s pool.
  void release(int rank, PointToPointRecord* record) noexcept {
    Inbox& inbox = inboxes_[static_cast<std::size_t>(rank)];
    std::lock_guard lock(inbox.mutex);
    inbox.free.push_back(record);  // capacity: reserved when the record was made
  }

  //! Wakes every sleeper of this group (see World::wake_all).
  void wake() {
    { std::lock_guard lock(mutex_); }
    cv_.notify_all();
    for (int r = 0; r < size_; ++r) {
      Inbox& inbox = inboxes_[static_cast<std::size_t>(r)];
      { std::lock_guard lock(inbox.mutex); }
      inbox.cv.notify_all();
    }
  }

 private:
  //! What a rank posted for the current collective.
  struct Slot {
    CollectiveCall call;
    bool split = false;
    int color = 0, key = 0;
    std::shared_ptr<Group> split_group;  //!< set by the leader of a color during split
  };
  //! Messages from one rank to another: posts not yet matched, in order.
  struct Channel {
    std::mutex mutex;
    std::vector<PointToPointRecord*> sends, receives;
  };
  //! One rank's point-to-point records (stable addresses, reused) and where it sleeps on them.
  struct Inbox {
    std::mutex mutex;
    std::condition_variable cv;
    std::deque<PointToPointRecord> records;
    std::vector<PointToPointRecord*> free;
  };
  //! `arrive` may fail (peer failure, timeout); `finish` follows a data phase, which cannot
  //! block, so it always completes and must not fail (peers may still use this rank's buffers).
  enum class Phase { arrive, finish };

  void run_alone(const CollectiveCall& call) {
    const bool moves = call.count > 0 && call.input != call.output && call.input != nullptr;
    if ((call.kind == Collective::reduce_scatter || call.kind == Collective::all_gather ||
         call.kind == Collective::all_reduce) && moves)
      std::memcpy(call.output, call.input, call.bytes());
  }

  void execute(int rank, const CollectiveCall& call) {
    const auto n = static_cast<std::size_t>(size_);
    const auto r = static_cast<std::size_t>(rank);
    const std::size_t element = size_of(call.dtype);
    const void** sources = const_cast<const void**>(&pointers_[2 * n * r]);
    void** destinations = &pointers_[2 * n * r + n];
    auto input_of = [&](std::size_t s) {
      const CollectiveCall& c = slots_[s].call;
      return static_cast<const unsigned char*>(c.input != nullptr ? c.input : c.output);
    };
    auto output_of = [&](std::size_t s) { return static_cast<unsigned char*>(slots_[s].call.output); };
    switch (call.kind) {
      case Collective::all_reduce: {
        // This rank reduces its chunk of every rank's buffer and writes the result into every
        // rank's buffer (reduce-scatter and all-gather fused, block by block): each element is
        // read from memory once and written once per rank. Only this rank touches this chunk.
        const std::size_t begin = call.count * r / n, end = call.count * (r + 1) / n;
        if (begin == end) return;
        for (std::size_t s = 0; s < n; ++s) {
          sources[s] = input_of(s) + begin * element;
          destinations[s] = output_of(s) + begin * element;
        }
        loom::detail::reduce(call.dtype, call.op, sources, size_, destinations, size_, end - begin, size_);
        return;
      }
      case Collective::reduce_scatter: {
        for (std::size_t s = 0; s < n; ++s) sources[s] = input_of(s) + r * call.count * element;
        destinations[0] = call.output;
        loom::detail::reduce(call.dtype, call.op, sources, size_, destinations, 1, call.count, size_);
        return;
      }
      case Collective::all_gather: {
        for (std::size_t s = 0; s < n; ++s) {
          unsigned char* target = static_cast<unsigned char*>(call.output) + s * call.bytes();
          if (target != input_of(s)) std::memcpy(target, input_of(s), call.bytes());
        }
        return;
      }
      case Collective::broadcast: {
        if (rank != call.peer) std::memcpy(call.output, output_of(static_cast<std::size_t>(call.peer)), call.bytes());
        return;
      }
      default: return;
    }
  }

  static bool agree(const Slot& a, const Slot& b) noexcept {
    if (a.split || b.split) return a.split == b.split;
    const CollectiveCall &x = a.call, &y = b.call;
    if (x.kind != y.kind) return false;
    if (x.kind == Collective::barrier) return true;
    if (x.count != y.count || x.dtype != y.dtype) return false;
    if ((x.kind == Collective::all_reduce || x.kind == Collective::reduce_scatter) && x.op != y.op) return false;
    if (x.kind == Collective::broadcast && x.peer != y.peer) return false;
    return true;
  }
  static std::string describe(const Slot& slot) {
    if (slot.split) return "split(color=" + std::to_string(slot.color) + ", key=" + std::to_string(slot.key) + ")";
    return text(slot.call);
  }
  //! Empty when every rank posted the same operation; otherwise a message naming two that differ.
  std::string find_disagreement() const {
    for (int s = 1; s < size_; ++s) {
      if (agree(slots_[0], slots_[static_cast<std::size_t>(s)])) continue;
      return "threads communicator: ranks disagree: " + describe_rank(0) + " called " + describe(slots_[0]) +
             ", " + describe_rank(s) + " called " + describe(slots_[static_cast<std::size_t>(s)]);
    }
    return {};
  }

  //! "ranks 2, 3" that have not arrived at generation `target` (and, with `exited_only`, have
  //! returned from their function); empty when none.
  std::string missing_ranks(std::uint64_t target, bool exited_only) const {
    std::vector<int> missing;
    for (int s = 0; s < size_; ++s)
      if (arrivals_[static_cast<std::size_t>(s)] < target && (!exited_only || world_->exited(world_rank(s))))
        missing.push_back(s);
    if (missing.empty()) return {};
    if (missing.size() == 1) return describe_rank(missing[0]);
    std::string out = "ranks ";
    for (std::size_t i = 0; i < missing.size(); ++i)
      out += (i ? ", " : "") + std::to_string(missing[i]);
    return out;
  }

  std::string point_to_point_failure(int rank, const CollectiveCall& call, const std::string& verb) const {
    if (call.kind == Collective::send)
      return "threads communicator: " + describe_rank(call.peer) + " " + verb + " receive " + text(call) + " from " +
             describe_rank(rank);
    return "threads communicator: " + describe_rank(call.peer) + " " + verb + " send to " + describe_rank(rank) +
           " a message matching " + text(call);
  }

  //! The group barrier. Spins briefly, then sleeps with a deadline so that a failure, an exit
  //! or the timeout is noticed. The last rank to arrive checks that the posted calls agree.
  void arrive(int rank, Phase phase) {
    World& world = *world_;
    std::unique_lock lock(mutex_);
    if (phase == Phase::arrive) {
      if (world.poisoned()) {
        lock.unlock();
        world.throw_poisoned();
      }
      if (disagreed_.load(std::memory_order_relaxed)) raise(disagreement_);
    }
    const std::uint64_t target = generation_.load(std::memory_order_relaxed) + 1;
    arrivals_[static_cast<std::size_t>(rank)] = target;
    if (++arrived_ == size_) {
      arrived_ = 0;
      bool disagree = false;
      if (phase == Phase::arrive && world.options().check_agreement) {
        std::string message = find_disagreement();
        if (!message.empty()) {
          disagreement_ = std::move(message);
          disagreed_.store(true, std::memory_order_relaxed);
          world.poison(world_rank(rank), disagreement_);
          disagree = true;
        }
      }
      generation_.store(target, std::memory_order_release);
      if (sleepers_ > 0) cv_.notify_all();
      lock.unlock();
      if (disagree) {
        world.wake_all();
        raise(disagreement_);
      }
      return;
    }
    lock.unlock();
    if (!spin_until(target)) {
      lock.lock();
      ++sleepers_;
      const auto deadline = Clock::now() + world.options().timeout;
      std::string failure;
      bool poisoned = false;
      while (generation_.load(std::memory_order_relaxed) < target) {
        if (phase == Phase::finish) {
          cv_.wait(lock);
          continue;
        }
        if (world.poisoned()) {
          poisoned = true;
          break;
        }
        if (std::string gone = missing_ranks(target, true); !gone.empty()) {
          failure = "threads communicator: " + gone + " returned from its function without arriving at " +
                    describe(slots_[static_cast<std::size_t>(rank)]);
          break;
        }
        if (Clock::now() >= deadline) {
          failure = "threads communicator: " + missing_ranks(target, false) + " did not arrive at " +
                    describe(slots_[static_cast<std::size_t>(rank)]) + " within " +
                    std::to_string(world.options().timeout.count()) + " ms";
          break;
        }
        cv_.wait_until(lock, deadline);
      }
      --sleepers_;
      if (poisoned) {
        lock.unlock();
        world.throw_poisoned();
      }
      if (!failure.empty()) {
        // Poisoned under the lock: a rank arriving later throws instead of completing this
        // barrier and then using this rank's buffers.
        world.poison(world_rank(rank), failure);
        lock.unlock();
        world.wake_all();
        raise(failure);
      }
    }
    if (phase == Phase::arrive && disagreed_.load(std::memory_order_relaxed)) raise(disagreement_);
  }

  bool spin_until(std::uint64_t target) const noexcept {
    for (int i = 0; i < relax_spins; ++i) {
      if (generation_.load(std::memory_order_acquire) >= target) return true;
      cpu_relax();
    }
    for (int i = 0; i < yield_spins; ++i) {
      if (generation_.load(std::memory_order_acquire) >= target) return true;
      std::this_thread::yield();
    }
    return generation_.load(std::memory_order_acquire) >= target;
  }

  Channel& channel_of(int rank, const CollectiveCall& call) const noexcept {
    const bool sending = call.kind == Collective::send;
    const int source = sending ? rank : call.peer, destination = sending ? call.peer : rank;
    return channels_[static_cast<std::size_t>(source * size_ + destination)];
  }

  //! Withdraws `record` if no peer has taken it yet; false when a peer is completing it.
  bool cancel(int rank, PointToPointRecord* record) {
    Channel& channel = channel_of(rank, record->call);
    std::lock_guard lock(channel.mutex);
    auto& queue = record->call.kind == Collective::send ? channel.sends : channel.receives;
    auto found = std::find(queue.begin(), queue.end(), record);
    if (found == queue.end()) return false;
    queue.erase(found);
    record->state.store(PointToPointRecord::withdrawn, std::memory_order_relaxed);
    return true;
  }

  PointToPointRecord* acquire_record(int rank) {
    Inbox& inbox = inboxes_[static_cast<std::size_t>(rank)];
    std::lock_guard lock(inbox.mutex);
    if (inbox.free.empty()) {
      inbox.records.emplace_back();
      inbox.free.reserve(inbox.records.size());
      return &inbox.records.back();
    }
    PointToPointRecord* record = inbox.free.back();
    inbox.free.pop_back();
    return record;
  }

  //! Completes `record` of rank `owner` (failed when `error` is not empty) and wakes the owner.
  //! The record is not touched afterwards: its owner may reuse it at once.
  void complete(int owner, PointToPointRecord* record, const std::string& error) {
    if (error.empty()) {
      record->state.store(PointToPointRecord::done, std::memory_order_release);
    } else {
      record->error = error;
      record->state.store(PointToPointRecord::failed, std::memory_order_release);
    }
    Inbox& inbox = inboxes_[static_cast<std::size_t>(owner)];
    { std::lock_guard lock(inbox.mutex); }
    inbox.cv.notify_all();
  }

  const std::shared_ptr<World> world_;
  const std::vector<int> world_ranks_;
  const int size_;

  // Collectives: guarded by mutex_, except slots_ (each rank writes its own before arriving;
  // the others read it between the two barriers) and pointers_ (each rank its own part).
  std::mutex mutex_;
  std::condition_variable cv_;
  std::atomic<std::uint64_t> generation_{0};
  int arrived_ = 0;
  int sleepers_ = 0;
  std::atomic<bool> disagreed_{false};
  std::string disagreement_;  // written once, before disagreed_ and the generation are published
  std::vector<Slot> slots_;
  std::vector<std::uint64_t> arrivals_;  //!< per rank: the generation it last arrived for
  std::vector<void*> pointers_;          //!< per rank: scratch for source and destination pointers

  // Point to point.
  std::unique_ptr<Channel[]> channels_;  //!< [source · size + destination]
  std::unique_ptr<Inbox[]> inboxes_;
};

inline void World::wake_all() {
  std::lock_guard lock(registry_mutex_);
  for (Group* group : groups_) group->wake();
}

//! The worker of one communicator object: runs its asynchronous collectives in issue order on
//! a thread started at the first one. Tickets number the calls 1, 2, ...; since they complete
//! in order, a request only needs its ticket.
class Executor {
 public:
  Executor(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;
  ~Executor() { stop(); }

  //! Queues `call`; returns its ticket. Called by the owning rank's thread only.
  std::uint64_t submit(const CollectiveCall& call) {
    std::lock_guard lock(mutex_);
    if (!worker_.joinable()) worker_ = std::thread([this] { work(); });
    push(call);
    ++issued_;
    work_cv_.notify_one();
    return issued_;
  }
  //! Nothing queued or running. Called by the owning rank's thread only.
  bool idle() const noexcept { return completed_.load(std::memory_order_acquire) == issued_; }
  //! Blocks until every call issued so far has completed (their errors go to their requests).
  void drain() { wait_for(issued_); }

  void wait(std::uint64_t ticket) {
    wait_for(ticket);
    throw_if_failed(ticket);
  }
  bool test(std::uint64_t ticket) {
    if (completed_.load(std::memory_order_acquire) < ticket) return false;
    throw_if_failed(ticket);
    return true;
  }
  //! Finishes the queued calls, then joins the worker.
  void stop() noexcept {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    work_cv_.notify_one();
    if (worker_.joinable()) worker_.join();
  }

 private:
  void wait_for(std::uint64_t ticket) {
    if (completed_.load(std::memory_order_acquire) >= ticket) return;
    std::unique_lock lock(mutex_);
    done_cv_.wait(lock, [&] { return completed_.load(std::memory_order_acquire) >= ticket; });
  }
  void throw_if_failed(std::uint64_t ticket) const {
    // Every failure poisons the world, so the calls after a failed one fail too.
    if (ticket >= failed_from_.load(std::memory_order_acquire)) throw *failure_;
  }

  void push(const CollectiveCall& call) {
    if (queued_ == ring_.size()) {
      std::vector<CollectiveCall> larger(std::max<std::size_t>(16, 2 * ring_.size()));
      for (std::size_t i = 0; i < queued_; ++i) larger[i] = ring_[(head_ + i) % ring_.size()];
      ring_ = std::move(larger);
      head_ = 0;
    }
    ring_[(head_ + queued_) % ring_.size()] = call;
    ++queued_;
  }

  void work() {
    std::unique_lock lock(mutex_);
    for (;;) {
      work_cv_.wait(lock, [&] { return queued_ > 0 || stopping_; });
      if (queued_ == 0) return;
      const CollectiveCall call = ring_[head_];
      lock.unlock();
      std::optional<Error> error;
      try {
        group_->run(rank_, call);
      } catch (const Error& e) {
        error = e;
      } catch (const std::exception& e) {
        error.emplace(std::string("threads communicator: ") + e.what(), "", "");
      }
      lock.lock();
      head_ = (head_ + 1) % ring_.size();
      --queued_;
      const std::uint64_t ticket = completed_.load(std::memory_order_relaxed) + 1;
      if (error && !failure_) {
        failure_ = std::move(error);
        failed_from_.store(ticket, std::memory_order_release);
      }
      completed_.store(ticket, std::memory_order_release);
      done_cv_.notify_all();
    }
  }

  const std::shared_ptr<Group> group_;
  const int rank_;
  std::uint64_t issued_ = 0;  // the owning thread's count of submitted calls
  std::atomic<std::uint64_t> completed_{0};
  std::atomic<std::uint64_t> failed_from_{std::numeric_limits<std::uint64_t>::max()};
  std::optional<Error> failure_;  // written once, before failed_from_
  std::mutex mutex_;
  std::condition_variable work_cv_, done_cv_;
  std::vector<CollectiveCall> ring_;  // queued calls, the running one first
  std::size_t head_ = 0, queued_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace loom::threads::detail
