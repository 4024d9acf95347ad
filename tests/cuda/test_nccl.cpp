// The NCCL communicator: the conformance suite (tests/comm/conformance.hpp) on host buffers
// (staged through the device) and on device buffers, on a world of one GPU, and on every GPU of
// the machine as thread ranks when there are two or more (NCCL refuses two ranks of one
// communicator on the same GPU); and the communication stream's ordering against the compute.
// Without a GPU it reports itself skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "comm/conformance.hpp"
#include "loom/backend/cuda/cuda.hpp"
#include "loom/comm/detail/staging.hpp"
#include "loom/comm/nccl.hpp"
#include "loom/comm/threads.hpp"
#include "loom/core/buffer.hpp"

using namespace loom;

namespace {
int gpus() { return cuda::device_count(); }

//! The collectives that NCCL supports with loom's semantics. Point-to-point messages are
//! matched in issue order per peer (NCCL has no tags), so the tagged send/recv patterns of the
//! suite are not among them; its groups (untagged, both ways at once) are.
template <class C>
conformance::Failures nccl_conformance(C& comm) {
  conformance::Failures all;
  for (conformance::Failures part :
       {conformance::check_all_reduce(comm), conformance::check_reduce_scatter(comm),
        conformance::check_all_gather(comm), conformance::check_broadcast(comm), conformance::check_group(comm),
        conformance::check_barrier(comm), conformance::check_split(comm), conformance::check_in_flight(comm)})
    all.insert(all.end(), part.begin(), part.end());
  return all;
}

//! The conformance suite's host buffers moved into device memory around each call, so the suite
//! runs NCCL's device path (the communication stream, its ordering and its Requests) rather
//! than the path that stages host buffers: each call's data goes to device buffers of its own,
//! and the result comes back when its Request completes.
class OnDevice : public CollectiveInterface<OnDevice> {
 public:
  using loom_communicator = void;

  OnDevice(nccl::Communicator inner, cuda& backend) : inner_(std::move(inner)), backend_(&backend) {}
  int rank() const { return inner_.rank(); }
  int size() const { return inner_.size(); }

  void run(const CollectiveCall& call) { start(call).wait(); }
  Request start(const CollectiveCall& call) {
    auto pending = std::make_unique<Pending>(*backend_, call, rank(), size());
    pending->inner = inner_.start(pending->device_call);
    return Request(State{std::move(pending)});
  }
  std::vector<Request> start_group(std::span<const CollectiveCall> calls) {
    this->check_group(calls);
    std::vector<std::unique_ptr<Pending>> parts;
    std::vector<CollectiveCall> device_calls;
    for (const CollectiveCall& call : calls) {
      parts.push_back(std::make_unique<Pending>(*backend_, call, rank(), size()));
      device_calls.push_back(parts.back()->device_call);
    }
    std::vector<Request> inner = inner_.start_group(std::span<const CollectiveCall>(device_calls));
    std::vector<Request> requests;
    for (std::size_t i = 0; i < calls.size(); ++i) {
      parts[i]->inner = std::move(inner[i]);
      requests.emplace_back(State{std::move(parts[i])});
    }
    return requests;
  }
  OnDevice split(int color, int key) { return OnDevice(inner_.split(color, key), *backend_); }

 private:
  struct Pending {
    cuda* backend;
    detail::StagingPlan plan;
    Buffer<std::byte, cuda> input, output;
    CollectiveCall device_call;
    Request inner;

    Pending(cuda& be, const CollectiveCall& call, int rank, int size)
        : backend(&be),
          plan(detail::staging_plan(call, rank, size)),
          input(be, static_cast<std::int64_t>(plan.input_bytes), MemoryCategory::communication),
          output(be, static_cast<std::int64_t>(plan.output_bytes), MemoryCategory::communication) {
      if (plan.stage_bytes > 0)
        be.copy_from_host(plan.stage_into_output ? output.data() : input.data(), plan.stage_from, plan.stage_bytes);
      device_call = detail::with_scratch_buffers(call, plan.input_bytes > 0 ? input.data() : nullptr,
                                                 plan.output_bytes > 0 ? output.data() : nullptr);
    }
    void finish() {
      if (plan.copy_back_bytes > 0) backend->copy_to_host(plan.copy_back_to, output.data(), plan.copy_back_bytes);
    }
  };
  using State = detail::StagedRequest<Pending>;

