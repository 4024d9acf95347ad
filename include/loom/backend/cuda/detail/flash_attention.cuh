#pragma once
//! \file SRAM-tiled causal self-attention with the log-sum-exp contract, for bf16 data with
//! float accumulation on tensor cores (WMMA 16x16x16): the algorithm of FlashAttention-2 (Dao,
//! "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", 2023), with
//! the backward split into two kernels so that no gradient element is written by two blocks
//! (FlashAttention-2 adds dQ with atomics, whose order changes the bits from run to run).
//!
//! - forward: a block owns 64 query rows of one (batch, head); it walks the key tiles 0..its own
//!   (causal), keeping each row's running max m and sum l (the online softmax) and the
//!   unnormalised output in shared memory, and writes out and lse = m + log l at the end.
//!   Nothing T x T exists anywhere.
//! - backward, with D = rowsum(dout * out) per query row (delta_kernel):
//!   - key_value_grad: a block owns 64 keys; it walks the query tiles from its own to the last,
//!     recomputing S^T = K Q^T, P^T = exp(S^T scale - lse), dP^T = V dO^T and
//!     dS^T = P^T (dP^T - D) scale, and accumulates dV += P^T dO and dK += dS^T Q in registers;
//!   - query_grad: a block owns 64 queries; it walks the key tiles 0..its own, recomputing S, P,
//!     dP and dS the same way, and accumulates dQ += dS K.
//!   The score work is done twice (once per kernel), the price of a fixed summation order.
//!
//! The kernel bodies are templates over a `Thread` type that supplies the thread and block
//! indices, the barriers, the lane exchange and the WMMA tile operations: on the GPU it is
//! DeviceThread (threadIdx, __syncthreads, nvcuda::wmma); the tests run the same bodies on the
//! host with every thread of a block as a host thread and the tile operations in float, so the
//! tiling, masking, barriers and indexing are checked where there is no GPU.
//!
//! Each warp works on 16 rows (one WMMA tile high) and each pair of lanes on one of them, lane
//! bit 0 choosing the half of the 64 columns; the pair exchanges partial maxima and sums with one
//! shuffle. Tile rows past T are loaded as zeros and masked, so any T works.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <mma.h>
#endif

#include "loom/core/bf16.hpp"
#include "loom/core/hd.hpp"

// The kernel bodies are host-device templates over a Thread type; instantiated with the tests'
// host Thread, their device side must not be checked (nvcc's exec check would warn that a host
// function is called from host-device code, though that instantiation never runs on a device).
#if defined(__CUDACC__)
#define LOOM_FLASH_BODY _Pragma("nv_exec_check_disable")
#else
#define LOOM_FLASH_BODY
#endif

namespace loom::detail::flash {

//! Query rows and key columns of a tile.
inline constexpr int tile = 64;
//! Warps of a block, each owning 16 rows of the block's tile.
inline constexpr int warps = 4;
inline constexpr int threads = 32 * warps;
inline constexpr int warp_rows = tile / warps;  // 16: one WMMA tile high
//! The WMMA tile edge (m = n = k = 16 for bf16).
inline constexpr int mma_edge = 16;
static_assert(warp_rows == mma_edge, "each warp owns one WMMA tile of rows");

//! The head sizes the kernels are built for (the rest use the cuBLAS path).
inline constexpr bool supported_head_size(std::int64_t hs) noexcept { return hs == 32 || hs == 64 || hs == 128; }

//! Tiles covering `tokens` rows.
LOOM_HD constexpr std::int64_t tiles(std::int64_t tokens) noexcept { return (tokens + tile - 1) / tile; }

//! The shapes every kernel reads. qkv [B,T,3C] (q, k, v of head h at columns h hs, C + h hs,
//! 2C + h hs), out and dout [B,T,C], lse and delta [B,NH,T].
struct Shape {
  std::int64_t tokens, channels;
  int heads;
  float scale;  //!< 1/sqrt(hs)
};

//! Forward: reads qkv, writes out and lse.
struct ForwardArgs {
  Shape shape;
  const bf16* qkv;
  bf16* out;
  float* lse;
};

//! Backward: reads qkv, dout, lse and delta; adds into dqkv.
struct BackwardArgs {
  Shape shape;
  const bf16* qkv;
  const bf16* dout;
  const float* lse;
  const float* delta;
  bf16* dqkv;
};

//! Where a block works: batch element b, head h (blockIdx.x = b NH + h) and the index of its
//! tile (blockIdx.y, ordered so that the blocks with the most tiles to walk start first).
struct Place {
  std::int64_t b, h, bh;
};
LOOM_HD inline Place place(std::int64_t block_x, int heads) noexcept {
  return {block_x / heads, block_x % heads, block_x};
}

// ---------------------------------------------------------------------------------------------
// Shared memory: byte offsets of each kernel's regions (every region a multiple of 128 bytes, so
// each WMMA pointer is 256-bit aligned as the WMMA loads and stores require).

//! Bytes of a [rows, cols] block of `E`.
template <class E>
LOOM_HD constexpr std::size_t bytes(int rows, int cols) noexcept {
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) * sizeof(E);
}

