#pragma once
//! \file CollectiveInterface: the typed collectives every communicator offers, written once over
//! the communicator's non-template core (`run` and `start` of a CollectiveCall). The arguments
//! are checked here, so every implementation rejects bad input with the same messages.

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "loom/comm/concepts.hpp"
#include "loom/comm/request.hpp"
#include "loom/core/error.hpp"

namespace loom {

//! Derive `class MyComm : public CollectiveInterface<MyComm>` and provide `rank()`, `size()`,
//! `run(const CollectiveCall&)` and `start(const CollectiveCall&) -> Request`; this adds the
//! typed blocking and asynchronous collectives of the Communicator concept, and a start_group
//! that starts each call of the group in turn (right where start() never waits for a peer; a
//! communicator whose operations wait in issue order, like NCCL's on one stream, provides its
//! own).
template <class Derived>
class CollectiveInterface {
 public:
  //! Reduces `data` over all ranks in place; every rank receives the result.
  template <CommScalar T>
  void all_reduce(std::span<T> data, ReduceOp op = ReduceOp::sum) {
    self().run(all_reduce_call(data, op));
  }
  //! Reduces `input` (size()·n elements) over all ranks; rank r receives elements [r·n, (r+1)·n)
  //! of the result in `output` (n elements), which may alias exactly that part of `input`.
  template <CommScalar T>
  void reduce_scatter(std::span<const T> input, std::span<T> output, ReduceOp op = ReduceOp::sum) {
    self().run(reduce_scatter_call(input, output, op));
  }
  //! Concatenates every rank's `input` (n elements) in rank order into `output` (size()·n);
  //! `input` may alias this rank's part of `output`.
  template <CommScalar T>
  void all_gather(std::span<const T> input, std::span<T> output) {
    self().run(all_gather_call(input, output));
  }
  //! Copies `data` of rank `root` into `data` of every rank.
  template <CommScalar T>
  void broadcast(std::span<T> data, int root) {
    self().run(broadcast_call(data, root));
  }
  //! Sends `data` to rank `peer`, matched by a recv with the same `tag`; returns once `data` may
  //! be reused.
  template <CommScalar T>
  void send(std::span<const T> data, int peer, int tag = 0) {
    self().run(send_call(data, peer, tag));
  }
  //! Receives `data.size()` elements sent by rank `peer` with `tag`.
  template <CommScalar T>
  void recv(std::span<T> data, int peer, int tag = 0) {
    self().run(recv_call(data, peer, tag));
  }
  //! Returns when every rank has called barrier().
  void barrier() { self().run(CollectiveCall{.kind = Collective::barrier}); }

  //! all_reduce, started; the buffers must stay alive until the Request completes.
  template <CommScalar T>
  Request all_reduce_async(std::span<T> data, ReduceOp op = ReduceOp::sum) {
    return self().start(all_reduce_call(data, op));
  }
  template <CommScalar T>
  Request reduce_scatter_async(std::span<const T> input, std::span<T> output, ReduceOp op = ReduceOp::sum) {
    return self().start(reduce_scatter_call(input, output, op));
  }
  template <CommScalar T>
  Request all_gather_async(std::span<const T> input, std::span<T> output) {
    return self().start(all_gather_call(input, output));
  }
  template <CommScalar T>
  Request broadcast_async(std::span<T> data, int root) {
    return self().start(broadcast_call(data, root));
  }
  template <CommScalar T>
  Request send_async(std::span<const T> data, int peer, int tag = 0) {
    return self().start(send_call(data, peer, tag));
  }
  template <CommScalar T>
  Request recv_async(std::span<T> data, int peer, int tag = 0) {
    return self().start(recv_call(data, peer, tag));
  }

  //! Starts the sends and receives of `calls` as one unit: none of them waits for another to
  //! complete, so a rank may send to a peer and receive from it (or from another) in one group
  //! without either waiting for the other first. Returns one Request per call, in order (on
  //! some communicators, NCCL's, each completes only with the whole group). The calls must be
  //! send or recv (see send_call and recv_call); between two ranks, sends and receives of one
  //! tag still match in issue order, across groups too.
  std::vector<Request> start_group(std::span<const CollectiveCall> calls) {
    check_group(calls);
    std::vector<Request> requests;
    requests.reserve(calls.size());
    for (const CollectiveCall& call : calls) requests.push_back(self().start(call));
    return requests;
  }

  //! The CollectiveCall of send(data, peer, tag), checked, for start_group.
  template <CommScalar T>
  CollectiveCall send_call(std::span<const T> data, int peer, int tag = 0) const {
    return point_to_point_call(Collective::send, data.data(), nullptr, data.size(), dtype_of<T>, peer, tag);
  }
  template <CommScalar T>
  CollectiveCall send_call(std::span<T> data, int peer, int tag = 0) const {
    return send_call(std::span<const T>(data), peer, tag);
  }
  //! The CollectiveCall of recv(data, peer, tag), checked, for start_group.
  template <CommScalar T>
  CollectiveCall recv_call(std::span<T> data, int peer, int tag = 0) const {
    return point_to_point_call(Collective::recv, nullptr, data.data(), data.size(), dtype_of<T>, peer, tag);
  }

