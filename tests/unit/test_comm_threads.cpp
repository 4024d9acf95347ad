// loom::threads::Communicator: the conformance suite for 1 to 8 ranks, then what only the
// threads communicator can show in one process: exact reduction order, and failures (an
// exception, disagreeing ranks, a timeout, a rank that returned) turned into errors everywhere.
#include <doctest/doctest.h>

#include <chrono>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/conformance.hpp"
#include "loom/comm/threads.hpp"
#include "support/gradcheck.hpp"

namespace test_comm_threads {

namespace {

using loom::threads::Communicator;
using namespace std::chrono_literals;

bool contains(const std::string& text, const std::string& fragment) { return text.find(fragment) != std::string::npos; }

//! Runs a conformance check on `n` ranks and reports every rank's failures.
template <class Check>
void conform(int n, Check check) {
  CAPTURE(n);
  std::vector<conformance::Failures> failures(static_cast<std::size_t>(n));
  loom::threads::run(n, [&](Communicator& comm) { failures[static_cast<std::size_t>(comm.rank())] = check(comm); });
  conformance::report(failures);
}

//! What one rank saw: the text of the loom::Error it caught (rethrown), or "".
struct Seen {
  std::vector<std::string> messages;
  explicit Seen(int n) : messages(static_cast<std::size_t>(n)) {}
  template <class Body>
  void record(const Communicator& comm, Body&& body) {
    try {
      body();
    } catch (const loom::Error& e) {
      messages[static_cast<std::size_t>(comm.rank())] = e.what();
      throw;
    }
  }
  const std::string& operator[](int rank) const { return messages[static_cast<std::size_t>(rank)]; }
};

//! The what() of the loom::Error that `call` throws, or "" (and a failed check) if none.
template <class Call>
std::string error_of(Call&& call) {
  try {
    call();
  } catch (const loom::Error& e) {
    return e.what();
  }
  FAIL_CHECK("expected a loom::Error");
  return {};
}

}  // namespace

static_assert(loom::Communicator<Communicator>);

TEST_CASE("threads conformance: every collective, type and length on 1 to 8 ranks") {
  for (int n = 1; n <= 8; ++n) conform(n, [](Communicator& comm) { return conformance::run_all(comm); });
}

TEST_CASE("threads conformance: a 64 MiB all_reduce on 2 and 8 ranks") {
  for (int n : {2, 8}) conform(n, [](Communicator& comm) { return conformance::check_large(comm); });
}

TEST_CASE("threads: reductions fold in rank order, so every rank gets the same bits on every run") {
  constexpr int n = 5;
  constexpr std::size_t count = 10007;
  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < n; ++r) inputs.push_back(loom::test::random_vector<float>(count, 100 + static_cast<std::uint64_t>(r)));
  std::vector<float> reference(count), maximum(count);
  std::vector<loom::bf16> reference_bf16(count);
  for (std::size_t i = 0; i < count; ++i) {
    float sum = inputs[0][i], largest = inputs[0][i];
    float sum_of_rounded = static_cast<float>(loom::bf16(inputs[0][i]));
    for (int r = 1; r < n; ++r) {
      sum += inputs[static_cast<std::size_t>(r)][i];
      largest = std::max(largest, inputs[static_cast<std::size_t>(r)][i]);
      sum_of_rounded += static_cast<float>(loom::bf16(inputs[static_cast<std::size_t>(r)][i]));
    }
    reference[i] = sum;
    maximum[i] = largest;
    reference_bf16[i] = loom::bf16(sum_of_rounded / n);
  }
  for (int repeat = 0; repeat < 3; ++repeat) {
    std::vector<std::vector<float>> sums(n), maxima(n);
    std::vector<std::vector<loom::bf16>> averages(n);
    loom::threads::run(n, [&](Communicator& comm) {
      const auto r = static_cast<std::size_t>(comm.rank());
      sums[r] = inputs[r];
      maxima[r] = inputs[r];
      averages[r].resize(count);
      for (std::size_t i = 0; i < count; ++i) averages[r][i] = loom::bf16(inputs[r][i]);
      comm.all_reduce(std::span<float>(sums[r]));
      loom::Request request = comm.all_reduce_async(std::span<float>(maxima[r]), loom::ReduceOp::max);
      comm.all_reduce(std::span<loom::bf16>(averages[r]), loom::ReduceOp::average);
      request.wait();
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(std::memcmp(sums[static_cast<std::size_t>(r)].data(), reference.data(), count * sizeof(float)) == 0);
      CHECK(std::memcmp(maxima[static_cast<std::size_t>(r)].data(), maximum.data(), count * sizeof(float)) == 0);
      CHECK(std::memcmp(averages[static_cast<std::size_t>(r)].data(), reference_bf16.data(), count * 2) == 0);
    }
  }
}

TEST_CASE("threads: a communicator moves, with its requests in flight") {
  loom::threads::run(3, [](Communicator& world) {
    std::vector<float> data(1000, 1.0f);
    loom::Request request = world.all_reduce_async(std::span<float>(data));
    Communicator moved = std::move(world);
    request.wait();
    moved.barrier();
    Communicator assigned = moved.split(0, 0);
    assigned = std::move(moved);
    assigned.all_reduce(std::span<float>(data));
    if (data[999] != 9.0f) throw std::runtime_error("wrong sum after moves: " + std::to_string(data[999]));
    // A request destroyed without wait() waits for its collective.
    { loom::Request dropped = assigned.all_reduce_async(std::span<float>(data)); }
    if (data[0] != 27.0f) throw std::runtime_error("dropped request did not complete");
  });
}

TEST_CASE("threads: run rejects fewer than one rank, split a negative color") {
  loom::test::expect_error([] { loom::threads::run(0, [](Communicator&) {}); }, "threads::run: ranks: got 0");
  loom::test::expect_error([] { loom::threads::run(-3, [](Communicator&) {}); }, "must be >= 1");
  loom::test::expect_error([] { loom::threads::run(2, [](Communicator& comm) { (void)comm.split(-1, 0); }); },
                           "split color: got -1; must be >= 0");
  loom::test::expect_error([] { loom::threads::run(1, [](Communicator&) {}, {.timeout = 0ms}); }, "timeout");
}

TEST_CASE("threads: an exception on one rank fails every other rank, and run rethrows it") {
  constexpr int n = 4;
  Seen seen(n);
  std::vector<std::chrono::milliseconds> poisoned_call(n, 0ms);
  CHECK_THROWS_WITH_AS(loom::threads::run(n,
                                          [&](Communicator& comm) {
                                            Communicator parity = comm.split(comm.rank() % 2, 0);
                                            const int rank = comm.rank();
                                            if (rank == 3) {
                                              std::this_thread::sleep_for(50ms);
                                              throw std::runtime_error("boom on three");
                                            }
                                            try {
                                              seen.record(comm, [&] {
                                                std::vector<float> data(64, 1.0f);
                                                if (rank == 1) parity.all_reduce(std::span<float>(data));  // with 3
                                                if (rank == 0) comm.barrier();
                                                if (rank == 2) comm.recv(std::span<float>(data), 3);
                                              });
                                            } catch (const loom::Error&) {
                                              // The world stays poisoned: the next call throws at once.
                                              const auto start = std::chrono::steady_clock::now();
                                              try {
                                                comm.barrier();
                                              } catch (const loom::Error&) {
                                              }
                                              poisoned_call[static_cast<std::size_t>(rank)] =
                                                  std::chrono::duration_cast<std::chrono::milliseconds>(
                                                      std::chrono::steady_clock::now() - start);
                                              throw;
                                            }
                                          }),
                       "boom on three", std::runtime_error);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(contains(seen[r], "threads communicator: rank 3 failed: boom on three"));
    CHECK(poisoned_call[static_cast<std::size_t>(r)] < 100ms);
  }
}

