// Uses loom added with add_subdirectory(): the counter-based RNG and the CPU backend.
#include <loom/backend/cpu/cpu.hpp>
#include <loom/core/rng.hpp>

#include <cstdio>

int main() {
  const loom::CounterRng rng(2026, "consumer.weights");
  const loom::CounterRng again(2026, "consumer.weights");
  double sum = 0;
  for (int i = 0; i < 1000; ++i) {
    const double u = rng.uniform(i);
    if (!(u > 0.0 && u < 1.0) || u != again.uniform(i)) {
      std::puts("loom consumer: uniform draw out of range or not reproducible");
      return 1;
    }
    sum += u;
  }

  loom::cpu backend(1);
  void* block = backend.allocate(1024, loom::MemoryCategory::workspace);
  backend.fill_zero(block, 1024);
  const auto held = backend.memory().current(loom::MemoryCategory::workspace);
  backend.deallocate(block, 1024, loom::MemoryCategory::workspace);
  if (held != 1024 || backend.memory().current(loom::MemoryCategory::workspace) != 0) {
    std::puts("loom consumer: memory accounting is off");
    return 1;
  }

  std::printf("loom consumer: ok (mean of 1000 uniforms %.3f, %d cpu thread)\n", sum / 1000,
              backend.threads());
  return 0;
}
