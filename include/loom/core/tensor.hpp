#pragma once
//! \file Shapes and non-owning tensor views over flat buffers (DESIGN.md invariant 4).

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <type_traits>

#include "loom/core/error.hpp"

namespace loom {

//! A row-major shape of rank 0..4 (rank 0 is a scalar with one element).
class Shape {
 public:
  static constexpr int max_rank = 4;

  constexpr Shape() = default;
  constexpr Shape(std::initializer_list<std::int64_t> extents) {
    if (extents.size() > max_rank) throw Error("shape", extents.size(), "rank must be <= 4");
    for (std::int64_t e : extents) {
      if (e < 0) throw Error("shape extent", e, "extents must be >= 0");
      extents_[rank_++] = e;
    }
  }

  //! The shape with `extents` (at most max_rank, each >= 0), e.g. read from a file.
  static constexpr Shape of(std::span<const std::int64_t> extents) {
    if (extents.size() > max_rank) throw Error("shape", extents.size(), "rank must be <= 4");
    Shape s;
    for (std::int64_t e : extents) {
      if (e < 0) throw Error("shape extent", e, "extents must be >= 0");
      s.extents_[s.rank_++] = e;
    }
    return s;
  }

  constexpr int rank() const noexcept { return rank_; }
  constexpr std::int64_t operator[](int axis) const noexcept { return extents_[axis]; }
  //! Number of elements (product of extents; 1 for rank 0).
  constexpr std::int64_t numel() const noexcept {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= extents_[i];
    return n;
  }
  //! Extent of the last axis (1 for rank 0): the row length of the 2-D view.
  constexpr std::int64_t cols() const noexcept { return rank_ == 0 ? 1 : extents_[rank_ - 1]; }
  //! Product of all but the last axis: the row count of the 2-D view.
  constexpr std::int64_t rows() const noexcept { return cols() == 0 ? 0 : numel() / cols(); }

  friend constexpr bool operator==(const Shape& a, const Shape& b) noexcept {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a.extents_[i] != b.extents_[i]) return false;
    return true;
  }
  friend std::ostream& operator<<(std::ostream& out, const Shape& s) {
    out << '[';
    for (int i = 0; i < s.rank_; ++i) out << (i ? ", " : "") << s.extents_[i];
    return out << ']';
  }

 private:
  std::array<std::int64_t, max_rank> extents_{};
  int rank_ = 0;
};

//! A non-owning view of `shape.numel()` contiguous elements of T in row-major order.
//! `Tensor<const T>` is the read-only view; a `Tensor<T>` converts to it implicitly.
template <class T>
class Tensor {
 public:
  using value_type = std::remove_const_t<T>;

  constexpr Tensor() = default;
  constexpr Tensor(T* data, Shape shape) noexcept : data_(data), shape_(shape) {}
  //! Read-only view of a mutable tensor.
  template <class U>
    requires(std::is_const_v<T> && std::is_same_v<U, std::remove_const_t<T>>)
  constexpr Tensor(const Tensor<U>& other) noexcept : data_(other.data()), shape_(other.shape()) {}

  constexpr T* data() const noexcept { return data_; }
  constexpr const Shape& shape() const noexcept { return shape_; }
  constexpr std::int64_t numel() const noexcept { return shape_.numel(); }
  constexpr std::int64_t extent(int axis) const noexcept { return shape_[axis]; }
  constexpr bool empty() const noexcept { return data_ == nullptr || numel() == 0; }
  //! Flat element access.
  constexpr T& operator[](std::int64_t i) const noexcept { return data_[i]; }
  constexpr T* begin() const noexcept { return data_; }
  constexpr T* end() const noexcept { return data_ + numel(); }

  //! The same elements seen with another shape of equal element count.
  Tensor reshape(Shape shape) const {
    LOOM_CHECK(shape.numel() == numel(), "tensor reshape", shape,
               "the new shape must hold " + detail::to_text(numel()) + " elements");
    return Tensor(data_, shape);
  }

 private:
  T* data_ = nullptr;
  Shape shape_{};
};

//! Checks that a tensor with elements has data (a default-constructed Tensor has none).
template <class T>
void check_data(const Tensor<T>& t, const char* kernel, const char* arg) {
  if (t.data() == nullptr && t.numel() > 0) [[unlikely]]
    throw Error(std::string(kernel) + ": argument " + arg, "a tensor without data",
                "a required argument needs " + detail::to_text(t.numel()) + " elements of storage");
}

//! Checks a kernel argument's shape; the message names the kernel and the argument.
template <class T>
void check_shape(const Tensor<T>& t, const Shape& expected, const char* kernel, const char* arg) {
  if (!(t.shape() == expected)) [[unlikely]]
    throw Error(std::string(kernel) + ": argument " + arg + " shape", detail::to_text(t.shape()),
                "expected " + detail::to_text(expected));
  check_data(t, kernel, arg);
}

//! Checks that a kernel argument has exactly `n` elements, whatever its shape.
template <class T>
void check_numel(const Tensor<T>& t, std::int64_t n, const char* kernel, const char* arg) {
  if (t.numel() != n) [[unlikely]]
    throw Error(std::string(kernel) + ": argument " + arg + " element count",
                detail::to_text(t.numel()), "expected " + detail::to_text(n));
  check_data(t, kernel, arg);
}

}  // namespace loom
