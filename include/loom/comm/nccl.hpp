#pragma once
//! \file The NCCL communicator: collectives on the rank's communication stream (beside its
//! compute stream, after the compute issued before them), async handles as CUDA events, every
//! NCCL error a loom::Error, and a stalled collective timed out (NCCL's non-blocking mode:
//! ncclCommGetAsyncError, then ncclCommAbort) instead of hanging.
//!
//! Buffers may be device memory or host memory (staged through device scratch, as the
//! Trainer's loss and norm sums are). On device memory a call completes in stream order: when
//! run() returns, or its Request's wait() does, the work issued on the backend's stream from then
//! on runs after it, and the host has not waited. The backend's host waits (synchronize and the
//! copies to and from the host) check the calls in flight (cuda::watch), so one that fails or
//! never completes is raised there, naming the call. On host memory, and for barrier(), the host
//! waits.

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/comm/collectives.hpp"
#include "loom/comm/concepts.hpp"
#include "loom/comm/detail/staging.hpp"
#include "loom/comm/request.hpp"
#include "loom/core/error.hpp"

namespace loom::nccl {

//! The id every rank of a new NCCL group joins with: made by one rank (make()), passed to the
//! others by any other means (Communicator::bootstrap does it over another communicator).
struct UniqueId {
  ncclUniqueId id{};
  static UniqueId make() {
    UniqueId u;
    const ncclResult_t r = ncclGetUniqueId(&u.id);
    if (r != ncclSuccess) throw Error("ncclGetUniqueId", ncclGetErrorString(r), "NCCL could not make a group id");
    return u;
  }
};

namespace detail {

inline ncclDataType_t type_of(DType t) noexcept {
  return t == DType::float32 ? ncclFloat32 : t == DType::float64 ? ncclFloat64 : ncclBfloat16;
}
using loom::detail::SharedEvent;

inline ncclRedOp_t op_of(ReduceOp op) noexcept {
  return op == ReduceOp::sum ? ncclSum : op == ReduceOp::average ? ncclAvg : ncclMax;
}

//! What a communicator and its requests share: the NCCL handle, the backend, the options, and
//! the first failure (after which every call throws it at once).
struct State {
  ncclComm_t comm = nullptr;
  loom::cuda* backend = nullptr;
  CommOptions options;
  int rank = 0, size = 1;
  std::string failure;  //!< empty while healthy
  void* barrier_word = nullptr;  //!< device scratch of barrier()

  State() = default;
  State(const State&) = delete;
  State& operator=(const State&) = delete;
  ~State() {
    if (barrier_word != nullptr) backend->deallocate(barrier_word, sizeof(float), MemoryCategory::communication);
    if (comm == nullptr) return;
    if (failure.empty()) {
      // Flush what was issued; a peer that never comes makes this time out and abort.
      try {
        finish(ncclCommFinalize(comm), "ncclCommFinalize");
      } catch (...) {
      }
    }
    if (failure.empty())
      (void)ncclCommDestroy(comm);
    else
      (void)ncclCommAbort(comm);
  }

  [[noreturn]] void fail(const std::string& what) {
    failure = what;
    if (comm != nullptr) (void)ncclCommAbort(comm);
    comm = nullptr;
    throw Error("nccl communicator (rank " + std::to_string(rank) + ")", what,
                "the communicator is aborted; later calls on it fail at once");
  }
  void check_healthy() const {
    if (!failure.empty())
      throw Error("nccl communicator (rank " + std::to_string(rank) + ")", failure, "it failed earlier and was aborted");
  }

  //! Waits (up to the timeout) until NCCL has finished an operation begun in non-blocking
  //! mode (ncclInProgress), then checks its result.
  void finish(ncclResult_t r, const char* call) {
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    while (r == ncclInProgress) {
      if (std::chrono::steady_clock::now() > deadline)
        fail(std::string(call) + " did not finish within " + std::to_string(options.timeout.count()) + " ms");
      std::this_thread::yield();
      r = async_result(call);
    }
    if (r != ncclSuccess) fail(std::string(call) + ": " + ncclGetErrorString(r));
  }

