#pragma once
//! \file Vocabulary-parallel embedding and cross-entropy on the CUDA backend: the contracts of
//! backend/cpu/vocab_parallel.hpp (one rank's slice of the vocabulary; the collectives between
//! the steps are the caller's), with tokens and targets in device memory.
//!
//! The host cannot read device ids, so these kernels check shapes only; the caller validates
//! token and target ids on the host before uploading them. On the device, an id outside the
//! slice's rows (negative, or beyond the table) is no row of this slice: it is never used as an
//! index, so a bad id gives a wrong answer but never an out-of-bounds access.
//!
//! Deterministic, no atomics: the embedding backward sorts the slice's token ids (CUB radix
//! sort, stable) and adds each id's gradient rows in (b, t) order, the CPU kernel's order, so
//! both backends give the same bits; the cross-entropy kernels give each row one block with a
//! fixed reduction tree. bf16 elements are loaded as float, every sum is in float (or double), and
//! each stored result is rounded once; the losses are float (accumulate_t).

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cuda/functional>
#include <cuda/std/limits>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/backend/detail/vocab_parallel_checks.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/memory.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_vocab_parallel {

//! Threads per block of the per-row kernels (cross-entropy rows, embedding segments). A
//! constant, never a property of the device, so each row's reduction tree (and its bits) is the
//! same on every GPU.
inline constexpr int row_threads = 256;
//! At most this many blocks; each block loops over rows (or sorted positions) with this stride.
inline constexpr std::int64_t max_row_blocks = std::int64_t{1} << 20;

//! Blocks for a kernel that gives one block to each of `rows > 0` rows.
inline unsigned blocks_for_rows(std::int64_t rows) noexcept {
  return static_cast<unsigned>(std::clamp<std::int64_t>(rows, 1, max_row_blocks));
}

//! The sort key of an id that is not in the slice: above every local id (ids are int32, so a
//! local id is < 2^31) and no larger than needed, so the radix sort looks at few bits.
inline std::uint32_t not_in_slice_key(std::int64_t slice_rows) noexcept {
  return static_cast<std::uint32_t>(std::min<std::int64_t>(slice_rows, std::int64_t{1} << 31));
}

//! out[b,t,:] = the token's row (where it is in the slice) + the position's row (where `pe`
//! is given), as the CPU kernel writes it: copies where only one row is present, so -0 stays -0.
template <class T>
__global__ void embedding_forward_kernel(T* out, const std::int32_t* ids, const T* te, std::int64_t slice_rows,
                                         std::int64_t vocab_begin, const T* pe, std::int64_t seq,
                                         std::int64_t channels, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride()) {
    const std::int64_t bt = i / channels, j = i % channels;
    const std::int64_t local = static_cast<std::int64_t>(ids[bt]) - vocab_begin;
    const bool in_slice = local >= 0 && local < slice_rows;
    const T* position_row = pe != nullptr ? pe + (bt % seq) * channels : nullptr;
    if (in_slice && position_row != nullptr)
      out[i] = static_cast<T>(to_accumulate(te[local * channels + j]) + to_accumulate(position_row[j]));
    else if (in_slice)
      out[i] = te[local * channels + j];
    else if (position_row != nullptr)
      out[i] = position_row[j];
    else
      out[i] = static_cast<T>(0.0f);
  }
}

//! keys[i] = the local id of token i where it is in the slice, else `not_in_slice`;
//! source_rows[i] = i (its (b, t) row, which the stable sort keeps in order within a key). A
//! template (Key = std::uint32_t) so that the header defines it in every translation unit.
template <class Key>
__global__ void sort_input_kernel(Key* keys, std::int64_t* source_rows, const std::int32_t* ids,
                                  std::int64_t vocab_begin, std::int64_t slice_rows, Key not_in_slice,
                                  std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride()) {
    const std::int64_t local = static_cast<std::int64_t>(ids[i]) - vocab_begin;
    keys[i] = local >= 0 && local < slice_rows ? static_cast<Key>(local) : not_in_slice;
    source_rows[i] = i;
  }
}

