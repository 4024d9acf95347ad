#pragma once
//! \file Checked CUDA runtime and cuBLAS calls: every failure becomes a loom::Error naming the call and
//! CUDA's own words for what went wrong.

#include <cublas_api.h>
#include <cuda_runtime_api.h>

#include <string>

#include "loom/core/error.hpp"

namespace loom::detail {

//! Throws loom::Error "<call>: got <cudaErrorName>; <cudaGetErrorString>" unless `status` is
//! cudaSuccess. Clears CUDA's sticky last error for non-sticky failures, so the next call on the
//! rank does not report this one again.
inline void cuda_check(cudaError_t status, const char* call) {
  if (status == cudaSuccess) [[likely]]
    return;
  (void)cudaGetLastError();
  throw Error(call, cudaGetErrorName(status), cudaGetErrorString(status));
}

//! After a kernel launch: a bad launch configuration (or an earlier asynchronous fault) becomes
//! a loom::Error naming `kernel`.
inline void cuda_check_launch(const char* kernel) {
  cuda_check(cudaGetLastError(), (std::string("launch of ") + kernel).c_str());
}

//! Throws loom::Error "<call>: got <status name>; <status description>" unless `status` is
//! CUBLAS_STATUS_SUCCESS.
inline void cublas_check(cublasStatus_t status, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) [[likely]]
    return;
  throw Error(call, cublasGetStatusName(status), cublasGetStatusString(status));
}

}  // namespace loom::detail

//! Checks a cuBLAS call, naming it as written: LOOM_CUBLAS_CHECK(cublasCreate(&handle)).
#define LOOM_CUBLAS_CHECK(call) ::loom::detail::cublas_check((call), #call)

//! Checks a CUDA runtime call, naming it as written: LOOM_CUDA_CHECK(cudaMalloc(&p, n)).
#define LOOM_CUDA_CHECK(call) ::loom::detail::cuda_check((call), #call)
