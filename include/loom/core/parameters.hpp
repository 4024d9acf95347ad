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

namespace loom {

//! How a parameter is split across a tensor-parallel group.
enum class Partition {
  replicated,  //!< every rank holds all of it (layernorms, row-parallel biases)
  split_rows,  //!< axis 0 is split (column-parallel linear, vocab-parallel embedding)
  split_cols,  //!< axis 1 is split (row-parallel linear)
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

//! A named parameter: global name and shape, owning layer, and how it is treated.
struct ParameterSpec {
  std::string name;  //!< global name, e.g. "h.3.attn.qkv.weight"; keys the initial values
  Shape shape;       //!< global shape
  int layer = 0;     //!< index of the layer that owns it
  bool weight_decay = false;  //!< AdamW decays it (matrices yes; biases and norms no)
  Partition partition = Partition::replicated;
  Init init{};
};

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
  //! computes any slice, e.g. its ZeRO-3 shard, without the rest).
  template <class T>
  void initialize(T* out, std::int64_t begin, std::int64_t end, std::uint64_t seed) const {
    for (const Entry& e : entries_) {
      const std::int64_t first = std::max(begin, e.offset), last = std::min(end, e.offset + e.numel());
      if (first >= last) continue;
      T* p = out + (first - begin);
      const std::int64_t from = first - e.offset, n = last - first;
#pragma omp parallel for schedule(static) if (n > (1 << 14))
      for (std::int64_t i = 0; i < n; ++i)
        p[i] = static_cast<T>(initial_value(seed, e.spec.name, e.spec.shape, e.spec.init, from + i));
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
        p[i] = static_cast<T>(initial_value(seed, e.spec.name, e.spec.shape, e.spec.init, i));
    }
  }

 private:
  std::vector<Entry> entries_;
  std::unordered_map<std::string, std::size_t> index_;
  std::int64_t total_ = 0;
};

}  // namespace loom
