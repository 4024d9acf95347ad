#pragma once
//! \file Element-wise optimizer updates (AdamW, SGD with momentum) on the CPU backend, over flat
//! ranges of parameters, gradients and optimizer state; for bf16 parameters, overloads that keep
//! fp32 master weights and state (mixed precision).

#include <Eigen/Core>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/cpu/detail/array_map.hpp"
#include "loom/backend/cpu/detail/staging.hpp"
#include "loom/core/accumulate.hpp"
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

//! AdamW's hyper-parameters in the arithmetic type A, bias corrections computed in double and
//! folded into two factors: p -= step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps), as
//! torch.optim.AdamW does.
template <class A>
struct AdamWFactors {
  A decay, step_size, inv_sqrt_bc2, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;

  explicit AdamWFactors(const AdamWUpdate& h) {
    const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
    const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
    decay = static_cast<A>(1.0 - h.lr * h.weight_decay);
    step_size = static_cast<A>(h.lr / bias_correction1);
    inv_sqrt_bc2 = static_cast<A>(1.0 / std::sqrt(bias_correction2));
    beta1 = static_cast<A>(h.beta1);
    one_minus_beta1 = static_cast<A>(1.0 - h.beta1);
    beta2 = static_cast<A>(h.beta2);
    one_minus_beta2 = static_cast<A>(1.0 - h.beta2);
    eps = static_cast<A>(h.eps);
  }
};

//! One AdamW step on `size` elements, as Eigen array expressions (vectorised sqrt).
template <class A>
void adamw_chunk(A* p_data, const A* g_data, A* m_data, A* v_data, std::int64_t size, const AdamWFactors<A>& f) {
  ArrayMap<A> p(p_data, size), m(m_data, size), v(v_data, size);
  const ConstArrayMap<A> g(g_data, size);
  m = f.beta1 * m + f.one_minus_beta1 * g;
  v = f.beta2 * v + f.one_minus_beta2 * g.square();
  p = p * f.decay - f.step_size * (m / (v.sqrt() * f.inv_sqrt_bc2 + f.eps));
}

//! Checks the AdamW arguments both overloads share.
template <class P, class G, class S>
void check_adamw(const Tensor<P>& params, const Tensor<G>& grads, const Tensor<S>& m, const Tensor<S>& v,
                 const AdamWUpdate& h) {
  constexpr const char* kernel = "adamw_update";
  const std::int64_t n = params.numel();
  check_numel(grads, n, kernel, "grads");
  check_numel(m, n, kernel, "m");
  check_numel(v, n, kernel, "v");
  LOOM_CHECK(h.step >= 1, "adamw_update: step", h.step, "steps count from 1");
}

//! Checks the SGD arguments both overloads share.
template <class P, class G, class S>
void check_sgd(const Tensor<P>& params, const Tensor<G>& grads, const Tensor<S>& momentum) {
  check_numel(grads, params.numel(), "sgd_momentum_update", "grads");
  check_numel(momentum, params.numel(), "sgd_momentum_update", "momentum");
}

//! One SGD-with-momentum step on p[0, n) (arithmetic type A) with gradients g of storage type G.
template <class A, class G>
void sgd_range(const cpu& be, A* p, const G* g, A* buf, std::int64_t n, const SgdUpdate& h) {
  const A lr = static_cast<A>(h.lr), mu = static_cast<A>(h.momentum);
  const A wd = static_cast<A>(h.weight_decay);
  if (h.nesterov) {
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= parallel_min_elements)
    for (std::int64_t i = 0; i < n; ++i) {
      const A gd = to_accumulate(g[i]) + wd * p[i];
      const A b = mu * buf[i] + gd;
      buf[i] = b;
      p[i] -= lr * (gd + mu * b);
    }
  } else {
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= parallel_min_elements)
    for (std::int64_t i = 0; i < n; ++i) {
      const A b = mu * buf[i] + (to_accumulate(g[i]) + wd * p[i]);
      buf[i] = b;
      p[i] -= lr * b;
    }
  }
}

//! One AdamW step on n elements, chunks in parallel: `p` (arithmetic type A) from gradients of
//! storage type G, widened chunk by chunk; where `rounded` is given (bf16 parameters beside
//! their fp32 master `p`), each chunk of `p` is rounded into it once.
template <class A, class G, class R>
void adamw_range(const cpu& be, A* p, const G* g, A* m, A* v, R* rounded, std::int64_t n, const AdamWUpdate& h) {
  const AdamWFactors<A> f(h);
  const std::int64_t chunks = (n + chunk - 1) / chunk;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= parallel_min_elements)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * chunk, size = std::min(chunk, n - begin);
    alignas(64) A g_stage[detail::stage_size<G, chunk>];
    adamw_chunk(p + begin, detail::load(g + begin, g_stage, size), m + begin, v + begin, size, f);
    if (rounded != nullptr) detail::narrow_into(p + begin, rounded + begin, size);
  }
}

//! params = master rounded once to T.
template <class T>
void round_params(const cpu& be, T* params, const accumulate_t<T>* master, std::int64_t n) {
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= parallel_min_elements)
  for (std::int64_t i = 0; i < n; ++i) params[i] = static_cast<T>(master[i]);
}

