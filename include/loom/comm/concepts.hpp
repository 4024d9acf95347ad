#pragma once
//! \file The Communicator concept, and the one value that describes any collective or
//! point-to-point operation (CollectiveCall): implementations are thin typed front ends over a
//! non-template core that runs a CollectiveCall (../shared/STYLE.md: type-erased byte spans).

#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "loom/comm/request.hpp"
#include "loom/core/bf16.hpp"

namespace loom {

//! How a reduction combines the ranks' values. `average` is the sum divided by the group size.
enum class ReduceOp { sum, average, max };

//! Element types a communicator moves and reduces.
enum class DType { float32, float64, bfloat16 };

//! "sum", "average", "max".
constexpr std::string_view name(ReduceOp op) noexcept {
  return op == ReduceOp::sum ? "sum" : op == ReduceOp::average ? "average" : "max";
}
//! "float32", "float64", "bfloat16".
constexpr std::string_view name(DType t) noexcept {
  return t == DType::float32 ? "float32" : t == DType::float64 ? "float64" : "bfloat16";
}
//! Bytes of one element.
constexpr std::size_t size_of(DType t) noexcept { return t == DType::float64 ? 8 : t == DType::float32 ? 4 : 2; }

//! The element types communicators accept: float, double, bf16.
template <class T>
concept CommScalar = std::same_as<T, float> || std::same_as<T, double> || std::same_as<T, bf16>;

//! The DType of a CommScalar.
template <CommScalar T>
inline constexpr DType dtype_of = std::same_as<T, float>    ? DType::float32
                                  : std::same_as<T, double> ? DType::float64
                                                            : DType::bfloat16;

//! Which operation a CollectiveCall describes.
enum class Collective { all_reduce, reduce_scatter, all_gather, broadcast, barrier, send, recv };

//! "all_reduce", "reduce_scatter", ...
constexpr std::string_view name(Collective c) noexcept {
  switch (c) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_gather: return "all_gather";
    case Collective::broadcast: return "broadcast";
    case Collective::barrier: return "barrier";
    case Collective::send: return "send";
    case Collective::recv: return "recv";
  }
  return "?";
}

//! One operation on a communicator, with untyped buffers. `count` is the number of elements
//! each rank contributes:
//!   all_reduce      `output` holds `count` elements, reduced in place (`input` == `output`)
//!   reduce_scatter  `input` holds size()·count, `output` receives this rank's `count`
//!                   (`output` may be `input` + rank()·count: in place; the rest of `input` is
//!                   then unspecified)
//!   all_gather      `input` holds `count`, `output` receives size()·count in rank order
//!                   (`input` may be `output` + rank()·count: in place)
//!   broadcast       `output` holds `count`, sent by `root` (`peer`) to every rank
//!   send / recv     `count` elements to / from `peer`, matched by `tag`
//!   barrier         nothing moves
//! Every rank of the group must issue the same collectives in the same order with the same
//! `kind`, `count`, `dtype`, `op` and `peer` (the root); implementations check this.
struct CollectiveCall {
  Collective kind = Collective::barrier;
  const void* input = nullptr;
  void* output = nullptr;
  std::size_t count = 0;
  DType dtype = DType::float32;
  ReduceOp op = ReduceOp::sum;
  int peer = 0;  //!< the root of a broadcast; the other rank of a send or recv
  int tag = 0;   //!< send/recv only

  //! Bytes of `count` elements.
  std::size_t bytes() const noexcept { return count * size_of(dtype); }

  //! "all_reduce(count=10, float32, sum)", for error messages.
  friend std::ostream& operator<<(std::ostream& out, const CollectiveCall& c) {
    out << name(c.kind) << "(count=" << c.count << ", " << name(c.dtype);
    if (c.kind == Collective::all_reduce || c.kind == Collective::reduce_scatter) out << ", " << name(c.op);
    if (c.kind == Collective::broadcast) out << ", root=" << c.peer;
    if (c.kind == Collective::send || c.kind == Collective::recv) out << ", peer=" << c.peer << ", tag=" << c.tag;
    return out << ')';
  }
};

