#pragma once
//! \file The stream a rank's NCCL calls run on, beside its compute stream, so that a collective
//! runs while the kernels issued after it do (DDP's buckets during the backward, ZeRO-3's
//! prefetched gathers). Three orderings keep it correct:
//!  - communication waits for the compute issued before it (an event recorded on the compute
//!    stream and waited for on this one, at every call);
//!  - compute that reads what communication wrote comes after the host waited for the call's
//!    Request (the Communicator contract: a buffer is not touched before its request completes);
//!  - memory freed while communication still uses it (a buffer released before its request was
//!    waited for) is not handed to new compute: the compute stream first waits for that work,
//!    as PyTorch's record_stream does.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <span>

#include "loom/backend/cuda/detail/in_use_ranges.hpp"
#include "loom/backend/cuda/error.hpp"

namespace loom::detail {

//! A CUDA event shared by what waits for it (a Request, the backend's watch of the call, memory
//! in use until it); destroyed with the last of them.
using SharedEvent = std::shared_ptr<CUevent_st>;

//! A new event, recorded on `stream` after the work issued on it so far.
inline SharedEvent record_event(cudaStream_t stream) {
  cudaEvent_t raw = nullptr;
  LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
  SharedEvent event(raw, [](cudaEvent_t e) { (void)cudaEventDestroy(e); });
  LOOM_CUDA_CHECK(cudaEventRecord(raw, stream));
  return event;
}

//! A communication stream of one device, ordered against that device's compute stream.
class CommunicationStream {
 public:
  //! Creates the stream on the current device (the caller activates it).
  explicit CommunicationStream(cudaStream_t compute) : compute_(compute) {
    LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    if (const cudaError_t e = cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming); e != cudaSuccess) {
      (void)cudaStreamDestroy(stream_);
      cuda_check(e, "cudaEventCreateWithFlags(&compute_done_, cudaEventDisableTiming)");
    }
  }
  CommunicationStream(const CommunicationStream&) = delete;
  CommunicationStream& operator=(const CommunicationStream&) = delete;
  ~CommunicationStream() {
    (void)cudaStreamSynchronize(stream_);
    (void)cudaEventDestroy(compute_done_);
    (void)cudaStreamDestroy(stream_);
  }

  cudaStream_t stream() const noexcept { return stream_; }

  //! Makes this stream wait for everything issued on the compute stream so far.
  void after_compute() {
    LOOM_CUDA_CHECK(cudaEventRecord(compute_done_, compute_));
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(stream_, compute_done_, 0));
  }

  //! Makes the compute stream wait for everything issued on this stream so far (before work
  //! goes back onto the compute stream alone).
  void before_compute() {
    const SharedEvent tail = record_event(stream_);
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(compute_, tail.get(), 0));
  }

  //! Records that `ranges` are in use until `until` (an event of this stream) completes.
  void uses(std::span<const DeviceRange> ranges, const SharedEvent& until) {
    // Entries seen done go when the list has doubled since the last sweep: a host running ahead
    // of the GPU keeps many in flight, and sweeping at every call would cost their number each.
    if (in_use_.size() >= next_sweep_) {
      in_use_.drop_done([](const SharedEvent& e) { return cudaEventQuery(e.get()) == cudaSuccess; },
                        [](SharedEvent) {});  // the last holder destroys the event
      next_sweep_ = std::max<std::size_t>(16, 2 * in_use_.size());
    }
    in_use_.add(ranges, until);
  }

  //! Before `range` is handed to new work on the compute stream: the compute stream waits for
  //! the communication still using any of it. Failures are left for the next checked call
  //! (this runs where memory is freed, which does not throw).
  void before_reuse(DeviceRange range) const noexcept {
    in_use_.for_each_overlapping(range, [this](const SharedEvent& until) {
      if (cudaEventQuery(until.get()) != cudaSuccess) (void)cudaStreamWaitEvent(compute_, until.get(), 0);
    });
  }

 private:
  cudaStream_t compute_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t compute_done_ = nullptr;
  InUseRanges<SharedEvent> in_use_;
  std::size_t next_sweep_ = 16;  // uses() drops the entries done at this many
};

}  // namespace loom::detail
