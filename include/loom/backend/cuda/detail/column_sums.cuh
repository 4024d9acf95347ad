#pragma once
//! \file Column sums over many rows (the bias gradient, layernorm's parameter gradients), added
//! into T outputs, in two launches that fill the GPU whatever the column count:
//!
//! 1. partials: block (x, chunk) sums the rows of chunk `chunk` (column_chunk_rows of them) for
//!    the column_tile columns of block x: thread (x, y) takes rows y, y + 32, ... of the chunk in
//!    order, then thread y = 0 adds the 32 partials in order, into float workspace [S][chunks][C];
//! 2. totals (column_totals_block): per column, 8 threads add every 8th chunk's partial in order,
//!    then one thread the 8 sums in order and the old output value, and rounds once.
//!
//! The order depends on the shape only, never on the GPU, so the bits are the same on every run
//! and every device. (One block per 32 columns, as before, ran 24 blocks for C = 768: a fifth of
//! an H100's SMs, 0.18 ms for layernorm's [16384, 768] parameter gradients.)

#include <cstddef>
#include <cstdint>
#include <string>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/block_body.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"

namespace loom::detail::cuda_kernels {

//! Rows per chunk of the first launch: fixed, so that the summation order is the shape's alone.
inline constexpr std::int64_t column_chunk_rows = 256;
inline std::int64_t column_chunks(std::int64_t rows) noexcept {
  return (rows + column_chunk_rows - 1) / column_chunk_rows;
}

//! The most rows add_column_sums takes: 65535 chunks, the limit of the grid's y extent.
inline constexpr std::int64_t max_column_sum_rows = 65535 * column_chunk_rows;

//! Checks, before any work, that `rows` rows fit the column sums' grid; `kernel` names the
//! public kernel in the error.
inline void check_column_sum_rows(std::int64_t rows, const char* kernel) {
  LOOM_CHECK(rows <= max_column_sum_rows, std::string(kernel) + ": rows (N)", rows,
             "must be at most " + std::to_string(max_column_sum_rows) + " (65535 chunks of 256 rows)");
}

//! The outputs of S column sums, each [cols], added into.
template <class T, int S>
struct ColumnOutputs {
  T* out[S];
};

//! Row threads per column of the totals launch, and its threads and shared bytes.
inline constexpr int total_row_threads = 8;
inline constexpr int totals_threads = column_tile * total_row_threads;
template <class A>
inline constexpr std::size_t totals_shared = sizeof(A) * totals_threads;

//! The totals of column sums whose partials are [S][chunks][cols] floats: block (x, s) adds into
//! out[s] the columns x column_tile .. + column_tile - 1. Thread (x, y) (thread = y column_tile +
//! x) adds chunks y, y + total_row_threads, ... of its column in order, thread y = 0 then the
//! total_row_threads sums in order and the old output value, and rounds once. The order is the
//! shape's alone. (One thread per column took 12 us for layernorm's 2 x 768 columns of 64 chunks
//! on an H200: three blocks on 132 SMs.) Shared memory: totals_shared<A>.
LOOM_BLOCK_BODY
template <int S, class T, class A, class Thread>
LOOM_HD void column_totals_block(Thread& th, ColumnOutputs<T, S> outputs, const A* partials, std::int64_t chunks,
                                 std::int64_t cols) {
  const int x = th.thread() % column_tile, y = th.thread() / column_tile;
  const std::int64_t j = th.block_x() * column_tile + x, s = th.block_y();
  A sum = 0;
  if (j < cols)
    for (std::int64_t chunk = y; chunk < chunks; chunk += total_row_threads)
      sum += partials[(s * chunks + chunk) * cols + j];
  A* sums = reinterpret_cast<A*>(th.shared());
  sums[th.thread()] = sum;
  th.sync_block();
  if (y != 0 || j >= cols) return;
  A total = 0;
  for (int k = 0; k < total_row_threads; ++k) total += sums[k * column_tile + x];
  T& out = outputs.out[s][j];
  out = static_cast<T>(to_accumulate(out) + total);
}

#if defined(__CUDACC__)

//! First launch: partials[s][chunk][j] = sum over the chunk's rows n of term(n, j)[s].
//! `Term` is a device functor: void operator()(std::int64_t n, std::int64_t j, A (&add)[S]),
//! which adds row n's terms of column j into `add`.
template <int S, class A, class Term>
__global__ void column_partials_kernel(A* partials, std::int64_t rows, std::int64_t cols, Term term) {
  __shared__ A partial[S][column_row_threads][column_tile];
  const std::int64_t j = static_cast<std::int64_t>(blockIdx.x) * column_tile + threadIdx.x;
  const std::int64_t chunk = blockIdx.y, first = chunk * column_chunk_rows;
  const std::int64_t last = first + column_chunk_rows < rows ? first + column_chunk_rows : rows;
  A sum[S] = {};
  if (j < cols)
    for (std::int64_t n = first + threadIdx.y; n < last; n += column_row_threads) term(n, j, sum);
  for (int s = 0; s < S; ++s) partial[s][threadIdx.y][threadIdx.x] = sum[s];
  __syncthreads();
  if (threadIdx.y != 0 || j >= cols) return;
  const std::int64_t chunks = gridDim.y;
  for (int s = 0; s < S; ++s) {
    A total = 0;
    for (int k = 0; k < column_row_threads; ++k) total += partial[s][k][threadIdx.x];
    partials[(s * chunks + chunk) * cols + j] = total;
  }
}

//! Second launch, through add_column_totals.
template <int S, class T, class A>
__global__ void __launch_bounds__(totals_threads) column_totals_kernel(ColumnOutputs<T, S> outputs,
                                                                       const A* partials, std::int64_t chunks,
                                                                       std::int64_t cols) {
  BlockThread th;
  column_totals_block<S>(th, outputs, partials, chunks, cols);
}

//! out[s][j] += sum over chunks of partials[s][chunk][j] ([S][chunks][cols] device floats), rounded
//! once: column_totals_block on the backend's stream. `kernel` names the public kernel.
template <int S, class T, class A>
void add_column_totals(const cuda& be, ColumnOutputs<T, S> outputs, const A* partials, std::int64_t chunks,
                       std::int64_t cols, const char* kernel) {
  column_totals_kernel<S><<<dim3(column_blocks(cols), S), totals_threads, totals_shared<A>, be.stream()>>>(
      outputs, partials, chunks, cols);
  cuda_check_launch(kernel);
}

//! Adds the S column sums of term over [rows, cols] into `outputs` (0 < rows <=
//! max_column_sum_rows, checked by the caller before its work; cols > 0), with S * chunks * cols
//! floats of workspace from the backend's allocator.
template <int S, class T, class Term>
void add_column_sums(cuda& be, ColumnOutputs<T, S> outputs, std::int64_t rows, std::int64_t cols, Term term,
                     const char* kernel) {
  using A = accumulate_t<T>;
  const std::int64_t chunks = column_chunks(rows);
  // Returned to the cache while the stream may still use it: safe, as in attention_backward.
  const Buffer<A, cuda> partials(be, S * chunks * cols, MemoryCategory::workspace);
  const dim3 grid(column_blocks(cols), static_cast<unsigned>(chunks)), block(column_tile, column_row_threads);
  column_partials_kernel<S><<<grid, block, 0, be.stream()>>>(partials.data(), rows, cols, term);
  cuda_check_launch(kernel);
  add_column_totals(be, outputs, partials.data(), chunks, cols, kernel);
}

#endif  // __CUDACC__

}  // namespace loom::detail::cuda_kernels
