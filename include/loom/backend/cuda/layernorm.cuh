#pragma once
//! \file LayerNorm over the last axis on the CUDA backend: one warp per row, row statistics in
//! two fp32 passes (mean, then the mean square of x - mean), parameter gradients as column sums
//! in a fixed order (detail/column_sums.cuh). bf16 elements are loaded as float; mean and rstd
//! are stored in float (accumulate_t) and every other result is rounded once.

#include <cstdint>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/backend/cuda/detail/column_sums.cuh"
#include "loom/backend/cuda/detail/kernel_support.cuh"
#include "loom/backend/cuda/error.hpp"
#include "loom/backend/detail/shape_checks.hpp"
#include "loom/backend/gradient_write.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::cuda_layernorm {

//! One warp per row: mean, rstd = 1/sqrt(biased variance + eps) and out. The variance is the
//! mean of (x - mean)^2 (a second pass over the row, which is in L1), so there is no
//! cancellation when the mean is large against the spread.
template <class T, class A = accumulate_t<T>>
__global__ void forward_kernel(T* out, A* mean, A* rstd, const T* in, const T* weight, const T* bias,
                               std::int64_t rows, std::int64_t cols, A eps) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t row =
      static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // the whole warp leaves together
  const T* x = in + row * cols;
  A sum = 0;
  for (std::int64_t i = lane; i < cols; i += 32) sum += to_accumulate(x[i]);
  const A m = cuda_kernels::warp_sum(sum) / static_cast<A>(cols);
  A sum_sq = 0;
  for (std::int64_t i = lane; i < cols; i += 32) {
    const A d = to_accumulate(x[i]) - m;
    sum_sq += d * d;
  }
  const A var = cuda_kernels::warp_sum(sum_sq) / static_cast<A>(cols);
  const A r = A(1) / sqrtf(var + eps);
  if (lane == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
  T* o = out + row * cols;
  for (std::int64_t i = lane; i < cols; i += 32)
    o[i] = static_cast<T>((to_accumulate(x[i]) - m) * r * to_accumulate(weight[i]) + to_accumulate(bias[i]));
}

//! What layernorm's input-gradient change is added to: din's old value (accumulate), nothing
//! (overwrite), the residual, or both, in that order (the CPU kernel's). The fused kernel has it
//! compiled in: as a runtime choice it cost the bf16 kernel at C = 768 40 bytes of spills at its
//! 128 registers (ptxas, CUDA 13, sm_90a); compiled in, none of the four spills there.
enum class GradientBase : std::uint8_t { din, zero, residual, din_and_residual };

//! The base for a residual given or not and din accumulated or overwritten.
LOOM_HD constexpr GradientBase gradient_base_of(bool residual, bool accumulate) noexcept {
  if (!residual) return accumulate ? GradientBase::din : GradientBase::zero;
  return accumulate ? GradientBase::din_and_residual : GradientBase::residual;
}
//! Whether `base` reads din's old value.
LOOM_HD constexpr bool reads_din(GradientBase base) noexcept {
  return base == GradientBase::din || base == GradientBase::din_and_residual;
}
//! Whether `base` reads the residual.
LOOM_HD constexpr bool reads_residual(GradientBase base) noexcept {
  return base == GradientBase::residual || base == GradientBase::din_and_residual;
}

//! One element's base from din's old value and the residual's (each used only where `base` reads it).
template <class A, class T>
LOOM_HD inline A base_value(GradientBase base, T old, T residual) {
  switch (base) {
    case GradientBase::din: return to_accumulate(old);
    case GradientBase::zero: return A(0);
    case GradientBase::residual: return to_accumulate(residual);
    default: return to_accumulate(old) + to_accumulate(residual);
  }
}

