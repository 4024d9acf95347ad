// The CUDA backend: without a GPU it refuses to start with a clear error (and the test reports
// itself skipped); with one, memory is accounted and cached, copies round-trip, and CUDA's
// failures come back as loom::Error naming the call.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/core/buffer.hpp"

using namespace loom;

namespace {
bool have_gpu() { return cuda::device_count() > 0; }

//! Holds up the stream it is launched on for `*milliseconds` (a host function: the stream runs
//! nothing after it until it returns), so a test can tell ordered work from work that races.
void CUDART_CB hold_stream(void* milliseconds) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<const int*>(milliseconds)));
}
int hold_ms = 200;
}  // namespace

TEST_CASE("without a GPU the CUDA backend refuses to start and says why") {
  if (have_gpu()) return;
  CHECK_THROWS_WITH_AS(cuda{0}, doctest::Contains("cuda backend: device: got 0; no CUDA device is available"), Error);
}

TEST_CASE("a device that does not exist is named") {
  if (!have_gpu()) return;
  const int n = cuda::device_count();
  const std::string expected = "must be in [0, " + std::to_string(n) + ")";
  CHECK_THROWS_WITH_AS(cuda{n}, doctest::Contains(expected.c_str()), Error);
}

TEST_CASE("CUDA failures become loom::Error naming the call and CUDA's words") {
  try {
    LOOM_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL("no throw");
  } catch (const Error& e) {
    const std::string what = e.what();
    CHECK(what.find("cudaErrorInvalidValue: got cudaErrorInvalidValue") != std::string::npos);
    CHECK(what.find("invalid argument") != std::string::npos);
  }
}

TEST_CASE("cuBLAS failures become loom::Error naming the call and cuBLAS's words") {
  try {
    LOOM_CUBLAS_CHECK(CUBLAS_STATUS_NOT_INITIALIZED);
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("CUBLAS_STATUS_NOT_INITIALIZED: got CUBLAS_STATUS_NOT_INITIALIZED") !=
          std::string::npos);
  }
}

TEST_CASE("the backend's cuBLAS handle is created once and bound to its stream") {
  if (!have_gpu()) return;
  cuda be(0);
  const cublasHandle_t handle = be.cublas();
  CHECK(be.cublas() == handle);
  cudaStream_t bound = nullptr;
  REQUIRE(cublasGetStream(handle, &bound) == CUBLAS_STATUS_SUCCESS);
  CHECK(bound == be.stream());
}

TEST_CASE("the size classes of the caching allocator") {
  using detail::CachingAllocator;
  CHECK(CachingAllocator::size_class(0) == 512);
  CHECK(CachingAllocator::size_class(1) == 512);
  CHECK(CachingAllocator::size_class(513) == 1024);
  CHECK(CachingAllocator::size_class(std::size_t{1} << 20) == std::size_t{1} << 20);
  CHECK(CachingAllocator::size_class((std::size_t{1} << 20) + 1) == std::size_t{2} << 20);
  CHECK(CachingAllocator::size_class((std::size_t{5} << 20) + 7) == std::size_t{6} << 20);
}

TEST_CASE("memory in use by communication: each piece of work once, until its event is done") {
  using detail::DeviceRange;
  detail::InUseRanges<int> in_use;
  std::vector<std::byte> memory(1000);
  std::byte* m = memory.data();
  const DeviceRange first[] = {{m, 100}, {m + 200, 50}, {m + 900, 0}, {nullptr, 8}};
  const DeviceRange second[] = {{m + 100, 100}};
  const DeviceRange none[] = {{m + 500, 0}};
  in_use.add(first, 1);
  in_use.add(second, 2);
  in_use.add(none, 3);  // nothing in use: no entry
  CHECK(in_use.size() == 2);
  const auto overlapping = [&](DeviceRange range) {
    std::vector<int> events;
    in_use.for_each_overlapping(range, [&](int e) { events.push_back(e); });
    return events;
  };
  CHECK(overlapping({m, 1000}) == std::vector<int>{1, 2});  // entry 1 once, though two ranges meet it
  CHECK(overlapping({m + 99, 2}) == std::vector<int>{1, 2});
  CHECK(overlapping({m + 99, 1}) == std::vector<int>{1});   // ends where entry 2's range begins
  CHECK(overlapping({m + 100, 1}) == std::vector<int>{2});  // begins where entry 1's range ends
  CHECK(overlapping({m + 249, 1}) == std::vector<int>{1});
  CHECK(overlapping({m + 250, 650}).empty());  // just past [200, 250); [900, 900) holds nothing
  CHECK(overlapping({m, 0}).empty());
  std::vector<int> recycled;
  in_use.drop_done([](int e) { return e == 1; }, [&](int e) { recycled.push_back(e); });
  CHECK(recycled == std::vector<int>{1});
  CHECK(overlapping({m, 1000}) == std::vector<int>{2});
  in_use.clear([&](int e) { recycled.push_back(e); });
  CHECK(recycled == std::vector<int>{1, 2});
  CHECK(in_use.empty());
}

