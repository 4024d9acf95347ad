#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <sstream>
#include <string>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/core/buffer.hpp"
#include "loom/core/error.hpp"
#include "loom/core/memory.hpp"
#include "loom/core/tensor.hpp"

namespace test_core {

using namespace loom;

TEST_CASE("Shape: extents, numel, rows and cols, printing") {
  const Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s.rows() == 6);
  CHECK(s.cols() == 4);
  CHECK(Shape{}.numel() == 1);
  CHECK(Shape{5, 0}.numel() == 0);
  CHECK(s == Shape{2, 3, 4});
  CHECK_FALSE(s == Shape{2, 12});
  std::ostringstream out;
  out << s;
  CHECK(out.str() == "[2, 3, 4]");
  CHECK_THROWS_AS((Shape{1, 2, 3, 4, 5}), Error);
  CHECK_THROWS_AS((Shape{-1}), Error);
}

TEST_CASE("Tensor: views, const conversion, reshape") {
  float data[6] = {0, 1, 2, 3, 4, 5};
  Tensor<float> t(data, {2, 3});
  Tensor<const float> c = t;
  CHECK(c.data() == data);
  CHECK(c[4] == 4.0f);
  CHECK(t.reshape({3, 2}).shape() == Shape{3, 2});
  CHECK_THROWS_AS(t.reshape({4, 2}), Error);
  CHECK_THROWS_WITH_AS(check_shape(c, Shape{3, 2}, "kernel_x", "in"),
                       doctest::Contains("kernel_x: argument in shape: got [2, 3]; expected [3, 2]"),
                       Error);
}

TEST_CASE("Error carries what, value and rule") {
  try {
    LOOM_CHECK(1 + 1 == 3, "arithmetic", 2, "must be 3");
    FAIL("no throw");
  } catch (const Error& e) {
    CHECK(std::string(e.what()) == "loom: arithmetic: got 2; must be 3");
    CHECK(e.subject() == "arithmetic");
    CHECK(e.value() == "2");
    CHECK(e.rule() == "must be 3");
  }
}

TEST_CASE("MemoryTracker: current and peak per category and in total") {
  MemoryTracker m;
  m.add(MemoryCategory::parameters, 100);
  m.add(MemoryCategory::activations, 50);
  m.remove(MemoryCategory::activations, 50);
  m.add(MemoryCategory::gradients, 30);
  CHECK(m.current(MemoryCategory::parameters) == 100);
  CHECK(m.current(MemoryCategory::activations) == 0);
  CHECK(m.peak(MemoryCategory::activations) == 50);
  CHECK(m.current_total() == 130);
  CHECK(m.peak_total() == 150);
  m.reset_peaks();
  CHECK(m.peak_total() == 130);
  std::ostringstream out;
  out << m;
  CHECK(out.str().find("optimizer_state") != std::string::npos);
  CHECK(out.str().find("total") != std::string::npos);
}

TEST_CASE("MemoryTracker::held: what is held now on one line, largest category first") {
  MemoryTracker m;
  CHECK(m.held() == "0.0 MiB");
  m.add(MemoryCategory::parameters, std::size_t{3} << 19);   // 1.5 MiB
  m.add(MemoryCategory::activations, std::size_t{5} << 20);  // 5 MiB
  m.add(MemoryCategory::workspace, 1);
  m.add(MemoryCategory::gradients, 7);
  m.remove(MemoryCategory::gradients, 7);
  CHECK(m.held() == "6.5 MiB (activations 5.0, parameters 1.5, workspace 0.0)");
}

TEST_CASE("cpu backend: an allocation the host cannot make says what the rank holds and loses nothing") {
  cpu be(1);
  Buffer<float, cpu> held(be, std::int64_t{1} << 20, MemoryCategory::parameters);  // 4 MiB
  // More than any host has (the sanitizer presets let the allocator return null for it).
  CHECK_THROWS_WITH_AS(be.allocate(std::size_t{1} << 60, MemoryCategory::activations),
                       doctest::Contains("cpu allocate (activations): got 1152921504606846976 bytes; the host is "
                                         "out of memory: this rank holds 4.0 MiB (parameters 4.0); smaller "
                                         "micro-batches"),
                       Error);
  // Within the alignment of the largest size: rounding it up would wrap around to a small block.
  CHECK_THROWS_WITH_AS(be.allocate(std::numeric_limits<std::size_t>::max() - 3, MemoryCategory::workspace),
                       doctest::Contains("the host is out of memory"), Error);
  CHECK(be.memory().current_total() == held.bytes());
  CHECK(be.memory().peak_total() == held.bytes());
}

TEST_CASE("Buffer: accounted while alive, move-only") {
  cpu be(1);
  {
    Buffer<float, cpu> a(be, 10, MemoryCategory::gradients);
    CHECK(be.memory().current(MemoryCategory::gradients) == 40);
    Buffer<float, cpu> b = std::move(a);
    CHECK(a.data() == nullptr);
    CHECK(be.memory().current(MemoryCategory::gradients) == 40);
    b.zero();
    CHECK(b.view()[9] == 0.0f);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % cpu::alignment == 0);
    CHECK_THROWS_AS(b.view(8, Shape{3}), Error);
  }
  CHECK(be.memory().current(MemoryCategory::gradients) == 0);
  CHECK(be.memory().peak(MemoryCategory::gradients) == 40);
}

TEST_CASE("cpu backend rejects a negative thread count") {
  CHECK_THROWS_AS(cpu(-1), Error);
  CHECK(cpu(0).threads() >= 1);
}

}  // namespace test_core
