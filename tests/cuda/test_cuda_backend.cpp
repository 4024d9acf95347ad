// The CUDA backend: without a GPU it refuses to start with a clear error (and the test reports
// itself skipped); with one, memory is accounted and cached, copies round-trip, and CUDA's
// failures come back as loom::Error naming the call.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdint>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "loom/backend/cuda/cuda.hpp"
#include "loom/core/buffer.hpp"

using namespace loom;

namespace {
bool have_gpu() { return cuda::device_count() > 0; }
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
