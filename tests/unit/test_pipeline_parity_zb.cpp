// ZeroBubbleH1 (each backward split into input- and weight-gradient passes) on every
// DP x TP x PP mesh with pp >= 2 and at most 8 thread ranks, under DDP and ZeRO-1, 2 and 3, with and
// without clipping: the same losses, gradient norms and weights as one-rank training
// (DESIGN.md invariant 3; the matrix is in support/pipeline_parity.hpp).
#include <doctest/doctest.h>

#include "loom/loom.hpp"
#include "support/pipeline_parity.hpp"

namespace test_pipeline_parity_zb {

using namespace loom;
using namespace loom::test;

TEST_CASE("ZeroBubbleH1 with DDP on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(ZeroBubbleH1{}, DataParallel{.bucket_bytes = 4096});
}

TEST_CASE("ZeroBubbleH1 with Zero<1> on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(ZeroBubbleH1{}, Zero<1>{.bucket_bytes = 4096});
}

TEST_CASE("ZeroBubbleH1 with Zero<1> as 2 copies (hybrid sharding) on DP4 x PP2 trains the same model as one rank") {
  for (double clip : {0.0, 0.05})
    check_pipeline_mesh({.dp = 4, .tp = 1, .pp = 2}, clip, ZeroBubbleH1{}, Zero<1>{.bucket_bytes = 4096, .replicas = 2});
}

TEST_CASE("ZeroBubbleH1 with Zero<2> on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(ZeroBubbleH1{}, Zero<2>{.bucket_bytes = 4096});
}

TEST_CASE("ZeroBubbleH1 with Zero<3> on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(ZeroBubbleH1{}, Zero<3>{});
}

TEST_CASE("ZeroBubbleH1 with Zero<3> as 2 copies (hybrid sharding) on DP4 x PP2 trains the same model as one rank") {
  for (double clip : {0.0, 0.05})
    check_pipeline_mesh({.dp = 4, .tp = 1, .pp = 2}, clip, ZeroBubbleH1{}, Zero<3>{.replicas = 2});
}

}  // namespace test_pipeline_parity_zb
