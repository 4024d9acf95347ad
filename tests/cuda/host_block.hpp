#pragma once
// The host emulation of a CUDA block, for the kernel bodies written over a Thread type
// (detail/block_body.hpp, detail/flash_attention.cuh): HostThread runs each thread of a block as
// a fiber (a stack of its own, switched to and from on the calling thread), with barriers for
// __syncthreads and __syncwarp, a shared exchange for the shuffles, cp.async done at once or at
// the wait that ends it (CopyTiming: the earliest and the latest it may land), and
// ldmatrix, mma.sync and wgmma computed from the lanes' addresses, fragments and descriptors by
// their PTX layouts. A wgmma that reads what a cp.async wrote fails the test unless the writing
// thread fenced it for the async proxy after it landed and a barrier passed since. Shared memory
// starts as garbage, so a body that reads what it did not write shows it.
//
// Why fibers, not host threads: the bodies meet a barrier every few instructions (each shuffle
// and each emulated mma is two), and with one host thread per emulated thread each barrier woke
// 32 or 128 threads through the kernel, on 2 cores: test_cuda_flash_attention took 193 s alone
// and 271 s under ctest -j2. A fiber switch costs a swapcontext (one signal-mask system call),
// not a wake-up through the scheduler: 29 s alone. The threads run in turns
// up to their next barrier, first thread 0 to the last, then the last to 0, and so on: a body
// that reads another thread's write without a barrier between sees it or not by the order,
// and each order occurs. A barrier that some threads never reach fails the test (host threads
// would hang).

#include <doctest/doctest.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "loom/backend/cuda/detail/flash_attention.cuh"
#include "loom/core/bf16.hpp"

namespace loom::cuda_test {

namespace fl = detail::flash;

//! The alignment of an emulated block's shared memory, whose offsets are the emulation's shared
//! addresses: wgmma's 128-byte swizzle is a function of the address bits, and its pattern starts at
//! 1024-byte boundaries.
inline constexpr std::size_t shared_alignment = 1024;

//! The most threads an emulated block has (the row kernels' 256; the tiled attention's 128).
inline constexpr int max_host_threads = 256;

//! When an emulated cp.async writes shared memory: at once (a body that reuses a buffer before
//! every thread is done reading it sees the new data), or only at the cp.async.wait_group that
//! ends its committed group (a body that reads a tile before waiting for it, or never commits its
//! copies, sees the garbage or the last tile there). On the GPU it lands somewhere between.
enum class CopyTiming { at_issue, at_wait };

//! A barrier of emulated threads (__syncthreads over the block, __syncwarp over a warp): the
//! last of `expected` arrivals opens it and starts its next generation.
struct FiberBarrier {
  int expected;
  int arrived = 0;
  std::uint64_t generation = 0;
};

//! The stacks of the emulated threads, kept for the calling thread's next blocks: each 256 KiB
//! (the bodies need a few), mapped lazily, with an inaccessible page below it so that an overflow
//! faults instead of writing into the next stack.
class FiberStacks {
 public:
  static constexpr std::size_t size = 256 * 1024;
  ~FiberStacks() {
    for (void* p : maps_) ::munmap(p, size + page());
  }
  //! The usable part of stack `i`.
  void* operator[](std::size_t i) {
    while (maps_.size() <= i) {
      void* p = ::mmap(nullptr, size + page(), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      REQUIRE(p != MAP_FAILED);
      REQUIRE(::mprotect(p, page(), PROT_NONE) == 0);
      maps_.push_back(p);
    }
    return static_cast<unsigned char*>(maps_[i]) + page();
  }

 private:
  static std::size_t page() { return static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)); }
  std::vector<void*> maps_;
};

