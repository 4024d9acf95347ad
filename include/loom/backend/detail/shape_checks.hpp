#pragma once
//! \file Shape checks every backend's kernels share (host code only), so that a kernel rejects
//! a bad argument with the same words on the CPU and on the GPU.

#include <cstdint>
#include <string>

#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail {

//! Checks that `t`, seen as a matrix (all axes but the last are rows), is [rows, cols]; leading
//! axes may differ (an [N, OC] output for a [B, T, C] input is fine).
template <class T>
void check_rows(const Tensor<T>& t, std::int64_t rows, std::int64_t cols, const char* kernel, const char* arg) {
  if (t.shape().rank() == 0 || t.shape().rows() != rows || t.shape().cols() != cols) [[unlikely]]
    throw Error(std::string(kernel) + ": argument " + arg + " shape", to_text(t.shape()),
                "expected " + to_text(rows) + " rows of " + to_text(cols) + " (all axes but the last are rows)");
}

//! Checks a kernel's `residual` (matmul_forward's, layernorm_backward's): [rows, cols] as its
//! output `out` (called `out_name`) is, and not that tensor itself (the sum is written over it).
template <class T>
void check_residual(const Tensor<const T>& residual, const Tensor<T>& out, std::int64_t rows, std::int64_t cols,
                    const char* kernel, const char* out_name = "out") {
  check_rows(residual, rows, cols, kernel, "residual");
  if (residual.data() == out.data()) [[unlikely]]
    throw Error(std::string(kernel) + ": argument residual", std::string(out_name) + " itself",
                std::string("a tensor other than ") + out_name + " (the sum is written over " + out_name + ")");
}

}  // namespace loom::detail
