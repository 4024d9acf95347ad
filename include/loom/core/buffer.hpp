#pragma once
//! \file Buffer: an owning, accounted, contiguous allocation on a backend.

#include <cstdint>
#include <utility>

#include "loom/backend/concepts.hpp"
#include "loom/core/error.hpp"
#include "loom/core/tensor.hpp"

namespace loom {

//! `size` elements of T on backend `B`, counted under one memory category while alive.
//! Move-only; the contents start uninitialised (call `zero()` when that matters).
template <class T, Backend B>
class Buffer {
 public:
  Buffer() = default;
  Buffer(B& backend, std::int64_t size, MemoryCategory category)
      : backend_(&backend), size_(size), category_(category) {
    LOOM_CHECK(size >= 0, "buffer size", size, "must be >= 0");
    if (size_ > 0) data_ = static_cast<T*>(backend.allocate(bytes(), category));
  }
  Buffer(Buffer&& other) noexcept { swap(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    Buffer(std::move(other)).swap(*this);
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() {
    if (data_) backend_->deallocate(data_, bytes(), category_);
  }

  T* data() const noexcept { return data_; }
  std::int64_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return static_cast<std::size_t>(size_) * sizeof(T); }
  MemoryCategory category() const noexcept { return category_; }
  //! The whole buffer as a rank-1 tensor.
  Tensor<T> view() const noexcept { return {data_, Shape{size_}}; }
  //! `shape.numel()` elements starting at element `offset`.
  Tensor<T> view(std::int64_t offset, Shape shape) const {
    LOOM_CHECK(offset >= 0 && offset + shape.numel() <= size_, "buffer view",
               detail::to_text(offset) + " + " + detail::to_text(shape.numel()),
               "the view must lie within the buffer's " + detail::to_text(size_) + " elements");
    return {data_ + offset, shape};
  }
  //! Sets every byte to zero.
  void zero() {
    if (data_) backend_->fill_zero(data_, bytes());
  }

  void swap(Buffer& other) noexcept {
    std::swap(backend_, other.backend_);
    std::swap(data_, other.data_);
    std::swap(size_, other.size_);
    std::swap(category_, other.category_);
  }

 private:
  B* backend_ = nullptr;
  T* data_ = nullptr;
  std::int64_t size_ = 0;
  MemoryCategory category_ = MemoryCategory::workspace;
};

}  // namespace loom
