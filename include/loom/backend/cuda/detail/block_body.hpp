#pragma once
//! \file Kernel bodies that run on the GPU and, in the tests, on the host. Such a body is a
//! LOOM_HD template over a `Thread` type that supplies the thread and block indices, the block's
//! shared memory and barrier, and the lane exchange: on the GPU a thin wrapper of threadIdx,
//! __syncthreads and __shfl_xor_sync (cuda_kernels::BlockThread, flash::DeviceThread); in the
//! tests every thread of a block is a fiber on the host (tests/cuda/host_block.hpp), so the indexing,
//! the barriers and the reductions are checked where there is no GPU.

#include <cstdint>

#include "loom/core/hd.hpp"

// Instantiated with the tests' host Thread, a body's device side must not be checked (nvcc's
// exec check would warn that a host function is called from host-device code, though that
// instantiation never runs on a device).
#if defined(__CUDACC__)
#define LOOM_BLOCK_BODY _Pragma("nv_exec_check_disable")
#else
#define LOOM_BLOCK_BODY
#endif
// Loops over register arrays must be unrolled on the device: an array indexed by a loop variable
// that is not a compile-time constant lives in local memory. (The host compiler does not know the
// pragma.) LOOM_ROLLED keeps a loop rolled where unrolling would only add registers.
#if defined(__CUDA_ARCH__)
#define LOOM_UNROLL _Pragma("unroll")
#define LOOM_ROLLED _Pragma("unroll 1")
#else
#define LOOM_UNROLL
#define LOOM_ROLLED
#endif

namespace loom::detail::cuda_kernels {

//! The butterfly sum of `value` over the 32 lanes of the calling thread's warp: every lane gets
//! the same bits (cuda_kernels::warp_sum's order).
LOOM_BLOCK_BODY
template <class Thread, class A>
LOOM_HD inline A warp_sum(const Thread& th, A value) {
  for (int mask = 16; mask > 0; mask /= 2) value += th.shuffle_xor(value, mask);
  return value;
}

#if defined(__CUDACC__)

//! The GPU's Thread: a thread of a one-dimensional block, and the launch's dynamic shared memory.
struct BlockThread {
  __device__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ std::int64_t block_x() const { return blockIdx.x; }
  __device__ std::int64_t block_y() const { return blockIdx.y; }
  __device__ unsigned char* shared() const {
    extern __shared__ __align__(16) unsigned char block_shared[];
    return block_shared;
  }
  __device__ void sync_block() const { __syncthreads(); }
  __device__ float shuffle_xor(float value, int mask) const { return __shfl_xor_sync(0xffffffffu, value, mask); }
  __device__ double shuffle_xor(double value, int mask) const { return __shfl_xor_sync(0xffffffffu, value, mask); }
};

#endif  // __CUDACC__

}  // namespace loom::detail::cuda_kernels
