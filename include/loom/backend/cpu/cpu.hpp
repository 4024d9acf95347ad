#pragma once
//! \file The CPU backend: host memory with accounting, Eigen GEMMs and OpenMP loops that use
//! this rank's share of the cores.

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <string>
#include <thread>

#include "loom/backend/concepts.hpp"
#include "loom/core/error.hpp"
#include "loom/core/memory.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace loom {

//! The CPU backend. A value per rank: it owns the rank's memory accounting and its thread count
//! (the rank's share of the cores). Kernels take it as their first argument.
class cpu {
 public:
  using loom_backend = void;

  //! `threads` = 0 uses every hardware thread.
  explicit cpu(int threads = 1) : threads_(threads) {
    LOOM_CHECK(threads >= 0, "cpu backend threads", threads, "must be >= 0 (0 = all cores)");
    if (threads_ == 0) threads_ = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  }
  cpu(const cpu&) = delete;
  cpu& operator=(const cpu&) = delete;

  //! Threads each kernel may use.
  int threads() const noexcept { return threads_; }

  //! 64-byte aligned host memory, counted under `category`.
  //! Fails with a loom::Error that says what this rank holds, by category, when the host has no
  //! more (or `bytes` is beyond any allocation).
  void* allocate(std::size_t bytes, MemoryCategory category) {
    // Rounding a request within `alignment` of the largest size would wrap around to a small one.
    const bool representable = bytes <= std::numeric_limits<std::size_t>::max() - alignment;
    const std::size_t rounded = bytes == 0 ? alignment : (bytes + alignment - 1) / alignment * alignment;
    void* p = representable ? std::aligned_alloc(alignment, rounded) : nullptr;
    if (p == nullptr)
      throw Error("cpu allocate (" + std::string(name(category)) + ")", std::to_string(bytes) + " bytes",
                  "the host is out of memory: this rank holds " + memory_.held() + "; " +
                      std::string(out_of_memory_hint));
    memory_.add(category, bytes);
    return p;
  }
  void deallocate(void* p, std::size_t bytes, MemoryCategory category) noexcept {
    std::free(p);
    memory_.remove(category, bytes);
  }
  const MemoryTracker& memory() const noexcept { return memory_; }
  MemoryTracker& memory() noexcept { return memory_; }

  void fill_zero(void* p, std::size_t bytes) const noexcept { std::memset(p, 0, bytes); }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) const noexcept {
    std::memcpy(dst, src, bytes);
  }
  void copy_to_host(void* dst, const void* src, std::size_t bytes) const noexcept {
    std::memcpy(dst, src, bytes);
  }
  //! Host work is synchronous.
  void synchronize() const noexcept {}

  //! Makes Eigen's GEMM on the calling thread use this rank's threads. Eigen reads OpenMP's
  //! per-thread setting, so ranks running as threads do not disturb one another.
  void bind_gemm_threads() const noexcept {
#if defined(_OPENMP)
    omp_set_num_threads(threads_);
#endif
  }

  static constexpr std::size_t alignment = 64;

 private:
  int threads_;
  MemoryTracker memory_;
};

static_assert(Backend<cpu>);

}  // namespace loom
