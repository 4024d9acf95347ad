#pragma once
//! \file Fixed-order double accumulation shared by the CPU kernels (results do not depend on the
//! thread count).

#include <cstdint>

namespace loom::detail {

//! sum_i x[i] accumulated in double, in a fixed order (four interleaved partial sums).
template <class T>
double sum_as_double(const T* x, std::int64_t n) noexcept {
  double acc[4] = {0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 4 <= n; i += 4)
    for (int k = 0; k < 4; ++k) acc[k] += static_cast<double>(x[i + k]);
  for (; i < n; ++i) acc[0] += static_cast<double>(x[i]);
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

}  // namespace loom::detail
