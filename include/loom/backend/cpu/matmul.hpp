#pragma once
//! \file Fully connected layer (matmul with bias) on the CPU backend: Eigen GEMMs over row-major
//! maps of the flat tensors, using this rank's threads.

#include <Eigen/Core>

#include <algorithm>
#include <cstdint>
#include <string>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/backend/detail/shape_checks.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail::matmul {

template <class T>
using RowMajor = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class T>
using Matrix = Eigen::Map<RowMajor<T>>;
template <class T>
using ConstMatrix = Eigen::Map<const RowMajor<T>>;

//! The shared check (backend/detail/shape_checks.hpp): `t` seen as a matrix is [rows, cols].
template <class T>
void check_matrix(const Tensor<T>& t, std::int64_t rows, std::int64_t cols, const char* kernel, const char* arg) {
  check_rows(t, rows, cols, kernel, arg);
}

struct Dims {
  std::int64_t rows, in_features, out_features;
};

//! N (rows of `in`), C (its last extent) and OC (rows of `weight`, which must be [OC, C]).
template <class T>
Dims dims(const Tensor<const T>& in, const Tensor<const T>& weight, const char* kernel) {
  if (in.shape().rank() == 0)
    throw Error(std::string(kernel) + ": argument in shape", in.shape(), "expected rank >= 1");
  const std::int64_t N = in.shape().rows(), C = in.shape().cols();
  if (weight.shape().rank() != 2)
    throw Error(std::string(kernel) + ": argument weight shape", weight.shape(),
                "expected [OC, C = " + detail::to_text(C) + "]");
  check_shape(weight, Shape{weight.extent(0), C}, kernel, "weight");
  return {N, C, weight.extent(0)};
}

//! Columns per task of the bias-gradient sum: every column is summed over all rows by one
//! thread in row order, so the result does not depend on the thread count.
inline constexpr std::int64_t bias_block = 64;

}  // namespace loom::detail::matmul

namespace loom::inline kernels {

//! out[N,OC] = in[N,C] · weight[OC,C]^T + bias[OC] with N = in's rows, C = in's last extent;
//! `in` and `out` may carry leading axes ([B,T,C] → [B,T,OC]). An empty `bias` means no bias.
template <class T>
void matmul_forward(const cpu& be, Tensor<T> out, Tensor<const T> in, Tensor<const T> weight,
                    Tensor<const T> bias) {
  namespace d = detail::matmul;
  constexpr const char* kernel = "matmul_forward";
  // Plain variables, not structured bindings: OpenMP regions below must capture them.
  const d::Dims dims = d::dims(in, weight, kernel);
  const std::int64_t N = dims.rows, C = dims.in_features, OC = dims.out_features;
  d::check_matrix(out, N, OC, kernel, "out");
  if (!bias.empty()) check_shape(bias, Shape{OC}, kernel, "bias");
  if (N == 0 || OC == 0) return;

  d::Matrix<T> o(out.data(), N, OC);
  be.bind_gemm_threads();
  if (bias.empty()) {
    if (C == 0) {
      o.setZero();
      return;
    }
    // No bias: the GEMM writes the output directly (no zero-fill pass over N·OC elements).
    o.noalias() = d::ConstMatrix<T>(in.data(), N, C) * d::ConstMatrix<T>(weight.data(), OC, C).transpose();
    return;
  }
  // The bias rows are written by all threads, then the GEMM accumulates onto them.
  const T* b = bias.data();
  T* po = out.data();
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (N * OC >= (1 << 16))
  for (std::int64_t n = 0; n < N; ++n) std::copy(b, b + OC, po + n * OC);
  if (C == 0) return;
  o.noalias() += d::ConstMatrix<T>(in.data(), N, C) * d::ConstMatrix<T>(weight.data(), OC, C).transpose();
}

//! Backward of matmul_forward, accumulating: din[N,C] += dout·weight, dweight[OC,C] +=
//! dout^T·in, dbias[OC] += column sums of dout. `din`, `dweight` and `dbias` may each be empty
//! (skipped): an empty `dweight` and `dbias` give the input-gradient pass of a split backward, an
//! empty `din` its weight-gradient pass; the two calls together compute the same bits as one.
template <class T>
void matmul_backward(const cpu& be, Tensor<T> din, Tensor<T> dweight, Tensor<T> dbias,
                     Tensor<const T> dout, Tensor<const T> in, Tensor<const T> weight) {
  namespace d = detail::matmul;
  constexpr const char* kernel = "matmul_backward";
  // Plain variables, not structured bindings: OpenMP regions below must capture them.
  const d::Dims dims = d::dims(in, weight, kernel);
  const std::int64_t N = dims.rows, C = dims.in_features, OC = dims.out_features;
  d::check_matrix(dout, N, OC, kernel, "dout");
  if (!dweight.empty()) check_shape(dweight, Shape{OC, C}, kernel, "dweight");
  if (!din.empty()) d::check_matrix(din, N, C, kernel, "din");
  if (!dbias.empty()) check_shape(dbias, Shape{OC}, kernel, "dbias");
  if (N == 0 || OC == 0) return;

  const d::ConstMatrix<T> g(dout.data(), N, OC);
  be.bind_gemm_threads();
  if (C > 0) {
    const d::ConstMatrix<T> x(in.data(), N, C), w(weight.data(), OC, C);
    if (!din.empty()) d::Matrix<T>(din.data(), N, C).noalias() += g * w;
    if (!dweight.empty()) d::Matrix<T>(dweight.data(), OC, C).noalias() += g.transpose() * x;
  }
  if (!dbias.empty()) {
    const T* gd = dout.data();
    T* db = dbias.data();
    const std::int64_t blocks = (OC + d::bias_block - 1) / d::bias_block;
#pragma omp parallel for num_threads(be.threads()) schedule(static) if (blocks > 1 && N * OC >= (1 << 15))
    for (std::int64_t blk = 0; blk < blocks; ++blk) {
      const std::int64_t j0 = blk * d::bias_block, j1 = std::min(OC, j0 + d::bias_block);
      for (std::int64_t n = 0; n < N; ++n) {
        const T* row = gd + n * OC;
        for (std::int64_t j = j0; j < j1; ++j) db[j] += row[j];
      }
    }
  }
}

}  // namespace loom::inline kernels
