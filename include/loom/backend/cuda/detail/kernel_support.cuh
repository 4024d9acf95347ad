#pragma once
//! \file What the CUDA kernels share: the element types, launch sizes, the device guard, warp
//! and block sums, and the row-view shape check (host-only, no Eigen).

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/block_body.hpp"
#include "loom/backend/cuda/error.hpp"
#include "loom/backend/detail/shape_checks.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/bf16.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_kernels {

//! The element types the CUDA kernels take: float (fp32 storage, fp32 arithmetic) and bf16 (bf16
//! storage, loaded as float, fp32 arithmetic, one rounding per stored result). The reductions
//! that return to the host accumulate in double.
template <class T>
inline constexpr bool supported = std::is_same_v<T, float> || std::is_same_v<T, bf16>;

//! Threads per block of the element-wise kernels.
inline constexpr int elementwise_threads = 256;
//! At most this many blocks; grid-stride loops cover the rest (about 8 blocks of 256 threads per
//! SM on an H100 with 132 SMs keep every SM busy; more only adds scheduling).
inline constexpr std::int64_t max_elementwise_blocks = 4096;

//! Blocks for an element-wise kernel over `n > 0` elements (grid-stride loops inside).
inline unsigned elementwise_blocks(std::int64_t n) noexcept {
  const std::int64_t blocks = (n + elementwise_threads - 1) / elementwise_threads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(blocks, 1, max_elementwise_blocks));
}

//! Blocks of a row-wise kernel that gives one warp to each row, `warps_per_block` warps a block.
inline constexpr int warps_per_block = 8;
inline unsigned row_blocks(std::int64_t rows) noexcept {
  return static_cast<unsigned>((rows + warps_per_block - 1) / warps_per_block);
}

//! Columns per block and row threads per column of the column-sum kernels (bias, layernorm
//! parameter gradients): thread (x, y) sums rows y, y + 32, ... of column x in a fixed order,
//! then the 32 partials are added in order, so the result is the same bits on every run.
inline constexpr int column_tile = 32;
inline constexpr int column_row_threads = 32;
inline unsigned column_blocks(std::int64_t cols) noexcept {
  return static_cast<unsigned>((cols + column_tile - 1) / column_tile);
}

//! `W` elements of T moved as one load or store: W = 1 is one element, Vector16 is 16 bytes. The
//! row kernels that take a width as a template argument run as either, with the same results.
template <class T, int W>
struct alignas(sizeof(T) * W) Pack {
  static constexpr int elements = W;
  T value[W];
};

//! `elements` T in 16 bytes, moved as one load or store by the kernels that read rows a vector
//! at a time (layernorm's input gradient, the attention softmax, cross-entropy, map.cuh).
template <class T>
using Vector16 = Pack<T, static_cast<int>(16 / sizeof(T))>;

