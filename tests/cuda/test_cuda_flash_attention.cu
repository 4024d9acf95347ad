// The SRAM-tiled attention kernels (detail/flash_attention.cuh), causal and bidirectional, against
// a double reference, on bf16 data at head sizes 32, 64 and 128 and token counts that leave
// partial tiles.
//
// Without a GPU the kernel bodies still run here: HostThread (host_block.hpp) runs each block with
// its 128 threads as fibers (barriers for __syncthreads, a shared exchange for the shuffles)
// and each mma.sync from the 32 lanes' fragments by the documented m16n8k16 layout, each lane
// computing its own part of the result from what the others published, as on the GPU. Shared
// memory starts as garbage. So the tiling, the online softmax, both masks, the partial tiles, the
// fragment indexing and the barriers are checked without a GPU, for warps of one 16-row block (M = 1, the
// library's launch) and of two (M = 2, which must give M = 1's values); with one, the same checks
// run on the device kernels through attention_forward_lse/backward_lse, against the cuBLAS path and
// for M = 2 launched directly, and a single mma checks the layout itself against a plain product.
//
// Tolerances. bf16 keeps 8 significant bits: the probabilities fed to the tensor cores are rounded
// (relative 2^-9), so are dS and every result. A result passes when
// |got - want| <= 1.5e-2 * magnitude + 2^-8 |want|, where magnitude is the sum of |terms| of the
// result's own formula (out: sum_s p |v|; dv: sum_t p |dout|; dq, dk: sum |dS| |k| or |q| with
// |dS| <= p (|dP| + sum |dout| |out| + sum p |dP|) scale). lse is computed in float from exact
// products: |got - want| <= 1e-4 (1 + |want|). A wrong index, mask or barrier is off by O(1).
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <type_traits>
#include <vector>

#include "loom/backend/attention_mask.hpp"
#include "loom/backend/cuda/attention.cuh"
#include "loom/backend/cuda/detail/flash_attention.cuh"
#include "loom/core/bf16.hpp"
#include "loom/core/dropout.hpp"
#include "attention_case.hpp"
#include "device_check.hpp"
#include "host_block.hpp"
#include "mismatch_report.hpp"

using namespace loom;
using namespace loom::cuda_test;

namespace {

namespace fl = detail::flash;

// ---------------------------------------------------------------------------------------------
// Cases, data and the double reference.

using Case = AttentionCase;

//! Partial tiles (T % 64 != 0), one token, exactly one and two tiles, each head size.
std::vector<Case> host_cases() {
  return {{1, 1, 1, 32}, {2, 70, 2, 32}, {1, 64, 1, 64}, {1, 129, 2, 64}, {2, 33, 1, 128}, {1, 100, 1, 128}};
}

//! The bidirectional mask's host cases: T = 1, 33, 64, 100, 129 (one partial tile, one whole, two
//! and three tiles, the last partial), each head size.
std::vector<Case> bidirectional_host_cases() {
  return {{1, 1, 1, 32}, {2, 33, 2, 32}, {1, 64, 1, 64}, {1, 100, 1, 128}, {1, 129, 2, 64}};
}

constexpr AttentionMask both_masks[] = {AttentionMask::causal, AttentionMask::bidirectional};

std::vector<double> widen(const std::vector<bf16>& v) {
  std::vector<double> d(v.size());
  std::transform(v.begin(), v.end(), d.begin(), [](bf16 x) { return static_cast<double>(static_cast<float>(x)); });
  return d;
}

struct Data {
  std::vector<bf16> qkv, dout, dqkv0;
};

//! q and k spread over [-2, 2] so that the softmax rows are far from uniform.
Data make_data(const Case& c, std::uint32_t seed) {
  return {random_bf16(c.B * c.T * 3 * c.C(), seed, -2.0f, 2.0f), random_bf16(c.B * c.T * c.C(), seed + 1),
          random_bf16(c.B * c.T * 3 * c.C(), seed + 2)};
}

struct Expected {
  std::vector<double> value, magnitude;
};

struct Reference {
  Expected out, lse, dqkv;
};

//! The sequences' lengths of a padded case ([B], each in [1, T]); empty: every sequence T long.
using Lengths = std::vector<std::int32_t>;

//! The exact forward and backward from the bf16 inputs, in double, query t seeing keys s <= t
//! (causal) or all s < T (bidirectional), and with `lengths` only keys s < lengths[b]; a padded
//! query (t >= lengths[b]) sees none: its out and lse are 0 and it gives no gradient. The kernels'
//! backward reads their own bf16 out for D = dout·out; the dq and dk magnitudes include
//! sum |dout| |out| for it. With `drop` (active), by definition: Z = the mask's keep times
//! 1 / (1 - rate) at global element head_origin(b, h, T) + t T + s, out = (P Z) v, lse the
//! softmax's, dv = (P Z)^T dout, dP = (dout v^T) Z, dS = P (dP - D) scale with D = sum_s P dP.
Reference reference(const Case& c, const Data& data, AttentionMask mask = AttentionMask::causal,
                    const Lengths& lengths = {}, const AttentionDropout* drop = nullptr) {
  const std::vector<double> qkv = widen(data.qkv), dout = widen(data.dout), dqkv0 = widen(data.dqkv0);
  const std::int64_t T = c.T, C = c.C(), hs = c.hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  const auto q = [&](std::int64_t b, std::int64_t t, std::int64_t part, std::int64_t h, std::int64_t i) {
    return (b * T + t) * 3 * C + part * C + h * hs + i;
  };
  const auto o = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t i) {
    return (b * T + t) * C + h * hs + i;
  };
  std::int64_t length = T;  // of the batch element below
  const auto keys = [&](std::int64_t t) -> std::int64_t {
    if (t >= length) return 0;
    return mask == AttentionMask::causal ? t + 1 : length;
  };
  Reference r;
  r.out = {std::vector<double>(static_cast<std::size_t>(c.B * T * C)), std::vector<double>(c.B * T * C)};
  r.lse = {std::vector<double>(static_cast<std::size_t>(c.B * c.NH * T)), std::vector<double>(c.B * c.NH * T)};
  r.dqkv = {dqkv0, std::vector<double>(dqkv0.size())};
  std::vector<double> p(static_cast<std::size_t>(T * T)), dp(p.size()), ds(p.size()), ds_mag(p.size()),
      z(p.size(), 1.0);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.NH; ++h) {
      length = lengths.empty() ? T : lengths[static_cast<std::size_t>(b)];
      if (drop != nullptr)
        for (std::int64_t e = 0; e < T * T; ++e)
          z[e] = drop->mask.keep(drop->head_origin(b, h, T) + static_cast<std::uint64_t>(e)) ? drop->mask.scale() : 0.0;
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t row = (b * c.NH + h) * T + t;
        if (keys(t) == 0) {  // a padded query: out and lse 0 (as written above)
          r.lse.magnitude[row] = 1;
          continue;
        }
        double max = -std::numeric_limits<double>::infinity();
        for (std::int64_t s = 0; s < keys(t); ++s) {
          double x = 0;
          for (std::int64_t i = 0; i < hs; ++i) x += qkv[q(b, t, 0, h, i)] * qkv[q(b, s, 1, h, i)];
          p[t * T + s] = x * scale;
          max = std::max(max, x * scale);
        }
        double sum = 0;
        for (std::int64_t s = 0; s < keys(t); ++s) sum += std::exp(p[t * T + s] - max);
        r.lse.value[row] = max + std::log(sum);
        r.lse.magnitude[row] = 1 + std::abs(r.lse.value[row]);
        for (std::int64_t s = 0; s < keys(t); ++s) p[t * T + s] = std::exp(p[t * T + s] - max) / sum;
        for (std::int64_t i = 0; i < hs; ++i) {
          double value = 0, magnitude = 0;
          for (std::int64_t s = 0; s < keys(t); ++s) {
            value += p[t * T + s] * z[t * T + s] * qkv[q(b, s, 2, h, i)];
            magnitude += p[t * T + s] * z[t * T + s] * std::abs(qkv[q(b, s, 2, h, i)]);
          }
          r.out.value[o(b, t, h, i)] = value;
          r.out.magnitude[o(b, t, h, i)] = magnitude;
        }
      }
      // The backward: dP = dout v^T, D = sum_s P dP, dS = P (dP - D) scale.
      for (std::int64_t t = 0; t < T; ++t) {
        double d = 0, d_mag = 0;
        for (std::int64_t s = 0; s < keys(t); ++s) {
          double x = 0;
          for (std::int64_t i = 0; i < hs; ++i) x += dout[o(b, t, h, i)] * qkv[q(b, s, 2, h, i)];
          x *= z[t * T + s];
          dp[t * T + s] = x;
          d += p[t * T + s] * x;
          d_mag += p[t * T + s] * std::abs(x);
        }
        for (std::int64_t i = 0; i < hs; ++i) d_mag += std::abs(dout[o(b, t, h, i)] * r.out.value[o(b, t, h, i)]);
        for (std::int64_t s = 0; s < keys(t); ++s) {
          ds[t * T + s] = p[t * T + s] * (dp[t * T + s] - d) * scale;
          ds_mag[t * T + s] = p[t * T + s] * (std::abs(dp[t * T + s]) + d_mag) * scale;
        }
      }
      for (std::int64_t i = 0; i < hs; ++i)
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t s = 0; s < keys(t); ++s) {
            const double pts = p[t * T + s], dropped = pts * z[t * T + s];
            r.dqkv.value[q(b, s, 2, h, i)] += dropped * dout[o(b, t, h, i)];  // dv
            r.dqkv.magnitude[q(b, s, 2, h, i)] += dropped * std::abs(dout[o(b, t, h, i)]);
            r.dqkv.value[q(b, t, 0, h, i)] += ds[t * T + s] * qkv[q(b, s, 1, h, i)];  // dq
            r.dqkv.magnitude[q(b, t, 0, h, i)] += ds_mag[t * T + s] * std::abs(qkv[q(b, s, 1, h, i)]);
            r.dqkv.value[q(b, s, 1, h, i)] += ds[t * T + s] * qkv[q(b, t, 0, h, i)];  // dk
            r.dqkv.magnitude[q(b, s, 1, h, i)] += ds_mag[t * T + s] * std::abs(qkv[q(b, t, 0, h, i)]);
          }
    }
  return r;
}