//! One warp per row: din = base + (dnorm - mean(dnorm) - norm * mean(dnorm * norm)) * rstd with
//! norm = (x - mean) * rstd, dnorm = weight * dout and base as base_value gives it.
template <class T, class A = accumulate_t<T>>
__global__ void input_grad_kernel(T* din, const T* dout, const T* in, const T* weight, const A* mean,
                                  const A* rstd, std::int64_t rows, std::int64_t cols, const T* residual,
                                  GradientBase base) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t row =
      static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const T* x = in + row * cols;
  const T* g = dout + row * cols;
  const A m = mean[row], r = rstd[row];
  A sum_dnorm = 0, sum_dnorm_norm = 0;
  for (std::int64_t i = lane; i < cols; i += 32) {
    const A dnorm = to_accumulate(weight[i]) * to_accumulate(g[i]);
    sum_dnorm += dnorm;
    sum_dnorm_norm += dnorm * ((to_accumulate(x[i]) - m) * r);
  }
  const A a = cuda_kernels::warp_sum(sum_dnorm) / static_cast<A>(cols);
  const A c = cuda_kernels::warp_sum(sum_dnorm_norm) / static_cast<A>(cols);
  T* dx = din + row * cols;
  const T* res = reads_residual(base) ? residual + row * cols : nullptr;
  for (std::int64_t i = lane; i < cols; i += 32) {
    const A norm = (to_accumulate(x[i]) - m) * r;
    const A start = base_value<A>(base, reads_din(base) ? dx[i] : T{}, reads_residual(base) ? res[i] : T{});
    dx[i] = static_cast<T>(start + (to_accumulate(weight[i]) * to_accumulate(g[i]) - a - norm * c) * r);
  }
}

//! input_grad_kernel with each lane's part of the row held in registers: P 16-byte vectors of
//! x, dout and weight per lane (cols = 32 P elements-per-vector), all loaded before the sums, then
//! din read, updated and written a vector at a time. The scalar kernel issues a load, waits, and
//! issues the next (its stores may alias its loads): on an H100 it took 0.45 ms for [16384, 768]
//! bf16, 16 times its forward; here each row costs two round trips to memory.
template <class T, int P, class A = accumulate_t<T>>
__global__ void input_grad_vector_kernel(T* din, const T* dout, const T* in, const T* weight, const A* mean,
                                         const A* rstd, std::int64_t rows, std::int64_t cols, const T* residual,
                                         GradientBase base) {
  using V = cuda_kernels::Vector16<T>;
  constexpr int E = V::elements;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;
  const A m = mean[row], r = rstd[row];
  V x[P], g[P], w[P];
  for (int p = 0; p < P; ++p) {
    const std::int64_t at = static_cast<std::int64_t>(p * 32 + lane) * E;
    x[p] = *reinterpret_cast<const V*>(in + row * cols + at);
    g[p] = *reinterpret_cast<const V*>(dout + row * cols + at);
    w[p] = *reinterpret_cast<const V*>(weight + at);
  }
  A sum_dnorm = 0, sum_dnorm_norm = 0;
  for (int p = 0; p < P; ++p)
    for (int e = 0; e < E; ++e) {
      const A dnorm = to_accumulate(w[p].value[e]) * to_accumulate(g[p].value[e]);
      sum_dnorm += dnorm;
      sum_dnorm_norm += dnorm * ((to_accumulate(x[p].value[e]) - m) * r);
    }
  const A a = cuda_kernels::warp_sum(sum_dnorm) / static_cast<A>(cols);
  const A c = cuda_kernels::warp_sum(sum_dnorm_norm) / static_cast<A>(cols);
  for (int p = 0; p < P; ++p) {
    const std::int64_t at = row * cols + static_cast<std::int64_t>(p * 32 + lane) * E;
    V* dx = reinterpret_cast<V*>(din + at);
    const V d = reads_din(base) ? *dx : V{};
    const V rv = reads_residual(base) ? *reinterpret_cast<const V*>(residual + at) : V{};
    V out;
    for (int e = 0; e < E; ++e) {
      const A norm = (to_accumulate(x[p].value[e]) - m) * r;
      const A dnorm = to_accumulate(w[p].value[e]) * to_accumulate(g[p].value[e]);
      out.value[e] = static_cast<T>(base_value<A>(base, d.value[e], rv.value[e]) + (dnorm - a - norm * c) * r);
    }
    *dx = out;
  }
}