  nccl::Communicator inner_;
  cuda* backend_;
};
static_assert(loom::Communicator<OnDevice>);

//! Holds up the stream it is launched on for `*milliseconds` (a host function).
void CUDART_CB hold_stream(void* milliseconds) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<const int*>(milliseconds)));
}
}  // namespace

TEST_CASE("NCCL on a world of one GPU passes the conformance suite") {
  if (gpus() == 0) return;
  cuda be(0);
  nccl::Communicator comm(be, nccl::UniqueId::make(), 1, 0);
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  conformance::report(nccl_conformance(comm), 0);
}

TEST_CASE("NCCL on device buffers, on its own stream and on the compute stream, passes the conformance suite") {
  if (gpus() == 0) return;
  for (const bool overlap : {true, false}) {
    CAPTURE(overlap);
    cuda be(0);
    be.set_overlap_communication(overlap);
    OnDevice comm(nccl::Communicator(be, nccl::UniqueId::make(), 1, 0), be);
    conformance::report(nccl_conformance(comm), 0);
  }
}

TEST_CASE("an NCCL call waits for the kernels issued before it and runs beside those issued after it") {
  if (gpus() == 0) return;
  const std::size_t n = std::size_t{1} << 20;
  const std::vector<float> before(n, 1.0f), after(n, 2.0f);
  std::vector<float> back(n);
  for (const bool overlap : {true, false}) {
    CAPTURE(overlap);
    cuda be(0);
    be.set_overlap_communication(overlap);
    nccl::Communicator comm(be, nccl::UniqueId::make(), 1, 0);
    Buffer<float, cuda> x(be, static_cast<std::int64_t>(n), MemoryCategory::workspace),
        y(be, static_cast<std::int64_t>(n), MemoryCategory::workspace),
        update(be, static_cast<std::int64_t>(n), MemoryCategory::workspace);
    comm.all_gather(std::span<const float>(x.data(), n), std::span<float>(y.data(), n));  // NCCL's first call sets up
    be.copy_from_host(x.data(), before.data(), x.bytes());
    be.copy_from_host(update.data(), after.data(), update.bytes());
    // Before: the compute stream writes x only after 200 ms; the gather must see the new x.
    int hold_ms = 200;
    LOOM_CUDA_CHECK(cudaLaunchHostFunc(be.stream(), hold_stream, &hold_ms));
    be.copy(x.data(), update.data(), x.bytes());
    comm.all_gather(std::span<const float>(x.data(), n), std::span<float>(y.data(), n));
    be.copy_to_host(back.data(), y.data(), y.bytes());
    CHECK(back == after);
    // After: with the communication stream held up for 300 ms, a gather issued on it waits for
    // that, while kernels issued after the gather run at once (off: all of it is one stream).
    int comm_hold_ms = 300;
    LOOM_CUDA_CHECK(cudaLaunchHostFunc(be.communication_stream(), hold_stream, &comm_hold_ms));
    const auto start = std::chrono::steady_clock::now();
    const auto ms_since = [&] {
      return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    };
    Request gathered = comm.all_gather_async(std::span<const float>(x.data(), n), std::span<float>(y.data(), n));
    be.copy(update.data(), x.data(), x.bytes());
    be.synchronize();
    const double compute_ms = ms_since();
    gathered.wait();  // in stream order: the host goes on
    const double wait_returned_ms = ms_since();
    be.synchronize();  // the stream waits for the gather
    const double gather_ms = ms_since();
    CAPTURE(compute_ms);
    CAPTURE(wait_returned_ms);
    CAPTURE(gather_ms);
    CHECK(gather_ms >= 250.0);  // the gather ran on the communication stream, behind the hold
    if (overlap) {
      CHECK(compute_ms < 200.0);
      CHECK(wait_returned_ms < 200.0);
    } else {
      CHECK(compute_ms >= 250.0);
    }
  }
}

