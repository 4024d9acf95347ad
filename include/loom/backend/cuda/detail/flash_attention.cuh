#pragma once
//! \file SRAM-tiled self-attention with the log-sum-exp contract, causal or bidirectional
//! (loom::AttentionMask, in Shape), for bf16 data with float accumulation on tensor cores: the
//! algorithm of FlashAttention-2 (Dao, "FlashAttention-2: Faster Attention with Better Parallelism
//! and Work Partitioning", 2023) with its scores, probabilities and accumulators held in registers
//! as mma.sync m16n8k16 fragments, and with the backward split into two kernels so that no
//! gradient element is written by two blocks (FlashAttention-2 adds dQ with atomics, whose order
//! changes the bits from run to run).
//!
//! - forward: a block owns 64 query rows of one (batch, head), each of its 4 warps 16 of them;
//!   it walks the key tiles 0..its own (causal) or all of them (bidirectional), keeping each row's
//!   running max m and sum l (the online softmax) and the unnormalised output in registers, and
//!   writes out and lse = m + log l at the end. Nothing T x T exists anywhere.
//! - backward, with D = rowsum(dout * out) per query row (delta_kernel), from lse and D copied into
//!   shared memory a tile at a time:
//!   - key_value_grad: a block owns 64 keys (a warp 16); it walks the query tiles from its own
//!     (causal; from 0, bidirectional) to the last, each in two halves of 32 queries (fewer
//!     registers), recomputing S^T = K Q^T, P^T = exp(S^T scale - lse), dP^T = V dO^T and
//!     dS^T = P^T (dP^T - D), and accumulates dV += P^T dO and dK += dS^T Q in registers (dK
//!     times the scale at the end);
//!   - query_grad: a block owns 64 queries (a warp 16); it walks the key tiles 0..its own
//!     (causal) or all of them (bidirectional), recomputing S, P, dP and dS the same way, and
//!     accumulates dQ += dS K (times the scale at the end).
//!   The score work is done twice (once per kernel), the price of a fixed summation order.
//! - Each kernel takes M, the 16-row blocks a warp owns (above, M = 1; row_blocks says which the
//!   library launches): with M = 2 a block owns 128 rows, and each B fragment a warp reads from
//!   shared memory serves M products (FlashAttention-2's forward layout: 4 warps of 32 rows), at
//!   the price of M times the fragments in registers. The key_value_grad kernel then walks a query
//!   tile in quarters and query_grad a key tile in halves, so that the scores still fit, and a
//!   warp skips a step where the mask hides it from all its rows. Every row meets the same tiles
//!   in the same order whatever M is: M changes no value.
//!
//! Attention dropout (the *_dropout_kernel builds) draws loom::AttentionDropout's mask in
//! registers, for the score fragments each warp holds: the forward multiplies V by the dropped
//! probabilities and keeps the softmax's lse; the backward kernels draw the same mask again for
//! dV and dP. Nothing of the mask is stored (the keep bits, below).
//!
//! The mask enters in two places only: which tiles a block walks (query_tile, key_tiles,
//! first_query_tile) and, per row of the warp, which keys or queries count (the last key a query
//! sees, t or T - 1; the first query a key meets, the key or 0), computed once before the walk;
//! the loops themselves are the same for both masks. A tile (or step) that every row of the warp
//! sees whole skips the masking; the others set their masked scores to -inf first. A padded
//! sequence (Shape::lengths) enters the same way, as if it were `length` tokens long: blocks of
//! padded keys or queries only do nothing, and a padded query's out and lse are written 0.
//! Causal blocks walk 1 to tiles(T) tiles, the longest first; bidirectional blocks all walk
//! tiles(T), about twice a causal layer's work.
//!
//! Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"): lane
//! l = 4 group + pair holds, of a 16 x 16 A block, rows group and group + 8 at columns 2 pair,
//! 2 pair + 1 and those + 8; of a 16 x 8 B block, column group at rows 2 pair, 2 pair + 1 and
//! those + 8; of a 16 x 8 C block, rows group and group + 8 at columns 2 pair, 2 pair + 1. So
//! the C fragments of two adjacent 16 x 8 score blocks are, rounded to bf16, the A fragment of
//! the 16 x 16 probability block that multiplies V: the probabilities never leave registers.
//! Every tile sits in shared memory as it is in global memory, [64 tokens, HS], rows padded by 8
//! bf16 so that the 8 rows x 4 words a fragment load reads fall in 32 different banks. B is read
//! through ldmatrix, two fragments per instruction: as [n][k] rows for the scores (K and Q as
//! they are) and transposed (ldmatrix.trans) for the products over keys or queries (V, dO, Q and
//! K), so no tile is stored transposed.
//!
//! The tiles a block walks are double-buffered: while the warps compute on tile i, the copies of
//! tile i + 1 (cp.async, 16 bytes each, zero-filled past T) are in flight into the other buffer,
//! so the global loads overlap the tensor-core work; one barrier per tile.
//!
//! The bodies also take a tile layout, PaddedTiles (the above: ldmatrix and mma.sync, sm_80 and
//! newer) or GroupTiles (head size 64, sm_90a: the block's 4 warps multiply together as one
//! warpgroup with wgmma, B read from 128-byte-swizzled tiles in shared memory once for the 4 warps;
//! the accumulators are laid out as mma.sync's C fragments, so nothing else changes).
//!
//! The kernel bodies are templates over a `Thread` type that supplies the thread and block
//! indices, the block barrier, the lane exchange, the asynchronous copies, ldmatrix.trans and
//! the mma: on the GPU it is DeviceThread (threadIdx, __syncthreads, __shfl_xor_sync, cp.async,
//! ldmatrix, mma.sync); the tests run the same bodies on the host with every thread of a block
//! as a fiber on the host, the copies done at once, and ldmatrix and the mma computed from the lanes'
//! addresses and fragments by their PTX layouts, so the tiling, masking, fragment indexing and
//! barriers are checked where there is no GPU. Tile rows past T are loaded as zeros and masked,
//! so any T works.

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#endif

#include "loom/backend/attention_mask.hpp"
#include "loom/backend/cuda/detail/block_body.hpp"
#include "loom/core/bf16.hpp"
#include "loom/core/dropout.hpp"
#include "loom/core/hd.hpp"

