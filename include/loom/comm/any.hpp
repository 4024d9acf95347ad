#pragma once
//! \file AnyCommunicator: an owning, type-erased Communicator. A program that picks its
//! communicator at run time (thread ranks, MPI processes, NCCL, one rank) writes its training code once
//! over `Mesh<AnyCommunicator>` instead of instantiating it once per communicator type; the
//! Trainer holds CommunicatorRefs either way, so only the caller's own code was multiplied. The
//! cost is one more indirect call per collective (a virtual one, behind the CommunicatorRef's),
//! against a collective that moves a whole bucket or activation.

#include <memory>
#include <span>
#include <type_traits>
#include <utility>
#include <vector>

#include "loom/comm/collectives.hpp"
#include "loom/comm/concepts.hpp"
#include "loom/comm/request.hpp"
#include "loom/comm/self.hpp"

namespace loom {

//! Holds any Communicator (by value) or refers to one (`AnyCommunicator::view`), and is itself a
//! Communicator: rank, size, run, start, start_group and every typed collective forward to it, and
//! split returns an AnyCommunicator that holds the sub-group the held communicator's split made.
//! Default-constructed, it holds the group of one rank (SelfCommunicator). Movable, not copyable
//! (communicators are not); a moved-from AnyCommunicator may only be destroyed or assigned to.
//!
//! Whether the held communicator runs point-to-point in issue order (NCCL) is a property of its
//! type, which the erasure hides from point_to_point_in_issue_order<AnyCommunicator> (false);
//! point_to_point_in_issue_order() answers it at run time, and a CommunicatorRef bound to an
//! AnyCommunicator asks that, so the pipeline executor plans for NCCL's rules either way.
class AnyCommunicator : public CollectiveInterface<AnyCommunicator> {
 public:
  //! Opts in to the loom::Communicator concept.
  using loom_communicator = void;

  //! The group of one rank.
  AnyCommunicator() : AnyCommunicator(SelfCommunicator{}) {}

  //! Takes `comm` over (moved in). (The same-type test comes first: checking Communicator<C>
  //! for C = AnyCommunicator asks whether it is movable, which would consider this constructor.)
  template <class C>
    requires(!std::is_same_v<C, AnyCommunicator> && Communicator<C>)
  explicit AnyCommunicator(C comm) : held_(std::make_unique<Held<C, C>>(std::move(comm))) {}

  //! Refers to `comm`, which must outlive this object; its splits are held by value as usual.
  //! For a communicator a launcher owns and lends, such as the world of threads::run or mpi::run.
  template <class C>
    requires(!std::is_same_v<C, AnyCommunicator> && Communicator<C>)
  static AnyCommunicator view(C& comm) {
    return AnyCommunicator(std::make_unique<Held<C, C*>>(&comm));
  }

  int rank() const { return held_->rank(); }
  int size() const { return held_->size(); }
  //! Runs `call` to completion on the held communicator.
  void run(const CollectiveCall& call) { held_->run(call); }
  //! Starts `call` on the held communicator.
  Request start(const CollectiveCall& call) { return held_->start(call); }
  //! Starts the group on the held communicator (its own start_group).
  std::vector<Request> start_group(std::span<const CollectiveCall> calls) { return held_->start_group(calls); }
  //! The held communicator's split(color, key), held (collective over the group).
  AnyCommunicator split(int color, int key) { return held_->split(color, key); }
  //! Whether the held communicator runs a rank's sends and receives in issue order, untagged
  //! (point_to_point_runs_in_issue_order: NCCL's).
  bool point_to_point_in_issue_order() const { return held_->in_issue_order(); }

 private:
  struct Interface {
    virtual ~Interface() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual void run(const CollectiveCall& call) = 0;
    virtual Request start(const CollectiveCall& call) = 0;
    virtual std::vector<Request> start_group(std::span<const CollectiveCall> calls) = 0;
    virtual AnyCommunicator split(int color, int key) = 0;
    virtual bool in_issue_order() const = 0;
  };

  //! Communicator C stored as `Storage`: C itself (owned) or C* (viewed).
  template <class C, class Storage>
  struct Held final : Interface {
    explicit Held(Storage s) : stored(std::move(s)) {}
    C& comm() {
      if constexpr (std::is_pointer_v<Storage>) return *stored;
      else return stored;
    }
    const C& comm() const {
      if constexpr (std::is_pointer_v<Storage>) return *stored;
      else return stored;
    }
    int rank() const override { return static_cast<int>(comm().rank()); }
    int size() const override { return static_cast<int>(comm().size()); }
    void run(const CollectiveCall& call) override { comm().run(call); }
    Request start(const CollectiveCall& call) override { return comm().start(call); }
    std::vector<Request> start_group(std::span<const CollectiveCall> calls) override {
      return comm().start_group(calls);
    }
    AnyCommunicator split(int color, int key) override { return AnyCommunicator(comm().split(color, key)); }
    bool in_issue_order() const override { return point_to_point_runs_in_issue_order(comm()); }

    Storage stored;
  };

  explicit AnyCommunicator(std::unique_ptr<Interface> held) noexcept : held_(std::move(held)) {}

  std::unique_ptr<Interface> held_;
};

static_assert(Communicator<AnyCommunicator>);

}  // namespace loom