//! The vectors per lane input_grad_vector_kernel takes for `cols` columns of T with these
//! pointers (nulls ignored): 1..8, or 0 where it does not apply (cols not a multiple of 32
//! vectors, more than 8 per lane, or a pointer not 16-byte aligned).
template <class T>
int input_grad_vectors(std::int64_t cols, const void* const (&pointers)[5]) {
  constexpr std::int64_t row_vector = 32 * cuda_kernels::Vector16<T>::elements;
  if (cols % row_vector != 0 || cols / row_vector > 8) return 0;
  for (const void* p : pointers)
    if (!cuda_kernels::aligned16(p)) return 0;
  return static_cast<int>(cols / row_vector);
}

//! The fused backward's rows: each warp takes fused_rows_per_warp rows, a block fused_rows, fixed,
//! so that the parameter gradients' summation order is the shape's alone.
inline constexpr int fused_warps = cuda_kernels::warps_per_block;
inline constexpr int fused_threads = 32 * fused_warps;
inline constexpr int fused_rows_per_warp = 4;
inline constexpr int fused_rows = fused_warps * fused_rows_per_warp;
inline std::int64_t fused_blocks(std::int64_t rows) noexcept { return (rows + fused_rows - 1) / fused_rows; }

//! Whether the fused backward takes rows of P 16-byte vectors of T a lane: each lane holds its
//! row's x and dout (8 P registers) and 2 P E parameter-gradient sums, at most 80 of them (bf16 up
//! to 768 columns, float up to 640), so that two blocks fit an SM without spilling (128 registers
//! a thread: 128 on sm_90 for bf16 at 768 and float at 640; float at 768 spilled 76 bytes). Wider
//! rows take the two-pass backward.
template <class T>
constexpr bool fused_vectors(int p) noexcept {
  return p >= 1 && 8 * p + 2 * p * cuda_kernels::Vector16<T>::elements <= 80;
}
static_assert(fused_vectors<bf16>(3) && !fused_vectors<bf16>(4) && fused_vectors<float>(5) &&
                  !fused_vectors<float>(6),
              "layernorm_backward's launcher instantiates the fused kernel for 1 to 5 vectors a lane");

//! What the fused backward reads and writes: din, dout, in [rows, cols], weight [cols], mean and
//! rstd [rows], and the parameter-gradient partials [2][fused_blocks(rows)][cols] (dweight's,
//! then dbias's); the residual [rows, cols] or null, and whether din's old value is added (the
//! kernel has their GradientBase compiled in).
template <class T, class A = accumulate_t<T>>
struct BackwardArgs {
  T* din;
  const T* dout;
  const T* in;
  const T* weight;
  const A* mean;
  const A* rstd;
  A* partials;
  std::int64_t rows, cols;
  const T* residual = nullptr;
  bool accumulate = true;
};

