#pragma once
// The communicator conformance suite, written once over any loom::Communicator. Every check is
// called by every rank of `comm` (it runs collectives) and returns this rank's failures instead
// of asserting, because doctest's assertions are not thread-safe and ranks may be threads:
// the test collects each rank's Failures after the ranks join (threads) or per process (MPI)
// and hands them to report().
//
//   loom::threads::run(n, [&](auto& comm) { failures[comm.rank()] = conformance::run_all(comm); });
//   conformance::report(failures);
//
// Values are small integers, so that sums are exact in every type (bf16 included) and sum and
// max are compared bit for bit; average is compared with a tolerance of the type.

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "loom/comm/concepts.hpp"
#include "loom/core/bf16.hpp"

namespace conformance {

//! Failure messages of one rank; empty when every check passed.
using Failures = std::vector<std::string>;

//! Element counts every collective is checked with: empty, one, odd sizes that do not divide
//! by the group size.
inline constexpr std::size_t lengths[] = {0, 1, 7, 1001};

//! At most this many messages per check and rank, so that a broken collective stays readable.
inline constexpr std::size_t max_failures_per_check = 8;

//! Collects failures with the context of the current check.
class Recorder {
 public:
  Recorder(Failures& out, std::string check, int rank) : out_(out), check_(std::move(check)), rank_(rank) {}

  //! Records `message()` unless `ok`; the message is built only on failure.
  template <class Message>
  void expect(bool ok, Message&& message) {
    if (ok) return;
    if (count_++ < max_failures_per_check) out_.push_back(check_ + " [rank " + std::to_string(rank_) + "]: " + message());
  }
  //! Runs `body`, recording an exception it throws instead of letting it leave the rank.
  template <class Body>
  void guard(Body&& body) {
    try {
      body();
    } catch (const std::exception& e) {
      expect(false, [&] { return std::string("threw: ") + e.what(); });
    }
  }