namespace loom::detail::flash {

//! Query rows and key columns of a tile.
inline constexpr int tile = 64;
//! Warps of a block, each owning 16 rows of the block's tile.
inline constexpr int warps = 4;
inline constexpr int threads = 32 * warps;
inline constexpr int warp_rows = tile / warps;  // 16: one mma block high
static_assert(warp_rows == 16, "each warp owns the 16 rows of one m16n8k16 block");
//! 8-column blocks of a tile's 64 columns (the n of m16n8k16).
inline constexpr int tile_blocks = tile / 8;

//! The head sizes the kernels are built for (the rest use the cuBLAS path).
inline constexpr bool supported_head_size(std::int64_t hs) noexcept { return hs == 32 || hs == 64 || hs == 128; }

//! Tiles covering `tokens` rows.
LOOM_HD constexpr std::int64_t tiles(std::int64_t tokens) noexcept { return (tokens + tile - 1) / tile; }

//! Token `token`'s column in the tile that starts at token `first`, clamped to [lo, hi]: the
//! per-element masks then compare 32-bit column numbers, not 64-bit tokens (fewer registers).
LOOM_HD constexpr int tile_column(std::int64_t token, std::int64_t first, int lo, int hi) noexcept {
  const std::int64_t column = token - first;
  return static_cast<int>(column < lo ? lo : column > hi ? hi : column);
}

//! The shapes every kernel reads, the mask and the sequences' lengths. qkv [B,T,3C] (q, k, v of
//! head h at columns h hs, C + h hs, 2C + h hs), out and dout [B,T,C], lse and delta [B,NH,T].
struct Shape {
  std::int64_t tokens, channels;
  int heads;
  float scale;  //!< 1/sqrt(hs)
  AttentionMask mask = AttentionMask::causal;
  //! [B] tokens of each sequence, each in [1, T] (device memory on the GPU), or null: all T. Keys
  //! at or past a sequence's length are masked; a padded query sees nothing: its out and lse are
  //! 0 and it gives no gradient (the CPU kernels' contract).
  const std::int32_t* lengths = nullptr;
  LOOM_HD bool causal() const noexcept { return mask == AttentionMask::causal; }
  //! The real tokens of batch element b.
  LOOM_HD std::int64_t length(std::int64_t b) const noexcept { return lengths != nullptr ? lengths[b] : tokens; }
};

//! Forward: reads qkv, writes out and lse.
struct ForwardArgs {
  Shape shape;
  const bf16* qkv;
  bf16* out;
  float* lse;
};

//! Backward: reads qkv, dout, lse and delta; adds into dqkv (`accumulate`), or writes it (0 at
//! padded positions) without reading it.
struct BackwardArgs {
  Shape shape;
  const bf16* qkv;
  const bf16* dout;
  const float* lse;
  const float* delta;
  bf16* dqkv;
  bool accumulate = true;
};

//! Where a block works: batch element b, head h (blockIdx.x = b NH + h).
struct Place {
  std::int64_t b, h, bh;
};
LOOM_HD inline Place place(std::int64_t block_x, int heads) noexcept {
  return {block_x / heads, block_x % heads, block_x};
}

// ---------------------------------------------------------------------------------------------
// Shared memory: byte offsets of each kernel's regions (each a multiple of 16 bytes, so that
// tile rows take 16-byte stores).

//! Bytes of a [rows, cols] block of `E`.
template <class E>
LOOM_HD constexpr std::size_t bytes(int rows, int cols) noexcept {
  return static_cast<std::size_t>(rows) * static_cast<std::size_t>(cols) * sizeof(E);
}

//! bf16 of padding after each shared tile row: a row of HS + 8 (HS = 32, 64, 128: 20, 36 or 68
//! words) starts 20 or 4 banks after the previous one, so a fragment load's 8 rows x 4
//! consecutive words, and an ldmatrix's 8 rows of 16 bytes, land in 32 different banks.
inline constexpr int pad = 8;
//! The row stride of a [64, HS] tile (rows are tokens) in the padded layout (PaddedTiles).
template <int HS>
inline constexpr int row_ld = HS + pad;

struct PaddedTiles;
struct GroupTiles;

//! Bytes of one [64, HS] tile in the layout of `Tiles` (PaddedTiles or GroupTiles, below).
template <int HS, class Tiles = PaddedTiles>
inline constexpr std::size_t tile_bytes = bytes<bf16>(tile, Tiles::template row_ld<HS>);

//! The forward's shared memory: two buffers of the key and value tiles. `total` includes the
//! slack the layout needs to align its first tile (Tiles::base).
template <int HS, class Tiles = PaddedTiles>
struct ForwardSmem {
  static constexpr std::size_t k = 0;  //!< k[buffer] at k + buffer tile_bytes
  static constexpr std::size_t v = k + 2 * tile_bytes<HS, Tiles>;
  static constexpr std::size_t total = v + 2 * tile_bytes<HS, Tiles> + Tiles::slack;
};

//! key_value_grad's shared memory: two buffers of the query and dout tiles and of the tile's lse
//! (times log2 e) and delta.
template <int HS, class Tiles = PaddedTiles>
struct KeyValueGradSmem {
  static constexpr std::size_t q = 0;
  static constexpr std::size_t dout = q + 2 * tile_bytes<HS, Tiles>;
  static constexpr std::size_t lse = dout + 2 * tile_bytes<HS, Tiles>;  //!< lse[buffer] at lse + buffer 64 floats
  static constexpr std::size_t delta = lse + 2 * bytes<float>(1, tile);
  static constexpr std::size_t total = delta + 2 * bytes<float>(1, tile) + Tiles::slack;
};

//! query_grad's shared memory: two buffers of the key and value tiles.
template <int HS, class Tiles = PaddedTiles>
struct QueryGradSmem {
  static constexpr std::size_t k = 0;
  static constexpr std::size_t v = k + 2 * tile_bytes<HS, Tiles>;
  static constexpr std::size_t total = v + 2 * tile_bytes<HS, Tiles> + Tiles::slack;
};

//! The region at byte `offset` of shared memory `base`, as E*.
template <class E>
LOOM_HD inline E* region(unsigned char* base, std::size_t offset) noexcept {
  return reinterpret_cast<E*>(base + offset);
}

// ---------------------------------------------------------------------------------------------
// Tiles from global into shared memory.

//! bf16 per 16-byte asynchronous copy.
inline constexpr int pack = 16 / sizeof(bf16);

//! Starts copying rows [first, first + 64) of a [T, ld]-strided matrix's HS columns at `src` into
//! the [64, HS] tile `rows`, element (r, c) at rows[Tiles::at<HS>(r, c)]; zeros for rows >= T.
//! All threads of the block take part, consecutive threads along a row. Where `src` is 16-byte
//! aligned and ld a multiple of 8, each thread starts asynchronous 16-byte copies (they land by
//! the caller's wait_copies); elsewhere it stores element by element at once.
//!
//! A thread copies the same 8 columns of rows r, r + rows_per_pass, ...: one address advanced by
//! a fixed step, so that the compiler keeps no per-copy address live across the caller's loop
//! over tiles (it did: 76 more registers in key_value_grad). Where a layout moves a row's
//! 16-byte chunks (GroupTiles), the rows of a thread are rows_per_pass apart, a multiple of the
//! 8 rows over which the chunks move, so its chunk lands at the same place in each of them.
LOOM_BLOCK_BODY
template <int HS, class Tiles, class Thread>
LOOM_HD inline void start_tile(Thread& th, bf16* rows, const bf16* src, std::int64_t ld, std::int64_t first,
                               std::int64_t tokens) {
  constexpr int row_ld = Tiles::template row_ld<HS>;
  const int real_rows = tile_column(tokens, first, 0, tile);
  if (reinterpret_cast<std::uintptr_t>(src) % 16 == 0 && ld % pack == 0) {
    constexpr int packs = HS / pack;                // per row
    constexpr int rows_per_pass = threads / packs;  // HS 64: 16
    static_assert(threads % packs == 0 && tile % rows_per_pass == 0, "every pass copies whole rows");
    static_assert(rows_per_pass % 8 == 0, "a thread's rows are a multiple of 8 apart (GroupTiles' chunks repeat)");
    const int r = th.thread() / packs, c = th.thread() % packs * pack;
    const bf16* from = src + (first + r) * ld + c;
    bf16* to = rows + Tiles::template at<HS>(r, c);
    LOOM_UNROLL
    for (int pass = 0; pass < tile / rows_per_pass; ++pass) {
      const bool real = r + pass * rows_per_pass < real_rows;
      th.copy_async(to + pass * rows_per_pass * row_ld, real ? from : src, real ? 16 : 0);
      from += rows_per_pass * ld;
    }
    return;
  }
  for (int e = th.thread(); e < tile * HS; e += threads) {
    const int r = e / HS, c = e % HS;
    rows[Tiles::template at<HS>(r, c)] = r < real_rows ? src[(first + r) * ld + c] : bf16(0.0f);
  }
}

//! Starts copying rows [first, first + 64) of two [T, ld]-strided matrices (HS columns each) into
//! the tiles `a` and `b` (start_tile), as one group of copies.
LOOM_BLOCK_BODY
template <int HS, class Tiles, class Thread>
LOOM_HD inline void start_tiles(Thread& th, bf16* a, const bf16* a_src, std::int64_t a_ld, bf16* b, const bf16* b_src,
                                std::int64_t b_ld, std::int64_t first, std::int64_t tokens) {
  start_tile<HS, Tiles>(th, a, a_src, a_ld, first, tokens);
  start_tile<HS, Tiles>(th, b, b_src, b_ld, first, tokens);
  th.commit_copies();
}

//! Starts copying dst[r] = src[first + r] for the 64 rows of a tile, 0 for rows >= T, by the 16
//! threads `lead`..`lead + 15`, 4 floats each, where src + first is 16-byte aligned (T a multiple
//! of 4; the caller commits the copies); elsewhere those threads store at once. Asynchronous,
//! because a shared store of a plain load waits for it: each thread would stall for a global
//! load's latency at every tile.
LOOM_BLOCK_BODY
template <class Thread>
LOOM_HD inline void start_rows(Thread& th, float* dst, const float* src, std::int64_t first, std::int64_t tokens,
                               int lead) {
  constexpr int per_copy = 16 / sizeof(float);
  const int part = th.thread() - lead;
  if (part < 0 || part >= tile / per_copy) return;
  const int r = part * per_copy, real = tile_column(tokens, first + r, 0, per_copy);
  if (reinterpret_cast<std::uintptr_t>(src + first) % 16 == 0) {
    th.copy_async(dst + r, real > 0 ? src + first + r : src, real * static_cast<int>(sizeof(float)));
    return;
  }
  for (int e = 0; e < per_copy; ++e) dst[r + e] = e < real ? src[first + r + e] : 0.0f;
}

// ---------------------------------------------------------------------------------------------
// Fragments.

//! A lane's place in the m16n8k16 fragments: lane = 4 group + pair.
struct Lane {
  int group, pair;
};

//! An A fragment (8 bf16 in 4 words), a B fragment (4 bf16 in 2 words), a C fragment (4 floats).
using FragmentA = std::uint32_t[4];
using FragmentB = std::uint32_t[2];
using FragmentC = float[4];

//! Two bf16 as one fragment word, `lo` (the lower row or column index) in bits 0-15; each value
//! rounded to nearest even.
LOOM_HD inline std::uint32_t pack_pair(float lo, float hi) noexcept {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const __nv_bfloat162 both = __floats2bfloat162_rn(lo, hi);  // .x = lo, in the low half
  std::uint32_t word;
  std::memcpy(&word, &both, sizeof word);
  return word;
#else
  return static_cast<std::uint32_t>(bf16(lo).bits) | static_cast<std::uint32_t>(bf16(hi).bits) << 16;
#endif
}

//! The two bf16 at `p` (no alignment assumed: global memory) as one fragment word.
LOOM_HD inline std::uint32_t load_pair(const bf16* p) noexcept {
  return static_cast<std::uint32_t>(p[0].bits) | static_cast<std::uint32_t>(p[1].bits) << 16;
}

//! The A fragment of the 16 x 16 block at rows first.. and columns k0.. of the row-major matrix
//! `m` (row stride ld, in global memory); rows >= `tokens` are zeros.
LOOM_HD inline void load_a(FragmentA& a, const bf16* m, std::int64_t ld, std::int64_t first, std::int64_t tokens,
                           int k0, Lane ln) {
  LOOM_UNROLL
  for (int i = 0; i < 2; ++i) {  // rows group, group + 8
    const std::int64_t row = first + ln.group + 8 * i;
    const bf16* p = m + row * ld + k0 + 2 * ln.pair;
    a[i] = row < tokens ? load_pair(p) : 0u;
    a[i + 2] = row < tokens ? load_pair(p + 8) : 0u;
  }
}

//! The A fragments of the M 16-row blocks starting at row `first` of `m` (load_a), over HS columns.
template <int HS, int M>
LOOM_HD inline void load_rows_a(FragmentA (&a)[M][HS / 16], const bf16* m, std::int64_t ld, std::int64_t first,
                                std::int64_t tokens, Lane ln) {
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int kk = 0; kk < HS / 16; ++kk) load_a(a[r][kk], m, ld, first + warp_rows * r, tokens, 16 * kk, ln);
  }
}

//! The A fragment of a 16 x 16 block from the C fragments of its left and right 16 x 8 halves,
//! each value rounded to bf16 (the layouts line up; see the file comment).
LOOM_HD inline void to_a(FragmentA& a, const FragmentC& left, const FragmentC& right) noexcept {
  a[0] = pack_pair(left[0], left[1]);
  a[1] = pack_pair(left[2], left[3]);
  a[2] = pack_pair(right[0], right[1]);
  a[3] = pack_pair(right[2], right[3]);
}

//! dst[row, 8 n + c] += acc[r][n] for the warp's M blocks of 16 rows starting at token `first`
//! (block r at first + 16 r; rows >= `tokens` skipped), each sum rounded to bf16 once; or, where
//! !accumulate, dst = acc without reading dst (the padding past `tokens` is zero_padding_block's).
template <int M, int N>
LOOM_HD inline void add_rows(bf16* dst, std::int64_t ld, const FragmentC (&acc)[M][N], std::int64_t first,
                             std::int64_t tokens, bool accumulate, Lane ln) {
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int i = 0; i < 2; ++i) {
      const std::int64_t row = first + warp_rows * r + ln.group + 8 * i;
      if (row >= tokens) continue;
      bf16* d = dst + row * ld + 2 * ln.pair;
      LOOM_UNROLL
      for (int n = 0; n < N; ++n) {
        LOOM_UNROLL
        for (int c = 0; c < 2; ++c) {
          const float value = acc[r][n][2 * i + c];
          d[8 * n + c] = bf16(accumulate ? static_cast<float>(d[8 * n + c]) + value : value);
        }
      }
    }
  }
}