//! Over the sorted (key, source row) pairs: the block at the first position of a segment of
//! equal keys adds that segment's dout rows to dwte[key] in (b, t) order, one column per thread,
//! in a register (acc = dwte; acc += g1; acc += g2; ...: the CPU kernel's float order). Other
//! positions, and the segment of ids not in the slice, leave at once. No two blocks share a
//! dwte row, so there are no atomics.
template <class T>
__global__ void token_grad_kernel(T* dwte, const std::uint32_t* keys, const std::int64_t* source_rows,
                                  const T* dout, std::int64_t n, std::int64_t channels,
                                  std::uint32_t not_in_slice) {
  for (std::int64_t start = blockIdx.x; start < n; start += gridDim.x) {
    const std::uint32_t key = keys[start];
    // The same for every thread of the block, so the barriers below are reached by all or none.
    if (key == not_in_slice || (start > 0 && keys[start - 1] == key)) continue;
    // The segment's end: the keys are sorted, so within each window of blockDim.x positions
    // the ones equal to `key` are a prefix; count them until a window is not full.
    std::int64_t end = start + 1;
    for (;;) {
      const std::int64_t k = end + threadIdx.x;
      const int same = __syncthreads_count(k < n && keys[k] == key);
      end += same;
      if (same < static_cast<int>(blockDim.x)) break;
    }
    T* row = dwte + static_cast<std::int64_t>(key) * channels;
    for (std::int64_t j = threadIdx.x; j < channels; j += blockDim.x) {
      accumulate_t<T> acc = to_accumulate(row[j]);
      for (std::int64_t k = start; k < end; ++k) acc += to_accumulate(dout[source_rows[k] * channels + j]);
      row[j] = static_cast<T>(acc);
    }
  }
}

//! dwpe[t, j] += dout[b, t, j] for b = 0, 1, ... in order (the CPU kernel's float order).
template <class T>
__global__ void position_grad_kernel(T* dwpe, const T* dout, std::int64_t batch, std::int64_t seq_channels) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < seq_channels; i += cuda_kernels::grid_stride()) {
    accumulate_t<T> acc = to_accumulate(dwpe[i]);
    for (std::int64_t b = 0; b < batch; ++b) acc += to_accumulate(dout[b * seq_channels + i]);
    dwpe[i] = static_cast<T>(acc);
  }
}

// The cross-entropy row kernels move W elements per load (cuda_kernels::Pack): W = 1, or 16
// bytes where the rows are aligned (the launchers choose). With 50304 columns a row is 100 KB of
// bf16, and these four passes over [N, V] are most of the head's memory traffic; element loads
// keep few bytes in flight (the layernorm and softmax kernels reached 6% of the bandwidth that
// way, docs/cuda.md). Thread t takes packs t, t + blockDim, ..., so with W = 1 each thread sums
// the elements it always did.

//! One block per row: row_max[n] = the largest of the row's `real` first logits (as double), or
//! the lowest double where there are none.
template <class T, int W>
__global__ void max_kernel(double* row_max, const T* logits, std::int64_t rows, std::int64_t columns,
                           std::int64_t real) {
  using A = accumulate_t<T>;
  using P = cuda_kernels::Pack<T, W>;
  using Reduce = cub::BlockReduce<A, row_threads>;
  __shared__ typename Reduce::TempStorage scratch;
  const std::int64_t used = (real + W - 1) / W;  // packs holding real columns
  for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    const P* x = reinterpret_cast<const P*>(logits + n * columns);
    A largest = -::cuda::std::numeric_limits<A>::infinity();
    for (std::int64_t v = threadIdx.x; v < used; v += blockDim.x) {
      const P p = x[v];
#pragma unroll
      for (int k = 0; k < W; ++k)
        if (v * W + k < real) largest = ::cuda::maximum<>{}(largest, to_accumulate(p.value[k]));
    }
    largest = Reduce(scratch).Reduce(largest, ::cuda::maximum<>{});  // valid in thread 0
    if (threadIdx.x == 0)
      row_max[n] = real > 0 ? static_cast<double>(largest) : ::cuda::std::numeric_limits<double>::lowest();
    __syncthreads();  // before the next row reuses `scratch`
  }
}

