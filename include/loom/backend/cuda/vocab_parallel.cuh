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

#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>
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
//! dwte row, so there are no atomics. dwte is of T, or fp32 sums (G = float, stored unrounded).
template <class T, GradientOf<T> G>
__global__ void token_grad_kernel(G* dwte, const std::uint32_t* keys, const std::int64_t* source_rows,
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
    G* row = dwte + static_cast<std::int64_t>(key) * channels;
    for (std::int64_t j = threadIdx.x; j < channels; j += blockDim.x) {
      accumulate_t<T> acc = to_accumulate(row[j]);
      for (std::int64_t k = start; k < end; ++k) acc += to_accumulate(dout[source_rows[k] * channels + j]);
      row[j] = static_cast<G>(acc);
    }
  }
}

//! dwpe[t, j] += dout[b, t, j] for b = 0, 1, ... in order (the CPU kernel's float order); dwpe
//! of T or fp32 sums (G).
template <class T, GradientOf<T> G>
__global__ void position_grad_kernel(G* dwpe, const T* dout, std::int64_t batch, std::int64_t seq_channels) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < seq_channels; i += cuda_kernels::grid_stride()) {
    accumulate_t<T> acc = to_accumulate(dwpe[i]);
    for (std::int64_t b = 0; b < batch; ++b) acc += to_accumulate(dout[b * seq_channels + i]);
    dwpe[i] = static_cast<G>(acc);
  }
}

// The cross-entropy row kernels move W elements per load (cuda_kernels::Pack): W = 1, or 16
// bytes where the rows are aligned (the launchers choose). With 50304 columns a row is 100 KB of
// bf16, and the passes over [N, V] (statistics, backward) are most of the head's memory traffic;
// element loads keep few bytes in flight (the layernorm and softmax kernels reached 6% of the
// bandwidth that way, docs/cuda.md). Thread t takes packs t, t + blockDim, ...
//
// The row bodies below are written over a Thread (detail/block_body.hpp), so that the tests run
// them on the host; their block reductions are butterflies within each warp, then the warps'
// results added in order by every thread: every thread gets the same bits, on every GPU.

//! Warps of a row kernel's block.
inline constexpr int row_warps = row_threads / 32;
//! The bytes at the start of a row kernel's dynamic shared memory that its reductions use: one
//! double a warp (a multiple of 16, so that a row staged after them is 16-byte aligned).
inline constexpr std::size_t reduction_bytes = row_warps * sizeof(double);
static_assert(reduction_bytes % 16 == 0);

//! `value` folded by `op` (a max, or a sum) over the block's threads, in every thread with the
//! same bits: each warp's butterfly (op(value, the partner's value), as cuda_kernels::warp_sum's
//! order), then the warps' results in order. `scratch`: reduction_bytes of shared memory, free
//! again on return. A float value passes through the double scratch exactly.
LOOM_BLOCK_BODY
template <class Thread, class A, class Op>
LOOM_HD A block_reduce(const Thread& th, A value, double* scratch, Op op) {
  for (int mask = 16; mask > 0; mask /= 2) value = op(value, th.shuffle_xor(value, mask));
  if (th.thread() % 32 == 0) scratch[th.thread() / 32] = static_cast<double>(value);
  th.sync_block();
  A folded = static_cast<A>(scratch[0]);
  for (int w = 1; w < row_warps; ++w) folded = op(folded, static_cast<A>(scratch[w]));
  th.sync_block();  // before the scratch is written again
  return folded;
}

//! One thread's share of a row's statistics: the largest of its packs' real values (-inf where
//! it has none) and the float sum of their exps below it.
struct ThreadStatistics {
  float largest, sum;
};

