#pragma once
//! \file Residual connection (out = a + b) on the CPU backend (bf16: added in float, rounded once).

#include <cstdint>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::residual {

//! Below this many elements a kernel stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 15;

}  // namespace loom::detail::residual

namespace loom::inline kernels {

//! out = a + b element-wise (equal element counts; `out` may alias `a` or `b`).
template <class T>
void residual_forward(const cpu& be, Tensor<T> out, Tensor<const T> a, Tensor<const T> b) {
  check_numel(a, out.numel(), "residual_forward", "a");
  check_numel(b, out.numel(), "residual_forward", "b");
  const std::int64_t n = out.numel();
  T* o = out.data();
  const T* x = a.data();
  const T* y = b.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) \
    if (n >= detail::residual::parallel_min_elements)
  for (std::int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(to_accumulate(x[i]) + to_accumulate(y[i]));
}

//! Backward of residual_forward, accumulating: da += dout, db += dout.
template <class T>
void residual_backward(const cpu& be, Tensor<T> da, Tensor<T> db, Tensor<const T> dout) {
  check_numel(da, dout.numel(), "residual_backward", "da");
  check_numel(db, dout.numel(), "residual_backward", "db");
  const std::int64_t n = dout.numel();
  T* ga = da.data();
  T* gb = db.data();
  const T* g = dout.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) \
    if (n >= detail::residual::parallel_min_elements)
  for (std::int64_t i = 0; i < n; ++i) {
    const accumulate_t<T> gi = to_accumulate(g[i]);
    ga[i] = static_cast<T>(to_accumulate(ga[i]) + gi);
    gb[i] = static_cast<T>(to_accumulate(gb[i]) + gi);
  }
}

}  // namespace loom::inline kernels
