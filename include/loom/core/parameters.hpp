#pragma once
//! \file Named parameter specs and their layout in one flat buffer (DESIGN.md invariants 1, 4).

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/core/error.hpp"
#include "loom/core/rng.hpp"
#include "loom/core/tensor.hpp"
#include "loom/core/whole_index.hpp"

namespace loom {

//! How a parameter is split across a tensor-parallel group.
enum class Partition {
  replicated,  //!< every rank holds all of it (layernorms, row-parallel biases)
  split_rows,  //!< axis 0 is split (column-parallel linear, vocab-parallel embedding)
  split_cols,  //!< axis 1 is split (row-parallel linear)
};

//! Which slice of a global tensor one tensor-parallel rank holds, along the axis its Partition
//! names. The global axis is `groups` equal blocks stacked (a fused qkv weight is [q; k; v]:
//! groups = 3); each block is cut into `ranks` equal pieces, and rank `rank` holds piece `rank`
//! of every block, in block order. So a rank of a fused qkv holds its heads' rows of q, of k and
//! of v, not one contiguous third of the rows. ranks = 1 is the whole tensor.
struct Shard {
  std::int64_t ranks = 1;   //!< tensor-parallel group size the parameter is split over
  std::int64_t rank = 0;    //!< this rank's piece, in [0, ranks)
  std::int64_t groups = 1;  //!< equal blocks stacked along the split axis, each split separately

  friend bool operator==(const Shard&, const Shard&) = default;
  friend std::ostream& operator<<(std::ostream& out, const Shard& s) {
    return out << "{ranks=" << s.ranks << ", rank=" << s.rank << ", groups=" << s.groups << "}";
  }
};

//! How a parameter's elements start.
struct Init {
  enum class Kind { zeros, ones, normal };
  Kind kind = Kind::zeros;
  double stddev = 0.0;
  //! Only the first `rows` rows are drawn; later rows (a padded vocabulary) start at zero.
  //! Negative means all rows.
  std::int64_t rows = -1;

  static constexpr Init zeros() { return {}; }
  static constexpr Init ones() { return {Kind::ones}; }
  static constexpr Init normal(double stddev, std::int64_t rows = -1) {
    return {Kind::normal, stddev, rows};
  }
};

//! A named parameter: global name, the shape this rank stores, owning layer, how it is
//! treated, and (under tensor parallelism) which slice of the global tensor it is.
struct ParameterSpec {
  std::string name;  //!< global name, e.g. "h.3.attn.qkv.weight"; keys the initial values
  Shape shape;       //!< shape stored on this rank (the global shape unless sharded)
  int layer = 0;     //!< index of the layer that owns it
  bool weight_decay = false;  //!< AdamW decays it (matrices yes; biases and norms no)
  Partition partition = Partition::replicated;
  Init init{};
  //! Shape of the whole tensor over the tensor-parallel group; left out (rank 0) it is `shape`
  //! (ParameterLayout fills it in).
  Shape global_shape{};
  //! The slice of `global_shape` this rank holds along the axis `partition` names.
  Shard shard{};
  //! A copy of a parameter that another pipeline stage owns (GPT-2's tied `wte` on the last
  //! stage): its gradient is summed with the owner's and it is updated identically there, so a
  //! gradient norm over the pipeline counts it on the owner only.
  bool tied_copy = false;

  //! Every tensor-parallel rank holds all of it (layernorms, row-parallel biases, wpe): a
  //! gradient norm over the tensor-parallel group counts it once, not once per rank.
  bool replicated_over_tensor_parallel() const noexcept { return partition == Partition::replicated; }

  //! The global shape: `global_shape`, or `shape` where that was left out.
  const Shape& whole_shape() const noexcept { return global_shape.rank() == 0 ? shape : global_shape; }

