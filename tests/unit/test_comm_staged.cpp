// loom::StagedCommunicator over thread ranks: the conformance suite with a cpu backend per rank
// (buffers in host memory), then, with a backend whose memory the host cannot read directly,
// that every call's data really goes through the backend's copies — blocking and
// asynchronous, in place, in sub-groups and through a CommunicatorRef.
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/conformance.hpp"
#include "loom/backend/cpu/cpu.hpp"
#include "loom/comm/ref.hpp"
#include "loom/comm/staged.hpp"
#include "loom/comm/threads.hpp"

namespace test_comm_staged {

namespace {

//! A cpu backend whose "device" memory holds every byte XOR 0x5A, so that a communicator that
//! read or wrote the caller's buffers itself, instead of through copy_to_host and
//! copy_from_host, would compute on scrambled values. Counts its copies and their bytes.
class ScrambledCpu : public loom::cpu {
 public:
  static constexpr unsigned char key = 0x5A;
  //! The host must not touch this memory directly (see loom::host_addressable).
  static constexpr bool device_memory = true;

  void copy_to_host(void* dst, const void* src, std::size_t bytes) {
    ++to_host;
    to_host_bytes += bytes;
    flip(dst, src, bytes);
  }
  void copy_from_host(void* dst, const void* src, std::size_t bytes) {
    ++from_host;
    from_host_bytes += bytes;
    flip(dst, src, bytes);
  }

  //! The device representation of `plain` (not counted: the test's own bookkeeping).
  static std::vector<float> to_device(const std::vector<float>& plain) {
    std::vector<float> device(plain.size());
    flip(device.data(), plain.data(), plain.size() * sizeof(float));
    return device;
  }
  //! The values behind device memory `device`.
  static std::vector<float> to_plain(std::span<const float> device) {
    std::vector<float> plain(device.size());
    flip(plain.data(), device.data(), device.size() * sizeof(float));
    return plain;
  }

  int to_host = 0, from_host = 0;
  std::size_t to_host_bytes = 0, from_host_bytes = 0;

 private:
  static void flip(void* dst, const void* src, std::size_t bytes) {
    auto* out = static_cast<unsigned char*>(dst);
    const auto* in = static_cast<const unsigned char*>(src);
    for (std::size_t i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>(in[i] ^ key);
  }
};

template <class B>
using Staged = loom::StagedCommunicator<loom::threads::Communicator, B>;

static_assert(loom::Backend<ScrambledCpu>);
static_assert(loom::Communicator<Staged<loom::cpu>>);
static_assert(loom::Communicator<Staged<ScrambledCpu>>);

//! Runs `body(comm, backend)` on `n` thread ranks, each with its own backend `B` and the
//! staged communicator over its thread communicator.
template <class B, class Body>
void run_staged(int n, Body body) {
  loom::threads::run(n, [&](loom::threads::Communicator& world) {
    B backend;  // declared first: outlives the communicator and its requests
    Staged<B> comm{std::move(world), backend};
    body(comm, backend);
  });
}

//! Runs a conformance check on `n` staged ranks with a cpu backend each and reports every
//! rank's failures.
template <class Check>
void conform(int n, Check check) {
  CAPTURE(n);
  std::vector<conformance::Failures> failures(static_cast<std::size_t>(n));
  run_staged<loom::cpu>(n, [&](Staged<loom::cpu>& comm, loom::cpu&) {
    failures[static_cast<std::size_t>(comm.rank())] = check(comm);
  });
  conformance::report(failures);
}

//! Throws (failing the rank, and threads::run rethrows it) unless `ok`.
void expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error(what);
}

//! Rank r's plain values: r·100 + i, exact in float sums.
std::vector<float> values(int rank, std::size_t count) {
  std::vector<float> out(count);
  for (std::size_t i = 0; i < count; ++i) out[i] = static_cast<float>(rank * 100 + static_cast<int>(i));
  return out;
}
//! Sum over ranks [0, n) of values(r, ...)[i].
float sum_of(int n, std::size_t i) {
  float sum = 0;
  for (int r = 0; r < n; ++r) sum += static_cast<float>(r * 100 + static_cast<int>(i));
  return sum;
}

//! The copies made since the last call: `(to_host, from_host)` counts and bytes.
struct CopyCounter {
  ScrambledCpu& backend;
  int to_host = 0, from_host = 0;
  std::size_t to_host_bytes = 0, from_host_bytes = 0;

