#pragma once
//! \file Reductions on the CUDA backend: the sum and the sum of squares (two-pass block reductions
//! in double, returned to the host: losses, the gradient norm) and scaling in place.

#include <algorithm>
#include <cstdint>
#include <span>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/memory.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_reduction {

//! Threads per block of both passes.
inline constexpr int threads = 512;
//! At most this many first-pass blocks (one partial each); the second pass is one block that
//! takes up to two partials per thread.
inline constexpr std::int64_t max_blocks = 2 * threads;
//! Elements per thread before a launch grows beyond one block.
inline constexpr std::int64_t elements_per_thread = 8;

//! First-pass blocks for `n > 0` elements. A function of n only, never of the device, so the
//! order of additions (and the bits of the sum) is the same on every GPU.
inline std::int64_t blocks_for(std::int64_t n) noexcept {
  return std::clamp<std::int64_t>((n + threads * elements_per_thread - 1) / (threads * elements_per_thread), 1,
                                  max_blocks);
}

//! partial[block] = sum of x[i] (or of x[i]^2 when `Square`) in double over the block's
//! grid-stride share of x.
template <bool Square, class T>
__global__ void partial_sums_kernel(double* partial, const T* x, std::int64_t n) {
  __shared__ double scratch[32];
  double sum = 0;
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride()) {
    const double value = static_cast<double>(to_accumulate(x[i]));
    sum += Square ? value * value : value;
  }
  sum = cuda_kernels::block_sum(sum, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

//! *total = sum of partial[0, count) in a fixed order (one block).
template <class A>
__global__ void total_kernel(A* total, const A* partial, std::int64_t count) {
  __shared__ A scratch[32];
  A sum = 0;
  for (std::int64_t i = threadIdx.x; i < count; i += blockDim.x) sum += partial[i];
  sum = cuda_kernels::block_sum(sum, scratch);
  if (threadIdx.x == 0) *total = sum;
}

template <class T>
__global__ void scale_kernel(T* x, accumulate_t<T> factor, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride())
    x[i] = static_cast<T>(to_accumulate(x[i]) * factor);
}

//! Enqueues *out = the sum (of squares when `Square`) of x[0, n) in double, n > 0: both passes,
//! the first writing up to max_blocks partials into `partial`.
template <bool Square, class T>
void enqueue_sum(const cuda& be, const T* x, std::int64_t n, double* partial, double* out, const char* kernel) {
  const std::int64_t blocks = blocks_for(n);
  partial_sums_kernel<Square><<<static_cast<unsigned>(blocks), threads, 0, be.stream()>>>(partial, x, n);
  cuda_check_launch(kernel);
  total_kernel<<<1, threads, 0, be.stream()>>>(out, partial, blocks);
  cuda_check_launch(kernel);
}

//! Sum (of squares when `Square`) of `x` in double on the host; see sum_of_squares.
template <bool Square, class T>
double sum_to_host(cuda& be, Tensor<const T> x, const char* kernel) {
  if (x.empty()) return 0.0;  // Tensor<T>{} has no data (its rank-0 shape counts one element)
  const std::int64_t blocks = blocks_for(x.numel());
  cuda_kernels::activate(be);
  Buffer<double, cuda> scratch(be, blocks + 1, MemoryCategory::workspace);
  enqueue_sum<Square>(be, x.data(), x.numel(), scratch.data(), scratch.data() + blocks, kernel);
  double total = 0;
  be.copy_to_host(&total, scratch.data() + blocks, sizeof(double));
  return total;
}

}  // namespace loom::detail::cuda_reduction

namespace loom::inline kernels {

//! Sum of the squares of `x`, accumulated in double; the global L2 norm is the square root of
//! the sum over all ranges. Returns to the host, so it waits for the stream. Deterministic: the
//! launch shape depends on the element count only. An empty tensor gives 0. Takes `cuda&`
//! because its scratch (the partial sums) comes from the backend's allocator (workspace).
template <class T>
double sum_of_squares(cuda& be, Tensor<const T> x) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  return detail::cuda_reduction::sum_to_host<true>(be, x, "sum_of_squares");
}

//! The sum of squares of several tensors (the gradient norm's ranges, one per parameter), in
//! double, with one wait for the stream instead of one per tensor: each tensor's total lands
//! in device memory, and the totals are added in order on the device. Deterministic.
template <class T>
double sum_of_squares(cuda& be, std::span<const Tensor<const T>> parts) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace r = detail::cuda_reduction;
  if (parts.empty()) return 0.0;
  const auto count = static_cast<std::int64_t>(parts.size());
  detail::cuda_kernels::activate(be);
  // [partials of the tensor being summed | one total per tensor | the sum of the totals]
  Buffer<double, cuda> scratch(be, r::max_blocks + count + 1, MemoryCategory::workspace);
  double* partial = scratch.data();
  double* totals = partial + r::max_blocks;
  be.fill_zero(totals, sizeof(double) * static_cast<std::size_t>(count));  // empty tensors add 0
  for (std::int64_t i = 0; i < count; ++i) {
    const Tensor<const T>& x = parts[static_cast<std::size_t>(i)];
    // Stream order lets every tensor reuse the partials once the previous total has read them.
    if (!x.empty()) r::enqueue_sum<true>(be, x.data(), x.numel(), partial, totals + i, "sum_of_squares (parts)");
  }
  r::total_kernel<<<1, r::threads, 0, be.stream()>>>(totals + count, totals, count);
  detail::cuda_check_launch("sum_of_squares (parts) total_kernel");
  double total = 0;
  be.copy_to_host(&total, totals + count, sizeof(double));
  return total;
}

//! Sum of the elements of `x`, accumulated in double (a micro-batch's per-token losses), on the
//! host; waits for the stream. Deterministic as sum_of_squares. An empty tensor gives 0.
template <class T>
double sum_elements(cuda& be, Tensor<const T> x) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  return detail::cuda_reduction::sum_to_host<false>(be, x, "sum_elements");
}

//! x *= factor (the factor rounded to float once; bf16 elements are multiplied in float and
//! rounded once). An empty tensor is left alone.
template <class T>
void scale(const cuda& be, Tensor<T> x, double factor) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  if (x.empty()) return;
  const std::int64_t n = x.numel();
  k::activate(be);
  detail::cuda_reduction::scale_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
      x.data(), static_cast<accumulate_t<T>>(factor), n);
  detail::cuda_check_launch("scale");
}

}  // namespace loom::inline kernels