//! One block per row: exps = exp(logits - max) on the real columns, 0 on padding; partials[n] =
//! their sum in double; partials[rows + n] = the target's logit - max in double where this slice
//! holds the target, else 0. `exps` may be `logits`: each pack is read, then written, by the
//! same thread, and the target's logit is read by that thread before it writes its exp.
template <class T, int W>
__global__ void partials_kernel(T* exps, double* partials, const T* logits, const double* row_max,
                                const std::int32_t* targets, std::int64_t rows, std::int64_t columns,
                                std::int64_t real, std::int64_t vocab_begin) {
  using P = cuda_kernels::Pack<T, W>;
  using Reduce = cub::BlockReduce<double, row_threads>;
  __shared__ typename Reduce::TempStorage scratch;
  const std::int64_t used = (real + W - 1) / W, packs = columns / W;
  for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    const P* x = reinterpret_cast<const P*>(logits + n * columns);
    P* e = reinterpret_cast<P*>(exps + n * columns);
    const double m = row_max[n];
    const float shift = static_cast<float>(m);  // exact: the global max is one of the logits
    const std::int32_t target = targets[n];
    const std::int64_t local_target = static_cast<std::int64_t>(target) - vocab_begin;
    const bool owns_target = target >= 0 && local_target >= 0 && local_target < real;
    if (!owns_target && threadIdx.x == 0) partials[rows + n] = 0.0;
    double sum = 0;
    for (std::int64_t v = threadIdx.x; v < packs; v += blockDim.x) {
      P out = cuda_kernels::zero_pack<T, W>();  // padding stays 0
      if (v < used) {
        const P in = x[v];
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const std::int64_t j = v * W + k;
          if (j >= real) continue;
          const float value = to_accumulate(in.value[k]);
          if (owns_target && j == local_target) partials[rows + n] = static_cast<double>(value) - m;
          const float exp_value = ::expf(value - shift);
          out.value[k] = static_cast<T>(exp_value);
          sum += static_cast<double>(exp_value);  // the float exp, before a bf16 rounding
        }
      }
      e[v] = out;
    }
    sum = Reduce(scratch).Sum(sum);  // valid in thread 0
    if (threadIdx.x == 0) partials[n] = sum;
    __syncthreads();  // before the next row reuses `scratch`
  }
}

//! Row n's loss (float) from the group's summed partials [2, rows]: log(sum) - shifted target, 0
//! where the target is negative.
__device__ inline float row_loss(const double* partials, const std::int32_t* targets, std::int64_t rows,
                                 std::int64_t n) {
  return targets[n] >= 0 ? static_cast<float>(::log(partials[n]) - partials[rows + n]) : 0.0f;
}

//! One block per row: probs *= 1 / sum (the factor rounded to float once, as the CPU kernel), and
//! losses[n] = row_loss.
template <class T, int W>
__global__ void finish_kernel(float* losses, T* probs, const double* partials, const std::int32_t* targets,
                              std::int64_t rows, std::int64_t columns) {
  using P = cuda_kernels::Pack<T, W>;
  const std::int64_t packs = columns / W;
  for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    const double sum = partials[n];
    const float factor = static_cast<float>(1.0 / sum);
    P* row = reinterpret_cast<P*>(probs + n * columns);
    for (std::int64_t v = threadIdx.x; v < packs; v += blockDim.x) {
      P p = row[v];
#pragma unroll
      for (int k = 0; k < W; ++k) p.value[k] = static_cast<T>(to_accumulate(p.value[k]) * factor);
      row[v] = p;
    }
    if (threadIdx.x == 0) losses[n] = row_loss(partials, targets, rows, n);
  }
}

//! losses[n] of finish_kernel from the partials alone, one thread a row.
template <class L>
__global__ void losses_kernel(L* losses, const double* partials, const std::int32_t* targets, std::int64_t rows) {
  for (std::int64_t n = cuda_kernels::grid_first(); n < rows; n += cuda_kernels::grid_stride())
    losses[n] = row_loss(partials, targets, rows, n);
}