 private:
  Failures& out_;
  std::string check_;
  int rank_;
  std::size_t count_ = 0;
};

template <class T>
const char* type_name() {
  return std::is_same_v<T, float> ? "float32" : std::is_same_v<T, double> ? "float64" : "bfloat16";
}

//! Calls `fn.template operator()<T>()` for float, double and bf16.
template <class Fn>
void for_each_type(Fn&& fn) {
  fn.template operator()<float>();
  fn.template operator()<double>();
  fn.template operator()<loom::bf16>();
}

//! The value rank `rank` contributes at element `index`: a small integer in [-5, 5].
inline int value(int rank, std::size_t index) { return static_cast<int>((static_cast<std::size_t>(rank) * 7 + index * 3) % 11) - 5; }

template <class T>
double as_double(T x) {
  return static_cast<double>(static_cast<float>(x));
}
template <>
inline double as_double<double>(double x) {
  return x;
}

template <class T>
T make(double x) {
  if constexpr (std::is_same_v<T, loom::bf16>)
    return loom::bf16(static_cast<float>(x));
  else
    return static_cast<T>(x);
}

template <class T>
std::vector<T> values_of(int rank, std::size_t count, std::size_t first_index = 0) {
  std::vector<T> out(count);
  for (std::size_t i = 0; i < count; ++i) out[i] = make<T>(value(rank, first_index + i));
  return out;
}

//! The expected result at `index` of reducing value(r, index) over ranks [0, size) with `op`,
//! computed as the library defines it (sum in the accumulation type, then divide once).
template <class T>
double expected_reduction(loom::ReduceOp op, int size, std::size_t index) {
  double sum = 0, max = -1e300;
  for (int r = 0; r < size; ++r) {
    sum += value(r, index);
    max = std::max<double>(max, value(r, index));
  }
  if (op == loom::ReduceOp::sum) return sum;
  if (op == loom::ReduceOp::max) return max;
  if constexpr (std::is_same_v<T, double>) return sum / size;
  return as_double(make<T>(static_cast<float>(sum) / static_cast<float>(size)));
}

//! Whether `got` matches `expected` for `op`: exactly for sum and max (integers), within a
//! relative tolerance of the type for average (implementations may divide differently).
template <class T>
bool matches(double got, double expected, loom::ReduceOp op) {
  if (op != loom::ReduceOp::average) return got == expected;
  const double tolerance = std::is_same_v<T, double> ? 1e-14 : std::is_same_v<T, float> ? 1e-6 : 1.0 / 128;
  return std::abs(got - expected) <= tolerance * std::max(1.0, std::abs(expected));
}

inline std::string describe(const char* what, const char* type, std::size_t count, const std::string& extra = {}) {
  std::ostringstream out;
  out << what << '(' << type << ", count=" << count << (extra.empty() ? "" : ", ") << extra << ')';
  return out.str();
}

constexpr loom::ReduceOp all_ops[] = {loom::ReduceOp::sum, loom::ReduceOp::average, loom::ReduceOp::max};

//! all_reduce with sum, average and max, every type and length.
template <loom::Communicator C>
Failures check_all_reduce(C& comm) {
  Failures failures;
  const int n = comm.size(), rank = comm.rank();
  for_each_type([&]<class T>() {
    for (auto op : all_ops)
      for (std::size_t count : lengths) {
        Recorder record(failures, describe("all_reduce", type_name<T>(), count, std::string(loom::name(op))), rank);
        record.guard([&] {
          std::vector<T> data = values_of<T>(rank, count);
          comm.all_reduce(std::span<T>(data), op);
          for (std::size_t i = 0; i < count; ++i) {
            const double expected = expected_reduction<T>(op, n, i);
            record.expect(matches<T>(as_double(data[i]), expected, op), [&] {
              return "element " + std::to_string(i) + " is " + std::to_string(as_double(data[i])) + ", expected " +
                     std::to_string(expected);
            });
          }
        });
      }
  });
  return failures;
}

//! reduce_scatter, out of place and in place (output = this rank's part of input).
template <loom::Communicator C>
Failures check_reduce_scatter(C& comm) {
  Failures failures;
  const int n = comm.size(), rank = comm.rank();
  for_each_type([&]<class T>() {
    for (auto op : all_ops)
      for (std::size_t count : lengths)
        for (bool in_place : {false, true}) {
          Recorder record(failures,
                          describe("reduce_scatter", type_name<T>(), count,
                                   std::string(loom::name(op)) + (in_place ? ", in place" : "")),
                          rank);
          record.guard([&] {
            std::vector<T> input = values_of<T>(rank, count * static_cast<std::size_t>(n));
            std::vector<T> separate(count);
            std::span<T> output = in_place ? std::span<T>(input).subspan(static_cast<std::size_t>(rank) * count, count)
                                           : std::span<T>(separate);
            comm.reduce_scatter(std::span<const T>(input), output, op);
            for (std::size_t i = 0; i < count; ++i) {
              const double expected = expected_reduction<T>(op, n, static_cast<std::size_t>(rank) * count + i);
              record.expect(matches<T>(as_double(output[i]), expected, op), [&] {
                return "element " + std::to_string(i) + " is " + std::to_string(as_double(output[i])) +
                       ", expected " + std::to_string(expected);
              });
            }
          });
        }
  });
  return failures;
}

//! all_gather, out of place and in place (input = this rank's part of output).
template <loom::Communicator C>
Failures check_all_gather(C& comm) {
  Failures failures;
  const int n = comm.size(), rank = comm.rank();
  for_each_type([&]<class T>() {
    for (std::size_t count : lengths)
      for (bool in_place : {false, true}) {
        Recorder record(failures, describe("all_gather", type_name<T>(), count, in_place ? "in place" : ""), rank);
        record.guard([&] {
          std::vector<T> output(count * static_cast<std::size_t>(n), make<T>(99));
          std::vector<T> separate = values_of<T>(rank, count);
          std::span<T> input = std::span<T>(separate);
          if (in_place) {
            input = std::span<T>(output).subspan(static_cast<std::size_t>(rank) * count, count);
            std::copy(separate.begin(), separate.end(), input.begin());
          }
          comm.all_gather(std::span<const T>(input), std::span<T>(output));
          for (int s = 0; s < n; ++s)
            for (std::size_t i = 0; i < count; ++i) {
              const double got = as_double(output[static_cast<std::size_t>(s) * count + i]);
              record.expect(got == value(s, i), [&] {
                return "part of rank " + std::to_string(s) + ", element " + std::to_string(i) + " is " +
                       std::to_string(got) + ", expected " + std::to_string(value(s, i));
              });
            }
        });
      }
  });
  return failures;
}

//! broadcast from every root.
template <loom::Communicator C>
Failures check_broadcast(C& comm) {
  Failures failures;
  const int n = comm.size(), rank = comm.rank();
  for_each_type([&]<class T>() {
    for (std::size_t count : lengths)
      for (int root = 0; root < n; ++root) {
        Recorder record(failures, describe("broadcast", type_name<T>(), count, "root=" + std::to_string(root)), rank);
        record.guard([&] {
          std::vector<T> data = values_of<T>(rank, count);
          comm.broadcast(std::span<T>(data), root);
          for (std::size_t i = 0; i < count; ++i)
            record.expect(as_double(data[i]) == value(root, i), [&] {
              return "element " + std::to_string(i) + " is " + std::to_string(as_double(data[i])) + ", expected " +
                     std::to_string(value(root, i));
            });
        });
      }
  });
  return failures;
}

//! Records every element of `got` that is not value(from, first_index + i).
template <class T>
void expect_received(Recorder& record, const std::vector<T>& got, int from, std::size_t first_index, const char* what) {
  for (std::size_t i = 0; i < got.size(); ++i)
    record.expect(as_double(got[i]) == value(from, first_index + i), [&] {
      return std::string(what) + ": element " + std::to_string(i) + " is " + std::to_string(as_double(got[i])) +
             ", expected " + std::to_string(value(from, first_index + i));
    });
}

//! send/recv: a ring (send_async to the next rank, blocking recv from the previous one), pairs
//! exchanging with blocking calls, tags received out of order, and FIFO order within one tag.
template <loom::Communicator C>
Failures check_send_recv(C& comm) {
  Failures failures;
  const int n = comm.size(), rank = comm.rank();
  if (n < 2) return failures;
  const int next = (rank + 1) % n, previous = (rank + n - 1) % n;
  for_each_type([&]<class T>() {
    for (std::size_t count : lengths) {
      Recorder record(failures, describe("send/recv", type_name<T>(), count), rank);
      auto expect_values = [&](const std::vector<T>& got, int from, std::size_t first_index, const char* what) {
        expect_received(record, got, from, first_index, what);
      };
      record.guard([&] {
        // Ring: every rank sends first, so send_async must not wait for the receiver.
        std::vector<T> out = values_of<T>(rank, count), in(count);
        loom::Request sent = comm.send_async(std::span<const T>(out), next, 5);
        comm.recv(std::span<T>(in), previous, 5);
        sent.wait();
        expect_values(in, previous, 0, "ring");
      });
      record.guard([&] {
        // Pairs (0, 1), (2, 3), ...: the lower sends then receives, the higher the reverse.
        const int partner = rank ^ 1;
        if (partner >= n) return;
        std::vector<T> out = values_of<T>(rank, count, 100), in(count);
        if (rank < partner) {
          comm.send(std::span<const T>(out), partner, 1);
          comm.recv(std::span<T>(in), partner, 1);
        } else {
          comm.recv(std::span<T>(in), partner, 1);
          comm.send(std::span<const T>(out), partner, 1);
        }
        expect_values(in, partner, 100, "pair");
      });
      record.guard([&] {
        // Tags 1 then 2 sent; received 2 first. Then two messages with one tag arrive in order.
        std::vector<T> first = values_of<T>(rank, count, 0), second = values_of<T>(rank, count, 50);
        std::vector<T> third = values_of<T>(rank, count, 200), fourth = values_of<T>(rank, count, 300);
        loom::Request a = comm.send_async(std::span<const T>(first), next, 1);
        loom::Request b = comm.send_async(std::span<const T>(second), next, 2);
        loom::Request c = comm.send_async(std::span<const T>(third), next, 3);
        loom::Request d = comm.send_async(std::span<const T>(fourth), next, 3);
        std::vector<T> got2(count), got1(count), got3(count), got4(count);
        loom::Request r2 = comm.recv_async(std::span<T>(got2), previous, 2);
        comm.recv(std::span<T>(got1), previous, 1);
        comm.recv(std::span<T>(got3), previous, 3);
        comm.recv(std::span<T>(got4), previous, 3);
        r2.wait();
        a.wait();
        b.wait();
        c.wait();
        d.wait();
        expect_values(got1, previous, 0, "tag 1");
        expect_values(got2, previous, 50, "tag 2");
        expect_values(got3, previous, 200, "tag 3, first");
        expect_values(got4, previous, 300, "tag 3, second");
      });
    }
  });
  return failures;
}

//! start_group: a ring where every rank sends to the next and receives from the previous in one
//! group (every send offered before any receive completes, which deadlocks if a send waits for
//! its receiver first), pairs exchanging both ways in one group, two groups in a row matched in
//! issue order, and an empty group. All tags are 0, so a communicator without tags (NCCL) runs
//! it too.
template <loom::Communicator C>
Failures check_group(C& comm) {
  Failures failures;
  const int n = comm.size(), rank = comm.rank();
  {
    Recorder record(failures, "start_group(empty)", rank);
    record.guard([&] {
      std::vector<loom::Request> none = comm.start_group(std::span<const loom::CollectiveCall>());
      record.expect(none.empty(), [&] { return std::to_string(none.size()) + " requests for an empty group"; });
    });
  }
  if (n < 2) return failures;
  const int next = (rank + 1) % n, previous = (rank + n - 1) % n;
  for_each_type([&]<class T>() {
    for (std::size_t count : lengths) {
      Recorder record(failures, describe("start_group", type_name<T>(), count), rank);
      auto expect_values = [&](const std::vector<T>& got, int from, std::size_t first_index, const char* what) {
        expect_received(record, got, from, first_index, what);
      };
      record.guard([&] {
        // Ring, the send listed first on every rank.
        std::vector<T> out = values_of<T>(rank, count), in(count);
        const std::array ring{comm.send_call(std::span<const T>(out), next), comm.recv_call(std::span<T>(in), previous)};
        std::vector<loom::Request> done = comm.start_group(ring);
        record.expect(done.size() == 2, [&] { return std::to_string(done.size()) + " requests for a group of 2"; });
        loom::wait_all(done);
        expect_values(in, previous, 0, "ring");
      });
      record.guard([&] {
        // Pairs (0, 1), (2, 3), ...: both send first in one group; then a second group in a row.
        const int partner = rank ^ 1;
        if (partner >= n) return;
        std::vector<T> first = values_of<T>(rank, count, 100), second = values_of<T>(rank, count, 200);
        std::vector<T> got_first(count), got_second(count);
        const std::array one{comm.send_call(std::span<const T>(first), partner),
                             comm.recv_call(std::span<T>(got_first), partner)};
        const std::array two{comm.recv_call(std::span<T>(got_second), partner),
                             comm.send_call(std::span<const T>(second), partner)};
        std::vector<loom::Request> a = comm.start_group(one);
        std::vector<loom::Request> b = comm.start_group(two);
        b[0].wait();  // the second group's receive, before anything of the first is waited for
        loom::wait_all(a);
        loom::wait_all(b);
        expect_values(got_first, partner, 100, "pair, first group");
        expect_values(got_second, partner, 200, "pair, second group");
      });
    }
  });
  Recorder record(failures, "start_group(bad call)", rank);
  bool refused = false;
  try {
    std::vector<float> data(1);
    const std::array bad{loom::CollectiveCall{.kind = loom::Collective::all_reduce, .input = data.data(),
                                              .output = data.data(), .count = 1}};
    std::vector<loom::Request> done = comm.start_group(bad);
    loom::wait_all(done);
  } catch (const std::exception&) {
    refused = true;
  }
  record.expect(refused, [] { return std::string("a group holding an all_reduce was not refused"); });
  return failures;
}

//! barrier, blocking and started through start().
template <loom::Communicator C>
Failures check_barrier(C& comm) {
  Failures failures;
  Recorder record(failures, "barrier", comm.rank());
  record.guard([&] {
    for (int i = 0; i < 3; ++i) comm.barrier();
    loom::Request request = comm.start(loom::CollectiveCall{.kind = loom::Collective::barrier});
    request.wait();
    record.expect(request.done(), [] { return std::string("request not done after wait()"); });
  });
  return failures;
}

//! split: even and odd ranks with reversed keys (checks the order), everyone in one group,
//! everyone alone, and a split of a split; each runs collectives.
template <loom::Communicator C>
Failures check_split(C& comm) {
  Failures failures;
  const int n = comm.size(), rank = comm.rank();
  Recorder record(failures, "split", rank);
  record.guard([&] {
    // Even/odd, keyed so that the highest rank comes first.
    C parity = comm.split(rank % 2, n - rank);
    std::vector<int> members;
    for (int r = n - 1; r >= 0; --r)
      if (r % 2 == rank % 2) members.push_back(r);
    const int expected_rank = static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
    record.expect(parity.size() == static_cast<int>(members.size()), [&] {
      return "parity group has size " + std::to_string(parity.size()) + ", expected " + std::to_string(members.size());
    });
    record.expect(parity.rank() == expected_rank, [&] {
      return "parity group rank is " + std::to_string(parity.rank()) + ", expected " + std::to_string(expected_rank);
    });
    std::vector<double> mine{static_cast<double>(rank)}, gathered(members.size());
    parity.all_gather(std::span<const double>(mine), std::span<double>(gathered));
    for (std::size_t i = 0; i < members.size(); ++i)
      record.expect(gathered[i] == members[i], [&] {
        return "parity group all_gather element " + std::to_string(i) + " is world rank " +
               std::to_string(gathered[i]) + ", expected " + std::to_string(members[i]);
      });
    std::vector<float> sum{static_cast<float>(rank)};
    parity.all_reduce(std::span<float>(sum));
    float expected_sum = 0;
    for (int r : members) expected_sum += static_cast<float>(r);
    record.expect(sum[0] == expected_sum, [&] {
      return "parity group sum of ranks is " + std::to_string(sum[0]) + ", expected " + std::to_string(expected_sum);
    });

    // Everyone in one group with equal keys: the order of comm.
    C same = comm.split(0, 0);
    record.expect(same.size() == n && same.rank() == rank, [&] {
      return "one-color split gives rank " + std::to_string(same.rank()) + " of " + std::to_string(same.size());
    });
    std::vector<float> ones{1.0f};
    same.all_reduce(std::span<float>(ones));
    record.expect(ones[0] == static_cast<float>(n), [&] { return "one-color split sum is " + std::to_string(ones[0]); });

    // Everyone alone.
    C alone = comm.split(rank, 0);
    record.expect(alone.size() == 1 && alone.rank() == 0, [&] {
      return "singleton split gives rank " + std::to_string(alone.rank()) + " of " + std::to_string(alone.size());
    });
    std::vector<double> own{static_cast<double>(rank)};
    alone.all_reduce(std::span<double>(own), loom::ReduceOp::average);
    record.expect(own[0] == rank, [&] { return "singleton all_reduce changed the value"; });

    // A split of a split, with collectives on both groups interleaved.
    C nested = parity.split(parity.rank() < 2 ? 0 : 1, parity.rank());
    std::vector<float> count_of{1.0f};
    nested.all_reduce(std::span<float>(count_of));
    parity.barrier();
    const int expected_nested = parity.rank() < 2 ? std::min(2, parity.size()) : parity.size() - 2;
    record.expect(count_of[0] == static_cast<float>(expected_nested) && nested.size() == expected_nested, [&] {
      return "nested split has size " + std::to_string(nested.size()) + " and sum " + std::to_string(count_of[0]) +
             ", expected " + std::to_string(expected_nested);
    });
  });
  return failures;
}

//! Many collectives in flight: 16 all_reduce_async on different buffers, then every one
//! waited; asynchronous and blocking calls mixed; test() polled until done.
template <loom::Communicator C>
Failures check_in_flight(C& comm) {
  Failures failures;
  const int n = comm.size(), rank = comm.rank();
  Recorder record(failures, "in flight", rank);
  auto expect_sum = [&](const std::vector<float>& data, const std::string& what) {
    for (std::size_t i = 0; i < data.size(); ++i) {
      const double expected = expected_reduction<float>(loom::ReduceOp::sum, n, i);
      record.expect(data[i] == expected, [&] {
        return what + ": element " + std::to_string(i) + " is " + std::to_string(data[i]) + ", expected " +
               std::to_string(expected);
      });
    }
  };
  record.guard([&] {
    constexpr int in_flight = 16;
    std::vector<std::vector<float>> buffers;
    for (int b = 0; b < in_flight; ++b) buffers.push_back(values_of<float>(rank, static_cast<std::size_t>(1 + 97 * b)));
    std::vector<loom::Request> requests;
    for (auto& buffer : buffers) requests.push_back(comm.all_reduce_async(std::span<float>(buffer)));
    for (auto& request : requests) request.wait();
    for (int b = 0; b < in_flight; ++b) expect_sum(buffers[static_cast<std::size_t>(b)], "buffer " + std::to_string(b) + " of 16");
  });
  record.guard([&] {
    // async A, blocking B, async C of other kinds, waited in reverse order.
    std::vector<float> a = values_of<float>(rank, 513), b = values_of<float>(rank, 65);
    std::vector<double> c_in = values_of<double>(rank, 9), c_out(9 * static_cast<std::size_t>(n));
    std::vector<loom::bf16> d = values_of<loom::bf16>(rank, 33);
    loom::Request request_a = comm.all_reduce_async(std::span<float>(a));
    comm.all_reduce(std::span<float>(b));
    loom::Request request_c = comm.all_gather_async(std::span<const double>(c_in), std::span<double>(c_out));
    loom::Request request_d = comm.broadcast_async(std::span<loom::bf16>(d), n - 1);
    request_d.wait();
    request_c.wait();
    request_a.wait();
    expect_sum(a, "async before blocking");
    expect_sum(b, "blocking between asyncs");
    for (int s = 0; s < n; ++s)
      for (std::size_t i = 0; i < 9; ++i)
        record.expect(c_out[static_cast<std::size_t>(s) * 9 + i] == value(s, i), [&] {
          return "all_gather_async part of rank " + std::to_string(s) + " element " + std::to_string(i);
        });
    for (std::size_t i = 0; i < d.size(); ++i)
      record.expect(as_double(d[i]) == value(n - 1, i), [&] { return "broadcast_async element " + std::to_string(i); });
  });
  record.guard([&] {
    // test() until done, with a reduce_scatter_async among them.
    std::vector<float> a = values_of<float>(rank, 300);
    std::vector<float> scatter_in = values_of<float>(rank, 5 * static_cast<std::size_t>(n)), scatter_out(5);
    std::vector<loom::Request> requests;
    requests.push_back(comm.all_reduce_async(std::span<float>(a)));
    requests.push_back(comm.reduce_scatter_async(std::span<const float>(scatter_in), std::span<float>(scatter_out)));
    for (;;) {
      bool all_done = true;
      for (auto& request : requests) all_done = request.test() && all_done;
      if (all_done) break;
      std::this_thread::yield();
    }
    expect_sum(a, "polled with test()");
    for (std::size_t i = 0; i < 5; ++i) {
      const double expected = expected_reduction<float>(loom::ReduceOp::sum, n, static_cast<std::size_t>(rank) * 5 + i);
      record.expect(scatter_out[i] == expected, [&] { return "reduce_scatter_async element " + std::to_string(i); });
    }
  });
  return failures;
}

//! A large float all_reduce (64 MiB by default), where the blocked, bandwidth-bound paths run.
//! Separate from run_all so that callers choose when to pay for it.
template <loom::Communicator C>
Failures check_large(C& comm, std::size_t bytes = std::size_t{64} << 20) {
  Failures failures;
  const int n = comm.size(), rank = comm.rank();
  Recorder record(failures, describe("all_reduce", "float32", bytes / sizeof(float), "large"), rank);
  record.guard([&] {
    // Values with period 8 in the index, so that the expected sums are a table of 8.
    const std::size_t count = bytes / sizeof(float);
    std::vector<float> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<float>((static_cast<std::size_t>(rank) + i) % 8);
    float expected[8] = {};
    for (std::size_t k = 0; k < 8; ++k)
      for (int r = 0; r < n; ++r) expected[k] += static_cast<float>((static_cast<std::size_t>(r) + k) % 8);
    comm.all_reduce(std::span<float>(data));
    for (std::size_t i = 0; i < count; ++i)
      if (data[i] != expected[i % 8])
        record.expect(false, [&] {
          return "element " + std::to_string(i) + " is " + std::to_string(data[i]) + ", expected " +
                 std::to_string(expected[i % 8]);
        });
  });
  return failures;
}

//! Every check above except check_large, in one list of failures.
template <loom::Communicator C>
Failures run_all(C& comm) {
  Failures all;
  for (Failures part : {check_all_reduce(comm), check_reduce_scatter(comm), check_all_gather(comm),
                        check_broadcast(comm), check_send_recv(comm), check_group(comm), check_barrier(comm),
                        check_split(comm), check_in_flight(comm)})
    all.insert(all.end(), part.begin(), part.end());
  return all;
}

//! Asserts (on the test's thread) that `failures` of one rank are empty, printing them.
inline void report(const Failures& failures, int rank) {
  CAPTURE(rank);
  for (const auto& failure : failures) FAIL_CHECK(failure);
  CHECK(failures.empty());
}
//! The same for every rank's failures, indexed by rank.
inline void report(const std::vector<Failures>& per_rank) {
  for (std::size_t r = 0; r < per_rank.size(); ++r) report(per_rank[r], static_cast<int>(r));
}

}  // namespace conformance