TEST_CASE("on device buffers a call completes in stream order; a barrier waits on the host") {
  if (gpus() == 0) return;
  cuda be(0);
  nccl::Communicator comm(be, nccl::UniqueId::make(), 1, 0);
  const std::size_t n = 1000;
  std::vector<float> host(n, 5.0f), back(n);
  Buffer<float, cuda> data(be, static_cast<std::int64_t>(n), MemoryCategory::workspace);
  be.copy_from_host(data.data(), host.data(), data.bytes());
  comm.all_reduce(std::span<float>(data.data(), n));  // NCCL's first call sets up
  be.synchronize();
  int hold_ms = 300;
  const auto ms_since = [](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t).count();
  };
  LOOM_CUDA_CHECK(cudaLaunchHostFunc(be.communication_stream(), hold_stream, &hold_ms));
  auto start = std::chrono::steady_clock::now();
  comm.all_reduce(std::span<float>(data.data(), n), ReduceOp::max);
  const double run_ms = ms_since(start);
  be.copy_to_host(back.data(), data.data(), data.bytes());
  const double copied_ms = ms_since(start);
  CAPTURE(run_ms);
  CAPTURE(copied_ms);
  CHECK(run_ms < 200.0);      // the host did not wait for the held stream
  CHECK(copied_ms >= 250.0);  // the copy, on the compute stream, did
  CHECK(back == host);
  LOOM_CUDA_CHECK(cudaLaunchHostFunc(be.communication_stream(), hold_stream, &hold_ms));
  start = std::chrono::steady_clock::now();
  comm.barrier();
  const double barrier_ms = ms_since(start);
  CAPTURE(barrier_ms);
  CHECK(barrier_ms >= 250.0);
}

TEST_CASE("NCCL over every GPU, bootstrapped through thread ranks, passes the conformance suite") {
  const int n = gpus();
  if (n < 2) return;
  std::vector<conformance::Failures> failures(static_cast<std::size_t>(n));
  threads::run(n, [&](threads::Communicator& group) {
    cuda be(group.rank());
    nccl::Communicator comm = nccl::Communicator::bootstrap(be, group);
    failures[static_cast<std::size_t>(group.rank())] = nccl_conformance(comm);
    OnDevice on_device(std::move(comm), be);
    const conformance::Failures device_failures = nccl_conformance(on_device);
    failures[static_cast<std::size_t>(group.rank())].insert(failures[static_cast<std::size_t>(group.rank())].end(),
                                                            device_failures.begin(), device_failures.end());
  });
  conformance::report(failures);
}

TEST_CASE("a bad rank or size is rejected before NCCL is called") {
  if (gpus() == 0) return;
  cuda be(0);
  CHECK_THROWS_WITH_AS(nccl::Communicator(be, nccl::UniqueId::make(), 2, 2), doctest::Contains("rank: got 2"), Error);
  CHECK_THROWS_WITH_AS(nccl::Communicator(be, nccl::UniqueId::make(), 0, 0), doctest::Contains("size: got 0"), Error);
}

// Last in the file: NCCL aborts the communicator while its kernel still waits behind the held
// stream, which may leave the GPU unusable for cases after it in this process.
TEST_CASE("a call that does not complete in time fails the backend's next host wait, naming it") {
  if (gpus() == 0) return;
  cuda be(0);
  {
    nccl::Communicator comm(be, nccl::UniqueId::make(), 1, 0, {.timeout = std::chrono::milliseconds(200)});
    Buffer<float, cuda> data(be, 64, MemoryCategory::workspace);
    be.fill_zero(data.data(), data.bytes());
    comm.all_reduce(std::span<float>(data.data(), 64));  // NCCL's first call sets up
    be.synchronize();
    int hold_ms = 1500;
    LOOM_CUDA_CHECK(cudaLaunchHostFunc(be.communication_stream(), hold_stream, &hold_ms));
    comm.all_reduce(std::span<float>(data.data(), 64));  // returns at once: stream-ordered
    const auto start = std::chrono::steady_clock::now();
    CHECK_THROWS_WITH_AS(be.synchronize(),
                         doctest::Contains("rank 0's all_reduce(count=64, float32, sum) did not complete within 200 ms"),
                         Error);
    const double failed_after_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    CAPTURE(failed_after_ms);
    CHECK(failed_after_ms < 1000.0);  // at the timeout, not when the held stream let go
    CHECK_THROWS_WITH_AS(comm.all_reduce(std::span<float>(data.data(), 64)),
                         doctest::Contains("it failed earlier and was aborted"), Error);
  }
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int status = context.run();
  if (status != 0 || context.shouldExit()) return status;
  if (gpus() == 0) {
    std::puts("loom: no CUDA device; the NCCL cases were skipped");
    return 77;
  }
  return 0;
}