//! Whether `p` may be read as Vector16s.
inline bool aligned16(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

//! Whether rows of `columns` elements of T stored from these pointers (null is no pointer) can
//! be moved as Vector16s: every row starts 16-byte aligned.
template <class T>
bool vector_rows(std::int64_t columns, const void* a, const void* b = nullptr) noexcept {
  return columns % Vector16<T>::elements == 0 && aligned16(a) && aligned16(b);
}

//! Launches over many parts at once (the gradient norm's tensors, the optimizer's segments): each
//! part is cut into blocks of a fixed number of elements, and one launch takes up to `Parts`
//! parts, passed by value in the kernel's parameters (which stay under 4 KiB), so that a model's
//! hundreds of small tensors cost a few launches instead of one each.
template <int Parts>
struct PartBlocks {
  static constexpr int capacity = Parts;
  //! Part p's blocks in the launch are [first_block[p], first_block[p + 1]).
  std::int64_t first_block[Parts + 1];
  std::int64_t n[Parts];  //!< part p's elements
  int count;              //!< parts in this launch
};

//! Calls `launch(blocks, members)` for consecutive groups of the parts with elements (`sizes`,
//! in order; empty ones skipped), at most Blocks::capacity a group: `blocks` (a PartBlocks) says
//! which blocks of the launch take which part, `members` which index of `sizes` is the group's
//! part p (the caller fills its own per-part arrays, pointers, from it).
template <class Blocks, class F>
void for_each_part_launch(std::span<const std::int64_t> sizes, std::int64_t block_elements, F&& launch) {
  Blocks blocks{};
  std::vector<std::size_t> members;  // the indices in `sizes` of the current group
  const auto flush = [&] {
    if (blocks.count == 0) return;
    launch(static_cast<const Blocks&>(blocks), std::span<const std::size_t>(members));
    blocks.count = 0;
    members.clear();
  };
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 0) continue;
    if (blocks.count == Blocks::capacity) flush();
    const int p = blocks.count++;
    if (p == 0) blocks.first_block[0] = 0;
    blocks.n[p] = sizes[i];
    blocks.first_block[p + 1] = blocks.first_block[p] + (sizes[i] + block_elements - 1) / block_elements;
    members.push_back(i);
  }
  flush();
}

//! Makes the calling thread work on the backend's device (ranks as threads may use several
//! GPUs; a launch on another device's stream fails).
inline void activate(const cuda& be) { be.activate(); }

//! Checks that `t`, seen as a matrix (all but the last axis are rows), is [rows, cols] and has
//! data; the same rule and message as the CPU kernels.
template <class T>
void check_rows(const Tensor<T>& t, std::int64_t rows, std::int64_t cols, const char* kernel,
                const char* arg) {
  loom::detail::check_rows(t, rows, cols, kernel, arg);
  check_data(t, kernel, arg);
}

//! Checks that the row-wise input `in` has rank >= 1 (it defines N and C).
template <class T>
void check_has_rows(const Tensor<T>& in, const char* kernel) {
  if (in.shape().rank() == 0) [[unlikely]]
    throw Error(std::string(kernel) + ": argument in shape", detail::to_text(in.shape()),
                "expected rank >= 1");
}

#if defined(__CUDACC__)

//! The first index of this thread and the stride of a grid-stride loop, in 64 bits.
__device__ inline std::int64_t grid_first() {
  return static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ inline std::int64_t grid_stride() {
  return static_cast<std::int64_t>(gridDim.x) * blockDim.x;
}

//! The part of `blocks` whose blocks hold block `block` of the launch (binary search), and the
//! elements [begin, end) of that part the block takes, `block_elements` a block.
struct PartRange {
  int part;
  std::int64_t begin, end;
};
template <class Blocks>
__device__ inline PartRange part_range(const Blocks& blocks, std::int64_t block, std::int64_t block_elements) {
  int lo = 0, hi = blocks.count - 1;  // the last part p with first_block[p] <= block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (blocks.first_block[mid] <= block)
      lo = mid;
    else
      hi = mid - 1;
  }
  const std::int64_t begin = (block - blocks.first_block[lo]) * block_elements;
  return {lo, begin, begin + block_elements < blocks.n[lo] ? begin + block_elements : blocks.n[lo]};
}

//! Sum over the 32 lanes of a warp (butterfly: every lane gets the same bits).
template <class A>
__device__ inline A warp_sum(A value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

//! Sum over a one-dimensional block, valid in thread 0. `scratch` is shared memory of 32
//! elements; call once per kernel (no barrier after the last read).
template <class A>
__device__ inline A block_sum(A value, A* scratch) {
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  value = warp_sum(value);
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  const int warps = static_cast<int>((blockDim.x + 31) / 32);
  value = static_cast<int>(threadIdx.x) < warps ? scratch[threadIdx.x] : A(0);
  if (warp == 0) value = warp_sum(value);
  return value;
}

#endif  // __CUDACC__

}  // namespace loom::detail::cuda_kernels
