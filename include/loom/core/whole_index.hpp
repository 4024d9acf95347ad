#pragma once
//! \file WholeIndex: where the elements of a run of one rank's slice of a parameter lie in the
//! whole (tensor-parallel global) tensor, as a small value kernels on any backend can evaluate.
//! ParameterSpec::global_index answers the same question on the host; this is its device-side
//! form, for kernels that gather statistics of the whole tensor (Adafactor's row and column sums).
//! loom::whole_index(spec, first) (parameters.hpp) builds one.

#include <cstdint>

#include "loom/core/hd.hpp"
#include "loom/core/tensor.hpp"

namespace loom {

//! Maps element i of a run that starts at flat element `first` of a rank's slice to its flat
//! index in the whole tensor, and that to a (row, column) of the whole tensor seen as a
//! [rows, cols] matrix, cols being the last extent (a vector is [n, 1]).
struct WholeIndex {
  enum Kind : int { whole = 0, split_rows = 1, split_cols = 2 };
  int kind = whole;
  std::int64_t first = 0;  //!< the slice's flat index of the run's element 0
  //! split_rows: elements per slice row of axis 0 (the same in the whole tensor);
  //! split_cols: the slice's columns.
  std::int64_t local_inner = 1;
  std::int64_t whole_cols = 1;  //!< split_cols: the whole tensor's columns
  //! The split axis: whole extent / groups (one block), block / ranks (one piece), this rank's piece.
  std::int64_t block = 1, piece = 1, rank = 0;
  std::int64_t cols = 1;  //!< columns of the [rows, cols] matrix view of the whole tensor

  //! The whole tensor's flat index of run element `i`.
  LOOM_HD std::int64_t flat(std::int64_t i) const noexcept {
    const std::int64_t local = first + i;
    if (kind == split_rows)
      return split_axis(local / local_inner) * local_inner + local % local_inner;
    if (kind == split_cols) return local / local_inner * whole_cols + split_axis(local % local_inner);
    return local;
  }
  LOOM_HD std::int64_t row(std::int64_t i) const noexcept { return flat(i) / cols; }
  LOOM_HD std::int64_t col(std::int64_t i) const noexcept { return flat(i) % cols; }
  //! How many elements from run element `i` on (it included) lie at consecutive flat indices of
  //! the whole tensor: up to the end of the slice's piece of the split axis, unbounded when whole.
  LOOM_HD std::int64_t consecutive(std::int64_t i) const noexcept {
    const std::int64_t local = first + i;
    if (kind == split_rows) return (piece - local / local_inner % piece) * local_inner - local % local_inner;
    if (kind == split_cols) return piece - local % local_inner % piece;
    return INT64_MAX;
  }

 private:
  LOOM_HD std::int64_t split_axis(std::int64_t local) const noexcept {
    return local / piece * block + rank * piece + local % piece;
  }
};

//! The matrix view of a whole shape: [numel / last extent, last extent] for rank >= 2, [n, 1]
//! for a vector (and [1, 1] for a scalar).
struct MatrixView {
  std::int64_t rows = 1, cols = 1;
  bool matrix = false;  //!< rank >= 2 (a factored second moment); vectors keep one per element
};

inline MatrixView matrix_view(const Shape& whole) {
  if (whole.rank() >= 2) {
    const std::int64_t cols = whole[whole.rank() - 1];
    return {cols == 0 ? 0 : whole.numel() / cols, cols, true};
  }
  return {whole.numel(), 1, false};
}

}  // namespace loom
