#pragma once
//! \file GELU (the tanh approximation GPT-2 uses) on the CPU backend: Eigen array expressions
//! over chunks, so that tanh is vectorised (Eigen's packet tanh for float), chunks in parallel.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/array_map.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::gelu {

//! Elements per task; also the size of the backward's stack scratch.
inline constexpr std::int64_t chunk = 1024;
//! Below this many elements a kernel stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 15;

using loom::detail::ArrayMap;
using loom::detail::ConstArrayMap;

//! sqrt(2 / pi) and the cubic coefficient of GPT-2's GELU.
template <class T>
inline constexpr T scaling = static_cast<T>(0.7978845608028654);
template <class T>
inline constexpr T cubic = static_cast<T>(0.044715);

}  // namespace loom::detail::gelu

namespace loom::inline kernels {

//! out = 0.5 in (1 + tanh(sqrt(2/pi) (in + 0.044715 in^3))) element-wise (equal element counts).
template <class T>
void gelu_forward(const cpu& be, Tensor<T> out, Tensor<const T> in) {
  namespace d = detail::gelu;
  check_numel(out, in.numel(), "gelu_forward", "out");
  const std::int64_t n = in.numel();
  const std::int64_t chunks = (n + d::chunk - 1) / d::chunk;
  const T* x_all = in.data();
  T* y_all = out.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= d::parallel_min_elements)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * d::chunk, size = std::min(d::chunk, n - begin);
    const d::ConstArrayMap<T> x(x_all + begin, size);
    d::ArrayMap<T>(y_all + begin, size) =
        T(0.5) * x * (T(1) + (d::scaling<T> * (x + d::cubic<T> * x.cube())).tanh());
  }
}

//! din += dout * GELU'(in) element-wise (equal element counts).
template <class T>
void gelu_backward(const cpu& be, Tensor<T> din, Tensor<const T> in, Tensor<const T> dout) {
  namespace d = detail::gelu;
  check_numel(din, in.numel(), "gelu_backward", "din");
  check_numel(dout, in.numel(), "gelu_backward", "dout");
  const std::int64_t n = in.numel();
  const std::int64_t chunks = (n + d::chunk - 1) / d::chunk;
  const T* x_all = in.data();
  const T* g_all = dout.data();
  T* dx_all = din.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= d::parallel_min_elements)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * d::chunk, size = std::min(d::chunk, n - begin);
    const d::ConstArrayMap<T> x(x_all + begin, size);
    alignas(64) T tanh_buffer[d::chunk];
    d::ArrayMap<T> th(tanh_buffer, size);
    th = (d::scaling<T> * (x + d::cubic<T> * x.cube())).tanh();
    // d/dx = 0.5 (1 + th) + 0.5 x (1 - th^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    d::ArrayMap<T>(dx_all + begin, size) +=
        d::ConstArrayMap<T>(g_all + begin, size) *
        (T(0.5) * (T(1) + th) + T(0.5) * x * (T(1) - th.square()) * d::scaling<T> *
                                    (T(1) + T(3) * d::cubic<T> * x.square()));
  }
}

}  // namespace loom::inline kernels
