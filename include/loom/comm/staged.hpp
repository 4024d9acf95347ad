#pragma once
//! \file StagedCommunicator: any host communicator serving a rank whose buffers live in backend
//! memory. Every call's data is copied to host scratch through the rank's backend, the inner
//! communicator runs there, and the result is copied back. This is what lets ranks that are
//! threads share one GPU over loom::threads (which reads buffers with the CPU), or MPI ranks
//! with GPU buffers run over an MPI that is not CUDA-aware.
//!
//!     loom::threads::run(4, [](loom::threads::Communicator& world) {
//!       loom::cuda backend{0};
//!       loom::StagedCommunicator comm{std::move(world), backend};
//!       comm.all_reduce(gradients_on_the_gpu, loom::ReduceOp::average);
//!     });
//!
//! The cost is two host copies per call (in and out) and, on a GPU backend, a stream
//! synchronisation in each, on top of the inner collective.

#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/comm/collectives.hpp"
#include "loom/comm/concepts.hpp"
#include "loom/comm/detail/staging.hpp"
#include "loom/comm/request.hpp"
#include "loom/core/error.hpp"

namespace loom {

namespace detail {

//! Host bytes that only grow, so that steady-state calls reuse them.
class HostScratch {
 public:
  //! At least `bytes` of host memory; the contents are unspecified.
  std::byte* reserve(std::size_t bytes) {
    if (bytes > capacity_) {
      data_ = std::make_unique_for_overwrite<std::byte[]>(bytes);
      capacity_ = bytes;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<std::byte[]> data_;
  std::size_t capacity_ = 0;
};

}  // namespace detail

//! Serves a rank whose buffers live in backend memory (`B`, e.g. loom::cuda) over a communicator
//! `C` that reads and writes host memory (loom::threads, loom::mpi without CUDA awareness): each
//! call copies its data to host scratch with `backend.copy_to_host`, runs `C` there, and copies
//! the result back with `backend.copy_from_host`. Host buffers work too (the backend's copies
//! accept them). Owns the inner communicator; refers to the rank's backend, which must outlive
//! it and every request it started. Use it from one thread at a time, like the inner one.
template <Communicator C, Backend B>
class StagedCommunicator : public CollectiveInterface<StagedCommunicator<C, B>> {
 public:
  //! Opts in to the loom::Communicator concept.
  using loom_communicator = void;
  //! As the inner communicator orders its point-to-point calls.
  static constexpr bool point_to_point_in_issue_order = loom::point_to_point_in_issue_order<C>;

  //! Takes over `inner` (the rank's place in the group); copies go through `backend`.
  StagedCommunicator(C inner, B& backend) noexcept(std::is_nothrow_move_constructible_v<C>)
      : inner_(std::move(inner)), backend_(&backend) {}

  //! This rank in the group, in [0, size()).
  int rank() const { return static_cast<int>(inner_.rank()); }
  //! Ranks in the group.
  int size() const { return static_cast<int>(inner_.size()); }
  //! The host communicator the staged calls run on.
  C& inner() noexcept { return inner_; }
  const C& inner() const noexcept { return inner_; }
  //! The backend that copies this rank's buffers.
  B& backend() const noexcept { return *backend_; }

  //! Stages `call`'s data on the host, runs it on the inner communicator, copies the result
  //! back; returns when the caller's output holds it. Host scratch is kept and grows, so
  //! repeated calls do not allocate.
  void run(const CollectiveCall& call) {
    const detail::StagingPlan plan = detail::staging_plan(call, rank(), size());
    std::byte* input = input_scratch_.reserve(plan.input_bytes);
    std::byte* output = output_scratch_.reserve(plan.output_bytes);
    stage(plan, input, output);
    inner_.run(detail::with_scratch_buffers(call, input, output));
    copy_back(*backend_, plan, output);
  }