//! The statistics of packs t, t + row_threads, ... of a row `x` of `used` packs holding `real`
//! values, for thread t: a running max and the sum of exp(value - max) below it (the online
//! softmax: the sum is rescaled when a pack raises the max). A thread adds a few hundred exps at
//! most, each <= 1: float keeps the sum to about 1e-5 of itself. (Widening each exp to double, as
//! the statistics kernel once did, put a second quarter-rate conversion beside each exp: 0.80 ms
//! of a GPT-2 small step at batch 16 on an H200, where reading the logits takes 0.34.)
LOOM_BLOCK_BODY
template <class T, int W, class Thread>
LOOM_HD ThreadStatistics thread_statistics(const Thread& th, const cuda_kernels::Pack<T, W>* x, std::int64_t used,
                                           std::int64_t real) {
  using P = cuda_kernels::Pack<T, W>;
  constexpr float lowest = -::cuda::std::numeric_limits<float>::infinity();
  float largest = lowest;
  float sum = 0;  // of exp(value - largest)
  for (std::int64_t v = th.thread(); v < used; v += row_threads) {
    const P in = x[v];
    float value[W];
    float pack_max = lowest;
    LOOM_UNROLL
    for (int k = 0; k < W; ++k) {
      value[k] = v * W + k < real ? to_accumulate(in.value[k]) : lowest;
      pack_max = pack_max < value[k] ? value[k] : pack_max;
    }
    if (pack_max > largest) {
      // exp(-inf) = 0 for the first pack (sum is 0 then).
      sum *= ::expf(largest - pack_max);
      largest = pack_max;
    }
    // Padding adds exp(-inf) = 0. While every value so far is -inf (logits masked to it), there
    // is nothing to add, and -inf - -inf would be NaN.
    if (largest != lowest) {
      LOOM_UNROLL
      for (int k = 0; k < W; ++k) sum += ::expf(value[k] - largest);
    }
  }
  return {largest, sum};
}

//! A row's statistics over its real values: `top`, the largest (the lowest double where there
//! are none), and `sum`, the sum of exp(value - top) in double.
struct RowStatistics {
  double top, sum;
};

//! The statistics of row `x` by the block: each thread's (thread_statistics), then the block's max
//! and, in double, the sum of the threads' sums rescaled to it, in every thread. (Exact in double:
//! both maxima are values of the row.)
LOOM_BLOCK_BODY
template <class T, int W, class Thread>
LOOM_HD RowStatistics row_statistics(const Thread& th, const cuda_kernels::Pack<T, W>* x, std::int64_t used,
                                     std::int64_t real, double* scratch) {
  const ThreadStatistics own = thread_statistics<T, W>(th, x, used, real);
  const float m = block_reduce(th, own.largest, scratch, [](float a, float b) { return a < b ? b : a; });
  // A thread that saw no real value has sum 0 (and largest -inf: its factor would be NaN).
  const double rescaled =
      own.sum != 0.0f ? static_cast<double>(own.sum) * ::exp(static_cast<double>(own.largest) - m) : 0.0;
  const double sum = block_reduce(th, rescaled, scratch, [](double a, double b) { return a + b; });
  return {real > 0 ? static_cast<double>(m) : ::cuda::std::numeric_limits<double>::lowest(), sum};
}

//! The logit of row n's target where the slice holds it (`real` columns from `vocab_begin`), else 0.
template <class T>
LOOM_HD double target_logit(const T* row, std::int32_t target, std::int64_t real, std::int64_t vocab_begin) {
  const std::int64_t local = static_cast<std::int64_t>(target) - vocab_begin;
  return target >= 0 && local >= 0 && local < real ? static_cast<double>(to_accumulate(row[local])) : 0.0;
}

//! A row's loss (float) from the group's statistics: log(sum) - (target logit - top), in double,
//! 0 where the target is negative.
LOOM_HD inline float loss_of(double top, double sum, double target_logit, std::int32_t target) {
  return target >= 0 ? static_cast<float>(::log(sum) - (target_logit - top)) : 0.0f;
}

//! One block per row, one read of the row and no write over it: row_max[n] and partials[n] =
//! row_statistics, partials[rows + n] = the target's logit where the slice holds it, else 0, and
//! slice_max[n] = row_max[n] where `slice_max` is given. Dynamic shared memory: reduction_bytes.
template <class T, int W>
__global__ void __launch_bounds__(row_threads) statistics_kernel(double* row_max, double* partials, double* slice_max,
                                                                 const T* logits, const std::int32_t* targets,
                                                                 std::int64_t rows, std::int64_t columns,
                                                                 std::int64_t real, std::int64_t vocab_begin) {
  using P = cuda_kernels::Pack<T, W>;
  const cuda_kernels::BlockThread th;
  double* scratch = reinterpret_cast<double*>(th.shared());
  const std::int64_t used = (real + W - 1) / W;  // packs holding real columns
  for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    const T* row = logits + n * columns;
    const RowStatistics r = row_statistics<T, W>(th, reinterpret_cast<const P*>(row), used, real, scratch);
    if (threadIdx.x == 0) {
      row_max[n] = r.top;
      if (slice_max != nullptr) slice_max[n] = r.top;
      partials[n] = r.sum;
      partials[rows + n] = target_logit(row, targets[n], real, vocab_begin);
    }
  }
}

