#pragma once
//! \file Element-wise kernels as one pattern: out[i] = op(out[i], a[i], b[i]) over n elements,
//! moved 16 bytes at a time where the buffers allow it. A kernel that loads one 2- or 4-byte
//! element per thread per pass keeps few loads in flight and reaches a fraction of the GPU's
//! memory bandwidth (the layernorm and softmax kernels did, docs/cuda.md); one 16-byte load per
//! operand moves 8 bf16 or 4 floats at once. The result of each element is the same in both
//! forms, so the bits do not depend on alignment.

#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/accumulate.hpp"

namespace loom::detail::cuda_kernels {

// An Op is a copyable struct with
//   static constexpr bool reads_out;   // whether op reads out[i]; if not, that load is skipped
//   __device__ float operator()(float out, float a, float b) const;
// out, a and b as float (0 for out when !reads_out, and for b when b is null).

//! The scalar form, one element per thread per pass.
template <class T, class Op>
__global__ void map_kernel(T* out, const T* a, const T* b, std::int64_t n, Op op) {
  for (std::int64_t i = grid_first(); i < n; i += grid_stride()) {
    const float o = Op::reads_out ? to_accumulate(out[i]) : 0.0f;
    out[i] = static_cast<T>(op(o, to_accumulate(a[i]), b != nullptr ? to_accumulate(b[i]) : 0.0f));
  }
}

//! The vector form over `vectors` Vector16s of each operand.
template <class T, class Op>
__global__ void map_vector_kernel(T* out, const T* a, const T* b, std::int64_t vectors, Op op) {
  using V = Vector16<T>;
  V* o = reinterpret_cast<V*>(out);
  const V* x = reinterpret_cast<const V*>(a);
  const V* y = reinterpret_cast<const V*>(b);
  for (std::int64_t i = grid_first(); i < vectors; i += grid_stride()) {
    const V u = x[i];
    V v, w;
    if (y != nullptr) v = y[i];
    if constexpr (Op::reads_out) w = o[i];
#pragma unroll
    for (int e = 0; e < V::elements; ++e)
      w.value[e] = static_cast<T>(op(Op::reads_out ? to_accumulate(w.value[e]) : 0.0f, to_accumulate(u.value[e]),
                                     y != nullptr ? to_accumulate(v.value[e]) : 0.0f));
    o[i] = w;
  }
}

//! Launches out[i] = op(out[i], a[i], b[i]) for i < n on the backend's stream (b may be null):
//! the whole vectors as Vector16s where out, a and b are 16-byte aligned (any buffer's start,
//! and the model's activations), then the elements past the last whole vector one by one.
//! `kernel` names the public kernel in a launch error.
template <class T, class Op>
void map(const cuda& be, T* out, const T* a, const T* b, std::int64_t n, Op op, const char* kernel) {
  if (n <= 0) return;
  std::int64_t done = 0;
  if (aligned16(out) && aligned16(a) && aligned16(b)) {
    const std::int64_t vectors = n / Vector16<T>::elements;
    if (vectors > 0) {
      map_vector_kernel<<<elementwise_blocks(vectors), elementwise_threads, 0, be.stream()>>>(out, a, b, vectors, op);
      cuda_check_launch(kernel);
    }
    done = vectors * Vector16<T>::elements;
  }
  if (done < n) {
    map_kernel<<<elementwise_blocks(n - done), elementwise_threads, 0, be.stream()>>>(
        out + done, a + done, b != nullptr ? b + done : nullptr, n - done, op);
    cuda_check_launch(kernel);
  }
}

}  // namespace loom::detail::cuda_kernels
