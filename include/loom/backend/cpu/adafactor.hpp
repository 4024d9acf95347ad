#pragma once
//! \file Adafactor's kernels on the CPU backend: the squared gradients summed per row and per
//! column of the whole tensor, the squared norm of the unclipped update, and the update itself.
//! Each takes one run of a rank's slice of a parameter and a WholeIndex that places its elements
//! in the whole tensor, so that tensor-parallel slices and ZeRO shards add into the statistics
//! of the tensor one rank would hold. The host side is loom::Adafactor (optim/adafactor.hpp).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"
#include "loom/core/whole_index.hpp"
#include "loom/optim/update_rules.hpp"

namespace loom::detail::adafactor {

//! Below this many elements a kernel stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 15;

//! Calls f(i, count, row, col) for stretches of run elements [begin, end) whose whole flat
//! indices are consecutive and, for a matrix, in one row: elements i .. i + count - 1 are at
//! (row, col .. col + count - 1). For a vector (cols = 1) a stretch is at rows row .. row +
//! count - 1 of column 0. So the kernels' inner loops run over contiguous memory and vectorise,
//! and the divisions happen once per stretch.
template <class F>
void for_each_stretch(const WholeIndex& w, std::int64_t begin, std::int64_t end, F&& f) {
  for (std::int64_t i = begin; i < end;) {
    const std::int64_t n = std::min(end - i, w.consecutive(i));
    const std::int64_t flat = w.flat(i);
    if (w.cols == 1) {
      f(i, n, flat, std::int64_t{0});
    } else {
      std::int64_t row = flat / w.cols, col = flat % w.cols;
      for (std::int64_t k = 0; k < n; ++row, col = 0) {
        const std::int64_t m = std::min(n - k, w.cols - col);
        f(i + k, m, row, col);
        k += m;
      }
    }
    i += n;
  }
}

//! Sum over k < n of term(k) (a double) in eight fixed lanes: vectorisable, with an order fixed
//! by the code.
template <class Term>
double lane_sum(std::int64_t n, Term&& term) {
  constexpr int lanes = 8;
  double acc[lanes] = {};
  std::int64_t k = 0;
  for (; k + lanes <= n; k += lanes)
    for (int l = 0; l < lanes; ++l) acc[l] += term(k + l);
  for (int l = 0; k < n; ++k, ++l) acc[l] += term(k);
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

//! The threads a kernel over n elements uses, and the bounds of part t of n.
inline int thread_parts(const cpu& be, std::int64_t n) {
  return n >= parallel_min_elements ? std::max(1, be.threads()) : 1;
}
inline std::int64_t part_begin(std::int64_t n, int parts, int t) { return n * t / parts; }

//! p = p · h.decay − h.step · g · row_scale[row] · col_scale[col] for each element, in the
//! accumulate type A; where `rounded` is given (bf16 parameters beside their fp32 master `p`),
//! each updated element is rounded into it.
template <class A, class G, class R>
void apply_range(const cpu& be, A* p, const G* g, R* rounded, std::int64_t n, const WholeIndex& index,
                 const A* row_scale, const A* col_scale, const AdafactorUpdate& h) {
  const A decay = static_cast<A>(h.decay), step = static_cast<A>(h.step);
  const int parts = thread_parts(be, n);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
  for (int t = 0; t < parts; ++t)
    for_each_stretch(index, part_begin(n, parts, t), part_begin(n, parts, t + 1),
                     [&](std::int64_t i, std::int64_t count, std::int64_t row, std::int64_t col) {
                       A* q = p + i;
                       const G* x = g + i;
                       // u = (g · row scale) · column scale, in this order on every path.
                       if (index.cols == 1) {
                         const A cs = col_scale[0];
                         for (std::int64_t k = 0; k < count; ++k)
                           q[k] = q[k] * decay - step * (to_accumulate(x[k]) * row_scale[row + k] * cs);
                       } else {
                         const A rs = row_scale[row];
                         const A* cs = col_scale + col;
                         for (std::int64_t k = 0; k < count; ++k)
                           q[k] = q[k] * decay - step * (to_accumulate(x[k]) * rs * cs[k]);
                       }
                       if constexpr (!std::is_same_v<R, A>)
                         for (std::int64_t k = 0; k < count; ++k) rounded[i + k] = static_cast<R>(q[k]);
                     });
}

}  // namespace loom::detail::adafactor

namespace loom::inline kernels {

//! Adds, for each element g of `grads` (a run of a slice of one parameter whose elements
//! `index` places in the whole tensor seen as [rows, index.cols]), g² in double to
//! row_sums[row] and to col_sums[col]. Each thread sums its contiguous part into its own
//! arrays, which are then added in thread order: the same bits for the same thread count.
template <class G>
void adafactor_square_sums(const cpu& be, Tensor<const G> grads, const WholeIndex& index, std::int64_t rows,
                           double* row_sums, double* col_sums) {
  namespace af = detail::adafactor;
  const std::int64_t n = grads.numel(), cols = index.cols;
  LOOM_CHECK(rows >= 0 && cols >= 1, "adafactor_square_sums: matrix view",
             detail::to_text(rows) + " x " + detail::to_text(cols), "needs rows >= 0 and cols >= 1");
  const G* g = grads.data();
  const int parts = af::thread_parts(be, n);
  std::vector<std::vector<double>> partial(static_cast<std::size_t>(parts));
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
  for (int t = 0; t < parts; ++t) {
    std::vector<double>& mine = partial[static_cast<std::size_t>(t)];
    mine.assign(static_cast<std::size_t>(rows + cols), 0.0);
    double* r = mine.data();
    double* c = r + rows;
    af::for_each_stretch(index, af::part_begin(n, parts, t), af::part_begin(n, parts, t + 1),
                         [&](std::int64_t i, std::int64_t count, std::int64_t row, std::int64_t col) {
                           const G* x = g + i;
                           if (cols == 1) {  // a vector: a row per element, one column
                             for (std::int64_t k = 0; k < count; ++k) {
                               const double v = static_cast<double>(to_accumulate(x[k]));
                               r[row + k] += v * v;
                             }
                             c[0] += af::lane_sum(count, [x](std::int64_t k) {
                               const double v = static_cast<double>(to_accumulate(x[k]));
                               return v * v;
                             });
                             return;
                           }
                           for (std::int64_t k = 0; k < count; ++k) {
                             const double v = static_cast<double>(to_accumulate(x[k]));
                             c[col + k] += v * v;
                           }
                           r[row] += af::lane_sum(count, [x](std::int64_t k) {
                             const double v = static_cast<double>(to_accumulate(x[k]));
                             return v * v;
                           });
                         });
  }
  for (const std::vector<double>& mine : partial) {
    for (std::int64_t k = 0; k < rows; ++k) row_sums[k] += mine[static_cast<std::size_t>(k)];
    for (std::int64_t k = 0; k < cols; ++k) col_sums[k] += mine[static_cast<std::size_t>(rows + k)];
  }
}

//! The sum, in double, of (g · row_scale[row] · col_scale[col])² over `grads`: the squared norm
//! of this run's part of Adafactor's update before clipping.
template <class G, class A>
double adafactor_update_square_sum(const cpu& be, Tensor<const G> grads, const WholeIndex& index,
                                   const A* row_scale, const A* col_scale) {
  namespace af = detail::adafactor;
  const std::int64_t n = grads.numel();
  const G* g = grads.data();
  const int parts = af::thread_parts(be, n);
  std::vector<double> partial(static_cast<std::size_t>(parts), 0.0);
#pragma omp parallel for num_threads(parts) schedule(static, 1) if (parts > 1)
  for (int t = 0; t < parts; ++t) {
    double sum = 0;
    af::for_each_stretch(index, af::part_begin(n, parts, t), af::part_begin(n, parts, t + 1),
                         [&](std::int64_t i, std::int64_t count, std::int64_t row, std::int64_t col) {
                           if (index.cols == 1) {
                             // u = (g r[row + k]) c[0]: the row scales vary, the column's is one.
                             for (std::int64_t k = 0; k < count; ++k) {
                               const A u = to_accumulate(g[i + k]) * row_scale[row + k] * col_scale[0];
                               sum += static_cast<double>(u) * static_cast<double>(u);
                             }
                           } else {
                             const G* x = g + i;
                             const A rs = row_scale[row];
                             const A* cs = col_scale + col;
                             sum += af::lane_sum(count, [x, rs, cs](std::int64_t k) {
                               const A u = to_accumulate(x[k]) * rs * cs[k];
                               return static_cast<double>(u) * static_cast<double>(u);
                             });
                           }
                         });
    partial[static_cast<std::size_t>(t)] = sum;
  }
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

//! One Adafactor update of a run of float or double parameters (see detail::adafactor::apply_range).
template <class T>
void adafactor_update(const cpu& be, Tensor<T> params, Tensor<const T> grads, const WholeIndex& index,
                      const T* row_scale, const T* col_scale, const AdafactorUpdate& h) {
  static_assert(!is_narrow_storage<T>,
                "loom: adafactor_update on bf16 parameters steps their fp32 master weights: call the "
                "overload that takes `master`");
  check_numel(grads, params.numel(), "adafactor_update", "grads");
  detail::adafactor::apply_range<T, T, T>(be, params.data(), grads.data(), nullptr, params.numel(), index,
                                          row_scale, col_scale, h);
}

//! One Adafactor update of a run of bf16 parameters through their fp32 master weights, from
//! gradients of storage type G (the parameters' type, or fp32: TrainerOptions::fp32_gradients);
//! params = master rounded once.
template <class T, class G>
  requires is_narrow_storage<T>
void adafactor_update(const cpu& be, Tensor<T> params, Tensor<const G> grads, Tensor<accumulate_t<T>> master,
                      const WholeIndex& index, const accumulate_t<T>* row_scale, const accumulate_t<T>* col_scale,
                      const AdafactorUpdate& h) {
  check_numel(grads, params.numel(), "adafactor_update", "grads");
  check_numel(master, params.numel(), "adafactor_update", "master");
  detail::adafactor::apply_range<accumulate_t<T>, G, T>(be, master.data(), grads.data(), params.data(),
                                                        params.numel(), index, row_scale, col_scale, h);
}

}  // namespace loom::inline kernels