//! acc[r][j] += the [16, 8 N] product a[r] b^T for each of the warp's M row blocks: a[r] the A
//! fragments of 16 rows over HS columns, `b` the first of 8 N rows of a [64, HS] tile in shared
//! memory (stride row_ld<HS>); acc[r][j] holds columns 8 j .. 8 j + 7. The B fragments
//! (B(k, n) = b[n row_ld + k]) come two at a time from ldmatrix, each used by the M blocks (the
//! shared-memory reads per mma fall as 1 / M): lane l gives the address of row l % 8 + 8 (l / 16)
//! (of the 16 n) at column 8 (l / 8 % 2) (of the 16 k). Each acc element sums over k in the
//! same order whatever M is.
LOOM_BLOCK_BODY
template <int HS, int M, int N, class Thread>
LOOM_HD inline void product_abt(Thread& th, FragmentC (&acc)[M][N], const FragmentA (&a)[M][HS / 16], const bf16* b,
                                Lane ln) {
  static_assert(N % 2 == 0, "ldmatrix.x4 gives the B fragments of 16 rows");
  const int lane = 4 * ln.group + ln.pair;
  const bf16* lane_row = b + (lane % 8 + 8 * (lane / 16)) * row_ld<HS> + 8 * (lane / 8 % 2);
  LOOM_UNROLL
  for (int j = 0; j < N; j += 2) {
    LOOM_UNROLL
    for (int kk = 0; kk < HS / 16; ++kk) {
      FragmentB fb[2];
      th.load_b_rows(fb, lane_row + 8 * j * row_ld<HS> + 16 * kk);
      LOOM_UNROLL
      for (int r = 0; r < M; ++r) {
        th.mma(acc[r][j], a[r][kk], fb[0]);
        th.mma(acc[r][j + 1], a[r][kk], fb[1]);
      }
    }
  }
}

//! acc[r][n] += (a[r] b)[:, 8 n ..] for each of the warp's M row blocks, over the 8 K columns of
//! a[r] (C fragments of [16, 8 K], rounded to bf16 here) and 8 K rows of a [64, HS] tile from `b`
//! on (B(k, n) = b[k row_ld<HS> + n], stride row_ld<HS>), whose B fragments come two at a time
//! from ldmatrix.trans, each used by the M blocks: lane l gives the address of row 16 kk + l % 16
//! at column 16 n2 + 8 (l / 16), the rows of the four 8 x 8 matrices in order.
LOOM_BLOCK_BODY
template <int HS, int M, int K, class Thread>
LOOM_HD inline void accumulate_ab(Thread& th, FragmentC (&acc)[M][HS / 8], const FragmentC (&a)[M][K], const bf16* b,
                                  Lane ln) {
  static_assert(K % 2 == 0, "an A fragment is 16 columns of a");
  const int lane = 4 * ln.group + ln.pair;
  const bf16* lane_row = b + (lane % 16) * row_ld<HS> + 8 * (lane / 16);
  LOOM_UNROLL
  for (int kk = 0; kk < K / 2; ++kk) {
    FragmentA fa[M];
    LOOM_UNROLL
    for (int r = 0; r < M; ++r) to_a(fa[r], a[r][2 * kk], a[r][2 * kk + 1]);
    LOOM_UNROLL
    for (int n2 = 0; n2 < HS / 16; ++n2) {
      FragmentB fb[2];
      th.load_b_transposed(fb, lane_row + 16 * kk * row_ld<HS> + 16 * n2);
      LOOM_UNROLL
      for (int r = 0; r < M; ++r) {
        th.mma(acc[r][2 * n2], fa[r], fb[0]);
        th.mma(acc[r][2 * n2 + 1], fa[r], fb[1]);
      }
    }
  }
}

//! acc *= factor, element by element.
template <int M, int N>
LOOM_HD inline void scale_fragments(FragmentC (&acc)[M][N], float factor) noexcept {
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int n = 0; n < N; ++n) {
      LOOM_UNROLL
      for (int i = 0; i < 4; ++i) acc[r][n][i] *= factor;
    }
  }
}

