// The NCCL communicator: the conformance suite (tests/comm/conformance.hpp) on a world of one
// GPU, and on every GPU of the machine as thread ranks when there are two or more (NCCL refuses
// two ranks of one communicator on the same GPU). Without a GPU it reports itself skipped.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <vector>

#include "comm/conformance.hpp"
#include "loom/backend/cuda/cuda.hpp"
#include "loom/comm/nccl.hpp"
#include "loom/comm/threads.hpp"

using namespace loom;

namespace {
int gpus() { return cuda::device_count(); }

//! The collectives that NCCL supports with loom's semantics. Point-to-point messages are
//! matched in issue order per peer (NCCL has no tags), so the tagged send/recv patterns of the
//! suite are not among them; its groups (untagged, both ways at once) are.
conformance::Failures nccl_conformance(nccl::Communicator& comm) {
  conformance::Failures all;
  for (conformance::Failures part :
       {conformance::check_all_reduce(comm), conformance::check_reduce_scatter(comm),
        conformance::check_all_gather(comm), conformance::check_broadcast(comm), conformance::check_group(comm),
        conformance::check_barrier(comm), conformance::check_split(comm), conformance::check_in_flight(comm)})
    all.insert(all.end(), part.begin(), part.end());
  return all;
}
}  // namespace

TEST_CASE("NCCL on a world of one GPU passes the conformance suite") {
  if (gpus() == 0) return;
  cuda be(0);
  nccl::Communicator comm(be, nccl::UniqueId::make(), 1, 0);
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  conformance::report(nccl_conformance(comm), 0);
}

TEST_CASE("NCCL over every GPU, bootstrapped through thread ranks, passes the conformance suite") {
  const int n = gpus();
  if (n < 2) return;
  std::vector<conformance::Failures> failures(static_cast<std::size_t>(n));
  threads::run(n, [&](threads::Communicator& group) {
    cuda be(group.rank());
    nccl::Communicator comm = nccl::Communicator::bootstrap(be, group);
    failures[static_cast<std::size_t>(group.rank())] = nccl_conformance(comm);
  });
  conformance::report(failures);
}

TEST_CASE("a bad rank or size is rejected before NCCL is called") {
  if (gpus() == 0) return;
  cuda be(0);
  CHECK_THROWS_WITH_AS(nccl::Communicator(be, nccl::UniqueId::make(), 2, 2), doctest::Contains("rank: got 2"), Error);
  CHECK_THROWS_WITH_AS(nccl::Communicator(be, nccl::UniqueId::make(), 0, 0), doctest::Contains("size: got 0"), Error);
}

int main(int argc, char** argv) {
  doctest::Context context(argc, argv);
  const int status = context.run();
  if (status != 0 || context.shouldExit()) return status;
  if (gpus() == 0) {
    std::puts("loom: no CUDA device; the NCCL cases were skipped");
    return 77;
  }
  return 0;
}
