#pragma once
//! \file GELU on the CPU backend, either form (loom::Gelu: GPT-2's tanh approximation or the exact
//! erf): Eigen array expressions over chunks, so that tanh and erf are vectorised (Eigen's packet
//! tanh and erf for float), chunks in parallel. bf16 chunks are widened to float on the stack and
//! each result rounded once.

#include <Eigen/Core>
#include <unsupported/Eigen/SpecialFunctions>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/array_map.hpp"
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/backend/gelu.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::gelu {

//! Elements per task; also the size of the backward's stack scratch.
inline constexpr std::int64_t chunk = 1024;
//! Below this many elements a kernel stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 15;

using loom::detail::ArrayMap;
using loom::detail::ConstArrayMap;

//! y = GELU(x) over one chunk (the scalar formulas of loom/backend/gelu.hpp as array expressions).
template <class A>
void forward_chunk(Gelu kind, const ConstArrayMap<A>& x, ArrayMap<A> y) {
  if (kind == Gelu::erf)
    y = A(0.5) * x * (A(1) + (x * inv_sqrt2<A>).erf());
  else
    y = A(0.5) * x * (A(1) + (scaling<A> * (x + cubic<A> * x.cube())).tanh());
}

//! derivative = GELU'(x) over one chunk (at most `chunk` elements).
template <class A>
void derivative_chunk(Gelu kind, const ConstArrayMap<A>& x, ArrayMap<A> derivative) {
  if (kind == Gelu::erf) {
    // d/dx = 0.5 (1 + erf(x / sqrt(2))) + x exp(-x^2 / 2) / sqrt(2 pi).
    derivative = A(0.5) * (A(1) + (x * inv_sqrt2<A>).erf()) + x * (A(-0.5) * x.square()).exp() * inv_sqrt_2pi<A>;
    return;
  }
  alignas(64) A tanh_buffer[chunk];
  ArrayMap<A> th(tanh_buffer, x.size());
  th = (scaling<A> * (x + cubic<A> * x.cube())).tanh();
  // d/dx = 0.5 (1 + th) + 0.5 x (1 - th^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2).
  derivative =
      A(0.5) * (A(1) + th) + A(0.5) * x * (A(1) - th.square()) * scaling<A> * (A(1) + A(3) * cubic<A> * x.square());
}

//! Runs `update(dx, derivative, begin, size)` over chunks of [0, n) in parallel: `dx` maps the
//! chunk of `d` in the accumulate type (stored back after the update), `derivative` holds
//! GELU'(x) of the chunk of `x`. gelu_backward adds dout * GELU'; the unfused
//! gelu_matmul_backward scales in place.
template <class T, class Update>
void for_each_derivative_chunk(const cpu& be, T* d_all, const T* x_all, std::int64_t n, const Update& update,
                               Gelu kind = Gelu::tanh) {
  using A = accumulate_t<T>;
  const std::int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= parallel_min_elements)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * chunk, size = std::min(chunk, n - begin);
    constexpr std::int64_t staged = detail::stage_size<T, chunk>;
    alignas(64) A x_stage[staged], dx_stage[staged];
    const ConstArrayMap<A> x(detail::load(x_all + begin, x_stage, size), size);
    A* dx = detail::load(d_all + begin, dx_stage, size);
    alignas(64) A derivative_buffer[chunk];
    ArrayMap<A> derivative(derivative_buffer, size);
    derivative_chunk<A>(kind, x, derivative);
    update(ArrayMap<A>(dx, size), derivative, begin, size);
    detail::store(d_all + begin, dx, size);
  }
}

//! d *= GELU'(x) element-wise over n elements, in place.
template <class T>
void scale_by_derivative(const cpu& be, T* d, const T* x, std::int64_t n, Gelu kind = Gelu::tanh) {
  for_each_derivative_chunk(
      be, d, x, n, [](auto dx, auto derivative, std::int64_t, std::int64_t) { dx *= derivative; }, kind);
}

}  // namespace loom::detail::gelu

namespace loom::inline kernels {

//! out = GELU(in) element-wise (equal element counts), of the form `kind`: GPT-2's
//! 0.5 in (1 + tanh(sqrt(2/pi) (in + 0.044715 in^3))) or the exact 0.5 in (1 + erf(in / sqrt(2))).
template <class T>
void gelu_forward(const cpu& be, Tensor<T> out, Tensor<const T> in, Gelu kind = Gelu::tanh) {
  namespace d = detail::gelu;
  check_numel(out, in.numel(), "gelu_forward", "out");
  const std::int64_t n = in.numel();
  const std::int64_t chunks = (n + d::chunk - 1) / d::chunk;
  using A = accumulate_t<T>;
  const T* x_all = in.data();
  T* y_all = out.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= d::parallel_min_elements)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * d::chunk, size = std::min(d::chunk, n - begin);
    alignas(64) A x_stage[detail::stage_size<T, d::chunk>], y_stage[detail::stage_size<T, d::chunk>];
    const d::ConstArrayMap<A> x(detail::load(x_all + begin, x_stage, size), size);
    A* y = detail::output(y_all + begin, y_stage);
    d::forward_chunk<A>(kind, x, d::ArrayMap<A>(y, size));
    detail::store(y_all + begin, y, size);
  }
}

//! din += dout * GELU'(in) element-wise (equal element counts), of the form `kind`.
template <class T>
void gelu_backward(const cpu& be, Tensor<T> din, Tensor<const T> in, Tensor<const T> dout, Gelu kind = Gelu::tanh) {
  check_numel(din, in.numel(), "gelu_backward", "din");
  check_numel(dout, in.numel(), "gelu_backward", "dout");
  const T* g_all = dout.data();
  detail::gelu::for_each_derivative_chunk(be, din.data(), in.data(), in.numel(),
                                          [&](auto dx, auto derivative, std::int64_t begin, std::int64_t size) {
                                            using A = accumulate_t<T>;
                                            alignas(64) A g_stage[detail::stage_size<T, detail::gelu::chunk>];
                                            dx += detail::gelu::ConstArrayMap<A>(
                                                      detail::load(g_all + begin, g_stage, size), size) *
                                                  derivative;
                                          },
                                          kind);
}

}  // namespace loom::inline kernels