//! |got - want| <= tolerance * magnitude + rounding |want| for every element.
void check_expected(const std::vector<float>& got, const Expected& e, double tolerance, double rounding,
                    const std::string& what) {
  std::vector<double> scale(e.value.size());
  for (std::size_t i = 0; i < scale.size(); ++i)
    scale[i] = e.magnitude[i] + rounding / tolerance * std::abs(e.value[i]);
  check_close(got, e.value, scale, tolerance, what, 0.0);
}

constexpr double bf16_tolerance = 1.5e-2;
const double bf16_rounding = std::ldexp(1.0, -8);
constexpr double lse_tolerance = 1e-4;
// The cuBLAS path rounds the scores to bf16 before its softmax, so its lse carries that rounding
// (seen on an H100: worst 1.5e-3 of |lse|).
const double cublas_lse_tolerance = 2 * bf16_rounding;

//! Checks out, lse and dqkv against the reference.
void check_all(const Reference& r, const std::vector<bf16>& out, const std::vector<float>& lse,
               const std::vector<bf16>& dqkv, double lse_error = lse_tolerance) {
  check_expected(floats_of(out), r.out, bf16_tolerance, bf16_rounding, "out");
  check_expected(lse, r.lse, lse_error, 0.0, "lse");
  check_expected(floats_of(dqkv), r.dqkv, bf16_tolerance, bf16_rounding, "dqkv");
}

//! What one forward and backward gave, on the host emulation or on the GPU.
struct Result {
  std::vector<bf16> out, dqkv;
  std::vector<float> lse;
};

//! The forward, then the backward from its own out and lse (the training path), on the host,
//! with each warp owning M blocks of 16 rows (the kernels' template argument; 1 by default) and
//! the tiles in the layout of `Tiles` (mma.sync's padded rows by default; GroupTiles, wgmma's, at
//! head size 64 only); with `drop`, the bodies built to draw its mask. With `write` = overwrite
//! dqkv starts as NaN and the backward writes it (after zero_padding_block where padded), as
//! flash_backward runs them. The tiled kernels' copies land at `copies` (host_block.hpp).
template <int M = 1, class Tiles = fl::PaddedTiles>
Result run_on_host(const Case& c, const Data& data, AttentionMask mask = AttentionMask::causal,
                   const Lengths& lengths = {}, const AttentionDropout* drop = nullptr,
                   GradientWrite write = GradientWrite::accumulate, CopyTiming copies = CopyTiming::at_issue) {
  const fl::Shape shape{c.T,  c.C(), static_cast<int>(c.NH), 1.0f / std::sqrt(static_cast<float>(c.hs)),
                        mask, lengths.empty() ? nullptr : lengths.data()};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const bool accumulate = write == GradientWrite::accumulate;
  Result r{std::vector<bf16>(static_cast<std::size_t>(c.B * c.T * c.C()), bf16(nan)),
           accumulate ? data.dqkv0 : std::vector<bf16>(data.dqkv0.size(), bf16(nan)),
           std::vector<float>(static_cast<std::size_t>(c.B * c.NH * c.T), nan)};
  std::vector<float> delta(r.lse.size(), nan);
  const std::int64_t grid_x = c.B * c.NH, grid_y = fl::row_tiles(c.T, M), rows = c.B * c.NH * c.T;
  detail::cuda_attention::with_head_size(c.dims(), [&]<int HS>() {
    if constexpr (std::is_same_v<Tiles, fl::GroupTiles> && HS != fl::group_head_size) {
      FAIL("GroupTiles is built for head size " << fl::group_head_size << " only, not " << HS);
    } else {
      const fl::ForwardArgs fa{shape, data.qkv.data(), r.out.data(), r.lse.data()};
      run_grid(grid_x, grid_y, fl::ForwardSmem<HS, Tiles>::total, [&](HostThread& th) {
        if (drop != nullptr)
          fl::forward_block<HS, M, true, Tiles>(th, fa, *drop);
        else
          fl::forward_block<HS, M, false, Tiles>(th, fa);
      }, fl::threads, copies);
      run_grid(fl::delta_blocks<HS>(rows), 1, 0, [&](HostThread& th) {
        fl::delta_block<HS>(th, r.out.data(), data.dout.data(), delta.data(), shape, rows);
      });
      const fl::BackwardArgs ba{shape,        data.qkv.data(), data.dout.data(), r.lse.data(),
                                delta.data(), r.dqkv.data(), accumulate};
      if (!accumulate && !lengths.empty())
        run_grid(c.B * c.T, 1, 0, [&](HostThread& th) { fl::zero_padding_block(th, ba); });
      run_grid(grid_x, grid_y, fl::KeyValueGradSmem<HS, Tiles>::total, [&](HostThread& th) {
        if (drop != nullptr)
          fl::key_value_grad_block<HS, M, true, Tiles>(th, ba, *drop);
        else
          fl::key_value_grad_block<HS, M, false, Tiles>(th, ba);
      }, fl::threads, copies);
      run_grid(grid_x, grid_y, fl::QueryGradSmem<HS, Tiles>::total, [&](HostThread& th) {
        if (drop != nullptr)
          fl::query_grad_block<HS, M, true, Tiles>(th, ba, *drop);
        else
          fl::query_grad_block<HS, M, false, Tiles>(th, ba);
      }, fl::threads, copies);
    }
  });
  return r;
}

TEST_CASE("flash attention's shared memory fits a block without opting in above 48 KiB where HS <= 64") {
  constexpr std::size_t default_limit = 48 * 1024, h100 = 227 * 1024;  // sm_90's largest, opted in
  CHECK(fl::ForwardSmem<64>::total == 4 * 64 * 72 * 2);  // two buffers of k and v
  CHECK(fl::KeyValueGradSmem<64>::total <= default_limit);
  CHECK(fl::QueryGradSmem<64>::total <= default_limit);
  CHECK(fl::KeyValueGradSmem<128>::total <= h100);
  // cp.async writes 16 bytes and ldmatrix reads rows of 16: every region and row 16-byte aligned.
  for (const std::size_t offset : {fl::ForwardSmem<32>::v, fl::KeyValueGradSmem<32>::dout,
                                   fl::KeyValueGradSmem<32>::lse, fl::KeyValueGradSmem<32>::delta,
                                   fl::QueryGradSmem<32>::v, fl::tile_bytes<32>})
    CHECK(offset % 16 == 0);
  for (const int ld : {fl::row_ld<32>, fl::row_ld<64>, fl::row_ld<128>}) CHECK(ld * sizeof(bf16) % 16 == 0);
  CHECK(fl::supported_head_size(64));
  CHECK_FALSE(fl::supported_head_size(48));
}

//! Whether the 32 banks (of 4-byte words, bank = word % 32) a warp's shared load reads differ.
bool all_different(std::vector<int> banks) {
  for (int& b : banks) b %= 32;
  std::sort(banks.begin(), banks.end());
  return std::adjacent_find(banks.begin(), banks.end()) == banks.end();
}

TEST_CASE("a B fragment load from a padded shared tile reads 32 different banks") {
  // Lane 4 group + pair reads the word at (n0 + group) ld + k0 + 2 pair (bf16 units).
  for (const int ld : {fl::row_ld<32>, fl::row_ld<64>, fl::row_ld<128>})
    for (const int k0 : {0, 16, 8}) {
      CAPTURE(ld);
      CAPTURE(k0);
      std::vector<int> words;
      for (int lane = 0; lane < 32; ++lane) words.push_back(((lane / 4) * ld + k0 + 2 * (lane % 4)) / 2);
      CHECK(all_different(words));
    }
}

TEST_CASE("an ldmatrix from a padded shared tile reads each 8 x 8 matrix from 32 different banks") {
  // Matrix j's 8 rows of 16 bytes (4 words each), rows r of the tile at column n0.
  for (const int ld : {fl::row_ld<32>, fl::row_ld<64>, fl::row_ld<128>})
    for (const int n0 : {0, 8, 16}) {
      CAPTURE(ld);
      CAPTURE(n0);
      std::vector<int> words;
      for (int r = 0; r < 8; ++r)
        for (int w = 0; w < 4; ++w) words.push_back((r * ld + n0) / 2 + w);
      CHECK(all_different(words));
    }
}

//! The B fragment of the 16 x 8 block at rows k0.. and columns n0.. of B, where
//! B(k, n) = t[n ld + k], by the m16n8k16 layout (the kernels take theirs by ldmatrix).
LOOM_HD inline void load_b(fl::FragmentB& b, const bf16* t, int ld, int n0, int k0, fl::Lane ln) {
  const bf16* p = t + (n0 + ln.group) * ld + k0 + 2 * ln.pair;
  b[0] = fl::load_pair(p);
  b[1] = fl::load_pair(p + 8);
}