TEST_CASE("communication runs on a stream of its own, after the compute issued before it") {
  if (!have_gpu()) return;
  cuda be(0);
  CHECK(be.overlap_communication());
  CHECK(be.communication_stream() != be.stream());
  const std::int64_t n = 1 << 20;
  const std::vector<float> before(static_cast<std::size_t>(n), 1.0f), after(before.size(), 2.0f);
  std::vector<float> back(before.size());
  Buffer<float, cuda> x(be, n, MemoryCategory::workspace), y(be, n, MemoryCategory::workspace),
      update(be, n, MemoryCategory::workspace);
  const auto compute_writes_x_late = [&] {
    be.copy_from_host(x.data(), before.data(), x.bytes());
    be.copy_from_host(update.data(), after.data(), update.bytes());
    LOOM_CUDA_CHECK(cudaLaunchHostFunc(be.stream(), hold_stream, &hold_ms));
    be.copy(x.data(), update.data(), x.bytes());
  };
  const auto communication_copies_x = [&] {
    LOOM_CUDA_CHECK(cudaMemcpyAsync(y.data(), x.data(), x.bytes(), cudaMemcpyDeviceToDevice, be.communication_stream()));
    LOOM_CUDA_CHECK(cudaStreamSynchronize(be.communication_stream()));
    be.copy_to_host(back.data(), y.data(), y.bytes());
  };
  SUBCASE("ordered, it reads what the compute wrote") {
    compute_writes_x_late();
    be.order_communication_after_compute();
    communication_copies_x();
    CHECK(back == after);
  }
  SUBCASE("unordered, it would run ahead (the test can tell)") {
    compute_writes_x_late();
    communication_copies_x();
    CHECK(back == before);
  }
  SUBCASE("off, communication is on the compute stream itself") {
    be.set_overlap_communication(false);
    CHECK(be.communication_stream() == be.stream());
    compute_writes_x_late();
    be.order_communication_after_compute();  // nothing to do
    communication_copies_x();
    CHECK(back == after);
  }
}

TEST_CASE("memory freed while communication uses it is reused only after that is done") {
  if (!have_gpu()) return;
  cuda be(0);
  const std::int64_t n = 1 << 20;
  const std::vector<float> sent(static_cast<std::size_t>(n), 3.0f), other(sent.size(), 4.0f);
  std::vector<float> back(sent.size());
  Buffer<float, cuda> received(be, n, MemoryCategory::communication);
  std::optional<Buffer<float, cuda>> source(std::in_place, be, n, MemoryCategory::communication);
  be.copy_from_host(source->data(), sent.data(), source->bytes());
  // The communication stream reads `source` only after 200 ms...
  LOOM_CUDA_CHECK(cudaLaunchHostFunc(be.communication_stream(), hold_stream, &hold_ms));
  LOOM_CUDA_CHECK(cudaMemcpyAsync(received.data(), source->data(), source->bytes(), cudaMemcpyDeviceToDevice,
                                  be.communication_stream()));
  const detail::DeviceRange in_use[] = {{source->data(), source->bytes()}};
  (void)be.record_communication(in_use);
  // ...but `source` is freed at once, and its block handed out again and written on the compute stream.
  void* block = source->data();
  source.reset();
  Buffer<float, cuda> reused(be, n, MemoryCategory::workspace);
  REQUIRE(reused.data() == block);
  be.copy_from_host(reused.data(), other.data(), reused.bytes());
  LOOM_CUDA_CHECK(cudaStreamSynchronize(be.communication_stream()));
  be.copy_to_host(back.data(), received.data(), received.bytes());
  CHECK(back == sent);
}

