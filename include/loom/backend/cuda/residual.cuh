#pragma once
//! \file Residual connection (out = a + b) on the CUDA backend, element-wise (bf16: added in
//! float, rounded once).

#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_residual {

template <class T>
__global__ void forward_kernel(T* out, const T* a, const T* b, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride())
    out[i] = static_cast<T>(to_accumulate(a[i]) + to_accumulate(b[i]));
}

template <class T>
__global__ void backward_kernel(T* da, T* db, const T* dout, std::int64_t n) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride()) {
    const accumulate_t<T> g = to_accumulate(dout[i]);
    da[i] = static_cast<T>(to_accumulate(da[i]) + g);
    db[i] = static_cast<T>(to_accumulate(db[i]) + g);
  }
}

}  // namespace loom::detail::cuda_residual

namespace loom::inline kernels {

//! out = a + b element-wise (equal element counts; `out` may alias `a` or `b`).
template <class T>
void residual_forward(const cuda& be, Tensor<T> out, Tensor<const T> a, Tensor<const T> b) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  check_numel(a, out.numel(), "residual_forward", "a");
  check_numel(b, out.numel(), "residual_forward", "b");
  check_data(out, "residual_forward", "out");
  const std::int64_t n = out.numel();
  if (n == 0) return;
  k::activate(be);
  detail::cuda_residual::forward_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
      out.data(), a.data(), b.data(), n);
  detail::cuda_check_launch("residual_forward");
}

//! Backward of residual_forward, accumulating: da += dout, db += dout.
template <class T>
void residual_backward(const cuda& be, Tensor<T> da, Tensor<T> db, Tensor<const T> dout) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  check_numel(da, dout.numel(), "residual_backward", "da");
  check_numel(db, dout.numel(), "residual_backward", "db");
  check_data(dout, "residual_backward", "dout");
  const std::int64_t n = dout.numel();
  if (n == 0) return;
  k::activate(be);
  detail::cuda_residual::backward_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
      da.data(), db.data(), dout.data(), n);
  detail::cuda_check_launch("residual_backward");
}

}  // namespace loom::inline kernels