//! Two products through the kernels' fragment helpers, as one warp: d [16, 8] = a b with a [16, 16]
//! row-major in global memory (load_a, rows >= 12 read as zeros) and b (k, n) = bt[n 16 + k] in
//! shared memory (load_b); then e [16, 8] = c b where c [16, 16] = [bf16(d), bf16(d)] is d's C
//! fragment taken as both halves of an A fragment (to_a). d and e are written by the C layout.
#pragma nv_exec_check_disable
template <class Thread>
LOOM_HD void fragment_body(Thread& th, const bf16* a, const bf16* bt_global, float* d, float* e) {
  const int lane = th.thread() % 32;
  const fl::Lane ln{lane / 4, lane % 4};
  bf16* bt = reinterpret_cast<bf16*>(th.shared());
  for (int i = lane; i < 8 * 16; i += 32) bt[i] = bt_global[i];
  th.sync_block();
  fl::FragmentA fa;
  fl::FragmentB fb;
  fl::load_a(fa, a, 16, 0, 12, 0, ln);
  load_b(fb, bt, 16, 0, 0, ln);
  const auto store = [&](float* out, const fl::FragmentC& c) {  // [16, 8] row-major, by the C layout
    for (int i = 0; i < 4; ++i) out[(ln.group + 8 * (i / 2)) * 8 + 2 * ln.pair + i % 2] = c[i];
  };
  fl::FragmentC acc{};
  th.mma(acc, fa, fb);
  store(d, acc);
  fl::FragmentA fc;
  fl::to_a(fc, acc, acc);
  fl::FragmentC acc2{};
  th.mma(acc2, fc, fb);
  store(e, acc2);
}

struct FragmentCase {
  std::vector<bf16> a, bt;
};

//! Checks d = a b (in double) and e = c b with c built from the d that came back, so that e tests
//! to_a and the second product alone. A wrong lane or register mapping is off by O(1).
void check_fragments(const FragmentCase& f, const std::vector<float>& d, const std::vector<float>& e) {
  const auto b = [&](int k, int n) { return static_cast<double>(static_cast<float>(f.bt[n * 16 + k])); };
  std::vector<double> want_d, want_e;
  for (int r = 0; r < 16; ++r)
    for (int n = 0; n < 8; ++n) {
      double sum = 0, sum_e = 0;
      for (int k = 0; k < 16 && r < 12; ++k) sum += static_cast<float>(f.a[r * 16 + k]) * b(k, n);
      for (int k = 0; k < 16; ++k) sum_e += static_cast<float>(bf16(d[r * 8 + k % 8])) * b(k, n);
      want_d.push_back(sum);
      want_e.push_back(sum_e);
    }
  check_close(d, want_d, 1e-4, "d = a b");
  check_close(e, want_e, 1e-4, "e = [bf16(d), bf16(d)] b");
}

TEST_CASE("the mma fragment helpers give a plain product (host emulation)") {
  const FragmentCase f{random_bf16(16 * 16, 51), random_bf16(8 * 16, 52)};
  std::vector<float> d(16 * 8, std::numeric_limits<float>::quiet_NaN()), e = d;
  HostBlock block(0, 0, 8 * 16 * sizeof(bf16), 32);
  run_block(block, [&](HostThread& th) { fragment_body(th, f.a.data(), f.bt.data(), d.data(), e.data()); });
  check_fragments(f, d, e);
}

TEST_CASE("the delta body sums each row a pack a lane where aligned, element by element elsewhere (host emulation)") {
  // T = 37: the last block is partial for every head size (4, 8 or 16 lanes a row).
  constexpr std::int64_t B = 2, T = 37, NH = 3;
  for (const int hs : {32, 64, 128}) {
    CAPTURE(hs);
    const std::int64_t C = NH * hs, n = B * T * C, rows = B * NH * T;
    // One spare pack: `at` is the first 16-byte-aligned element; at + 1 is not aligned.
    const std::vector<bf16> out = random_bf16(n + fl::pack, 61), dout = random_bf16(n + fl::pack, 62);
    const auto first_aligned = [](const std::vector<bf16>& v) {
      std::size_t at = 0;
      while (reinterpret_cast<std::uintptr_t>(v.data() + at) % 16 != 0) ++at;
      return at;
    };
    for (const std::size_t shift : {std::size_t{0}, std::size_t{1}}) {
      CAPTURE(shift);
      const bf16* o = out.data() + first_aligned(out) + shift;
      const bf16* g = dout.data() + first_aligned(dout) + shift;
      std::vector<double> want(static_cast<std::size_t>(rows)), magnitude(want.size());
      for (std::int64_t row = 0; row < rows; ++row) {
        const std::int64_t b = row / (NH * T), h = row / T % NH, t = row % T, at = (b * T + t) * C + h * hs;
        for (std::int64_t c = 0; c < hs; ++c) {
          const double term = static_cast<double>(static_cast<float>(o[at + c])) * static_cast<float>(g[at + c]);
          want[static_cast<std::size_t>(row)] += term;
          magnitude[static_cast<std::size_t>(row)] += std::abs(term);
        }
      }
      std::vector<float> delta(want.size(), std::numeric_limits<float>::quiet_NaN());
      const fl::Shape shape{T, C, static_cast<int>(NH), 1.0f, AttentionMask::causal, nullptr};
      const auto run = [&]<int HS>() {
        run_grid(fl::delta_blocks<HS>(rows), 1, 0,
                 [&](HostThread& th) { fl::delta_block<HS>(th, o, g, delta.data(), shape, rows); });
      };
      if (hs == 32) run.template operator()<32>();
      if (hs == 64) run.template operator()<64>();
      if (hs == 128) run.template operator()<128>();
      check_close(delta, want, magnitude, float_tolerance, "delta", 0.0);
    }
  }
}

TEST_CASE("the tiled kernels' bodies match the reference (host emulation of the blocks and of mma.sync)") {
  std::uint32_t seed = 100;
  for (const Case& c : host_cases()) {
    CAPTURE(c);
    const Data data = make_data(c, seed += 10);
    const Result got = run_on_host(c, data);
    check_all(reference(c, data), got.out, got.lse, got.dqkv);
  }
}

TEST_CASE("the tiled kernels' bodies match the reference with the bidirectional mask (host emulation)") {
  std::uint32_t seed = 200;
  for (const Case& c : bidirectional_host_cases()) {
    CAPTURE(c);
    const Data data = make_data(c, seed += 10);
    const Result got = run_on_host(c, data, AttentionMask::bidirectional);
    const Reference want = reference(c, data, AttentionMask::bidirectional);
    check_all(want, got.out, got.lse, got.dqkv);
    if (c.T > 1) {
      // The causal reference is another result: a kernel that ignored the mask would fail above.
      const Reference causal = reference(c, data);
      double diff = 0;
      for (std::size_t i = 0; i < want.out.value.size(); ++i)
        diff = std::max(diff, std::abs(want.out.value[i] - causal.out.value[i]));
      CHECK(diff > 0.1);
    }
  }
}

//! Padded cases: lengths ending at a tile's end (64), in the first and second half of a tile (70,
//! 100: the key/value kernel's two halves), one real token, and full-length sequences among them.
struct PaddedCase {
  Case shape;
  Lengths lengths;
};
std::vector<PaddedCase> padded_cases() {
  return {{{3, 129, 1, 32}, {1, 100, 129}}, {{2, 129, 2, 64}, {70, 64}}, {{2, 100, 1, 128}, {33, 100}}};
}

TEST_CASE("the tiled kernels' bodies match the reference on padded sequences, both masks (host emulation)") {
  std::uint32_t seed = 400;
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : padded_cases()) {
      INFO(loom::name(mask));
      CAPTURE(pc.shape);
      const Data data = make_data(pc.shape, seed += 10);
      const Result got = run_on_host(pc.shape, data, mask, pc.lengths);
      check_all(reference(pc.shape, data, mask, pc.lengths), got.out, got.lse, got.dqkv);
      // Exactly: a padded query's out and lse are 0, and padded tokens' dq, dk, dv are untouched.
      const Case& c = pc.shape;
      std::int64_t wrong = 0;
      for (std::int64_t b = 0; b < c.B; ++b)
        for (std::int64_t t = pc.lengths[static_cast<std::size_t>(b)]; t < c.T; ++t) {
          for (std::int64_t j = 0; j < c.C(); ++j) wrong += static_cast<float>(got.out[(b * c.T + t) * c.C() + j]) != 0;
          for (std::int64_t h = 0; h < c.NH; ++h) wrong += got.lse[(b * c.NH + h) * c.T + t] != 0;
          for (std::int64_t j = 0; j < 3 * c.C(); ++j) {
            const std::size_t at = static_cast<std::size_t>((b * c.T + t) * 3 * c.C() + j);
            wrong += got.dqkv[at].bits != data.dqkv0[at].bits;
          }
        }
      CHECK(wrong == 0);
    }
  }
}

//! Whether two results hold the same values (a zero's sign aside; a NaN matches nothing).
bool same_values(const std::vector<bf16>& a, const std::vector<bf16>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(static_cast<float>(a[i]) == static_cast<float>(b[i]))) return false;
  return true;
}

//! The overwriting backward's cases: the padded ones, and one unpadded of head size 64 (the
//! warpgroup bodies' too) over three tiles.
std::vector<PaddedCase> overwrite_cases() {
  std::vector<PaddedCase> cases = padded_cases();
  cases.push_back({{2, 129, 2, 64}, {}});
  return cases;
}

//! `data` with dqkv0 = 0: what an overwriting backward must match by accumulating.
Data with_zero_gradient(Data data) {
  std::fill(data.dqkv0.begin(), data.dqkv0.end(), bf16(0.0f));
  return data;
}

TEST_CASE("an overwriting backward writes all of dqkv, padding 0: accumulating into zeros' bits (host emulation)") {
  std::uint32_t seed = 450;
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : overwrite_cases()) {
      INFO(loom::name(mask));
      CAPTURE(pc.shape);
      const Data data = with_zero_gradient(make_data(pc.shape, seed += 10));
      const Result accumulated = run_on_host(pc.shape, data, mask, pc.lengths);
      const Result written = run_on_host(pc.shape, data, mask, pc.lengths, nullptr, GradientWrite::overwrite);
      CHECK(same_values(written.dqkv, accumulated.dqkv));
      if (pc.shape.hs == fl::group_head_size) {  // the warpgroup bodies too
        const Result group =
            run_on_host<1, fl::GroupTiles>(pc.shape, data, mask, pc.lengths, nullptr, GradientWrite::overwrite);
        CHECK(same_values(group.dqkv, accumulated.dqkv));
      }
    }
  }
}

