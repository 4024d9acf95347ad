#pragma once
//! \file Element-wise optimizer updates (AdamW, SGD with momentum) on the CUDA backend, over
//! flat ranges of parameters, gradients and optimizer state. The per-element steps are
//! host/device functions (the host tests check them directly); the scalar factors are computed
//! on the host in double, as on the CPU. bf16 parameters keep fp32 master weights and state (the
//! overloads that take `master`).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/hd.hpp"
#include "loom/core/tensor.hpp"
#include "loom/optim/concepts.hpp"
#include "loom/optim/update_rules.hpp"

namespace loom::detail::cuda_optimizer_updates {

//! AdamW's hyper-parameters rounded to float once, bias corrections folded in (torch's form).
struct AdamWFactors {
  float decay, step_size, inv_sqrt_bc2, beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
};

//! The CPU kernel's factors: bias corrections in double, then rounded to float.
inline AdamWFactors adamw_factors(const AdamWUpdate& h) {
  const double bias_correction1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bias_correction2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  return {static_cast<float>(1.0 - h.lr * h.weight_decay), static_cast<float>(h.lr / bias_correction1),
          static_cast<float>(1.0 / std::sqrt(bias_correction2)), static_cast<float>(h.beta1),
          static_cast<float>(1.0 - h.beta1), static_cast<float>(h.beta2), static_cast<float>(1.0 - h.beta2),
          static_cast<float>(h.eps)};
}

//! One AdamW step of one element: m, v updated; p = p decay - step_size m / (sqrt(v) / sqrt(bc2) + eps).
LOOM_HD inline void adamw_element(float& p, float g, float& m, float& v, const AdamWFactors& f) {
  m = f.beta1 * m + f.one_minus_beta1 * g;
  v = f.beta2 * v + f.one_minus_beta2 * (g * g);
  p = p * f.decay - f.step_size * (m / (sqrtf(v) * f.inv_sqrt_bc2 + f.eps));
}

//! SGD's hyper-parameters rounded to float once.
struct SgdFactors {
  float lr, momentum, weight_decay;
  bool nesterov;
};

inline SgdFactors sgd_factors(const SgdUpdate& h) {
  return {static_cast<float>(h.lr), static_cast<float>(h.momentum), static_cast<float>(h.weight_decay),
          h.nesterov};
}

//! One SGD-with-momentum step of one element: g' = g + wd p; buf = mu buf + g';
//! p -= lr buf, or with Nesterov p -= lr (g' + mu buf).
LOOM_HD inline void sgd_element(float& p, float g, float& buf, const SgdFactors& f) {
  const float gd = g + f.weight_decay * p;
  const float b = f.momentum * buf + gd;
  buf = b;
  p -= f.lr * (f.nesterov ? gd + f.momentum * b : b);
}

//! master, m, v in float, updated from the widened gradient; params = master rounded once. For
//! float parameters `master` is `params` itself (the same value is written twice).
template <class T, class G>
__device__ inline void adamw_elements(T* params, const G* grads, float* master, float* m, float* v,
                                      std::int64_t first, std::int64_t end, std::int64_t stride,
                                      const AdamWFactors& f) {
  for (std::int64_t i = first; i < end; i += stride) {
    float p = master[i], mi = m[i], vi = v[i];
    adamw_element(p, to_accumulate(grads[i]), mi, vi, f);
    master[i] = p;
    m[i] = mi;
    v[i] = vi;
    params[i] = static_cast<T>(p);
  }
}
template <class T, class G>
__global__ void adamw_kernel(T* params, const G* grads, float* master, float* m, float* v, std::int64_t n,
                             AdamWFactors f) {
  adamw_elements(params, grads, master, m, v, cuda_kernels::grid_first(), n, cuda_kernels::grid_stride(), f);
}

//! Elements each block of adamw_segments_kernel updates (256 threads, 8 each).
inline constexpr std::int64_t segment_block_elements = cuda_kernels::elementwise_threads * 8;

//! The segments of one adamw_segments_kernel launch: 40 a launch (3.2 KiB of parameters), each
//! with its own pointers and weight-decay factor.
template <class T, class G>
struct AdamWSegments {
  static constexpr int capacity = 40;
  cuda_kernels::PartBlocks<capacity> blocks;
  T* params[capacity];
  const G* grads[capacity];
  float* master[capacity];
  float* m[capacity];
  float* v[capacity];
  float decay[capacity];  //!< 1 - lr wd of the segment (1 where it is not decayed)
};

//! adamw_kernel over several segments in one launch (a model's 148 tensors in 4 launches instead
//! of 148); each element's arithmetic is adamw_kernel's (adamw_elements).
template <class T, class G>
__global__ void adamw_segments_kernel(AdamWSegments<T, G> table, AdamWFactors f) {
  const cuda_kernels::PartRange r = cuda_kernels::part_range(table.blocks, blockIdx.x, segment_block_elements);
  f.decay = table.decay[r.part];
  adamw_elements(table.params[r.part], table.grads[r.part], table.master[r.part], table.m[r.part], table.v[r.part],
                 r.begin + threadIdx.x, r.end, blockDim.x, f);
}

//! master and momentum in float; params = master rounded once (`master` is `params` for float).
template <class T, class G>
__global__ void sgd_kernel(T* params, const G* grads, float* master, float* momentum, std::int64_t n,
                           SgdFactors f) {
  for (std::int64_t i = cuda_kernels::grid_first(); i < n; i += cuda_kernels::grid_stride()) {
    float p = master[i], b = momentum[i];
    sgd_element(p, to_accumulate(grads[i]), b, f);
    master[i] = p;
    momentum[i] = b;
    params[i] = static_cast<T>(p);
  }
}

}  // namespace loom::detail::cuda_optimizer_updates

