#pragma once
//! \file Element-wise reductions over untyped buffers, for communicator implementations: the
//! DType and ReduceOp are dispatched once per call, and the loops inside are typed and free of
//! branches so that the compiler vectorizes them. bf16 is accumulated in float and rounded once.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "loom/comm/concepts.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/bf16.hpp"

namespace loom::detail {

//! Elements per block of a blocked reduction: the accumulator block (16 KiB) and the sources'
//! blocks stay in the first-level cache while every source is folded in.
template <class T>
inline constexpr std::size_t reduction_block_elements = 16384 / sizeof(accumulate_t<T>);

template <class T>
inline accumulate_t<T> widen(T value) noexcept {
  if constexpr (std::is_same_v<T, bf16>)
    return std::bit_cast<float>(static_cast<std::uint32_t>(value.bits) << 16);
  else
    return value;
}

//! `accumulator[i] = op(accumulator[i], source[i])`; `average` folds like `sum` (the division
//! comes once, at the end).
template <ReduceOp Op, class A, class T>
inline void fold(A* __restrict accumulator, const T* __restrict source, std::size_t count) noexcept {
  if constexpr (Op == ReduceOp::max) {
    for (std::size_t i = 0; i < count; ++i) {
      const A value = widen(source[i]);
      accumulator[i] = accumulator[i] < value ? value : accumulator[i];
    }
  } else {
    for (std::size_t i = 0; i < count; ++i) accumulator[i] += widen(source[i]);
  }
}

//! The typed core of reduce(): see there.
template <ReduceOp Op, class T>
void reduce_typed(const void* const* sources, int source_count, void* const* destinations,
                  int destination_count, std::size_t count, int divisor) noexcept {
  using A = accumulate_t<T>;
  constexpr std::size_t block = reduction_block_elements<T>;
  alignas(64) A accumulator[block];
  alignas(64) T rounded[std::is_same_v<T, A> ? 1 : block];
  const A scale = static_cast<A>(divisor);
  for (std::size_t begin = 0; begin < count; begin += block) {
    const std::size_t length = std::min(block, count - begin);
    const T* first = static_cast<const T*>(sources[0]) + begin;
    for (std::size_t i = 0; i < length; ++i) accumulator[i] = widen(first[i]);
    for (int s = 1; s < source_count; ++s)
      fold<Op>(accumulator, static_cast<const T*>(sources[s]) + begin, length);
    if constexpr (Op == ReduceOp::average)
      for (std::size_t i = 0; i < length; ++i) accumulator[i] /= scale;
    const T* result = nullptr;
    if constexpr (std::is_same_v<T, A>) {
      result = accumulator;
    } else {
      for (std::size_t i = 0; i < length; ++i) rounded[i] = T(accumulator[i]);
      result = rounded;
    }
    // Every source block has been read before any destination is written, so a destination
    // may be one of the sources (in place).
    for (int d = 0; d < destination_count; ++d)
      std::memcpy(static_cast<T*>(destinations[d]) + begin, result, length * sizeof(T));
  }
}

//! Reduces `count` elements of `source_count` arrays, folding them in the fixed order source 0,
//! 1, ... (so the result does not depend on timing), and stores the result in each of
//! `destination_count` arrays. A destination may be one
//! of the sources. `average` divides the sum by `divisor` (the group size). Works in cache-sized
//! blocks so that each source element is read from memory once.
inline void reduce(DType dtype, ReduceOp op, const void* const* sources, int source_count,
                   void* const* destinations, int destination_count, std::size_t count,
                   int divisor) noexcept {
  if (count == 0 || source_count < 1) return;
  auto with_op = [&]<class T>(T*) {
    switch (op) {
      case ReduceOp::sum:
        return reduce_typed<ReduceOp::sum, T>(sources, source_count, destinations, destination_count, count, divisor);
      case ReduceOp::average:
        return reduce_typed<ReduceOp::average, T>(sources, source_count, destinations, destination_count, count, divisor);
      case ReduceOp::max:
        return reduce_typed<ReduceOp::max, T>(sources, source_count, destinations, destination_count, count, divisor);
    }
  };
  switch (dtype) {
    case DType::float32: return with_op(static_cast<float*>(nullptr));
    case DType::float64: return with_op(static_cast<double*>(nullptr));
    case DType::bfloat16: return with_op(static_cast<bf16*>(nullptr));
  }
}

//! `inout[i] = op(inout[i], input[i])` for `count` elements (`average` folds like `sum`; finish
//! it with divide()). For pairwise reductions such as a user-defined MPI operation and the MPI
//! ring's steps; bf16 rounds after each fold here, so prefer reduce() where all sources are at
//! hand. `inout` and `input` must not overlap. One pass in place, not reduce()'s blocked copy
//! through an accumulator (docs/benchmarks.md, "The ring's reduction").
inline void reduce_into(DType dtype, ReduceOp op, void* inout, const void* input, std::size_t count) noexcept {
  auto typed = [&]<class T>(T*) {
    auto* __restrict out = static_cast<T*>(inout);
    const auto* __restrict in = static_cast<const T*>(input);
    if (op == ReduceOp::max) {
      for (std::size_t i = 0; i < count; ++i) {
        const accumulate_t<T> a = widen(out[i]), b = widen(in[i]);
        out[i] = T(a < b ? b : a);
      }
    } else {
      for (std::size_t i = 0; i < count; ++i) out[i] = T(widen(out[i]) + widen(in[i]));
    }
  };
  switch (dtype) {
    case DType::float32: return typed(static_cast<float*>(nullptr));
    case DType::float64: return typed(static_cast<double*>(nullptr));
    case DType::bfloat16: return typed(static_cast<bf16*>(nullptr));
  }
}

//! `data[i] /= divisor` for `count` elements: the last step of an `average` built with
//! reduce_into().
inline void divide(DType dtype, void* data, std::size_t count, int divisor) noexcept {
  const void* sources[1] = {data};
  void* destinations[1] = {data};
  reduce(dtype, ReduceOp::average, sources, 1, destinations, 1, count, divisor);
}

}  // namespace loom::detail