TEST_CASE("the tiles a block walks: causal blocks the longest first, bidirectional blocks all tiles") {
  const fl::Shape causal{129, 64, 1, 0.125f, AttentionMask::causal};  // 3 tiles, the last partial
  const fl::Shape bidirectional{129, 64, 1, 0.125f, AttentionMask::bidirectional};
  for (std::int64_t y = 0; y < 3; ++y) {
    CAPTURE(y);
    CHECK(fl::query_tile(causal, y) == 2 - y);  // block 0 walks the most key tiles
    CHECK(fl::key_tiles(causal, fl::query_tile(causal, y), 129) == 3 - y);
    CHECK(fl::first_query_tile(causal, y) == y);
    CHECK(fl::query_tile(bidirectional, y) == y);
    CHECK(fl::key_tiles(bidirectional, fl::query_tile(bidirectional, y), 129) == 3);
    CHECK(fl::first_query_tile(bidirectional, y) == 0);
  }
  CHECK(fl::last_key(causal, 5, 129) == 5);
  CHECK(fl::last_key(bidirectional, 5, 129) == 128);
  CHECK(fl::last_key(bidirectional, 150, 129) == 128);  // a padding row of the last tile
  // A sequence of 70 real tokens: bidirectional queries walk the two tiles that hold real keys,
  // and no query sees a key past 69; a padded query sees keys as if it were real (finite).
  CHECK(fl::key_tiles(bidirectional, 0, 70) == 2);
  CHECK(fl::key_tiles(causal, 1, 70) == 2);
  CHECK(fl::last_key(bidirectional, 5, 70) == 69);
  CHECK(fl::last_key(causal, 5, 70) == 5);
  CHECK(fl::last_key(causal, 100, 70) == 69);
  const std::int32_t lengths[] = {70, 129};
  const fl::Shape padded{129, 64, 1, 0.125f, AttentionMask::causal, lengths};
  CHECK(padded.length(0) == 70);
  CHECK(padded.length(1) == 129);
  CHECK(causal.length(0) == 129);
  CHECK(fl::Shape{1, 32, 1, 1.0f}.causal());       // the default mask
  // A token's column in a tile, clamped: the masks' 32-bit form of the comparisons above.
  CHECK(fl::tile_column(130, 128, -1, 63) == 2);
  CHECK(fl::tile_column(5, 128, -1, 63) == -1);       // before the tile: no column counts
  CHECK(fl::tile_column(1000, 128, -1, 63) == 63);    // after it: every column counts
  CHECK(fl::tile_column(129, 128, 0, 64) == 1);       // T = 129: one real row in the third tile
  CHECK(fl::tile_column(1LL << 40, 0, 0, 64) == 64);  // no overflow where tokens exceed int
}

TEST_CASE("the tiled kernels' bodies give the same bits for the same input (host emulation)") {
  const Case c{1, 129, 2, 64};
  const Data data = make_data(c, 7);
  for (const AttentionMask mask : both_masks) {
    INFO(loom::name(mask));
    const Result a = run_on_host(c, data, mask), b = run_on_host(c, data, mask);
    CHECK(std::equal(a.out.begin(), a.out.end(), b.out.begin()));
    CHECK(std::equal(a.dqkv.begin(), a.dqkv.end(), b.dqkv.begin()));
    CHECK(std::equal(a.lse.begin(), a.lse.end(), b.lse.begin(), [](float x, float y) {
      return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y);
    }));
  }
}

//! Whether two results hold the same values (out and dqkv compared as floats, so that -0 == +0;
//! lse bit for bit).
bool same_values(const Result& a, const Result& b) {
  const auto same = [](bf16 x, bf16 y) { return static_cast<float>(x) == static_cast<float>(y); };
  return std::equal(a.out.begin(), a.out.end(), b.out.begin(), b.out.end(), same) &&
         std::equal(a.dqkv.begin(), a.dqkv.end(), b.dqkv.begin(), b.dqkv.end(), same) &&
         std::equal(a.lse.begin(), a.lse.end(), b.lse.begin(), b.lse.end(), [](float x, float y) {
           return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y);
         });
}

//! Warps of M row blocks, as a value `run` reads back from its type (a template argument of a
//! lambda it cannot deduce would not convert to a function pointer, and nvcc warns).
template <int M>
using RowBlocksTag = std::integral_constant<int, M>;

//! For each case and mask: `run(RowBlocksTag<M>{}, case, data, mask)` at M = 2 against the
//! reference (with `drop`'s dropout where given), and against M = 1's values, which must be the
//! same (each row and key meets the same tiles in the same order).
template <class Run>
void check_two_row_blocks(const std::vector<PaddedCase>& cases, std::uint32_t seed, Run&& run,
                          const AttentionDropout* drop = nullptr) {
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : cases) {
      INFO(loom::name(mask));
      CAPTURE(pc.shape);
      const Data data = make_data(pc.shape, seed += 10);
      const Result two = run(RowBlocksTag<2>{}, pc, data, mask);
      check_all(reference(pc.shape, data, mask, pc.lengths, drop), two.out, two.lse, two.dqkv);
      CHECK(same_values(two, run(RowBlocksTag<1>{}, pc, data, mask)));
    }
  }
}

TEST_CASE("warps of two row blocks (M = 2) match the reference and M = 1's values, both masks (host emulation)") {
  // Blocks of 128 rows: one partial (T = 100: two key tiles, warps 2 and 3 partly past T), whole
  // (T = 64: warps 2 and 3 wholly past T; 128), two with the second holding one row (129), and
  // padded sequences ending in either half of a block (70, 100) or at its first row (1).
  const std::vector<PaddedCase> cases = {{{1, 100, 1, 64}, {}},           {{1, 64, 1, 64}, {}},
                                         {{1, 128, 2, 32}, {}},           {{1, 129, 1, 128}, {}},
                                         {{3, 200, 1, 32}, {70, 1, 200}}, {{2, 129, 1, 64}, {100, 129}}};
  check_two_row_blocks(cases, 500, [](auto m, const PaddedCase& pc, const Data& data, AttentionMask mask) {
    return run_on_host<decltype(m)::value>(pc.shape, data, mask, pc.lengths);
  });
}

TEST_CASE("the tiles a block of 128 rows walks (M = 2)") {
  const fl::Shape causal{300, 64, 1, 0.125f, AttentionMask::causal};  // 3 blocks of 128, 5 tiles of 64
  const fl::Shape bidirectional{300, 64, 1, 0.125f, AttentionMask::bidirectional};
  CHECK(fl::row_tiles(300, 2) == 3);
  CHECK(fl::row_tiles(256, 2) == 2);
  CHECK(fl::row_tiles(300, 1) == fl::tiles(300));
  for (std::int64_t y = 0; y < 3; ++y) {
    CAPTURE(y);
    CHECK(fl::query_tile(causal, y, 2) == 2 - y);
    CHECK(fl::query_tile(bidirectional, y, 2) == y);
    CHECK(fl::first_query_tile(causal, y, 2) == 2 * y);
    CHECK(fl::first_query_tile(bidirectional, y, 2) == 0);
    CHECK(fl::key_tiles(bidirectional, y, 300, 2) == 5);
  }
  CHECK(fl::key_tiles(causal, 0, 300, 2) == 2);
  CHECK(fl::key_tiles(causal, 1, 300, 2) == 4);
  CHECK(fl::key_tiles(causal, 2, 300, 2) == 5);  // rows 256..299: keys up to 299, tile 4
  CHECK(fl::key_tiles(causal, 0, 70, 2) == 2);
  CHECK(fl::key_tiles(causal, 0, 50, 2) == 1);   // no tile of padded keys only
}

// ---------------------------------------------------------------------------------------------
// Attention dropout in the tiled kernels.

//! A tensor-parallel rank's view of a micro-batch: sequences from 3 on, heads 1.. of 4, at rate
//! 0.3 (a strong signal: a kernel that ignored the mask, or drew another element's, is off by O(1)).
AttentionDropout test_dropout(std::uint64_t seed = 17) {
  return {DropoutMask(DropoutKey{seed, 5, 3}, 2, 1, 0.3), 3, 4, 1};
}

//! Runs the keep-bit helpers as one warp on the host and compares every lane's bits with the
//! mask's own: by rows (M = 2 blocks of 16 queries from `first_row`, 8 N = 64 keys from
//! `first_column`) and by columns (2 blocks of 16 keys from `first_row`, 32 queries from
//! `first_column`). Returns the elements compared.
std::int64_t check_keep_bits(const AttentionDropout& drop, std::int64_t tokens, std::int64_t first_row,
                             std::int64_t first_column) {
  constexpr int M = 2, rows_n = 8, columns_n = 4;
  const std::uint64_t origin = drop.head_origin(1, 1, tokens);
  std::uint32_t by_rows[32][M][2] = {}, by_columns[32][M][2] = {};
  HostBlock block(0, 0, 0, 32);
  run_block(block, [&](HostThread& th) {
    const int t = th.thread();
    const fl::Lane ln{t / 4, t % 4};
    fl::keep_bits_by_rows<M, rows_n>(th, by_rows[t], drop.mask, origin, tokens, first_row, first_column, ln);
    fl::keep_bits_by_columns<M, columns_n>(th, by_columns[t], drop.mask, origin, tokens, first_row, first_column, ln);
  });
  std::int64_t compared = 0, wrong = 0;
  for (int lane = 0; lane < 32; ++lane)
    for (int r = 0; r < M; ++r)
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < rows_n; ++j)
          for (int c = 0; c < 2; ++c) {
            const std::int64_t row = first_row + 16 * r + lane / 4 + 8 * i;
            const std::int64_t col = first_column + 8 * j + 2 * (lane % 4) + c;
            const auto bit = [&](const std::uint32_t (&keep)[M][2]) { return (keep[r][i] >> (2 * j + c) & 1u) != 0; };
            // By rows: (query row, key col); by columns: (key row, query col).
            wrong += bit(by_rows[lane]) != drop.mask.keep(origin + static_cast<std::uint64_t>(row * tokens + col));
            ++compared;
            if (j < columns_n) {
              wrong += bit(by_columns[lane]) != drop.mask.keep(origin + static_cast<std::uint64_t>(col * tokens + row));
              ++compared;
            }
          }
  CHECK(wrong == 0);
  return compared;
}

