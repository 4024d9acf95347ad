#pragma once
//! \file loom::mpi — the Communicator over an MPI communicator (OpenMPI), the RAII MPI
//! Environment, and mpi::run, which turns an exception on one rank into an error on every other.
//!
//! Fail loudly, never hang (DESIGN.md, invariant 7): no wait is a blocking MPI call. Every wait
//! is a loop of MPI_Test against a deadline (CommOptions::timeout) that also looks for failure
//! notices from other ranks. With CommOptions::check_agreement, every rank sends the signature
//! of each collective (kind, count, type, op, root) to every other rank on a private control
//! communicator before the collective is posted, so that ranks that disagree, or a rank that
//! does not arrive, raise loom::Error naming them instead of corrupting data or hanging. The
//! collective itself is posted only when all signatures agree, in issue order; a start() never
//! blocks on the peers.
//!
//! A Communicator and the Requests it returns are used by one thread at a time (as an MPI
//! communicator would be); different communicators may be used from different threads.

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "loom/comm/collectives.hpp"
#include "loom/comm/concepts.hpp"
#include "loom/comm/detail/reduce.hpp"
#include "loom/comm/request.hpp"
#include "loom/core/bf16.hpp"
#include "loom/core/error.hpp"

namespace loom::mpi {

namespace detail {

//! Throws loom::Error naming the MPI call and MPI's text for `code` unless it is MPI_SUCCESS.
inline void check(int code, const char* call) {
  if (code == MPI_SUCCESS) [[likely]]
    return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) length = 0;
  throw Error(std::string(call) + " failed: " + std::string(text, static_cast<std::size_t>(length)), "", "");
}

//! Whether MPI may still be called (destructors run after MPI_Finalize must not call it).
inline bool mpi_alive() noexcept {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

//! An error text without loom's "loom: " prefix, to embed it in another message.
inline std::string strip_prefix(std::string_view text) {
  constexpr std::string_view prefix = "loom: ";
  if (text.substr(0, prefix.size()) == prefix) text.remove_prefix(prefix.size());
  return std::string(text);
}

// Tags on the control communicators (never on the user's communicator, so they cannot match a
// user's send or recv).
inline constexpr int signature_tag = 1;  //!< a collective's signature, for the agreement check
inline constexpr int failure_tag = 2;    //!< "this communicator failed on rank r: ..."
inline constexpr int abort_tag = 3;      //!< "rank r failed: ..." (mpi::run), to the whole family

//! Failure notices are cut to this many bytes: small enough to be sent eagerly.
inline constexpr std::size_t notice_bytes = 1024;

//! Ring all_reduces use tags from here on, on the control communicator.
inline constexpr int ring_tag_base = 16;
//! From this many bytes on, all_reduce runs as a ring (State::post).
inline constexpr std::size_t ring_bytes = std::size_t{256} << 10;

//! The kind value a split() sends as its signature (not a Collective).
inline constexpr std::int32_t split_kind = 100;

//! What every rank sends before a collective: enough to name the call in a message.
struct Signature {
  std::int64_t count = 0;
  std::int32_t kind = 0;
  std::int32_t dtype = 0;
  std::int32_t op = 0;
  std::int32_t root = 0;
  friend bool operator==(const Signature&, const Signature&) = default;
};

inline Signature signature_of(const CollectiveCall& call) {
  const bool reduces = call.kind == Collective::all_reduce || call.kind == Collective::reduce_scatter;
  return {.count = static_cast<std::int64_t>(call.count),
          .kind = static_cast<std::int32_t>(call.kind),
          .dtype = static_cast<std::int32_t>(call.dtype),
          .op = reduces ? static_cast<std::int32_t>(call.op) : 0,
          .root = call.kind == Collective::broadcast ? call.peer : 0};
}

//! An all_reduce of at most this many bytes sends its data along with its signature, and every
//! rank reduces all ranks' data itself: one message round instead of the check's round and then
//! MPI's.
inline constexpr std::size_t eager_bytes = 256;

//! What the agreement check sends: the signature, and the data of an eager all_reduce.
struct Message {
  Signature signature;
  alignas(8) unsigned char payload[eager_bytes];
};

//! "all_reduce(count=10, float32, sum)", or "split".
inline std::string describe(const Signature& s) {
  if (s.kind == split_kind) return "split";
  return ::loom::detail::to_text(CollectiveCall{.kind = static_cast<Collective>(s.kind),
                                                .count = static_cast<std::size_t>(s.count),
                                                .dtype = static_cast<DType>(s.dtype),
                                                .op = static_cast<ReduceOp>(s.op),
                                                .peer = s.root});
}

//! "rank 3" or "ranks 3, 5".
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string text = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text;
}

// bf16 reductions: MPI has no bf16, so a 2-byte type with user-defined operations that
// accumulate in float and round to bf16 after each combining step (the same fold the threads
// communicator uses, loom/comm/detail/reduce.hpp).
inline void bf16_sum(void* in, void* inout, int* length, MPI_Datatype*) {
  ::loom::detail::reduce_into(DType::bfloat16, ReduceOp::sum, inout, in, static_cast<std::size_t>(*length));
}
inline void bf16_max(void* in, void* inout, int* length, MPI_Datatype*) {
  ::loom::detail::reduce_into(DType::bfloat16, ReduceOp::max, inout, in, static_cast<std::size_t>(*length));
}

//! Frees an MPI communicator unless MPI is gone.
inline void free_comm(MPI_Comm& comm) noexcept {
  if (comm != MPI_COMM_NULL && mpi_alive()) MPI_Comm_free(&comm);
  comm = MPI_COMM_NULL;
}

//! Sends `text` to every other rank of `comm` with `tag`, waits up to a short while for the
//! sends to leave (they are small, so MPI sends them eagerly), and lets go of the rest. The
//! text's buffer is leaked when a send is still pending, because MPI may still read it.
inline void send_notice(MPI_Comm comm, int tag, std::string_view text) noexcept {
  int rank = 0, size = 0;
  if (MPI_Comm_rank(comm, &rank) != MPI_SUCCESS || MPI_Comm_size(comm, &size) != MPI_SUCCESS) return;
  const std::size_t length = std::min(text.size(), notice_bytes);
  auto buffer = std::make_unique<char[]>(length + 1);
  std::memcpy(buffer.get(), text.data(), length);
  std::vector<MPI_Request> sends;
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    MPI_Request request = MPI_REQUEST_NULL;
    if (MPI_Isend(buffer.get(), static_cast<int>(length), MPI_CHAR, r, tag, comm, &request) == MPI_SUCCESS)
      sends.push_back(request);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
  int done = 0;
  while (!sends.empty() && MPI_Testall(static_cast<int>(sends.size()), sends.data(), &done, MPI_STATUSES_IGNORE) == MPI_SUCCESS && !done &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  if (!done && !sends.empty()) {
    for (auto& request : sends)
      if (request != MPI_REQUEST_NULL) MPI_Request_free(&request);
    static_cast<void>(buffer.release());  // MPI may still read it
  }
}

//! Receives a pending notice with `tag` on `comm`, if there is one: returns whether one came,
//! its sender and text. Matched probe, so two threads probing the same channel cannot both
//! receive one message.
inline bool receive_notice(MPI_Comm comm, int tag, int& source, std::string& text) {
  int flag = 0;
  MPI_Message message = MPI_MESSAGE_NULL;
  MPI_Status status;
  check(MPI_Improbe(MPI_ANY_SOURCE, tag, comm, &flag, &message, &status), "MPI_Improbe");
  if (!flag) return false;
  int length = 0;
  check(MPI_Get_count(&status, MPI_CHAR, &length), "MPI_Get_count");
  text.assign(static_cast<std::size_t>(length), '\0');
  check(MPI_Mrecv(text.data(), length, MPI_CHAR, &message, MPI_STATUS_IGNORE), "MPI_Mrecv");
  source = status.MPI_SOURCE;
  return true;
}

//! What the communicators split (directly or not) from one root communicator share: a channel
//! on which mpi::run tells every rank that one rank failed, and whether that happened.
struct Family {
  MPI_Comm channel = MPI_COMM_NULL;
  std::atomic<bool> failed{false};
  std::mutex mutex;     // guards `failure`
  std::string failure;  // the message every communicator of the family raises once failed

  explicit Family(MPI_Comm root) {
    check(MPI_Comm_dup(root, &channel), "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(channel, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  }
  ~Family() { free_comm(channel); }
  Family(const Family&) = delete;
  Family& operator=(const Family&) = delete;

  void mark_failed(std::string message) {
    std::lock_guard lock(mutex);
    if (failed.load()) return;
    failure = std::move(message);
    failed.store(true);
  }
  std::string failure_text() {
    std::lock_guard lock(mutex);
    return failure;
  }
  //! Throws the family's failure if one rank reported one (now or earlier).
  void throw_if_failed() {
    if (!failed.load(std::memory_order_acquire)) {
      int source = 0;
      std::string text;
      if (!receive_notice(channel, abort_tag, source, text)) return;
      mark_failed("rank " + std::to_string(source) + " failed: " + strip_prefix(text));
    }
    throw Error(failure_text(), "", "");
  }
};

//! One operation of a communicator: the call, its agreement-check messages and its MPI request.
//! Heap-allocated and pooled, because MPI holds pointers into it while it is in flight.
struct Operation {
  CollectiveCall call;
  bool split = false;
  bool in_place = false;  // reduce_scatter: posted in place on the input
  bool posted = false;
  std::uint64_t sequence = 0;  // the how-manyth collective of its communicator (rings' tags)
  bool eager = false;  // a small all_reduce whose data travels with the signatures
  std::vector<Message> messages;       // one per rank, as received (this rank's: what it sends)
  std::vector<const void*> sources;    // the ranks' payloads, for an eager all_reduce
  std::vector<MPI_Request> checks;    // size()-1 receives, then size()-1 sends
  MPI_Request request = MPI_REQUEST_NULL;

  // A large all_reduce runs as a ring over nonblocking sends and receives (see State::post).
  bool ring = false;
  bool ring_done = false;
  int ring_step = 0;  // 0 .. 2·(size-1): reduce-scatter steps, then all-gather steps
  int ring_tag = 0;
  MPI_Request ring_requests[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  std::vector<unsigned char> scratch;  // one received chunk, reduced into place

  Signature signature() const {
    if (!split) return signature_of(call);
    return {.kind = split_kind};
  }
  std::string description() const {
    return split ? std::string("split") : ::loom::detail::to_text(call);
  }
};

//! The state of one loom::mpi::Communicator; shared with its Requests, so that a Request that
//! outlives its Communicator still finds the MPI objects it waits on.
class State {
 public:
  //! Takes `comm` (already owned: a duplicate or a split result) and makes the control
  //! communicator, the bf16 type and operations. `family` is null for a root communicator.
  State(MPI_Comm owned, CommOptions options, std::shared_ptr<Family> family)
      : comm_(owned), options_(options) {
    check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
    check(MPI_Comm_dup(comm_, &control_), "MPI_Comm_dup");
    check(MPI_Comm_set_errhandler(control_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    family_ = family ? std::move(family) : std::make_shared<Family>(comm_);
    check(MPI_Type_contiguous(2, MPI_BYTE, &bf16_type_), "MPI_Type_contiguous");
    check(MPI_Type_commit(&bf16_type_), "MPI_Type_commit");
    check(MPI_Op_create(&bf16_sum, 1, &bf16_sum_), "MPI_Op_create");
    check(MPI_Op_create(&bf16_max, 1, &bf16_max_), "MPI_Op_create");
    void* tag_bound = nullptr;
    int found = 0;
    check(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &tag_bound, &found), "MPI_Comm_get_attr");
    tag_upper_bound_ = found ? *static_cast<int*>(tag_bound) : 32767;
  }

  ~State() {
    if (!mpi_alive()) return;  // after MPI_Finalize there is nothing left to free
    for (Operation* op : pool_) delete op;
    for (Operation* op : abandoned_)
      if (quiet(*op)) delete op;  // else MPI may still write into it: leaked on purpose
    if (bf16_sum_ != MPI_OP_NULL) MPI_Op_free(&bf16_sum_);
    if (bf16_max_ != MPI_OP_NULL) MPI_Op_free(&bf16_max_);
    if (bf16_type_ != MPI_DATATYPE_NULL) MPI_Type_free(&bf16_type_);
    free_comm(control_);
    free_comm(comm_);
  }
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  int rank() const noexcept { return rank_; }
  int size() const noexcept { return size_; }
  const CommOptions& options() const noexcept { return options_; }
  MPI_Comm native() const noexcept { return comm_; }
  const std::shared_ptr<Family>& family() const noexcept { return family_; }

  //! Starts `call`: posts it at once (send, recv, no agreement check) or sends its signature
  //! and queues it until every rank's signature has come and agrees. Returns the operation,
  //! which the caller gives back with release().
  Operation* start(const CollectiveCall& call, bool split = false) {
    throw_if_failed();
    LOOM_CHECK(call.count <= static_cast<std::size_t>(INT_MAX), std::string(name(call.kind)) + ": count", call.count,
               "must be at most INT_MAX (" + std::to_string(INT_MAX) +
                   ") elements under MPI; split the buffer into smaller calls");
    if (call.kind == Collective::send || call.kind == Collective::recv)
      LOOM_CHECK(call.tag <= tag_upper_bound_, std::string(name(call.kind)) + ": tag", call.tag,
                 "must be at most MPI_TAG_UB (" + std::to_string(tag_upper_bound_) + ")");
    Operation* op = acquire();
    op->call = call;
    op->split = split;
    if (call.kind != Collective::send && call.kind != Collective::recv) op->sequence = collectives_++;
    try {
      guarded([&] {
        check_family();
        throw_if_notified();
        const bool point_to_point = call.kind == Collective::send || call.kind == Collective::recv;
        if (point_to_point || !options_.check_agreement || size_ == 1) {
          post(*op);
        } else {
          send_signature(*op);
          queue_.push_back(op);
          progress();  // post it now if every peer is already there: overlap starts early
        }
      });
    } catch (...) {
      release(op);
      throw;
    }
    return op;
  }

  //! Waits until `op` completed, with the deadline and failure notices described in the file
  //! comment.
  void wait(Operation& op) {
    guarded([&] {
      using clock = std::chrono::steady_clock;
      const auto begin = clock::now();
      const auto deadline = begin + options_.timeout;
      // Most waits end within microseconds: test in a tight loop first (a yield there costs
      // several microseconds on a busy machine), then yield between tests; sleep only once
      // nothing has moved for a while (1 ms while peers have not arrived, 50 ms once the data
      // moves: MPI moves a large message only inside our tests), so that oversubscribed ranks
      // leave the cores to the ranks doing the work.
      const auto busy_until = begin + std::chrono::microseconds(20);
      auto last_moved = begin;
      while (!poll(op)) {
        const auto now = clock::now();
        if (now >= deadline) fail(timeout_message(op), true);
        if (moved_) last_moved = now;
        const auto patience = op.posted ? std::chrono::milliseconds(50) : std::chrono::milliseconds(1);
        if (now < busy_until)
          continue;
        else if (now < last_moved + patience)
          std::this_thread::yield();
        else
          std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    });
  }

  //! Whether `op` has completed (then its results are in place); never blocks.
  bool test(Operation& op) {
    bool finished = false;
    guarded([&] { finished = poll(op); });
    return finished;
  }

  //! Gives `op` back after its wait (or after an error). An operation MPI still holds
  //! (abandoned after an error) is kept aside instead of reused.
  void release(Operation* op) noexcept {
    if (!op) return;
    std::erase(queue_, op);
    std::erase(rings_, op);
    if (mpi_alive() && !quiet(*op)) {
      abandoned_.push_back(op);
      return;
    }
    op->posted = false;
    op->ring = false;
    op->eager = false;
    op->request = MPI_REQUEST_NULL;
    op->checks.clear();
    pool_.push_back(op);
  }

  //! Marks this communicator failed with `message` (loom::Error text) and, when `notify`, tells
  //! the other ranks of this communicator, so that their waits fail too instead of timing out.
  void poison(const std::string& message, bool notify) noexcept {
    if (failure_) return;
    failure_ = std::make_unique<std::string>(strip_prefix(message));
    queue_.clear();  // the queued and ring operations are released (or abandoned) by their owners
    rings_.clear();
    if (notify && mpi_alive()) send_notice(control_, failure_tag, *failure_);
  }

 private:
  //! Runs `body`; any error it throws poisons the communicator first (telling the peers unless
  //! the error came from them or from an earlier failure).
  template <class Body>
  void guarded(Body&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      poison(e.what(), true);
      throw;
    }
  }

  [[noreturn]] void fail(const std::string& message, bool notify) {
    poison(message, notify);
    throw Error(strip_prefix(message), "", "");
  }

  //! A failure reported to the whole family (mpi::run on another rank): fail without telling
  //! anyone, since that rank told everyone.
  void check_family() {
    try {
      family_->throw_if_failed();
    } catch (const Error& e) {
      fail(e.what(), false);
    }
  }

  void throw_if_failed() {
    if (failure_)
      throw Error("this communicator failed earlier (" + *failure_ + ")", "", "later operations fail at once; make a new communicator");
    if (family_->failed.load(std::memory_order_acquire)) fail(family_->failure_text(), false);
  }

  //! A failure notice from a peer of this communicator (it timed out or saw an MPI error).
  void throw_if_notified() {
    int source = 0;
    std::string text;
    if (!receive_notice(control_, failure_tag, source, text)) return;
    fail("rank " + std::to_string(source) + " failed: " + text, false);
  }

  //! One step of a wait: failure notices, the queue, then `op` itself.
  bool poll(Operation& op) {
    throw_if_failed();
    check_family();
    throw_if_notified();
    moved_ = progress();
    if (!op.posted) return false;
    if (op.ring) {
      if (!op.ring_done) return false;
      finish(op, MPI_Status{});
      return true;
    }
    int flag = 0;
    MPI_Status status;
    status.MPI_ERROR = MPI_SUCCESS;
    const int code = MPI_Test(&op.request, &flag, &status);
    if (code != MPI_SUCCESS && op.call.kind == Collective::recv) {
      int error_class = 0;
      MPI_Error_class(code, &error_class);
      if (error_class == MPI_ERR_TRUNCATE)
        fail(op.description() + ": rank " + std::to_string(op.call.peer) +
                 " sent more elements: sender and receiver must agree on the count and type",
             true);
    }
    check(code, "MPI_Test");
    if (!flag) return false;
    finish(op, status);
    return true;
  }

  //! Posts the queued operations, in issue order, whose signatures have all come and agree.
  //! Returns whether anything moved (then the waits keep spinning rather than sleeping).
  bool progress() {
    bool moved = false;
    while (!queue_.empty()) {
      Operation& op = *queue_.front();
      int done = 0;
      check(MPI_Testall(static_cast<int>(op.checks.size()), op.checks.data(), &done, MPI_STATUSES_IGNORE),
            "MPI_Testall");
      if (!done) break;
      agree(op);
      queue_.pop_front();
      post(op);
      moved = true;
    }
    // Every ring in flight advances, not only the one waited for: a peer may wait for another.
    for (std::size_t i = 0; i < rings_.size();) {
      Operation& op = *rings_[i];
      moved = advance_ring(op) || moved;
      if (op.ring_done)
        rings_.erase(rings_.begin() + static_cast<std::ptrdiff_t>(i));
      else
        ++i;
    }
    return moved;
  }

  //! Elements [begin, end) of chunk `c` (of size()) of the ring's buffer.
  std::pair<std::size_t, std::size_t> chunk(const Operation& op, int c) const noexcept {
    const std::size_t n = op.call.count, p = static_cast<std::size_t>(size_);
    const auto k = static_cast<std::size_t>((c % size_ + size_) % size_);
    return {k * n / p, (k + 1) * n / p};
  }

  //! Posts step `op.ring_step` of a ring all_reduce: in the first size()-1 steps each rank sends
  //! one chunk to the right and receives another from the left, which it adds into its own
  //! copy (after them, rank r holds chunk r+1 reduced); in the last size()-1 steps the reduced
  //! chunks travel around the ring. Each element crosses the network 2·(size-1)/size times, as
  //! in MPI's own large-message algorithms.
  void post_ring_step(Operation& op) {
    const int s = op.ring_step, last = size_ - 1;
    const int right = (rank_ + 1) % size_, left = (rank_ + size_ - 1) % size_;
    const std::size_t element = size_of(op.call.dtype);
    auto* data = static_cast<unsigned char*>(op.call.output);
    const MPI_Datatype type = datatype(op.call.dtype);
    int send_chunk = 0, receive_chunk = 0;
    void* receive_into = nullptr;
    if (s < last) {  // reduce-scatter
      send_chunk = rank_ - s;
      receive_chunk = rank_ - s - 1;
      receive_into = op.scratch.data();
    } else {  // all-gather
      send_chunk = rank_ + 1 - (s - last);
      receive_chunk = rank_ - (s - last);
      receive_into = data + chunk(op, receive_chunk).first * element;
    }
    const auto [send_begin, send_end] = chunk(op, send_chunk);
    const auto [receive_begin, receive_end] = chunk(op, receive_chunk);
    check(MPI_Irecv(receive_into, static_cast<int>(receive_end - receive_begin), type, left, op.ring_tag, control_,
                    &op.ring_requests[0]),
          "MPI_Irecv");
    check(MPI_Isend(data + send_begin * element, static_cast<int>(send_end - send_begin), type, right, op.ring_tag,
                    control_, &op.ring_requests[1]),
          "MPI_Isend");
  }

  //! Completes the ring's current step if its messages arrived (adding the received chunk in
  //! the reduce-scatter steps) and posts the next. Returns whether a step completed.
  bool advance_ring(Operation& op) {
    bool moved = false;
    while (!op.ring_done) {
      int done = 0;
      check(MPI_Testall(2, op.ring_requests, &done, MPI_STATUSES_IGNORE), "MPI_Testall");
      if (!done) return moved;
      moved = true;
      if (op.ring_step < size_ - 1) {
        const auto [begin, end] = chunk(op, rank_ - op.ring_step - 1);
        const std::size_t element = size_of(op.call.dtype);
        ::loom::detail::reduce_into(op.call.dtype, op.call.op, static_cast<unsigned char*>(op.call.output) + begin * element,
                                    op.scratch.data(), end - begin);
      }
      if (++op.ring_step == 2 * (size_ - 1))
        op.ring_done = true;
      else
        post_ring_step(op);
    }
    return moved;
  }

  //! Throws, naming two ranks and their calls, unless every rank sent the same signature. The
  //! first rank that differs from rank 0 is named, so that every rank raises the same message.
  void agree(const Operation& op) {
    const auto& all = op.messages;
    for (int r = 1; r < size_; ++r) {
      const Signature& other = all[static_cast<std::size_t>(r)].signature;
      if (!(other == all[0].signature))
        fail("ranks disagree: rank 0 called " + describe(all[0].signature) + ", rank " + std::to_string(r) +
                 " called " + describe(other),
             false);  // every rank sees the same signatures, and raises the same error itself
    }
  }

  void send_signature(Operation& op) {
    op.messages.resize(static_cast<std::size_t>(size_));
    Message& own = op.messages[static_cast<std::size_t>(rank_)];
    own.signature = op.signature();
    op.eager = !op.split && op.call.kind == Collective::all_reduce && op.call.bytes() <= eager_bytes;
    const std::size_t payload = op.eager ? op.call.bytes() : 0;
    if (payload > 0) std::memcpy(own.payload, op.call.output, payload);
    op.checks.assign(2 * static_cast<std::size_t>(size_ - 1), MPI_REQUEST_NULL);
    std::size_t i = 0;
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      // Room for the largest message, so that a peer that disagrees is named, not truncated.
      check(MPI_Irecv(&op.messages[static_cast<std::size_t>(r)], sizeof(Message), MPI_BYTE, r, signature_tag,
                      control_, &op.checks[i++]),
            "MPI_Irecv");
    }
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      check(MPI_Isend(&own, static_cast<int>(offsetof(Message, payload) + payload), MPI_BYTE, r, signature_tag,
                      control_, &op.checks[i++]),
            "MPI_Isend");
    }
  }

  MPI_Datatype datatype(DType dtype) const noexcept {
    return dtype == DType::float32 ? MPI_FLOAT : dtype == DType::float64 ? MPI_DOUBLE : bf16_type_;
  }
  MPI_Op reduction(DType dtype, ReduceOp op) const noexcept {
    if (dtype == DType::bfloat16) return op == ReduceOp::max ? bf16_max_ : bf16_sum_;
    return op == ReduceOp::max ? MPI_MAX : MPI_SUM;  // average: a sum, divided afterwards
  }

  void post(Operation& op) {
    const CollectiveCall& c = op.call;
    const MPI_Datatype type = datatype(c.dtype);
    const int count = static_cast<int>(c.count);
    MPI_Request* request = &op.request;
    if (op.split) {
      check(MPI_Ibarrier(comm_, request), "MPI_Ibarrier");
      op.posted = true;
      return;
    }
    if (op.eager) {  // every rank's data is here: reduce it in rank order, the same on every rank
      op.sources.resize(static_cast<std::size_t>(size_));
      for (int r = 0; r < size_; ++r)
        op.sources[static_cast<std::size_t>(r)] = op.messages[static_cast<std::size_t>(r)].payload;
      void* destination[1] = {c.output};
      ::loom::detail::reduce(c.dtype, c.op, op.sources.data(), size_, destination, 1, c.count, size_);
      op.request = MPI_REQUEST_NULL;  // complete: MPI_Test says so at once
      op.posted = true;
      return;
    }
    switch (c.kind) {
      case Collective::all_reduce:
        if (size_ > 1 && c.bytes() >= ring_bytes && c.count >= static_cast<std::size_t>(size_)) {
          // MPI's nonblocking all_reduce of a large buffer in place is about twice as slow as its
          // blocking one (OpenMPI's libnbc then picks a binomial tree); a ring over nonblocking
          // sends matches the blocking one and still never blocks.
          op.ring = true;
          op.ring_done = false;
          op.ring_step = 0;
          op.ring_tag = ring_tag_base + static_cast<int>(op.sequence % static_cast<std::uint64_t>(tag_upper_bound_ - ring_tag_base));
          op.scratch.resize((c.count / static_cast<std::size_t>(size_) + 1) * size_of(c.dtype));
          post_ring_step(op);
          rings_.push_back(&op);
          op.posted = true;
          return;
        }
        check(MPI_Iallreduce(MPI_IN_PLACE, c.output, count, type, reduction(c.dtype, c.op), comm_, request),
              "MPI_Iallreduce");
        break;
      case Collective::reduce_scatter: {
        const auto* own_part = static_cast<const unsigned char*>(c.input) + static_cast<std::size_t>(rank_) * c.bytes();
        op.in_place = c.count > 0 && own_part == c.output;
        if (op.in_place)  // MPI leaves the result at the front of the input; finish() moves it
          check(MPI_Ireduce_scatter_block(MPI_IN_PLACE, const_cast<void*>(c.input), count, type,
                                          reduction(c.dtype, c.op), comm_, request),
                "MPI_Ireduce_scatter_block");
        else
          check(MPI_Ireduce_scatter_block(c.input, c.output, count, type, reduction(c.dtype, c.op), comm_, request),
                "MPI_Ireduce_scatter_block");
        break;
      }
      case Collective::all_gather: {
        const auto* own_part = static_cast<const unsigned char*>(c.output) + static_cast<std::size_t>(rank_) * c.bytes();
        if (c.count > 0 && own_part == c.input)
          check(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, c.output, count, type, comm_, request),
                "MPI_Iallgather");
        else
          check(MPI_Iallgather(c.input, count, type, c.output, count, type, comm_, request), "MPI_Iallgather");
        break;
      }
      case Collective::broadcast:
        check(MPI_Ibcast(c.output, count, type, c.peer, comm_, request), "MPI_Ibcast");
        break;
      case Collective::barrier:
        check(MPI_Ibarrier(comm_, request), "MPI_Ibarrier");
        break;
      case Collective::send:
        check(MPI_Isend(c.input, count, type, c.peer, c.tag, comm_, request), "MPI_Isend");
        break;
      case Collective::recv:
        check(MPI_Irecv(c.output, count, type, c.peer, c.tag, comm_, request), "MPI_Irecv");
        break;
    }
    op.posted = true;
  }

  //! What happens after MPI completed `op`: the received count is checked, an in-place
  //! reduce_scatter moves its result into place, and an average is divided.
  void finish(Operation& op, const MPI_Status& status) {
    const CollectiveCall& c = op.call;
    if (op.split) return;
    if (c.kind == Collective::recv) {
      int received = 0;
      check(MPI_Get_count(&status, datatype(c.dtype), &received), "MPI_Get_count");
      if (static_cast<std::size_t>(received) != c.count)
        fail(op.description() + ": rank " + std::to_string(c.peer) + " sent " + std::to_string(received) +
                 " elements: sender and receiver must agree on the count and type",
             true);
    }
    if (c.kind == Collective::reduce_scatter && op.in_place && rank_ != 0)
      std::memmove(c.output, c.input, c.bytes());
    if ((c.kind == Collective::all_reduce || c.kind == Collective::reduce_scatter) && c.op == ReduceOp::average &&
        !op.eager)  // reduce() divided already
      ::loom::detail::divide(c.dtype, c.output, c.count, size_);
  }

  //! "rank 3 did not arrive at all_reduce(count=10, float32, sum) within 200 ms", naming the
  //! ranks whose signature of the first queued collective did not come; or, once posted, that
  //! the operation did not complete.
  std::string timeout_message(Operation& op) {
    const std::string within = " within " + std::to_string(options_.timeout.count()) + " ms";
    if (!queue_.empty()) {
      Operation& blocker = *queue_.front();
      std::vector<int> missing;
      for (int r = 0, i = 0; r < size_; ++r) {
        if (r == rank_) continue;
        MPI_Request& receive = blocker.checks[static_cast<std::size_t>(i++)];
        int flag = 0;
        if (receive != MPI_REQUEST_NULL && MPI_Test(&receive, &flag, MPI_STATUS_IGNORE) == MPI_SUCCESS && !flag)
          missing.push_back(r);
      }
      if (!missing.empty()) return rank_list(missing) + " did not arrive at " + blocker.description() + within;
    }
    const CollectiveCall& c = op.call;
    if (c.kind == Collective::send || c.kind == Collective::recv)
      return "rank " + std::to_string(c.peer) + " did not arrive at " + op.description() + within;
    return op.description() + " did not complete" + within +
           (options_.check_agreement ? " (every rank had arrived)"
                                     : " (check_agreement is off, so the missing ranks are not known)");
  }

  //! Whether MPI holds nothing of `op` any more (cancelling receives nobody will match).
  static bool quiet(Operation& op) noexcept {
    bool all = true;
    for (std::size_t i = 0; i < op.checks.size(); ++i) {
      MPI_Request& request = op.checks[i];
      if (request == MPI_REQUEST_NULL) continue;
      int flag = 0;
      MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
      if (flag) continue;
      if (i < op.checks.size() / 2) {  // a receive: cancel it, then it completes
        MPI_Cancel(&request);
        MPI_Wait(&request, MPI_STATUS_IGNORE);
      } else {
        all = false;
      }
    }
    for (MPI_Request& request : op.ring_requests) {
      if (request == MPI_REQUEST_NULL) continue;
      int flag = 0;
      MPI_Test(&request, &flag, MPI_STATUS_IGNORE);
      if (!flag) all = false;  // a ring step in flight: its peer may still send into it
    }
    if (op.posted && op.request != MPI_REQUEST_NULL) {
      int flag = 0;
      MPI_Test(&op.request, &flag, MPI_STATUS_IGNORE);
      if (!flag) all = false;  // a collective cannot be cancelled
    }
    return all;
  }

  Operation* acquire() {
    if (pool_.empty()) return new Operation;
    Operation* op = pool_.back();
    pool_.pop_back();
    return op;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  MPI_Comm control_ = MPI_COMM_NULL;  // signatures and failure notices, apart from user traffic
  int rank_ = 0;
  int size_ = 1;
  int tag_upper_bound_ = 32767;
  CommOptions options_;
  std::shared_ptr<Family> family_;
  MPI_Datatype bf16_type_ = MPI_DATATYPE_NULL;
  MPI_Op bf16_sum_ = MPI_OP_NULL;
  MPI_Op bf16_max_ = MPI_OP_NULL;
  std::deque<Operation*> queue_;         // started collectives not yet posted, in issue order
  std::vector<Operation*> rings_;        // ring all_reduces in flight
  std::uint64_t collectives_ = 0;        // collectives started: the same count on every rank
  bool moved_ = false;                   // whether the last poll saw progress
  std::vector<Operation*> pool_;         // finished operations, for reuse
  std::vector<Operation*> abandoned_;    // operations MPI still held when they were given back
  std::unique_ptr<std::string> failure_;  // set once an error poisoned this communicator
};

//! What a loom::Request holds for an MPI operation.
class Pending {
 public:
  Pending(std::shared_ptr<State> state, Operation* op) noexcept : state_(std::move(state)), op_(op) {}
  Pending(Pending&& other) noexcept : state_(std::move(other.state_)), op_(std::exchange(other.op_, nullptr)) {}
  Pending& operator=(Pending&&) = delete;
  ~Pending() {
    if (op_) state_->release(op_);
  }
  void wait() { state_->wait(*op_); }
  bool test() { return state_->test(*op_); }

 private:
  std::shared_ptr<State> state_;
  Operation* op_;
};
static_assert(RequestState<Pending>);

}  // namespace detail

//! MPI for the lifetime of this object: MPI_Init_thread asking for MPI_THREAD_MULTIPLE (at least
//! MPI_THREAD_FUNNELED is required) and MPI_Finalize at the end. If MPI was already initialised
//! it does neither, so Environments nest.
class Environment {
 public:
  //! Initialises MPI without command-line arguments (unless already initialised).
  Environment() : Environment(nullptr, nullptr) {}
  //! Initialises MPI with the program's arguments (unless already initialised).
  Environment(int& argc, char**& argv) : Environment(&argc, &argv) {}
  ~Environment() {
    if (owns_ && detail::mpi_alive()) MPI_Finalize();
  }
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;

  //! The thread support MPI provides (MPI_THREAD_FUNNELED or more).
  int thread_level() const noexcept { return thread_level_; }
  //! Whether this Environment initialised MPI (and so finalises it).
  bool owns() const noexcept { return owns_; }

 private:
  Environment(int* argc, char*** argv) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    LOOM_CHECK(!finalized, "mpi::Environment", "MPI already finalised", "MPI can be initialised once per process");
    if (initialized) {
      detail::check(MPI_Query_thread(&thread_level_), "MPI_Query_thread");
    } else {
      detail::check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &thread_level_), "MPI_Init_thread");
      owns_ = true;
    }
    if (thread_level_ < MPI_THREAD_FUNNELED) {
      if (owns_) MPI_Finalize();
      owns_ = false;
      throw Error("mpi::Environment: thread support", thread_level_,
                  "must be at least MPI_THREAD_FUNNELED (" + std::to_string(MPI_THREAD_FUNNELED) + ")");
    }
  }