  //! This communicator's asynchronous state (ncclCommGetAsyncError), failing if it cannot be read.
  ncclResult_t async_result(const char* call) {
    ncclResult_t async = ncclSuccess;
    const ncclResult_t query = ncclCommGetAsyncError(comm, &async);
    if (query != ncclSuccess) fail(std::string(call) + ": ncclCommGetAsyncError: " + ncclGetErrorString(query));
    return async;
  }

  //! Waits (up to the timeout) until NCCL's thread has written a new communicator's handle into
  //! `handle`, failing if this communicator reports an error meanwhile.
  void wait_for_handle(ncclComm_t& handle, const char* call) {
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    const std::atomic_ref<ncclComm_t> written(handle);
    while (written.load(std::memory_order_acquire) == nullptr) {
      if (std::chrono::steady_clock::now() > deadline)
        fail(std::string(call) + " gave no new communicator within " + std::to_string(options.timeout.count()) + " ms");
      const ncclResult_t async = async_result(call);
      if (async != ncclSuccess && async != ncclInProgress) fail(std::string(call) + ": " + ncclGetErrorString(async));
      std::this_thread::yield();
    }
  }

  //! Waits for `event` with the timeout, watching NCCL for asynchronous errors meanwhile.
  void await(cudaEvent_t event, const CollectiveCall& call) {
    const auto deadline = std::chrono::steady_clock::now() + options.timeout;
    while (true) {
      if (poll(event, call)) return;
      if (std::chrono::steady_clock::now() > deadline) {
        std::string what = "rank " + std::to_string(rank) + "'s ";
        fail(what + to_text(call) + " did not complete within " + std::to_string(options.timeout.count()) +
             " ms (a peer did not join it)");
      }
      std::this_thread::yield();
    }
  }
  //! The backend's watch of a call (cuda::watch): true once it completed, or once this
  //! communicator failed (that was raised already); fails it on an error, or when `deadline`
  //! passed first.
  bool watch(cudaEvent_t event, const CollectiveCall& call, std::chrono::steady_clock::time_point deadline) {
    if (!failure.empty()) return true;
    if (poll(event, call)) return true;
    if (std::chrono::steady_clock::now() > deadline)
      fail("rank " + std::to_string(rank) + "'s " + to_text(call) + " did not complete within " +
           std::to_string(options.timeout.count()) + " ms (a peer did not join it)");
    return false;
  }
  //! Makes the backend's stream wait for `event` (stream-ordered completion).
  void order_compute_after(cudaEvent_t event, const CollectiveCall& call) {
    check_healthy();
    backend->activate();
    if (const cudaError_t e = cudaStreamWaitEvent(backend->stream(), event, 0); e != cudaSuccess) {
      (void)cudaGetLastError();
      fail(to_text(call) + ": cudaStreamWaitEvent: " + cudaGetErrorString(e));
    }
  }
  //! Whether `event` has completed; throws on a CUDA or NCCL error.
  bool poll(cudaEvent_t event, const CollectiveCall& call) {
    check_healthy();
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) return true;
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      fail(to_text(call) + ": " + cudaGetErrorString(q));
    }
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess && async != ncclInProgress)
      fail(to_text(call) + ": " + ncclGetErrorString(async));
    return false;
  }
  static std::string to_text(const CollectiveCall& call) { return loom::detail::to_text(call); }
};

//! How a call's Request completes: in stream order (device buffers: the backend's stream waits
//! for the call, the host does not), or with the host waiting (barrier, staged host buffers).
enum class Completion { stream_ordered, host };

//! An asynchronous collective's handle: a CUDA event recorded after it on the communication
//! stream.
class EventRequest {
 public:
  EventRequest(std::shared_ptr<State> state, SharedEvent event, const CollectiveCall& call,
               Completion completion) noexcept
      : state_(std::move(state)), event_(std::move(event)), call_(call), completion_(completion) {}
  EventRequest(EventRequest&&) noexcept = default;
  EventRequest& operator=(EventRequest&&) = delete;
  void wait() {
    if (completion_ == Completion::host)
      state_->await(event_.get(), call_);
    else
      state_->order_compute_after(event_.get(), call_);
  }
  bool test() { return state_->poll(event_.get(), call_); }