TEST_CASE("the keep bits a lane draws are the dropout mask's, in both fragment layouts and for any T") {
  const AttentionDropout drop = test_dropout();
  // T % 4 == 0 takes the shared draws (a block per lane, passed by shuffles); 70 (T % 4 == 2) and
  // the odd ones draw per element. Rows and columns start where the kernels' do (multiples of 16).
  for (const std::int64_t tokens : {64, 100, 1024, 70, 33, 129})
    for (const auto& [first_row, first_column] : {std::pair<std::int64_t, std::int64_t>{0, 0}, {16, 64}, {48, 32}}) {
      CAPTURE(tokens);
      CAPTURE(first_row);
      CAPTURE(first_column);
      CHECK(check_keep_bits(drop, tokens, first_row, first_column) == 32 * 2 * 2 * (16 + 8));
    }
  // Both kept and dropped elements among them (a constant mask would pass a wrong layout too).
  std::int64_t kept = 0;
  for (std::uint64_t e = 0; e < 4096; ++e) kept += drop.mask.keep(drop.head_origin(1, 1, 64) + e);
  CHECK(kept > 2500);
  CHECK(kept < 3200);
}

//! Cases of the tiled kernels with dropout: T % 4 == 0 (64, 100, 128: the shared draws) and not
//! (70, 33: per element), every head size, several batch elements and heads, and a padded batch.
std::vector<PaddedCase> dropout_cases() {
  return {{{2, 64, 2, 32}, {}},   {{1, 100, 1, 64}, {}}, {{1, 70, 2, 64}, {}},
          {{1, 33, 1, 128}, {}}, {{2, 128, 1, 32}, {70, 128}}};
}

TEST_CASE("the tiled kernels' bodies with attention dropout match the reference, both masks (host emulation)") {
  std::uint32_t seed = 700;
  const AttentionDropout drop = test_dropout();
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : dropout_cases()) {
      INFO(loom::name(mask));
      CAPTURE(pc.shape);
      const Data data = make_data(pc.shape, seed += 10);
      const Reference want = reference(pc.shape, data, mask, pc.lengths, &drop);
      const Result got = run_on_host(pc.shape, data, mask, pc.lengths, &drop);
      check_all(want, got.out, got.lse, got.dqkv);
      // The reference without dropout is another result: a kernel that ignored the mask would
      // fail above. (lse is the softmax's either way.)
      const Reference undropped = reference(pc.shape, data, mask, pc.lengths);
      double diff = 0;
      for (std::size_t i = 0; i < want.dqkv.value.size(); ++i)
        diff = std::max(diff, std::abs(want.dqkv.value[i] - undropped.dqkv.value[i]));
      CHECK(diff > 0.1);
      CHECK(want.lse.value == undropped.lse.value);
    }
  }
}

TEST_CASE("with attention dropout, warps of two row blocks (M = 2) give M = 1's values (host emulation)") {
  const AttentionDropout drop = test_dropout(23);
  const std::vector<PaddedCase> cases = {{{1, 128, 2, 32}, {}}, {{2, 100, 1, 64}, {100, 33}}};
  check_two_row_blocks(
      cases, 800,
      [&drop](auto m, const PaddedCase& pc, const Data& data, AttentionMask mask) {
        return run_on_host<decltype(m)::value>(pc.shape, data, mask, pc.lengths, &drop);
      },
      &drop);
}

// ---------------------------------------------------------------------------------------------
// The warpgroup's products (GroupTiles: wgmma, sm_90a).

//! Products through GroupTiles' helpers, as one warpgroup: a [64, 64] row-major in global memory,
//! b [64, 64] copied into a shared tile by GroupTiles::at; s = a b^T (b a K-major B, 64 columns),
//! o = bf16(s) b (b an MN-major B over its 64 rows); and, as the key/value kernel takes its halves
//! of 32 rows, h = a b[32..63]^T (32 columns; the descriptor 32 rows into the tile) and
//! o2 = bf16(h) b[32..63]. Each result [64, n] is written by the accumulator layout.
#pragma nv_exec_check_disable
template <class Thread>
LOOM_HD void group_fragment_body(Thread& th, const bf16* a, const bf16* b_global, float* s_out, float* o_out,
                                 float* h_out, float* o2_out) {
  using Tiles = fl::GroupTiles;
  const int lane = th.thread() % 32, warp = th.thread() / 32;
  const fl::Lane ln{lane / 4, lane % 4};
  bf16* b = reinterpret_cast<bf16*>(Tiles::base(th));
  for (int e = th.thread(); e < 64 * 64; e += fl::threads) b[Tiles::at<64>(e / 64, e % 64)] = b_global[e];
  Tiles::copies_landed(th);
  th.sync_block();
  fl::FragmentA fa[1][4];
  fl::load_rows_a<64>(fa, a, 64, 16 * warp, 64, ln);
  const auto store = [&]<int N>(float* out, const fl::FragmentC (&c)[1][N]) {
    for (int j = 0; j < N; ++j)
      for (int i = 0; i < 4; ++i)
        out[(16 * warp + ln.group + 8 * (i / 2)) * 8 * N + 8 * j + 2 * ln.pair + i % 2] = c[0][j][i];
  };
  fl::FragmentC s[1][8], o[1][8], h[1][4], o2[1][8];
  fl::zero(s);
  fl::zero(o);
  fl::zero(h);
  fl::zero(o2);
  Tiles::product_abt<64>(th, s, fa, b, ln);
  store(s_out, s);
  Tiles::accumulate_ab<64>(th, o, s, b, ln);
  store(o_out, o);
  Tiles::product_abt<64>(th, h, fa, b + 32 * 64, ln);
  store(h_out, h);
  Tiles::accumulate_ab<64>(th, o2, h, b + 32 * 64, ln);
  store(o2_out, o2);
}

//! What group_fragment_body takes and gives.
struct GroupFragments {
  std::vector<bf16> a = random_bf16(64 * 64, 71), b = random_bf16(64 * 64, 72);
  std::vector<float> s = nans(64 * 64), o = nans(64 * 64), h = nans(64 * 32), o2 = nans(64 * 64);
  static std::vector<float> nans(std::size_t n) {
    return std::vector<float>(n, std::numeric_limits<float>::quiet_NaN());
  }
};
//! Bytes of shared memory group_fragment_body takes: one tile and the alignment slack.
constexpr std::size_t group_fragment_bytes = fl::tile_bytes<64, fl::GroupTiles> + fl::GroupTiles::slack;

//! Checks the four products against double sums over what went in (o and o2 from the s and h that
//! came back, rounded to bf16 as the kernels round them). A wrong swizzle, descriptor, register or
//! row offset is off by O(1).
void check_group_fragments(const GroupFragments& f) {
  const auto at = [](const std::vector<bf16>& m, int r, int c) {
    return static_cast<double>(static_cast<float>(m[r * 64 + c]));
  };
  std::vector<double> s(64 * 64), o(64 * 64), h(64 * 32), o2(64 * 64);
  for (int r = 0; r < 64; ++r) {
    for (int n = 0; n < 64; ++n)
      for (int k = 0; k < 64; ++k) {
        s[r * 64 + n] += at(f.a, r, k) * at(f.b, n, k);
        o[r * 64 + n] += static_cast<float>(bf16(f.s[r * 64 + k])) * at(f.b, k, n);
        if (k < 32) o2[r * 64 + n] += static_cast<float>(bf16(f.h[r * 32 + k])) * at(f.b, 32 + k, n);
        if (n < 32) h[r * 32 + n] += at(f.a, r, k) * at(f.b, 32 + n, k);
      }
  }
  // Where a product is wrong, where and how (mismatch_report.hpp), and all of them in the dump.
  bool failed = false;
  const auto check = [&](const std::vector<float>& got, const std::vector<double>& want, int cols, const char* what) {
    check_close(got, want, 1e-4, what);
    const std::string report = mismatch_report(got, want, 64, cols, 1e-4);
    if (!report.empty()) MESSAGE(what << ": " << report);
    failed = failed || !report.empty();
  };
  check(f.s, s, 64, "s = a b^T (K-major B)");
  check(f.o, o, 64, "o = bf16(s) b (MN-major B)");
  check(f.h, h, 32, "h = a b[32..]^T (32 columns, descriptor 32 rows in)");
  check(f.o2, o2, 64, "o2 = bf16(h) b[32..] (two k16 steps)");
  if (failed) {
    const char* file = "wgmma_fragments.txt";
    dump_values(file, "a", floats_of(f.a), 64, 64);
    dump_values(file, "b", floats_of(f.b), 64, 64);
    dump_values(file, "s", f.s, 64, 64);
    dump_values(file, "o", f.o, 64, 64);
    dump_values(file, "h", f.h, 64, 32);
    const std::string path = dump_values(file, "o2", f.o2, 64, 64);
    if (!path.empty()) MESSAGE("a, b and the four products (as got) written to " << path);
  }
}