//! Zeros of a register array of fragments.
template <int M, int N>
LOOM_HD inline void zero(FragmentC (&acc)[M][N]) noexcept {
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int n = 0; n < N; ++n) {
      LOOM_UNROLL
      for (int i = 0; i < 4; ++i) acc[r][n][i] = 0.0f;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tile layouts: where a tile's elements sit in shared memory and how the warps multiply by it.
// The kernel bodies take one as a template argument.

//! mma.sync (sm_80 and newer): each warp multiplies its own rows, its B fragments read through
//! ldmatrix (product_abt, accumulate_ab), so each of the 4 warps reads the whole B tile. Rows
//! padded by `pad` bf16 (bank conflicts; the file comment).
struct PaddedTiles {
  //! Whether the block's warps multiply together: then no warp may skip a product.
  static constexpr bool collective = false;
  //! Bytes of shared memory beyond the regions, to align the first one (base).
  static constexpr std::size_t slack = 0;
  template <int HS>
  static constexpr int row_ld = flash::row_ld<HS>;
  //! The element offset of (row r, column c) in a tile.
  template <int HS>
  LOOM_HD static constexpr int at(int r, int c) noexcept {
    return r * row_ld<HS> + c;
  }
  //! The block's shared memory, where the regions start.
  LOOM_BLOCK_BODY
  template <class Thread>
  LOOM_HD static unsigned char* base(const Thread& th) {
    return th.shared();
  }
  //! After this thread's copies have landed, before the barrier that publishes them.
  LOOM_BLOCK_BODY
  template <class Thread>
  LOOM_HD static void copies_landed(const Thread&) {}
  LOOM_BLOCK_BODY
  template <int HS, int M, int N, class Thread>
  LOOM_HD static void product_abt(Thread& th, FragmentC (&acc)[M][N], const FragmentA (&a)[M][HS / 16],
                                  const bf16* b, Lane ln) {
    flash::product_abt<HS>(th, acc, a, b, ln);
  }
  LOOM_BLOCK_BODY
  template <int HS, int M, int K, class Thread>
  LOOM_HD static void accumulate_ab(Thread& th, FragmentC (&acc)[M][HS / 8], const FragmentC (&a)[M][K],
                                    const bf16* b, Lane ln) {
    flash::accumulate_ab<HS>(th, acc, a, b, ln);
  }
};

//! The shared-memory matrix descriptor of wgmma (PTX ISA, "Matrix Descriptor Format") for a
//! matrix at shared address `address` in GroupTiles' layout: 128-byte swizzle (mode 1, bits
//! 62-63), the pattern starting at a 1024-byte boundary (base offset 0), and 1024 bytes (8 rows of
//! 128) from one 8-row group to the next. That step is the stride-dimension offset of a K-major
//! B (groups of 8 rows of n) and of an MN-major one (groups of 8 rows of k); the leading-dimension
//! offset is unused by both here (K-major swizzled: not read; MN-major: B is one 64-column atom
//! wide), and is given the same 1024. Addresses and offsets are in units of 16 bytes.
LOOM_HD constexpr std::uint64_t group_descriptor(std::uint32_t address) noexcept {
  constexpr std::uint64_t step = 1024 >> 4;
  return (address & 0x3FFFFu) >> 4 | step << 16 | step << 32 | std::uint64_t{1} << 62;
}

//! wgmma (sm_90a): the block's 4 warps are one warpgroup, which multiplies all 64 rows at once,
//! each warp giving its 16 rows' A fragments (the same registers, laid out as for mma.sync), with
//! B read by the tensor cores from shared memory once for the 4 warps, not by ldmatrix once a
//! warp. Accumulators are laid out as mma.sync's C fragments too (PTX ISA, "Matrix Fragments for
//! wgmma.mma_async.m64nNk16": warp w holds rows 16 w .. 16 w + 15), so the softmax, the masks,
//! the dropout bits and the output code are the same for both layouts.
//!
//! Tiles are stored unpadded (rows of HS = 64 bf16, 128 bytes) with the 16-byte chunk c of row r
//! at chunk c ^ (r % 8): wgmma's 128-byte swizzle (Swizzle<3,4,3>: address bits 4-6 XOR bits 7-9),
//! which also puts the 8 chunks of any column of 8 rows in different banks. The same tile serves
//! as a K-major B (scores: B(k, n) = row n, column k) and as an MN-major one (products over rows:
//! B(k, n) = row k, column n), so nothing is stored transposed.
struct GroupTiles {
  static constexpr bool collective = true;
  //! The swizzle pattern repeats every 1024 bytes and must start at a 1024-byte boundary.
  static constexpr std::size_t alignment = 1024;
  static constexpr std::size_t slack = alignment;
  template <int HS>
  static constexpr int row_ld = HS;
  template <int HS>
  LOOM_HD static constexpr int at(int r, int c) noexcept {
    static_assert(HS == 64, "GroupTiles' rows are the 128 bytes of the swizzle");
    return r * HS + ((c / pack) ^ (r % 8)) * pack + c % pack;
  }
  LOOM_BLOCK_BODY
  template <class Thread>
  LOOM_HD static unsigned char* base(const Thread& th) {
    unsigned char* shared = th.shared();
    const std::uint32_t address = th.shared_address(shared);
    return shared + ((alignment - address % alignment) % alignment);
  }
  //! cp.async writes through the generic proxy and wgmma reads through the async proxy: each
  //! thread's writes are made visible to the latter before the barrier.
  LOOM_BLOCK_BODY
  template <class Thread>
  LOOM_HD static void copies_landed(const Thread& th) {
    th.fence_async_shared();
  }
  //! acc += a b^T over the warpgroup's 64 rows: a the A fragments of the warp's 16 rows over HS
  //! columns, b the first of 8 N rows of a tile (a multiple of 8 rows into it), as a K-major B.
  //! One wgmma m64n(8N)k16 per 16 columns, advancing the descriptor 32 bytes along the rows.
  LOOM_BLOCK_BODY
  template <int HS, int M, int N, class Thread>
  LOOM_HD static void product_abt(Thread& th, FragmentC (&acc)[M][N], const FragmentA (&a)[M][HS / 16],
                                  const bf16* b, Lane) {
    static_assert(M == 1 && HS == 64, "a warpgroup multiplies 64 rows, a warp 16 of them");
    const std::uint32_t address = th.shared_address(b);
    th.group_begin(acc[0], a[0]);
    LOOM_UNROLL
    for (int kk = 0; kk < HS / 16; ++kk)
      th.template group_mma<false>(acc[0], a[0][kk], group_descriptor(address + 32 * kk));
    th.group_end(acc[0]);
  }
  //! acc += (a b) over the warpgroup's 64 rows: a the C fragments of [16, 8 K] (rounded to bf16
  //! here), b the first of 8 K rows of a tile, as an MN-major B (B(k, n) = row k, column n). One
  //! wgmma m64n(HS)k16 per 16 rows of b, advancing the descriptor 16 rows (2048 bytes).
  LOOM_BLOCK_BODY
  template <int HS, int M, int K, class Thread>
  LOOM_HD static void accumulate_ab(Thread& th, FragmentC (&acc)[M][HS / 8], const FragmentC (&a)[M][K],
                                    const bf16* b, Lane) {
    static_assert(M == 1 && HS == 64 && K % 2 == 0, "a warpgroup multiplies 64 rows by whole k16 steps");
    FragmentA fa[K / 2];  // written before group_begin's fence: wgmma reads them
    LOOM_UNROLL
    for (int kk = 0; kk < K / 2; ++kk) to_a(fa[kk], a[0][2 * kk], a[0][2 * kk + 1]);
    const std::uint32_t address = th.shared_address(b);
    constexpr std::uint32_t step_bytes = 16 * HS * sizeof(bf16);  // 16 rows
    th.group_begin(acc[0], fa);
    LOOM_UNROLL
    for (int kk = 0; kk < K / 2; ++kk)
      th.template group_mma<true>(acc[0], fa[kk], group_descriptor(address + step_bytes * kk));
    th.group_end(acc[0]);
  }
};

//! Calls f(x, y, r, i, col, bit) for each of the 4 M N elements of M [16, 8 N] blocks that the
//! lane holds in the fragments x and y (the same element of each): row group + 8 i of block r,
//! column col = 8 j + 2 pair + c, whose keep bit (dropout) is bit = 2 j + c: a compile-time
//! constant once unrolled (computed from col, it cost ptxas 12 more bytes of spill).
template <int M, int N, class F>
LOOM_HD inline void for_each_element(FragmentC (&x)[M][N], FragmentC (&y)[M][N], Lane ln, F&& f) {
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int j = 0; j < N; ++j) {
      LOOM_UNROLL
      for (int i = 0; i < 2; ++i) {
        LOOM_UNROLL
        for (int c = 0; c < 2; ++c) f(x[r][j][2 * i + c], y[r][j][2 * i + c], r, i, 8 * j + 2 * ln.pair + c, 2 * j + c);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention dropout: the mask of loom::AttentionDropout (the CPU kernels' and the dropout kernel's
// bits), element (t, s) of batch element b and head h being global element
// head_origin(b, h, T) + t T + s, kept where its 32-bit word of Philox block (element / 4) passes
// the threshold. Nothing is stored: the forward and both backward kernels draw the same words
// again. A lane's elements are described by keep bits: bit 2 j + c of keep[r][i] is the element
// at row group + 8 i of block r, column 8 j + 2 pair + c of the fragments (for_each_element
// passes the bit).
//
// Where T % 4 == 0 each Philox block is 4 elements of one fragment-layout group, drawn once by one
// lane and passed to the lanes that hold them by shuffles: one block per lane per 16 x 8 fragment,
// the least there can be. Elsewhere a lane draws the block of each of its elements (4 times the
// work; such T are rare).

//! The 4 keep bits of Philox block `block` of `mask` (bit w: its element 4 block + w).
LOOM_HD inline std::uint32_t keep_nibble(const DropoutMask& mask, std::uint64_t block) noexcept {
  const Philox4x32::Counter w = mask.block(block);
  return static_cast<std::uint32_t>(mask.keeps(w[0])) | static_cast<std::uint32_t>(mask.keeps(w[1])) << 1 |
         static_cast<std::uint32_t>(mask.keeps(w[2])) << 2 | static_cast<std::uint32_t>(mask.keeps(w[3])) << 3;
}

//! keep[r][i] for the lane's elements of M [16, 8 N] fragments whose row 0 is `first_row` and
//! column 0 `first_column`, fragment element (row, col) being global element origin + row
//! row_stride + col column_stride: each element from its own Philox block.
template <int M, int N>
LOOM_HD inline void keep_bits_each(std::uint32_t (&keep)[M][2], const DropoutMask& mask, std::uint64_t origin,
                                   std::int64_t row_stride, std::int64_t column_stride, std::int64_t first_row,
                                   std::int64_t first_column, Lane ln) noexcept {
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int i = 0; i < 2; ++i) {
      const std::int64_t row = first_row + warp_rows * r + ln.group + 8 * i;
      std::uint32_t bits = 0;
      LOOM_ROLLED
      for (int j = 0; j < N; ++j) {
        LOOM_ROLLED
        for (int c = 0; c < 2; ++c) {
          const std::int64_t col = first_column + 8 * j + 2 * ln.pair + c;
          const auto e = origin + static_cast<std::uint64_t>(row * row_stride + col * column_stride);
          bits |= static_cast<std::uint32_t>(mask.keep(e)) << (2 * j + c);
        }
      }
      keep[r][i] = bits;
    }
  }
}

//! keep[r][i] where the fragments' rows are the mask's rows (queries) and their columns its
//! columns (keys): element (row, col) of M [16, 8 N] fragments from query first_query and key
//! first_key (a multiple of 4) is global element origin + row T + col (the forward's and
//! query_grad's S). All 32 lanes of the warp take part.
//!
//! Where T % 4 == 0, the keys 8 j + 4 h .. + 3 of a row are one Philox block, held by lanes
//! 2 h and 2 h + 1 of the row's group: the even lane draws it for row group, the odd one for row
//! group + 8, each keeps the two words of its own columns and passes the other two over.
LOOM_BLOCK_BODY
template <int M, int N, class Thread>
LOOM_HD inline void keep_bits_by_rows(Thread& th, std::uint32_t (&keep)[M][2], const DropoutMask& mask,
                                      std::uint64_t origin, std::int64_t tokens, std::int64_t first_query,
                                      std::int64_t first_key, Lane ln) {
  static_assert(N <= 16, "2 N keep bits in a word");
  if (tokens % 4 != 0) return keep_bits_each<M, N>(keep, mask, origin, tokens, 1, first_query, first_key, ln);
  const int own = ln.pair % 2;  // the row (group + 8 own) whose blocks this lane draws
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    const std::int64_t row = first_query + warp_rows * r + ln.group + 8 * own;
    const std::uint64_t first_block = (origin + static_cast<std::uint64_t>(row * tokens + first_key)) / 4 + ln.pair / 2;
    std::uint32_t mine = 0, theirs = 0;
    LOOM_ROLLED
    for (int j = 0; j < N; ++j) {
      const std::uint32_t nibble = keep_nibble(mask, first_block + 2 * j);  // 8 keys: 2 blocks
      mine |= (own != 0 ? nibble >> 2 : nibble & 3u) << (2 * j);
      theirs |= (own != 0 ? nibble & 3u : nibble >> 2) << (2 * j);
    }
    const std::uint32_t other = th.shuffle_xor(theirs, 1);
    keep[r][0] = own != 0 ? other : mine;
    keep[r][1] = own != 0 ? mine : other;
  }
}

//! keep[r][i] where the fragments' rows are the mask's columns (keys) and their columns its rows
//! (queries): element (row, col) of M [16, 8 N] fragments from key first_key (a multiple of 4) and
//! query first_query is global element origin + col T + row (key_value_grad's S^T). All 32 lanes
//! of the warp take part.
//!
//! Where T % 4 == 0, the Philox blocks of a [16 keys, 8 queries] fragment are (query q, keys
//! 4 g4 .. + 3) for q < 8, g4 < 4: 32, one per lane. Lane 4 g + p draws query 2 p + g % 2, keys
//! 4 (g / 2) ..; the element at key g + 8 i, query 2 p + c is word g % 4 of the block of lane
//! 4 (2 (g / 4 + 2 i) + c) + p, which it reads by a shuffle (4 per fragment row block).
LOOM_BLOCK_BODY
template <int M, int N, class Thread>
LOOM_HD inline void keep_bits_by_columns(Thread& th, std::uint32_t (&keep)[M][2], const DropoutMask& mask,
                                         std::uint64_t origin, std::int64_t tokens, std::int64_t first_key,
                                         std::int64_t first_query, Lane ln) {
  static_assert(N <= 8, "a nibble per 8 queries in a word");
  if (tokens % 4 != 0) return keep_bits_each<M, N>(keep, mask, origin, 1, tokens, first_key, first_query, ln);
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    const std::int64_t query = first_query + 2 * ln.pair + ln.group % 2;
    const std::int64_t key = first_key + warp_rows * r + 4 * (ln.group / 2);
    const std::uint64_t first_block = (origin + static_cast<std::uint64_t>(query * tokens + key)) / 4;
    const auto query_step = static_cast<std::uint64_t>(2 * tokens);  // blocks from query q to q + 8
    std::uint32_t nibbles = 0;
    LOOM_ROLLED
    for (int j = 0; j < N; ++j) nibbles |= keep_nibble(mask, first_block + j * query_step) << (4 * j);
    std::uint32_t bits[2] = {0, 0};
    LOOM_UNROLL
    for (int i = 0; i < 2; ++i) {
      LOOM_UNROLL
      for (int c = 0; c < 2; ++c) {
        const std::uint32_t from = th.shuffle(nibbles, 4 * (2 * (ln.group / 4 + 2 * i) + c) + ln.pair);
        LOOM_UNROLL
        for (int j = 0; j < N; ++j) bits[i] |= (from >> (4 * j + ln.group % 4) & 1u) << (2 * j + c);
      }
    }
    keep[r][0] = bits[0];
    keep[r][1] = bits[1];
  }
}

//! 2^x for the softmax's exponentials: on the GPU one ex2.approx.ftz (exp2f adds a compare and
//! two predicated multiplies per call to keep results under 2^-126, which are nothing beside a
//! row's largest term, 1; PTX ISA: 2^-inf = +0), on the host std::exp2.
LOOM_HD inline float exp2_approx(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

//! Sets to -inf the scores of the M [16, 8 N] score blocks `s` (rows queries, columns the keys
//! from `first_key`) whose key is past the last one its row sees (`last`, by row group + 8 i of
//! block r): a masked score's probability is then 2^-inf = 0, and its dS 0.
template <int M, int N>
LOOM_HD inline void mask_keys_after(FragmentC (&s)[M][N], const std::int64_t (&last)[M][2], std::int64_t first_key,
                                    Lane ln) {
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int i = 0; i < 2; ++i) {
      // Compared with the lane's first column, so that each element's test is against a constant.
      const int last_column = tile_column(last[r][i], first_key, -1, 8 * N - 1) - 2 * ln.pair;
      LOOM_UNROLL
      for (int j = 0; j < N; ++j) {
        LOOM_UNROLL
        for (int c = 0; c < 2; ++c)
          if (8 * j + c > last_column) s[r][j][2 * i + c] = -std::numeric_limits<float>::infinity();
      }
    }
  }
}

