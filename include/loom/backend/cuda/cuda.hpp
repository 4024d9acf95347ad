#pragma once
//! \file The CUDA backend: one GPU and one stream per rank, device memory through a caching
//! allocator with the same per-category accounting as the CPU backend, every CUDA call checked.

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "loom/backend/concepts.hpp"
#include "loom/backend/cuda/caching_allocator.hpp"
#include "loom/backend/cuda/detail/communication_stream.hpp"
#include "loom/backend/cuda/detail/lt_gemms.hpp"
#include "loom/backend/cuda/error.hpp"
#include "loom/core/error.hpp"
#include "loom/core/memory.hpp"

namespace loom {

//! The CUDA backend. A value per rank: its device, its stream (all of the rank's kernels and
//! copies are ordered on it), a second stream for its NCCL calls (communication_stream), its
//! memory and the accounting of it. Host calls that return data (copy_to_host, synchronize)
//! wait for the stream, checking the communication in flight meanwhile (watch), so a collective
//! that never completes fails the wait instead of hanging it.
class cuda {
 public:
  using loom_backend = void;
  //! The host cannot read this backend's memory (host_addressable<cuda> is false).
  static constexpr bool device_memory = true;

  //! GPUs this process can use; 0 when there is none or no driver (never throws).
  static int device_count() noexcept {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return n;
  }

  //! The rank's backend on GPU `device`, with a stream of its own.
  explicit cuda(int device = 0) : device_(check_device(device)) {
    LOOM_CUDA_CHECK(cudaSetDevice(device_));
    LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    allocator_ = std::make_unique<detail::CachingAllocator>(device_, stream_);
  }
  cuda(const cuda&) = delete;
  cuda& operator=(const cuda&) = delete;
  ~cuda() {
    (void)cudaSetDevice(device_);
    communication_.reset();  // waits for the communication issued on it
    (void)cudaStreamSynchronize(stream_);
    if (cublas_ != nullptr) (void)cublasDestroy(cublas_);
    lt_gemms_.reset();
    allocator_.reset();
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }

  int device() const noexcept { return device_; }
  //! Makes this rank's device current on the calling thread (kernels, copies and events must be
  //! issued there; ranks as threads may use several GPUs). Cheap when it already is.
  void activate() const {
    int current = -1;
    LOOM_CUDA_CHECK(cudaGetDevice(&current));
    if (current != device_) LOOM_CUDA_CHECK(cudaSetDevice(device_));
  }
  //! Whether float GEMMs may use TF32 tensor-core products (on by default, as cuBLAS users
  //! usually choose; PyTorch's torch.backends.cuda.matmul.allow_tf32). Off gives full fp32
  //! products, e.g. for parity tests against the CPU backend at fp32 tolerances.
  bool tf32() const noexcept { return tf32_; }
  void set_tf32(bool allowed) noexcept { tf32_ = allowed; }
  //! Whether attention_forward_lse/attention_backward_lse on bf16 with head size 32, 64 or 128
  //! run the SRAM-tiled tensor-core kernels (on, the default, where the program holds them for
  //! the GPU: flash_attention_available) or the cuBLAS batched-GEMM path that every other shape
  //! takes. On an H100 the tiled pair took 0.60 ms at GPT-2 small's layer against 1.22 ms for the
  //! cuBLAS one (docs/cuda.md); off is for comparisons.
  bool flash_attention() const noexcept { return flash_attention_; }
  void set_flash_attention(bool enabled) noexcept { flash_attention_ = enabled; }
  //! Whether the tiled kernels at head size 64 multiply with the warpgroup's wgmma (Hopper) where
  //! the program holds those kernels (built for sm_90a: warpgroup_attention_available), instead
  //! of each warp's mma.sync. Off by default: they have not yet been run on a GPU (docs/cuda.md).
  bool warpgroup_attention() const noexcept { return warpgroup_attention_; }
  void set_warpgroup_attention(bool enabled) noexcept { warpgroup_attention_ = enabled; }
  //! Whether GEMMs fuse what follows them into cuBLASLt epilogues: matmul_forward's bias,
  //! matmul_gelu_forward's bias and GELU, gelu_matmul_backward's GELU gradient (Gelu::tanh only:
  //! cuBLASLt's GELU is the tanh approximation), and
  //! matmul_backward's bias gradient (from the dweight GEMM). Off (the
  //! default) runs the same operations as separate kernels. A GEMM that cuBLASLt cannot fuse
  //! falls back to them either way (detail::LtEpilogueCounts counts both). Off by default until
  //! it has been timed on a GPU (docs/cuda.md).
  bool gemm_epilogues() const noexcept { return gemm_epilogues_; }
  void set_gemm_epilogues(bool enabled) noexcept { gemm_epilogues_ = enabled; }
  //! The stream every operation of this rank is ordered on.
  cudaStream_t stream() const noexcept { return stream_; }