TEST_CASE("threads: an exception reaches ranks waiting on asynchronous requests") {
  Seen seen(3);
  CHECK_THROWS_WITH_AS(loom::threads::run(3,
                                          [&](Communicator& comm) {
                                            if (comm.rank() == 0) throw std::logic_error("rank zero gives up");
                                            seen.record(comm, [&] {
                                              std::vector<double> data(10, 1.0);
                                              loom::Request request = comm.all_reduce_async(std::span<double>(data));
                                              request.wait();
                                            });
                                          }),
                       "rank zero gives up", std::logic_error);
  CHECK(contains(seen[1], "rank 0 failed: rank zero gives up"));
  CHECK(contains(seen[2], "rank 0 failed: rank zero gives up"));
}

TEST_CASE("threads: ranks that disagree on the operation or the count fail, naming both calls") {
  SUBCASE("operation") {
    Seen seen(2);
    const std::string error = error_of([&] {
      loom::threads::run(2, [&](Communicator& comm) {
        seen.record(comm, [&] {
          std::vector<float> data(10), gathered(6);
          if (comm.rank() == 0) comm.all_reduce(std::span<float>(data));
          if (comm.rank() == 1) comm.all_gather(std::span<float>(data).first(3), std::span<float>(gathered));
        });
      });
    });
    const std::string expected =
        "threads communicator: ranks disagree: rank 0 called all_reduce(count=10, float32, sum), rank 1 called "
        "all_gather(count=3, float32)";
    CHECK(contains(error, expected));
    CHECK(contains(seen[0], expected));
    CHECK(contains(seen[1], expected));
  }
  SUBCASE("count") {
    Seen seen(3);
    const std::string error = error_of([&] {
      loom::threads::run(3, [&](Communicator& comm) {
        seen.record(comm, [&] {
          std::vector<float> data(comm.rank() == 2 ? 11 : 10);
          comm.all_reduce(std::span<float>(data));
        });
      });
    });
    const std::string expected = "rank 0 called all_reduce(count=10, float32, sum), rank 2 called all_reduce(count=11, float32, sum)";
    CHECK(contains(error, expected));
    for (int r = 0; r < 3; ++r) CHECK(contains(seen[r], expected));
  }
  SUBCASE("type, operator, root and split") {
    auto disagreement = [](auto body) { return error_of([&] { loom::threads::run(2, body); }); };
    CHECK(contains(disagreement([](Communicator& comm) {
                     std::vector<float> f(4);
                     std::vector<double> d(4);
                     if (comm.rank() == 0) comm.all_reduce(std::span<float>(f));
                     else comm.all_reduce(std::span<double>(d));
                   }),
                   "rank 1 called all_reduce(count=4, float64, sum)"));
    CHECK(contains(disagreement([](Communicator& comm) {
                     std::vector<float> f(4);
                     comm.all_reduce(std::span<float>(f), comm.rank() == 0 ? loom::ReduceOp::sum : loom::ReduceOp::max);
                   }),
                   "rank 1 called all_reduce(count=4, float32, max)"));
    CHECK(contains(disagreement([](Communicator& comm) {
                     std::vector<float> f(4);
                     comm.broadcast(std::span<float>(f), comm.rank());
                   }),
                   "rank 0 called broadcast(count=4, float32, root=0), rank 1 called broadcast(count=4, float32, root=1)"));
    CHECK(contains(disagreement([](Communicator& comm) {
                     if (comm.rank() == 0) (void)comm.split(0, 0);
                     else comm.barrier();
                   }),
                   "rank 0 called split(color=0, key=0), rank 1 called barrier(count=0, float32)"));
  }
}