//! Settings every communicator implementation takes (values, not global state).
struct CommOptions {
  //! A rank that waits longer than this for its peers raises loom::Error naming the ranks it
  //! waited for, instead of hanging.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  //! Check before every collective that all ranks issue the same operation, count, type and
  //! root (cheap on threads; one small message exchange per collective under MPI).
  bool check_agreement = true;

  friend bool operator==(const CommOptions&, const CommOptions&) = default;
  friend std::ostream& operator<<(std::ostream& out, const CommOptions& o) {
    return out << "{timeout=" << o.timeout.count() << " ms, check_agreement=" << o.check_agreement
               << "}";
  }
};

//! Whether communicator `C` runs a rank's point-to-point operations in issue order, without tags,
//! each holding up what the rank issued after it until its peer takes part (NCCL on one stream):
//! `static constexpr bool point_to_point_in_issue_order = true;` says so. Only the calls of one
//! start_group then progress together, and the pipeline executor checks its plan against
//! these rules before a step (loom/parallel/detail/in_order_check.hpp).
template <class C>
inline constexpr bool point_to_point_in_issue_order = [] {
  if constexpr (requires { C::point_to_point_in_issue_order; })
    return static_cast<bool>(C::point_to_point_in_issue_order);
  else
    return false;
}();

//! Whether `comm` runs point-to-point in issue order: its member function
//! `point_to_point_in_issue_order()` where it answers at run time (AnyCommunicator and
//! CommunicatorRef, which stand for communicators of any type), else
//! point_to_point_in_issue_order<C>. Code that may be handed a type-erased communicator asks this,
//! not the trait.
template <class C>
bool point_to_point_runs_in_issue_order(const C& comm) {
  if constexpr (requires {
                  { comm.point_to_point_in_issue_order() } -> std::convertible_to<bool>;
                })
    return comm.point_to_point_in_issue_order();
  else
    return point_to_point_in_issue_order<C>;
}

//! A Communicator is a group of ranks that run collectives together. It has a rank and a size,
//! a non-template core that runs a CollectiveCall blocking (`run`) or asynchronously (`start`,
//! returning a loom::Request), typed collectives over spans of float, double and bf16 (the
//! CollectiveInterface front end provides them from the core), and `split(color, key)` making
//! sub-groups (collective; ranks with the same color form a group, ordered by key then rank),
//! and `start_group` starting several sends and receives as one unit (none waits for another).
//! Opt in with `using loom_communicator = void;`.
template <class C>
concept Communicator =
    requires { typename C::loom_communicator; } && std::movable<C> &&
    requires(C& c, const C& cc, const CollectiveCall& call, std::span<float> data,
             std::span<const float> input, std::span<const CollectiveCall> group, int color, int key) {
      { cc.rank() } -> std::convertible_to<int>;
      { cc.size() } -> std::convertible_to<int>;
      c.run(call);
      { c.start(call) } -> std::same_as<Request>;
      { c.start_group(group) } -> std::same_as<std::vector<Request>>;
      { c.split(color, key) } -> std::same_as<C>;
      c.all_reduce(data, ReduceOp::sum);
      c.reduce_scatter(input, data, ReduceOp::sum);
      c.all_gather(input, data);
      c.broadcast(data, 0);
      c.send(input, 0, 0);
      c.recv(data, 0, 0);
      c.barrier();
      { c.all_reduce_async(data, ReduceOp::sum) } -> std::same_as<Request>;
      { c.reduce_scatter_async(input, data, ReduceOp::sum) } -> std::same_as<Request>;
      { c.all_gather_async(input, data) } -> std::same_as<Request>;
      { c.broadcast_async(data, 0) } -> std::same_as<Request>;
      { c.send_async(input, 0, 0) } -> std::same_as<Request>;
      { c.recv_async(data, 0, 0) } -> std::same_as<Request>;
    };

}  // namespace loom
