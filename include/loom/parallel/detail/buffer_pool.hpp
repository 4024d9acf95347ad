#pragma once
//! \file BufferPool: buffers handed out and taken back, best fit by size, so that a step that
//! needs the same working buffers as the last one allocates nothing (ZeRO's gathered parameters
//! and per-unit gradients). A buffer may be larger than asked for. Everything the pool holds, in
//! use or free, stays counted under its memory category.

#include <cstdint>
#include <utility>
#include <vector>

#include "loom/core/buffer.hpp"

namespace loom::detail {

template <class T, class B>
class BufferPool {
 public:
  BufferPool(B& backend, MemoryCategory category) : backend_(&backend), category_(category) {}

  //! A buffer of at least `size` elements (contents unspecified): the smallest free one that is
  //! large enough, or a new one of exactly `size`.
  Buffer<T, B> acquire(std::int64_t size) {
    std::size_t best = free_.size();
    for (std::size_t i = 0; i < free_.size(); ++i)
      if (free_[i].size() >= size && (best == free_.size() || free_[i].size() < free_[best].size())) best = i;
    if (best == free_.size()) return Buffer<T, B>(*backend_, size, category_);
    Buffer<T, B> b = std::move(free_[best]);
    free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(best));
    return b;
  }
  //! Takes `buffer` back for a later acquire of the same size.
  void release(Buffer<T, B>&& buffer) {
    if (buffer.size() > 0) free_.push_back(std::move(buffer));
  }

 private:
  B* backend_;
  MemoryCategory category_;
  std::vector<Buffer<T, B>> free_;
};

}  // namespace loom::detail