 private:
  std::shared_ptr<State> state_;
  SharedEvent event_;
  CollectiveCall call_;
  Completion completion_;
};

}  // namespace detail

//! A group of ranks, one GPU each, communicating through NCCL on their backends' communication
//! streams (loom::cuda::communication_stream): a call runs after the kernels issued before it
//! and beside those issued after it, until its completion (run()'s return, its Request's
//! wait()), after which the kernels issued on the backend's stream run after it. On device
//! buffers that completion is stream-ordered: the host goes on at once, and the backend's next
//! host wait raises a call that failed or timed out (see the file comment).
class Communicator : public CollectiveInterface<Communicator> {
 public:
  using loom_communicator = void;
  //! Point-to-point runs on one stream in issue order, untagged (see loom::point_to_point_in_issue_order).
  static constexpr bool point_to_point_in_issue_order = true;

  //! Joins the group `id` of `size` ranks as `rank` (collective: every rank constructs with the
  //! same id and size), on `backend`'s device and stream, which must outlive the communicator.
  Communicator(loom::cuda& backend, const UniqueId& id, int size, int rank, CommOptions options = {})
      : state_(std::make_shared<detail::State>()) {
    LOOM_CHECK(size >= 1, "nccl communicator: size", size, "must be >= 1");
    LOOM_CHECK(rank >= 0 && rank < size, "nccl communicator: rank", rank,
               "must be in [0, size = " + std::to_string(size) + ")");
    state_->backend = &backend;
    state_->options = options;
    state_->rank = rank;
    state_->size = size;
    backend.activate();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&state_->comm, size, id.id, rank, &config);
    state_->finish(r, "ncclCommInitRankConfig");
  }

  //! Joins a new NCCL group made of the ranks of `group` (any loom communicator: MPI across
  //! processes, threads for one process driving several GPUs): its rank 0 makes the id and
  //! broadcasts it. Collective over `group`.
  template <class C>
  static Communicator bootstrap(loom::cuda& backend, C& group, CommOptions options = {}) {
    // The id travels as floats' bits (the communicators move floats, not bytes).
    std::array<float, sizeof(ncclUniqueId) / sizeof(float)> words{};
    UniqueId id;
    if (group.rank() == 0) {
      id = UniqueId::make();
      std::memcpy(words.data(), &id.id, sizeof(id.id));
    }
    group.broadcast(std::span<float>(words), 0);
    std::memcpy(&id.id, words.data(), sizeof(id.id));
    return Communicator(backend, id, group.size(), group.rank(), options);
  }

  Communicator(Communicator&&) noexcept = default;
  Communicator& operator=(Communicator&&) noexcept = default;

  int rank() const noexcept { return state_->rank; }
  int size() const noexcept { return state_->size; }
  //! The NCCL handle, for calls loom does not wrap.
  ncclComm_t native() const noexcept { return state_->comm; }

  //! Runs `call`. Device buffers: after the work issued on the backend's stream, and complete in
  //! stream order on return (the backend's stream waits for it; the host does not). Host
  //! buffers (staged through device memory) and barrier: complete on return (the host waited,
  //! with the timeout).
  void run(const CollectiveCall& call) { start(call).wait(); }

  //! Starts `call` on the communication stream, after the work issued on the backend's stream;
  //! the Request completes with it (wait(): in stream order, or for a barrier with the host
  //! waiting). Host buffers are staged and the call completes before this returns.
  Request start(const CollectiveCall& call) {
    state_->check_healthy();
    if (call.kind == Collective::barrier) {
      const CollectiveCall word = barrier_call();
      state_->backend->order_communication_after_compute();
      enqueue(word);
      return completion(call, detail::Completion::host, state_->backend->record_communication());
    }
    if (on_host(call)) {
      run_staged(std::span<const CollectiveCall>(&call, 1));
      return {};
    }
    state_->backend->order_communication_after_compute();
    enqueue(call);
    const std::span<const CollectiveCall> calls(&call, 1);
    return completion(call, detail::Completion::stream_ordered, state_->backend->record_communication(buffers(calls)));
  }

  //! Starts the sends and receives of `calls` as one NCCL group (ncclGroupStart/ncclGroupEnd):
  //! they progress together on the communication stream, so a rank may send to a peer and
  //! receive from it in one group, where a send issued alone would hold up that stream (and
  //! every later call on it) until its receiver posts the receive. One Request per call, each complete when the whole group is. Host buffers: the
  //! group is staged and completes before this returns.
  std::vector<Request> start_group(std::span<const CollectiveCall> calls) {
    state_->check_healthy();
    this->check_group(calls);
    std::vector<Request> requests(calls.size());
    if (calls.empty()) return requests;
    for (const CollectiveCall& call : calls)
      if (on_host(call)) {
        run_staged(calls);
        return requests;
      }
    state_->backend->order_communication_after_compute();
    enqueue_group(calls);
    const detail::SharedEvent done = state_->backend->record_communication(buffers(calls));
    for (std::size_t i = 0; i < calls.size(); ++i)
      requests[i] = completion(calls[i], detail::Completion::stream_ordered, done);
    return requests;
  }

  //! Ranks with the same `color` form a new group, ordered by `key` then rank (ncclCommSplit;
  //! collective over this group).
  Communicator split(int color, int key) {
    state_->check_healthy();
    LOOM_CHECK(color >= 0, "nccl communicator: split color", color, "must be >= 0");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    Communicator out;
    out.state_ = std::make_shared<detail::State>();
    out.state_->backend = state_->backend;
    out.state_->options = state_->options;
    out.state_->rank = state_->rank;
    // In non-blocking mode the new handle stays null until the split has completed: NCCL's own
    // thread writes it (into out.state_, on the heap, so the address is stable). Wait for it,
    // watching the parent for errors, then for the new communicator to report itself ready.
    try {
      state_->finish(ncclCommSplit(state_->comm, color, key, &out.state_->comm, &config), "ncclCommSplit");
      state_->wait_for_handle(out.state_->comm, "ncclCommSplit");
    } catch (...) {
      out.state_->failure = "the split failed";  // abort, not finalize, whatever NCCL left in it
      throw;
    }
    out.state_->finish(ncclInProgress, "ncclCommSplit (new communicator)");
    int n = 0, me = 0;
    out.state_->finish(ncclCommCount(out.state_->comm, &n), "ncclCommCount");
    out.state_->finish(ncclCommUserRank(out.state_->comm, &me), "ncclCommUserRank");
    out.state_->size = n;
    out.state_->rank = me;
    return out;
  }

 private:
  Communicator() = default;

  //! A barrier is an all-reduce of one float in device scratch the state keeps.
  CollectiveCall barrier_call() {
    if (state_->barrier_word == nullptr)
      state_->barrier_word = state_->backend->allocate(sizeof(float), MemoryCategory::communication);
    return {.kind = Collective::all_reduce, .input = state_->barrier_word, .output = state_->barrier_word, .count = 1};
  }

  //! Whether the call's buffers are host memory (then staged).
  static bool on_host(const CollectiveCall& call) {
    const void* p = call.output != nullptr ? call.output : call.input;
    if (p == nullptr) return false;
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, p) != cudaSuccess) {
      (void)cudaGetLastError();
      return true;
    }
    return attributes.type != cudaMemoryTypeDevice && attributes.type != cudaMemoryTypeManaged;
  }

  //! Issues `call` on the communication stream (device buffers; the caller ordered the stream
  //! after the compute).
  void enqueue(const CollectiveCall& call) {
    detail::State& s = *state_;
    const cudaStream_t stream = s.backend->communication_stream();
    const ncclDataType_t type = detail::type_of(call.dtype);
    ncclResult_t r = ncclSuccess;
    switch (call.kind) {
      case Collective::all_reduce:
        r = ncclAllReduce(call.output, call.output, call.count, type, detail::op_of(call.op), s.comm, stream);
        break;
      case Collective::reduce_scatter:
        r = ncclReduceScatter(call.input, call.output, call.count, type, detail::op_of(call.op), s.comm, stream);
        break;
      case Collective::all_gather: r = ncclAllGather(call.input, call.output, call.count, type, s.comm, stream); break;
      case Collective::broadcast:
        r = ncclBroadcast(call.output, call.output, call.count, type, call.peer, s.comm, stream);
        break;
      case Collective::send: r = ncclSend(call.input, call.count, type, call.peer, s.comm, stream); break;
      case Collective::recv: r = ncclRecv(call.output, call.count, type, call.peer, s.comm, stream); break;
      case Collective::barrier: break;
    }
    s.finish(r, "nccl enqueue");
  }

  //! A Request that completes with `event` (recorded after the call on the communication
  //! stream). The backend watches the call until it is done (cuda::watch), from now until the
  //! timeout.
  Request completion(const CollectiveCall& call, detail::Completion how, const detail::SharedEvent& event) {
    const auto deadline = std::chrono::steady_clock::now() + state_->options.timeout;
    state_->backend->watch([state = std::weak_ptr<detail::State>(state_), event, call, deadline] {
      const std::shared_ptr<detail::State> s = state.lock();
      return s == nullptr || s->watch(event.get(), call, deadline);
    });
    return Request(detail::EventRequest(state_, event, call, how));
  }

  //! The device memory `calls` read and write (kept in use until they are done, should a caller
  //! free some of it early).
  std::vector<loom::detail::DeviceRange> buffers(std::span<const CollectiveCall> calls) const {
    std::vector<loom::detail::DeviceRange> ranges;
    ranges.reserve(2 * calls.size());
    for (const CollectiveCall& call : calls) {
      const loom::detail::StagingPlan plan = loom::detail::staging_plan(call, rank(), size());
      ranges.push_back({call.input, plan.input_bytes});
      ranges.push_back({call.output, plan.output_bytes});
    }
    return ranges;
  }

  //! Issues the calls as one group on the communication stream (device buffers).
  void enqueue_group(std::span<const CollectiveCall> calls) {
    state_->finish(ncclGroupStart(), "ncclGroupStart");
    for (const CollectiveCall& call : calls) enqueue(call);
    state_->finish(ncclGroupEnd(), "ncclGroupEnd");
  }

  //! Host buffers: each call's data copied to device scratch, the calls run there (as one group
  //! when there are several), the results copied back (what moves: loom::detail::staging_plan).
  void run_staged(std::span<const CollectiveCall> calls) {
    loom::cuda& be = *state_->backend;
    // Each part starts 256-byte aligned, like a cudaMalloc'd buffer, whatever the sizes before it.
    const auto padded = [](std::size_t bytes) { return (bytes + 255) / 256 * 256; };
    std::vector<loom::detail::StagingPlan> plans;
    plans.reserve(calls.size());
    std::size_t total = 0;
    for (const CollectiveCall& call : calls) {
      plans.push_back(loom::detail::staging_plan(call, rank(), size()));
      total += padded(plans.back().input_bytes) + padded(plans.back().output_bytes);
    }
    const std::size_t scratch_bytes = total == 0 ? 1 : total;
    void* scratch = be.allocate(scratch_bytes, MemoryCategory::communication);
    struct Free {
      loom::cuda& be;
      void* p;
      std::size_t bytes;
      ~Free() { be.deallocate(p, bytes, MemoryCategory::communication); }
    } free_scratch{be, scratch, scratch_bytes};
    std::vector<CollectiveCall> device;
    device.reserve(calls.size());
    auto* next = static_cast<std::byte*>(scratch);
    for (std::size_t i = 0; i < calls.size(); ++i) {
      const loom::detail::StagingPlan& plan = plans[i];
      std::byte* in = next;
      std::byte* out = in + padded(plan.input_bytes);
      next = out + padded(plan.output_bytes);
      if (plan.stage_bytes > 0) be.copy_from_host(plan.stage_into_output ? out : in, plan.stage_from, plan.stage_bytes);
      device.push_back(loom::detail::with_scratch_buffers(calls[i], in, out));
    }
    be.order_communication_after_compute();
    if (device.size() == 1)
      enqueue(device.front());
    else
      enqueue_group(device);
    completion(device.front(), detail::Completion::host, be.record_communication()).wait();
    for (std::size_t i = 0; i < device.size(); ++i)
      if (plans[i].copy_back_bytes > 0) be.copy_to_host(plans[i].copy_back_to, device[i].output, plans[i].copy_back_bytes);
  }

  std::shared_ptr<detail::State> state_;
};

static_assert(loom::Communicator<Communicator>);

}  // namespace loom::nccl
