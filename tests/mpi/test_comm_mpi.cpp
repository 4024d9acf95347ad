// loom::mpi::Communicator under mpiexec (8 ranks, label "mpi"): collectives of every kind and
// type, many in flight at once, Environment nesting, split, the conformance suite on every
// sub-group size and through an AnyCommunicator, and the ways it fails loudly: ranks that
// disagree, a rank that arrives too late, a rank that throws. Every rank runs every test case in
// the same order; a case that expects an error checks it on every rank and ends with all ranks
// in step again.

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <loom/comm/any.hpp>
#include <loom/comm/mpi.hpp>

#include <chrono>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if __has_include("comm/conformance.hpp")
#include "comm/conformance.hpp"
#define LOOM_HAVE_CONFORMANCE 1
#endif

using namespace std::chrono_literals;
using loom::bf16;
using loom::CommOptions;
using loom::ReduceOp;
namespace mpi = loom::mpi;

namespace {

//! The options of the communicators that must work: a generous timeout, so that an
//! oversubscribed machine is never mistaken for a missing rank.
constexpr CommOptions working{.timeout = std::chrono::seconds(60), .check_agreement = true};

//! The world communicator of the test cases that must work (made once in main).
mpi::Communicator* world_pointer = nullptr;
mpi::Communicator& world() { return *world_pointer; }

//! The text of the loom::Error `call` throws, or "(no error)".
template <class Call>
std::string error_of(Call&& call) {
  try {
    call();
  } catch (const loom::Error& e) {
    return e.what();
  }
  return "(no error)";
}

bool contains(const std::string& text, const std::string& fragment) { return text.find(fragment) != std::string::npos; }

template <class T>
T value(double x) {
  return T(x);
}

template <class T>
double as_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}
template <>
double as_double<double>(double x) {
  return x;
}

//! Small integers, exact in bf16 and in every sum of 8 of them.
double pattern(int rank, std::size_t i) { return static_cast<double>((rank + static_cast<int>(i)) % 5); }

}  // namespace

TEST_CASE("mpi: Environment nests; the world matches MPI_COMM_WORLD") {
  {
    mpi::Environment inner;
    CHECK_FALSE(inner.owns());
    CHECK(inner.thread_level() >= MPI_THREAD_FUNNELED);
  }
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  CHECK(initialized);
  CHECK_FALSE(finalized);

  int rank = -1, size = -1, comparison = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  CHECK(world().rank() == rank);
  CHECK(world().size() == size);
  MPI_Comm_compare(world().native(), MPI_COMM_WORLD, &comparison);
  CHECK(comparison == MPI_CONGRUENT);  // a duplicate, not MPI_COMM_WORLD itself
  CHECK(world().options() == working);

  mpi::Communicator moved = mpi::Communicator::world(working);
  mpi::Communicator target = std::move(moved);
  CHECK(target.size() == size);
  CHECK(contains(error_of([&] { (void)moved.rank(); }), "moved-from"));
}

TEST_CASE_TEMPLATE("mpi: all_reduce, reduce_scatter, all_gather, broadcast", T, float, double, bf16) {
  auto& comm = world();
  const int rank = comm.rank(), size = comm.size();
  const std::size_t n = 7;

  for (ReduceOp op : {ReduceOp::sum, ReduceOp::average, ReduceOp::max}) {
    CAPTURE(loom::name(op));
    std::vector<T> data(n);
    for (std::size_t i = 0; i < n; ++i) data[i] = value<T>(pattern(rank, i));
    comm.all_reduce(std::span<T>(data), op);
    for (std::size_t i = 0; i < n; ++i) {
      double sum = 0, max = 0;
      for (int r = 0; r < size; ++r) sum += pattern(r, i), max = std::max(max, pattern(r, i));
      const double expected = op == ReduceOp::sum ? sum : op == ReduceOp::max ? max : sum / size;
      CHECK(as_double(data[i]) == doctest::Approx(as_double(value<T>(expected))).epsilon(1e-6));
    }
  }

  for (bool in_place : {false, true}) {
    CAPTURE(in_place);
    std::vector<T> input(n * static_cast<std::size_t>(size)), separate(n);
    for (std::size_t j = 0; j < input.size(); ++j) input[j] = value<T>(pattern(rank, j));
    std::span<T> output = in_place ? std::span<T>(input).subspan(static_cast<std::size_t>(rank) * n, n) : std::span<T>(separate);
    comm.reduce_scatter(std::span<const T>(input), output, ReduceOp::sum);
    for (std::size_t i = 0; i < n; ++i) {
      double sum = 0;
      for (int r = 0; r < size; ++r) sum += pattern(r, static_cast<std::size_t>(rank) * n + i);
      CHECK(as_double(output[i]) == sum);
    }
  }

  for (bool in_place : {false, true}) {
    CAPTURE(in_place);
    std::vector<T> output(n * static_cast<std::size_t>(size)), separate(n);
    std::span<T> input = in_place ? std::span<T>(output).subspan(static_cast<std::size_t>(rank) * n, n) : std::span<T>(separate);
    for (std::size_t i = 0; i < n; ++i) input[i] = value<T>(rank * 10 + static_cast<int>(i));
    comm.all_gather(std::span<const T>(input), std::span<T>(output));
    for (int r = 0; r < size; ++r)
      for (std::size_t i = 0; i < n; ++i) CHECK(as_double(output[static_cast<std::size_t>(r) * n + i]) == r * 10 + static_cast<int>(i));
  }

  for (int root = 0; root < size; ++root) {
    std::vector<T> data(n, value<T>(rank == root ? 3.0 : -1.0));
    comm.broadcast(std::span<T>(data), root);
    for (const T& x : data) CHECK(as_double(x) == 3.0);
  }
}

