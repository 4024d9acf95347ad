#pragma once
//! \file Request: the handle of an asynchronous communication. Each communicator keeps its own
//! state behind it (a completion record, an MPI_Request); the handle stores that state inline
//! (no allocation per call) and erases its type so that every communicator returns the same
//! handle type.

#include <cstddef>
#include <new>
#include <span>
#include <type_traits>
#include <utility>

namespace loom {

//! What a communicator puts behind a Request: `wait()` blocks until the operation completed
//! (throwing loom::Error if it failed), `test()` says whether it has completed without
//! blocking (and may throw the same error). Must be nothrow-movable and fit in
//! Request::inline_bytes.
template <class S>
concept RequestState = std::is_nothrow_move_constructible_v<S> && requires(S& s) {
  s.wait();
  { s.test() } -> std::same_as<bool>;
};

//! The handle of an asynchronous communication: `wait()` until it completes, `test()` whether it
//! has. Move-only. A default-constructed Request is already complete. A Request destroyed before
//! completing waits for the operation (its buffers must stay alive until then); an error seen
//! only there is dropped, because the peers raise it on their side as well.
class Request {
 public:
  //! Bytes of state a communicator may keep inline in a Request.
  static constexpr std::size_t inline_bytes = 96;

  Request() noexcept = default;

  // The Request check comes first, so that asking whether Request itself is a RequestState
  // (copying a std::vector<Request> does) does not recurse through this constructor.
  template <class S>
    requires(!std::is_same_v<std::decay_t<S>, Request> && RequestState<S>)
  explicit Request(S state) noexcept {
    static_assert(sizeof(S) <= inline_bytes, "loom: a communicator's request state must fit in Request::inline_bytes");
    static_assert(alignof(S) <= alignof(std::max_align_t), "loom: request state is over-aligned");
    ::new (static_cast<void*>(storage_)) S(std::move(state));
    ops_ = &ops_for<S>;
  }

  Request(Request&& other) noexcept { take(other); }
  Request& operator=(Request&& other) noexcept {
    if (this != &other) {
      reset();
      take(other);
    }
    return *this;
  }
  Request(const Request&) = delete;
  Request& operator=(const Request&) = delete;
  ~Request() { reset(); }

  //! Blocks until the operation has completed; throws loom::Error if it failed. Afterwards the
  //! request is empty (done() is true).
  void wait() {
    if (!ops_) return;
    struct Clear {
      Request* r;
      ~Clear() { r->destroy(); }
    } clear{this};
    ops_->wait(storage_);
  }
  //! Whether the operation has completed (then the request becomes empty); throws loom::Error if
  //! it failed.
  bool test() {
    if (!ops_) return true;
    bool finished = false;
    try {
      finished = ops_->test(storage_);
    } catch (...) {
      destroy();
      throw;
    }
    if (finished) destroy();
    return finished;
  }
  //! True when there is nothing left to wait for.
  bool done() const noexcept { return ops_ == nullptr; }

 private:
  struct Ops {
    void (*wait)(void*);
    bool (*test)(void*);
    void (*move)(void* to, void* from) noexcept;
    void (*destroy)(void*) noexcept;
  };
  template <class S>
  static constexpr Ops ops_for{
      [](void* p) { static_cast<S*>(p)->wait(); },
      [](void* p) { return static_cast<S*>(p)->test(); },
      [](void* to, void* from) noexcept { ::new (to) S(std::move(*static_cast<S*>(from))); },
      [](void* p) noexcept { static_cast<S*>(p)->~S(); }};

  void take(Request& other) noexcept {
    if (!other.ops_) return;
    other.ops_->move(storage_, other.storage_);
    ops_ = other.ops_;
    other.destroy();
  }
  void destroy() noexcept {
    if (ops_) ops_->destroy(storage_);
    ops_ = nullptr;
  }
  void reset() noexcept {
    if (!ops_) return;
    try {
      ops_->wait(storage_);
    } catch (...) {
      // Dropped on purpose: see the class comment.
    }
    destroy();
  }

  alignas(std::max_align_t) unsigned char storage_[inline_bytes];
  const Ops* ops_ = nullptr;
};

//! Waits for every request of `requests` (e.g. a start_group's), in order.
inline void wait_all(std::span<Request> requests) {
  for (Request& r : requests) r.wait();
}

}  // namespace loom
