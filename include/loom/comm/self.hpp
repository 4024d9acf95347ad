#pragma once
//! \file SelfCommunicator: the group of one rank. Collectives are copies (or nothing); there is
//! no peer to send to. It lets single-rank code run through the same strategy seams.

#include <cstring>

#include "loom/comm/collectives.hpp"
#include "loom/comm/concepts.hpp"
#include "loom/comm/request.hpp"
#include "loom/core/error.hpp"

namespace loom {

//! A communicator of size 1: all_reduce leaves the data as it is (the sum, average and max of
//! one value is that value), reduce_scatter and all_gather copy, send and recv are errors.
class SelfCommunicator : public CollectiveInterface<SelfCommunicator> {
 public:
  using loom_communicator = void;

  int rank() const noexcept { return 0; }
  int size() const noexcept { return 1; }

  void run(const CollectiveCall& call) {
    switch (call.kind) {
      case Collective::reduce_scatter:
      case Collective::all_gather:
        if (call.bytes() > 0 && call.input != call.output) std::memmove(call.output, call.input, call.bytes());
        return;
      case Collective::send:
      case Collective::recv:
        throw Error("self communicator: " + std::string(name(call.kind)), call,
                    "a group of one rank has no peer to exchange messages with");
      default:
        return;
    }
  }
  //! Runs `call` at once; the returned request is complete.
  Request start(const CollectiveCall& call) {
    run(call);
    return {};
  }
  //! Every color gives another group of one.
  SelfCommunicator split(int color, int /*key*/) const {
    LOOM_CHECK(color >= 0, "self communicator: split color", color, "must be >= 0");
    return {};
  }
};

static_assert(Communicator<SelfCommunicator>);

}  // namespace loom
