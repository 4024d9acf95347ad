// OneFOneB on every DP x TP x PP mesh with pp >= 2 and at most 8 thread ranks, under DDP and
// ZeRO-1, 2 and 3, with and without clipping: the same losses, gradient norms and weights as one-rank
// training (DESIGN.md invariant 3; the matrix is in support/pipeline_parity.hpp).
#include <doctest/doctest.h>

#include "loom/loom.hpp"
#include "support/pipeline_parity.hpp"

namespace test_pipeline_parity_1f1b {

using namespace loom;
using namespace loom::test;

TEST_CASE("OneFOneB with DDP on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(OneFOneB{}, DataParallel{.bucket_bytes = 4096});
}

TEST_CASE("OneFOneB with Zero<1> on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(OneFOneB{}, Zero<1>{.bucket_bytes = 4096});
}

TEST_CASE("OneFOneB with Zero<2> on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(OneFOneB{}, Zero<2>{.bucket_bytes = 4096});
}

TEST_CASE("OneFOneB with Zero<3> on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(OneFOneB{}, Zero<3>{});
}

}  // namespace test_pipeline_parity_1f1b