//! What the threads of one emulated block share: the block's indices, its shared memory, the
//! barriers, each lane's last shuffle value and mma fragments, where the other lanes of its warp
//! read them, and the fibers that run the threads (run_block).
struct HostBlock {
  std::int64_t x, y;
  std::size_t bytes;  // of shared memory
  int threads;
  std::unique_ptr<unsigned char[], void (*)(unsigned char*)> shared;
  FiberBarrier block;     // the kernel's __syncthreads: its generation counts them
  FiberBarrier group;     // the emulated wgmma's own meeting of the 128 threads, not a barrier of the kernel
  std::vector<FiberBarrier> warp;
  float exchange[max_host_threads] = {};
  std::uint32_t words[max_host_threads] = {};  // the integer shuffles' values
  const bf16* rows[max_host_threads] = {};     // the addresses the lanes give an ldmatrix
  // Two sets, used by turns: a lane writes set s for its next mma only after every lane of its
  // warp has passed the barrier of the mma that read set s last.
  std::uint32_t a[2][max_host_threads][4] = {}, b[2][max_host_threads][2] = {};
  //! An emulated cp.async not yet landed (CopyTiming::at_wait).
  struct Copy {
    void* dst;
    const void* src;
    int bytes;
  };
  CopyTiming copies;
  // Each thread's copies (at_wait): started since its last commit, and committed but not waited.
  std::vector<Copy> started[max_host_threads], committed[max_host_threads];
  //! What a wgmma may read of 16 bytes of shared memory that a cp.async wrote: wgmma reads through
  //! the async proxy, so the writing thread must fence (fence.proxy.async) after the copy landed,
  //! and a barrier of the kernel must pass between that fence and the read (PTX ISA, "Async
  //! proxy"). writer -1: no cp.async wrote them.
  struct Chunk {
    int writer = -1;
    bool fenced = false;
    std::uint64_t fenced_at = 0;  // the kernel's barriers passed when it fenced
  };
  std::vector<Chunk> chunks;
  bool reported_unfenced = false;

  //! A block of `threads` threads (a multiple of 32, at most max_host_threads) with `bytes` of
  //! shared memory, whose copies land at `timing`.
  HostBlock(std::int64_t bx, std::int64_t by, std::size_t shared_bytes, int thread_count = fl::threads,
            CopyTiming timing = CopyTiming::at_issue)
      : x(bx),
        y(by),
        bytes(shared_bytes),
        threads(thread_count),
        shared(static_cast<unsigned char*>(
                   ::operator new(std::max<std::size_t>(shared_bytes, 1), std::align_val_t(shared_alignment))),
               [](unsigned char* p) { ::operator delete(p, std::align_val_t(shared_alignment)); }),
        block{thread_count},
        group{thread_count},
        warp(static_cast<std::size_t>(thread_count / 32), FiberBarrier{32}),
        copies(timing),
        chunks((shared_bytes + 15) / 16) {
    REQUIRE(thread_count % 32 == 0);
    REQUIRE(thread_count <= max_host_threads);
    // Garbage, not zeros: a kernel that reads shared memory it did not write shows it.
    std::fill(shared.get(), shared.get() + shared_bytes, static_cast<unsigned char>(0x7f));
  }
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;

  //! Runs body(t) for every thread t, each on a fiber, to the end; returns once all have ended.
  //! Fails the test (and returns) where the threads left all wait at barriers.
  void run(const std::function<void(int)>& body) {
    static thread_local FiberStacks stacks;
    fibers_.assign(static_cast<std::size_t>(threads), Fiber{});
    body_ = &body;
    for (int t = 0; t < threads; ++t) {
      Fiber& f = fibers_[static_cast<std::size_t>(t)];
      REQUIRE(::getcontext(&f.context) == 0);
      f.context.uc_stack.ss_sp = stacks[static_cast<std::size_t>(t)];
      f.context.uc_stack.ss_size = FiberStacks::size;
      f.context.uc_link = &scheduler_;
      ::makecontext(&f.context, reinterpret_cast<void (*)()>(&HostBlock::start), 1, t);
    }
    running_block() = this;
    int running = threads;
    for (bool ascending = true; running > 0; ascending = !ascending) {
      bool moved = false;
      for (int k = 0; k < threads; ++k) {
        current_ = ascending ? k : threads - 1 - k;
        Fiber& f = fibers_[static_cast<std::size_t>(current_)];
        if (f.done || (f.waiting != nullptr && f.waiting->generation == f.generation)) continue;
        f.waiting = nullptr;
        REQUIRE(::swapcontext(&scheduler_, &f.context) == 0);
        moved = true;
        running -= f.done;
      }
      if (!moved) {
        FAIL_CHECK("emulated block (" << x << ", " << y << "): " << running << " of its " << threads
                                      << " threads wait at barriers that the others never reach");
        return;
      }
    }
  }