//! The forward's shared memory for head size HS: the query, key and value tiles [64, HS] (bf16),
//! and per warp the scores [16, 64] (float), the probabilities [16, 64] (bf16) and the running
//! output [16, HS] (float).
template <int HS>
struct ForwardSmem {
  static constexpr std::size_t q = 0;
  static constexpr std::size_t k = q + bytes<bf16>(tile, HS);
  static constexpr std::size_t v = k + bytes<bf16>(tile, HS);
  static constexpr std::size_t s = v + bytes<bf16>(tile, HS);
  static constexpr std::size_t p = s + warps * bytes<float>(warp_rows, tile);
  static constexpr std::size_t o = p + warps * bytes<bf16>(warp_rows, tile);
  static constexpr std::size_t total = o + warps * bytes<float>(warp_rows, HS);
};

//! The backward kernels' shared memory: four [64, HS] bf16 tiles (key_value_grad: k, v, q, dout;
//! query_grad: q, dout, k, v), lse and delta of the 64 query rows, and per warp two adjacent
//! [16, 64] float blocks (the scores and the probability gradient; at the end together the
//! [16, HS] staging of the accumulators, HS <= 128) and two [16, 64] bf16 blocks (P^T and dS^T,
//! or dS).
template <int HS>
struct BackwardSmem {
  static constexpr std::size_t tile_a = 0;
  static constexpr std::size_t tile_b = tile_a + bytes<bf16>(tile, HS);
  static constexpr std::size_t tile_c = tile_b + bytes<bf16>(tile, HS);
  static constexpr std::size_t tile_d = tile_c + bytes<bf16>(tile, HS);
  static constexpr std::size_t lse = tile_d + bytes<bf16>(tile, HS);
  static constexpr std::size_t delta = lse + bytes<float>(1, 128);  // 64 used; 128-byte aligned
  //! Warp w's scores at floats + w warp_floats, its probability gradient warp_rows * tile after.
  static constexpr std::size_t floats = delta + bytes<float>(1, 128);
  static constexpr int warp_floats = 2 * warp_rows * tile;
  static constexpr std::size_t p = floats + warps * bytes<float>(1, warp_floats);
  static constexpr std::size_t ds = p + warps * bytes<bf16>(warp_rows, tile);
  static constexpr std::size_t total = ds + warps * bytes<bf16>(warp_rows, tile);
  static_assert(warp_rows * HS <= warp_floats, "the accumulators are staged in a warp's two float blocks");
};

//! The region at byte `offset` of shared memory `base`, as E*.
template <class E>
LOOM_HD inline E* region(unsigned char* base, std::size_t offset) noexcept {
  return reinterpret_cast<E*>(base + offset);
}

// ---------------------------------------------------------------------------------------------
// Pieces the kernel bodies share.

