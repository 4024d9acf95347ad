#pragma once
//! \file Eigen array views of flat ranges, shared by the element-wise CPU kernels.

#include <Eigen/Core>

namespace loom::detail {

//! `n` contiguous elements seen as an Eigen column array (vectorised element-wise math).
template <class T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
//! The read-only view.
template <class T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

}  // namespace loom::detail
