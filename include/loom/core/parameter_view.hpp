#pragma once
//! \file ParameterView: where a layer finds the elements of its parameters (or of their
//! gradients) by their offset in the flat layout. On one rank it is the whole flat buffer; under
//! ZeRO-3 it is the few gathered buffers that hold the layer's parameters, so a layer's code
//! never knows how the state is sharded.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/core/error.hpp"

namespace loom {

//! A contiguous range [begin, end) of flat layout elements.
struct ElementRange {
  std::int64_t begin = 0, end = 0;
  std::int64_t size() const noexcept { return end - begin; }
  friend bool operator==(const ElementRange&, const ElementRange&) = default;
};

//! The elements of `from` not in any range of `cut`, as ranges in `from`'s order (each range of
//! `from` split where `cut` covers parts of it; empty pieces left out).
inline std::vector<ElementRange> subtract_ranges(const std::vector<ElementRange>& from, std::vector<ElementRange> cut) {
  std::sort(cut.begin(), cut.end(), [](const ElementRange& a, const ElementRange& b) { return a.begin < b.begin; });
  std::vector<ElementRange> out;
  for (const ElementRange& r : from) {
    std::int64_t at = r.begin;
    for (const ElementRange& c : cut) {
      if (c.end <= at || c.begin >= r.end) continue;
      if (c.begin > at) out.push_back({at, c.begin});
      at = std::max(at, c.end);
    }
    if (at < r.end) out.push_back({at, r.end});
  }
  return out;
}

//! Up to `max_windows` ranges of the flat layout, each stored contiguously somewhere; `at`
//! finds the storage of elements by their flat offset.
template <class T>
class ParameterView {
 public:
  static constexpr int max_windows = 4;

  ParameterView() = default;
  //! The whole layout, stored from `base`.
  explicit ParameterView(T* base) noexcept { windows_[count_++] = {0, std::numeric_limits<std::int64_t>::max(), base}; }

  //! Adds layout elements [begin, end), stored from `data`.
  void add(std::int64_t begin, std::int64_t end, T* data) {
    LOOM_CHECK(count_ < max_windows, "parameter view: windows", count_ + 1,
               "at most " + std::to_string(max_windows) + " ranges per layer");
    windows_[count_++] = {begin, end, data};
  }

  //! Whether the view has no window (nothing to find).
  bool empty() const noexcept { return count_ == 0; }

  //! The storage of the `count` elements from layout offset `offset`; they must lie in one
  //! window (a layer reads only the parameters its view was made for).
  T* at(std::int64_t offset, std::int64_t count) const {
    for (int w = 0; w < count_; ++w) {
      const Window& v = windows_[w];
      if (offset >= v.begin && offset + count <= v.end) return v.data + (offset - v.begin);
    }
    throw Error("parameter view: elements", std::to_string(offset) + " + " + std::to_string(count),
                "are not in this layer's view (ParameterView::at; is layer_parameters() complete?)");
  }

  //! Calls `f(begin, end, data)` for each window: layout elements [begin, end) stored from
  //! `data` (a pipeline stage maps its own layout's windows onto the model's).
  template <class F>
  void for_each_window(F&& f) const {
    for (int w = 0; w < count_; ++w) f(windows_[w].begin, windows_[w].end, windows_[w].data);
  }

  //! The read-only view of the same windows. (A template, so that ParameterView<const T> has
  //! no conversion to its own type, which nvcc warns about even when it is constrained away.)
  template <class U = T>
    requires(!std::is_const_v<U>)
  operator ParameterView<const U>() const noexcept {
    ParameterView<const U> view;
    for (int w = 0; w < count_; ++w) view.add(windows_[w].begin, windows_[w].end, windows_[w].data);
    return view;
  }

 private:
  struct Window {
    std::int64_t begin = 0, end = 0;
    T* data = nullptr;
  };
  Window windows_[max_windows]{};
  int count_ = 0;
};

}  // namespace loom