  //! Stages `call`'s input now (copy_to_host waits for the backend's earlier work, so the
  //! data this rank produced is what is sent), starts it on the inner communicator, and returns
  //! a Request that owns the host scratch; the result is copied into the caller's output by
  //! the wait() or test() that sees the operation complete, on the thread that calls it. The
  //! caller's buffers must stay alive, and the output untouched, until then.
  Request start(const CollectiveCall& call) {
    const detail::StagingPlan plan = detail::staging_plan(call, rank(), size());
    if (plan.input_bytes == 0 && plan.output_bytes == 0)
      return inner_.start(detail::with_scratch_buffers(call, nullptr, nullptr));  // nothing to stage or keep

    auto pending = std::make_unique<Pending>(*backend_, plan);
    stage(plan, pending->input(), pending->output());
    pending->inner = inner_.start(detail::with_scratch_buffers(call, pending->input(), pending->output()));
    if (pending->inner.done()) {
      // Finished at once (a send its peer already waited for): no state to keep.
      copy_back(*backend_, plan, pending->output());
      return Request();
    }
    return Request(State{std::move(pending)});
  }

  //! Stages every send's data now, starts the calls as one group on the inner communicator (its
  //! own start_group, so a group keeps its meaning there), and returns a Request per call; each
  //! receive's data is copied into the caller's buffer by the wait() or test() that sees it
  //! complete.
  std::vector<Request> start_group(std::span<const CollectiveCall> calls) {
    this->check_group(calls);
    std::vector<std::unique_ptr<Pending>> parts;
    parts.reserve(calls.size());
    std::vector<CollectiveCall> host_calls;
    host_calls.reserve(calls.size());
    for (const CollectiveCall& call : calls) {
      auto& part = parts.emplace_back(std::make_unique<Pending>(*backend_, detail::staging_plan(call, rank(), size())));
      stage(part->plan, part->input(), part->output());
      host_calls.push_back(detail::with_scratch_buffers(call, part->input(), part->output()));
    }
    std::vector<Request> inner = inner_.start_group(std::span<const CollectiveCall>(host_calls));
    LOOM_CHECK(inner.size() == calls.size(), "staged start_group: requests from the inner communicator", inner.size(),
               "must be one per call (" + std::to_string(calls.size()) + ")");
    std::vector<Request> requests;
    requests.reserve(calls.size());
    for (std::size_t i = 0; i < calls.size(); ++i) {
      parts[i]->inner = std::move(inner[i]);
      if (parts[i]->inner.done()) {
        parts[i]->finish();
        requests.emplace_back();
      } else {
        requests.emplace_back(State{std::move(parts[i])});
      }
    }
    return requests;
  }

  //! Collective over the group: the inner communicator's split, staged through the same
  //! backend.
  StagedCommunicator split(int color, int key) { return StagedCommunicator(inner_.split(color, key), *backend_); }

 private:
  //! A started call: its host scratch (input, then output, in one allocation), the inner
  //! Request, and where the result goes.
  struct Pending {
    B* backend;
    detail::StagingPlan plan;
    std::size_t output_offset;
    std::unique_ptr<std::byte[]> host;
    Request inner;

    Pending(B& b, const detail::StagingPlan& p)
        : backend(&b),
          plan(p),
          output_offset(round_up(p.input_bytes)),
          host(std::make_unique_for_overwrite<std::byte[]>(output_offset + p.output_bytes)) {}

    std::byte* input() noexcept { return host.get(); }
    std::byte* output() noexcept { return host.get() + output_offset; }
    void finish() { copy_back(*backend, plan, output()); }

    static std::size_t round_up(std::size_t bytes) noexcept {
      constexpr std::size_t a = alignof(std::max_align_t);
      return (bytes + a - 1) / a * a;
    }
  };

  //! What a loom::Request holds: the Pending call, finished when it completes.
  using State = detail::StagedRequest<Pending>;
  static_assert(RequestState<State>);

  void stage(const detail::StagingPlan& plan, std::byte* input, std::byte* output) const {
    if (plan.stage_bytes > 0)
      backend_->copy_to_host(plan.stage_into_output ? output : input, plan.stage_from, plan.stage_bytes);
  }
  static void copy_back(B& backend, const detail::StagingPlan& plan, const std::byte* output) {
    if (plan.copy_back_bytes > 0) backend.copy_from_host(plan.copy_back_to, output, plan.copy_back_bytes);
  }

  C inner_;
  B* backend_;  //!< a pointer, so that the communicator stays move-assignable
  detail::HostScratch input_scratch_;
  detail::HostScratch output_scratch_;
};

}  // namespace loom
