#pragma once
//! \file Counter-based random numbers (Philox 4x32-10, Salmon et al., SC'11) and the keys that
//! make every parameter element a pure function of (seed, global name, global index).

#include <array>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <string_view>

#include "loom/core/hd.hpp"

namespace loom {

//! Philox 4x32 with 10 rounds: a bijection of a 128-bit counter under a 64-bit key. Stateless,
//! so any element of any stream can be drawn in any order on any rank.
struct Philox4x32 {
  using Counter = std::array<std::uint32_t, 4>;
  using Key = std::array<std::uint32_t, 2>;

  //! Encrypts `counter` under `key`.
  LOOM_HD static constexpr Counter generate(Counter counter, Key key) noexcept {
    for (int round = 0; round < 10; ++round) {
      if (round > 0) {
        key[0] += weyl0;
        key[1] += weyl1;
      }
      const std::uint64_t p0 = std::uint64_t{multiplier0} * counter[0];
      const std::uint64_t p1 = std::uint64_t{multiplier1} * counter[2];
      counter = {static_cast<std::uint32_t>(p1 >> 32) ^ counter[1] ^ key[0],
                 static_cast<std::uint32_t>(p1),
                 static_cast<std::uint32_t>(p0 >> 32) ^ counter[3] ^ key[1],
                 static_cast<std::uint32_t>(p0)};
    }
    return counter;
  }

  static constexpr std::uint32_t multiplier0 = 0xD2511F53u, multiplier1 = 0xCD9E8D57u;
  static constexpr std::uint32_t weyl0 = 0x9E3779B9u, weyl1 = 0xBB67AE85u;
};

//! A 64-bit key for the stream named `name` under `seed` (FNV-1a of the name, mixed with the
//! seed by splitmix64's finaliser so that nearby seeds give unrelated keys).
constexpr Philox4x32::Key stream_key(std::uint64_t seed, std::string_view name) noexcept {
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (char c : name) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  std::uint64_t z = h ^ (seed + 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return {static_cast<std::uint32_t>(z), static_cast<std::uint32_t>(z >> 32)};
}

//! Draws of the stream with key `key`: element `index` of every distribution depends only on
//! (key, index), never on what was drawn before.
class CounterRng {
 public:
  constexpr explicit CounterRng(Philox4x32::Key key) noexcept : key_(key) {}
  constexpr CounterRng(std::uint64_t seed, std::string_view name) noexcept
      : key_(stream_key(seed, name)) {}

  //! Four raw 32-bit words for `index`; `lane` selects an independent sub-stream.
  LOOM_HD constexpr Philox4x32::Counter bits(std::uint64_t index,
                                             std::uint32_t lane = 0) const noexcept {
    return Philox4x32::generate({static_cast<std::uint32_t>(index),
                                 static_cast<std::uint32_t>(index >> 32), lane, 0u},
                                key_);
  }
  //! Uniform in (0, 1) for `index`.
  LOOM_HD double uniform(std::uint64_t index, std::uint32_t lane = 0) const noexcept {
    return to_unit(bits(index, lane)[0]);
  }
  //! Standard normal for `index` (Box-Muller on two words of one Philox block).
  LOOM_HD double normal(std::uint64_t index, std::uint32_t lane = 0) const noexcept {
    const auto w = bits(index, lane);
    const double u1 = to_unit(w[0]), u2 = to_unit(w[1]);
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
  }
  //! Uniform integer in [0, n) for `index` (64 random bits, negligible bias for n < 2^32).
  LOOM_HD std::uint64_t below(std::uint64_t n, std::uint64_t index,
                              std::uint32_t lane = 0) const noexcept {
    const auto w = bits(index, lane);
    const std::uint64_t r = (std::uint64_t{w[0]} << 32) | w[1];
    return r % n;
  }

 private:
  LOOM_HD static constexpr double to_unit(std::uint32_t x) noexcept {
    return (static_cast<double>(x) + 0.5) * (1.0 / 4294967296.0);
  }
  Philox4x32::Key key_;
};

}  // namespace loom
