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
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/block_body.hpp"
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
// bf16, and the two passes over [N, V] (statistics, backward) are most of the head's memory
// traffic; element loads keep few bytes in flight (the layernorm and softmax kernels reached 6% of
// the bandwidth that way, docs/cuda.md). Thread t takes packs t, t + blockDim, ...

//! One block per row, one read of the row and no write over it: row_max[n] = the largest of the
//! row's `real` first logits (the lowest double where there are none), partials[n] = the sum of
//! exp(logit - row_max[n]) over them, partials[rows + n] = the target's logit where the slice holds
//! it, else 0, and slice_max[n] = row_max[n] where `slice_max` is given. Each thread keeps a running
//! max and the float sum of its exps below it (the online softmax: the sum is rescaled when a pack
//! raises the max); the block then takes the max of the threads' maxima and, in double, the sum of
//! their sums rescaled to it, in a fixed tree. (A thread adds a few hundred exps at most, each <= 1:
//! float keeps the sum to about 1e-5 of itself. Widening each exp to double, as this kernel once
//! did, put a second quarter-rate conversion beside each exp: 0.80 ms of a GPT-2 small step at batch
//! 16 on an H200, where reading the logits takes 0.34.)
template <class T, int W>
__global__ void statistics_kernel(double* row_max, double* partials, double* slice_max, const T* logits,
                                  const std::int32_t* targets, std::int64_t rows, std::int64_t columns,
                                  std::int64_t real, std::int64_t vocab_begin) {
  using P = cuda_kernels::Pack<T, W>;
  using MaxReduce = cub::BlockReduce<float, row_threads>;
  using SumReduce = cub::BlockReduce<double, row_threads>;
  __shared__ union {
    typename MaxReduce::TempStorage max;
    typename SumReduce::TempStorage sum;
  } scratch;
  __shared__ float block_max;
  constexpr float lowest = -::cuda::std::numeric_limits<float>::infinity();
  const std::int64_t used = (real + W - 1) / W;  // packs holding real columns
  for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    const P* x = reinterpret_cast<const P*>(logits + n * columns);
    float largest = lowest;
    float sum = 0;  // of exp(value - largest)
    for (std::int64_t v = threadIdx.x; v < used; v += blockDim.x) {
      const P in = x[v];
      float value[W];
      float pack_max = lowest;
#pragma unroll
      for (int k = 0; k < W; ++k) {
        value[k] = v * W + k < real ? to_accumulate(in.value[k]) : lowest;
        pack_max = ::cuda::maximum<>{}(pack_max, value[k]);
      }
      if (pack_max > largest) {
        // exp(-inf) = 0 for the first pack (sum is 0 then).
        sum *= ::expf(largest - pack_max);
        largest = pack_max;
      }
      // Padding adds exp(-inf) = 0. While every value so far is -inf (logits masked to it),
      // there is nothing to add, and -inf - -inf would be NaN.
      if (largest != lowest) {
#pragma unroll
        for (int k = 0; k < W; ++k) sum += ::expf(value[k] - largest);
      }
    }
    const float reduced = MaxReduce(scratch.max).Reduce(largest, ::cuda::maximum<>{});  // valid in thread 0
    if (threadIdx.x == 0) block_max = reduced;
    __syncthreads();  // block_max is read, and scratch reused, below
    const float m = block_max;
    // A thread that saw no real column has sum 0 (and largest -inf: its factor would be NaN).
    // Exact in double: both maxima are logits.
    double rescaled = sum != 0.0f ? static_cast<double>(sum) * ::exp(static_cast<double>(largest) - m) : 0.0;
    rescaled = SumReduce(scratch.sum).Sum(rescaled);  // valid in thread 0
    if (threadIdx.x == 0) {
      const double top = real > 0 ? static_cast<double>(m) : ::cuda::std::numeric_limits<double>::lowest();
      row_max[n] = top;
      if (slice_max != nullptr) slice_max[n] = top;
      partials[n] = rescaled;
      const std::int32_t target = targets[n];
      const std::int64_t local_target = static_cast<std::int64_t>(target) - vocab_begin;
      partials[rows + n] = target >= 0 && local_target >= 0 && local_target < real
                               ? static_cast<double>(to_accumulate(logits[n * columns + local_target]))
                               : 0.0;
    }
    __syncthreads();  // before the next row reuses `scratch` and block_max
  }
}

