// loom::AnyCommunicator: the conformance suite over thread ranks held by value and viewed, that
// its splits and everything it forwards reach the communicator it holds, a Trainer on a
// Mesh<AnyCommunicator> training bit for bit as on the mesh of the thread communicator itself,
// and the default (one rank).
#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "comm/conformance.hpp"
#include "loom/backend/cpu/kernels.hpp"
#include "loom/comm/any.hpp"
#include "loom/comm/ref.hpp"
#include "loom/comm/threads.hpp"
#include "loom/models/gpt2/model.hpp"
#include "loom/optim/adamw.hpp"
#include "loom/parallel/data_parallel.hpp"
#include "loom/parallel/mesh.hpp"
#include "loom/parallel/trainer.hpp"
#include "loom/schedule/one_f_one_b.hpp"
#include "support/training.hpp"

namespace test_comm_any {

namespace {

//! A Communicator that counts the calls that reach it, over a thread communicator.
class Counting : public loom::CollectiveInterface<Counting> {
 public:
  using loom_communicator = void;
  Counting(loom::threads::Communicator comm, int& runs, int& starts, int& groups)
      : comm_(std::move(comm)), runs_(&runs), starts_(&starts), groups_(&groups) {}
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  void run(const loom::CollectiveCall& call) {
    ++*runs_;
    comm_.run(call);
  }
  loom::Request start(const loom::CollectiveCall& call) {
    ++*starts_;
    return comm_.start(call);
  }
  std::vector<loom::Request> start_group(std::span<const loom::CollectiveCall> calls) {
    ++*groups_;
    return comm_.start_group(calls);
  }
  Counting split(int color, int key) { return Counting(comm_.split(color, key), *runs_, *starts_, *groups_); }

 private:
  loom::threads::Communicator comm_;
  int* runs_;
  int* starts_;
  int* groups_;
};
static_assert(loom::Communicator<Counting>);

}  // namespace

TEST_CASE("any conformance: thread ranks held by value, every collective, type and length on 1 to 8 ranks") {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    std::vector<conformance::Failures> failures(static_cast<std::size_t>(n));
    loom::threads::run(n, [&](loom::threads::Communicator& world) {
      loom::AnyCommunicator any(std::move(world));
      failures[static_cast<std::size_t>(any.rank())] = conformance::run_all(any);
    });
    conformance::report(failures);
  }
}

TEST_CASE("any conformance: a view of the launcher's world on 1 to 8 ranks") {
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    std::vector<conformance::Failures> failures(static_cast<std::size_t>(n));
    loom::threads::run(n, [&](loom::threads::Communicator& world) {
      loom::AnyCommunicator any = loom::AnyCommunicator::view(world);
      failures[static_cast<std::size_t>(world.rank())] = conformance::run_all(any);
    });
    conformance::report(failures);
  }
}