//! partials[n] *= exp(slice_max[n] - row_max[n]), one thread a row. A template (D = double) so
//! that the header defines it in every translation unit.
template <class D>
__global__ void rebase_kernel(D* partials, const D* slice_max, const D* row_max, std::int64_t rows) {
  for (std::int64_t n = cuda_kernels::grid_first(); n < rows; n += cuda_kernels::grid_stride())
    partials[n] *= ::exp(slice_max[n] - row_max[n]);
}

//! losses[n] = loss_of row n's group statistics, one thread a row.
template <class L>
__global__ void losses_kernel(L* losses, const double* row_max, const double* partials, const std::int32_t* targets,
                              std::int64_t rows) {
  for (std::int64_t n = cuda_kernels::grid_first(); n < rows; n += cuda_kernels::grid_stride())
    losses[n] = loss_of(row_max[n], partials[n], partials[rows + n], targets[n]);
}

//! A row of the backward by the row_threads threads of a block: g = scale * (p - onehot(target))
//! on the `real` columns of its `columns` / W packs, 0 on padding and everywhere where `ignored`
//! (a negative target). FromLogits: `x` holds the logits and p = T(exp(value - shift) · factor)
//! (shift the row's max, factor float(1 / its sum)); else `x` holds the probabilities and p =
//! value. `g` may be `x`: each pack is read, then written, by the same thread (the target's
//! one-hot included). A thread loads two packs before it stores either, so that two loads are in
//! flight where the aliasing would otherwise keep the compiler to one; a pack of real columns
//! without the target skips the per-column tests.
LOOM_BLOCK_BODY
template <class T, int W, bool FromLogits, class Thread>
LOOM_HD void row_gradients(const Thread& th, cuda_kernels::Pack<T, W>* g, const cuda_kernels::Pack<T, W>* x,
                           std::int64_t columns, std::int64_t real, std::int64_t local_target, bool ignored,
                           float shift, float factor, float scale) {
  using P = cuda_kernels::Pack<T, W>;
  const std::int64_t packs = columns / W;
  // An ignored row has no active column: all are written 0 below.
  const std::int64_t active = ignored ? 0 : real;
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

//! Row n of the backward (row_gradients) from the group's statistics: shift = float(row_max[n]),
//! factor = float(1 / partials[n]) where FromLogits. `dlogits` may be `in`.
LOOM_BLOCK_BODY
template <class T, int W, bool FromLogits, class Thread>
LOOM_HD void backward_row(const Thread& th, T* dlogits, const T* in, const double* row_max, const double* partials,
                          const std::int32_t* targets, std::int64_t n, std::int64_t columns, std::int64_t real,
                          std::int64_t vocab_begin, float scale) {
  using P = cuda_kernels::Pack<T, W>;
  // The group's max is one of the logits: exact in float.
  const float shift = FromLogits ? static_cast<float>(row_max[n]) : 0.0f;
  const float factor = FromLogits ? static_cast<float>(1.0 / partials[n]) : 1.0f;
  const std::int32_t target = targets[n];
  const std::int64_t local_target = target >= 0 ? static_cast<std::int64_t>(target) - vocab_begin : -1;
  row_gradients<T, W, FromLogits>(th, reinterpret_cast<P*>(dlogits + n * columns),
                                  reinterpret_cast<const P*>(in + n * columns), columns, real, local_target,
                                  target < 0, shift, factor, scale);
}

//! backward_row over the rows, a block (of row_threads threads) per row. Where `gradient_scale`
//! is given and holds s != 0, `in` (which is then `dlogits`) holds the gradient at scale s already
//! (cross_entropy_forward_backward): left as it is where s == scale, else multiplied by scale / s.
template <class T, int W, bool FromLogits>
__global__ void __launch_bounds__(row_threads) backward_kernel(T* dlogits, const T* in, const double* row_max,
                                                               const double* partials, const std::int32_t* targets,
                                                               std::int64_t rows, std::int64_t columns,
                                                               std::int64_t real, std::int64_t vocab_begin,
                                                               float scale, const double* gradient_scale) {
  const cuda_kernels::BlockThread th;
  if (gradient_scale != nullptr && *gradient_scale != 0.0) {
    if (*gradient_scale == static_cast<double>(scale)) return;
    const float factor = static_cast<float>(static_cast<double>(scale) / *gradient_scale);
    for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x)
      for (std::int64_t j = threadIdx.x; j < columns; j += row_threads) {
        T& value = dlogits[n * columns + j];
        value = static_cast<T>(to_accumulate(value) * factor);
      }
    return;
  }
  for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x)
    backward_row<T, W, FromLogits>(th, dlogits, in, row_max, partials, targets, n, columns, real, vocab_begin, scale);
}

