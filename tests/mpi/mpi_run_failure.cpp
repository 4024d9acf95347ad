// mpi::run when one rank throws (run by check_run_failure.cmake under mpiexec, label "mpi"):
// rank 1 throws before its first collective; every other rank is waiting in one and must raise
// "rank 1 failed: boom on purpose" instead of hanging, print it, and return non-zero; no rank
// calls MPI_Abort, so every rank prints its line.
#include <loom/comm/mpi.hpp>

#include <chrono>
#include <span>
#include <stdexcept>
#include <vector>

int main(int argc, char** argv) {
  return loom::mpi::run(
      argc, argv,
      [](loom::mpi::Communicator& world) {
        if (world.rank() == 1) throw std::runtime_error("boom on purpose");
        std::vector<float> data(16, 1.0f);
        world.all_reduce(std::span<float>(data));
        auto half = world.split(world.rank() % 2, world.rank());  // not reached: rank 1 is missing
      },
      {.timeout = std::chrono::seconds(60)});
}