//! partials[n] *= exp(slice_max[n] - row_max[n]), one thread a row. A template (D = double) so
//! that the header defines it in every translation unit.
template <class D>
__global__ void rebase_kernel(D* partials, const D* slice_max, const D* row_max, std::int64_t rows) {
  for (std::int64_t n = cuda_kernels::grid_first(); n < rows; n += cuda_kernels::grid_stride())
    partials[n] *= ::exp(slice_max[n] - row_max[n]);
}

//! Row n's loss (float) from the group's statistics: log(sum) - (target logit - row max), in
//! double, 0 where the target is negative.
__device__ inline float row_loss(const double* row_max, const double* partials, const std::int32_t* targets,
                                 std::int64_t rows, std::int64_t n) {
  return targets[n] >= 0 ? static_cast<float>(::log(partials[n]) - (partials[rows + n] - row_max[n])) : 0.0f;
}

//! losses[n] = row_loss, one thread a row.
template <class L>
__global__ void losses_kernel(L* losses, const double* row_max, const double* partials, const std::int32_t* targets,
                              std::int64_t rows) {
  for (std::int64_t n = cuda_kernels::grid_first(); n < rows; n += cuda_kernels::grid_stride())
    losses[n] = row_loss(row_max, partials, targets, rows, n);
}

//! Row n of the backward, by the row_threads threads of a block: dlogits = scale * (p -
//! onehot(target)) on the real columns, 0 on padding and on rows whose target is negative.
//! FromLogits: `in` holds the logits and p = T(exp(x - row_max[n]) · factor), factor = float(1 /
//! partials[n]) (the row statistics); else `in` holds the probabilities and p = x. `dlogits` may
//! be `in`: each pack is read, then written, by the same thread (the target's one-hot included).
//! A thread loads two packs before it stores either, so that two loads are in flight where the
//! aliasing would otherwise keep the compiler to one; a pack of real columns without the target
//! skips the per-column tests. (Host-device, so that the tests run it without a GPU.)
LOOM_BLOCK_BODY
template <class T, int W, bool FromLogits, class Thread>
LOOM_HD void backward_row(const Thread& th, T* dlogits, const T* in, const double* row_max, const double* partials,
                          const std::int32_t* targets, std::int64_t n, std::int64_t columns, std::int64_t real,
                          std::int64_t vocab_begin, float scale) {
  using P = cuda_kernels::Pack<T, W>;
  const std::int64_t packs = columns / W;
  // The group's max is one of the logits: exact in float.
  const float shift = FromLogits ? static_cast<float>(row_max[n]) : 0.0f;
  const float factor = FromLogits ? static_cast<float>(1.0 / partials[n]) : 1.0f;
  const P* x = reinterpret_cast<const P*>(in + n * columns);
  P* g = reinterpret_cast<P*>(dlogits + n * columns);
  const std::int32_t target = targets[n];
  // A negative target ignores the row: no column is active, all are written 0 below.
  const std::int64_t local_target = target >= 0 ? static_cast<std::int64_t>(target) - vocab_begin : -1;
  const std::int64_t active = target >= 0 ? real : 0;
  const std::int64_t used = (active + W - 1) / W;
  const auto probability = [&](T value) {
    const float v = to_accumulate(value);
    return FromLogits ? to_accumulate(static_cast<T>(::expf(v - shift) * factor)) : v;
  };
  // The gradients of pack v from its values p: zeros past `used`.
  const auto gradients = [&](const P& p, std::int64_t v) {
    P out{};
    const std::int64_t first = v * W;
    if (first + W <= active && (local_target < first || local_target >= first + W)) {
      LOOM_UNROLL
      for (int k = 0; k < W; ++k) out.value[k] = static_cast<T>(scale * probability(p.value[k]));
      return out;
    }
    LOOM_UNROLL
    for (int k = 0; k < W; ++k) {
      const std::int64_t j = first + k;
      if (j >= active) continue;  // stays 0
      const float prob = probability(p.value[k]);
      out.value[k] = static_cast<T>(j == local_target ? scale * (prob - 1.0f) : scale * prob);
    }
    return out;
  };
  std::int64_t v = th.thread();
  for (; v + row_threads < packs; v += 2 * row_threads) {
    const std::int64_t u = v + row_threads;
    const P a = v < used ? x[v] : P{}, b = u < used ? x[u] : P{};
    g[v] = gradients(a, v);
    g[u] = gradients(b, u);
  }
  if (v < packs) g[v] = gradients(v < used ? x[v] : P{}, v);
}