//! staged[v] = x[v] for the calling thread's packs v < used (v = t, t + row_threads, ...), eight
//! loads in flight before their stores.
LOOM_BLOCK_BODY
template <class P, class Thread>
LOOM_HD void stage_row(const Thread& th, P* staged, const P* x, std::int64_t used) {
  constexpr int batch = 8;
  std::int64_t v = th.thread();
  for (; v + (batch - 1) * row_threads < used; v += batch * row_threads) {
    P in[batch];
    LOOM_UNROLL
    for (int k = 0; k < batch; ++k) in[k] = x[v + k * row_threads];
    LOOM_UNROLL
    for (int k = 0; k < batch; ++k) staged[v + k * row_threads] = in[k];
  }
  for (; v < used; v += row_threads) staged[v] = x[v];
}

//! Row n of the cross-entropy over one slice holding the whole vocabulary, with its gradient, by
//! a block: the statistics kernel's row_max[n], partials[n] and partials[rows + n], the losses
//! kernel's losses[n], then the backward's gradient at `scale` written over the row of `logits`,
//! each with the bits the three kernels give. Staged: the row's real packs are copied into the
//! block's shared memory (after its reduction_bytes) as they are read, so that the gradient
//! reads them from there and the row is read from memory once; else it reads them again.
LOOM_BLOCK_BODY
template <class T, int W, bool Staged, class Thread>
LOOM_HD void forward_backward_row(const Thread& th, T* logits, accumulate_t<T>* losses, double* row_max,
                                  double* partials, const std::int32_t* targets, std::int64_t n, std::int64_t rows,
                                  std::int64_t columns, std::int64_t real, float scale) {
  using P = cuda_kernels::Pack<T, W>;
  double* scratch = reinterpret_cast<double*>(th.shared());
  T* row = logits + n * columns;
  P* x = reinterpret_cast<P*>(row);
  const std::int64_t used = (real + W - 1) / W;
  const std::int32_t target = targets[n];
  // Before any barrier: after the last one, other threads write the gradient over the row.
  const double target_value = th.thread() == 0 ? target_logit(row, target, real, 0) : 0.0;
  const P* source = x;
  if constexpr (Staged) {
    P* staged = reinterpret_cast<P*>(th.shared() + reduction_bytes);
    stage_row(th, staged, static_cast<const P*>(x), used);  // each thread reads back only its own packs
    source = staged;
  }
  const RowStatistics r = row_statistics<T, W>(th, source, used, real, scratch);
  if (th.thread() == 0) {
    row_max[n] = r.top;
    partials[n] = r.sum;
    partials[rows + n] = target_value;
    losses[n] = loss_of(r.top, r.sum, target_value, target);
  }
  row_gradients<T, W, true>(th, x, source, columns, real, target, target < 0, static_cast<float>(r.top),
                            static_cast<float>(1.0 / r.sum), scale);
}

//! forward_backward_row over the rows, a block per row; the block's `gradient_scale` is set to
//! `scale` by block 0. Dynamic shared memory: reduction_bytes, and the staged row after it.
template <class T, int W, bool Staged>
__global__ void __launch_bounds__(row_threads)
    forward_backward_kernel(T* logits, accumulate_t<T>* losses, double* row_max, double* partials,
                            const std::int32_t* targets, std::int64_t rows, std::int64_t columns, std::int64_t real,
                            float scale, double* gradient_scale) {
  const cuda_kernels::BlockThread th;
  if (blockIdx.x == 0 && threadIdx.x == 0) *gradient_scale = static_cast<double>(scale);
  for (std::int64_t n = blockIdx.x; n < rows; n += gridDim.x)
    forward_backward_row<T, W, Staged>(th, logits, losses, row_max, partials, targets, n, rows, columns, real, scale);
}