TEST_CASE("threads: a rank missing for longer than the timeout is named by the others") {
  Seen seen(3);
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of([&] {
    loom::threads::run(
        3,
        [&](Communicator& comm) {
          if (comm.rank() == 2) std::this_thread::sleep_for(600ms);
          seen.record(comm, [&] {
            std::vector<float> data(4);
            comm.all_reduce(std::span<float>(data));
          });
        },
        {.timeout = 200ms});
  });
  const auto elapsed = std::chrono::steady_clock::now() - start;
  const std::string expected = "rank 2 did not arrive at all_reduce(count=4, float32, sum) within 200 ms";
  CHECK(contains(error, expected));
  CHECK(contains(seen[0], expected));
  CHECK(contains(seen[1], expected));
  CHECK(contains(seen[2], expected));  // arrived late, into a poisoned world
  CHECK(elapsed < 2s);
}

TEST_CASE("threads: a recv whose sender never comes times out, naming it") {
  const std::string error = error_of([&] {
    loom::threads::run(
        2,
        [&](Communicator& comm) {
          std::vector<float> data(3);
          if (comm.rank() == 0) comm.recv(std::span<float>(data), 1, 7);
          else std::this_thread::sleep_for(500ms);
        },
        {.timeout = 150ms});
  });
  CHECK(contains(error, "rank 1 did not send to rank 0 a message matching recv(count=3, float32, peer=1, tag=7) within 150 ms"));
}

