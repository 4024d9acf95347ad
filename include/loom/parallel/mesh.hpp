#pragma once
//! \file Mesh: the world's ranks as a DP × TP × PP grid, with a sub-communicator per axis.
//! Ranks are ordered as Megatron-LM orders them: tensor-parallel neighbours are adjacent ranks
//! (they exchange the most), then data-parallel, then pipeline stages:
//!
//!     rank = pp_rank · (dp · tp) + dp_rank · tp + tp_rank

#include <ostream>
#include <string>
#include <utility>

#include "loom/comm/concepts.hpp"
#include "loom/core/error.hpp"

namespace loom {

//! Ranks along each axis of the mesh.
struct MeshShape {
  int dp = 1;  //!< data-parallel replicas (or ZeRO shards)
  int tp = 1;  //!< tensor-parallel ranks splitting each layer
  int pp = 1;  //!< pipeline stages splitting the layer stack

  //! dp · tp · pp.
  int size() const noexcept { return dp * tp * pp; }

  friend bool operator==(const MeshShape&, const MeshShape&) = default;
  friend std::ostream& operator<<(std::ostream& out, const MeshShape& s) {
    return out << "{dp=" << s.dp << ", tp=" << s.tp << ", pp=" << s.pp << "}";
  }
};

//! Where one rank sits in the mesh.
struct MeshCoordinates {
  int dp = 0, tp = 0, pp = 0;
  friend bool operator==(const MeshCoordinates&, const MeshCoordinates&) = default;
  friend std::ostream& operator<<(std::ostream& out, const MeshCoordinates& c) {
    return out << "{dp=" << c.dp << ", tp=" << c.tp << ", pp=" << c.pp << "}";
  }
};

//! The coordinates of world rank `rank` in a mesh of `shape` (Megatron's order, see the file).
constexpr MeshCoordinates mesh_coordinates(const MeshShape& shape, int rank) noexcept {
  return {.dp = (rank / shape.tp) % shape.dp, .tp = rank % shape.tp, .pp = rank / (shape.tp * shape.dp)};
}

//! The world rank at `c` in a mesh of `shape`.
constexpr int mesh_rank(const MeshShape& shape, const MeshCoordinates& c) noexcept {
  return c.pp * shape.dp * shape.tp + c.dp * shape.tp + c.tp;
}

//! A DP × TP × PP view of `world` (which must outlive it): this rank's coordinates and one
//! sub-communicator per axis, made with split (collective: every world rank constructs its
//! Mesh together). A shape whose product is not the world size is rejected on every rank
//! before anything is split.
template <Communicator C>
class Mesh {
 public:
  Mesh(C& world, MeshShape shape)
      : world_(&world),
        shape_(validated(shape, world.size())),
        coordinates_(mesh_coordinates(shape, world.rank())),
        // Each axis groups the ranks that agree on the two other coordinates.
        data_parallel_(world.split(coordinates_.pp * shape.tp + coordinates_.tp, coordinates_.dp)),
        tensor_parallel_(world.split(coordinates_.pp * shape.dp + coordinates_.dp, coordinates_.tp)),
        pipeline_(world.split(coordinates_.dp * shape.tp + coordinates_.tp, coordinates_.pp)) {}

  const MeshShape& shape() const noexcept { return shape_; }
  //! This rank's place in the mesh.
  const MeshCoordinates& coordinates() const noexcept { return coordinates_; }
  C& world() noexcept { return *world_; }
  //! The ranks holding the same layers' same shards: DDP and ZeRO reduce over them.
  C& data_parallel() noexcept { return data_parallel_; }
  //! The ranks splitting the same layers (adjacent world ranks).
  C& tensor_parallel() noexcept { return tensor_parallel_; }
  //! The stages of this rank's pipeline, in stage order.
  C& pipeline() noexcept { return pipeline_; }

 private:
  static MeshShape validated(const MeshShape& s, int world_size) {
    LOOM_CHECK(s.dp >= 1 && s.tp >= 1 && s.pp >= 1, "mesh shape", s, "every axis must be >= 1");
    LOOM_CHECK(s.size() == world_size, "mesh: dp x tp x pp",
               std::to_string(s.dp) + " x " + std::to_string(s.tp) + " x " + std::to_string(s.pp) + " = " +
                   std::to_string(s.size()),
               "must equal the world size (" + std::to_string(world_size) + ")");
    return s;
  }

  C* world_;
  MeshShape shape_;
  MeshCoordinates coordinates_;
  C data_parallel_, tensor_parallel_, pipeline_;
};

}  // namespace loom