//! AdamW with master weights from gradients of storage type G (T, or the accumulate type).
template <class T, class G>
void adamw_master(const cpu& be, Tensor<T> params, Tensor<const G> grads, Tensor<accumulate_t<T>> master,
                  Tensor<accumulate_t<T>> m, Tensor<accumulate_t<T>> v, const AdamWUpdate& h) {
  check_adamw(params, grads, m, v, h);
  check_numel(master, params.numel(), "adamw_update", "master");
  adamw_range(be, master.data(), grads.data(), m.data(), v.data(), params.data(), params.numel(), h);
}

//! SGD with momentum and master weights from gradients of storage type G.
template <class T, class G>
void sgd_master(const cpu& be, Tensor<T> params, Tensor<const G> grads, Tensor<accumulate_t<T>> master,
                Tensor<accumulate_t<T>> momentum, const SgdUpdate& h) {
  check_sgd(params, grads, momentum);
  check_numel(master, params.numel(), "sgd_momentum_update", "master");
  const std::int64_t n = params.numel();
  sgd_range(be, master.data(), grads.data(), momentum.data(), n, h);
  round_params(be, params.data(), master.data(), n);
}

}  // namespace loom::detail::optimizer_updates

namespace loom::inline kernels {

//! One AdamW step on a flat range, PyTorch's formula (decoupled weight decay): p -= lr wd p;
//! m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
//! with t = h.step >= 1. The four tensors have equal element counts (any shapes). The bias
//! corrections are computed in double; the element-wise work is in T, chunks in parallel.
template <class T>
void adamw_update(const cpu& be, Tensor<T> params, Tensor<const T> grads, Tensor<T> m, Tensor<T> v,
                  const AdamWUpdate& h) {
  static_assert(!is_narrow_storage<T>,
                "loom: adamw_update on bf16 parameters keeps fp32 master weights, m and v: call the "
                "overload that takes `master`");
  detail::optimizer_updates::check_adamw(params, grads, m, v, h);
  detail::optimizer_updates::adamw_range(be, params.data(), grads.data(), m.data(), v.data(),
                                         static_cast<T*>(nullptr), params.numel(), h);
}

//! One AdamW step with master weights (mixed precision): `master`, `m` and `v` are updated in
//! the accumulate type (float for bf16) exactly as the plain overload updates float parameters
//! from the widened gradients, then params = master rounded once. All five tensors have equal
//! element counts (any shapes).
template <class T>
void adamw_update(const cpu& be, Tensor<T> params, Tensor<const T> grads, Tensor<accumulate_t<T>> master,
                  Tensor<accumulate_t<T>> m, Tensor<accumulate_t<T>> v, const AdamWUpdate& h) {
  detail::optimizer_updates::adamw_master(be, params, grads, master, m, v, h);
}

//! The same from fp32 gradients of bf16 parameters (TrainerOptions::fp32_gradients).
template <class T>
  requires is_narrow_storage<T>
void adamw_update(const cpu& be, Tensor<T> params, Tensor<const accumulate_t<T>> grads,
                  Tensor<accumulate_t<T>> master, Tensor<accumulate_t<T>> m, Tensor<accumulate_t<T>> v,
                  const AdamWUpdate& h) {
  detail::optimizer_updates::adamw_master(be, params, grads, master, m, v, h);
}

//! One SGD-with-momentum step on a flat range, PyTorch's formula (no dampening): g' = g + wd p;
//! buf = mu buf + g' (a zero buffer makes the first step buf = g'); p -= lr buf, or with
//! Nesterov p -= lr (g' + mu buf). The three tensors have equal element counts (any shapes).
template <class T>
void sgd_momentum_update(const cpu& be, Tensor<T> params, Tensor<const T> grads, Tensor<T> momentum,
                         const SgdUpdate& h) {
  static_assert(!is_narrow_storage<T>,
                "loom: sgd_momentum_update on bf16 parameters keeps fp32 master weights and momentum: "
                "call the overload that takes `master`");
  detail::optimizer_updates::check_sgd(params, grads, momentum);
  detail::optimizer_updates::sgd_range(be, params.data(), grads.data(), momentum.data(), params.numel(), h);
}

//! One SGD-with-momentum step with master weights: `master` and `momentum` are updated in the
//! accumulate type exactly as the plain overload updates float parameters from the widened
//! gradients, then params = master rounded once. Equal element counts.
template <class T>
void sgd_momentum_update(const cpu& be, Tensor<T> params, Tensor<const T> grads, Tensor<accumulate_t<T>> master,
                         Tensor<accumulate_t<T>> momentum, const SgdUpdate& h) {
  detail::optimizer_updates::sgd_master(be, params, grads, master, momentum, h);
}

//! The same from fp32 gradients of bf16 parameters (TrainerOptions::fp32_gradients).
template <class T>
  requires is_narrow_storage<T>
void sgd_momentum_update(const cpu& be, Tensor<T> params, Tensor<const accumulate_t<T>> grads,
                         Tensor<accumulate_t<T>> master, Tensor<accumulate_t<T>> momentum, const SgdUpdate& h) {
  detail::optimizer_updates::sgd_master(be, params, grads, master, momentum, h);
}

}  // namespace loom::inline kernels