//! Sets to -inf the scores of the M [16, 8 N] transposed score blocks `st` (rows keys, columns
//! queries from column `first` of their tile) whose query is outside [lowest, end) (`lowest` by
//! key row group + 8 i of block r; tile columns).
template <int M, int N>
LOOM_HD inline void mask_queries_outside(FragmentC (&st)[M][N], const int (&lowest)[M][2], int end, int first,
                                         Lane ln) {
  const int lane_first = first + 2 * ln.pair;
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int i = 0; i < 2; ++i) {
      const int from = lowest[r][i] - lane_first, to = end - lane_first;  // the lane's columns [from, to)
      LOOM_UNROLL
      for (int j = 0; j < N; ++j) {
        LOOM_UNROLL
        for (int c = 0; c < 2; ++c)
          if (8 * j + c < from || 8 * j + c >= to) st[r][j][2 * i + c] = -std::numeric_limits<float>::infinity();
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The kernel bodies, run by every thread of a block of `threads`.

inline constexpr float log2e = 1.4426950408889634f;
inline constexpr float ln2 = 0.6931471805599453f;

//! What a thread of a kernel body works on: the sizes (ld = 3C, qkv's row stride), its block's
//! (batch, head), its warp and its lane's place in the fragments.
struct Position {
  std::int64_t tokens, channels, ld;
  Place at;
  int warp;
  Lane lane;
};
LOOM_BLOCK_BODY
template <class Thread>
LOOM_HD inline Position position(const Thread& th, const Shape& sh) {
  const int lane = th.thread() % 32;
  return {sh.tokens, sh.channels, 3 * sh.channels, place(th.block_x(), sh.heads), th.thread() / 32,
          Lane{lane / 4, lane % 4}};
}

//! The blocks of 64 m rows that cover `tokens` rows: a kernel's grid height where each warp owns
//! m blocks of 16 rows (its block 64 m; tiles(tokens) for m = 1).
LOOM_HD constexpr std::int64_t row_tiles(std::int64_t tokens, int m) noexcept {
  return (tokens + tile * m - 1) / (tile * m);
}

//! The row tile (of 64 m) of a block that walks from tile 0 to its own (causal): the last ones,
//! which walk the longest, go to the first blocks.
LOOM_HD inline std::int64_t longest_first(std::int64_t tokens, std::int64_t block_y, int m = 1) noexcept {
  return row_tiles(tokens, m) - 1 - block_y;
}

//! The query row tile (of 64 m) of a forward or query_grad block: longest_first (causal), or the
//! block's own place in the grid (bidirectional: every block walks all key tiles).
LOOM_HD inline std::int64_t query_tile(const Shape& sh, std::int64_t block_y, int m = 1) noexcept {
  return sh.causal() ? longest_first(sh.tokens, block_y, m) : block_y;
}

//! The 64-key tiles [0, key_tiles) that query row tile `qt` (of 64 m rows, one with real
//! queries: qt 64 m < length) meets in a sequence of `length` real tokens: those up to its last
//! row (causal) or all that hold real keys.
LOOM_HD inline std::int64_t key_tiles(const Shape& sh, std::int64_t qt, std::int64_t length, int m = 1) noexcept {
  const std::int64_t all = tiles(length);
  return sh.causal() && (qt + 1) * m < all ? (qt + 1) * m : all;
}

//! The first 64-query tile that key row tile `kt` (of 64 m keys) meets: the one of its first key
//! (causal) or 0. (A key_value_grad block's row tile is its blockIdx.y: with the causal mask the
//! first ones walk the longest.)
LOOM_HD inline std::int64_t first_query_tile(const Shape& sh, std::int64_t kt, int m = 1) noexcept {
  return sh.causal() ? kt * m : 0;
}

//! The last key that query t sees in a sequence of `length` real tokens: t (causal) or
//! length - 1, and no real key past length - 1. A padded query (t >= length, or a row past T,
//! never written) sees keys as if it were real: the forward's online softmax then stays finite.
//! It never falls as t grows, so a warp's last row gives the last key any of its rows sees.
LOOM_HD inline std::int64_t last_key(const Shape& sh, std::int64_t t, std::int64_t length) noexcept {
  return sh.causal() && t < length ? t : length - 1;
}

//! The forward of one block: 64 M query rows of one (batch, head), M blocks of 16 rows a warp.
//! Shared memory: ForwardSmem<HS>. Scores are kept in base-2 units (times log2 e) so that each
//! exponential is one exp2. Each row walks the same key tiles, in the same order, whatever M is,
//! so M changes no bit of out or lse. With Drop, out = dropout(P) V: the sum l (so lse) is the
//! softmax's, and each probability goes into the product with V through `drop`'s mask (active).
LOOM_BLOCK_BODY
template <int HS, int M, bool Drop = false, class Tiles = PaddedTiles, class Thread>
LOOM_HD void forward_block(Thread& th, const ForwardArgs& a, const AttentionDropout& drop = {}) {
  using Smem = ForwardSmem<HS, Tiles>;
  const Shape& sh = a.shape;
  const auto [T, C, ld, at, warp, ln] = position(th, sh);
  const std::int64_t qt = query_tile(sh, th.block_y(), M), length = sh.length(at.b);
  unsigned char* smem = Tiles::base(th);
  constexpr std::size_t tile_size = tile_bytes<HS, Tiles>;
  [[maybe_unused]] constexpr int tile_ld = Tiles::template row_ld<HS>;
  const auto k = [&](std::int64_t tile_index) { return region<bf16>(smem, Smem::k + tile_index % 2 * tile_size); };
  const auto v = [&](std::int64_t tile_index) { return region<bf16>(smem, Smem::v + tile_index % 2 * tile_size); };

  const bf16* qkv_bh = a.qkv + at.b * T * ld + at.h * HS;  // q of token 0; k at + C, v at + 2C
  const std::int64_t first = (qt * warps + warp) * warp_rows * M;  // the warp's first query
  FragmentA q[M][HS / 16];
  load_rows_a<HS>(q, qkv_bh, ld, first, T, ln);

  FragmentC o[M][HS / 8];
  zero(o);
  const float scale2 = sh.scale * log2e;
  [[maybe_unused]] const float drop_scale = Drop ? static_cast<float>(drop.mask.scale()) : 1.0f;
  // Per row group + 8 i of block r: the running max (base 2) and this lane's part of the running
  // sum, and the last key the row sees.
  float m[M][2], l[M][2];
  std::int64_t last[M][2];
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int i = 0; i < 2; ++i) {
      m[r][i] = -std::numeric_limits<float>::infinity();
      l[r][i] = 0.0f;
      last[r][i] = last_key(sh, first + warp_rows * r + ln.group + 8 * i, length);
    }
  }
  // A key tile past the last key any row of the warp sees is masked for all of them: the warp
  // skips it (M > 1: the block walks the tiles its last warp needs; with M = 1 none is skipped).
  const std::int64_t warp_last = last_key(sh, first + warp_rows * M - 1, length);
  // The last key the warp's first row sees, the fewest of its rows (last_key never falls).
  const std::int64_t warp_first_last = last_key(sh, first, length);
  // A tile of padded queries only (the same for the whole block) walks no key tile: its rows are
  // written as zeros below.
  const std::int64_t end = qt * tile * M < length ? key_tiles(sh, qt, length, M) : 0;
  const auto start = [&](std::int64_t kt) {
    start_tiles<HS, Tiles>(th, k(kt), qkv_bh + C, ld, v(kt), qkv_bh + 2 * C, ld, kt * tile, T);
  };
  if (end > 0) start(0);
  for (std::int64_t kt = 0; kt < end; ++kt) {
    th.wait_copies();  // this thread's copies of tile kt (the only ones in flight)
    Tiles::copies_landed(th);
    // Every thread's copies of tile kt have landed, and every warp is done with tile kt - 1, whose
    // buffer tile kt + 1 takes next, while this one is computed.
    th.sync_block();
    if (kt + 1 < end) start(kt + 1);
    if (!Tiles::collective && kt * tile > warp_last) continue;

    // The keep bits first, while the scores take no registers.
    [[maybe_unused]] std::uint32_t keep[M][2];
    if constexpr (Drop)
      keep_bits_by_rows<M, tile_blocks>(th, keep, drop.mask, drop.head_origin(at.b, at.h, T), T, first,
                                        kt * tile, ln);
    FragmentC s[M][tile_blocks];
    zero(s);
    Tiles::template product_abt<HS>(th, s, q, k(kt), ln);
    // A key counts where key <= last (t, the causal mask; or length - 1). Only a tile that holds
    // a key past the warp's first row's last one has anything to mask (causal: the diagonal
    // tile; padded: the sequence's last): the others skip the compare and select per score.
    if ((kt + 1) * tile - 1 > warp_first_last) mask_keys_after(s, last, kt * tile, ln);
    // Online softmax, in base 2 (scale2 = scale log2 e > 0, so the raw max gives the scaled one):
    // p = 2^(x scale2 - m) is one fused multiply-add and one ex2. Tile 0 holds key 0, which every
    // row sees, so m is finite from the first tile on; a later tile may hold no key a row sees
    // (M > 1): its max is -inf, m stays, alpha = 1 and p = 0.
    LOOM_UNROLL
    for (int r = 0; r < M; ++r) {
      LOOM_UNROLL
      for (int i = 0; i < 2; ++i) {
        float tile_max = -std::numeric_limits<float>::infinity();
        LOOM_UNROLL
        for (int j = 0; j < tile_blocks; ++j) tile_max = fmaxf(tile_max, fmaxf(s[r][j][2 * i], s[r][j][2 * i + 1]));
        tile_max = fmaxf(tile_max, th.shuffle_xor(tile_max, 1));  // the 4 lanes of the row
        tile_max = fmaxf(tile_max, th.shuffle_xor(tile_max, 2));
        const float m_new = fmaxf(m[r][i], tile_max * scale2);
        const float alpha = exp2_approx(m[r][i] - m_new);
        float sum = 0.0f;
        LOOM_UNROLL
        for (int j = 0; j < tile_blocks; ++j) {
          LOOM_UNROLL
          for (int c = 0; c < 2; ++c) {
            float& x = s[r][j][2 * i + c];
            x = exp2_approx(fmaf(x, scale2, -m_new));
            sum += x;
            if constexpr (Drop) x = keep[r][i] >> (2 * j + c) & 1u ? x * drop_scale : 0.0f;
          }
        }
        l[r][i] = l[r][i] * alpha + sum;
        m[r][i] = m_new;
        LOOM_UNROLL
        for (int n = 0; n < HS / 8; ++n) {
          o[r][n][2 * i] *= alpha;
          o[r][n][2 * i + 1] *= alpha;
        }
      }
    }
    Tiles::template accumulate_ab<HS>(th, o, s, v(kt), ln);  // o += p v
  }

  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int i = 0; i < 2; ++i) {
      float sum = l[r][i] + th.shuffle_xor(l[r][i], 1);
      sum += th.shuffle_xor(sum, 2);
      const std::int64_t t = first + warp_rows * r + ln.group + 8 * i;
      if (t >= T) continue;
      // sum >= 1 where the row walked a tile (the max term is exp2(0)); a padded query's out and
      // lse are 0 (factor 0, not 0 times an infinite inverse).
      const bool real = t < length;
      const float factor = real ? 1.0f / sum : 0.0f;
      bf16* out_row = a.out + (at.b * T + t) * C + at.h * HS + 2 * ln.pair;
      LOOM_UNROLL
      for (int n = 0; n < HS / 8; ++n) {
        LOOM_UNROLL
        for (int c = 0; c < 2; ++c) out_row[8 * n + c] = bf16(real ? o[r][n][2 * i + c] * factor : 0.0f);
      }
      if (ln.pair == 0) a.lse[at.bh * T + t] = real ? (m[r][i] + log2f(sum)) * ln2 : 0.0f;
    }
  }
}