  //! Flat index in the global tensor of flat element `index` of this rank's slice (DESIGN.md
  //! invariant 1: initial values are keyed by it). The identity when the parameter is whole.
  std::int64_t global_index(std::int64_t index) const noexcept {
    if (partition == Partition::replicated || shard.ranks == 1) return index;
    const Shape& global = whole_shape();
    if (partition == Partition::split_rows) {
      // Elements per row of axis 0 (1 for a vector), the same locally and globally.
      const std::int64_t inner = shape[0] == 0 ? 1 : shape.numel() / shape[0];
      return split_axis_index(index / inner, global[0]) * inner + index % inner;
    }
    // split_cols: axis 1 of a [rows, cols] matrix.
    const std::int64_t local_cols = shape[1];
    return index / local_cols * global[1] + split_axis_index(index % local_cols, global[1]);
  }

  //! A run of this rank's slice that is also a run of the global tensor: element `index` is at
  //! global_index(index), and so are the `count` - 1 elements after it at the global positions
  //! after that one. The run ends where the slice's piece of the split axis ends (or at the
  //! tensor's end when the parameter is whole), so a slice is copied a piece at a time rather
  //! than an element at a time.
  struct GlobalRun {
    std::int64_t global = 0, count = 0;
  };
  GlobalRun global_run(std::int64_t index) const noexcept {
    if (partition == Partition::replicated || shard.ranks == 1) return {index, shape.numel() - index};
    const Shape& global = whole_shape();
    if (partition == Partition::split_rows) {
      // A piece of axis 0 is `piece` consecutive global rows, each `inner` contiguous elements.
      const std::int64_t inner = shape[0] == 0 ? 1 : shape.numel() / shape[0];
      const std::int64_t piece = global[0] / shard.groups / shard.ranks;
      const std::int64_t row = index / inner;
      return {global_index(index), (piece - row % piece) * inner - index % inner};
    }
    // split_cols: a piece is `piece` consecutive columns of one row.
    const std::int64_t piece = global[1] / shard.groups / shard.ranks;
    return {global_index(index), piece - index % shape[1] % piece};
  }

 private:
  //! Global position along the split axis (of length `global_extent`) of local position `local`.
  std::int64_t split_axis_index(std::int64_t local, std::int64_t global_extent) const noexcept {
    const std::int64_t block = global_extent / shard.groups, piece = block / shard.ranks;
    return local / piece * block + shard.rank * piece + local % piece;
  }
};

//! `spec` (whole, global shape) cut for rank `rank` of a tensor-parallel group of `ranks` along
//! the axis its Partition names: the local shape, the global shape and the Shard. A replicated
//! spec comes back whole. Throws loom::Error naming the parameter when the split axis (or one
//! of its `shard.groups` blocks) is not a multiple of `ranks`.
inline ParameterSpec tensor_parallel_slice(ParameterSpec spec, std::int64_t ranks, std::int64_t rank) {
  LOOM_CHECK(ranks >= 1, "tensor-parallel slice of " + spec.name + ": ranks", ranks, "must be >= 1");
  LOOM_CHECK(rank >= 0 && rank < ranks, "tensor-parallel slice of " + spec.name + ": rank", rank,
             "must be in [0, ranks = " + detail::to_text(ranks) + ")");
  LOOM_CHECK(spec.shard.ranks == 1, "tensor-parallel slice of " + spec.name + ": shard.ranks",
             spec.shard.ranks, "must be 1 (the spec must be the whole tensor)");
  spec.global_shape = spec.whole_shape();
  if (spec.partition == Partition::replicated) return spec;
  const int axis = spec.partition == Partition::split_rows ? 0 : 1;
  const Shape& global = spec.global_shape;
  LOOM_CHECK(global.rank() > axis, "tensor-parallel slice of " + spec.name + ": shape", global,
             axis == 0 ? "split_rows needs rank >= 1" : "split_cols needs a [rows, cols] matrix");
  LOOM_CHECK(global.rank() <= 2, "tensor-parallel slice of " + spec.name + ": shape", global,
             "only vectors and matrices can be split");
  const std::int64_t groups = spec.shard.groups;
  LOOM_CHECK(groups >= 1 && global[axis] % groups == 0,
             "tensor-parallel slice of " + spec.name + ": shard.groups", groups,
             "must be >= 1 and divide axis " + detail::to_text(axis) + " (" +
                 detail::to_text(global[axis]) + ")");
  LOOM_CHECK(global[axis] / groups % ranks == 0,
             "tensor-parallel slice of " + spec.name + ": axis " + detail::to_text(axis) + " extent",
             global[axis],
             "must be a multiple of " + (groups > 1 ? detail::to_text(groups) + " blocks x " : std::string()) +
                 "the tensor-parallel size (" + detail::to_text(ranks) + ")");
  spec.shape = axis == 0 ? (global.rank() == 1 ? Shape{global[0] / ranks} : Shape{global[0] / ranks, global[1]})
                         : Shape{global[0], global[1] / ranks};
  spec.shard = {.ranks = ranks, .rank = rank, .groups = groups};
  return spec;
}

//! The value parameter `name` has at flat element `index` under `init` and `seed`.
//! A pure function (DESIGN.md invariant 1): any rank can compute any element.
inline double initial_value(std::uint64_t seed, std::string_view name, const Shape& shape,
                            const Init& init, std::int64_t index) {
  switch (init.kind) {
    case Init::Kind::zeros: return 0.0;
    case Init::Kind::ones: return 1.0;
    case Init::Kind::normal:
      if (init.rows >= 0 && index / shape.cols() >= init.rows) return 0.0;
      return init.stddev * CounterRng(seed, name).normal(static_cast<std::uint64_t>(index));
  }
  return 0.0;
}

//! Where each parameter lives in the flat buffer: offsets in declaration order, so each
//! layer's parameters are one contiguous range when specs are ordered by layer.
class ParameterLayout {
 public:
  struct Entry {
    ParameterSpec spec;
    std::int64_t offset = 0;  //!< first element in the flat buffer
    std::int64_t numel() const noexcept { return spec.shape.numel(); }
  };