  // The same calls on spans of mutable data where the interface reads (spans do not convert
  // from T to const T through template deduction).
  template <CommScalar T>
  void reduce_scatter(std::span<T> input, std::span<T> output, ReduceOp op = ReduceOp::sum) {
    reduce_scatter(std::span<const T>(input), output, op);
  }
  template <CommScalar T>
  void all_gather(std::span<T> input, std::span<T> output) {
    all_gather(std::span<const T>(input), output);
  }
  template <CommScalar T>
  void send(std::span<T> data, int peer, int tag = 0) {
    send(std::span<const T>(data), peer, tag);
  }
  template <CommScalar T>
  Request reduce_scatter_async(std::span<T> input, std::span<T> output, ReduceOp op = ReduceOp::sum) {
    return reduce_scatter_async(std::span<const T>(input), output, op);
  }
  template <CommScalar T>
  Request all_gather_async(std::span<T> input, std::span<T> output) {
    return all_gather_async(std::span<const T>(input), output);
  }
  template <CommScalar T>
  Request send_async(std::span<T> data, int peer, int tag = 0) {
    return send_async(std::span<const T>(data), peer, tag);
  }

 protected:
  //! A group may hold only sends and receives, to ranks of the group other than this one.
  void check_group(std::span<const CollectiveCall> calls) const {
    for (const CollectiveCall& call : calls) {
      LOOM_CHECK(call.kind == Collective::send || call.kind == Collective::recv, "start_group: a call",
                 std::string(name(call.kind)), "must be a send or a recv");
      check_peer(call.peer, std::string("start_group: peer of a ") + std::string(name(call.kind)));
    }
  }

 private:
  Derived& self() noexcept { return static_cast<Derived&>(*this); }
  const Derived& self() const noexcept { return static_cast<const Derived&>(*this); }

  template <class T>
  CollectiveCall all_reduce_call(std::span<T> data, ReduceOp op) const {
    return {.kind = Collective::all_reduce, .input = data.data(), .output = data.data(),
            .count = data.size(), .dtype = dtype_of<T>, .op = op};
  }
  template <class T>
  CollectiveCall reduce_scatter_call(std::span<const T> input, std::span<T> output, ReduceOp op) const {
    const auto n = static_cast<std::size_t>(self().size());
    LOOM_CHECK(input.size() == n * output.size(), "reduce_scatter: input elements", input.size(),
               "must be size() (" + std::to_string(n) + ") x output elements (" +
                   std::to_string(output.size()) + ")");
    check_alias(input.data(), output.data(), output.size(), "reduce_scatter: output");
    return {.kind = Collective::reduce_scatter, .input = input.data(), .output = output.data(),
            .count = output.size(), .dtype = dtype_of<T>, .op = op};
  }
  template <class T>
  CollectiveCall all_gather_call(std::span<const T> input, std::span<T> output) const {
    const auto n = static_cast<std::size_t>(self().size());
    LOOM_CHECK(output.size() == n * input.size(), "all_gather: output elements", output.size(),
               "must be size() (" + std::to_string(n) + ") x input elements (" +
                   std::to_string(input.size()) + ")");
    check_alias(output.data(), input.data(), input.size(), "all_gather: input");
    return {.kind = Collective::all_gather, .input = input.data(), .output = output.data(),
            .count = input.size(), .dtype = dtype_of<T>};
  }
  template <class T>
  CollectiveCall broadcast_call(std::span<T> data, int root) const {
    check_rank(root, "broadcast: root");
    return {.kind = Collective::broadcast, .input = data.data(), .output = data.data(),
            .count = data.size(), .dtype = dtype_of<T>, .peer = root};
  }
  CollectiveCall point_to_point_call(Collective kind, const void* input, void* output, std::size_t count,
                                     DType dtype, int peer, int tag) const {
    check_peer(peer, std::string(name(kind)) + ": peer");
    LOOM_CHECK(tag >= 0, std::string(name(kind)) + ": tag", tag, "must be >= 0");
    return {.kind = kind, .input = input, .output = output, .count = count, .dtype = dtype,
            .peer = peer, .tag = tag};
  }

  //! A point-to-point peer: a rank of the group other than this one.
  void check_peer(int peer, const std::string& what) const {
    check_rank(peer, what);
    LOOM_CHECK(peer != self().rank(), what, peer, "must differ from this rank");
  }
  void check_rank(int r, const std::string& what) const {
    LOOM_CHECK(r >= 0 && r < self().size(), what, r,
               "must be a rank of the group, in [0, " + std::to_string(self().size()) + ")");
  }
  //! A buffer may be disjoint from the whole buffer, or exactly this rank's part of it.
  template <class T, class U>
  void check_alias(const T* whole, const U* part, std::size_t part_count, const std::string& what) const {
    const auto* w = reinterpret_cast<const unsigned char*>(whole);
    const auto* p = reinterpret_cast<const unsigned char*>(part);
    const std::size_t part_bytes = part_count * sizeof(U);
    const std::size_t whole_bytes = part_bytes * static_cast<std::size_t>(self().size());
    if (part_bytes == 0 || p + part_bytes <= w || p >= w + whole_bytes) return;
    const auto own = w + static_cast<std::size_t>(self().rank()) * part_bytes;
    LOOM_CHECK(p == own, what, "a buffer overlapping the other side",
               "must be disjoint from it, or exactly this rank's part of it (in place)");
  }
};

}  // namespace loom