//! One block per row: dlogits = scale * (p - onehot(target)) on the real columns, 0 on padding
//! and on rows whose target is negative, where p = T(x · factor) for the row's x of `probs`, with
//! factor = float(1 / sums[n]) (finish_kernel's probabilities, from the exps) where `sums` is
//! given, else 1 (then p = x exactly). `dlogits` may be `probs`: each pack is read, then written,
//! by the same thread (the target's one-hot included).
template <class T, int W>
__global__ void backward_kernel(T* dlogits, const T* probs, const double* sums, const std::int32_t* targets,
                                std::int64_t rows, std::int64_t columns, std::int64_t real, std::int64_t vocab_begin,
                                float scale) {
  using P = cuda_kernels::Pack<T, W>;
  const std::int64_t packs = columns / W;
  for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    const float factor = sums != nullptr ? static_cast<float>(1.0 / sums[n]) : 1.0f;
    const P* p = reinterpret_cast<const P*>(probs + n * columns);
    P* g = reinterpret_cast<P*>(dlogits + n * columns);
    const std::int32_t target = targets[n];
    // A negative target ignores the row: no column is active, all are written 0 below.
    const std::int64_t local_target = target >= 0 ? static_cast<std::int64_t>(target) - vocab_begin : -1;
    const std::int64_t active = target >= 0 ? real : 0;
    const std::int64_t used = (active + W - 1) / W;
    for (std::int64_t v = threadIdx.x; v < packs; v += blockDim.x) {
      P out = cuda_kernels::zero_pack<T, W>();  // padding and ignored rows stay 0
      if (v < used) {
        const P in = p[v];
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const std::int64_t j = v * W + k;
          if (j >= active) continue;
          const float prob = to_accumulate(static_cast<T>(to_accumulate(in.value[k]) * factor));
          out.value[k] = static_cast<T>(j == local_target ? scale * (prob - 1.0f) : scale * prob);
        }
      }
      g[v] = out;
    }
  }
}

// The launchers run the kernels at W = vector_width where vector_rows allows, else at W = 1.
using cuda_kernels::vector_rows;
template <class T>
inline constexpr int vector_width = cuda_kernels::Vector16<T>::elements;

//! backward_kernel on the backend's stream, one block a row, with `sums` (null: probabilities).
template <class T>
void launch_backward(const cuda& be, T* dlogits, const T* in, const double* sums, const std::int32_t* targets,
                     const vocab_parallel::CrossEntropyDims& dims, std::int64_t vocab_begin, float scale,
                     const char* kernel) {
  cuda_kernels::activate(be);
  const auto launch = vector_rows<T>(dims.slice_columns, dlogits, in) ? backward_kernel<T, vector_width<T>>
                                                                       : backward_kernel<T, 1>;
  launch<<<blocks_for_rows(dims.rows), row_threads, 0, be.stream()>>>(dlogits, in, sums, targets, dims.rows,
                                                                      dims.slice_columns, dims.real_columns,
                                                                      vocab_begin, scale);
  cuda_check_launch(kernel);
}

//! One block: rows[0, M) = the indices of the targets >= 0 among `n`, in order (the first `room`
//! of them), row_targets their targets, *count = M. Each tile of Threads targets is one block-wide
//! exclusive scan of the flags; `base` carries the tiles before it. A template so that the header
//! defines it in every translation unit.
template <int Threads>
__global__ void select_target_rows_kernel(std::int32_t* rows, std::int32_t* row_targets, std::int32_t* count,
                                          const std::int32_t* targets, std::int64_t n, std::int64_t room) {
  using Scan = cub::BlockScan<int, Threads>;
  __shared__ typename Scan::TempStorage scratch;
  int base = 0;
  for (std::int64_t first = 0; first < n; first += Threads) {
    const std::int64_t i = first + threadIdx.x;
    const std::int32_t target = i < n ? targets[i] : -1;
    int offset = 0, tile_count = 0;
    Scan(scratch).ExclusiveSum(target >= 0 ? 1 : 0, offset, tile_count);
    if (target >= 0 && base + offset < room) {
      rows[base + offset] = static_cast<std::int32_t>(i);
      row_targets[base + offset] = target;
    }
    base += tile_count;
    __syncthreads();  // the next tile's scan reuses the scratch
  }
  if (threadIdx.x == 0) *count = base;
}

}  // namespace loom::detail::cuda_vocab_parallel

namespace loom::inline kernels {

//! Vocabulary-parallel embedding forward on the GPU: out[b,t,:] = wte_slice[tokens[b,t] -
//! vocab_begin, :] where the token lies in this slice, else 0; plus wpe[t,:] when `wpe` is
//! non-empty. tokens [B,T] (device, int32, validated by the caller), out [B,T,C], wte_slice
//! [rows,C], wpe [maxT >= T, C]. The same bits as the CPU kernel.
template <class T>
void vocab_parallel_embedding_forward(const cuda& be, Tensor<T> out, Tensor<const std::int32_t> tokens,
                                      Tensor<const T> wte_slice, std::int64_t vocab_begin, Tensor<const T> wpe) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  constexpr const char* kernel = "vocab_parallel_embedding_forward";
  const detail::vocab_parallel::EmbeddingDims dims = detail::vocab_parallel::check_embedding_shapes(
      out, tokens, wte_slice, vocab_begin, wpe, kernel, "out", "wte_slice", "wpe");
  const std::int64_t n = dims.batch * dims.seq * dims.channels;
  if (n == 0) return;
  check_data(tokens, kernel, "tokens");
  check_data(wte_slice, kernel, "wte_slice");