//! Layernorm's backward in one pass over the rows (cols = 32 P E, every pointer 16-byte aligned):
//! warp w of block i takes rows fused_rows i + w + fused_warps r, r < fused_rows_per_warp, each
//! with input_grad_vector_kernel's arithmetic, and adds each row's parameter-
//! gradient terms, norm dout and dout, into its lanes' sums in row order. The warps then add their
//! sums into shared memory [2][cols] one warp after another, and the block writes them to its
//! partials; cuda_kernels::column_totals_block adds the blocks' partials in order. So dout and in
//! are read once for all three gradients, where the two-pass backward reads them again for the
//! parameter gradients (0.83 ms of a GPT-2 small step at batch 16 on an H200). Shared memory:
//! 2 cols A.
LOOM_BLOCK_BODY
template <class T, int P, GradientBase Base, class Thread, class A = accumulate_t<T>>
LOOM_HD void fused_backward_block(Thread& th, const BackwardArgs<T>& a) {
  using V = cuda_kernels::Vector16<T>;
  constexpr int E = V::elements;
  const int warp = th.thread() / 32, lane = th.thread() % 32;
  const std::int64_t cols = a.cols, first = th.block_x() * fused_rows;
  A dweight[P][E], dbias[P][E];
  LOOM_UNROLL
  for (int p = 0; p < P; ++p)
    LOOM_UNROLL
    for (int e = 0; e < E; ++e) dweight[p][e] = dbias[p][e] = A(0);
  LOOM_ROLLED
  for (int r = 0; r < fused_rows_per_warp; ++r) {
    const std::int64_t row = first + static_cast<std::int64_t>(r) * fused_warps + warp;
    if (row >= a.rows) break;  // the whole warp: the rows of a block ascend with r
    const A m = a.mean[row], rs = a.rstd[row];
    V x[P], g[P];
    LOOM_UNROLL
    for (int p = 0; p < P; ++p) {
      const std::int64_t at = row * cols + static_cast<std::int64_t>(p * 32 + lane) * E;
      x[p] = *reinterpret_cast<const V*>(a.in + at);
      g[p] = *reinterpret_cast<const V*>(a.dout + at);
    }
    // weight (in L1 after the first row) and din are loaded where they are used, not held: with
    // them in registers beside the sums, the bf16 kernel at C = 768 took 182 registers, one block
    // an SM.
    A sum_dnorm = 0, sum_dnorm_norm = 0;
    LOOM_UNROLL
    for (int p = 0; p < P; ++p) {
      const V w = *reinterpret_cast<const V*>(a.weight + static_cast<std::int64_t>(p * 32 + lane) * E);
      LOOM_UNROLL
      for (int e = 0; e < E; ++e) {
        const A dnorm = to_accumulate(w.value[e]) * to_accumulate(g[p].value[e]);
        sum_dnorm += dnorm;
        sum_dnorm_norm += dnorm * ((to_accumulate(x[p].value[e]) - m) * rs);
      }
    }
    const A mean_dnorm = cuda_kernels::warp_sum(th, sum_dnorm) / static_cast<A>(cols);
    const A mean_dnorm_norm = cuda_kernels::warp_sum(th, sum_dnorm_norm) / static_cast<A>(cols);
    LOOM_UNROLL
    for (int p = 0; p < P; ++p) {
      const std::int64_t column = static_cast<std::int64_t>(p * 32 + lane) * E;
      const V w = *reinterpret_cast<const V*>(a.weight + column);
      V* dx = reinterpret_cast<V*>(a.din + row * cols + column);
      V d{}, rv{};
      if constexpr (reads_din(Base)) d = *dx;
      if constexpr (reads_residual(Base)) rv = *reinterpret_cast<const V*>(a.residual + row * cols + column);
      LOOM_UNROLL
      for (int e = 0; e < E; ++e) {
        const A norm = (to_accumulate(x[p].value[e]) - m) * rs, gradient = to_accumulate(g[p].value[e]);
        const A dnorm = to_accumulate(w.value[e]) * gradient;
        const A change = (dnorm - mean_dnorm - norm * mean_dnorm_norm) * rs;
        d.value[e] = static_cast<T>(base_value<A>(Base, d.value[e], rv.value[e]) + change);
        dweight[p][e] += norm * gradient;
        dbias[p][e] += gradient;
      }
      *dx = d;
    }
  }
  A* sums = reinterpret_cast<A*>(th.shared());  // [2][cols]
  for (int turn = 0; turn < fused_warps; ++turn) {
    if (warp == turn) {
      LOOM_UNROLL
      for (int p = 0; p < P; ++p)
        LOOM_UNROLL
        for (int e = 0; e < E; ++e) {
          const std::int64_t j = static_cast<std::int64_t>(p * 32 + lane) * E + e;
          sums[j] = (turn == 0 ? A(0) : sums[j]) + dweight[p][e];
          sums[cols + j] = (turn == 0 ? A(0) : sums[cols + j]) + dbias[p][e];
        }
    }
    th.sync_block();
  }
  const std::int64_t blocks = fused_blocks(a.rows), block = th.block_x();
  for (std::int64_t i = th.thread(); i < 2 * cols; i += fused_threads)
    a.partials[(i / cols * blocks + block) * cols + i % cols] = sums[i];
}