TEST_CASE("the warpgroup product helpers give plain products (host emulation of wgmma)") {
  GroupFragments f;
  HostBlock block(0, 0, group_fragment_bytes);
  run_block(block, [&](HostThread& th) {
    group_fragment_body(th, f.a.data(), f.b.data(), f.s.data(), f.o.data(), f.h.data(), f.o2.data());
  });
  check_group_fragments(f);
}

TEST_CASE("a mismatch report finds the wrong blocks, a permutation's offsets, and NaN (host side)") {
  // want: a [32, 16] result of distinct values; got: it with rows 0-7 and 8-15 swapped and the
  // block at rows 24-31, columns 8-15 never written.
  const int rows = 32, cols = 16;
  std::vector<double> want(rows * cols);
  const std::vector<float> values = random_floats(rows * cols, 81, -4.0f, 4.0f);
  std::copy(values.begin(), values.end(), want.begin());
  CHECK(mismatch_report(values, want, rows, cols, 1e-4).empty());
  std::vector<float> got = values;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < cols; ++c) got[r * cols + c] = values[(r ^ 8) * cols + c];
  for (int r = 24; r < 32; ++r)
    for (int c = 8; c < 16; ++c) got[r * cols + c] = std::numeric_limits<float>::quiet_NaN();
  const std::string report = mismatch_report(got, want, rows, cols, 1e-4);
  INFO(report);
  CHECK(report.find("320 of 512 outside") != std::string::npos);
  CHECK(report.find("  xx\n  xx\n  ..\n  .n\n") != std::string::npos);
  CHECK(report.find("256 of the 320 equal an expected value elsewhere") != std::string::npos);
  CHECK(report.find("(8, 0) x128") != std::string::npos);
  CHECK(report.find("(-8, 0) x128") != std::string::npos);

  // The dump: nothing without LOOM_TEST_DUMP_DIR; with it, every value back bit for bit.
  const char* had = std::getenv("LOOM_TEST_DUMP_DIR");
  const std::string kept = had ? had : "";
  unsetenv("LOOM_TEST_DUMP_DIR");
  CHECK(dump_values("dump_check.txt", "got", got, rows, cols).empty());
  char folder[] = "/tmp/loom_dump_XXXXXX";
  REQUIRE(mkdtemp(folder) != nullptr);
  setenv("LOOM_TEST_DUMP_DIR", folder, 1);
  const std::string path = dump_values("dump_check.txt", "got", got, rows, cols);
  if (kept.empty())
    unsetenv("LOOM_TEST_DUMP_DIR");
  else
    setenv("LOOM_TEST_DUMP_DIR", kept.c_str(), 1);
  REQUIRE(path == std::string(folder) + "/dump_check.txt");
  std::FILE* in = std::fopen(path.c_str(), "r");
  REQUIRE(in != nullptr);
  char name[8] = {};
  int read_rows = 0, read_cols = 0;
  CHECK(std::fscanf(in, "%7s %d %d", name, &read_rows, &read_cols) == 3);
  CHECK((std::string(name) == "got" && read_rows == rows && read_cols == cols));
  std::vector<float> back(got.size());
  for (float& v : back) CHECK(std::fscanf(in, "%a", &v) == 1);
  std::fclose(in);
  std::remove(path.c_str());
  std::remove(folder);
  // A NaN comes back as a NaN (printed "nan", its payload not kept); every other value exactly.
  for (std::size_t i = 0; i < got.size(); ++i)
    CHECK((std::isnan(got[i]) ? std::isnan(back[i])
                              : std::bit_cast<std::uint32_t>(back[i]) == std::bit_cast<std::uint32_t>(got[i])));
}

TEST_CASE("GroupTiles' layout: the 128-byte swizzle, the descriptor, the regions' alignment") {
  // Chunk c of row r at chunk c ^ (r % 8); each chunk of a row exactly once.
  for (int r = 0; r < 16; ++r) {
    std::vector<int> chunks;
    for (int c = 0; c < 64; c += 8) chunks.push_back(fl::GroupTiles::at<64>(r, c) - 64 * r);
    CHECK(chunks[0] == 8 * (r % 8));
    std::sort(chunks.begin(), chunks.end());
    CHECK(chunks == std::vector<int>{0, 8, 16, 24, 32, 40, 48, 56});
  }
  CHECK(fl::GroupTiles::at<64>(9, 13) == 9 * 64 + (1 ^ 1) * 8 + 5);
  // Address 0x12340 (16-byte units: 0x1234), offsets of 1024 bytes (64), 128-byte swizzle.
  const std::uint64_t d = fl::group_descriptor(0x12340);
  CHECK((d & 0x3FFF) == 0x1234);
  CHECK((d >> 16 & 0x3FFF) == 64);
  CHECK((d >> 32 & 0x3FFF) == 64);
  CHECK((d >> 49 & 7) == 0);
  CHECK((d >> 62) == 1);
  // Every tile of every kernel starts on a 1024-byte boundary of the aligned base.
  using Tiles = fl::GroupTiles;
  for (const std::size_t offset : {fl::ForwardSmem<64, Tiles>::k, fl::ForwardSmem<64, Tiles>::v,
                                   fl::KeyValueGradSmem<64, Tiles>::q, fl::KeyValueGradSmem<64, Tiles>::dout,
                                   fl::QueryGradSmem<64, Tiles>::k, fl::QueryGradSmem<64, Tiles>::v,
                                   fl::tile_bytes<64, Tiles>})
    CHECK(offset % Tiles::alignment == 0);
  CHECK(fl::KeyValueGradSmem<64, Tiles>::total <= 48 * 1024);
}

TEST_CASE("the warpgroup (wgmma) bodies match the reference and give the mma.sync bodies' bits, both masks "
          "(host emulation)") {
  // Head size 64. One whole tile, partial tiles (70, 129), several heads, and padded sequences
  // ending in either half of a tile (100, 33). The emulated wgmma sums each element over k in the
  // order the emulated mma.sync does, so the two layouts must agree bit for bit.
  const std::vector<PaddedCase> cases = {
      {{1, 64, 1, 64}, {}}, {{2, 70, 2, 64}, {}}, {{1, 129, 1, 64}, {}}, {{2, 129, 1, 64}, {100, 33}}};
  std::uint32_t seed = 1600;
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : cases) {
      INFO(loom::name(mask));
      CAPTURE(pc.shape);
      const Data data = make_data(pc.shape, seed += 10);
      const Result group = run_on_host<1, fl::GroupTiles>(pc.shape, data, mask, pc.lengths);
      check_all(reference(pc.shape, data, mask, pc.lengths), group.out, group.lse, group.dqkv);
      CHECK(same_values(group, run_on_host(pc.shape, data, mask, pc.lengths)));
    }
  }
}

TEST_CASE("with attention dropout the warpgroup bodies give the mma.sync bodies' bits (host emulation)") {
  const AttentionDropout drop = test_dropout(29);
  for (const PaddedCase& pc : std::vector<PaddedCase>{{{1, 100, 1, 64}, {}}, {{2, 70, 1, 64}, {70, 33}}}) {
    CAPTURE(pc.shape);
    const Data data = make_data(pc.shape, 1700);
    const Result group = run_on_host<1, fl::GroupTiles>(pc.shape, data, AttentionMask::causal, pc.lengths, &drop);
    check_all(reference(pc.shape, data, AttentionMask::causal, pc.lengths, &drop), group.out, group.lse, group.dqkv);
    CHECK(same_values(group, run_on_host(pc.shape, data, AttentionMask::causal, pc.lengths, &drop)));
  }
}