  bool owns_ = false;
  int thread_level_ = MPI_THREAD_SINGLE;
};

//! A group of MPI processes running loom's collectives: owns a duplicate of an MPI communicator
//! (so that loom's traffic never matches the user's), maps collectives onto MPI's nonblocking
//! ones, turns MPI errors into loom::Error (MPI_ERRORS_RETURN; never MPI_Abort) and checks,
//! when CommOptions::check_agreement is on, that every rank issues the same collective. Move-only.
//!
//! all_reduce of 256 KiB or more runs as a ring of nonblocking sends and receives (as fast as
//! MPI's blocking all_reduce, where OpenMPI's nonblocking one is about half as fast); everything
//! else is MPI's nonblocking collective. After an error (timeout, disagreement, a failed rank)
//! the communicator is poisoned: later operations throw at once. MPI cannot cancel a collective
//! it already started, so the buffers of an operation that failed by timeout must stay alive
//! until the process ends (or MPI may still write into them).
class Communicator : public CollectiveInterface<Communicator> {
 public:
  using loom_communicator = void;

  //! Duplicates `comm` (collective over it). The duplicate is the root of a family: it and the
  //! communicators split from it share the channel on which notify_failure() reaches every rank.
  explicit Communicator(MPI_Comm comm, CommOptions options = {}) : state_(make_root(comm, options)) {}