  //! Thread `current` arrives at `barrier` and waits until all of its threads have arrived.
  void arrive_and_wait(FiberBarrier& barrier) {
    if (++barrier.arrived == barrier.expected) {  // the last: opens it and goes on
      barrier.arrived = 0;
      ++barrier.generation;
      return;
    }
    Fiber& f = fibers_[static_cast<std::size_t>(current_)];
    f.waiting = &barrier;
    f.generation = barrier.generation;
    ::swapcontext(&f.context, &scheduler_);
  }

 private:
  struct Fiber {
    ucontext_t context{};
    const FiberBarrier* waiting = nullptr;  // the barrier it waits at, in generation `generation`
    std::uint64_t generation = 0;
    bool done = false;
  };

  //! The block whose fibers run on this host thread (makecontext passes only int arguments).
  static HostBlock*& running_block() {
    static thread_local HostBlock* block = nullptr;
    return block;
  }

  //! A fiber's entry. Exceptions cannot leave a fiber: one from the body fails the test here
  //! (a failed REQUIRE's is doctest's own, already recorded); the other threads may then wait for
  //! this one at a barrier, which run() reports.
  static void start(int thread) {
    HostBlock& block = *running_block();
    try {
      (*block.body_)(thread);
    } catch (const std::exception& e) {
      FAIL_CHECK("emulated thread " << thread << " of block (" << block.x << ", " << block.y
                                    << ") threw: " << e.what());
    } catch (...) {
    }
    block.fibers_[static_cast<std::size_t>(thread)].done = true;
  }

  std::vector<Fiber> fibers_;
  const std::function<void(int)>* body_ = nullptr;
  ucontext_t scheduler_{};
  int current_ = 0;
};

//! bf16 `half` (0: bits 0-15) of a fragment word, as float.
inline float half_of(std::uint32_t word, int half) {
  return static_cast<float>(bf16::from_bits(static_cast<std::uint16_t>(word >> (16 * half))));
}

//! One thread of an emulated block: the interface of flash::DeviceThread.
class HostThread {
 public:
  HostThread(HostBlock& block, int thread) : block_(block), thread_(thread) {}

  int thread() const { return thread_; }
  std::int64_t block_x() const { return block_.x; }
  std::int64_t block_y() const { return block_.y; }
  unsigned char* shared() const { return block_.shared.get(); }
  void sync_block() const { block_.arrive_and_wait(block_.block); }
  float shuffle_xor(float value, int mask) const {
    block_.exchange[thread_] = value;
    sync_warp();
    const float other = block_.exchange[thread_ ^ mask];
    sync_warp();
    return other;
  }
  std::uint32_t shuffle_xor(std::uint32_t value, int mask) const { return shuffle(value, thread_ % 32 ^ mask); }
  //! A double's two words, each by the integer shuffle (__shfl_xor_sync's double overload).
  double shuffle_xor(double value, int mask) const {
    const auto bits = std::bit_cast<std::uint64_t>(value);
    const std::uint64_t low = shuffle_xor(static_cast<std::uint32_t>(bits), mask);
    const std::uint64_t high = shuffle_xor(static_cast<std::uint32_t>(bits >> 32), mask);
    return std::bit_cast<double>(low | high << 32);
  }
  //! `value` of lane `lane` of this thread's warp (__shfl_sync).
  std::uint32_t shuffle(std::uint32_t value, int lane) const {
    block_.words[thread_] = value;
    sync_warp();
    const std::uint32_t other = block_.words[thread_ / 32 * 32 + lane];
    sync_warp();
    return other;
  }