TEST_CASE("an emulated cp.async lands at once, or at the wait after its commit and never without one (host side)") {
  // 32 threads, each copying the 16 bytes 1..16 into its own slot; thread 1 only 12 of them (the
  // last 4 zero-filled), thread 3 none (all 16 zeros).
  alignas(16) static const std::uint8_t source[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  for (const CopyTiming timing : {CopyTiming::at_issue, CopyTiming::at_wait}) {
    CAPTURE(static_cast<int>(timing));
    HostBlock block(0, 0, 32 * 16, 32, timing);
    std::uint8_t before[32], after_commit[32], after_wait[32], fourth[32], thirteenth[32];
    run_block(block, [&](HostThread& th) {
      const int t = th.thread();
      unsigned char* slot = th.shared() + 16 * t;
      th.copy_async(slot, source, t == 1 ? 12 : t == 3 ? 0 : 16);
      before[t] = slot[0];
      if (t != 2) th.commit_copies();  // thread 2 never commits its copy
      after_commit[t] = slot[0];
      th.wait_copies();
      after_wait[t] = slot[0];
      fourth[t] = slot[3];
      thirteenth[t] = slot[12];
    });
    const std::uint8_t garbage = 0x7f;
    const bool at_once = timing == CopyTiming::at_issue;
    CHECK(before[0] == (at_once ? 1 : garbage));
    CHECK(after_commit[0] == (at_once ? 1 : garbage));
    CHECK(after_wait[0] == 1);
    CHECK(fourth[0] == 4);
    CHECK(thirteenth[0] == 13);
    CHECK((after_wait[1] == 1 && thirteenth[1] == 0));
    CHECK((after_wait[3] == 0 && thirteenth[3] == 0));
    CHECK(after_wait[2] == (at_once ? 1 : garbage));
  }
}

TEST_CASE("the tiled kernels' bodies give the same bits when each cp.async lands only at its wait (host emulation)") {
  // Copies landing at once, as the other cases run them, show a buffer overwritten while another
  // thread still reads it; landing at the wait, a tile read before its wait or a group never
  // committed: the GPU lands them in between, so both must give the same values.
  std::uint32_t seed = 1800;
  for (const AttentionMask mask : both_masks) {
    INFO(loom::name(mask));
    for (const PaddedCase& pc : padded_cases()) {
      CAPTURE(pc.shape);
      const Data data = make_data(pc.shape, seed += 10);
      const Result late = run_on_host(pc.shape, data, mask, pc.lengths, nullptr, GradientWrite::accumulate,
                                      CopyTiming::at_wait);
      CHECK(same_values(late, run_on_host(pc.shape, data, mask, pc.lengths)));
    }
    const Case wide{2, 129, 1, 64};
    const Lengths lengths{100, 129};
    const Data data = make_data(wide, seed += 10);
    const AttentionDropout drop = test_dropout(31);
    const auto late = [&]<int M, class Tiles>(const AttentionDropout* d) {
      return run_on_host<M, Tiles>(wide, data, mask, lengths, d, GradientWrite::accumulate, CopyTiming::at_wait);
    };
    CHECK(same_values(late.template operator()<2, fl::PaddedTiles>(nullptr),
                      run_on_host<2>(wide, data, mask, lengths)));
    CHECK(same_values(late.template operator()<1, fl::GroupTiles>(nullptr),
                      run_on_host<1, fl::GroupTiles>(wide, data, mask, lengths)));
    CHECK(same_values(late.template operator()<1, fl::GroupTiles>(&drop),
                      run_on_host<1, fl::GroupTiles>(wide, data, mask, lengths, &drop)));
  }
}

// ---------------------------------------------------------------------------------------------
// On the GPU.

//! The forward and backward through the public kernels on `be` (flash or cuBLAS per its switch),
//! with `dropout` (inactive by default).
Result run_on_device(cuda& be, const Case& c, const Data& data, AttentionMask mask = AttentionMask::causal,
                     const Lengths& lengths = {}, const AttentionDropout& dropout = {},
                     GradientWrite write = GradientWrite::accumulate) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const DeviceArray<std::int32_t> device_lengths(be, lengths.empty() ? Lengths(1, 0) : lengths,
                                                 Shape{lengths.empty() ? 1 : c.B});
  const AttentionKeys keys = lengths.empty() ? AttentionKeys(mask) : AttentionKeys(mask, device_lengths.cview());
  const Shape qkv_shape{c.B, c.T, 3 * c.C()}, out_shape{c.B, c.T, c.C()};
  const DeviceArray<bf16> qkv(be, data.qkv, qkv_shape), dout(be, data.dout, out_shape),
      dqkv(be, write == GradientWrite::accumulate ? data.dqkv0 : std::vector<bf16>(data.dqkv0.size(), bf16(nan)),
           qkv_shape);
  const DeviceArray<bf16> out(be, std::vector<bf16>(static_cast<std::size_t>(out_shape.numel()), bf16(nan)),
                              out_shape);
  const DeviceArray<float> lse(be, std::vector<float>(static_cast<std::size_t>(c.B * c.NH * c.T), nan),
                               Shape{c.B, c.NH, c.T});
  const int heads = static_cast<int>(c.NH);
  attention_forward_lse<bf16>(be, out.view(), lse.view(), qkv.cview(), heads, keys, dropout);
  attention_backward_lse<bf16>(be, dqkv.view(), dout.cview(), qkv.cview(), out.cview(), lse.cview(), heads, keys,
                               dropout, write);
  return {out.to_host(be), dqkv.to_host(be), lse.to_host(be)};
}

std::vector<Case> device_cases() {
  std::vector<Case> cases = host_cases();
  // GPT-2 small's sequence and head size; two heads, not 4 x 12: the double reference over 48
  // heads took over two minutes on the H100 machine's CPU.
  cases.push_back({1, 1024, 2, 64});
  cases.push_back({2, 333, 4, 128});
  return cases;
}

//! Whether the GPU is sm_80 or newer; then this program must have the tiled kernels for it (it is
//! built with compute_80 PTX beside CMake's architectures; tests/cuda/CMakeLists.txt).
bool tiled_kernels_run(cuda& be) {
  int major = 0;
  REQUIRE(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, be.device()) == cudaSuccess);
  if (major < 8) {
    MESSAGE("GPU older than sm_80: no bf16 mma.sync, the tiled kernels are not used or tested");
    CHECK_FALSE(flash_attention_available(be));
    return false;
  }
  REQUIRE(flash_attention_available(be));
  CHECK(be.flash_attention());  // on by default (measured faster than the cuBLAS path)
  return true;
}

__global__ void fragment_kernel(const bf16* a, const bf16* bt, float* d, float* e) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  fl::DeviceThread th;
  fragment_body(th, a, bt, d, e);
#else
  (void)a, (void)bt, (void)d, (void)e;
#endif
}

TEST_CASE("the mma fragment helpers give a plain product on the GPU (the m16n8k16 layout itself)") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!tiled_kernels_run(be)) return;
  const FragmentCase f{random_bf16(16 * 16, 51), random_bf16(8 * 16, 52)};
  const std::vector<float> nans(16 * 8, std::numeric_limits<float>::quiet_NaN());
  const DeviceArray<bf16> a(be, f.a, Shape{16, 16}), bt(be, f.bt, Shape{8, 16});
  const DeviceArray<float> d(be, nans, Shape{16, 8}), e(be, nans, Shape{16, 8});
  detail::cuda_kernels::activate(be);
  fragment_kernel<<<1, 32, 8 * 16 * sizeof(bf16), be.stream()>>>(a.buffer.data(), bt.buffer.data(), d.buffer.data(),
                                                                  e.buffer.data());
  detail::cuda_check_launch("fragment_kernel");
  check_fragments(f, d.to_host(be), e.to_host(be));
}

TEST_CASE("attention_forward_lse/backward_lse on the tiled kernels match the reference; same bits each run") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!tiled_kernels_run(be)) return;
  std::uint32_t seed = 300;
  for (const AttentionMask mask : both_masks) {
    for (const Case& c : device_cases()) {
      INFO(loom::name(mask));
      CAPTURE(c);
      const Data data = make_data(c, seed += 10);
      const Reference ref = reference(c, data, mask);
      const Result first = run_on_device(be, c, data, mask);
      check_all(ref, first.out, first.lse, first.dqkv);
      const Result second = run_on_device(be, c, data, mask);
      CHECK(std::equal(first.dqkv.begin(), first.dqkv.end(), second.dqkv.begin()));
      CHECK(std::equal(first.out.begin(), first.out.end(), second.out.begin()));
    }
  }
}

TEST_CASE("the tiled kernels and the cuBLAS path agree (both masks); the tiled forward takes no workspace, its "
          "backward B NH T floats") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!tiled_kernels_run(be)) return;
  const Case c{2, 200, 3, 64};
  const Data data = make_data(c, 900);
  const Reference ref = reference(c, data);
  const Result tiled = run_on_device(be, c, data);
  check_all(ref, tiled.out, tiled.lse, tiled.dqkv);

  const Shape qkv_shape{c.B, c.T, 3 * c.C()}, out_shape{c.B, c.T, c.C()};
  const DeviceArray<bf16> qkv(be, data.qkv, qkv_shape), dout(be, data.dout, out_shape),
      dqkv(be, data.dqkv0, qkv_shape), out(be, tiled.out, out_shape);
  const DeviceArray<float> lse(be, tiled.lse, Shape{c.B, c.NH, c.T});
  const auto peak_workspace = [&](auto&& launch) {
    const std::size_t before = be.memory().current(MemoryCategory::workspace);
    be.memory().reset_peaks();
    launch();
    CHECK(be.memory().current(MemoryCategory::workspace) == before);
    return be.memory().peak(MemoryCategory::workspace) - before;
  };
  const int heads = static_cast<int>(c.NH);
  CHECK(peak_workspace([&] { attention_forward_lse<bf16>(be, out.view(), lse.view(), qkv.cview(), heads); }) == 0);
  CHECK(peak_workspace([&] {
          attention_backward_lse<bf16>(be, dqkv.view(), dout.cview(), qkv.cview(), out.cview(), lse.cview(), heads);
        }) == static_cast<std::size_t>(c.B * c.NH * c.T) * sizeof(float));

  be.set_flash_attention(false);
  const Result batched = run_on_device(be, c, data);
  check_all(ref, batched.out, batched.lse, batched.dqkv, cublas_lse_tolerance);

  // The bidirectional mask on both paths.
  const Reference everywhere = reference(c, data, AttentionMask::bidirectional);
  const Result batched_bidirectional = run_on_device(be, c, data, AttentionMask::bidirectional);
  check_all(everywhere, batched_bidirectional.out, batched_bidirectional.lse, batched_bidirectional.dqkv,
            cublas_lse_tolerance);
  be.set_flash_attention(true);
  const Result tiled_bidirectional = run_on_device(be, c, data, AttentionMask::bidirectional);
  check_all(everywhere, tiled_bidirectional.out, tiled_bidirectional.lse, tiled_bidirectional.dqkv);
}

//! One case through the public pair on `be` with `enable(true)` (a backend switch): against the
//! reference, the bits repeating; then with `enable(false)`: against the reference, lse within
//! `off_lse_tolerance`.
template <class Enable>
void check_switched(cuda& be, Enable&& enable, const PaddedCase& pc, const Data& data, AttentionMask mask,
                    const Reference& ref, const AttentionDropout& dropout, double off_lse_tolerance) {
  enable(true);
  const Result on = run_on_device(be, pc.shape, data, mask, pc.lengths, dropout);
  check_all(ref, on.out, on.lse, on.dqkv);
  const Result again = run_on_device(be, pc.shape, data, mask, pc.lengths, dropout);
  CHECK(on.out == again.out);
  CHECK(on.dqkv == again.dqkv);
  enable(false);
  const Result off = run_on_device(be, pc.shape, data, mask, pc.lengths, dropout);
  check_all(ref, off.out, off.lse, off.dqkv, off_lse_tolerance);
}