  //! Whether NCCL calls run on a stream of their own (on, the default), so that a collective
  //! overlaps the kernels issued after it (DDP's buckets with the rest of the backward), or on
  //! stream() behind and before the kernels (off: each collective holds up the compute).
  bool overlap_communication() const noexcept { return overlap_communication_; }
  void set_overlap_communication(bool enabled) {
    if (!enabled && communication_ != nullptr) {
      activate();
      communication_->before_compute();  // what already runs there comes before what follows
    }
    overlap_communication_ = enabled;
  }
  //! The stream NCCL calls are issued on: a stream of the rank's own beside stream() (created
  //! on first use), or stream() itself when overlap_communication() is off. Before issuing,
  //! call order_communication_after_compute(); after, record_communication() with the buffers.
  cudaStream_t communication_stream() const {
    if (!overlap_communication_) return stream_;
    return communication().stream();
  }
  //! Makes the communication stream wait for everything issued on stream() so far (a no-op
  //! when they are the same stream).
  void order_communication_after_compute() const {
    if (!overlap_communication_) return;
    activate();
    communication().after_compute();
  }
  //! An event recorded after the communication issued so far (for its Requests and watches).
  //! `ranges` of device memory stay in use until it: if one of them is freed before, the memory
  //! is not handed to new work on stream() until the event (deallocate makes stream() wait).
  detail::SharedEvent record_communication(std::span<const detail::DeviceRange> ranges = {}) const {
    activate();
    detail::SharedEvent done = detail::record_event(communication_stream());
    if (overlap_communication_ && !ranges.empty()) communication().uses(ranges, done);
    return done;
  }
  //! The rank's cuBLAS handle, bound to its stream (created on first use: a backend that runs
  //! no GEMM never initialises cuBLAS).
  cublasHandle_t cublas() const {
    if (cublas_ == nullptr) {
      activate();
      LOOM_CUBLAS_CHECK(cublasCreate(&cublas_));
      if (const cublasStatus_t s = cublasSetStream(cublas_, stream_); s != CUBLAS_STATUS_SUCCESS) {
        (void)cublasDestroy(cublas_);
        cublas_ = nullptr;
        detail::cublas_check(s, "cublasSetStream(cublas_, stream_)");
      }
    }
    return cublas_;
  }
  //! The rank's cuBLASLt handle and GEMM plans (created on first use). GEMMs on it take the
  //! stream as an argument.
  detail::LtGemms& lt_gemms() const {
    if (lt_gemms_ == nullptr) {
      activate();
      lt_gemms_ = std::make_unique<detail::LtGemms>();
    }
    return *lt_gemms_;
  }

