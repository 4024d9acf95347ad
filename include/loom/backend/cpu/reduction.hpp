#pragma once
//! \file Reductions on the CPU backend: the sum and the sum of squares in double (losses, the
//! global L2 norm) and scaling in place.

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::reduction {

//! Elements per partial sum. Chunks do not depend on the thread count and their partials are
//! added in order, so the sum is the same bits on any number of threads.
inline constexpr std::int64_t chunk = 1 << 14;
//! Below this many elements a kernel stays on the calling thread.
inline constexpr std::int64_t parallel_min_elements = 1 << 15;

//! Sum of x[i] (of x[i]^2 when `Square`) in double over eight fixed lanes (vectorisable, order
//! fixed by the code).
template <bool Square, class T>
double sum_serial(const T* x, std::int64_t n) {
  constexpr int lanes = 8;
  double acc[lanes] = {};
  std::int64_t i = 0;
  for (; i + lanes <= n; i += lanes)
    for (int k = 0; k < lanes; ++k) {
      const double value = static_cast<double>(to_accumulate(x[i + k]));
      acc[k] += Square ? value * value : value;
    }
  for (int k = 0; i < n; ++i, ++k) {
    const double value = static_cast<double>(to_accumulate(x[i]));
    acc[k] += Square ? value * value : value;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

//! sum_serial over fixed chunks in parallel, the chunks' partials added in order.
template <bool Square, class T>
double sum_chunked(const cpu& be, Tensor<const T> x) {
  if (x.empty()) return 0.0;  // Tensor<T>{} has no data (its rank-0 shape counts one element)
  const std::int64_t n = x.numel();
  const std::int64_t chunks = (n + chunk - 1) / chunk;
  if (chunks == 1) return sum_serial<Square>(x.data(), n);
  std::vector<double> partial(static_cast<std::size_t>(chunks));
  const T* data = x.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (n >= parallel_min_elements)
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t begin = c * chunk;
    partial[static_cast<std::size_t>(c)] = sum_serial<Square>(data + begin, std::min(chunk, n - begin));
  }
  double total = 0;
  for (double p : partial) total += p;
  return total;
}

}  // namespace loom::detail::reduction

namespace loom::inline kernels {

//! Sum of the squares of `x`, accumulated in double; the global L2 norm is the square root of
//! the sum over all ranges. Deterministic for any thread count; an empty tensor gives 0.
template <class T>
double sum_of_squares(const cpu& be, Tensor<const T> x) {
  return detail::reduction::sum_chunked<true>(be, x);
}

//! The sum of squares of several tensors, added in order (the gradient norm's ranges): the same
//! bits as adding sum_of_squares of each.
template <class T>
double sum_of_squares(const cpu& be, std::span<const Tensor<const T>> parts) {
  double total = 0;
  for (const Tensor<const T>& x : parts) total += sum_of_squares<T>(be, x);
  return total;
}

//! Sum of the elements of `x` (a micro-batch's per-token losses), accumulated in double;
//! deterministic for any thread count. An empty tensor gives 0.
template <class T>
double sum_elements(const cpu& be, Tensor<const T> x) {
  return detail::reduction::sum_chunked<false>(be, x);
}

//! x *= factor (the factor rounded to T's accumulate type once; bf16 elements are multiplied in
//! float and rounded once). An empty tensor is left alone.
template <class T>
void scale(const cpu& be, Tensor<T> x, double factor) {
  if (x.empty()) return;
  const std::int64_t n = x.numel();
  const accumulate_t<T> f = static_cast<accumulate_t<T>>(factor);
  T* data = x.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) \
    if (n >= detail::reduction::parallel_min_elements)
  for (std::int64_t i = 0; i < n; ++i) data[i] = static_cast<T>(to_accumulate(data[i]) * f);
}

}  // namespace loom::inline kernels