// The launchers run the kernels at W = vector_width where vector_rows allows, else at W = 1.
using cuda_kernels::vector_rows;
template <class T>
inline constexpr int vector_width = cuda_kernels::Vector16<T>::elements;

//! backward_kernel on the backend's stream, one block a row: from the logits with the row
//! statistics where `row_max` is given (and `gradient_scale`, unless null), else from the
//! probabilities.
template <class T>
void launch_backward(const cuda& be, T* dlogits, const T* in, const double* row_max, const double* partials,
                     const std::int32_t* targets, const vocab_parallel::CrossEntropyDims& dims,
                     std::int64_t vocab_begin, float scale, const double* gradient_scale, const char* kernel) {
  cuda_kernels::activate(be);
  const bool vectors = vector_rows<T>(dims.slice_columns, dlogits, in);
  const auto launch = row_max != nullptr ? (vectors ? backward_kernel<T, vector_width<T>, true>
                                                    : backward_kernel<T, 1, true>)
                                         : (vectors ? backward_kernel<T, vector_width<T>, false>
                                                    : backward_kernel<T, 1, false>);
  launch<<<blocks_for_rows(dims.rows), row_threads, 0, be.stream()>>>(dlogits, in, row_max, partials, targets,
                                                                      dims.rows, dims.slice_columns, dims.real_columns,
                                                                      vocab_begin, scale, gradient_scale);
  cuda_check_launch(kernel);
}

//! Dynamic shared memory of forward_backward_kernel at W for rows of `real` real columns, staged.
template <class T, int W>
std::size_t staged_bytes(std::int64_t real) noexcept {
  return reduction_bytes + static_cast<std::size_t>((real + W - 1) / W) * sizeof(cuda_kernels::Pack<T, W>);
}

//! The most dynamic shared memory a block may take on the backend's device (its opt-in limit), and
//! whether a staged row of `bytes` fits two blocks on each of its SMs: one block an SM would leave
//! a row's reductions nothing to overlap with; where it does not, the kernel reads the row twice.
struct Staging {
  int block_limit = 0;
  bool stages = false;
};
inline Staging staging(const cuda& be, std::size_t bytes) {
  int per_block = 0, per_multiprocessor = 0;
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, be.device()));
  LOOM_CUDA_CHECK(
      cudaDeviceGetAttribute(&per_multiprocessor, cudaDevAttrMaxSharedMemoryPerMultiprocessor, be.device()));
  constexpr std::size_t reserved = 1024;  // the runtime's own shared memory per block (sm_80 and newer)
  return {per_block, bytes <= static_cast<std::size_t>(per_block) &&
                         2 * (bytes + reserved) <= static_cast<std::size_t>(per_multiprocessor)};
}

