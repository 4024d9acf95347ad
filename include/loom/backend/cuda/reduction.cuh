#pragma once
//! \file Reductions on the CUDA backend: the sum and the sum of squares (two-pass block reductions
//! in double, returned to the host: losses, the gradient norm) and scaling in place.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

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

//! Elements each block of parts_sums_kernel sums (512 threads, 32 each): a function of the parts'
//! sizes only, so the order of additions is the same on every GPU.
inline constexpr std::int64_t part_block_elements = threads * 32;

//! The parts of one parts_sums_kernel launch (127 pointers beside PartBlocks: 3 KiB).
template <class T>
struct PartsTable {
  cuda_kernels::PartBlocks<127> blocks;
  const T* x[127];
};

//! partial[blockIdx.x] = the sum of squares in double of one block's share of one part: the
//! gradient norm of a model in a launch per 127 tensors (a launch per tensor left GPT-2 small's
//! 148 gradient tensors 0.8 ms on an H200, where reading them takes 0.06).
template <class T>
__global__ void parts_sums_kernel(double* partial, PartsTable<T> table) {
  __shared__ double scratch[32];
  const cuda_kernels::PartRange r = cuda_kernels::part_range(table.blocks, blockIdx.x, part_block_elements);
  const T* x = table.x[r.part];
  double sum = 0;
  for (std::int64_t i = r.begin + threadIdx.x; i < r.end; i += blockDim.x) {
    const double value = static_cast<double>(to_accumulate(x[i]));
    sum += value * value;
  }
  sum = cuda_kernels::block_sum(sum, scratch);
  if (threadIdx.x == 0) partial[blockIdx.x] = sum;
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
//! double, with one wait for the stream: each part is cut into blocks of part_block_elements,
//! each block's sum lands in device memory (one launch per 127 parts), and one block adds them
//! all in order. Deterministic: the blocks depend on the parts' sizes only.
template <class T>
double sum_of_squares(cuda& be, std::span<const Tensor<const T>> parts) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace r = detail::cuda_reduction;
  namespace k = detail::cuda_kernels;
  std::vector<std::int64_t> sizes;
  std::int64_t blocks = 0;
  for (const Tensor<const T>& x : parts) {
    sizes.push_back(x.empty() ? 0 : x.numel());
    blocks += (sizes.back() + r::part_block_elements - 1) / r::part_block_elements;
  }
  if (blocks == 0) return 0.0;
  k::activate(be);
  Buffer<double, cuda> scratch(be, blocks + 1, MemoryCategory::workspace);  // [block sums | total]
  double* partial = scratch.data();
  std::int64_t launched = 0;
  k::for_each_part_launch<decltype(r::PartsTable<T>::blocks)>(
      sizes, r::part_block_elements, [&](const auto& part_blocks, std::span<const std::size_t> members) {
        r::PartsTable<T> table{part_blocks, {}};
        for (std::size_t p = 0; p < members.size(); ++p) table.x[p] = parts[members[p]].data();
        const std::int64_t launch_blocks = part_blocks.first_block[part_blocks.count];
        r::parts_sums_kernel<T><<<static_cast<unsigned>(launch_blocks), r::threads, 0, be.stream()>>>(
            partial + launched, table);
        detail::cuda_check_launch("sum_of_squares (parts)");
        launched += launch_blocks;
      });
  r::total_kernel<<<1, r::threads, 0, be.stream()>>>(partial + blocks, partial, blocks);
  detail::cuda_check_launch("sum_of_squares (parts) total_kernel");
  double total = 0;
  be.copy_to_host(&total, partial + blocks, sizeof(double));
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