//! Eight bf16, moved as one 16-byte word.
struct alignas(16) Pack {
  std::uint32_t words[4];
};
inline constexpr int pack = 8;
static_assert(sizeof(Pack) == pack * sizeof(bf16));

//! The 8 bf16 at `p` (16-byte aligned) as one load; on the host through memcpy (no aliasing).
LOOM_HD inline Pack load_pack(const bf16* p) noexcept {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const Pack*>(p);
#else
  Pack value;
  std::memcpy(&value, p, sizeof value);
  return value;
#endif
}
LOOM_HD inline void store_pack(bf16* p, const Pack& value) noexcept {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Pack*>(p) = value;
#else
  std::memcpy(static_cast<void*>(p), &value, sizeof value);
#endif
}

//! Copies rows [first, first + 64) of a [T, ld]-strided matrix's HS columns at `src` into the
//! [64, HS] tile `dst`, zeros for rows >= T. All threads of the block take part (consecutive
//! threads read consecutive elements of a row).
//! Where `src` is 16-byte aligned and ld a multiple of 8, each thread moves 8 elements at a time
//! (one 16-byte load and store instead of eight 2-byte ones).
LOOM_FLASH_BODY
template <int HS, class Thread>
LOOM_HD inline void load_tile(Thread& th, bf16* dst, const bf16* src, std::int64_t ld, std::int64_t first,
                              std::int64_t tokens) {
  if (reinterpret_cast<std::uintptr_t>(src) % sizeof(Pack) == 0 && ld % pack == 0) {
    constexpr int packs = HS / pack;  // per row
    for (int e = th.thread(); e < tile * packs; e += threads) {
      const int r = e / packs, c = e % packs * pack;
      const std::int64_t row = first + r;
      Pack value{};
      if (row < tokens) value = load_pack(src + row * ld + c);
      store_pack(dst + r * HS + c, value);
    }
    return;
  }
  for (int e = th.thread(); e < tile * HS; e += threads) {
    const int r = e / HS, c = e % HS;
    const std::int64_t row = first + r;
    dst[e] = row < tokens ? src[row * ld + c] : bf16(0.0f);
  }
}

//! Copies the 64 floats of row-indexed data at `src` + first into `dst`, 0 for rows >= T.
LOOM_FLASH_BODY
template <class Thread>
LOOM_HD inline void load_rows(Thread& th, float* dst, const float* src, std::int64_t first, std::int64_t tokens) {
  for (int r = th.thread(); r < tile; r += threads) dst[r] = first + r < tokens ? src[first + r] : 0.0f;
}

//! acc[j] (j < 4) = the [16, 64] product a b^T of a = rows of the [., HS] tile at `a` (16 rows)
//! and b = the [64, HS] tile at `b`, i.e. a k-loop over HS in steps of 16; stored row-major into
//! the [16, 64] float block `out`.
LOOM_FLASH_BODY
template <int HS, class Thread>
LOOM_HD inline void product_abt(Thread& th, float* out, const bf16* a, const bf16* b) {
  for (int j = 0; j < tile / mma_edge; ++j) {
    typename Thread::Acc acc;
    th.zero(acc);
    for (int k = 0; k < HS; k += mma_edge) {
      typename Thread::RowA fa;
      typename Thread::ColB fb;
      th.load(fa, a + k, HS);
      th.load(fb, b + j * mma_edge * HS + k, HS);  // b^T: column n of it is row n of b
      th.mma(acc, fa, fb);
    }
    th.store(out + j * mma_edge, acc, tile);
  }
}

//! acc[n] += the [16, HS] product a b of a = the [16, 64] bf16 block at `a` and b = the [64, HS]
//! tile at `b` (n indexes 16-column blocks of HS).
LOOM_FLASH_BODY
template <int HS, class Thread>
LOOM_HD inline void accumulate_ab(Thread& th, typename Thread::Acc (&acc)[HS / mma_edge], const bf16* a,
                                  const bf16* b) {
  for (int k = 0; k < tile; k += mma_edge) {
    typename Thread::RowA fa;
    th.load(fa, a + k, tile);
    for (int n = 0; n < HS / mma_edge; ++n) {
      typename Thread::RowB fb;
      th.load(fb, b + k * HS + n * mma_edge, HS);
      th.mma(acc[n], fa, fb);
    }
  }
}

