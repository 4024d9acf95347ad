#pragma once
//! \file What a call moves when its buffers are staged through scratch memory: which bytes are
//! copied in before it, which are copied back after it, and the call rewritten onto the scratch.
//! StagedCommunicator stages device buffers through the host; the NCCL communicator stages host
//! buffers through the device.

#include <cstddef>
#include <memory>

#include "loom/comm/concepts.hpp"

namespace loom::detail {

//! Where a staged call's data goes in scratch, and what is copied in and out of the caller's
//! buffers around the call on the scratch.
struct StagingPlan {
  std::size_t input_bytes = 0;   //!< input scratch
  std::size_t output_bytes = 0;  //!< output scratch
  const void* stage_from = nullptr;  //!< caller's bytes copied into scratch before the call
  bool stage_into_output = false;    //!< ...into the output scratch (all_reduce, broadcast root)
  std::size_t stage_bytes = 0;
  void* copy_back_to = nullptr;  //!< caller's bytes the output scratch is copied to afterwards
  std::size_t copy_back_bytes = 0;
};

//! The plan for `call` on rank `rank` of `size` ranks. Input and output scratch are always
//! separate, so the inner call aliases exactly where the operation itself does (all_reduce,
//! broadcast) and never because the caller's buffers overlapped.
inline StagingPlan staging_plan(const CollectiveCall& call, int rank, int size) {
  const std::size_t bytes = call.bytes();
  const std::size_t group_bytes = bytes * static_cast<std::size_t>(size);
  StagingPlan plan;
  switch (call.kind) {
    case Collective::all_reduce:
      // Reduced in place: the output's current contents are this rank's contribution.
      plan = {.output_bytes = bytes, .stage_from = call.output, .stage_into_output = true, .stage_bytes = bytes,
              .copy_back_to = call.output, .copy_back_bytes = bytes};
      break;
    case Collective::broadcast:
      // Only the root's data is read, and the root's data does not change.
      if (call.peer == rank)
        plan = {.output_bytes = bytes, .stage_from = call.output, .stage_into_output = true, .stage_bytes = bytes};
      else
        plan = {.output_bytes = bytes, .copy_back_to = call.output, .copy_back_bytes = bytes};
      break;
    case Collective::reduce_scatter:
      plan = {.input_bytes = group_bytes, .output_bytes = bytes, .stage_from = call.input, .stage_bytes = group_bytes,
              .copy_back_to = call.output, .copy_back_bytes = bytes};
      break;
    case Collective::all_gather:
      plan = {.input_bytes = bytes, .output_bytes = group_bytes, .stage_from = call.input, .stage_bytes = bytes,
              .copy_back_to = call.output, .copy_back_bytes = group_bytes};
      break;
    case Collective::send:
      plan = {.input_bytes = bytes, .stage_from = call.input, .stage_bytes = bytes};
      break;
    case Collective::recv:
      plan = {.output_bytes = bytes, .copy_back_to = call.output, .copy_back_bytes = bytes};
      break;
    case Collective::barrier:
      break;
  }
  return plan;
}

//! `call` with its buffers replaced by scratch (`input` may be null when the operation
//! reads its output in place).
inline CollectiveCall with_scratch_buffers(CollectiveCall call, std::byte* input, std::byte* output) noexcept {
  switch (call.kind) {
    case Collective::all_reduce:
    case Collective::broadcast:
      call.input = output;
      call.output = output;
      break;
    case Collective::send:
      call.input = input;
      call.output = nullptr;
      break;
    case Collective::recv:
      call.input = nullptr;
      call.output = output;
      break;
    case Collective::reduce_scatter:
    case Collective::all_gather:
      call.input = input;
      call.output = output;
      break;
    case Collective::barrier:
      break;
  }
  return call;
}

//! What a Request holds for a staged call: the call on the heap (`Pending`, with the inner
//! communicator's `Request inner` and a `finish()` that copies the result back), finished by the
//! wait() or test() that sees the inner call complete. On the heap because the inner Request
//! alone fills Request::inline_bytes.
template <class Pending>
struct StagedRequest {
  std::unique_ptr<Pending> pending;

  void wait() {
    pending->inner.wait();
    pending->finish();
  }
  bool test() {
    if (!pending->inner.test()) return false;
    pending->finish();
    return true;
  }
};

}  // namespace loom::detail
