#pragma once
//! \file bf16: the 16-bit brain floating-point format (8 exponent bits, 7 mantissa bits), as a
//! storage type. Arithmetic converts to float; conversion from float rounds to nearest even.

#include <bit>
#include <cstdint>
#include <ostream>
#include <type_traits>

#include "loom/core/hd.hpp"

namespace loom {

//! A bfloat16 value: the upper 16 bits of an IEEE float. Converting from float rounds to
//! nearest, ties to even; NaN stays NaN.
struct bf16 {
  std::uint16_t bits = 0;

  constexpr bf16() = default;
  LOOM_HD constexpr explicit bf16(float value) noexcept : bits(round(value)) {}
  LOOM_HD constexpr explicit operator float() const noexcept {
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
  //! The value with these raw bits.
  static constexpr bf16 from_bits(std::uint16_t raw) noexcept {
    bf16 b;
    b.bits = raw;
    return b;
  }

  friend constexpr bool operator==(bf16 a, bf16 b) noexcept { return a.bits == b.bits; }
  friend std::ostream& operator<<(std::ostream& out, bf16 b) { return out << static_cast<float>(b); }

 private:
  LOOM_HD static constexpr std::uint16_t round(float value) noexcept {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    // On the GPU one conversion instruction instead of the integer steps below (about eight, in
    // every bf16 store of every kernel): the same rounding to nearest even; a NaN becomes the
    // canonical quiet NaN 0x7fff instead of keeping its payload.
    if (!std::is_constant_evaluated()) {
      std::uint16_t rounded;
      asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(rounded) : "f"(value));
      return rounded;
    }
#endif
    const std::uint32_t u = std::bit_cast<std::uint32_t>(value);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
      return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
    const std::uint32_t lsb = (u >> 16) & 1u;
    return static_cast<std::uint16_t>((u + 0x7fffu + lsb) >> 16);
  }
};

static_assert(sizeof(bf16) == 2);

}  // namespace loom