TEST_CASE("mpi: send and recv around a ring; barrier") {
  auto& comm = world();
  const int rank = comm.rank(), size = comm.size();
  const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
  std::vector<double> out(1000, rank), in(1000, -1);
  loom::Request receive = comm.recv_async(std::span<double>(in), previous, 5);
  comm.send(std::span<const double>(out), next, 5);
  receive.wait();
  CHECK(in.front() == previous);
  CHECK(in.back() == previous);
  comm.barrier();
}

TEST_CASE("mpi: many collectives in flight, waited in any order") {
  auto& comm = world();
  const int rank = comm.rank(), size = comm.size();
  constexpr int in_flight = 24;
  std::vector<std::vector<float>> sums(in_flight);
  std::vector<std::vector<bf16>> maxima(in_flight);
  std::vector<std::vector<double>> gathered(in_flight);
  std::vector<double> mine(in_flight);
  std::vector<loom::Request> requests;
  for (int k = 0; k < in_flight; ++k) {
    sums[k].assign(static_cast<std::size_t>(1 + 997 * k), static_cast<float>(rank + k));
    maxima[k].assign(static_cast<std::size_t>(1 + k), bf16(static_cast<float>(rank)));
    mine[k] = rank * 100 + k;
    gathered[k].assign(static_cast<std::size_t>(size), -1);
    requests.push_back(comm.all_reduce_async(std::span<float>(sums[k])));
    requests.push_back(comm.all_reduce_async(std::span<bf16>(maxima[k]), ReduceOp::max));
    requests.push_back(comm.all_gather_async(std::span<const double>(&mine[k], 1), std::span<double>(gathered[k])));
  }
  // Odd requests by polling, the others waited from the last to the first.
  for (std::size_t i = 1; i < requests.size(); i += 2)
    while (!requests[i].test()) std::this_thread::yield();
  for (std::size_t i = requests.size(); i-- > 0;) requests[i].wait();
  for (int k = 0; k < in_flight; ++k) {
    CAPTURE(k);
    const float expected = static_cast<float>(size * k + size * (size - 1) / 2);
    CHECK(sums[k].front() == expected);
    CHECK(sums[k].back() == expected);
    CHECK(static_cast<float>(maxima[k].back()) == static_cast<float>(size - 1));
    for (int r = 0; r < size; ++r) CHECK(gathered[k][static_cast<std::size_t>(r)] == r * 100 + k);
  }
  // A request dropped without a wait waits in its destructor.
  std::vector<float> dropped(10, 1.0f);
  { loom::Request request = comm.all_reduce_async(std::span<float>(dropped)); }
  CHECK(dropped[9] == static_cast<float>(size));
}

TEST_CASE_TEMPLATE("mpi: a large all_reduce (the ring) with every operation, several in flight", T, float, double, bf16) {
  auto& comm = world();
  const int rank = comm.rank(), size = comm.size();
  const std::size_t count = (std::size_t{1} << 20) / sizeof(T) + 3;  // 1 MiB and a ragged end
  const ReduceOp ops[] = {ReduceOp::sum, ReduceOp::average, ReduceOp::max};
  std::vector<std::vector<T>> data(3);
  std::vector<loom::Request> requests;
  for (int k = 0; k < 3; ++k) {
    data[k].resize(count);
    for (std::size_t i = 0; i < count; ++i) data[k][i] = value<T>(rank + static_cast<int>(i % 3));
    requests.push_back(comm.all_reduce_async(std::span<T>(data[k]), ops[k]));
  }
  for (int k = 2; k >= 0; --k) requests[static_cast<std::size_t>(k)].wait();
  const double ranks_sum = size * (size - 1) / 2.0;
  for (std::size_t i : {std::size_t{0}, std::size_t{1}, count / 2, count - 2, count - 1}) {
    CAPTURE(i);
    const double j = static_cast<double>(i % 3);
    CHECK(as_double(data[0][i]) == ranks_sum + size * j);
    CHECK(as_double(data[1][i]) == doctest::Approx(ranks_sum / size + j));
    CHECK(as_double(data[2][i]) == size - 1 + j);
  }
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) wrong += as_double(data[0][i]) != ranks_sum + size * static_cast<double>(i % 3);
  CHECK(wrong == 0);
}

