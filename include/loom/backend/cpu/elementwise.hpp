#pragma once
//! \file Plain element-wise helpers on the CPU backend: copy, accumulate, drain into a wider sum,
//! zero (float, double, bf16).

#include <cstring>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::inline kernels {

//! dst = src (same element count).
template <class T>
void copy(const cpu& be, Tensor<T> dst, Tensor<const T> src) {
  check_numel(dst, src.numel(), "copy", "dst");
  if (dst.numel() > 0) std::memcpy(dst.data(), src.data(), sizeof(T) * dst.numel());
}

//! dst += src (same element count; bf16 adds in float and rounds once).
template <class T>
void add_to(const cpu& be, Tensor<T> dst, Tensor<const T> src) {
  check_numel(dst, src.numel(), "add_to", "dst");
  T* d = dst.data();
  const T* s = src.data();
  const std::int64_t n = dst.numel();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n > (1 << 16))
  for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(to_accumulate(d[i]) + to_accumulate(s[i]));
}

//! sum += part (widened to the accumulate type), then part = 0: one micro-batch's gradient moved
//! into an fp32 accumulator (TrainerOptions::fp32_gradients). Equal element counts.
template <class T>
void drain_into(const cpu& be, Tensor<accumulate_t<T>> sum, Tensor<T> part) {
  check_numel(sum, part.numel(), "drain_into", "sum");
  accumulate_t<T>* s = sum.data();
  T* p = part.data();
  const std::int64_t n = part.numel();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n > (1 << 16))
  for (std::int64_t i = 0; i < n; ++i) {
    s[i] += to_accumulate(p[i]);
    p[i] = T(0.0f);
  }
}

//! x = 0.
template <class T>
void zero(const cpu& be, Tensor<T> x) {
  if (x.numel() > 0) std::memset(static_cast<void*>(x.data()), 0, sizeof(T) * x.numel());
}

}  // namespace loom::inline kernels