TEST_CASE("the host's waits for the stream run the watches of communication in flight") {
  if (!have_gpu()) return;
  cuda be(0);
  int done_checks = 0, pending_checks = 0;
  be.watch([&] { return ++done_checks > 0; });  // done at its first check
  be.synchronize();
  be.synchronize();
  CHECK(done_checks == 1);  // and dropped then
  be.watch([&] {
    if (++pending_checks < 3) return false;
    throw Error("watched call", "3 checks", "fails the wait");
  });
  LOOM_CUDA_CHECK(cudaLaunchHostFunc(be.stream(), hold_stream, &hold_ms));
  const auto start = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH_AS(be.synchronize(), doctest::Contains("watched call: got 3 checks"), Error);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::milliseconds(150));  // not held to the end
  be.synchronize();  // the failed watch is gone: an ordinary wait
  CHECK(pending_checks == 3);
}

TEST_CASE("device memory is accounted by category and cached for reuse") {
  if (!have_gpu()) return;
  cuda be(0);
  void* first = nullptr;
  {
    Buffer<float, cuda> params(be, 1000, MemoryCategory::parameters);
    first = params.data();
    CHECK(be.memory().current(MemoryCategory::parameters) == 4000);
    CHECK(be.reserved_bytes() == 4096);
  }
  CHECK(be.memory().current(MemoryCategory::parameters) == 0);
  CHECK(be.memory().peak(MemoryCategory::parameters) == 4000);
  CHECK(be.cached_bytes() == 4096);
  Buffer<float, cuda> again(be, 1000, MemoryCategory::gradients);
  CHECK(again.data() == first);  // the same size class reuses the cached block
  CHECK(be.cached_bytes() == 0);
  be.empty_cache();
  CHECK(be.reserved_bytes() == 4096);
}

TEST_CASE("copies round-trip and fill_zero zeroes, in stream order") {
  if (!have_gpu()) return;
  cuda be(0);
  for (std::int64_t n : {1, 7, 1001, 1 << 20}) {
    CAPTURE(n);
    std::vector<float> host(static_cast<std::size_t>(n)), back(host.size(), -1.0f);
    std::iota(host.begin(), host.end(), 1.0f);
    Buffer<float, cuda> a(be, n, MemoryCategory::workspace), b(be, n, MemoryCategory::workspace);
    be.copy_from_host(a.data(), host.data(), a.bytes());
    be.copy(b.data(), a.data(), a.bytes());
    be.copy_to_host(back.data(), b.data(), b.bytes());
    CHECK(back == host);
    be.fill_zero(b.data(), b.bytes());
    be.copy_to_host(back.data(), b.data(), b.bytes());
    CHECK(back == std::vector<float>(host.size(), 0.0f));
  }
}

TEST_CASE("running out of device memory is a loom::Error that says how much is held") {
  if (!have_gpu()) return;
  cuda be(0);
  std::size_t free_bytes = 0, total_bytes = 0;
  LOOM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  Buffer<float, cuda> held(be, std::int64_t{1} << 20, MemoryCategory::parameters);  // 4 MiB
  const std::string expected = "cuda allocate on device 0 (activations): got " + std::to_string(total_bytes * 2) +
                               " bytes; out of device memory: this rank holds 4.0 MiB (parameters 4.0), its "
                               "allocator 4 MiB in all; the device has ";
  CHECK_THROWS_WITH_AS(be.allocate(total_bytes * 2, MemoryCategory::activations), doctest::Contains(expected.c_str()),
                       Error);
  CHECK(be.memory().current_total() == held.bytes());
  // The backend still works afterwards.
  Buffer<float, cuda> small(be, 16, MemoryCategory::workspace);
  be.fill_zero(small.data(), small.bytes());
  be.synchronize();
}

//! Runs the cases; without a GPU, a clean run reports "skipped" (ctest SKIP_RETURN_CODE 77)
//! because the device cases had nothing to check.
int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int status = context.run();
  if (status != 0 || context.shouldExit()) return status;
  if (!have_gpu()) {
    std::puts("loom: no CUDA device; the device cases were skipped");
    return 77;
  }
  return 0;
}