  k::activate(be);
  detail::cuda_vocab_parallel::embedding_forward_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0,
                                                          be.stream()>>>(
      out.data(), tokens.data(), wte_slice.data(), wte_slice.extent(0), vocab_begin,
      wpe.empty() ? nullptr : wpe.data(), dims.seq, dims.channels, n);
  detail::cuda_check_launch(kernel);
}

//! Backward of vocab_parallel_embedding_forward on the GPU, accumulating: dwte_slice[tokens[b,t]
//! - vocab_begin] += dout[b,t] for tokens in this slice, dwpe[t] += sum over b of dout[b,t] when
//! `dwpe` is non-empty. Deterministic without atomics, and the same bits as the CPU kernel: the
//! slice's ids are sorted (stable, so each id keeps its rows in (b, t) order) and each id's rows
//! are added in that order. Takes `cuda&`: the sort's scratch comes from the backend's
//! allocator (workspace), freed on return (stream order makes the reuse safe).
template <class T>
void vocab_parallel_embedding_backward(cuda& be, Tensor<T> dwte_slice, std::int64_t vocab_begin, Tensor<T> dwpe,
                                       Tensor<const T> dout, Tensor<const std::int32_t> tokens) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_embedding_backward";
  const detail::vocab_parallel::EmbeddingDims dims = detail::vocab_parallel::check_embedding_shapes(
      dout, tokens, dwte_slice, vocab_begin, dwpe, kernel, "dout", "dwte_slice", "dwpe");
  const std::int64_t n = dims.batch * dims.seq, C = dims.channels, slice_rows = dwte_slice.extent(0);
  if (n == 0 || C == 0) return;
  check_data(tokens, kernel, "tokens");
  check_data(dwte_slice, kernel, "dwte_slice");

  k::activate(be);
  if (slice_rows > 0) {
    const std::uint32_t not_in_slice = v::not_in_slice_key(slice_rows);
    const int end_bit = std::bit_width(not_in_slice);  // every key is <= not_in_slice
    Buffer<std::uint32_t, cuda> keys(be, 2 * n, MemoryCategory::workspace);
    Buffer<std::int64_t, cuda> source_rows(be, 2 * n, MemoryCategory::workspace);
    std::uint32_t* keys_in = keys.data();
    std::uint32_t* keys_sorted = keys.data() + n;
    std::int64_t* rows_in = source_rows.data();
    std::int64_t* rows_sorted = source_rows.data() + n;
    v::sort_input_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
        keys_in, rows_in, tokens.data(), vocab_begin, slice_rows, not_in_slice, n);
    detail::cuda_check_launch("vocab_parallel_embedding_backward sort_input_kernel");
    std::size_t temp_bytes = 0;
    LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, temp_bytes, keys_in, keys_sorted, rows_in, rows_sorted,
                                                    n, 0, end_bit, be.stream()));
    // At least one byte: a null temp pointer would make the second call a size query again.
    Buffer<std::byte, cuda> temp(be, static_cast<std::int64_t>(std::max<std::size_t>(temp_bytes, 1)),
                                 MemoryCategory::workspace);
    LOOM_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data(), temp_bytes, keys_in, keys_sorted, rows_in,
                                                    rows_sorted, n, 0, end_bit, be.stream()));
    v::token_grad_kernel<<<v::blocks_for_rows(n), v::row_threads, 0, be.stream()>>>(
        dwte_slice.data(), keys_sorted, rows_sorted, dout.data(), n, C, not_in_slice);
    detail::cuda_check_launch("vocab_parallel_embedding_backward token_grad_kernel");
  }
  if (!dwpe.empty()) {
    const std::int64_t seq_channels = dims.seq * C;
    v::position_grad_kernel<<<k::elementwise_blocks(seq_channels), k::elementwise_threads, 0, be.stream()>>>(
        dwpe.data(), dout.data(), dims.batch, seq_channels);
    detail::cuda_check_launch("vocab_parallel_embedding_backward position_grad_kernel");
  }
}