  //! MPI_COMM_WORLD, duplicated.
  static Communicator world(CommOptions options = {}) { return Communicator(MPI_COMM_WORLD, options); }

  Communicator(Communicator&&) noexcept = default;
  Communicator& operator=(Communicator&&) noexcept = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  //! This process's rank in the group.
  int rank() const { return state().rank(); }
  //! The number of ranks in the group.
  int size() const { return state().size(); }
  //! The options this communicator was made with.
  const CommOptions& options() const { return state().options(); }
  //! The MPI communicator loom uses (owned by this object; for interoperation, not for freeing).
  MPI_Comm native() const { return state().native(); }

  //! Runs `call` to completion (see CollectiveCall for what each kind does).
  void run(const CollectiveCall& call) {
    detail::State& s = state();
    detail::Operation* op = s.start(call);
    struct Release {
      detail::State& s;
      detail::Operation* op;
      ~Release() { s.release(op); }
    } release{s, op};
    s.wait(*op);
  }

  //! Starts `call`; its buffers must stay alive until the returned Request completed.
  Request start(const CollectiveCall& call) {
    detail::Operation* op = state().start(call);
    return Request(detail::Pending(state_, op));
  }

  //! The sub-group of the ranks that pass the same `color` (>= 0), ordered by `key`, then by
  //! rank (MPI_Comm_split; collective over this group). It belongs to this communicator's
  //! family and has the same options.
  Communicator split(int color, int key) {
    LOOM_CHECK(color >= 0, "mpi communicator: split color", color, "must be >= 0");
    detail::State& s = state();
    {
      // Every rank must be here before the blocking MPI_Comm_split: a checked, timed barrier.
      detail::Operation* op = s.start(CollectiveCall{.kind = Collective::barrier}, true);
      struct Release {
        detail::State& s;
        detail::Operation* op;
        ~Release() { s.release(op); }
      } release{s, op};
      s.wait(*op);
    }
    MPI_Comm part = MPI_COMM_NULL;
    try {
      detail::check(MPI_Comm_split(s.native(), color, key, &part), "MPI_Comm_split");
      return Communicator(std::make_shared<detail::State>(part, s.options(), s.family()));
    } catch (const std::exception& e) {
      detail::free_comm(part);
      s.poison(e.what(), true);
      throw;
    }
  }