//! The tiled kernels' switch of `be`, for check_switched: on, the tiled kernels; off, cuBLAS's.
auto flash_switch(cuda& be) {
  return [&be](bool on) { be.set_flash_attention(on); };
}

TEST_CASE("padded batches on the tiled kernels match the reference and the cuBLAS path (both masks)") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!tiled_kernels_run(be)) return;
  std::uint32_t seed = 1000;
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : padded_cases()) {
      INFO(loom::name(mask));
      CAPTURE(pc.shape);
      const Data data = make_data(pc.shape, seed += 10);
      check_switched(be, flash_switch(be), pc, data, mask, reference(pc.shape, data, mask, pc.lengths), {},
                     cublas_lse_tolerance);
    }
  }
  be.set_flash_attention(true);
}

TEST_CASE("on the GPU an overwriting backward writes all of dqkv: the tiled kernels give accumulating into zeros' "
          "bits, the cuBLAS path the reference (both masks, padded or not)") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!tiled_kernels_run(be)) return;
  std::uint32_t seed = 1500;
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : overwrite_cases()) {
      INFO(loom::name(mask));
      CAPTURE(pc.shape);
      const Data data = with_zero_gradient(make_data(pc.shape, seed += 10));
      for (const bool flash : {true, false}) {
        INFO(std::string(flash ? "tiled kernels" : "cuBLAS path"));
        be.set_flash_attention(flash);
        const Result accumulated = run_on_device(be, pc.shape, data, mask, pc.lengths);
        const Result written = run_on_device(be, pc.shape, data, mask, pc.lengths, {}, GradientWrite::overwrite);
        if (flash) CHECK(same_values(written.dqkv, accumulated.dqkv));
        check_all(reference(pc.shape, data, mask, pc.lengths), written.out, written.lse, written.dqkv,
                  flash ? lse_tolerance : cublas_lse_tolerance);
      }
    }
  }
  be.set_flash_attention(true);
}

//! The forward and backward through the tiled kernels launched directly with warps of M row
//! blocks (the public functions launch the library's row_blocks), padded or not; head size 32 or
//! 64 (M = 2 is built for those only here).
template <int M>
Result run_layout_on_device(cuda& be, const Case& c, const Data& data, AttentionMask mask, const Lengths& lengths) {
  REQUIRE(c.hs <= 64);
  namespace ca = detail::cuda_attention;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::int64_t rows = c.B * c.NH * c.T;
  const Shape qkv_shape{c.B, c.T, 3 * c.C()}, out_shape{c.B, c.T, c.C()};
  const DeviceArray<std::int32_t> device_lengths(be, lengths.empty() ? Lengths(1, 0) : lengths,
                                                 Shape{lengths.empty() ? 1 : c.B});
  const DeviceArray<bf16> qkv(be, data.qkv, qkv_shape), dout(be, data.dout, out_shape),
      dqkv(be, data.dqkv0, qkv_shape);
  const DeviceArray<bf16> out(be, std::vector<bf16>(static_cast<std::size_t>(out_shape.numel()), bf16(nan)),
                              out_shape);
  const DeviceArray<float> lse(be, std::vector<float>(static_cast<std::size_t>(rows), nan), Shape{rows}),
      delta(be, std::vector<float>(static_cast<std::size_t>(rows), nan), Shape{rows});
  const fl::Shape shape{c.T,  c.C(), static_cast<int>(c.NH), 1.0f / std::sqrt(static_cast<float>(c.hs)),
                        mask, lengths.empty() ? nullptr : device_lengths.buffer.data()};
  const fl::ForwardArgs fa{shape, qkv.buffer.data(), out.buffer.data(), lse.buffer.data()};
  const fl::BackwardArgs ba{shape,           qkv.buffer.data(),   dout.buffer.data(), lse.buffer.data(),
                            delta.buffer.data(), dqkv.buffer.data()};
  const dim3 grid(static_cast<unsigned>(c.B * c.NH), static_cast<unsigned>(fl::row_tiles(c.T, M)));
  const auto run = [&]<int HS>() {
    ca::launch_tiled(be, fl::forward_kernel<HS, M>, grid, fl::ForwardSmem<HS>::total, "test", "forward", fa);
    ca::launch_tiled(be, fl::delta_kernel<HS>, dim3(fl::delta_blocks<HS>(rows)), 0, "test", "delta",
                     out.buffer.data(), dout.buffer.data(), delta.buffer.data(), shape, rows);
    ca::launch_tiled(be, fl::key_value_grad_kernel<HS, M>, grid, fl::KeyValueGradSmem<HS>::total, "test",
                     "key_value_grad", ba);
    ca::launch_tiled(be, fl::query_grad_kernel<HS, M>, grid, fl::QueryGradSmem<HS>::total, "test", "query_grad", ba);
  };
  if (c.hs == 32)
    run.template operator()<32>();
  else
    run.template operator()<64>();
  return {out.to_host(be), dqkv.to_host(be), lse.to_host(be)};
}

TEST_CASE("on the GPU, warps of two row blocks (M = 2) match the reference and give M = 1's values") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!tiled_kernels_run(be)) return;
  const std::vector<PaddedCase> cases = {{{1, 1024, 2, 64}, {}},
                                         {{2, 333, 4, 64}, {}},
                                         {{1, 129, 2, 32}, {}},
                                         {{3, 200, 1, 64}, {70, 1, 200}},
                                         {{2, 129, 1, 32}, {100, 129}}};
  check_two_row_blocks(cases, 1200, [&be](auto m, const PaddedCase& pc, const Data& data, AttentionMask mask) {
    return run_layout_on_device<decltype(m)::value>(be, pc.shape, data, mask, pc.lengths);
  });
}

TEST_CASE("with attention dropout the tiled kernels match the reference and the cuBLAS path (both masks); same bits "
          "each run") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!tiled_kernels_run(be)) return;
  const AttentionDropout drop = test_dropout(31);
  std::vector<PaddedCase> cases = dropout_cases();
  cases.push_back({{1, 1024, 2, 64}, {}});  // GPT-2 small's T and head size
  cases.push_back({{2, 512, 2, 64}, {512, 300}});  // BERT's T, padded
  std::uint32_t seed = 1400;
  for (const AttentionMask mask : both_masks) {
    for (const PaddedCase& pc : cases) {
      INFO(loom::name(mask));
      CAPTURE(pc.shape);
      const Data data = make_data(pc.shape, seed += 10);
      check_switched(be, flash_switch(be), pc, data, mask, reference(pc.shape, data, mask, pc.lengths, &drop), drop,
                     cublas_lse_tolerance);
    }
  }
  be.set_flash_attention(true);
}

__global__ void group_fragment_kernel(const bf16* a, const bf16* b, float* s, float* o, float* h, float* o2) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  fl::GroupDeviceThread th;
  group_fragment_body(th, a, b, s, o, h, o2);
#else
  (void)a, (void)b, (void)s, (void)o, (void)h, (void)o2;
#endif
}

//! Whether this program holds the wgmma kernels for the GPU (built for sm_90a); says why not.
bool group_kernels_run(cuda& be) {
  if (!tiled_kernels_run(be)) return false;
  if (!warpgroup_attention_available(be)) {
    MESSAGE("not built for sm_90a (CMAKE_CUDA_ARCHITECTURES=90a) or not a Hopper GPU: the wgmma kernels are "
            "not tested");
    return false;
  }
  CHECK_FALSE(be.warpgroup_attention());  // off by default
  return true;
}

TEST_CASE("the warpgroup product helpers give plain products on the GPU (wgmma's layouts themselves)") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!group_kernels_run(be)) return;
  GroupFragments f;
  const DeviceArray<bf16> a(be, f.a, Shape{64, 64}), b(be, f.b, Shape{64, 64});
  DeviceArray<float> s(be, f.s, Shape{64, 64}), o(be, f.o, Shape{64, 64}), h(be, f.h, Shape{64, 32}),
      o2(be, f.o2, Shape{64, 64});
  detail::cuda_kernels::activate(be);
  group_fragment_kernel<<<1, fl::threads, group_fragment_bytes, be.stream()>>>(
      a.buffer.data(), b.buffer.data(), s.buffer.data(), o.buffer.data(), h.buffer.data(), o2.buffer.data());
  detail::cuda_check_launch("group_fragment_kernel");
  f.s = s.to_host(be);
  f.o = o.to_host(be);
  f.h = h.to_host(be);
  f.o2 = o2.to_host(be);
  check_group_fragments(f);
}

TEST_CASE("on the GPU the warpgroup (wgmma) kernels match the reference and the mma.sync kernels; same bits each "
          "run") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!group_kernels_run(be)) return;
  const AttentionDropout drop = test_dropout(37);
  const std::vector<PaddedCase> cases = {{{1, 1024, 2, 64}, {}},       {{2, 333, 4, 64}, {}},
                                         {{1, 129, 2, 64}, {}},        {{3, 200, 1, 64}, {70, 1, 200}},
                                         {{2, 512, 2, 64}, {512, 300}}};
  std::uint32_t seed = 1800;
  for (const bool dropped : {false, true}) {
    for (const AttentionMask mask : both_masks) {
      for (const PaddedCase& pc : cases) {
        INFO(loom::name(mask) << (dropped ? ", dropout" : ""));
        CAPTURE(pc.shape);
        const Data data = make_data(pc.shape, seed += 10);
        const Reference ref = reference(pc.shape, data, mask, pc.lengths, dropped ? &drop : nullptr);
        // On, then the mma.sync kernels (off): both within the tiled kernels' tolerances.
        check_switched(
            be, [&be](bool on) { be.set_warpgroup_attention(on); }, pc, data, mask, ref,
            dropped ? drop : AttentionDropout{}, lse_tolerance);
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) { return run_tests(argc, argv); }