//! forward_backward_kernel on the backend's stream at W, staged where the row fits. The staged
//! kernel's limit is raised to the device's whole opt-in limit, the same for every row width, so
//! that ranks of other widths on other threads never lower it under a launch of this one.
template <class T, int W>
void launch_forward_backward(const cuda& be, T* logits, accumulate_t<T>* losses, double* row_max, double* partials,
                             const std::int32_t* targets, const vocab_parallel::CrossEntropyDims& dims, float scale,
                             double* gradient_scale, const char* kernel) {
  const std::size_t bytes = staged_bytes<T, W>(dims.real_columns);
  const Staging s = staging(be, bytes);
  const auto launch = s.stages ? forward_backward_kernel<T, W, true> : forward_backward_kernel<T, W, false>;
  if (s.stages)
    LOOM_CUDA_CHECK(cudaFuncSetAttribute(launch, cudaFuncAttributeMaxDynamicSharedMemorySize, s.block_limit));
  launch<<<blocks_for_rows(dims.rows), row_threads, s.stages ? bytes : reduction_bytes, be.stream()>>>(
      logits, losses, row_max, partials, targets, dims.rows, dims.slice_columns, dims.real_columns, scale,
      gradient_scale);
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
//! allocator (workspace), freed on return (stream order makes the reuse safe). `dwte_slice` and
//! `dwpe` are of T, or for bf16 fp32 gradient sums (G = accumulate_t<T>, stored unrounded).
template <class T, GradientOf<T> G = T>
void vocab_parallel_embedding_backward(cuda& be, Tensor<G> dwte_slice, std::int64_t vocab_begin, Tensor<G> dwpe,
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
  launch<<<v::blocks_for_rows(dims.rows), v::row_threads, v::reduction_bytes, be.stream()>>>(
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
                        nullptr, kernel);
}

//! Vocabulary-parallel cross-entropy backward on the GPU from the `logits` [N, Vs] and the
//! group's `row_max` [N] and `partials` [2, N] (the CPU kernel's contract): p = exp(logit -
//! row_max) · float(1 / sum), rounded to T, then the backward above on it, in one pass over
//! [N, Vs]. `dlogits` may alias `logits`. `gradient_scale` [1] (device, or empty): as on the CPU,
//! where it holds s != 0 the logits hold the gradient at scale s already, which is kept (rescaled
//! where s != scale); the kernel reads it, so the host never waits for it.
template <class T>
void vocab_parallel_cross_entropy_backward(const cuda& be, Tensor<T> dlogits, Tensor<const T> logits,
                                           Tensor<const double> row_max, Tensor<const double> partials,
                                           Tensor<const std::int32_t> targets, std::int64_t vocab_begin,
                                           std::int64_t vocab, accumulate_t<T> scale,
                                           Tensor<const double> gradient_scale = {}) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "vocab_parallel_cross_entropy_backward";
  const detail::vocab_parallel::CrossEntropyDims dims = detail::vocab_parallel::check_backward_from_logits(
      dlogits, logits, row_max, partials, targets, vocab_begin, vocab, kernel);
  detail::vocab_parallel::check_gradient_scale(gradient_scale, dlogits, logits, kernel);
  if (dims.rows == 0) return;
  check_data(logits, kernel, "logits");
  check_data(row_max, kernel, "row_max");
  v::launch_backward<T>(be, dlogits.data(), logits.data(), row_max.data(), partials.data(), targets.data(), dims,
                        vocab_begin, scale, gradient_scale.empty() ? nullptr : gradient_scale.data(), kernel);
}

//! Cross-entropy over one slice holding the whole vocabulary, with its gradient, on the GPU (the
//! CPU kernel's contract): the statistics, the losses and the backward from the logits at `scale`
//! written over `logits` [N, V], each with the bits those three kernels give, and `scale` into
//! `gradient_scale` [1] (device). One block a row reads the row once, keeping its real columns in
//! shared memory for the gradient where two blocks of them fit an SM (bf16 rows up to about
//! 57,800 columns on an H100 or H200), else reading it again.
template <class T>
void cross_entropy_forward_backward(const cuda& be, Tensor<accumulate_t<T>> losses, Tensor<double> row_max,
                                    Tensor<double> partials, Tensor<T> logits, Tensor<const std::int32_t> targets,
                                    std::int64_t vocab, accumulate_t<T> scale, Tensor<double> gradient_scale) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace v = detail::cuda_vocab_parallel;
  constexpr const char* kernel = "cross_entropy_forward_backward";
  const detail::vocab_parallel::CrossEntropyDims dims = detail::vocab_parallel::check_forward_backward(
      losses, row_max, partials, logits, targets, vocab, scale, gradient_scale, kernel);
  check_data(gradient_scale, kernel, "gradient_scale");
  if (dims.rows > 0) check_data(logits, kernel, "logits");
  detail::cuda_kernels::activate(be);
  // Launched for no rows too: its first block sets gradient_scale.
  if (v::vector_rows<T>(dims.slice_columns, logits.data()))
    v::launch_forward_backward<T, v::vector_width<T>>(be, logits.data(), losses.data(), row_max.data(),
                                                      partials.data(), targets.data(), dims, scale,
                                                      gradient_scale.data(), kernel);
  else
    v::launch_forward_backward<T, 1>(be, logits.data(), losses.data(), row_max.data(), partials.data(),
                                     targets.data(), dims, scale, gradient_scale.data(), kernel);
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