TEST_CASE("mpi: split into every group size; the conformance suite on each") {
  auto& comm = world();
  const int rank = comm.rank(), size = comm.size();
  for (int k = 1; k <= size; ++k) {
    CAPTURE(k);
    const bool inside = rank < k;
    mpi::Communicator sub = comm.split(inside ? 0 : 1, rank);
    CHECK(sub.size() == (inside ? k : size - k));
    CHECK(sub.rank() == (inside ? rank : rank - k));
    CHECK(sub.options() == comm.options());
    std::vector<float> one{1.0f};
    sub.all_reduce(std::span<float>(one));
    CHECK(one[0] == static_cast<float>(sub.size()));
#ifdef LOOM_HAVE_CONFORMANCE
    if (inside) {
      conformance::Failures failures = conformance::run_all(sub);
      // A large all_reduce runs as a ring (all_reduce of 256 KiB and more): 4 MiB per group.
      for (std::string& failure : conformance::check_large(sub, std::size_t{4} << 20)) failures.push_back(std::move(failure));
      conformance::report(failures, rank);
    }
#endif
  }
  comm.barrier();
}

#ifdef LOOM_HAVE_CONFORMANCE
TEST_CASE("mpi: the conformance suite's large all_reduce on the whole world") {
  conformance::report(conformance::check_large(world()), world().rank());
}
#endif

#ifdef LOOM_HAVE_CONFORMANCE
TEST_CASE("mpi: the conformance suite through an AnyCommunicator viewing the world, and one holding a split") {
  loom::AnyCommunicator any = loom::AnyCommunicator::view(world());
  conformance::report(conformance::run_all(any), world().rank());
  // Held by value: this rank's group of even or odd ranks, which the suite splits again.
  loom::AnyCommunicator odd_even(world().split(world().rank() % 2, world().rank()));
  conformance::report(conformance::run_all(odd_even), world().rank());
  world().barrier();
}
#endif

TEST_CASE("mpi: a count above INT_MAX is an error naming the limit") {
  auto& comm = world();
  const loom::CollectiveCall huge{.kind = loom::Collective::broadcast, .count = std::size_t{1} << 31};
  CHECK(contains(error_of([&] { comm.run(huge); }), "must be at most INT_MAX"));
  comm.barrier();  // not poisoned: the count is checked before any rank talks to another
}

TEST_CASE("mpi: ranks that disagree get an error naming both, on every rank") {
  const int rank = world().rank();
  const CommOptions options{.timeout = std::chrono::seconds(60)};
  std::vector<float> data(10, 1.0f);
  std::vector<float> gathered(3 * static_cast<std::size_t>(world().size()));

  SUBCASE("the reduction") {
    mpi::Communicator comm(MPI_COMM_WORLD, options);
    const std::string error = error_of([&] { comm.all_reduce(std::span<float>(data), rank == 1 ? ReduceOp::max : ReduceOp::sum); });
    CHECK(contains(error, "ranks disagree: rank 0 called all_reduce(count=10, float32, sum), rank 1 called "
                          "all_reduce(count=10, float32, max)"));
    // Poisoned: every later operation fails at once.
    const auto begin = std::chrono::steady_clock::now();
    CHECK(contains(error_of([&] { comm.barrier(); }), "failed earlier"));
    CHECK(std::chrono::steady_clock::now() - begin < 1s);
  }
  SUBCASE("the count") {
    mpi::Communicator comm(MPI_COMM_WORLD, options);
    std::span<float> part = std::span<float>(data).first(rank == 2 ? 3 : 10);
    CHECK(contains(error_of([&] { comm.all_reduce(part); }),
                   "ranks disagree: rank 0 called all_reduce(count=10, float32, sum), rank 2 called "
                   "all_reduce(count=3, float32, sum)"));
  }
  SUBCASE("the operation") {
    mpi::Communicator comm(MPI_COMM_WORLD, options);
    const std::string error = error_of([&] {
      if (rank == 3)
        comm.all_gather(std::span<const float>(data).first(3), std::span<float>(gathered));
      else
        comm.all_reduce(std::span<float>(data));
    });
    CHECK(contains(error, "rank 3 called all_gather(count=3, float32)"));
  }
  SUBCASE("the root of a broadcast") {
    mpi::Communicator comm(MPI_COMM_WORLD, options);
    CHECK(contains(error_of([&] { comm.broadcast(std::span<float>(data), rank == 4 ? 1 : 0); }),
                   "rank 0 called broadcast(count=10, float32, root=0), rank 4 called broadcast(count=10, float32, root=1)"));
  }
  world().barrier();
}