  //! cp.async: the first `bytes` of the 16 at `src`, zeros for the rest, written at once or at
  //! the wait that ends its group (the block's CopyTiming). A size outside [0, 16] or a source
  //! not 16-byte aligned (cp.async's rule) fails the test without throwing from the block's
  //! thread, and copies nothing.
  void copy_async(void* dst, const void* src, int bytes) const {
    if (bytes < 0 || bytes > 16 || reinterpret_cast<std::uintptr_t>(src) % 16 != 0) {
      FAIL_CHECK("cp.async of " << bytes << " bytes from " << src << ": expected 0 to 16 bytes, 16-byte aligned");
      return;
    }
    const std::size_t offset = static_cast<std::size_t>(static_cast<unsigned char*>(dst) - shared());
    if (offset % 16 != 0 || offset + 16 > block_.bytes) {
      FAIL_CHECK("cp.async to shared offset " << offset << ": expected a 16-byte-aligned 16 bytes within "
                                              << block_.bytes);
      return;
    }
    if (block_.copies == CopyTiming::at_wait) {
      block_.started[thread_].push_back({dst, src, bytes});
      return;
    }
    land({dst, src, bytes});
  }
  //! cp.async.commit_group: the copies started since the last commit form a group.
  void commit_copies() const {
    auto& from = block_.started[thread_];
    block_.committed[thread_].insert(block_.committed[thread_].end(), from.begin(), from.end());
    from.clear();
  }
  //! cp.async.wait_group 0: every committed copy of this thread has landed (one started and not
  //! committed has not: it lands at a wait after its commit, or never).
  void wait_copies() const {
    for (const HostBlock::Copy& c : block_.committed[thread_]) land(c);
    block_.committed[thread_].clear();
  }

  //! ldmatrix.m8n8.x4 by its PTX layout: lanes 8 j .. 8 j + 7 give the rows of matrix j, and
  //! lane l receives, of each matrix, row l / 4 at columns 2 (l % 4) and 2 (l % 4) + 1; with
  //! .trans, the transposed elements (rows 2 (l % 4) and 2 (l % 4) + 1, column l / 4). The lower
  //! index goes in bits 0-15; matrices 0..3 fill b[0][0], b[0][1], b[1][0], b[1][1].
  void load_b_rows(fl::FragmentB (&b)[2], const bf16* lane_row) const { ldmatrix(b, lane_row, false); }
  void load_b_transposed(fl::FragmentB (&b)[2], const bf16* lane_row) const { ldmatrix(b, lane_row, true); }

  //! d += a b over the warp's fragments, by the m16n8k16 layout (flash_attention.cuh's file
  //! comment): every lane publishes its a and b, and computes its own 4 elements of d from all 32.
  void mma(fl::FragmentC& d, const fl::FragmentA& a, const fl::FragmentB& b) {
    const int set = turn_++ % 2, warp = thread_ / 32 * 32, lane = thread_ % 32;
    std::copy(std::begin(a), std::end(a), block_.a[set][thread_]);
    std::copy(std::begin(b), std::end(b), block_.b[set][thread_]);
    sync_warp();
    const auto a_at = [&](int row, int k) {  // A(row, k): lane 4 (row % 8) + (k % 8) / 2
      const int owner = warp + 4 * (row % 8) + (k % 8) / 2, reg = row / 8 + 2 * (k / 8);
      return half_of(block_.a[set][owner][reg], k % 2);
    };
    const auto b_at = [&](int k, int col) {  // B(k, col): lane 4 col + (k % 8) / 2
      const int owner = warp + 4 * col + (k % 8) / 2, reg = k / 8;
      return half_of(block_.b[set][owner][reg], k % 2);
    };
    for (int i = 0; i < 4; ++i) {
      const int row = lane / 4 + 8 * (i / 2), col = 2 * (lane % 4) + i % 2;
      float sum = d[i];
      for (int k = 0; k < 16; ++k) sum += a_at(row, k) * b_at(k, col);
      d[i] = sum;
    }
  }