//! Vocabulary-parallel cross-entropy on the GPU, step 1 of 3: row_max[n] (device, double) = the
//! largest logits[n, j] over this slice's real columns (vocab_begin + j < vocab), or the lowest
//! double where the slice has none. The caller then all-reduces `row_max` [N] with max.
template <class T>
void vocab_parallel_cross_entropy_max(const cuda& be, Tensor<double> row_max, Tensor<const T> logits,
                                      std::int64_t vocab_begin, std::int64_t vocab) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_max";
  const detail::vocab_parallel::CrossEntropyDims dims =
      detail::vocab_parallel::check_max(row_max, logits, vocab_begin, vocab, kernel);
  if (dims.rows == 0) return;
  check_data(logits, kernel, "logits");

  detail::cuda_kernels::activate(be);
  const auto launch = v::vector_rows<T>(dims.slice_columns, logits.data()) ? v::max_kernel<T, v::vector_width<T>>
                                                                             : v::max_kernel<T, 1>;
  launch<<<v::blocks_for_rows(dims.rows), v::row_threads, 0, be.stream()>>>(
      row_max.data(), logits.data(), dims.rows, dims.slice_columns, dims.real_columns);
  detail::cuda_check_launch(kernel);
}

//! Vocabulary-parallel cross-entropy on the GPU, step 2 of 3, given the global `row_max` [N]:
//! exps[n,j] = exp(logits[n,j] - row_max[n]) on the real columns, 0 on padding (`exps` may
//! alias `logits`); `partials` [2, N] (device, double): row 0 the slice's sum of exps in double,
//! row 1 logits[n, target - vocab_begin] - row_max[n] where this slice holds row n's target,
//! else 0 (also for a target outside [0, vocab)). The caller then all-reduces `partials` with sum.
template <class T>
void vocab_parallel_cross_entropy_partials(const cuda& be, Tensor<T> exps, Tensor<double> partials,
                                           Tensor<const T> logits, Tensor<const double> row_max,
                                           Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                           std::int64_t vocab) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_partials";
  const detail::vocab_parallel::CrossEntropyDims dims =
      detail::vocab_parallel::check_partials(exps, partials, logits, row_max, targets, vocab_begin, vocab, kernel);
  if (dims.rows == 0) return;
  check_data(logits, kernel, "logits");

  detail::cuda_kernels::activate(be);
  const auto launch = v::vector_rows<T>(dims.slice_columns, exps.data(), logits.data())
                           ? v::partials_kernel<T, v::vector_width<T>>
                           : v::partials_kernel<T, 1>;
  launch<<<v::blocks_for_rows(dims.rows), v::row_threads, 0, be.stream()>>>(
      exps.data(), partials.data(), logits.data(), row_max.data(), targets.data(), dims.rows, dims.slice_columns,
      dims.real_columns, vocab_begin);
  detail::cuda_check_launch(kernel);
}

//! Vocabulary-parallel cross-entropy on the GPU, step 3 of 3, given the group's summed
//! `partials` [2, N]: probs[n, :] = exps[n, :] / sum[n] in place, and losses[n] = log(sum[n]) -
//! shifted_target[n], 0 where targets[n] < 0, in float (accumulate_t). Every rank of the group
//! computes the same losses.
template <class T>
void vocab_parallel_cross_entropy_finish(const cuda& be, Tensor<accumulate_t<T>> losses, Tensor<T> probs,
                                         Tensor<const double> partials, Tensor<const std::int32_t> targets) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_finish";
  const detail::vocab_parallel::FinishDims dims =
      detail::vocab_parallel::check_finish(losses, probs, partials, targets, kernel);
  if (dims.rows == 0) return;
  check_data(probs, kernel, "probs");

  detail::cuda_kernels::activate(be);
  const auto launch = v::vector_rows<T>(dims.columns, probs.data()) ? v::finish_kernel<T, v::vector_width<T>>
                                                                    : v::finish_kernel<T, 1>;
  launch<<<v::blocks_for_rows(dims.rows), v::row_threads, 0, be.stream()>>>(
      losses.data(), probs.data(), partials.data(), targets.data(), dims.rows, dims.columns);
  detail::cuda_check_launch(kernel);
}

