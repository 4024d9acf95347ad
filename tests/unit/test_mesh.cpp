// Mesh: Megatron's rank order, the sub-communicators of each axis (their members, order and
// independence), and shapes rejected on every rank before any split.
#include <doctest/doctest.h>

#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "loom/comm/threads.hpp"
#include "loom/parallel/mesh.hpp"

namespace test_mesh {

using namespace loom;

TEST_CASE("mesh coordinates: tensor-parallel neighbours adjacent, then data-parallel, then stages") {
  const MeshShape shape{.dp = 2, .tp = 2, .pp = 2};
  CHECK(mesh_coordinates(shape, 0) == MeshCoordinates{0, 0, 0});
  CHECK(mesh_coordinates(shape, 1) == MeshCoordinates{.dp = 0, .tp = 1, .pp = 0});
  CHECK(mesh_coordinates(shape, 2) == MeshCoordinates{.dp = 1, .tp = 0, .pp = 0});
  CHECK(mesh_coordinates(shape, 5) == MeshCoordinates{.dp = 0, .tp = 1, .pp = 1});
  for (int dp = 1; dp <= 3; ++dp)
    for (int tp = 1; tp <= 3; ++tp)
      for (int pp = 1; pp <= 3; ++pp) {
        const MeshShape s{dp, tp, pp};
        for (int r = 0; r < s.size(); ++r) CHECK(mesh_rank(s, mesh_coordinates(s, r)) == r);
      }
}

TEST_CASE("every mesh shape with product <= 8 builds groups of the right ranks, in order") {
  for (int dp = 1; dp <= 8; ++dp)
    for (int tp = 1; dp * tp <= 8; ++tp)
      for (int pp = 1; dp * tp * pp <= 8; ++pp) {
        const MeshShape shape{dp, tp, pp};
        CAPTURE(shape);
        std::mutex mutex;
        std::vector<std::string> failures;
        threads::run(shape.size(), [&](threads::Communicator& world) {
          Mesh<threads::Communicator> mesh(world, shape);
          const MeshCoordinates me = mesh.coordinates();
          // Each group's members, by world rank, gathered in group order.
          const auto members = [&](threads::Communicator& group) {
            std::vector<double> mine{static_cast<double>(world.rank())}, all(static_cast<std::size_t>(group.size()));
            group.all_gather(std::span<double>(mine), std::span<double>(all));
            return all;
          };
          std::vector<double> expect_dp, expect_tp, expect_pp;
          for (int i = 0; i < dp; ++i) expect_dp.push_back(mesh_rank(shape, {i, me.tp, me.pp}));
          for (int i = 0; i < tp; ++i) expect_tp.push_back(mesh_rank(shape, {me.dp, i, me.pp}));
          for (int i = 0; i < pp; ++i) expect_pp.push_back(mesh_rank(shape, {me.dp, me.tp, i}));
          const bool ok = members(mesh.data_parallel()) == expect_dp && members(mesh.tensor_parallel()) == expect_tp &&
                          members(mesh.pipeline()) == expect_pp && mesh.data_parallel().rank() == me.dp &&
                          mesh.tensor_parallel().rank() == me.tp && mesh.pipeline().rank() == me.pp;
          if (!ok) {
            std::lock_guard lock(mutex);
            failures.push_back("rank " + std::to_string(world.rank()));
          }
        });
        CHECK(failures.empty());
      }
}

TEST_CASE("a mesh whose product is not the world size is rejected on every rank, naming both") {
  std::mutex mutex;
  std::vector<std::string> messages;
  threads::run(8, [&](threads::Communicator& world) {
    try {
      Mesh<threads::Communicator> mesh(world, {.dp = 2, .tp = 2, .pp = 3});
    } catch (const Error& e) {
      std::lock_guard lock(mutex);
      messages.push_back(e.what());
    }
  });
  REQUIRE(messages.size() == 8);
  for (const auto& m : messages)
    CHECK(m == "loom: mesh: dp x tp x pp: got 2 x 2 x 3 = 12; must equal the world size (8)");
  threads::run(1, [&](threads::Communicator& world) {
    CHECK_THROWS_WITH_AS(Mesh<threads::Communicator>(world, {.dp = 0}), doctest::Contains("every axis must be >= 1"),
                         Error);
  });
}

}  // namespace test_mesh