//! Row n's terms of column j of the parameter gradients: (x - mean) * rstd * dout for dweight,
//! dout for dbias (cuda_kernels::add_column_sums adds them up).
template <class T, class A = accumulate_t<T>>
struct ParamGradTerms {
  const T* dout;
  const T* in;
  const A* mean;
  const A* rstd;
  std::int64_t cols;
  __device__ void operator()(std::int64_t n, std::int64_t j, A (&add)[2]) const {
    const A g = to_accumulate(dout[n * cols + j]);
    add[0] += (to_accumulate(in[n * cols + j]) - mean[n]) * rstd[n] * g;
    add[1] += g;
  }
};

//! fused_backward_block on the GPU: fused_threads threads, 2 cols A of dynamic shared memory.
template <class T, int P, GradientBase Base>
__global__ void __launch_bounds__(fused_threads, 2) fused_backward_kernel(BackwardArgs<T> a) {
  cuda_kernels::BlockThread th;
  fused_backward_block<T, P, Base>(th, a);
}

//! Runs `f.template operator()<Base>()` for a's GradientBase.
template <class T, class F>
void with_gradient_base(const BackwardArgs<T>& a, F&& f) {
  switch (gradient_base_of(a.residual != nullptr, a.accumulate)) {
    case GradientBase::din: f.template operator()<GradientBase::din>(); break;
    case GradientBase::zero: f.template operator()<GradientBase::zero>(); break;
    case GradientBase::residual: f.template operator()<GradientBase::residual>(); break;
    case GradientBase::din_and_residual: f.template operator()<GradientBase::din_and_residual>(); break;
  }
}

}  // namespace loom::detail::cuda_layernorm

namespace loom::inline kernels {

//! LayerNorm over the last axis C of `in` (N rows): mean[N], rstd[N] = 1/sqrt(biased variance +
//! eps), out = (in - mean) * rstd * weight + bias. `mean` and `rstd` hold N elements (any shape)
//! in the accumulate type (float for bf16 storage).
template <class T>
void layernorm_forward(const cuda& be, Tensor<T> out, Tensor<accumulate_t<T>> mean,
                       Tensor<accumulate_t<T>> rstd, Tensor<const T> in, Tensor<const T> weight,
                       Tensor<const T> bias, accumulate_t<T> eps = accumulate_t<T>(1e-5)) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  constexpr const char* kernel = "layernorm_forward";
  k::check_has_rows(in, kernel);
  const std::int64_t N = in.shape().rows(), C = in.shape().cols();
  k::check_rows(out, N, C, kernel, "out");
  check_numel(mean, N, kernel, "mean");
  check_numel(rstd, N, kernel, "rstd");
  check_shape(weight, Shape{C}, kernel, "weight");
  check_shape(bias, Shape{C}, kernel, "bias");
  if (N == 0) return;  // also when C == 0: a shape with a zero extent has no rows
  check_data(in, kernel, "in");

  k::activate(be);
  detail::cuda_layernorm::forward_kernel<<<k::row_blocks(N), 32 * k::warps_per_block, 0, be.stream()>>>(
      out.data(), mean.data(), rstd.data(), in.data(), weight.data(), bias.data(), N, C, eps);
  detail::cuda_check_launch("layernorm_forward");
}