namespace loom::detail::cuda_optimizer_updates {

//! adamw_update with master weights, for gradients of T or of float.
template <class T, class G>
void adamw_master(const cuda& be, Tensor<T> params, Tensor<const G> grads, Tensor<float> master, Tensor<float> m,
                  Tensor<float> v, const AdamWUpdate& h) {
  static_assert(cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = cuda_kernels;
  constexpr const char* kernel = "adamw_update";
  const std::int64_t n = params.numel();
  check_data(params, kernel, "params");
  check_numel(grads, n, kernel, "grads");
  check_numel(m, n, kernel, "m");
  check_numel(v, n, kernel, "v");
  check_numel(master, n, kernel, "master");
  LOOM_CHECK(h.step >= 1, "adamw_update: step", h.step, "steps count from 1");
  if (n == 0) return;
  k::activate(be);
  adamw_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
      params.data(), grads.data(), master.data(), m.data(), v.data(), n, adamw_factors(h));
  cuda_check_launch("adamw_update");
}

//! adamw_update over `segments`, `grads_of(s)` giving each one's gradients (of G): a few
//! launches for all of them. Segment s is decayed by h.weight_decay where s.weight_decay, else
//! not; float parameters are their own master.
template <class T, class G, class GradsOf>
void adamw_segments(const cuda& be, std::span<const OptimizerSegment<T>> segments, GradsOf grads_of,
                    const AdamWUpdate& h) {
  static_assert(cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = cuda_kernels;
  constexpr const char* kernel = "adamw_update (segments)";
  LOOM_CHECK(h.step >= 1, "adamw_update: step", h.step, "steps count from 1");
  constexpr bool narrow = is_narrow_storage<T>;
  std::vector<std::int64_t> sizes;
  for (const OptimizerSegment<T>& s : segments) {
    const std::int64_t n = s.params.numel();
    if (n > 0) {
      check_data(s.params, kernel, "params");
      check_numel(grads_of(s), n, kernel, "grads");
      check_numel(s.state[0], n, kernel, "m");
      check_numel(s.state[1], n, kernel, "v");
      if constexpr (narrow) check_numel(s.master, n, kernel, "master");
    }
    sizes.push_back(n);
  }
  const AdamWFactors f = adamw_factors(h);
  AdamWUpdate undecayed = h;
  undecayed.weight_decay = 0.0;
  const float no_decay = adamw_factors(undecayed).decay;
  k::activate(be);
  using Table = AdamWSegments<T, G>;
  k::for_each_part_launch<decltype(Table::blocks)>(
      sizes, segment_block_elements, [&](const auto& part_blocks, std::span<const std::size_t> members) {
        Table table{};
        table.blocks = part_blocks;
        for (std::size_t p = 0; p < members.size(); ++p) {
          const OptimizerSegment<T>& s = segments[members[p]];
          table.params[p] = s.params.data();
          table.grads[p] = grads_of(s).data();
          table.master[p] = narrow ? s.master.data() : reinterpret_cast<float*>(s.params.data());
          table.m[p] = s.state[0].data();
          table.v[p] = s.state[1].data();
          table.decay[p] = s.weight_decay ? f.decay : no_decay;
        }
        const auto blocks = static_cast<unsigned>(part_blocks.first_block[part_blocks.count]);
        adamw_segments_kernel<<<blocks, k::elementwise_threads, 0, be.stream()>>>(table, f);
        cuda_check_launch(kernel);
      });
}

//! sgd_momentum_update with master weights, for gradients of T or of float.
template <class T, class G>
void sgd_master(const cuda& be, Tensor<T> params, Tensor<const G> grads, Tensor<float> master,
                Tensor<float> momentum, const SgdUpdate& h) {
  static_assert(cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = cuda_kernels;
  constexpr const char* kernel = "sgd_momentum_update";
  const std::int64_t n = params.numel();
  check_data(params, kernel, "params");
  check_numel(grads, n, kernel, "grads");
  check_numel(master, n, kernel, "master");
  check_numel(momentum, n, kernel, "momentum");
  if (n == 0) return;
  k::activate(be);
  sgd_kernel<<<k::elementwise_blocks(n), k::elementwise_threads, 0, be.stream()>>>(
      params.data(), grads.data(), master.data(), momentum.data(), n, sgd_factors(h));
  cuda_check_launch("sgd_momentum_update");
}

}  // namespace loom::detail::cuda_optimizer_updates

namespace loom::inline kernels {

//! One AdamW step with fp32 master weights (mixed precision): `master`, `m` and `v` (float) are
//! updated exactly as the float overload updates float parameters from the widened gradients,
//! then params = master rounded once. All five tensors have equal element counts.
template <class T>
void adamw_update(const cuda& be, Tensor<T> params, Tensor<const T> grads, Tensor<float> master, Tensor<float> m,
                  Tensor<float> v, const AdamWUpdate& h) {
  detail::cuda_optimizer_updates::adamw_master(be, params, grads, master, m, v, h);
}

//! The same from fp32 gradients of bf16 parameters (TrainerOptions::fp32_gradients).
template <class T>
  requires is_narrow_storage<T>
void adamw_update(const cuda& be, Tensor<T> params, Tensor<const float> grads, Tensor<float> master,
                  Tensor<float> m, Tensor<float> v, const AdamWUpdate& h) {
  detail::cuda_optimizer_updates::adamw_master(be, params, grads, master, m, v, h);
}

//! One SGD-with-momentum step with fp32 master weights: `master` and `momentum` updated as the
//! float overload updates float parameters, then params = master rounded once.
template <class T>
void sgd_momentum_update(const cuda& be, Tensor<T> params, Tensor<const T> grads, Tensor<float> master,
                         Tensor<float> momentum, const SgdUpdate& h) {
  detail::cuda_optimizer_updates::sgd_master(be, params, grads, master, momentum, h);
}

//! The same from fp32 gradients of bf16 parameters (TrainerOptions::fp32_gradients).
template <class T>
  requires is_narrow_storage<T>
void sgd_momentum_update(const cuda& be, Tensor<T> params, Tensor<const float> grads, Tensor<float> master,
                         Tensor<float> momentum, const SgdUpdate& h) {
  detail::cuda_optimizer_updates::sgd_master(be, params, grads, master, momentum, h);
}

//! One AdamW step on a flat range, PyTorch's formula (decoupled weight decay): p -= lr wd p;
//! m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps)
//! with t = h.step >= 1. The four tensors have equal element counts (any shapes).
template <class T>
void adamw_update(const cuda& be, Tensor<T> params, Tensor<const T> grads, Tensor<T> m, Tensor<T> v,
                  const AdamWUpdate& h) {
  static_assert(std::is_same_v<T, float>,
                "loom: adamw_update on bf16 parameters keeps fp32 master weights, m and v: call the "
                "overload that takes `master`");
  adamw_update<T>(be, params, grads, params, m, v, h);  // float: the parameters are their own master
}

//! One AdamW step (adamw_update) on each of `segments` (an optimizer's segments of a flat range:
//! bf16 parameters with fp32 master weights, or float ones; state slots 0 and 1 are m and v), in
//! a launch per 40 segments instead of one each: a model's small tensors (biases, layernorm
//! parameters) cost no launch of their own. Segment s takes h.weight_decay where s.weight_decay,
//! 0 elsewhere; its gradients are s.fp32_grads where it holds them, else s.grads (the same for
//! all the segments). Each element's arithmetic is adamw_update's; the results agree with it to
//! float rounding (ptxas may contract the parameter update's multiply-adds otherwise in the two
//! kernels), and the same segments give the same bits on every run, however they are cut.
template <class T>
void adamw_update_segments(const cuda& be, std::span<const OptimizerSegment<T>> segments, const AdamWUpdate& h) {
  namespace u = detail::cuda_optimizer_updates;
  const auto wide = [](const OptimizerSegment<T>& s) { return s.fp32_grads.data() != nullptr; };
  const bool all_wide = std::all_of(segments.begin(), segments.end(), wide);
  if constexpr (is_narrow_storage<T>) {
    if (all_wide) return u::adamw_segments<T, float>(be, segments, [](const auto& s) { return s.fp32_grads; }, h);
  }
  LOOM_CHECK(segments.empty() || std::none_of(segments.begin(), segments.end(), wide),
             "adamw_update_segments: segments", segments.size(),
             "must all hold fp32 gradients or none (got a mix)");
  u::adamw_segments<T, T>(be, segments, [](const auto& s) { return s.grads; }, h);
}

//! One SGD-with-momentum step on a flat range, PyTorch's formula (no dampening): g' = g + wd p;
//! buf = mu buf + g' (a zero buffer makes the first step buf = g'); p -= lr buf, or with
//! Nesterov p -= lr (g' + mu buf). The three tensors have equal element counts (any shapes).
template <class T>
void sgd_momentum_update(const cuda& be, Tensor<T> params, Tensor<const T> grads, Tensor<T> momentum,
                         const SgdUpdate& h) {
  static_assert(std::is_same_v<T, float>,
                "loom: sgd_momentum_update on bf16 parameters keeps fp32 master weights and momentum: "
                "call the overload that takes `master`");
  sgd_momentum_update<T>(be, params, grads, params, momentum, h);  // float: its own master
}

}  // namespace loom::inline kernels
