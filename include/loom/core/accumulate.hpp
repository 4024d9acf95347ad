#pragma once
//! \file The type a kernel computes and accumulates in for a stored element type: double for
//! double, float for float and bf16 (mixed precision as llm.c and Megatron do it: bf16 storage,
//! fp32 arithmetic, one rounding per stored result).

#include <concepts>
#include <type_traits>

#include "loom/core/bf16.hpp"
#include "loom/core/hd.hpp"

namespace loom {

namespace detail {
template <class T>
struct accumulate_type {
  using type = T;
};
template <>
struct accumulate_type<bf16> {
  using type = float;
};
}  // namespace detail

//! The arithmetic and accumulation type of kernels on T elements (per-row statistics such as
//! layernorm's mean and rstd, and losses, are stored in it too).
template <class T>
using accumulate_t = typename detail::accumulate_type<std::remove_const_t<T>>::type;

//! `x` converted to its accumulate type (the identity for float and double).
template <class T>
LOOM_HD constexpr accumulate_t<T> to_accumulate(T x) noexcept {
  return static_cast<accumulate_t<T>>(x);
}

//! Whether T is stored narrower than it computes (bf16): such kernels convert on load and round
//! once on store.
template <class T>
inline constexpr bool is_narrow_storage = !std::is_same_v<std::remove_const_t<T>, accumulate_t<T>>;

//! Whether G may hold the gradients of parameters stored as T: T itself, or its accumulate type
//! (the fp32 sums of a bf16 layer's gradients, TrainerOptions::fp32_gradient_fusion).
template <class G, class T>
concept GradientOf = std::same_as<G, T> || std::same_as<G, accumulate_t<T>>;

}  // namespace loom
