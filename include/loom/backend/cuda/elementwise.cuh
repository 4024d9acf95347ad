#pragma once
//! \file Plain element-wise helpers on the CUDA backend: copy, accumulate, zero, dropout (all
//! ordered on the backend's stream).

#include <cstddef>
#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_elementwise {

template <class T>
__device__ inline T add(T a, T b) {
  return static_cast<T>(to_accumulate(a) + to_accumulate(b));
}

template <class T>
__global__ void add_to_kernel(T* dst, const T* src, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride()) dst[i] = add(dst[i], src[i]);
}

//! add_to_kernel over `vectors` 16-byte vectors: one load of each operand and one store per
//! 4 floats or 8 bf16, the same per-element sums.
template <class T>
__global__ void add_to_vector_kernel(T* dst, const T* src, std::int64_t vectors) {
  using V = cuda_kernels::Vector16<T>;
  V* d = reinterpret_cast<V*>(dst);
  const V* s = reinterpret_cast<const V*>(src);
  for (std::int64_t i = cuda_kernels::grid_first(); i < vectors; i += cuda_kernels::grid_stride()) {
    V a = d[i];
    const V b = s[i];
#pragma unroll
    for (int e = 0; e < V::elements; ++e) a.value[e] = add(a.value[e], b.value[e]);
    d[i] = a;
  }
}

//! One thread per Philox block of four global elements: x[i] through `mask` for the elements
//! [first, first + n) of the site's global tensor that the block covers (x[0] is element first).
template <class T>
__global__ void dropout_kernel(T* x, DropoutMask mask, std::uint64_t first, std::int64_t n) {
  const std::uint64_t first_block = first >> 2, last = first + static_cast<std::uint64_t>(n);
  const auto blocks = static_cast<std::int64_t>(((last + 3) >> 2) - first_block);
  const auto scale = static_cast<float>(mask.scale());
  for (std::int64_t i = cuda_kernels::grid_first(); i < blocks; i += cuda_kernels::grid_stride()) {
    const std::uint64_t block = first_block + static_cast<std::uint64_t>(i);
    const auto words = mask.block(block);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const std::uint64_t e = (block << 2) + static_cast<std::uint64_t>(w);
      if (e < first || e >= last) continue;
      T& v = x[e - first];
      v = mask.keeps(words[w]) ? static_cast<T>(to_accumulate(v) * scale) : T(0.0f);
    }
  }
}

}  // namespace loom::detail::cuda_elementwise

namespace loom::inline kernels {

//! dst = src (same element count): a device-to-device copy on the stream.
template <class T>
void copy(const cuda& be, Tensor<T> dst, Tensor<const T> src) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  check_numel(dst, src.numel(), "copy", "dst");
  check_data(src, "copy", "src");
  if (dst.numel() == 0) return;
  detail::cuda_kernels::activate(be);
  be.copy(dst.data(), src.data(), sizeof(T) * static_cast<std::size_t>(dst.numel()));
}

//! dst += src (same element count; bf16 adds in float and rounds once). 16 bytes per load where
//! both are 16-byte aligned.
template <class T>
void add_to(const cuda& be, Tensor<T> dst, Tensor<const T> src) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  check_numel(dst, src.numel(), "add_to", "dst");
  check_data(src, "add_to", "src");
  const std::int64_t n = dst.numel();
  if (n == 0) return;
  k::activate(be);
  namespace e = detail::cuda_elementwise;
  // Both 16-byte aligned (any buffer start, and the model's [B, T, C] activations): vectors,
  // then the few elements past the last whole vector one by one.
  std::int64_t done = 0;
  if (k::aligned16(dst.data()) && k::aligned16(src.data())) {
    const std::int64_t vectors = n / k::Vector16<T>::elements;
    if (vectors > 0) {
      e::add_to_vector_kernel<<<k::elementwise_blocks(vectors), k::elementwise_threads, 0, be.stream()>>>(
          dst.data(), src.data(), vectors);
      detail::cuda_check_launch("add_to");
    }
    done = vectors * k::Vector16<T>::elements;
  }
  if (done < n) {
    e::add_to_kernel<<<k::elementwise_blocks(n - done), k::elementwise_threads, 0, be.stream()>>>(
        dst.data() + done, src.data() + done, n - done);
    detail::cuda_check_launch("add_to");
  }
}

//! x[i] = mask keeps element first_element + i ? x[i] · scale : 0 (the CPU kernel's contract and
//! mask: the same elements are kept on both backends). Does nothing with an inactive mask.
template <class T>
void dropout(const cuda& be, Tensor<T> x, const DropoutMask& mask, std::int64_t first_element) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  LOOM_CHECK(first_element >= 0, "dropout: first element", first_element, "must be >= 0");
  if (!mask.active() || x.numel() == 0) return;
  check_data(x, "dropout", "x");
  k::activate(be);
  const std::int64_t blocks = (x.numel() + 3) / 4 + 1;  // Philox blocks the range can touch
  detail::cuda_elementwise::dropout_kernel<<<k::elementwise_blocks(blocks), k::elementwise_threads, 0, be.stream()>>>(
      x.data(), mask, static_cast<std::uint64_t>(first_element), x.numel());
  detail::cuda_check_launch("dropout");
}

//! x = 0 (a memset on the stream). An empty tensor is left alone.
template <class T>
void zero(const cuda& be, Tensor<T> x) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  if (x.empty()) return;
  detail::cuda_kernels::activate(be);
  be.fill_zero(x.data(), sizeof(T) * static_cast<std::size_t>(x.numel()));
}

}  // namespace loom::inline kernels
