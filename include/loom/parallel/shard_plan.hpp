#pragma once
//! \file ShardPlan: how ZeRO splits the flat layout over the data-parallel ranks. The layout is
//! cut into units of whole layers; each unit is padded to a multiple of the rank count and split
//! into equal contiguous pieces, rank r owning piece r. Collectives on a unit are then
//! equal-count reduce-scatters and all-gathers, and a rank's shard — the concatenation of its
//! pieces — has the same length on every rank. Padding is zero, accounted for, never updated.

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/parameter_view.hpp"
#include "loom/core/parameters.hpp"
#include "loom/parallel/data_parallel.hpp"

namespace loom {

//! One unit of a ShardPlan: layout elements [begin, begin + size) of layers
//! [first_layer, last_layer], split into `ranks` pieces of `piece` elements.
struct ShardUnit {
  int first_layer = 0, last_layer = 0;
  std::int64_t begin = 0, size = 0;
  std::int64_t piece = 0;          //!< elements per rank; piece × ranks ≥ size
  std::int64_t padded_offset = 0;  //!< where the unit starts in a padded full buffer
  std::int64_t shard_offset = 0;   //!< where each rank's piece starts in its shard
  friend bool operator==(const ShardUnit&, const ShardUnit&) = default;
};

//! The units, the shard length and this rank's place (see the file comment).
class ShardPlan {
 public:
  //! Units from `buckets` (whole layers, any order) of `layout`, over `ranks` ranks; this is
  //! `rank`. Rejects a rank whose shard would hold no parameter at all.
  ShardPlan(const ParameterLayout& layout, const std::vector<GradientBucket>& buckets, int ranks, int rank)
      : ranks_(ranks), rank_(rank), total_(layout.total()) {
    LOOM_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "shard plan: rank", rank,
               "must be in [0, ranks = " + std::to_string(ranks) + ")");
    for (const auto& b : buckets)
      units_.push_back({b.first_layer, b.last_layer, b.begin, b.end - b.begin, 0, 0, 0});
    std::sort(units_.begin(), units_.end(), [](const ShardUnit& a, const ShardUnit& b) { return a.begin < b.begin; });
    std::int64_t padded = 0, shard = 0;
    for (auto& u : units_) {
      u.piece = (u.size + ranks - 1) / ranks;
      u.padded_offset = padded;
      u.shard_offset = shard;
      padded += u.piece * ranks;
      shard += u.piece;
    }
    shard_size_ = shard;
    LOOM_CHECK(owned_elements() > 0, "ZeRO: parameters in the shard of rank " + std::to_string(rank), 0,
               "every rank must own at least one parameter element: the model's " + std::to_string(total_) +
                   " parameters in " + std::to_string(units_.size()) + " units cannot be sharded over " +
                   std::to_string(ranks) + " ranks (use fewer data-parallel ranks)");
  }

  const std::vector<ShardUnit>& units() const noexcept { return units_; }
  int ranks() const noexcept { return ranks_; }
  int rank() const noexcept { return rank_; }
  //! Elements of each rank's shard (the same on every rank, padding included).
  std::int64_t shard_size() const noexcept { return shard_size_; }
  //! Elements of a padded full buffer: ranks × shard_size().
  std::int64_t padded_total() const noexcept { return shard_size_ * ranks_; }
  //! Padding elements of a full buffer: padded_total() − the layout's elements.
  std::int64_t padding() const noexcept { return padded_total() - total_; }

  //! First element of this rank's piece of `u`, in layout order.
  std::int64_t owned_begin(const ShardUnit& u) const noexcept { return u.begin + rank_ * u.piece; }
  //! Parameter elements (not padding) in this rank's piece of `u`.
  std::int64_t owned_count(const ShardUnit& u) const noexcept {
    return std::clamp<std::int64_t>(u.size - rank_ * u.piece, 0, u.piece);
  }
  //! Parameter elements in this rank's whole shard.
  std::int64_t owned_elements() const noexcept {
    std::int64_t n = 0;
    for (const auto& u : units_) n += owned_count(u);
    return n;
  }

  //! Indices of the units that hold any of `ranges`, ascending.
  std::vector<int> units_of(const std::vector<ElementRange>& ranges) const {
    std::vector<int> out;
    for (int i = 0; i < static_cast<int>(units_.size()); ++i)
      for (const auto& r : ranges)
        if (r.begin < units_[i].begin + units_[i].size && units_[i].begin < r.end) {
          out.push_back(i);
          break;
        }
    return out;
  }

 private:
  int ranks_, rank_;
  std::int64_t total_;
  std::int64_t shard_size_ = 0;
  std::vector<ShardUnit> units_;
};

}  // namespace loom