  //! While the host waits for this rank's stream (synchronize, copy_to_host, copy_from_host),
  //! runs `check` now and then until it returns true (done; it is dropped); an exception from it
  //! ends the wait and propagates. The NCCL communicator watches each of its calls this way:
  //! their completion is stream-ordered (the host does not wait for them), so it is here that a
  //! collective that never completes, or fails, is noticed and its communicator aborted.
  void watch(std::function<bool()> check) const {
    watches_.push_back(std::move(check));
    // Checks of earlier calls that are done by now go, so the list stays short between waits.
    // A host running ahead of the GPU has many calls in flight: the next sweep waits until the
    // list has doubled, so sweeping costs a constant per call however long the list.
    if (watches_.size() >= next_sweep_) {
      run_watches();
      next_sweep_ = std::max<std::size_t>(64, 2 * watches_.size());
    }
  }
  //! Checks the communication in flight (see watch); throws what a check throws.
  void run_watches() const {
    std::size_t kept = 0, i = 0;
    try {
      for (; i < watches_.size(); ++i) {
        if (watches_[i]()) continue;
        if (kept != i) watches_[kept] = std::move(watches_[i]);
        ++kept;
      }
    } catch (...) {
      // The check that threw goes too: it has said what it had to.
      watches_.erase(watches_.begin() + static_cast<std::ptrdiff_t>(kept),
                     watches_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
      throw;
    }
    watches_.resize(kept);
  }

  //! Device memory counted under `category` (the requested bytes; the allocator may hold more).
  //! Out of device memory (after the cache was given back), fails with a loom::Error that says
  //! what this rank holds, by category, and what the device has left.
  void* allocate(std::size_t bytes, MemoryCategory category) {
    activate();
    void* p = allocator_->allocate(bytes);
    if (p == nullptr) throw out_of_memory(bytes, category);
    memory_.add(category, bytes);
    return p;
  }
  void deallocate(void* p, std::size_t bytes, MemoryCategory category) noexcept {
    if (communication_ != nullptr) communication_->before_reuse({p, bytes});
    allocator_->deallocate(p);
    memory_.remove(category, bytes);
  }
  const MemoryTracker& memory() const noexcept { return memory_; }
  MemoryTracker& memory() noexcept { return memory_; }
  //! Bytes obtained from CUDA (in use or cached), and the cached part.
  std::size_t reserved_bytes() const noexcept { return allocator_->reserved_bytes(); }
  std::size_t cached_bytes() const noexcept { return allocator_->cached_bytes(); }
  //! Gives cached blocks back to CUDA (e.g. before handing the GPU to another library).
  void empty_cache() {
    synchronize();
    allocator_->release_cache();
  }

  //! Zeroes `bytes` at device address `p`, ordered on the stream.
  void fill_zero(void* p, std::size_t bytes) const {
    if (bytes == 0) return;
    activate();
    LOOM_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream_));
  }
  //! Host to device; `src` may be reused when this returns. `dst` may also be host memory (the
  //! direction comes from the addresses: unified virtual addressing), so code that stages
  //! buffers (StagedCommunicator) need not know where each one lives.
  void copy_from_host(void* dst, const void* src, std::size_t bytes) const {
    if (bytes == 0) return;
    activate();
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    synchronize();
  }
  //! Device to host; the data is in `dst` when this returns. `src` may also be host memory.
  void copy_to_host(void* dst, const void* src, std::size_t bytes) const {
    if (bytes == 0) return;
    activate();
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_));
    synchronize();
  }
  //! Device to device, ordered on the stream.
  void copy(void* dst, const void* src, std::size_t bytes) const {
    if (bytes == 0) return;
    activate();
    LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  }
  //! Waits for everything issued on the stream; an asynchronous fault of earlier work surfaces
  //! here as a loom::Error, as does communication the stream waits for that failed or timed out
  //! (watch).
  void synchronize() const {
    if (watches_.empty()) {
      LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
      return;
    }
    activate();
    // The watches run every millisecond of the wait: often enough for a timeout of any use,
    // seldom enough that many calls in flight cost nothing beside the stream's work.
    auto next_check = std::chrono::steady_clock::now();
    while (true) {
      const cudaError_t status = cudaStreamQuery(stream_);
      if (status == cudaSuccess) break;
      if (status != cudaErrorNotReady) detail::cuda_check(status, "cudaStreamQuery(stream_)");
      if (const auto now = std::chrono::steady_clock::now(); now >= next_check) {
        run_watches();
        next_check = now + std::chrono::milliseconds(1);
      }
      std::this_thread::yield();
    }
    run_watches();
  }

 private:
  static int check_device(int device) {
    const int n = device_count();
    LOOM_CHECK(n > 0, "cuda backend: device", device,
               "no CUDA device is available (cudaGetDeviceCount found none or no driver)");
    LOOM_CHECK(device >= 0 && device < n, "cuda backend: device", device,
               "must be in [0, " + std::to_string(n) + ") (the GPUs this process sees)");
    return device;
  }
  Error out_of_memory(std::size_t bytes, MemoryCategory category) const {
    std::size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) (void)cudaGetLastError();
    const auto mib = [](std::size_t b) { return std::to_string(b >> 20); };
    return Error("cuda allocate on device " + std::to_string(device_) + " (" + std::string(name(category)) + ")",
                 std::to_string(bytes) + " bytes",
                 "out of device memory: this rank holds " + memory_.held() + ", its allocator " +
                     mib(allocator_->reserved_bytes()) + " MiB in all; the device has " + mib(free_bytes) +
                     " MiB free of " + mib(total_bytes) + " MiB; " + std::string(out_of_memory_hint));
  }

  int device_;
  bool tf32_ = true;
  bool flash_attention_ = true;
  bool warpgroup_attention_ = false;
  bool gemm_epilogues_ = false;
  cudaStream_t stream_ = nullptr;
  mutable cublasHandle_t cublas_ = nullptr;  // created by the first cublas() call
  mutable std::unique_ptr<detail::LtGemms> lt_gemms_;  // created by the first lt_gemms() call
  detail::CommunicationStream& communication() const {
    if (communication_ == nullptr) {
      activate();
      communication_ = std::make_unique<detail::CommunicationStream>(stream_);
    }
    return *communication_;
  }

  bool overlap_communication_ = true;
  mutable std::vector<std::function<bool()>> watches_;  // communication in flight (watch)
  mutable std::size_t next_sweep_ = 64;                  // watch() sweeps at this many
  std::unique_ptr<detail::CachingAllocator> allocator_;
  mutable std::unique_ptr<detail::CommunicationStream> communication_;  // created on first use
  MemoryTracker memory_;
};

static_assert(Backend<cuda>);

}  // namespace loom