//! backward_row over the rows, a block (of row_threads threads) per row.
template <class T, int W, bool FromLogits>
__global__ void __launch_bounds__(row_threads) backward_kernel(T* dlogits, const T* in, const double* row_max,
                                                               const double* partials, const std::int32_t* targets,
                                                               std::int64_t rows, std::int64_t columns,
                                                               std::int64_t real, std::int64_t vocab_begin,
                                                               float scale) {
  const cuda_kernels::BlockThread th;
  for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x)
    backward_row<T, W, FromLogits>(th, dlogits, in, row_max, partials, targets, n, columns, real, vocab_begin, scale);
}

// The launchers run the kernels at W = vector_width where vector_rows allows, else at W = 1.
using cuda_kernels::vector_rows;
template <class T>
inline constexpr int vector_width = cuda_kernels::Vector16<T>::elements;

//! backward_kernel on the backend's stream, one block a row: from the logits with the row
//! statistics where `row_max` is given, else from the probabilities.
template <class T>
void launch_backward(const cuda& be, T* dlogits, const T* in, const double* row_max, const double* partials,
                     const std::int32_t* targets, const vocab_parallel::CrossEntropyDims& dims,
                     std::int64_t vocab_begin, float scale, const char* kernel) {
  cuda_kernels::activate(be);
  const bool vectors = vector_rows<T>(dims.slice_columns, dlogits, in);
  const auto launch = row_max != nullptr ? (vectors ? backward_kernel<T, vector_width<T>, true>
                                                    : backward_kernel<T, 1, true>)
                                         : (vectors ? backward_kernel<T, vector_width<T>, false>
                                                    : backward_kernel<T, 1, false>);
  launch<<<blocks_for_rows(dims.rows), row_threads, 0, be.stream()>>>(dlogits, in, row_max, partials, targets,
                                                                      dims.rows, dims.slice_columns, dims.real_columns,
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

//! Vocabulary-parallel cross-entropy on the GPU, step 1 (the CPU kernel's contract): the row
//! statistics of this slice's `logits` [N, Vs] in one pass that writes nothing over them, to
//! `row_max` [N] and `partials` [2, N] (device, double), and to `slice_max` [N] unless it is empty.
//! A target outside [0, vocab) counts as not held here. Online: the sums are formed below each
//! thread's running max and rescaled, so their last bits differ from the CPU kernel's.
template <class T>
void vocab_parallel_cross_entropy_statistics(const cuda& be, Tensor<double> row_max, Tensor<double> partials,
                                             Tensor<const T> logits, Tensor<const std::int32_t> targets,
                                             std::int64_t vocab_begin, std::int64_t vocab,
                                             Tensor<double> slice_max = {}) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_statistics";
  const detail::vocab_parallel::CrossEntropyDims dims = detail::vocab_parallel::check_statistics(
      row_max, partials, logits, targets, vocab_begin, vocab, slice_max, kernel);
  if (dims.rows == 0) return;
  check_data(logits, kernel, "logits");

  detail::cuda_kernels::activate(be);
  const auto launch = v::vector_rows<T>(dims.slice_columns, logits.data())
                          ? v::statistics_kernel<T, v::vector_width<T>>
                          : v::statistics_kernel<T, 1>;
  launch<<<v::blocks_for_rows(dims.rows), v::row_threads, 0, be.stream()>>>(
      row_max.data(), partials.data(), slice_max.empty() ? nullptr : slice_max.data(), logits.data(), targets.data(),
      dims.rows, dims.slice_columns, dims.real_columns, vocab_begin);
  detail::cuda_check_launch(kernel);
}

//! Vocabulary-parallel cross-entropy on the GPU, step 2 for a group (the CPU kernel's contract):
//! partials[n] *= exp(slice_max[n] - row_max[n]) once `row_max` holds the group's max.
inline void vocab_parallel_cross_entropy_rebase(const cuda& be, Tensor<double> partials,
                                                Tensor<const double> slice_max, Tensor<const double> row_max) {
  namespace k = detail::cuda_kernels;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_rebase";
  const std::int64_t N = detail::vocab_parallel::check_rebase(partials, slice_max, row_max, kernel);
  if (N == 0) return;
  k::activate(be);
  detail::cuda_vocab_parallel::rebase_kernel<<<k::elementwise_blocks(N), k::elementwise_threads, 0, be.stream()>>>(
      partials.data(), slice_max.data(), row_max.data(), N);
  detail::cuda_check_launch(kernel);
}

//! Vocabulary-parallel cross-entropy losses on the GPU (the CPU kernel's contract): losses[n] =
//! log(sum[n]) - (target logit[n] - row_max[n]), 0 where targets[n] < 0, in float, from the
//! group's `row_max` [N] and `partials` [2, N].
template <class T>
void vocab_parallel_cross_entropy_losses(const cuda& be, Tensor<accumulate_t<T>> losses, Tensor<const double> row_max,
                                         Tensor<const double> partials, Tensor<const std::int32_t> targets) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_losses";
  const std::int64_t N = detail::vocab_parallel::check_losses(losses, row_max, partials, targets, kernel);
  if (N == 0) return;
  k::activate(be);
  detail::cuda_vocab_parallel::losses_kernel<<<k::elementwise_blocks(N), k::elementwise_threads, 0, be.stream()>>>(
      losses.data(), row_max.data(), partials.data(), targets.data(), N);
  detail::cuda_check_launch(kernel);
}