  //! Tells every other rank of this communicator's family (the root it was split from) that this
  //! rank failed with `what`: their waits on any communicator of the family raise
  //! "rank r failed: <what>" (r: the rank in the root). mpi::run calls this on an exception.
  void notify_failure(std::string_view what) noexcept {
    if (!state_) return;
    detail::Family& family = *state_->family();
    if (family.failed.load()) return;  // the failure came from another rank, which told everyone
    family.mark_failed("this rank failed: " + detail::strip_prefix(what));
    if (detail::mpi_alive()) detail::send_notice(family.channel, detail::abort_tag, detail::strip_prefix(what));
  }

 private:
  explicit Communicator(std::shared_ptr<detail::State> state) noexcept : state_(std::move(state)) {}

  static std::shared_ptr<detail::State> make_root(MPI_Comm comm, CommOptions options) {
    LOOM_CHECK(comm != MPI_COMM_NULL, "mpi communicator", "MPI_COMM_NULL", "needs a valid MPI communicator");
    LOOM_CHECK(options.timeout.count() > 0, "mpi communicator: timeout", options.timeout.count(), "must be > 0 ms");
    MPI_Comm copy = MPI_COMM_NULL;
    detail::check(MPI_Comm_dup(comm, &copy), "MPI_Comm_dup");
    try {
      return std::make_shared<detail::State>(copy, options, nullptr);
    } catch (...) {
      detail::free_comm(copy);
      throw;
    }
  }