//! The delta kernel's lanes per row of [B, NH, T] (one 16-byte pack of the head's HS each) and
//! rows per block: a warp takes 32 / (HS / 8) rows, so each lane loads 16 bytes of dout and of
//! out at once. (A warp per row, two bytes a lane, took 0.45 ms of a GPT-2 small step at batch 16
//! on an H200, three times what its bytes take.)
template <int HS>
inline constexpr int delta_lanes = HS / pack;
template <int HS>
inline constexpr int delta_rows = warps * (32 / delta_lanes<HS>);

//! Blocks of the delta kernel for `rows` rows of [B, NH, T] (a grid's x extent: rows < 2^36).
template <int HS>
constexpr unsigned delta_blocks(std::int64_t rows) noexcept {
  return static_cast<unsigned>((rows + delta_rows<HS> - 1) / delta_rows<HS>);
}

//! 8 bf16 of 16-byte-aligned `p` (global memory) as float: one 16-byte load on the GPU.
LOOM_HD inline void load_pack(float (&to)[pack], const bf16* p) {
#if defined(__CUDA_ARCH__)
  struct alignas(16) Pack {
    bf16 value[pack];
  };
  const Pack v = *reinterpret_cast<const Pack*>(p);
  LOOM_UNROLL
  for (int e = 0; e < pack; ++e) to[e] = static_cast<float>(v.value[e]);
#else
  for (int e = 0; e < pack; ++e) to[e] = static_cast<float>(p[e]);
#endif
}

//! An overwriting backward's padding (a.accumulate false, a.shape.lengths given): the block's row
//! of dqkv (blockIdx.x = b T + t), all 3 C columns, set to 0 where t is at or past sequence b's
//! length. Not in the tiled kernels, which write the real rows only: writing the padding there
//! cost them registers (ptxas spilled more in key_value_grad at HS 64).
LOOM_BLOCK_BODY
template <class Thread>
LOOM_HD void zero_padding_block(Thread& th, const BackwardArgs& a) {
  const Shape& sh = a.shape;
  const std::int64_t row = th.block_x(), t = row % sh.tokens, width = 3 * sh.channels;
  if (t < sh.length(row / sh.tokens)) return;
  for (std::int64_t j = th.thread(); j < width; j += threads) a.dqkv[row * width + j] = bf16(0.0f);
}

//! delta[b, h, t] = sum_c dout[b, t, h hs + c] out[b, t, h hs + c] in float over the `rows` rows
//! of [B, NH, T]: delta_lanes<HS> lanes per row, delta_rows<HS> rows per block, each lane one pack
//! of 8 channels where both tensors' rows start 16-byte aligned (`vectors`), else channels lane,
//! lane + delta_lanes, ...; then the row's lanes add up by butterfly.
LOOM_BLOCK_BODY
template <int HS, class Thread>
LOOM_HD void delta_block(Thread& th, const bf16* out, const bf16* dout, float* delta, const Shape& sh,
                         std::int64_t rows) {
  constexpr int lanes = delta_lanes<HS>;
  static_assert(HS % pack == 0 && 32 % lanes == 0, "a warp holds whole rows of whole packs");
  const int lane = th.thread() % 32, part = lane % lanes;
  const std::int64_t row = th.block_x() * delta_rows<HS> + th.thread() / lanes;  // (b NH + h) T + t
  const bool valid = row < rows;
  const std::int64_t T = sh.tokens, bh = valid ? row / T : 0, t = valid ? row % T : 0;
  const std::int64_t b = bh / sh.heads, h = bh % sh.heads;
  const std::int64_t offset = (b * T + t) * sh.channels + h * HS;
  const bool vectors = sh.channels % pack == 0 && reinterpret_cast<std::uintptr_t>(out) % 16 == 0 &&
                       reinterpret_cast<std::uintptr_t>(dout) % 16 == 0;
  float sum = 0.0f;
  if (valid && vectors) {
    float o[pack], g[pack];
    load_pack(o, out + offset + part * pack);
    load_pack(g, dout + offset + part * pack);
    LOOM_UNROLL
    for (int e = 0; e < pack; ++e) sum += g[e] * o[e];
  } else if (valid) {
    for (int c = part; c < HS; c += lanes)
      sum += static_cast<float>(dout[offset + c]) * static_cast<float>(out[offset + c]);
  }
  // Every lane takes part: the masks stay within a row's lanes.
  for (int mask = lanes / 2; mask > 0; mask /= 2) sum += th.shuffle_xor(sum, mask);
  if (valid && part == 0) delta[row] = sum;
}

//! The gradient of 64 M keys of one (batch, head): dk and dv of rows kt 64 M .. (kt = blockIdx.y:
//! with the causal mask the first key tiles see the most queries), a warp's M blocks of 16 keys in
//! its registers. Shared memory: KeyValueGradSmem<HS>. Each key meets the same queries in the same
//! order whatever M is, so M changes no bit of dk or dv. With Drop, dV takes the dropped P^T (the
//! mask of `drop`, active) and dS^T = P^T (dropout(dP^T) - D) the undropped one (D =
//! rowsum(dout out) still: out was dropped).
LOOM_BLOCK_BODY
template <int HS, int M, bool Drop = false, class Tiles = PaddedTiles, class Thread>
LOOM_HD void key_value_grad_block(Thread& th, const BackwardArgs& a, const AttentionDropout& drop = {}) {
  using Smem = KeyValueGradSmem<HS, Tiles>;
  const Shape& sh = a.shape;
  const auto [T, C, ld, at, warp, ln] = position(th, sh);
  const std::int64_t kt = th.block_y(), length = sh.length(at.b);
  // Keys at or past the length get no gradient, and queries there give none: a tile of padded
  // keys only leaves at once (the whole block, before any barrier); the others walk the query
  // tiles that hold real queries.
  if (kt * tile * M >= length) return;
  const std::int64_t query_tiles = tiles(length);
  unsigned char* smem = Tiles::base(th);
  constexpr std::size_t tile_size = tile_bytes<HS, Tiles>;
  [[maybe_unused]] constexpr int tile_ld = Tiles::template row_ld<HS>;
  const auto q = [&](std::int64_t i) { return region<bf16>(smem, Smem::q + i % 2 * tile_size); };
  const auto g = [&](std::int64_t i) { return region<bf16>(smem, Smem::dout + i % 2 * tile_size); };
  const auto lse = [&](std::int64_t i) { return region<float>(smem, Smem::lse + i % 2 * bytes<float>(1, tile)); };
  const auto delta = [&](std::int64_t i) { return region<float>(smem, Smem::delta + i % 2 * bytes<float>(1, tile)); };

  const bf16* qkv_bh = a.qkv + at.b * T * ld + at.h * HS;
  const bf16* dout_bh = a.dout + at.b * T * C + at.h * HS;
  const std::int64_t first = (kt * warps + warp) * warp_rows * M;  // the warp's first key
  FragmentA k[M][HS / 16], v[M][HS / 16];
  load_rows_a<HS>(k, qkv_bh + C, ld, first, T, ln);
  load_rows_a<HS>(v, qkv_bh + 2 * C, ld, first, T, ln);
  FragmentC dk[M][HS / 8], dv[M][HS / 8];
  zero(dk);
  zero(dv);
  const float scale2 = sh.scale * log2e;
  [[maybe_unused]] const float drop_scale = Drop ? static_cast<float>(drop.mask.scale()) : 1.0f;
  // The first query that key row group + 8 i of block r meets: the key itself (causal), or 0;
  // none (the length) for a padded key, whose dk and dv are never written.
  std::int64_t lowest[M][2];
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int i = 0; i < 2; ++i) {
      const std::int64_t key = first + warp_rows * r + ln.group + 8 * i;
      lowest[r][i] = key >= length ? length : sh.causal() ? key : 0;
    }
  }
  // The first query any key of the warp meets (its first key's lowest, the least): where M > 1 the
  // warp skips the steps before it, masked for all its keys, and everything where its keys are all
  // padded. (With M = 1 only half a diagonal tile would be skipped, and the branch made ptxas
  // spill about 50 bytes more.)
  const std::int64_t warp_lowest = first >= length ? tiles(length) * tile : sh.causal() ? first : 0;
  // The first query that every key of the warp meets (its last key's lowest, the most; the length
  // where any of its keys is padded): a step from there to the length needs no mask.
  const std::int64_t warp_last_key = first + warp_rows * M - 1;
  const std::int64_t warp_highest_lowest = warp_last_key >= length ? length : sh.causal() ? warp_last_key : 0;
  const auto start = [&](std::int64_t qtile) {  // start_tiles commits the rows' copies with its own
    start_rows(th, lse(qtile), a.lse + at.bh * T, qtile * tile, T, 0);
    start_rows(th, delta(qtile), a.delta + at.bh * T, qtile * tile, T, 32);  // another warp
    start_tiles<HS, Tiles>(th, q(qtile), qkv_bh, ld, g(qtile), dout_bh, C, qtile * tile, T);
  };
  // The queries of a step: a tile in two halves of 32 (M = 1) or four quarters of 16 (M = 2), so
  // that S^T and dP^T take 32 registers beside dK, dV, K and V (96 of them, HS 64, M = 1).
  constexpr int step = tile / 2 / M;
  static_assert(step % 16 == 0, "a step is whole A fragments of queries");
  start(first_query_tile(sh, kt, M));
  for (std::int64_t qtile = first_query_tile(sh, kt, M); qtile < query_tiles; ++qtile) {
    th.wait_copies();
    Tiles::copies_landed(th);
    th.sync_block();  // tile qtile is in, tile qtile - 1 no longer read (forward_block's loop)
    if (qtile + 1 < query_tiles) start(qtile + 1);

    // The queries of the tile that count for key row group + 8 i of block r: columns
    // [lowest, end).
    const int end = tile_column(length, qtile * tile, 0, tile);
    int lowest_column[M][2];
    LOOM_UNROLL
    for (int r = 0; r < M; ++r) {
      LOOM_UNROLL
      for (int i = 0; i < 2; ++i) lowest_column[r][i] = tile_column(lowest[r][i], qtile * tile, 0, tile);
    }
    for (int first_query = 0; first_query < tile; first_query += step) {  // of the tile
      if (!Tiles::collective && M > 1 && qtile * tile + first_query + step <= warp_lowest) continue;
      const bf16* const q_step = q(qtile) + first_query * tile_ld;
      const bf16* const g_step = g(qtile) + first_query * tile_ld;
      const float* const lse_step = lse(qtile) + first_query;
      const float* const delta_step = delta(qtile) + first_query;
      [[maybe_unused]] std::uint32_t keep[M][2];  // first, while S^T and dP^T take no registers
      if constexpr (Drop)
        keep_bits_by_columns<M, step / 8>(th, keep, drop.mask, drop.head_origin(at.b, at.h, T), T, first,
                                          qtile * tile + first_query, ln);
      FragmentC st[M][step / 8], dpt[M][step / 8];  // S^T and dP^T: [16 keys, step queries] a block
      zero(st);
      zero(dpt);
      Tiles::template product_abt<HS>(th, st, k, q_step, ln);
      Tiles::template product_abt<HS>(th, dpt, v, g_step, ln);  // dP^T = V dO^T
      // Only a step with a query that some key of the warp does not meet (causal: the diagonal;
      // padded: past the length) masks: the masked scores become -inf, so p = 0 and dS = 0.
      const std::int64_t step_first = qtile * tile + first_query;
      if (step_first < warp_highest_lowest || step_first + step > length)
        mask_queries_outside(st, lowest_column, end, first_query, ln);
      // dS^T without the softmax scale, which multiplies dK once at the end.
      for_each_element(st, dpt, ln, [&](float& p, float& ds, [[maybe_unused]] int r, [[maybe_unused]] int i,
                                        int col, [[maybe_unused]] int bit) {
        p = exp2_approx(fmaf(p, scale2, -lse_step[col] * log2e));
        if constexpr (Drop) {
          const float z = keep[r][i] >> bit & 1u ? drop_scale : 0.0f;
          ds = p * (ds * z - delta_step[col]);
          p *= z;
        } else {
          ds = p * (ds - delta_step[col]);
        }
      });
      Tiles::template accumulate_ab<HS>(th, dv, st, g_step, ln);   // dV += P^T dO
      Tiles::template accumulate_ab<HS>(th, dk, dpt, q_step, ln);  // dK += dS^T Q
    }
  }
  scale_fragments(dk, sh.scale);
  bf16* dqkv_bh = a.dqkv + at.b * T * ld + at.h * HS;
  add_rows(dqkv_bh + C, ld, dk, first, length, a.accumulate, ln);
  add_rows(dqkv_bh + 2 * C, ld, dv, first, length, a.accumulate, ln);
}