  void expect_since(int to, int from, std::size_t to_bytes, std::size_t from_bytes, const std::string& what) {
    const int got_to = backend.to_host - to_host, got_from = backend.from_host - from_host;
    const std::size_t got_to_bytes = backend.to_host_bytes - to_host_bytes;
    const std::size_t got_from_bytes = backend.from_host_bytes - from_host_bytes;
    expect(got_to == to && got_from == from && got_to_bytes == to_bytes && got_from_bytes == from_bytes,
           what + ": " + std::to_string(got_to) + " copies to host (" + std::to_string(got_to_bytes) + " bytes) and " +
               std::to_string(got_from) + " from host (" + std::to_string(got_from_bytes) + " bytes), expected " +
               std::to_string(to) + " (" + std::to_string(to_bytes) + ") and " + std::to_string(from) + " (" +
               std::to_string(from_bytes) + ")");
    to_host = backend.to_host;
    from_host = backend.from_host;
    to_host_bytes = backend.to_host_bytes;
    from_host_bytes = backend.from_host_bytes;
  }
};

}  // namespace

TEST_CASE("staged conformance: every collective, type and length on 1 to 8 ranks") {
  for (int n = 1; n <= 8; ++n) conform(n, [](Staged<loom::cpu>& comm) { return conformance::run_all(comm); });
}

TEST_CASE("staged conformance: a 64 MiB all_reduce on 2 and 8 ranks") {
  for (int n : {2, 8}) conform(n, [](Staged<loom::cpu>& comm) { return conformance::check_large(comm); });
}

TEST_CASE("staged: every blocking call's data goes through the backend's copies, once each way") {
  for (int n : {1, 3, 4}) {
    CAPTURE(n);
    run_staged<ScrambledCpu>(n, [n](Staged<ScrambledCpu>& comm, ScrambledCpu& backend) {
      const int rank = comm.rank();
      const auto group = static_cast<std::size_t>(n), own = static_cast<std::size_t>(rank);
      constexpr std::size_t count = 37, bytes = count * sizeof(float);
      CopyCounter copies{backend};

      std::vector<float> data = ScrambledCpu::to_device(values(rank, count));
      comm.all_reduce(std::span<float>(data));
      copies.expect_since(1, 1, bytes, bytes, "all_reduce");
      const std::vector<float> reduced = ScrambledCpu::to_plain(data);
      for (std::size_t i = 0; i < count; ++i) expect(reduced[i] == sum_of(n, i), "all_reduce element " + std::to_string(i));

      // reduce_scatter out of place and in place (the output is this rank's part of the input).
      for (bool in_place : {false, true}) {
        std::vector<float> input = ScrambledCpu::to_device(values(rank, group * count)), separate(count);
        std::span<float> output = in_place ? std::span<float>(input).subspan(own * count, count) : std::span<float>(separate);
        comm.reduce_scatter(std::span<const float>(input), output);
        copies.expect_since(1, 1, group * bytes, bytes, "reduce_scatter");
        const std::vector<float> got = ScrambledCpu::to_plain(output);
        for (std::size_t i = 0; i < count; ++i)
          expect(got[i] == sum_of(n, own * count + i), "reduce_scatter element " + std::to_string(i) +
                                                             (in_place ? " (in place)" : ""));
      }

      // all_gather out of place and in place (the input is this rank's part of the output).
      for (bool in_place : {false, true}) {
        std::vector<float> output(group * count), separate = ScrambledCpu::to_device(values(rank, count));
        std::span<float> input(separate);
        if (in_place) {
          input = std::span<float>(output).subspan(own * count, count);
          std::memcpy(input.data(), separate.data(), bytes);
        }
        comm.all_gather(std::span<const float>(input), std::span<float>(output));
        copies.expect_since(1, 1, bytes, group * bytes, "all_gather");
        const std::vector<float> got = ScrambledCpu::to_plain(output);
        for (int s = 0; s < n; ++s)
          for (std::size_t i = 0; i < count; ++i)
            expect(got[static_cast<std::size_t>(s) * count + i] == static_cast<float>(s * 100 + static_cast<int>(i)),
                   "all_gather part " + std::to_string(s) + (in_place ? " (in place)" : ""));
      }

      // broadcast: only the root stages its data, only the others copy the result back.
      const int root = n - 1;
      std::vector<float> broadcast = ScrambledCpu::to_device(values(rank, count));
      comm.broadcast(std::span<float>(broadcast), root);
      if (rank == root)
        copies.expect_since(1, 0, bytes, 0, "broadcast root");
      else
        copies.expect_since(0, 1, 0, bytes, "broadcast non-root");
      expect(ScrambledCpu::to_plain(broadcast) == values(root, count), "broadcast values");

      // send/recv around a ring: the sender stages, the receiver copies back.
      if (n > 1) {
        std::vector<float> out = ScrambledCpu::to_device(values(rank, count)), in(count);
        const int next = (rank + 1) % n, previous = (rank + n - 1) % n;
        if (rank % 2 == 0) {
          comm.send(std::span<const float>(out), next, 3);
          comm.recv(std::span<float>(in), previous, 3);
        } else {
          comm.recv(std::span<float>(in), previous, 3);
          comm.send(std::span<const float>(out), next, 3);
        }
        copies.expect_since(1, 1, bytes, bytes, "send + recv");
        expect(ScrambledCpu::to_plain(in) == values(previous, count), "recv values");
      }

      // Nothing to move: no copies.
      std::vector<float> empty;
      comm.all_reduce(std::span<float>(empty));
      comm.all_gather(std::span<const float>(empty), std::span<float>(empty));
      comm.barrier();
      copies.expect_since(0, 0, 0, 0, "empty calls and barrier");
    });
  }
}

TEST_CASE("staged: asynchronous calls copy the result back when wait() or test() sees them complete") {
  constexpr int n = 4;
  run_staged<ScrambledCpu>(n, [](Staged<ScrambledCpu>& comm, ScrambledCpu& backend) {
    const int rank = comm.rank();
    const auto own = static_cast<std::size_t>(rank);
    constexpr std::size_t count = 301;
    CopyCounter copies{backend};

    // Completed by wait(), several in flight, one blocking call between them.
    std::vector<float> a = ScrambledCpu::to_device(values(rank, count));
    std::vector<float> b = ScrambledCpu::to_device(values(rank, count + 1));
    std::vector<float> c = ScrambledCpu::to_device(values(rank, count + 2));
    loom::Request request_a = comm.all_reduce_async(std::span<float>(a));
    loom::Request request_b = comm.all_reduce_async(std::span<float>(b));
    comm.all_reduce(std::span<float>(c));
    request_b.wait();
    request_a.wait();
    expect(request_a.done() && request_b.done(), "requests not done after wait()");
    copies.expect_since(3, 3, (3 * count + 3) * sizeof(float), (3 * count + 3) * sizeof(float), "two async + one blocking");
    for (const auto* device : {&a, &b, &c}) {
      const std::vector<float> got = ScrambledCpu::to_plain(*device);
      for (std::size_t i = 0; i < got.size(); ++i) expect(got[i] == sum_of(n, i), "all_reduce_async element " + std::to_string(i));
    }

    // Completed by polling test(): reduce_scatter in place and all_gather in place.
    std::vector<float> scatter = ScrambledCpu::to_device(values(rank, n * count));
    std::vector<float> gather(n * count);
    const std::vector<float> mine = ScrambledCpu::to_device(values(rank, count));
    std::memcpy(gather.data() + own * count, mine.data(), count * sizeof(float));
    std::vector<loom::Request> requests;
    requests.push_back(comm.reduce_scatter_async(std::span<const float>(scatter),
                                                 std::span<float>(scatter).subspan(own * count, count)));
    requests.push_back(comm.all_gather_async(std::span<const float>(gather).subspan(own * count, count),
                                             std::span<float>(gather)));
    for (;;) {
      bool all_done = true;
      for (auto& request : requests) all_done = request.test() && all_done;
      if (all_done) break;
      std::this_thread::yield();
    }
    copies.expect_since(2, 2, (n * count + count) * sizeof(float), (count + n * count) * sizeof(float), "polled");
    const std::vector<float> scattered = ScrambledCpu::to_plain(std::span<const float>(scatter).subspan(own * count, count));
    for (std::size_t i = 0; i < count; ++i)
      expect(scattered[i] == sum_of(n, own * count + i), "reduce_scatter_async element " + std::to_string(i));
    const std::vector<float> gathered = ScrambledCpu::to_plain(gather);
    for (int s = 0; s < n; ++s)
      for (std::size_t i = 0; i < count; ++i)
        expect(gathered[static_cast<std::size_t>(s) * count + i] == static_cast<float>(s * 100 + static_cast<int>(i)),
               "all_gather_async part " + std::to_string(s));

    // Point to point, started, around a ring (send_async first on every rank).
    const int next = (rank + 1) % n, previous = (rank + n - 1) % n;
    std::vector<float> out = ScrambledCpu::to_device(values(rank, count)), in(count);
    loom::Request sent = comm.send_async(std::span<const float>(out), next, 7);
    loom::Request received = comm.recv_async(std::span<float>(in), previous, 7);
    received.wait();
    sent.wait();
    expect(ScrambledCpu::to_plain(in) == values(previous, count), "recv_async values");
    copies.expect_since(1, 1, count * sizeof(float), count * sizeof(float), "send_async + recv_async");

    // The same ring as one group: the send staged in at the start, the receive copied out at the
    // end.
    std::vector<float> group_out = ScrambledCpu::to_device(values(rank, count + 3)), group_in(count + 3);
    const std::array ring{comm.send_call(std::span<const float>(group_out), next, 8),
                          comm.recv_call(std::span<float>(group_in), previous, 8)};
    std::vector<loom::Request> done = comm.start_group(ring);
    loom::wait_all(done);
    expect(ScrambledCpu::to_plain(group_in) == values(previous, count + 3), "start_group values");
    copies.expect_since(1, 1, (count + 3) * sizeof(float), (count + 3) * sizeof(float), "start_group");

    // A request destroyed without wait() completes, copy back included; one in flight
    // survives moving the communicator.
    std::vector<float> dropped = ScrambledCpu::to_device(values(rank, count));
    { loom::Request request = comm.broadcast_async(std::span<float>(dropped), 0); }
    expect(ScrambledCpu::to_plain(dropped) == values(0, count), "dropped broadcast_async values");
    std::vector<float> moved = ScrambledCpu::to_device(values(rank, count));
    loom::Request in_flight = comm.all_reduce_async(std::span<float>(moved));
    Staged<ScrambledCpu> other = std::move(comm);
    in_flight.wait();
    const std::vector<float> after_move = ScrambledCpu::to_plain(moved);
    for (std::size_t i = 0; i < count; ++i) expect(after_move[i] == sum_of(n, i), "all_reduce_async across a move");
    other.barrier();
  });
}

TEST_CASE("staged: split into 2 x 2 groups, and a split of those, still stage through the backend") {
  constexpr int n = 4;
  run_staged<ScrambledCpu>(n, [](Staged<ScrambledCpu>& comm, ScrambledCpu& backend) {
    const int rank = comm.rank();
    Staged<ScrambledCpu> pair = comm.split(rank / 2, rank);
    expect(pair.size() == 2 && pair.rank() == rank % 2, "pair group is rank " + std::to_string(pair.rank()) + " of " +
                                                            std::to_string(pair.size()));
    expect(&pair.backend() == &backend, "split keeps the rank's backend");
    CopyCounter copies{backend};
    std::vector<float> data = ScrambledCpu::to_device({static_cast<float>(rank)});
    pair.all_reduce(std::span<float>(data));
    copies.expect_since(1, 1, sizeof(float), sizeof(float), "all_reduce in the pair");
    const float expected = rank < 2 ? 1.0f : 5.0f;  // 0 + 1, 2 + 3
    expect(ScrambledCpu::to_plain(data)[0] == expected, "pair sum is " + std::to_string(ScrambledCpu::to_plain(data)[0]));

    // The pairs' second ranks, across pairs, then each rank alone within its pair.
    Staged<ScrambledCpu> across = comm.split(rank % 2, rank);
    std::vector<float> ranks = ScrambledCpu::to_device({static_cast<float>(rank)}), gathered(2);
    across.all_gather(std::span<const float>(ranks), std::span<float>(gathered));
    const std::vector<float> got = ScrambledCpu::to_plain(gathered);
    expect(got[0] == static_cast<float>(rank % 2) && got[1] == static_cast<float>(rank % 2 + 2), "across-pairs all_gather");
    Staged<ScrambledCpu> alone = pair.split(pair.rank(), 0);
    std::vector<float> single = ScrambledCpu::to_device({42.0f});
    alone.all_reduce(std::span<float>(single), loom::ReduceOp::max);
    expect(alone.size() == 1 && ScrambledCpu::to_plain(single)[0] == 42.0f, "singleton split");
    copies.expect_since(2, 2, 2 * sizeof(float), 3 * sizeof(float), "all_gather and singleton all_reduce");
  });
}

TEST_CASE("staged: a CommunicatorRef binds to it, and calls through the reference are staged") {
  constexpr int n = 2;
  run_staged<ScrambledCpu>(n, [](Staged<ScrambledCpu>& comm, ScrambledCpu& backend) {
    loom::CommunicatorRef ref = comm;
    expect(ref.rank() == comm.rank() && ref.size() == n, "reference rank and size");
    CopyCounter copies{backend};
    std::vector<float> data = ScrambledCpu::to_device(values(comm.rank(), 5));
    ref.all_reduce(std::span<float>(data));
    loom::Request request = ref.all_reduce_async(std::span<float>(data));
    request.wait();
    copies.expect_since(2, 2, 10 * sizeof(float), 10 * sizeof(float), "through the reference");
    const std::vector<float> got = ScrambledCpu::to_plain(data);
    for (std::size_t i = 0; i < got.size(); ++i) expect(got[i] == 2 * sum_of(n, i), "reference all_reduce twice");
  });
}

TEST_CASE("staged: bad input is rejected with every communicator's words, before anything is copied") {
  constexpr int n = 2;
  std::vector<std::string> scatter_error(n), broadcast_error(n), send_error(n);
  std::vector<int> copies(n, -1);
  auto message_of = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const loom::Error& e) {
      return e.what();
    }
    return "no error";
  };
  run_staged<ScrambledCpu>(n, [&](Staged<ScrambledCpu>& comm, ScrambledCpu& backend) {
    const auto r = static_cast<std::size_t>(comm.rank());
    std::vector<float> input(10), output(3);
    scatter_error[r] = message_of([&] { comm.reduce_scatter(std::span<const float>(input), std::span<float>(output)); });
    broadcast_error[r] = message_of([&] { comm.broadcast(std::span<float>(output), 5); });
    send_error[r] = message_of([&] { comm.send(std::span<const float>(output), comm.rank(), 0); });
    copies[r] = backend.to_host + backend.from_host;
    comm.barrier();  // the group is still usable
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    const auto i = static_cast<std::size_t>(r);
    CHECK(scatter_error[i] == "loom: reduce_scatter: input elements: got 10; must be size() (2) x output elements (3)");
    CHECK(broadcast_error[i] == "loom: broadcast: root: got 5; must be a rank of the group, in [0, 2)");
    CHECK(send_error[i] == "loom: send: peer: got " + std::to_string(r) + "; must differ from this rank");
    CHECK(copies[i] == 0);
  }
}

}  // namespace test_comm_staged
