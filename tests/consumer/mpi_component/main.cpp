// Compiles and links against MPI through loom::mpi. It asks only for the library's version,
// which MPI allows before MPI_Init, so it runs without a launcher.
#include <loom/core/rng.hpp>

#include <mpi.h>

#include <cstdio>

int main() {
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  if (MPI_Get_library_version(version, &length) != MPI_SUCCESS || length <= 0) {
    std::puts("loom mpi consumer: MPI_Get_library_version failed");
    return 1;
  }
  const loom::CounterRng rng(7, "consumer.mpi");
  std::printf("loom mpi consumer: ok (uniform %.3f; %.*s)\n", rng.uniform(0),
              length > 60 ? 60 : length, version);
  return 0;
}