//! The gradient of 64 M queries of one (batch, head): dq of rows qt 64 M .., a warp's M blocks of
//! 16 queries in its registers. Shared memory: QueryGradSmem<HS>. Each query meets the same keys
//! in the same order whatever M is, so M changes no bit of dq. With Drop, dS = P (dropout(dP) - D),
//! `drop` (active) giving the mask.
LOOM_BLOCK_BODY
template <int HS, int M, bool Drop = false, class Tiles = PaddedTiles, class Thread>
LOOM_HD void query_grad_block(Thread& th, const BackwardArgs& a, const AttentionDropout& drop = {}) {
  using Smem = QueryGradSmem<HS, Tiles>;
  const Shape& sh = a.shape;
  const auto [T, C, ld, at, warp, ln] = position(th, sh);
  const std::int64_t qtile = query_tile(sh, th.block_y(), M), length = sh.length(at.b);
  if (qtile * tile * M >= length) return;  // padded queries only: no gradient (key_value_grad_block)
  unsigned char* smem = Tiles::base(th);
  constexpr std::size_t tile_size = tile_bytes<HS, Tiles>;
  [[maybe_unused]] constexpr int tile_ld = Tiles::template row_ld<HS>;
  const auto k = [&](std::int64_t i) { return region<bf16>(smem, Smem::k + i % 2 * tile_size); };
  const auto v = [&](std::int64_t i) { return region<bf16>(smem, Smem::v + i % 2 * tile_size); };

  const bf16* qkv_bh = a.qkv + at.b * T * ld + at.h * HS;
  const bf16* dout_bh = a.dout + at.b * T * C + at.h * HS;
  const std::int64_t first = (qtile * warps + warp) * warp_rows * M;  // the warp's first query
  FragmentA q[M][HS / 16], g[M][HS / 16];
  load_rows_a<HS>(q, qkv_bh, ld, first, T, ln);
  load_rows_a<HS>(g, dout_bh, C, first, T, ln);
  float lse[M][2], delta[M][2];  // of row group + 8 i of block r; lse times log2 e
  std::int64_t last[M][2];       // the last key the row sees; -1 (none) for a padded row
  LOOM_UNROLL
  for (int r = 0; r < M; ++r) {
    LOOM_UNROLL
    for (int i = 0; i < 2; ++i) {
      const std::int64_t t = first + warp_rows * r + ln.group + 8 * i;
      lse[r][i] = t < length ? a.lse[at.bh * T + t] * log2e : 0.0f;
      delta[r][i] = t < length ? a.delta[at.bh * T + t] : 0.0f;
      last[r][i] = t < length ? last_key(sh, t, length) : -1;
    }
  }
  // The last key any row of the warp sees (its last real row's): the warp skips the keys past it,
  // masked for all its rows, and everything where its rows are all padded.
  const std::int64_t last_real_row = (first + warp_rows * M < length ? first + warp_rows * M : length) - 1;
  const std::int64_t warp_last = last_real_row >= first ? last_key(sh, last_real_row, length) : -1;
  // The last key every row of the warp sees (its first row's; none where a row is padded).
  const std::int64_t warp_first_last = first + warp_rows * M - 1 < length ? last_key(sh, first, length) : -1;
  FragmentC dq[M][HS / 8];
  zero(dq);
  const float scale2 = sh.scale * log2e;
  [[maybe_unused]] const float drop_scale = Drop ? static_cast<float>(drop.mask.scale()) : 1.0f;
  const std::int64_t end = key_tiles(sh, qtile, length, M);
  const auto start = [&](std::int64_t kt) {
    start_tiles<HS, Tiles>(th, k(kt), qkv_bh + C, ld, v(kt), qkv_bh + 2 * C, ld, kt * tile, T);
  };
  // The keys of a step: the whole tile (M = 1) or two halves of 32 (M = 2), so that S and dP
  // take 64 registers whatever M is.
  constexpr int step = tile / M;
  static_assert(step % 16 == 0, "a step is whole A fragments of keys");
  start(0);
  for (std::int64_t kt = 0; kt < end; ++kt) {
    th.wait_copies();
    Tiles::copies_landed(th);
    th.sync_block();  // tile kt is in, tile kt - 1 no longer read (forward_block's loop)
    if (kt + 1 < end) start(kt + 1);

    for (int first_key = 0; first_key < tile; first_key += step) {  // of the tile
      if (!Tiles::collective && kt * tile + first_key > warp_last) break;
      const bf16* const k_step = k(kt) + first_key * tile_ld;
      [[maybe_unused]] std::uint32_t keep[M][2];  // first, while S and dP take no registers
      if constexpr (Drop)
        keep_bits_by_rows<M, step / 8>(th, keep, drop.mask, drop.head_origin(at.b, at.h, T), T, first,
                                       kt * tile + first_key, ln);
      FragmentC s[M][step / 8], dp[M][step / 8];
      zero(s);
      zero(dp);
      Tiles::template product_abt<HS>(th, s, q, k_step, ln);
      Tiles::template product_abt<HS>(th, dp, g, v(kt) + first_key * tile_ld, ln);  // dP = dO V^T
      // Only a step with a key that some row of the warp does not see (causal: the diagonal;
      // padded: past the length, or a padded row) masks: the masked scores become -inf, so p = 0
      // and dS = 0.
      if (kt * tile + first_key + step - 1 > warp_first_last) mask_keys_after(s, last, kt * tile + first_key, ln);
      // dS without the softmax scale, which multiplies dQ once at the end.
      for_each_element(s, dp, ln, [&](float& score, float& ds, int r, int i, [[maybe_unused]] int col,
                                      [[maybe_unused]] int bit) {
        const float p = exp2_approx(fmaf(score, scale2, -lse[r][i]));
        if constexpr (Drop)
          ds = p * ((keep[r][i] >> bit & 1u ? ds * drop_scale : 0.0f) - delta[r][i]);
        else
          ds = p * (ds - delta[r][i]);
      });
      Tiles::template accumulate_ab<HS>(th, dq, dp, k_step, ln);  // dQ += dS K
    }
  }
  scale_fragments(dq, sh.scale);
  add_rows(a.dqkv + at.b * T * ld + at.h * HS, ld, dq, first, length, a.accumulate, ln);
}

// ---------------------------------------------------------------------------------------------
// The GPU's Thread and the kernels. bf16 mma.sync needs sm_80 or newer: compiled for an older
// architecture the kernels are empty, and the host never launches them there (built_for).

#if defined(__CUDACC__)

//! The architecture (major * 10 + minor) the kernels need.
inline constexpr int minimum_architecture = 80;

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define LOOM_FLASH_DEVICE 1