TEST_CASE("mpi: a recv that expects more than was sent is an error") {
  mpi::Communicator comm(MPI_COMM_WORLD, working);
  std::vector<float> data(10, 1.0f);
  if (comm.rank() == 0) comm.send(std::span<const float>(data).first(5), 1, 3);
  if (comm.rank() == 1)
    CHECK(contains(error_of([&] { comm.recv(std::span<float>(data), 0, 3); }), "rank 0 sent 5 elements"));
  world().barrier();
}

TEST_CASE("mpi: a rank that arrives later than the timeout is named by the others") {
  const int rank = world().rank(), late = world().size() - 1;
  for (bool check_agreement : {true, false}) {
    CAPTURE(check_agreement);
    // MPI may still write into the buffer of a collective posted before the timeout (it cannot be
    // cancelled): it outlives the test.
    static std::vector<float> data[2] = {std::vector<float>(4), std::vector<float>(4)};
    mpi::Communicator comm(MPI_COMM_WORLD, {.timeout = 300ms, .check_agreement = check_agreement});
    if (rank == late) std::this_thread::sleep_for(1500ms);
    const auto begin = std::chrono::steady_clock::now();
    const std::string error = error_of([&] { comm.all_reduce(std::span<float>(data[check_agreement])); });
    const auto waited = std::chrono::steady_clock::now() - begin;
    CAPTURE(error);
    if (rank == late) {
      // The others gave up long ago and said so: the late rank fails at once, naming itself.
      CHECK(contains(error, "failed: "));
      CHECK(waited < 1s);
    } else {
      CHECK(waited >= 300ms);
      CHECK(waited < 10s);
    }
    if (check_agreement)
      CHECK(contains(error, "rank " + std::to_string(late) + " did not arrive at all_reduce(count=4, float32, sum) within 300 ms"));
    else
      CHECK(contains(error, "all_reduce(count=4, float32, sum) did not complete within 300 ms"));
    CHECK(contains(error_of([&] { comm.barrier(); }), "failed earlier"));
    world().barrier();
  }
}

TEST_CASE("mpi: an exception on one rank becomes an error on every other rank") {
  const int rank = world().rank(), culprit = 1;
  mpi::Communicator family(MPI_COMM_WORLD, working);
  mpi::Communicator half = family.split(rank % 2, rank);  // the culprit's half and the other
  std::vector<float> data(4, 1.0f);
  if (rank == culprit) {
    // What mpi::run(argc, argv, fn) does with the exception of fn.
    CHECK(mpi::run(family, [](mpi::Communicator&) -> void { throw std::runtime_error("boom on purpose"); }) == 1);
  } else {
    // The culprit's half waits on the sub-communicator, the other half on the family's root:
    // both hear of it.
    const std::string error = rank % 2 == culprit % 2 ? error_of([&] { half.all_reduce(std::span<float>(data)); })
                                                      : error_of([&] { family.barrier(); });
    CHECK(contains(error, "rank 1 failed: boom on purpose"));
    // Every communicator of the family is poisoned now, even one that saw no error itself.
    const auto begin = std::chrono::steady_clock::now();
    CHECK(contains(error_of([&] { half.barrier(); }), "rank 1 failed: boom on purpose"));
    CHECK(std::chrono::steady_clock::now() - begin < 1s);
  }
  world().barrier();
}

int main(int argc, char** argv) {
  mpi::Environment environment(argc, argv);
  int result = 1;
  {
    mpi::Communicator comm = mpi::Communicator::world(working);
    world_pointer = &comm;
    doctest::Context context(argc, argv);
    // Rank 0 reports in full; the other ranks print their failures only.
    if (comm.rank() != 0) {
      context.setOption("minimal", true);
      context.setOption("no-colors", true);
    }
    result = context.run();
    if (context.shouldExit()) return result;
    MPI_Allreduce(MPI_IN_PLACE, &result, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    world_pointer = nullptr;
  }
  return result;
}