TEST_CASE("threads: a rank that returns while the others wait for it fails them at once") {
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of([&] {
    loom::threads::run(3, [&](Communicator& comm) {
      if (comm.rank() == 1) return;
      std::vector<float> data(4);
      comm.all_reduce(std::span<float>(data));
    });
  });
  CHECK(contains(error, "rank 1 returned from its function without arriving at all_reduce(count=4, float32, sum)"));
  CHECK(std::chrono::steady_clock::now() - start < 5s);

  const std::string unmatched = error_of([&] {
    loom::threads::run(2, [&](Communicator& comm) {
      std::vector<float> data(4);
      if (comm.rank() == 0) comm.send(std::span<float>(data), 1, 3);
    });
  });
  CHECK(contains(unmatched, "rank 1 returned from its function without receive send(count=4, float32, peer=1, tag=3)"));
}

TEST_CASE("threads: a send and a recv of different sizes fail on both sides, naming both counts") {
  Seen seen(2);
  for (bool receiver_first : {false, true}) {
    CAPTURE(receiver_first);
    const std::string error = error_of([&] {
      loom::threads::run(2, [&](Communicator& comm) {
        seen.record(comm, [&] {
          std::vector<float> data(10);
          if (comm.rank() == 0) {
            if (receiver_first) std::this_thread::sleep_for(30ms);
            comm.send(std::span<float>(data), 1);
          } else {
            if (!receiver_first) std::this_thread::sleep_for(30ms);
            comm.recv(std::span<float>(data).first(5), 0);
          }
        });
      });
    });
    const std::string expected =
        "send and recv disagree: rank 0 called send(count=10, float32, peer=1, tag=0), rank 1 called "
        "recv(count=5, float32, peer=0, tag=0)";
    CHECK(contains(error, expected));
    CHECK(contains(seen[0], expected));
    CHECK(contains(seen[1], expected));
  }
}

TEST_CASE("threads: exchanging with send_async then recv does not deadlock, for many rounds") {
  conform(2, [](Communicator& comm) {
    conformance::Failures failures;
    const int peer = 1 - comm.rank();
    std::vector<double> out(257), in(257);
    for (int round = 0; round < 200; ++round) {
      for (std::size_t i = 0; i < out.size(); ++i) out[i] = comm.rank() * 1000 + round + static_cast<double>(i);
      loom::Request sent = comm.send_async(std::span<const double>(out), peer, round % 3);
      comm.recv(std::span<double>(in), peer, round % 3);
      sent.wait();
      if (in[5] != peer * 1000 + round + 5) failures.push_back("round " + std::to_string(round) + ": wrong data");
    }
    return failures;
  });
}

}  // namespace test_comm_threads