  //! The offset of `p` in the block's shared memory: the emulation's shared address.
  std::uint32_t shared_address(const void* p) const {
    return static_cast<std::uint32_t>(static_cast<const unsigned char*>(p) - shared());
  }
  //! fence.proxy.async.shared::cta: this thread's landed copies become visible to wgmma once a
  //! barrier of the kernel has passed.
  void fence_async_shared() const {
    for (HostBlock::Chunk& c : block_.chunks)
      if (c.writer == thread_ && !c.fenced) c = {thread_, true, block_.block.generation};
  }
  template <int N, int K>
  void group_begin(fl::FragmentC (&)[N], const fl::FragmentA (&)[K]) const {}
  template <int N>
  void group_end(fl::FragmentC (&)[N]) const {}

  //! wgmma.mma_async.m64n(8N)k16 with A in registers, done at once, by its PTX layouts: the
  //! block's 128 threads are the warpgroup; each publishes its A fragment (warp w's lane 4 g + p
  //! holds rows 16 w + g and + 8 at columns 2 p, 2 p + 1 and those + 8, as mma.sync's) and
  //! computes its own elements of d (row 16 w + g + 8 (i / 2), column 8 j + 2 p + i % 2 in
  //! d[j][i]), reading B from shared memory by the descriptor: start address, leading and stride
  //! byte offsets (each in 16-byte units), the 128-byte swizzle (mode 1, the only one the kernels
  //! use, base offset 0). B(k, n) is at byte start + (n / 8) SBO + (n % 8) 128 + 2 k (K-major) or
  //! start + (n / 64) LBO + (k / 8) SBO + (k % 8) 128 + 2 (n % 64) (MN-major, Transposed), then
  //! bits 4-6 of that address XOR bits 7-9. The sums run over k in order, starting from d, as the
  //! mma emulation's: the same bits as the m16n8k16 products over the same k.
  template <bool Transposed, int N>
  void group_mma(fl::FragmentC (&d)[N], const fl::FragmentA& a, std::uint64_t descriptor) {
    if (block_.threads != fl::threads) {
      FAIL_CHECK("wgmma needs a block of one warpgroup (" << fl::threads << " threads), not " << block_.threads);
      return;
    }
    const int set = turn_++ % 2, lane = thread_ % 32, warp = thread_ / 32;
    std::copy(std::begin(a), std::end(a), block_.a[set][thread_]);
    block_.arrive_and_wait(block_.group);
    const auto field = [&](int shift) { return static_cast<std::uint32_t>(descriptor >> shift & 0x3FFFu) << 4; };
    const std::uint32_t start = field(0), leading = field(16), stride = field(32);
    if (descriptor >> 62 != 1 || (descriptor >> 49 & 7u) != 0) {
      FAIL_CHECK("wgmma descriptor " << descriptor << ": expected the 128-byte swizzle, base offset 0");
      return;
    }
    const auto a_at = [&](int row, int k) {
      const int owner = 32 * (row / 16) + 4 * (row % 8) + (k % 8) / 2, reg = row % 16 / 8 + 2 * (k / 8);
      return half_of(block_.a[set][owner][reg], k % 2);
    };
    bool inside = true;
    const HostBlock::Chunk* unfenced = nullptr;  // the first chunk read that the async proxy may not see
    const auto b_at = [&](int k, int n) {
      std::uint32_t byte = Transposed ? start + n / 64 * leading + k / 8 * stride + k % 8 * 128 + 2 * (n % 64)
                                      : start + n / 8 * stride + n % 8 * 128 + 2 * k;
      byte ^= (byte >> 7 & 7u) << 4;
      if (byte + sizeof(bf16) > block_.bytes) {
        inside = false;
        return 0.0f;
      }
      const HostBlock::Chunk& chunk = block_.chunks[byte / 16];
      if (chunk.writer >= 0 && (!chunk.fenced || chunk.fenced_at == block_.block.generation) && unfenced == nullptr)
        unfenced = &chunk;
      bf16 value;
      std::memcpy(&value, shared() + byte, sizeof value);
      return static_cast<float>(value);
    };
    for (int j = 0; j < N; ++j)
      for (int i = 0; i < 4; ++i) {
        const int row = 16 * warp + lane / 4 + 8 * (i / 2), col = 8 * j + 2 * (lane % 4) + i % 2;
        float sum = d[j][i];
        for (int k = 0; k < 16; ++k) sum += a_at(row, k) * b_at(k, col);
        d[j][i] = sum;
      }
    if (!inside) FAIL_CHECK("wgmma read B past the block's " << block_.bytes << " bytes of shared memory");
    if (unfenced != nullptr && !block_.reported_unfenced) {  // once a block: every thread reads them
      block_.reported_unfenced = true;
      const std::string why = unfenced->fenced ? "fenced with no barrier of the kernel since"
                                               : "with no fence.proxy.async after it landed";
      FAIL_CHECK("wgmma read shared memory that thread " << unfenced->writer << "'s cp.async wrote, " << why);
    }
  }