  ParameterLayout() = default;
  explicit ParameterLayout(std::vector<ParameterSpec> specs) {
    int last_layer = 0;
    for (auto& spec : specs) {
      LOOM_CHECK(spec.layer >= last_layer, "parameter layout: layer of " + spec.name, spec.layer,
                 "parameters must be declared in layer order (previous was layer " +
                     detail::to_text(last_layer) + ")");
      last_layer = spec.layer;
      LOOM_CHECK(!index_.contains(spec.name), "parameter layout: name", spec.name,
                 "parameter names must be unique");
      check_shard(spec);
      if (spec.global_shape.rank() == 0) spec.global_shape = spec.shape;
      index_.emplace(spec.name, entries_.size());
      const std::int64_t n = spec.shape.numel();
      entries_.push_back({std::move(spec), total_});
      total_ += n;
    }
  }

  std::span<const Entry> entries() const noexcept { return entries_; }
  //! Elements in the flat buffer.
  std::int64_t total() const noexcept { return total_; }
  //! The entry named `name`; loom::Error if there is none.
  const Entry& find(std::string_view name) const {
    auto it = index_.find(std::string(name));
    LOOM_CHECK(it != index_.end(), "parameter layout: lookup", name, "no parameter has this name");
    return entries_[it->second];
  }
  bool contains(std::string_view name) const { return index_.contains(std::string(name)); }

  //! The parameter's elements inside `flat` (a buffer laid out by this layout).
  template <class T>
  Tensor<T> view(T* flat, std::string_view name) const {
    const Entry& e = find(name);
    return {flat + e.offset, e.spec.shape};
  }
  template <class T>
  Tensor<T> view(T* flat, const Entry& e) const {
    return {flat + e.offset, e.spec.shape};
  }

