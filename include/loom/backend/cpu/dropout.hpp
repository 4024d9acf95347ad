#pragma once
//! \file Dropout on the CPU backend (loom::DropoutMask): the same kernel runs in the forward (on
//! the activations) and in the backward (on their gradient), drawing the same mask.

#include <algorithm>
#include <cstdint>

#include "loom/backend/cpu/cpu.hpp"
#include "loom/core/accumulate.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/tensor.hpp"

namespace loom::detail {

//! Calls f(i, kept) for i in [0, n): whether `mask` keeps global element first + i, one Philox
//! block per four consecutive global elements.
template <class F>
void for_each_dropout_element(const DropoutMask& shared, std::uint64_t first, std::int64_t n, F&& f) {
  const DropoutMask mask = shared;  // a local copy: f's writes cannot alias it
  const std::uint64_t last = first + static_cast<std::uint64_t>(n);
  for (std::uint64_t e = first; e < last;) {
    const auto words = mask.block(e >> 2);
    const std::uint64_t block_end = std::min(last, ((e >> 2) + 1) << 2);
    for (; e < block_end; ++e) f(static_cast<std::int64_t>(e - first), mask.keeps(words[e & 3]));
  }
}

//! dst[i] = mask keeps global element first + i ? src[i] · scale : 0, for i in [0, n) (dst may
//! be src).
template <class A>
void dropout_row(const DropoutMask& mask, std::uint64_t first, const A* src, A* dst, std::int64_t n) {
  const A scale = static_cast<A>(mask.scale());
  for_each_dropout_element(mask, first, n, [&](std::int64_t i, bool kept) { dst[i] = kept ? src[i] * scale : A(0); });
}

}  // namespace loom::detail

namespace loom::inline kernels {

//! x[i] = mask keeps element first_element + i ? x[i] · scale : 0, for every i of `x` (a
//! contiguous slice of the site's global tensor starting at `first_element`). Does nothing with
//! an inactive mask. bf16 multiplies in float and rounds once.
template <class T>
void dropout(const cpu& be, Tensor<T> x, const DropoutMask& mask, std::int64_t first_element) {
  LOOM_CHECK(first_element >= 0, "dropout: first element", first_element, "must be >= 0");
  if (!mask.active() || x.numel() == 0) return;
  using A = accumulate_t<T>;
  const A scale = static_cast<A>(mask.scale());
  T* data = x.data();
  const auto first = static_cast<std::uint64_t>(first_element);
  const auto last = first + static_cast<std::uint64_t>(x.numel());  // one past
  const auto apply = [&](T& v, bool kept) { v = kept ? static_cast<T>(to_accumulate(v) * scale) : T(0); };
  // One Philox block serves four consecutive global elements: the whole blocks in the middle
  // in a tight loop, the partial ones at either end element by element.
  const std::uint64_t middle_begin = std::min(last, (first + 3) & ~std::uint64_t{3});
  const std::uint64_t middle_end = std::max(middle_begin, last & ~std::uint64_t{3});
  const auto edge = [&](std::uint64_t begin, std::uint64_t end) {
    detail::for_each_dropout_element(mask, begin, static_cast<std::int64_t>(end - begin),
                                     [&](std::int64_t i, bool kept) { apply(data[begin - first + i], kept); });
  };
  edge(first, middle_begin);
  const auto first_block = static_cast<std::int64_t>(middle_begin >> 2),
             end_block = static_cast<std::int64_t>(middle_end >> 2);
  // Each thread's own copy of the mask and scale: read through the shared ones, every block
  // reloads them (the writes to `data` might alias them), which doubles the kernel's time.
  const DropoutMask local = mask;
  const A local_scale = scale;
#pragma omp parallel for num_threads(be.threads()) schedule(static) firstprivate(local, local_scale) \
    if (x.numel() > (1 << 15))
  for (std::int64_t b = first_block; b < end_block; ++b) {
    const auto words = local.block(static_cast<std::uint64_t>(b));
    T* v = data + ((static_cast<std::uint64_t>(b) << 2) - first);
    for (int k = 0; k < 4; ++k) v[k] = local.keeps(words[k]) ? static_cast<T>(to_accumulate(v[k]) * local_scale) : T(0);
  }
  edge(middle_end, last);
}

}  // namespace loom::inline kernels