//! A CUDA thread of a one-dimensional block of `threads` (cuda_kernels::BlockThread), with the
//! integer shuffles, the asynchronous copies, ldmatrix and the mma.
struct DeviceThread : cuda_kernels::BlockThread {
  using BlockThread::shuffle_xor;
  __device__ std::uint32_t shuffle_xor(std::uint32_t value, int mask) const {
    return __shfl_xor_sync(0xffffffffu, value, mask);
  }
  //! `value` of lane `lane` of the warp.
  __device__ std::uint32_t shuffle(std::uint32_t value, int lane) const {
    return __shfl_sync(0xffffffffu, value, lane);
  }
  //! Starts copying the first `bytes` (0 to 16; src then is not read) of the 16 at `src` (global,
  //! 16-byte aligned) to `dst` (shared), the rest of the 16 as zeros.
  __device__ void copy_async(void* dst, const void* src, int bytes) const {
    const auto to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(bytes) : "memory");
  }
  //! Closes the group of copies started since the last call.
  __device__ void commit_copies() const { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
  //! Waits for every copy this thread started.
  __device__ void wait_copies() const { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
  //! Two B fragments of an [n][k] row-major tile in shared memory by ldmatrix.x4: lane l gives
  //! the address of row l % 8 + 8 (l / 16) (of the 16 n) at column 8 (l / 8 % 2) (of the 16 k);
  //! b[j] is the fragment of rows 8 j .. 8 j + 7.
  __device__ void load_b_rows(FragmentB (&b)[2], const bf16* lane_row) const {
    const auto from = static_cast<unsigned>(__cvta_generic_to_shared(lane_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(b[0][0]), "=r"(b[0][1]), "=r"(b[1][0]), "=r"(b[1][1])
                 : "r"(from)
                 : "memory");
  }
  //! Two B fragments of a [k][n] row-major tile in shared memory by ldmatrix.x4.trans: lane l
  //! gives the address of row l % 16 (of the 16 k) at column 8 (l / 16) (of the 16 n); b[j] is
  //! the fragment of columns 8 j .. 8 j + 7.
  __device__ void load_b_transposed(FragmentB (&b)[2], const bf16* lane_row) const {
    const auto from = static_cast<unsigned>(__cvta_generic_to_shared(lane_row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(b[0][0]), "=r"(b[0][1]), "=r"(b[1][0]), "=r"(b[1][1])
                 : "r"(from)
                 : "memory");
  }
  //! The shared-window address of `p` (in shared memory), as wgmma's descriptors take it.
  __device__ std::uint32_t shared_address(const void* p) const {
    return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
  }
  //! d += a b: one m16n8k16 tensor-core product, bf16 in, float accumulators, all 32 lanes.
  static __device__ void mma(FragmentC& d, const FragmentA& a, const FragmentB& b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

#endif  // __CUDA_ARCH__ >= 800

// wgmma exists only in code built for sm_90a (CMAKE_CUDA_ARCHITECTURES 90a), not for sm_90 or the
// PTX of any architecture: the GroupTiles kernels are empty elsewhere, and the host launches them
// only where a probe kernel says they were built (cuda_attention::group_built_for).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LOOM_FLASH_GROUP_DEVICE 1

//! DeviceThread with the warpgroup's products (GroupTiles): wgmma.mma_async with A in registers
//! and B in shared memory, and the fences it needs.
struct GroupDeviceThread : DeviceThread {
  //! Orders this thread's generic-proxy shared writes (cp.async, stores) before later
  //! async-proxy reads (wgmma) of them, once a barrier has passed.
  __device__ void fence_async_shared() const { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
  //! Before a group of wgmma on `d` with the A fragments `a`: each register of d and a is
  //! written before this point (an empty volatile asm reads each, and writes d's: the compiler
  //! may not sink a write past it, nor move d across the products), then wgmma.fence orders those
  //! writes before the products read them (PTX ISA: required between a register's write and a
  //! wgmma that reads it).
  template <int N, int K>
  __device__ void group_begin(FragmentC (&d)[N], const FragmentA (&a)[K]) const {
    pin(d);
    LOOM_UNROLL
    for (int k = 0; k < K; ++k) {
      LOOM_UNROLL
      for (int i = 0; i < 4; ++i) asm volatile("" ::"r"(a[k][i]) : "memory");
    }
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  }
  //! After a group of wgmma on `d`: commits the group and waits until it is done, so d holds the
  //! sums and the B tiles may be overwritten once a barrier has passed.
  template <int N>
  __device__ void group_end(FragmentC (&d)[N]) const {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    pin(d);
  }
  //! d += A B for the warpgroup's 64 rows and 8 N columns (N = 4 or 8): A this warp's 16 rows
  //! (k16) in the mma.sync A fragment's registers, B [16, 8 N] in shared memory by `descriptor`,
  //! K-major (B(k, n) at row n, column k of the tile) or, Transposed, MN-major (row k, column n).
  template <bool Transposed, int N>
  __device__ void group_mma(FragmentC (&d)[N], const FragmentA& a, std::uint64_t descriptor) const {
    static_assert(N == 4 || N == 8, "the kernels multiply by 32 or 64 columns");
    if constexpr (N == 4) {
      asm volatile(
          "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %21, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
          "{%16, %17, %18, %19}, %20, accumulate, 1, 1, %22;\n}\n"
          : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
            "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
            "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(descriptor), "r"(1), "n"(Transposed ? 1 : 0));
    } else {
      asm volatile(
          "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %37, 0;\n"
          "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
          "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
          "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
          "{%32, %33, %34, %35}, %36, accumulate, 1, 1, %38;\n}\n"
          : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
            "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
            "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
            "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
            "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
            "+f"(d[7][2]), "+f"(d[7][3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(descriptor), "r"(1), "n"(Transposed ? 1 : 0));
    }
  }

 private:
  template <int N>
  __device__ static void pin(FragmentC (&d)[N]) {
    LOOM_UNROLL
    for (int j = 0; j < N; ++j) {
      LOOM_UNROLL
      for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
    }
  }
};

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

static_assert(sizeof(bf16) == sizeof(__nv_bfloat16), "loom::bf16 and __nv_bfloat16 share their bits");

// Each kernel runs its body where the architecture has bf16 mma.sync, and is empty elsewhere.
#if defined(LOOM_FLASH_DEVICE)
#define LOOM_FLASH_RUN(...) \
  DeviceThread th;          \
  __VA_ARGS__;
#else
#define LOOM_FLASH_RUN(...)
#endif

//! The blocks of the forward and backward kernels that must fit on an SM at once, which bounds
//! their registers, where each warp owns m blocks of 16 rows: for m = 1, 3 (168 registers) where
//! HS <= 64 and 2 (255) for HS 128, whose fragments alone take more than 168 in key_value_grad;
//! m = 2 doubles the fragments a warp holds: 2 where HS <= 64, else 1. The kernels take both as
//! template arguments, so that loom_cuda_attention_bench can time others beside the library's.
constexpr int blocks_per_sm(int hs, int m = 1) { return m == 1 ? (hs <= 64 ? 3 : 2) : (hs <= 64 ? 2 : 1); }

//! The 16-row blocks a warp of each kernel owns in the library's launches (its block then owns
//! 64 M rows). M = 2 reads half the shared memory per tensor-core product (FlashAttention-2's
//! forward gives each of its 4 warps 32 of 128 rows) but holds twice the fragments (ptxas, sm_90,
//! hs 64: the forward fits in 254 registers, query_grad spills 32 bytes, key_value_grad 224).
//! Timed on an H200 (2026-11-27, loom_cuda_attention_bench, GPT-2 small's layer): M = 2 took
//! 0.97x the forward's time, 0.96x query_grad's and 1.11x key_value_grad's, about 0.5% of a
//! step in all, so 1 for each.
struct RowBlocks {
  int forward = 1, key_value_grad = 1, query_grad = 1;
};
inline constexpr RowBlocks row_blocks{};

template <int HS, int M = row_blocks.forward, int Blocks = blocks_per_sm(HS, M)>
__global__ void __launch_bounds__(threads, Blocks) forward_kernel(ForwardArgs a) {
  LOOM_FLASH_RUN(forward_block<HS, M>(th, a))
}
template <int = 0>  // a template: defined in a header, once for every program
__global__ void __launch_bounds__(threads) zero_padding_kernel(BackwardArgs a) {
  LOOM_FLASH_RUN(zero_padding_block(th, a))
}
template <int HS>
__global__ void __launch_bounds__(threads) delta_kernel(const bf16* out, const bf16* dout, float* delta, Shape sh,
                                                       std::int64_t rows) {
  LOOM_FLASH_RUN(delta_block<HS>(th, out, dout, delta, sh, rows))
}
template <int HS, int M = row_blocks.key_value_grad, int Blocks = blocks_per_sm(HS, M)>
__global__ void __launch_bounds__(threads, Blocks) key_value_grad_kernel(BackwardArgs a) {
  LOOM_FLASH_RUN(key_value_grad_block<HS, M>(th, a))
}
template <int HS, int M = row_blocks.query_grad, int Blocks = blocks_per_sm(HS, M)>
__global__ void __launch_bounds__(threads, Blocks) query_grad_kernel(BackwardArgs a) {
  LOOM_FLASH_RUN(query_grad_block<HS, M>(th, a))
}

// The same kernels with attention dropout (`drop` active). Separate kernels, not a flag in the
// arguments: a larger argument struct alone changed ptxas's register allocation of the kernels
// above (query_grad spilled 28 bytes instead of 8).

//! The blocks an SM of key_value_grad_dropout_kernel: one fewer than without dropout at HS 64
//! (M = 1), where with 168 registers ptxas spilled 164 bytes around the Philox draws and with
//! 255 none (241 used, sm_90).
constexpr int dropout_key_value_blocks_per_sm(int hs, int m = 1) {
  return m == 1 && hs == 64 ? 2 : blocks_per_sm(hs, m);
}
template <int HS, int M = row_blocks.forward, int Blocks = blocks_per_sm(HS, M)>
__global__ void __launch_bounds__(threads, Blocks) forward_dropout_kernel(ForwardArgs a, AttentionDropout drop) {
  LOOM_FLASH_RUN(forward_block<HS, M, true>(th, a, drop))
}
template <int HS, int M = row_blocks.key_value_grad, int Blocks = dropout_key_value_blocks_per_sm(HS, M)>
__global__ void __launch_bounds__(threads, Blocks) key_value_grad_dropout_kernel(BackwardArgs a,
                                                                                 AttentionDropout drop) {
  LOOM_FLASH_RUN(key_value_grad_block<HS, M, true>(th, a, drop))
}
template <int HS, int M = row_blocks.query_grad, int Blocks = blocks_per_sm(HS, M)>
__global__ void __launch_bounds__(threads, Blocks) query_grad_dropout_kernel(BackwardArgs a, AttentionDropout drop) {
  LOOM_FLASH_RUN(query_grad_block<HS, M, true>(th, a, drop))
}

// The same kernels on the warpgroup's products (GroupTiles, HS = 64, M = 1), where built for
// sm_90a, and empty elsewhere. They keep the mma.sync kernels' register bound (3 blocks an SM).
#if defined(LOOM_FLASH_GROUP_DEVICE)
#define LOOM_FLASH_GROUP_RUN(...) \
  GroupDeviceThread th;           \
  __VA_ARGS__;
#else
#define LOOM_FLASH_GROUP_RUN(...)
#endif

//! The head size the GroupTiles kernels are built for (GPT-2's and BERT's).
inline constexpr int group_head_size = 64;

template <bool Drop>
__global__ void __launch_bounds__(threads, blocks_per_sm(group_head_size))
    forward_group_kernel(ForwardArgs a, AttentionDropout drop) {
  LOOM_FLASH_GROUP_RUN(forward_block<group_head_size, 1, Drop, GroupTiles>(th, a, drop))
}
template <bool Drop>
__global__ void __launch_bounds__(threads, Drop ? dropout_key_value_blocks_per_sm(group_head_size)
                                                : blocks_per_sm(group_head_size))
    key_value_grad_group_kernel(BackwardArgs a, AttentionDropout drop) {
  LOOM_FLASH_GROUP_RUN(key_value_grad_block<group_head_size, 1, Drop, GroupTiles>(th, a, drop))
}
template <bool Drop>
__global__ void __launch_bounds__(threads, blocks_per_sm(group_head_size))
    query_grad_group_kernel(BackwardArgs a, AttentionDropout drop) {
  LOOM_FLASH_GROUP_RUN(query_grad_block<group_head_size, 1, Drop, GroupTiles>(th, a, drop))
}

//! Writes 1 to *built where this program holds the GroupTiles kernels for the device (sm_90a
//! code), 0 elsewhere. (A template: defined in a header, once for every program.)
template <int = 0>
__global__ void group_probe_kernel(int* built) {
#if defined(LOOM_FLASH_GROUP_DEVICE)
  *built = 1;
#else
  *built = 0;
#endif
}

#undef LOOM_FLASH_GROUP_RUN
#undef LOOM_FLASH_GROUP_DEVICE
#undef LOOM_FLASH_RUN
#undef LOOM_FLASH_DEVICE

#endif  // __CUDACC__

}  // namespace loom::detail::flash
