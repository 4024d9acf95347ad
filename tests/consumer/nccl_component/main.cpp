// Links NCCL through loom::nccl; asks only for its version, which needs no GPU.
#include <loom/core/rng.hpp>

#include <nccl.h>

#include <cstdio>

int main() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess || version <= 0) {
    std::puts("loom nccl consumer: ncclGetVersion failed");
    return 1;
  }
  const loom::CounterRng rng(7, "consumer.nccl");
  std::printf("loom nccl consumer: ok (uniform %.3f; NCCL %d)\n", rng.uniform(0), version);
  return 0;
}
