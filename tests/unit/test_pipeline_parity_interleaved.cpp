// Interleaved1F1B with 2 virtual stages on every DP x TP x PP mesh with pp >= 2 and at most 8
// thread ranks, under DDP and ZeRO-1, 2 and 3, with and without clipping: the same losses, gradient norms
// and weights as one-rank training (DESIGN.md invariant 3; the matrix is in
// support/pipeline_parity.hpp). No mesh is skipped: m = 16 / dp micro-batches is a multiple of
// pp whenever dp x pp divides 16 (it is 2, 4 or 8 here), and the 16 model layers give every one
// of the pp x 2 <= 16 virtual stages at least one (pp = 8: exactly one each).
#include <doctest/doctest.h>

#include "loom/loom.hpp"
#include "support/pipeline_parity.hpp"

namespace test_pipeline_parity_interleaved {

using namespace loom;
using namespace loom::test;

TEST_CASE("Interleaved1F1B (v = 2) with DDP on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(Interleaved1F1B{.virtual_stages = 2}, DataParallel{.bucket_bytes = 4096});
}

TEST_CASE("Interleaved1F1B (v = 2) with Zero<1> on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(Interleaved1F1B{.virtual_stages = 2}, Zero<1>{.bucket_bytes = 4096});
}

TEST_CASE("Interleaved1F1B (v = 2) with Zero<1> as 2 copies (hybrid sharding) on DP2 x TP2 x PP2 trains the same model as one rank") {
  for (double clip : {0.0, 0.05})
    check_pipeline_mesh({.dp = 2, .tp = 2, .pp = 2}, clip, Interleaved1F1B{.virtual_stages = 2}, Zero<1>{.bucket_bytes = 4096, .replicas = 2});
}

TEST_CASE("Interleaved1F1B (v = 2) with Zero<2> on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(Interleaved1F1B{.virtual_stages = 2}, Zero<2>{.bucket_bytes = 4096});
}

TEST_CASE("Interleaved1F1B (v = 2) with Zero<3> on every DP x TP x PP mesh up to 8 ranks trains the same model as one rank") {
  check_pipeline_meshes(Interleaved1F1B{.virtual_stages = 2}, Zero<3>{});
}

TEST_CASE("Interleaved1F1B (v = 2) with Zero<3> as 2 copies (hybrid sharding) on DP2 x TP2 x PP2 trains the same model as one rank") {
  for (double clip : {0.0, 0.05})
    check_pipeline_mesh({.dp = 2, .tp = 2, .pp = 2}, clip, Interleaved1F1B{.virtual_stages = 2}, Zero<3>{.replicas = 2});
}

TEST_CASE("Interleaved1F1B (v = 2) with Zero<2> as 2 copies, reduced after each backward, on DP4 x PP2 trains the same model as one rank") {
  // Without overlap a unit's last reduce-scatter may start in another chunk's backward of an
  // earlier micro-batch; it must still be summed over the copies.
  for (double clip : {0.0, 0.05})
    check_pipeline_mesh({.dp = 4, .tp = 1, .pp = 2}, clip, Interleaved1F1B{.virtual_stages = 2},
                        Zero<2>{.bucket_bytes = 4096, .overlap = false, .replicas = 2});
}

}  // namespace test_pipeline_parity_interleaved