//! Vocabulary-parallel cross-entropy backward on the GPU: WRITES `dlogits` [N, Vs] = scale *
//! (probs - onehot(target)) on this slice's real columns (the one-hot only where the slice holds
//! the target), 0 on padding and on rows whose target is negative. `dlogits` may alias `probs`.
template <class T>
void vocab_parallel_cross_entropy_backward(const cuda& be, Tensor<T> dlogits, Tensor<const T> probs,
                                           Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                           std::int64_t vocab, accumulate_t<T> scale) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_backward";
  const detail::vocab_parallel::CrossEntropyDims dims =
      detail::vocab_parallel::check_backward(dlogits, probs, targets, vocab_begin, vocab, kernel);
  if (dims.rows == 0) return;
  check_data(probs, kernel, "probs");
  v::launch_backward<T>(be, dlogits.data(), probs.data(), nullptr, targets.data(), dims, vocab_begin, scale, kernel);
}

//! Vocabulary-parallel cross-entropy losses on the GPU (the CPU kernel's contract): `losses` [N]
//! of vocab_parallel_cross_entropy_finish from the group's summed `partials` [2, N] alone, for a
//! head whose backward takes the exps (the overload below) and so skips finish's pass.
template <class T>
void vocab_parallel_cross_entropy_losses(const cuda& be, Tensor<accumulate_t<T>> losses, Tensor<const double> partials,
                                         Tensor<const std::int32_t> targets) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_losses";
  const std::int64_t N = detail::vocab_parallel::check_losses(losses, partials, targets, kernel);
  if (N == 0) return;
  k::activate(be);
  detail::cuda_vocab_parallel::losses_kernel<<<k::elementwise_blocks(N), k::elementwise_threads, 0, be.stream()>>>(
      losses.data(), partials.data(), targets.data(), N);
  detail::cuda_check_launch(kernel);
}

//! Vocabulary-parallel cross-entropy backward on the GPU from step 2's `exps` [N, Vs] and the
//! group's summed `partials` [2, N] (the CPU kernel's contract): finish's probabilities, exps ·
//! (1 / sum) rounded to T, then the backward above on them, in one pass over [N, Vs]: the same
//! bits as finish then the backward. `dlogits` may alias `exps`.
template <class T>
void vocab_parallel_cross_entropy_backward(const cuda& be, Tensor<T> dlogits, Tensor<const T> exps,
                                           Tensor<const double> partials, Tensor<const std::int32_t> targets,
                                           std::int64_t vocab_begin, std::int64_t vocab, accumulate_t<T> scale) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_backward";
  const detail::vocab_parallel::CrossEntropyDims dims =
      detail::vocab_parallel::check_backward(dlogits, exps, targets, vocab_begin, vocab, kernel, "exps");
  check_numel(partials, 2 * dims.rows, kernel, "partials");
  if (dims.rows == 0) return;
  check_data(exps, kernel, "exps");
  v::launch_backward<T>(be, dlogits.data(), exps.data(), partials.data(), targets.data(), dims, vocab_begin, scale,
                        kernel);
}

//! The rows a loss predicts (the CPU kernel's contract): rows[0, M) = the indices of `targets` [N]
//! that are >= 0, in increasing order, row_targets[0, M) their targets, at most rows.numel() of
//! them written; returns M. One block scans the targets on the stream, then the count comes to
//! the host: this waits for the stream.
inline std::int64_t select_target_rows(cuda& be, Tensor<std::int32_t> rows, Tensor<std::int32_t> row_targets,
                                       Tensor<const std::int32_t> targets) {
  namespace k = detail::cuda_kernels;
  constexpr const char* kernel = "select_target_rows";
  const std::int64_t n = targets.numel(), room = rows.numel();
  check_numel(row_targets, room, kernel, "row_targets");
  if (n == 0) return 0;
  check_data(targets, kernel, "targets");
  if (room > 0) {
    check_data(rows, kernel, "rows");
    check_data(row_targets, kernel, "row_targets");
  }
  k::activate(be);
  Buffer<std::int32_t, cuda> count(be, 1, MemoryCategory::workspace);
  constexpr int threads = 1024;
  detail::cuda_vocab_parallel::select_target_rows_kernel<threads><<<1, threads, 0, be.stream()>>>(
      rows.data(), row_targets.data(), count.data(), targets.data(), n, room);
  detail::cuda_check_launch(kernel);
  std::int32_t selected = 0;
  be.copy_to_host(&selected, count.data(), sizeof selected);
  return selected;
}

}  // namespace loom::inline kernels