  //! Fills `out` with the initial values of layout elements [begin, end) (invariant 1: any rank
  //! computes any slice, e.g. its ZeRO-3 shard, without the rest). A tensor-parallel slice gets
  //! the values of its elements' global indices.
  template <class T>
  void initialize(T* out, std::int64_t begin, std::int64_t end, std::uint64_t seed) const {
    for (const Entry& e : entries_) {
      const std::int64_t first = std::max(begin, e.offset), last = std::min(end, e.offset + e.numel());
      if (first >= last) continue;
      T* p = out + (first - begin);
      const std::int64_t from = first - e.offset, n = last - first;
#pragma omp parallel for schedule(static) if (n > (1 << 14))
      for (std::int64_t i = 0; i < n; ++i)
        p[i] = static_cast<T>(initial_value(seed, e.spec.name, e.spec.global_shape, e.spec.init,
                                            e.spec.global_index(from + i)));
    }
  }

  //! Fills `flat` with every parameter's initial values (invariant 1).
  template <class T>
  void initialize(T* flat, std::uint64_t seed) const {
    for (const Entry& e : entries_) {
      const std::int64_t n = e.numel();
      T* p = flat + e.offset;
      // Each element is a pure function of its index, so any split over threads is exact.
#pragma omp parallel for schedule(static) if (n > (1 << 14))
      for (std::int64_t i = 0; i < n; ++i)
        p[i] = static_cast<T>(initial_value(seed, e.spec.name, e.spec.global_shape, e.spec.init,
                                            e.spec.global_index(i)));
    }
  }

 private:
  //! A sliced spec must describe a slice that exists: the local shape is the global shape with
  //! the split axis divided by shard.ranks.
  static void check_shard(const ParameterSpec& spec) {
    if (spec.global_shape.rank() == 0) {
      LOOM_CHECK(spec.shard.ranks == 1, "parameter layout: shard.ranks of " + spec.name, spec.shard.ranks,
                 "a sliced parameter needs its global_shape (use tensor_parallel_slice)");
      return;
    }
    const Shape& g = spec.global_shape;
    const Shape expected = spec.partition == Partition::replicated || spec.shard.ranks == 1 ? g
                           : spec.partition == Partition::split_rows
                               ? (g.rank() == 1 ? Shape{g[0] / spec.shard.ranks} : Shape{g[0] / spec.shard.ranks, g[1]})
                               : Shape{g[0], g.rank() > 1 ? g[1] / spec.shard.ranks : 0};
    LOOM_CHECK(spec.shape == expected, "parameter layout: shape of " + spec.name, spec.shape,
               "must be the slice " + detail::to_text(expected) + " of global_shape " + detail::to_text(g) +
                   " for shard " + detail::to_text(spec.shard));
  }

