#pragma once
//! \file Plain element-wise helpers on the CUDA backend: copy, accumulate, drain into a wider sum,
//! zero, dropout (all ordered on the backend's stream).

#include <cstddef>
#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/detail/map.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_elementwise {

//! dst += src as a map op (bf16 adds in float and rounds once).
struct Add {
  static constexpr bool reads_out = true;
  __device__ float operator()(float out, float a, float) const { return out + a; }
};

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

//! sum[i] += part[i] (widened), part[i] = 0.
template <class T>
__global__ void drain_kernel(float* sum, T* part, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride()) {
    sum[i] += to_accumulate(part[i]);
    part[i] = T(0.0f);
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
  k::map(be, dst.data(), src.data(), static_cast<const T*>(nullptr), n, detail::cuda_elementwise::Add{}, "add_to");
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

//! sum += part (widened to float), then part = 0: one micro-batch's gradient moved into an fp32
//! accumulator (TrainerOptions::fp32_gradients). Equal element counts.
template <class T>
void drain_into(const cuda& be, Tensor<float> sum, Tensor<T> part) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  check_numel(sum, part.numel(), "drain_into", "sum");
  const std::int64_t n = part.numel();
  if (n == 0) return;
  check_data(part, "drain_into", "part");
  k::activate(be);
  detail::cuda_elementwise::drain_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
      sum.data(), part.data(), n);
  detail::cuda_check_launch("drain_into");
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
