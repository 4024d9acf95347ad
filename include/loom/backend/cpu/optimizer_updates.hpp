#pragma once
//! \file Element-wise optimizer updates (AdamW, SGD with momentum) on the CPU backend, over flat
//! ranges of parameters, gradients and optimizer state.

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/array_map.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"
#include "loom/optim/update_rules.hpp"

namespace loom::detail::optimizer_updates {

//! Elements per task.
inline constexpr std::int64_t chunk = 4096;
//! Below this many elements an update stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 15;

using loom::detail::ArrayMap;
using loom::detail::ConstArrayMap;

}  // namespace loom::detail::optimizer_updates

namespace loom::inline kernels {

//! One AdamW step on a flat range, PyTorch's formula (decoupled weight decay): p -= lr wd p;
//! m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
//! with t = h.step >= 1. The four tensors have equal element counts (any shapes).
template <class T>
void adamw_update(const cpu& be, Tensor<T> params, Tensor<const T> grads, Tensor<T> m, Tensor<T> v,
                  const AdamWUpdate& h) {
  namespace d = detail::optimizer_updates;
  constexpr const char* kernel = "adamw_update";
  const std::int64_t n = params.numel();
  check_numel(grads, n, kernel, "grads");
  check_numel(m, n, kernel, "m");
  check_numel(v, n, kernel, "v");
  LOOM_CHECK(h.step >= 1, "adamw_update: step", h.step, "steps count from 1");

  // Bias corrections in double, folded into two factors: p -= step_size * m / (sqrt(v) *
  // inv_sqrt_bc2 + eps), as torch.optim.AdamW does.
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  const T decay = static_cast<T>(1.0 - h.lr * h.weight_decay);
  const T step_size = static_cast<T>(h.lr / bias_correction1);
  const T inv_sqrt_bc2 = static_cast<T>(1.0 / std::sqrt(bias_correction2));
  const T beta1 = static_cast<T>(h.beta1), one_minus_beta1 = static_cast<T>(1.0 - h.beta1);
  const T beta2 = static_cast<T>(h.beta2), one_minus_beta2 = static_cast<T>(1.0 - h.beta2);
  const T eps = static_cast<T>(h.eps);

  T* p_all = params.data();
  const T* g_all = grads.data();
  T* m_all = m.data();
  T* v_all = v.data();
  const std::int64_t chunks = (n + d::chunk - 1) / d::chunk;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= d::parallel_min_elements)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * d::chunk, size = std::min(d::chunk, n - begin);
    d::ArrayMap<T> p(p_all + begin, size), mc(m_all + begin, size), vc(v_all + begin, size);
    const d::ConstArrayMap<T> g(g_all + begin, size);
    mc = beta1 * mc + one_minus_beta1 * g;
    vc = beta2 * vc + one_minus_beta2 * g.square();
    p = p * decay - step_size * (mc / (vc.sqrt() * inv_sqrt_bc2 + eps));
  }
}

//! One SGD-with-momentum step on a flat range, PyTorch's formula (no dampening): g' = g + wd p;
//! buf = mu buf + g' (a zero buffer makes the first step buf = g'); p -= lr buf, or with
//! Nesterov p -= lr (g' + mu buf). The three tensors have equal element counts (any shapes).
template <class T>
void sgd_momentum_update(const cpu& be, Tensor<T> params, Tensor<const T> grads, Tensor<T> momentum,
                         const SgdUpdate& h) {
  namespace d = detail::optimizer_updates;
  constexpr const char* kernel = "sgd_momentum_update";
  const std::int64_t n = params.numel();
  check_numel(grads, n, kernel, "grads");
  check_numel(momentum, n, kernel, "momentum");

  const T lr = static_cast<T>(h.lr), mu = static_cast<T>(h.momentum);
  const T wd = static_cast<T>(h.weight_decay);
  T* p = params.data();
  const T* g = grads.data();
  T* buf = momentum.data();
  if (h.nesterov) {
#pragma omp parallel for simd num_threads(be.threads()) schedule(static) \
    if (n >= d::parallel_min_elements)
    for (std::int64_t i = 0; i < n; ++i) {
      const T gd = g[i] + wd * p[i];
      const T b = mu * buf[i] + gd;
      buf[i] = b;
      p[i] -= lr * (gd + mu * b);
    }
  } else {
#pragma omp parallel for simd num_threads(be.threads()) schedule(static) \
    if (n >= d::parallel_min_elements)
    for (std::int64_t i = 0; i < n; ++i) {
      const T b = mu * buf[i] + (g[i] + wd * p[i]);
      buf[i] = b;
      p[i] -= lr * b;
    }
  }
}

}  // namespace loom::inline kernels
