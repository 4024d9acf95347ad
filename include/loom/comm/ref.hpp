#pragma once
//! \file CommunicatorRef: a non-owning, type-erased reference to any Communicator. Strategies
//! hold one, so that `Trainer<..., DataParallel>` is one type whichever communicator (threads,
//! MPI, NCCL) it runs over; the cost is one indirect call per collective, which moves a whole
//! gradient bucket.

#include <span>
#include <type_traits>
#include <vector>

#include "loom/comm/any.hpp"
#include "loom/comm/collectives.hpp"
#include "loom/comm/concepts.hpp"
#include "loom/comm/request.hpp"
#include "loom/comm/self.hpp"

namespace loom {

//! Refers to a communicator that outlives it; offers its rank, size and every typed collective
//! (CollectiveInterface) by forwarding the CollectiveCall to it. Copyable. A default-constructed
//! reference is the group of one rank (SelfCommunicator).
class CommunicatorRef : public CollectiveInterface<CommunicatorRef> {
 public:
  CommunicatorRef() noexcept : object_(nullptr), ops_(&self_ops) {}
  template <Communicator C>
    requires(!std::is_same_v<C, CommunicatorRef>)
  CommunicatorRef(C& comm) noexcept  // NOLINT: implicit on purpose, any communicator binds
      : object_(&comm), ops_(&ops_for<C>) {}

  int rank() const { return ops_->rank(object_); }
  int size() const { return ops_->size(object_); }
  //! Whether the referenced communicator runs a rank's sends and receives in issue order,
  //! untagged, each holding up the next (point_to_point_runs_in_issue_order: NCCL, or an
  //! AnyCommunicator holding it).
  bool point_to_point_in_issue_order() const { return ops_->in_issue_order(object_); }
  //! Runs `call` to completion on the referenced communicator.
  void run(const CollectiveCall& call) { ops_->run(object_, call); }
  //! Starts `call` on the referenced communicator.
  Request start(const CollectiveCall& call) { return ops_->start(object_, call); }
  //! Starts the group on the referenced communicator (its own start_group).
  std::vector<Request> start_group(std::span<const CollectiveCall> calls) { return ops_->start_group(object_, calls); }
  //! The referenced communicator's split(color, key), held by an AnyCommunicator (collective
  //! over the group): for a strategy that divides its group further (Zero's replicas).
  AnyCommunicator split(int color, int key) { return ops_->split(object_, color, key); }

 private:
  struct Ops {
    int (*rank)(const void*);
    int (*size)(const void*);
    void (*run)(void*, const CollectiveCall&);
    Request (*start)(void*, const CollectiveCall&);
    std::vector<Request> (*start_group)(void*, std::span<const CollectiveCall>);
    bool (*in_issue_order)(const void*);
    AnyCommunicator (*split)(void*, int, int);
  };
  template <class C>
  static constexpr Ops ops_for{
      [](const void* c) { return static_cast<int>(static_cast<const C*>(c)->rank()); },
      [](const void* c) { return static_cast<int>(static_cast<const C*>(c)->size()); },
      [](void* c, const CollectiveCall& call) { static_cast<C*>(c)->run(call); },
      [](void* c, const CollectiveCall& call) { return static_cast<C*>(c)->start(call); },
      [](void* c, std::span<const CollectiveCall> calls) { return static_cast<C*>(c)->start_group(calls); },
      [](const void* c) { return point_to_point_runs_in_issue_order(*static_cast<const C*>(c)); },
      [](void* c, int color, int key) { return AnyCommunicator(static_cast<C*>(c)->split(color, key)); }};

  static constexpr Ops self_ops{
      [](const void*) { return 0; }, [](const void*) { return 1; },
      [](void*, const CollectiveCall& call) { SelfCommunicator{}.run(call); },
      [](void*, const CollectiveCall& call) { return SelfCommunicator{}.start(call); },
      [](void*, std::span<const CollectiveCall> calls) { return SelfCommunicator{}.start_group(calls); },
      [](const void*) { return false; },
      [](void*, int color, int key) { return AnyCommunicator(SelfCommunicator{}.split(color, key)); }};

  void* object_;
  const Ops* ops_;
};

}  // namespace loom