TEST_CASE("any: run, start, start_group and split reach the held communicator; a CommunicatorRef binds") {
  constexpr int n = 3;
  std::vector<std::string> errors(n);
  loom::threads::run(n, [&](loom::threads::Communicator& world) {
    const int rank = world.rank();
    int runs = 0, starts = 0, groups = 0;
    std::string& error = errors[static_cast<std::size_t>(rank)];
    const auto expect = [&](bool ok, const std::string& what) {
      if (!ok && error.empty()) error = what;
    };
    loom::AnyCommunicator any(Counting(std::move(world), runs, starts, groups));
    expect(any.rank() == rank && any.size() == n, "rank or size");

    std::vector<float> x{static_cast<float>(rank + 1)};
    any.all_reduce(std::span<float>(x));
    expect(x[0] == 6.0f && runs == 1, "all_reduce: sum " + std::to_string(x[0]) + ", runs " + std::to_string(runs));

    std::vector<double> y{static_cast<double>(rank)};
    any.all_reduce_async(std::span<double>(y), loom::ReduceOp::max).wait();
    expect(y[0] == n - 1 && starts == 1, "all_reduce_async: max " + std::to_string(y[0]));

    // A ring shift as one group: each rank sends to the next and receives from the previous.
    std::vector<float> out{static_cast<float>(rank)}, in{-1.0f};
    const std::vector<loom::CollectiveCall> calls{any.send_call(std::span<const float>(out), (rank + 1) % n),
                                                  any.recv_call(std::span<float>(in), (rank + n - 1) % n)};
    for (loom::Request& r : any.start_group(calls)) r.wait();
    expect(in[0] == static_cast<float>((rank + n - 1) % n) && groups == 1,
           "start_group: received " + std::to_string(in[0]));

    // A split is held too, and still counts: the sub-group is the held communicator's own split.
    loom::AnyCommunicator pair = any.split(rank == 2 ? 1 : 0, rank);
    expect(pair.size() == (rank == 2 ? 1 : 2), "split size " + std::to_string(pair.size()));
    std::vector<float> ones{1.0f};
    pair.all_reduce(std::span<float>(ones));
    expect(ones[0] == static_cast<float>(pair.size()) && runs == 2, "split all_reduce: runs " + std::to_string(runs));

    // Through a CommunicatorRef (what the Trainer, models and strategies hold).
    loom::CommunicatorRef ref(any);
    expect(!ref.point_to_point_in_issue_order(), "ref: point-to-point in issue order");
    std::vector<float> z{1.0f};
    ref.all_reduce(std::span<float>(z));
    expect(z[0] == static_cast<float>(n) && runs == 3, "ref all_reduce: runs " + std::to_string(runs));

    // Moved, it keeps the communicator and its place.
    loom::AnyCommunicator moved = std::move(any);
    moved.barrier();
    expect(moved.rank() == rank && runs == 4, "moved: rank " + std::to_string(moved.rank()));
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(errors[static_cast<std::size_t>(r)] == "");
  }
}

TEST_CASE("CommunicatorRef::split: the referenced communicator's sub-groups, held; conformance on them") {
  // 1..8 ranks split into colors rank % 2, keyed in reverse: sizes, ranks and every collective.
  for (int n = 1; n <= 8; ++n) {
    CAPTURE(n);
    std::vector<conformance::Failures> failures(static_cast<std::size_t>(n));
    std::vector<int> sizes(static_cast<std::size_t>(n)), ranks(static_cast<std::size_t>(n)),
        calls(static_cast<std::size_t>(n));
    loom::threads::run(n, [&](loom::threads::Communicator& world) {
      const int rank = world.rank();
      int runs = 0, starts = 0, groups = 0;  // this rank's: the threads do not share them
      Counting counting(std::move(world), runs, starts, groups);
      loom::CommunicatorRef ref(counting);
      loom::AnyCommunicator half = ref.split(rank % 2, n - rank);
      sizes[static_cast<std::size_t>(rank)] = half.size();
      ranks[static_cast<std::size_t>(rank)] = half.rank();
      failures[static_cast<std::size_t>(rank)] = conformance::run_all(half);
      // A split of the split, through a reference again: each rank alone.
      loom::AnyCommunicator alone = loom::CommunicatorRef(half).split(half.rank(), 0);
      sizes[static_cast<std::size_t>(rank)] += 100 * alone.size();
      calls[static_cast<std::size_t>(rank)] = runs + starts + groups;
    });
    conformance::report(failures);
    for (int r = 0; r < n; ++r) {
      const int same_color = (n - r % 2 + 1) / 2;  // ranks r' < n with r' % 2 == r % 2
      CHECK(sizes[static_cast<std::size_t>(r)] == 100 + same_color);  // the split's split: size 1
      // Keys n - r: the highest world rank of a color is its rank 0.
      CHECK(ranks[static_cast<std::size_t>(r)] == same_color - 1 - r / 2);
      // The sub-group's calls went through the referenced communicator's split.
      CHECK(calls[static_cast<std::size_t>(r)] > 0);
    }
  }
  // A default reference is the group of one rank, and so is its split.
  loom::AnyCommunicator self = loom::CommunicatorRef{}.split(0, 0);
  CHECK(self.size() == 1);
  CHECK(self.rank() == 0);
}

TEST_CASE("any: default-constructed, the group of one rank") {
  loom::AnyCommunicator one;
  CHECK(one.rank() == 0);
  CHECK(one.size() == 1);
  std::vector<float> x{3.0f};
  one.all_reduce(std::span<float>(x));
  CHECK(x[0] == 3.0f);
  loom::AnyCommunicator split = one.split(5, 0);
  CHECK(split.size() == 1);
  std::vector<float> out(1);
  CHECK_THROWS_WITH_AS(one.send(std::span<const float>(out), 0), doctest::Contains("must differ from this rank"), loom::Error);
}

namespace {

//! Rank 0's losses and gradient norms over three steps of a 2 (dp) x 2 (pp) 1F1B trainer on a
//! Mesh over 4 thread ranks, the world wrapped by `wrap` (as it is, or an AnyCommunicator view).
template <class Wrap>
std::vector<double> mesh_run(Wrap wrap) {
  using Gpt = loom::gpt2::Model<loom::cpu>;
  std::vector<double> seen;
  loom::threads::run(4, [&](loom::threads::Communicator& world) {
    auto&& group = wrap(world);
    using Group = std::remove_cvref_t<decltype(group)>;
    loom::Mesh<Group> mesh(group, {.dp = 2, .tp = 1, .pp = 2});
    loom::cpu backend(1);
    loom::Trainer<Gpt, loom::AdamW, loom::OneFOneB, loom::DataParallel> trainer(
        backend, mesh, Gpt(loom::test::small_test_config(), mesh.tensor_parallel()), loom::AdamW(),
        loom::ConstantLr{1e-2}, {.micro_batch_size = 1, .clip_grad_norm = 1.0, .seed = 9});
    for (std::int64_t s = 0; s < 3; ++s) {
      const loom::StepMetrics m = trainer.step(loom::test::make_batch(s, 8, 16, 50));
      if (world.rank() == 0) {
        seen.push_back(m.loss);
        seen.push_back(m.grad_norm);
      }
    }
  });
  return seen;
}

}  // namespace

TEST_CASE("any: a Trainer on a Mesh<AnyCommunicator> trains bit for bit as on the thread communicator's own mesh") {
  const std::vector<double> direct =
      mesh_run([](loom::threads::Communicator& w) -> loom::threads::Communicator& { return w; });
  const std::vector<double> erased = mesh_run([](loom::threads::Communicator& w) { return loom::AnyCommunicator::view(w); });
  REQUIRE(direct.size() == 6);
  CHECK(direct[0] > 0);
  CHECK(erased == direct);
}

}  // namespace test_comm_any
