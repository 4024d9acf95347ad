#pragma once
//! \file A caching allocator for device memory on one stream, in the manner of PyTorch's:
//! freed blocks are kept by size class and handed out again, so a training step that frees and
//! reallocates the same buffers as the last one calls into CUDA not at all.

#include <cuda_runtime_api.h>

#include <cstddef>
#include <unordered_map>
#include <vector>

#include "loom/backend/cuda/error.hpp"

namespace loom::detail {

//! Device memory for one stream. Blocks are rounded to a size class (512 B steps up to 1 MiB,
//! 2 MiB steps above) and cached when freed. A cached block is reused only on the same stream,
//! so stream order makes the reuse safe without events (the rank's work is on its one stream).
//! When CUDA runs out of memory the cache is released and the allocation tried once more.
class CachingAllocator {
 public:
  CachingAllocator(int device, cudaStream_t stream) : stream_(stream) {
    int pools = 0;
    LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device));
    stream_ordered_ = pools != 0;
  }
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;
  ~CachingAllocator() {
    // Everything handed out should be back; what is not is freed with the rest.
    for (auto& [p, size] : live_) (void)free_block(p);
    live_.clear();
    release_cache();
  }

  //! The size class of a request of `bytes`.
  static std::size_t size_class(std::size_t bytes) noexcept {
    constexpr std::size_t small = 512, large = std::size_t{2} << 20, small_limit = std::size_t{1} << 20;
    if (bytes == 0) return small;
    if (bytes <= small_limit) return (bytes + small - 1) / small * small;
    return (bytes + large - 1) / large * large;
  }

  //! A block of at least `bytes` (device memory, 256-byte aligned at least), or null when CUDA
  //! is out of memory even after the cache was given back (the caller says what was held).
  void* allocate(std::size_t bytes) {
    const std::size_t size = size_class(bytes);
    if (auto it = cache_.find(size); it != cache_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      cached_ -= size;
      live_.emplace(p, size);
      return p;
    }
    void* p = nullptr;
    cudaError_t status = raw_allocate(&p, size);
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      release_cache();
      status = raw_allocate(&p, size);
    }
    if (status == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      return nullptr;
    }
    cuda_check(status, stream_ordered_ ? "cudaMallocAsync" : "cudaMalloc");
    reserved_ += size;
    live_.emplace(p, size);
    return p;
  }

  //! Takes `p` back into the cache (it may be reused by later work on the stream at once).
  void deallocate(void* p) noexcept {
    auto it = live_.find(p);
    if (it == live_.end()) return;
    cache_[it->second].push_back(p);
    cached_ += it->second;
    live_.erase(it);
  }

  //! Gives every cached block back to CUDA.
  void release_cache() noexcept {
    for (auto& [size, blocks] : cache_)
      for (void* p : blocks)
        if (free_block(p) == cudaSuccess) reserved_ -= size;
    cache_.clear();
    cached_ = 0;
  }

  //! Bytes obtained from CUDA and not given back (in use or cached).
  std::size_t reserved_bytes() const noexcept { return reserved_; }
  //! Bytes cached for reuse.
  std::size_t cached_bytes() const noexcept { return cached_; }

 private:
  cudaError_t raw_allocate(void** p, std::size_t size) {
    return stream_ordered_ ? cudaMallocAsync(p, size, stream_) : cudaMalloc(p, size);
  }
  cudaError_t free_block(void* p) noexcept { return stream_ordered_ ? cudaFreeAsync(p, stream_) : cudaFree(p); }

  cudaStream_t stream_;
  bool stream_ordered_ = false;
  std::unordered_map<void*, std::size_t> live_;
  std::unordered_map<std::size_t, std::vector<void*>> cache_;
  std::size_t reserved_ = 0, cached_ = 0;
};

}  // namespace loom::detail