 private:
  void sync_warp() const { block_.arrive_and_wait(block_.warp[static_cast<std::size_t>(thread_ / 32)]); }

  void ldmatrix(fl::FragmentB (&b)[2], const bf16* lane_row, bool transposed) const {
    block_.rows[thread_] = lane_row;
    sync_warp();
    const int warp = thread_ / 32 * 32, lane = thread_ % 32;
    for (int j = 0; j < 4; ++j) {
      const bf16* const* rows = block_.rows + warp + 8 * j;
      const bf16 lo = transposed ? rows[2 * (lane % 4)][lane / 4] : rows[lane / 4][2 * (lane % 4)];
      const bf16 hi = transposed ? rows[2 * (lane % 4) + 1][lane / 4] : rows[lane / 4][2 * (lane % 4) + 1];
      b[j / 2][j % 2] = static_cast<std::uint32_t>(lo.bits) | static_cast<std::uint32_t>(hi.bits) << 16;
    }
    sync_warp();
  }

  //! A copy's 16 bytes written, by this thread through the generic proxy, not yet fenced.
  void land(const HostBlock::Copy& c) const {
    std::memcpy(c.dst, c.src, static_cast<std::size_t>(c.bytes));
    std::memset(static_cast<unsigned char*>(c.dst) + c.bytes, 0, static_cast<std::size_t>(16 - c.bytes));
    block_.chunks[static_cast<std::size_t>(static_cast<unsigned char*>(c.dst) - shared()) / 16] = {thread_, false, 0};
  }

  HostBlock& block_;
  int thread_;
  int turn_ = 0;
};

//! Runs `body(HostThread&)` for every thread of `block`.
template <class Body>
void run_block(HostBlock& block, Body&& body) {
  block.run([&](int t) {
    HostThread th(block, t);
    body(th);
  });
}

//! Runs `body(HostThread&)` for every block of a grid_x x grid_y grid of `threads`-thread blocks
//! (a multiple of 32; the tiled attention kernels' 128 unless given), one block at a time, their
//! copies landing at `timing`.
template <class Body>
void run_grid(std::int64_t grid_x, std::int64_t grid_y, std::size_t shared_bytes, Body&& body,
              int threads_per_block = fl::threads, CopyTiming timing = CopyTiming::at_issue) {
  for (std::int64_t y = 0; y < grid_y; ++y)
    for (std::int64_t x = 0; x < grid_x; ++x) {
      HostBlock block(x, y, shared_bytes, threads_per_block, timing);
      run_block(block, body);
    }
}

}  // namespace loom::cuda_test