//! Backward of layernorm_forward from its saved `mean` and `rstd`, accumulating: din += d in,
//! dweight += sum over rows of dout * normalized in, dbias += sum over rows of dout. `residual`
//! and `din_write` as on the CPU: din += residual + d in, or with GradientWrite::overwrite din =
//! (residual +) d in without reading din, summed in the accumulate type and rounded once.
//! `dweight` and `dbias` are of T or, for bf16, fp32 sums (G = float, GradientOf), stored unrounded.
template <class T, GradientOf<T> G = T>
void layernorm_backward(cuda& be, Tensor<T> din, Tensor<G> dweight, Tensor<G> dbias,
                        Tensor<const T> dout, Tensor<const T> in, Tensor<const T> weight,
                        Tensor<const accumulate_t<T>> mean, Tensor<const accumulate_t<T>> rstd,
                        Tensor<const T> residual = {}, GradientWrite din_write = GradientWrite::accumulate) {
  static_assert(detail::cuda_kernels::supported<T>, "loom: the cuda kernels take T = float or bf16");
  namespace k = detail::cuda_kernels;
  namespace d = detail::cuda_layernorm;
  constexpr const char* kernel = "layernorm_backward";
  k::check_has_rows(in, kernel);
  const std::int64_t N = in.shape().rows(), C = in.shape().cols();
  k::check_rows(din, N, C, kernel, "din");
  k::check_rows(dout, N, C, kernel, "dout");
  check_shape(dweight, Shape{C}, kernel, "dweight");
  check_shape(dbias, Shape{C}, kernel, "dbias");
  check_shape(weight, Shape{C}, kernel, "weight");
  check_numel(mean, N, kernel, "mean");
  check_numel(rstd, N, kernel, "rstd");
  if (!residual.empty()) detail::check_residual(residual, din, N, C, kernel, "din");
  if (N == 0 || C == 0) return;
  check_data(in, kernel, "in");
  k::check_column_sum_rows(N, kernel);

  k::activate(be);
  const T* res = residual.empty() ? nullptr : residual.data();
  const bool accumulate = din_write == GradientWrite::accumulate;
  const int vectors = d::input_grad_vectors<T>(C, {din.data(), dout.data(), in.data(), weight.data(), res});
  if (d::fused_vectors<T>(vectors)) {
    using A = accumulate_t<T>;
    // check_column_sum_rows above bounds N far below a grid's 2^31 - 1 blocks of fused_rows.
    const std::int64_t blocks = d::fused_blocks(N);
    // Returned to the cache while the stream may still use it: safe, as in attention_backward.
    const Buffer<A, cuda> partials(be, 2 * blocks * C, MemoryCategory::workspace);
    const d::BackwardArgs<T> args{din.data(), dout.data(), in.data(), weight.data(), mean.data(),
                                  rstd.data(), partials.data(), N, C, res, accumulate};
    const auto fused = [&]<int P>() {
      if constexpr (d::fused_vectors<T>(P)) {  // the widths this T never takes are not compiled
        d::with_gradient_base(args, [&]<d::GradientBase Base>() {
          d::fused_backward_kernel<T, P, Base>
              <<<static_cast<unsigned>(blocks), d::fused_threads, 2 * C * sizeof(A), be.stream()>>>(args);
        });
      }
    };
    switch (vectors) {
      case 1: fused.template operator()<1>(); break;
      case 2: fused.template operator()<2>(); break;
      case 3: fused.template operator()<3>(); break;
      case 4: fused.template operator()<4>(); break;
      default: fused.template operator()<5>(); break;
    }
    detail::cuda_check_launch("layernorm_backward fused_backward_kernel");
    k::add_column_totals(be, k::ColumnOutputs<G, 2>{{dweight.data(), dbias.data()}}, partials.data(), blocks, C,
                         "layernorm_backward parameter gradients");
    return;
  }
  const auto launch = [&](auto input_grad) {
    input_grad<<<k::row_blocks(N), 32 * k::warps_per_block, 0, be.stream()>>>(
        din.data(), dout.data(), in.data(), weight.data(), mean.data(), rstd.data(), N, C, res,
        d::gradient_base_of(res != nullptr, accumulate));
  };
  switch (vectors) {
    case 1: launch(d::input_grad_vector_kernel<T, 1>); break;
    case 2: launch(d::input_grad_vector_kernel<T, 2>); break;
    case 3: launch(d::input_grad_vector_kernel<T, 3>); break;
    case 4: launch(d::input_grad_vector_kernel<T, 4>); break;
    case 5: launch(d::input_grad_vector_kernel<T, 5>); break;
    case 6: launch(d::input_grad_vector_kernel<T, 6>); break;
    case 7: launch(d::input_grad_vector_kernel<T, 7>); break;
    case 8: launch(d::input_grad_vector_kernel<T, 8>); break;
    default: launch(d::input_grad_kernel<T>); break;
  }
  detail::cuda_check_launch("layernorm_backward input_grad_kernel");
  k::add_column_sums<2>(be, k::ColumnOutputs<G, 2>{{dweight.data(), dbias.data()}}, N, C,
                        d::ParamGradTerms<T>{dout.data(), in.data(), mean.data(), rstd.data(), C},
                        "layernorm_backward parameter gradients");
}

}  // namespace loom::inline kernels