  detail::State& state() const {
    LOOM_CHECK(state_ != nullptr, "mpi communicator", "a moved-from communicator", "use the one it was moved to");
    return *state_;
  }

  std::shared_ptr<detail::State> state_;
};

static_assert(::loom::Communicator<Communicator>);

//! Runs `fn(comm)`. An exception becomes: a notice to every other rank of comm's family (their
//! waits raise "rank r failed: <what>"), the line "rank r: <what>" on stderr, and a return of
//! 1. Returns fn's result when it is an int, else 0. Never calls MPI_Abort.
template <class Fn>
int run(Communicator& comm, Fn&& fn) {
  try {
    if constexpr (std::is_convertible_v<std::invoke_result_t<Fn&, Communicator&>, int>) {
      return static_cast<int>(fn(comm));
    } else {
      fn(comm);
      return 0;
    }
  } catch (const std::exception& e) {
    comm.notify_failure(e.what());
    std::fprintf(stderr, "rank %d: %s\n", comm.rank(), e.what());
  } catch (...) {
    comm.notify_failure("an exception that is not a std::exception");
    std::fprintf(stderr, "rank %d: an exception that is not a std::exception\n", comm.rank());
  }
  std::fflush(stderr);
  return 1;
}

//! A whole MPI program: Environment, the world communicator with `options`, and
//! run(world, fn) (see there). Returns what main should return.
template <class Fn>
int run(int& argc, char**& argv, Fn fn, CommOptions options = {}) {
  try {
    Environment environment(argc, argv);
    Communicator world = Communicator::world(options);
    return run(world, fn);
  } catch (const std::exception& e) {  // MPI could not start: no rank to tell
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}

}  // namespace loom::mpi
