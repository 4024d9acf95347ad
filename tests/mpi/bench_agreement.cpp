// The per-call cost of loom::mpi::Communicator over raw MPI, for a small and a large all_reduce,
// with and without the agreement check. Not a test; run by hand, e.g.
//   mpiexec -n 2 build/release/tests/mpi/bench_mpi_agreement
// Prints microseconds per call (rank 0), the best of 5 repetitions (the machine may be shared).
#include <loom/comm/mpi.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

namespace {

template <class Body>
double microseconds_per_call(MPI_Comm comm, int calls, Body&& body) {
  std::vector<double> samples;
  for (int repetition = 0; repetition < 5; ++repetition) {
    MPI_Barrier(comm);
    const auto begin = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) body();
    const auto end = std::chrono::steady_clock::now();
    double seconds = std::chrono::duration<double>(end - begin).count();
    MPI_Allreduce(MPI_IN_PLACE, &seconds, 1, MPI_DOUBLE, MPI_MAX, comm);
    samples.push_back(seconds * 1e6 / calls);
  }
  std::sort(samples.begin(), samples.end());
  return samples.front();
}

}  // namespace

int main(int argc, char** argv) {
  loom::mpi::Environment environment(argc, argv);
  auto checked = loom::mpi::Communicator::world({.check_agreement = true});
  auto unchecked = loom::mpi::Communicator::world({.check_agreement = false});
  const int rank = checked.rank();
  const int small_calls = argc > 1 ? std::atoi(argv[1]) : 2000;
  for (std::size_t count : {std::size_t{1}, std::size_t{64}, std::size_t{256}, std::size_t{1} << 22}) {
    std::vector<float> data(count, 1.0f);
    const int calls = count > 4096 ? 10 : small_calls;
    const double raw = microseconds_per_call(MPI_COMM_WORLD, calls, [&] {
      MPI_Allreduce(MPI_IN_PLACE, data.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    });
    const double off = microseconds_per_call(MPI_COMM_WORLD, calls, [&] { unchecked.all_reduce(std::span<float>(data)); });
    const double on = microseconds_per_call(MPI_COMM_WORLD, calls, [&] { checked.all_reduce(std::span<float>(data)); });
    if (rank == 0)
      std::printf("ranks=%d count=%zu  MPI_Allreduce %.2f us  loom check_agreement=false %.2f us  "
                  "check_agreement=true %.2f us\n",
                  checked.size(), count, raw, off, on);
  }
  return 0;
}