//! dst[row, h hs + c] += the warp's accumulators for its 16 rows starting at token `first`
//! (rows >= T skipped), one rounding per element: the accumulators are staged row-major in the
//! warp's [16, HS] float block `stage`.
LOOM_FLASH_BODY
template <int HS, class Thread>
LOOM_HD inline void add_rows(Thread& th, bf16* dst, std::int64_t ld, const typename Thread::Acc (&acc)[HS / mma_edge],
                             float* stage, std::int64_t first, std::int64_t tokens) {
  for (int n = 0; n < HS / mma_edge; ++n) th.store(stage + n * mma_edge, acc[n], HS);
  th.sync_warp();
  const int lane = th.thread() % 32;
  for (int e = lane; e < warp_rows * HS; e += 32) {
    const int r = e / HS, c = e % HS;
    const std::int64_t row = first + r;
    if (row < tokens) {
      bf16& d = dst[row * ld + c];
      d = bf16(static_cast<float>(d) + stage[e]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel bodies, run by every thread of a block of `threads`.

//! What a thread of a kernel body works on: the sizes (ld = 3C, qkv's row stride), its block's
//! (batch, head), its warp, and its lane's row r of the warp's 16 and half of the 64 columns.
struct Position {
  std::int64_t tokens, channels, ld;
  Place at;
  int warp, lane, r, half;
};
LOOM_FLASH_BODY
template <class Thread>
LOOM_HD inline Position position(const Thread& th, const Shape& sh) {
  const int lane = th.thread() % 32;
  return {sh.tokens, sh.channels, 3 * sh.channels, place(th.block_x(), sh.heads), th.thread() / 32, lane, lane / 2,
          lane % 2};
}

//! The column that the lane of row r and half `half` visits at step i of a loop over the `width`
//! columns of its half (i < width). The steps are rotated by row and half so that at every step
//! the warp's 32 lanes reach 32 different banks of a row-major [16, 64] float block: walked in
//! the same order, all 32 would read one bank, 32 ways serialised (the first tiled kernels ran at
//! 7 TFLOP/s on an H100 so).
LOOM_HD constexpr int staggered(int i, int r, int half, int width) noexcept { return (i + r + 16 * half) % width; }

//! The tile of a block that walks from tile 0 to its own: the last tiles, which walk the
//! longest, go to the first blocks.
LOOM_HD inline std::int64_t longest_first(std::int64_t tokens, std::int64_t block_y) noexcept {
  return tiles(tokens) - 1 - block_y;
}

//! The forward of one block: 64 query rows of one (batch, head). Shared memory: ForwardSmem<HS>.
LOOM_FLASH_BODY
template <int HS, class Thread>
LOOM_HD void forward_block(Thread& th, const ForwardArgs& a) {
  using Smem = ForwardSmem<HS>;
  const Shape& sh = a.shape;
  const auto [T, C, ld, at, warp, lane, r, half] = position(th, sh);
  const std::int64_t qt = longest_first(T, th.block_y());

  unsigned char* smem = th.shared();
  bf16* q = region<bf16>(smem, Smem::q);
  bf16* k = region<bf16>(smem, Smem::k);
  bf16* v = region<bf16>(smem, Smem::v);
  float* s = region<float>(smem, Smem::s) + warp * warp_rows * tile;
  bf16* p = region<bf16>(smem, Smem::p) + warp * warp_rows * tile;
  float* o = region<float>(smem, Smem::o) + warp * warp_rows * HS;

  const bf16* qkv_bh = a.qkv + at.b * T * ld + at.h * HS;  // q of token 0; k at + C, v at + 2C
  load_tile<HS>(th, q, qkv_bh, ld, qt * tile, T);
  for (int e = lane; e < warp_rows * HS; e += 32) o[e] = 0.0f;

  const std::int64_t t = qt * tile + warp * warp_rows + r;  // this lane's query
  const bool row_valid = t < T;
  float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
  for (std::int64_t kt = 0; kt <= qt; ++kt) {
    th.sync_block();  // the previous tile's k and v are no longer read
    load_tile<HS>(th, k, qkv_bh + C, ld, kt * tile, T);
    load_tile<HS>(th, v, qkv_bh + 2 * C, ld, kt * tile, T);
    th.sync_block();
    product_abt<HS>(th, s, q + warp * warp_rows * HS, k);  // raw scores of the warp's 16 rows
    th.sync_warp();

    // Online softmax of row r over this tile's keys: a key s counts where s <= t (the causal
    // mask; it implies s < T for a query t < T). Every valid row sees key kt * 64 <= t.
    const float* srow = s + r * tile;
    float tile_max = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < 32; ++i) {
      const int c = half * 32 + staggered(i, r, half, 32);
      if (row_valid && kt * tile + c <= t) tile_max = fmaxf(tile_max, srow[c] * sh.scale);
    }
    tile_max = fmaxf(tile_max, th.swap_pair(tile_max));
    const float m_new = row_valid ? fmaxf(m, tile_max) : 0.0f;
    const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.0f : expf(m - m_new);
    float sum = 0.0f;
    for (int i = 0; i < 32; ++i) {
      const int c = half * 32 + staggered(i, r, half, 32);
      const float e = row_valid && kt * tile + c <= t ? expf(fmaf(srow[c], sh.scale, -m_new)) : 0.0f;
      p[r * tile + c] = bf16(e);
      sum += e;
    }
    sum += th.swap_pair(sum);
    l = l * alpha + sum;
    m = m_new;
    for (int i = 0; i < HS / 2; ++i) o[r * HS + half * (HS / 2) + staggered(i, r, half, HS / 2)] *= alpha;
    th.sync_warp();

    // o += p v, the accumulators round-tripping through shared memory (their rows were rescaled)
    for (int n = 0; n < HS / mma_edge; ++n) {
      typename Thread::Acc acc;
      th.load(acc, o + n * mma_edge, HS);
      for (int kk = 0; kk < tile; kk += mma_edge) {
        typename Thread::RowA fa;
        typename Thread::RowB fb;
        th.load(fa, p + kk, tile);
        th.load(fb, v + kk * HS + n * mma_edge, HS);
        th.mma(acc, fa, fb);
      }
      th.store(o + n * mma_edge, acc, HS);
    }
    th.sync_warp();
  }

  if (row_valid) {
    const float inverse = 1.0f / l;  // l >= 1: the max term is exp(0)
    bf16* out_row = a.out + (at.b * T + t) * C + at.h * HS;
    for (int i = 0; i < HS / 2; ++i) {
      const int c = half * (HS / 2) + staggered(i, r, half, HS / 2);
      out_row[c] = bf16(o[r * HS + c] * inverse);
    }
    if (half == 0) a.lse[at.bh * T + t] = m + logf(l);
  }
}

//! delta[b, h, t] = sum_c dout[b, t, h hs + c] out[b, t, h hs + c] in float: one warp per row of
//! [B, NH, T] (`rows` of them), `warps` rows per block.
LOOM_FLASH_BODY
template <int HS, class Thread>
LOOM_HD void delta_block(Thread& th, const bf16* out, const bf16* dout, float* delta, const Shape& sh,
                         std::int64_t rows) {
  const int warp = th.thread() / 32, lane = th.thread() % 32;
  const std::int64_t row = th.block_x() * warps + warp;  // (b NH + h) T + t
  const bool valid = row < rows;
  const std::int64_t T = sh.tokens, bh = valid ? row / T : 0, t = valid ? row % T : 0;
  const std::int64_t b = bh / sh.heads, h = bh % sh.heads;
  const std::int64_t offset = (b * T + t) * sh.channels + h * HS;
  float sum = 0.0f;
  if (valid)
    for (int c = lane; c < HS; c += 32) sum += static_cast<float>(dout[offset + c]) * static_cast<float>(out[offset + c]);
  for (int mask = 16; mask > 0; mask /= 2) sum += th.shuffle_xor(sum, mask);  // every lane takes part
  if (valid && lane == 0) delta[row] = sum;
}

//! The gradient of 64 keys of one (batch, head): dk and dv of rows kt 64 .. kt 64 + 63 (kt =
//! blockIdx.y: the first key tiles see the most queries). Shared memory: BackwardSmem<HS>.
LOOM_FLASH_BODY
template <int HS, class Thread>
LOOM_HD void key_value_grad_block(Thread& th, const BackwardArgs& a) {
  using Smem = BackwardSmem<HS>;
  const Shape& sh = a.shape;
  const auto [T, C, ld, at, warp, lane, r, half] = position(th, sh);
  const std::int64_t kt = th.block_y(), tiles_t = tiles(T);

  unsigned char* smem = th.shared();
  bf16* k = region<bf16>(smem, Smem::tile_a);
  bf16* v = region<bf16>(smem, Smem::tile_b);
  bf16* q = region<bf16>(smem, Smem::tile_c);
  bf16* g = region<bf16>(smem, Smem::tile_d);  // dout
  float* lse = region<float>(smem, Smem::lse);
  float* delta = region<float>(smem, Smem::delta);
  float* st = region<float>(smem, Smem::floats) + warp * Smem::warp_floats;
  float* dpt = st + warp_rows * tile;
  bf16* pt = region<bf16>(smem, Smem::p) + warp * warp_rows * tile;
  bf16* dst = region<bf16>(smem, Smem::ds) + warp * warp_rows * tile;

  const bf16* qkv_bh = a.qkv + at.b * T * ld + at.h * HS;
  const bf16* dout_bh = a.dout + at.b * T * C + at.h * HS;
  load_tile<HS>(th, k, qkv_bh + C, ld, kt * tile, T);
  load_tile<HS>(th, v, qkv_bh + 2 * C, ld, kt * tile, T);

  typename Thread::Acc dk[HS / mma_edge], dv[HS / mma_edge];
  for (int n = 0; n < HS / mma_edge; ++n) {
    th.zero(dk[n]);
    th.zero(dv[n]);
  }
  const std::int64_t key = kt * tile + warp * warp_rows + r;  // this lane's key
  for (std::int64_t qt = kt; qt < tiles_t; ++qt) {
    th.sync_block();  // the previous tile's q, dout, lse and delta are no longer read
    load_tile<HS>(th, q, qkv_bh, ld, qt * tile, T);
    load_tile<HS>(th, g, dout_bh, C, qt * tile, T);
    load_rows(th, lse, a.lse + at.bh * T, qt * tile, T);
    load_rows(th, delta, a.delta + at.bh * T, qt * tile, T);
    th.sync_block();
    product_abt<HS>(th, st, k + warp * warp_rows * HS, q);   // S^T: [16 keys, 64 queries]
    product_abt<HS>(th, dpt, v + warp * warp_rows * HS, g);  // dP^T = V dO^T
    th.sync_warp();
    for (int i = 0; i < 32; ++i) {
      const int c = half * 32 + staggered(i, r, half, 32);
      const std::int64_t query = qt * tile + c;
      const bool valid = query < T && key <= query;
      const float e = valid ? expf(fmaf(st[r * tile + c], sh.scale, -lse[c])) : 0.0f;
      pt[r * tile + c] = bf16(e);
      dst[r * tile + c] = bf16(valid ? e * (dpt[r * tile + c] - delta[c]) * sh.scale : 0.0f);
    }
    th.sync_warp();
    accumulate_ab<HS>(th, dv, pt, g);   // dV += P^T dO
    accumulate_ab<HS>(th, dk, dst, q);  // dK += dS^T Q
  }
  const std::int64_t first = kt * tile + warp * warp_rows;
  bf16* dqkv_bh = a.dqkv + at.b * T * ld + at.h * HS;
  add_rows<HS>(th, dqkv_bh + C, ld, dk, st, first, T);  // staged in st and dpt
  th.sync_warp();
  add_rows<HS>(th, dqkv_bh + 2 * C, ld, dv, st, first, T);
}

//! The gradient of 64 queries of one (batch, head): dq of rows qt 64 .. qt 64 + 63. Shared
//! memory: BackwardSmem<HS>.
LOOM_FLASH_BODY
template <int HS, class Thread>
LOOM_HD void query_grad_block(Thread& th, const BackwardArgs& a) {
  using Smem = BackwardSmem<HS>;
  const Shape& sh = a.shape;
  const auto [T, C, ld, at, warp, lane, r, half] = position(th, sh);
  const std::int64_t qt = longest_first(T, th.block_y());

  unsigned char* smem = th.shared();
  bf16* q = region<bf16>(smem, Smem::tile_a);
  bf16* g = region<bf16>(smem, Smem::tile_b);  // dout
  bf16* k = region<bf16>(smem, Smem::tile_c);
  bf16* v = region<bf16>(smem, Smem::tile_d);
  float* lse = region<float>(smem, Smem::lse);
  float* delta = region<float>(smem, Smem::delta);
  float* s = region<float>(smem, Smem::floats) + warp * Smem::warp_floats;
  float* dp = s + warp_rows * tile;
  bf16* ds = region<bf16>(smem, Smem::ds) + warp * warp_rows * tile;

  const bf16* qkv_bh = a.qkv + at.b * T * ld + at.h * HS;
  load_tile<HS>(th, q, qkv_bh, ld, qt * tile, T);
  load_tile<HS>(th, g, a.dout + at.b * T * C + at.h * HS, C, qt * tile, T);
  load_rows(th, lse, a.lse + at.bh * T, qt * tile, T);
  load_rows(th, delta, a.delta + at.bh * T, qt * tile, T);

  typename Thread::Acc dq[HS / mma_edge];
  for (int n = 0; n < HS / mma_edge; ++n) th.zero(dq[n]);
  const int row = warp * warp_rows + r;  // this lane's row of the tile
  const std::int64_t t = qt * tile + row;
  for (std::int64_t kt = 0; kt <= qt; ++kt) {
    th.sync_block();  // the previous tile's k and v are no longer read
    load_tile<HS>(th, k, qkv_bh + C, ld, kt * tile, T);
    load_tile<HS>(th, v, qkv_bh + 2 * C, ld, kt * tile, T);
    th.sync_block();
    product_abt<HS>(th, s, q + warp * warp_rows * HS, k);   // S
    product_abt<HS>(th, dp, g + warp * warp_rows * HS, v);  // dP = dO V^T
    th.sync_warp();
    for (int i = 0; i < 32; ++i) {
      const int c = half * 32 + staggered(i, r, half, 32);
      const bool valid = t < T && kt * tile + c <= t;
      const float e = valid ? expf(fmaf(s[r * tile + c], sh.scale, -lse[row])) : 0.0f;
      ds[r * tile + c] = bf16(valid ? e * (dp[r * tile + c] - delta[row]) * sh.scale : 0.0f);
    }
    th.sync_warp();
    accumulate_ab<HS>(th, dq, ds, k);  // dQ += dS K
  }
  add_rows<HS>(th, a.dqkv + at.b * T * ld + at.h * HS, ld, dq, s, qt * tile + warp * warp_rows, T);
}

// ---------------------------------------------------------------------------------------------
// The GPU's Thread and the kernels. bf16 WMMA needs sm_80 or newer: compiled for an older
// architecture the kernels are empty, and the host never launches them there (built_for).

#if defined(__CUDACC__)

//! The architecture (major * 10 + minor) the kernels need.
inline constexpr int minimum_architecture = 80;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LOOM_FLASH_DEVICE 1

//! A CUDA thread of a one-dimensional block of `threads`: WMMA m16n16k16 tiles, bf16 in, float
//! accumulators; the dynamic shared memory of the launch.
struct DeviceThread {
  using Acc = nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float>;
  using RowA = nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major>;
  using RowB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::row_major>;
  using ColB = nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __nv_bfloat16, nvcuda::wmma::col_major>;

  __device__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ std::int64_t block_x() const { return blockIdx.x; }
  __device__ std::int64_t block_y() const { return blockIdx.y; }
  __device__ unsigned char* shared() const {
    extern __shared__ __align__(128) unsigned char flash_shared[];
    return flash_shared;
  }
  __device__ void sync_block() const { __syncthreads(); }
  __device__ void sync_warp() const { __syncwarp(); }
  //! The value of the lane whose index differs in bit 0 (the other lane of this lane's row).
  __device__ float swap_pair(float value) const { return __shfl_xor_sync(0xffffffffu, value, 1); }
  __device__ float shuffle_xor(float value, int mask) const { return __shfl_xor_sync(0xffffffffu, value, mask); }

  static __device__ const __nv_bfloat16* raw(const bf16* p) { return reinterpret_cast<const __nv_bfloat16*>(p); }
  static __device__ void zero(Acc& c) { nvcuda::wmma::fill_fragment(c, 0.0f); }
  static __device__ void load(RowA& f, const bf16* p, unsigned ld) { nvcuda::wmma::load_matrix_sync(f, raw(p), ld); }
  static __device__ void load(RowB& f, const bf16* p, unsigned ld) { nvcuda::wmma::load_matrix_sync(f, raw(p), ld); }
  static __device__ void load(ColB& f, const bf16* p, unsigned ld) { nvcuda::wmma::load_matrix_sync(f, raw(p), ld); }
  static __device__ void load(Acc& f, const float* p, unsigned ld) {
    nvcuda::wmma::load_matrix_sync(f, p, ld, nvcuda::wmma::mem_row_major);
  }
  template <class B>
  static __device__ void mma(Acc& c, const RowA& a, const B& b) {
    nvcuda::wmma::mma_sync(c, a, b, c);
  }
  static __device__ void store(float* p, const Acc& c, unsigned ld) {
    nvcuda::wmma::store_matrix_sync(p, c, ld, nvcuda::wmma::mem_row_major);
  }
};

#endif  // __CUDA_ARCH__ >= 800

static_assert(sizeof(bf16) == sizeof(__nv_bfloat16), "loom::bf16 and __nv_bfloat16 share their bits");

// Each kernel runs its body where the architecture has bf16 WMMA, and is empty elsewhere.
#if defined(LOOM_FLASH_DEVICE)
#define LOOM_FLASH_RUN(...) \
  DeviceThread th;          \
  __VA_ARGS__;
#else
#define LOOM_FLASH_RUN(...)
#endif

template <int HS>
__global__ void __launch_bounds__(threads) forward_kernel(ForwardArgs a) {
  LOOM_FLASH_RUN(forward_block<HS>(th, a))
}
template <int HS>
__global__ void __launch_bounds__(threads) delta_kernel(const bf16* out, const bf16* dout, float* delta, Shape sh,
                                                       std::int64_t rows) {
  LOOM_FLASH_RUN(delta_block<HS>(th, out, dout, delta, sh, rows))
}
template <int HS>
__global__ void __launch_bounds__(threads) key_value_grad_kernel(BackwardArgs a) {
  LOOM_FLASH_RUN(key_value_grad_block<HS>(th, a))
}
template <int HS>
__global__ void __launch_bounds__(threads) query_grad_kernel(BackwardArgs a) {
  LOOM_FLASH_RUN(query_grad_block<HS>(th, a))
}

#undef LOOM_FLASH_RUN
#undef LOOM_FLASH_DEVICE

#endif  // __CUDACC__

}  // namespace loom::detail::flash

#undef LOOM_FLASH_BODY
