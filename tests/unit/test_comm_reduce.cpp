// The communicators' element-wise reductions (comm/detail/reduce.hpp) against scalar references:
// reduce() over several sources in their fixed order, and reduce_into(), the pairwise fold of the
// MPI ring's steps and of MPI's user-defined bf16 operations, for every type and operation, over
// lengths around the blocks reduce() works in.

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "loom/comm/detail/reduce.hpp"
#include "loom/core/bf16.hpp"
#include "support/gradcheck.hpp"

namespace test_comm_reduce {

using namespace loom;

namespace {

//! A value of source `s` at `i` with a fraction that does not round away in T, signs mixed, so
//! that max and the sums' rounding are both exercised.
template <class T>
T source_value(int s, std::size_t i) {
  const double v = static_cast<double>((static_cast<int>(i) * 7 + s * 13) % 29 - 14) * 0.37 + 0.001 * s;
  if constexpr (std::is_same_v<T, bf16>) return bf16(static_cast<float>(v));
  else return static_cast<T>(v);
}

// Lengths: empty, one, odd, and either side of reduce()'s blocks (16 KiB of the accumulate type:
// 4096 floats or bf16 values, 2048 doubles).
const std::vector<std::size_t> lengths = {0, 1, 3, 17, 2047, 2048, 2049, 4095, 4096, 4097, 8193, 12289};

}  // namespace

TEST_CASE_TEMPLATE("reduce_into folds one array into another in place, for every operation", T, float, double, bf16) {
  using A = accumulate_t<T>;
  for (const ReduceOp op : {ReduceOp::sum, ReduceOp::average, ReduceOp::max})
    for (const std::size_t n : lengths) {
      CAPTURE(static_cast<int>(op));
      CAPTURE(n);
      std::vector<T> inout(n + 1), input(n + 1);
      for (std::size_t i = 0; i <= n; ++i) {
        inout[i] = source_value<T>(0, i);
        input[i] = source_value<T>(1, i);
      }
      // average folds like sum (the division comes later, from divide()); one rounding to T. The
      // element past the count must not change.
      std::vector<T> want(inout);
      for (std::size_t i = 0; i < n; ++i) {
        const A a = static_cast<A>(inout[i]), b = static_cast<A>(input[i]);
        want[i] = T(op == ReduceOp::max ? (a < b ? b : a) : a + b);
      }
      detail::reduce_into(dtype_of<T>, op, inout.data(), input.data(), n);
      CHECK(test::same_bits(inout, want));
    }
}

TEST_CASE_TEMPLATE("reduce folds the sources in order, rounds once, divides an average, and may write in place", T,
                   float, double, bf16) {
  using A = accumulate_t<T>;
  for (const int sources : {1, 2, 5})
    for (const ReduceOp op : {ReduceOp::sum, ReduceOp::average, ReduceOp::max})
      for (const std::size_t n : lengths) {
        CAPTURE(sources);
        CAPTURE(static_cast<int>(op));
        CAPTURE(n);
        std::vector<std::vector<T>> data(static_cast<std::size_t>(sources), std::vector<T>(n));
        for (int s = 0; s < sources; ++s)
          for (std::size_t i = 0; i < n; ++i) data[static_cast<std::size_t>(s)][i] = source_value<T>(s, i);
        std::vector<const void*> from;
        for (const auto& d : data) from.push_back(d.data());
        std::vector<T> copy(n);
        // Results into source 0 (in place) and into a separate array.
        void* into[2] = {data[0].data(), copy.data()};
        detail::reduce(dtype_of<T>, op, from.data(), sources, into, 2, n, sources);
        std::vector<T> want(n);
        for (std::size_t i = 0; i < n; ++i) {
          A sum = static_cast<A>(source_value<T>(0, i));
          for (int s = 1; s < sources; ++s) {
            const A v = static_cast<A>(source_value<T>(s, i));
            sum = op == ReduceOp::max ? (sum < v ? v : sum) : sum + v;
          }
          if (op == ReduceOp::average) sum /= static_cast<A>(sources);
          want[i] = T(sum);
        }
        CHECK(test::same_bits(data[0], want));
        CHECK(test::same_bits(copy, want));
      }
}

}  // namespace test_comm_reduce