//! Vocabulary-parallel cross-entropy backward on the GPU from probabilities: WRITES `dlogits`
//! [N, Vs] = scale * (probs - onehot(target)) on this slice's real columns (the one-hot only where
//! the slice holds the target), 0 on padding and on rows whose target is negative. `dlogits` may
//! alias `probs`.
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
  v::launch_backward<T>(be, dlogits.data(), probs.data(), nullptr, nullptr, targets.data(), dims, vocab_begin, scale,
                        kernel);
}

//! Vocabulary-parallel cross-entropy backward on the GPU from the `logits` [N, Vs] and the
//! group's `row_max` [N] and `partials` [2, N] (the CPU kernel's contract): p = exp(logit -
//! row_max) · float(1 / sum), rounded to T, then the backward above on it, in one pass over
//! [N, Vs]. `dlogits` may alias `logits`.
template <class T>
void vocab_parallel_cross_entropy_backward(const cuda& be, Tensor<T> dlogits, Tensor<const T> logits,
                                           Tensor<const double> row_max, Tensor<const double> partials,
                                           Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                           std::int64_t vocab, accumulate_t<T> scale) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_backward";
  const detail::vocab_parallel::CrossEntropyDims dims = detail::vocab_parallel::check_backward_from_logits(
      dlogits, logits, row_max, partials, targets, vocab_begin, vocab, kernel);
  if (dims.rows == 0) return;
  check_data(logits, kernel, "logits");
  check_data(row_max, kernel, "row_max");
  v::launch_backward<T>(be, dlogits.data(), logits.data(), row_max.data(), partials.data(), targets.data(), dims,
                        vocab_begin, scale, kernel);
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