  std::vector<Entry> entries_;
  std::unordered_map<std::string, std::size_t> index_;
  std::int64_t total_ = 0;
};

//! The layout of the whole tensors: every parameter of `layout` (one tensor-parallel rank's
//! slices) at its global shape, unsharded, in the same order. Every rank of a tensor-parallel
//! group gets the same layout, the one a single rank would have; checkpoints are written in it.
inline ParameterLayout whole_layout(const ParameterLayout& layout) {
  std::vector<ParameterSpec> specs;
  for (const ParameterLayout::Entry& e : layout.entries()) {
    ParameterSpec spec = e.spec;
    spec.shape = spec.whole_shape();
    spec.global_shape = spec.shape;
    spec.shard = Shard{};
    specs.push_back(std::move(spec));
  }
  return ParameterLayout(std::move(specs));
}

//! Elements [local, local + count) of a rank's buffer that are elements [whole, whole + count)
//! of the whole layout.
struct WholeRun {
  std::int64_t local = 0, whole = 0, count = 0;
  friend bool operator==(const WholeRun&, const WholeRun&) = default;
};

//! Appends to `runs` where elements [begin, begin + count) of `layout` (a tensor-parallel rank's
//! slices), stored from position `local` of a buffer, lie in `whole` (whole_layout(layout)):
//! each element at its parameter's global_index. Parameters every rank holds whole
//! (Partition::replicated) are left out unless `with_replicated`, so that the ranks of a group
//! can claim disjoint elements. Elements adjacent on both sides share a run: an unsliced layout
//! is one run.
inline void append_whole_runs(const ParameterLayout& layout, const ParameterLayout& whole, std::int64_t begin,
                              std::int64_t count, std::int64_t local, bool with_replicated,
                              std::vector<WholeRun>& runs) {
  const auto add = [&runs](std::int64_t at, std::int64_t to, std::int64_t n) {
    if (!runs.empty() && runs.back().local + runs.back().count == at && runs.back().whole + runs.back().count == to)
      runs.back().count += n;
    else
      runs.push_back({at, to, n});
  };
  const auto entries = layout.entries();
  const std::int64_t end = begin + count;
  const auto ends_after = [](std::int64_t x, const ParameterLayout::Entry& e) { return x < e.offset + e.numel(); };
  auto it = std::upper_bound(entries.begin(), entries.end(), begin, ends_after);
  for (; it != entries.end() && it->offset < end; ++it) {
    const ParameterSpec& spec = it->spec;
    if (spec.replicated_over_tensor_parallel() && !with_replicated) continue;
    const std::int64_t first = std::max(begin, it->offset) - it->offset;
    const std::int64_t last = std::min(end, it->offset + it->numel()) - it->offset;
    const std::int64_t to = whole.entries()[static_cast<std::size_t>(it - entries.begin())].offset;
    const std::int64_t at = local + (it->offset + first - begin);
    if (spec.replicated_over_tensor_parallel() || spec.shard.ranks == 1) {
      add(at, to + first, last - first);
      continue;
    }
    for (std::int64_t i = first; i < last;) {
      const ParameterSpec::GlobalRun run = spec.global_run(i);
      const std::int64_t n = std::min(run.count, last - i);
      add(at + (i - first), to + run.global, n);
      i += n;
    }
  }
}

//! Writes each element of `local` (laid out by `layout`, a tensor-parallel rank's slices) to its
//! place in `out` (laid out by `whole`, which is whole_layout(layout)); parameters every rank
//! holds whole (Partition::replicated) only when `with_replicated`, so that the ranks of a group
//! write disjoint elements and a sum over the group assembles each once.
template <class T>
void scatter_to_whole(const ParameterLayout& layout, const T* local, const ParameterLayout& whole, T* out,
                      bool with_replicated) {
  std::vector<WholeRun> runs;
  append_whole_runs(layout, whole, 0, layout.total(), 0, with_replicated, runs);
  for (const WholeRun& r : runs) std::copy_n(local + r.local, r.count, out + r.whole);
}

//! The inverse of scatter_to_whole: fills `local` (laid out by `layout`) with its elements of
//! `values` (laid out by `whole`, which is whole_layout(layout)).
template <class T>
void gather_from_whole(const ParameterLayout& layout, const T* values, const ParameterLayout& whole, T* local) {
  std::vector<WholeRun> runs;
  append_whole_runs(layout, whole, 0, layout.total(), 0, true, runs);
  for (const WholeRun& r : runs) std::copy_n(values + r.whole, r.count, local + r.local);
}

//! The WholeIndex of the run of `spec`'s slice that starts at its flat element `first`.
inline WholeIndex whole_index(const ParameterSpec& spec, std::int64_t first) {
  WholeIndex w;
  w.first = first;
  w.cols = matrix_view(spec.whole_shape()).cols;
  if (spec.partition == Partition::replicated || spec.shard.ranks == 1) return w;
  const Shape& whole = spec.whole_shape();
  const int axis = spec.partition == Partition::split_rows ? 0 : 1;
  w.block = whole[axis] / spec.shard.groups;
  w.piece = w.block / spec.shard.ranks;
  w.rank = spec.shard.rank;
  if (spec.partition == Partition::split_rows) {
    w.kind = WholeIndex::split_rows;
    w.local_inner = spec.shape[0] == 0 ? 1 : spec.shape.numel() / spec.shape[0];
  } else {
    w.kind = WholeIndex::split_cols;
    w.local_inner = spec.shape[1];
    w.whole_cols = whole[1];
  }
  return w;
}

}  // namespace loom
