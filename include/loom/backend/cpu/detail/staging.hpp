#pragma once
//! \file How a CPU kernel on narrow storage (bf16) runs the float code: it widens a row or chunk
//! of each operand into per-thread scratch in the accumulate type, computes there, and rounds
//! each result once on the way back. For float and double every helper hands back the tensor's
//! own memory, so those kernels run in place, unchanged.

#include <cstdint>
#include <type_traits>
#include <vector>

#include "loom/core/accumulate.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace loom::detail {

//! out[i] = x[i] in the accumulate type, for i in [0, n).
template <class T>
void widen_into(const T* x, accumulate_t<T>* out, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) out[i] = to_accumulate(x[i]);
}

//! out[i] = a[i] rounded once to T, for i in [0, n).
template <class T>
void narrow_into(const accumulate_t<T>* a, T* out, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(a[i]);
}

//! Per-thread scratch for staging: `per_thread` elements of the accumulate type per thread, or
//! nothing at all where T is its own accumulate type. Allocated before a parallel region, so
//! that a failed allocation throws normally.
template <class T>
class Staging {
 public:
  using A = accumulate_t<T>;
  Staging(int threads, std::int64_t per_thread) : per_thread_(per_thread) {
    if constexpr (is_narrow_storage<T>) data_.resize(static_cast<std::size_t>(threads * per_thread));
  }
  //! Thread `thread`'s scratch (nullptr where nothing is staged).
  A* at(int thread) noexcept { return data_.empty() ? nullptr : data_.data() + thread * per_thread_; }

 private:
  std::int64_t per_thread_;
  std::vector<A> data_;
};

//! The `n` elements at `x` in the accumulate type: `x` itself, or widened into `scratch`. Read-only
//! where X is const; otherwise updated in place (`+=`), and `store` writes them back.
template <class X>
auto load(X* x, accumulate_t<X>* scratch, std::int64_t n) noexcept
    -> std::conditional_t<std::is_const_v<X>, const accumulate_t<X>*, accumulate_t<X>*> {
  if constexpr (is_narrow_storage<X>) {
    widen_into(x, scratch, n);
    return scratch;
  } else {
    return x;
  }
}

//! Where results bound for `x` are computed: `x` itself, or `scratch`; `store` writes them back.
template <class T>
accumulate_t<T>* output(T* x, accumulate_t<T>* scratch) noexcept {
  if constexpr (is_narrow_storage<T>)
    return scratch;
  else
    return x;
}

//! Rounds `n` staged results once into `x` (nothing to do where they were computed in place).
template <class T>
void store(T* x, const accumulate_t<T>* staged, std::int64_t n) noexcept {
  if constexpr (is_narrow_storage<T>) narrow_into(staged, x, n);
}

}  // namespace loom::detail

namespace loom::detail {

//! Elements of a stack staging buffer for chunks of `chunk` elements of T: `chunk` where T is
//! staged, 1 (unused) where the kernel works in place.
template <class T, std::int64_t chunk>
inline constexpr std::int64_t stage_size = is_narrow_storage<T> ? chunk : 1;

}  // namespace loom::detail

namespace loom::detail {

//! out[rows, cols] (row-major, packed) = the block of `src` (row-major, rows `ld` apart) at row
//! r0, column c0, widened to the accumulate type.
template <class T>
void widen_block(const T* src, std::int64_t ld, std::int64_t r0, std::int64_t rows, std::int64_t c0,
                 std::int64_t cols, accumulate_t<T>* out) noexcept {
  for (std::int64_t r = 0; r < rows; ++r) widen_into(src + (r0 + r) * ld + c0, out + r * cols, cols);
}

//! The block of `dst` (rows `ld` apart) = src[rows, cols] (packed) rounded once to T.
template <class T>
void narrow_block(const accumulate_t<T>* src, std::int64_t src_ld, T* dst, std::int64_t ld, std::int64_t rows,
                  std::int64_t cols) noexcept {
  for (std::int64_t r = 0; r < rows; ++r) narrow_into(src + r * src_ld, dst + r * ld, cols);
}

//! The calling thread's index in its OpenMP team (0 without OpenMP).
inline int thread_index() noexcept {
#if defined(_OPENMP)
  return omp_get_thread_num();
#else
  return 0;
#endif
}

//! Keeps Eigen single-threaded inside a kernel's parallel loop. Eigen already stays serial when
//! the team has more than one thread; for a one-thread team it would read omp_get_max_threads()
//! and could open a nested region. The setting is per OpenMP task, so it ends with the region.
inline void serial_gemm_in_this_task() noexcept {
#if defined(_OPENMP)
  omp_set_num_threads(1);
#endif
}

}  // namespace loom::detail
