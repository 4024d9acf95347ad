// The SRAM-tiled causal attention kernels (detail/flash_attention.cuh) against a double reference,
// on bf16 data at head sizes 32, 64 and 128 and token counts that leave partial tiles.
//
// Without a GPU the kernel bodies still run here: HostThread runs each block with its 128 threads
// as host threads (barriers for __syncthreads and __syncwarp, a shared exchange for the shuffles)
// and the WMMA tile operations in float by lane 0 of each warp, whose results the other lanes see
// only through a barrier, as on the GPU. It also checks WMMA's rules on every tile pointer (256-bit
// aligned) and leading dimension (a multiple of 16 bytes). So the tiling, the online softmax, the
// causal mask, the partial tiles, the barriers and the indexing are checked without a GPU; with
// one, the same checks run on the device kernels through attention_forward_lse/backward_lse, and
// against the cuBLAS path.
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
#include <atomic>
#include <barrier>
#include <bit>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <new>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "loom/backend/cuda/attention.cuh"
#include "loom/backend/cuda/detail/flash_attention.cuh"
#include "loom/core/bf16.hpp"
#include "attention_case.hpp"
#include "device_check.hpp"

using namespace loom;
using namespace loom::cuda_test;

namespace {

namespace fl = detail::flash;

// ---------------------------------------------------------------------------------------------
// The host emulation of a block.

//! WMMA rule violations seen by HostThread (a pointer not 32-byte aligned, a leading dimension
//! not a multiple of 16 bytes).
std::atomic<int> wmma_rule_violations{0};

//! What the threads of one emulated block share.
struct HostBlock {
  std::int64_t x, y;
  std::unique_ptr<unsigned char[], void (*)(unsigned char*)> shared;
  std::barrier<> block{fl::threads};
  std::deque<std::barrier<>> warp;  // a deque: barriers do not move
  float exchange[fl::threads] = {};

  HostBlock(std::int64_t bx, std::int64_t by, std::size_t bytes)
      : x(bx),
        y(by),
        shared(static_cast<unsigned char*>(::operator new(std::max<std::size_t>(bytes, 1), std::align_val_t(128))),
               [](unsigned char* p) { ::operator delete(p, std::align_val_t(128)); }) {
    for (int w = 0; w < fl::warps; ++w) warp.emplace_back(32);
    // Garbage, not zeros: a kernel that reads shared memory it did not write shows it.
    std::fill(shared.get(), shared.get() + bytes, static_cast<unsigned char>(0x7f));
  }
};

//! One thread of an emulated block: the interface of flash::DeviceThread.
class HostThread {
 public:
  struct Acc {
    float v[256];
  };
  struct RowA {
    float v[256];  // (i, k) at v[16 i + k]
  };
  struct RowB {
    float v[256];  // (k, n) at v[16 k + n]
  };
  struct ColB {
    float v[256];  // (k, n) at v[16 k + n], read from column-major memory
  };

  HostThread(HostBlock& block, int thread) : block_(block), thread_(thread) {}

  int thread() const { return thread_; }
  std::int64_t block_x() const { return block_.x; }
  std::int64_t block_y() const { return block_.y; }
  unsigned char* shared() const { return block_.shared.get(); }
  void sync_block() const { block_.block.arrive_and_wait(); }
  void sync_warp() const { block_.warp[static_cast<std::size_t>(thread_ / 32)].arrive_and_wait(); }
  float swap_pair(float value) const { return shuffle_xor(value, 1); }
  float shuffle_xor(float value, int mask) const {
    block_.exchange[thread_] = value;
    sync_warp();
    const float other = block_.exchange[thread_ ^ mask];
    sync_warp();
    return other;
  }

  // The tile operations: lane 0 of the warp computes them; the other lanes' fragments are never
  // stored, so they skip the work.
  void zero(Acc& c) const {
    if (lead()) std::fill(std::begin(c.v), std::end(c.v), 0.0f);
  }
  void load(RowA& f, const bf16* p, unsigned ld) const { load_bf16(f.v, p, ld, false); }
  void load(RowB& f, const bf16* p, unsigned ld) const { load_bf16(f.v, p, ld, false); }
  void load(ColB& f, const bf16* p, unsigned ld) const { load_bf16(f.v, p, ld, true); }
  void load(Acc& f, const float* p, unsigned ld) const {
    if (!lead()) return;
    check_rules(p, ld * sizeof(float));
    for (int i = 0; i < 16; ++i)
      for (int n = 0; n < 16; ++n) f.v[16 * i + n] = p[i * ld + n];
  }
  template <class B>
  void mma(Acc& c, const RowA& a, const B& b) const {
    if (!lead()) return;
    for (int i = 0; i < 16; ++i)
      for (int n = 0; n < 16; ++n) {
        float sum = c.v[16 * i + n];
        for (int k = 0; k < 16; ++k) sum += a.v[16 * i + k] * b.v[16 * k + n];
        c.v[16 * i + n] = sum;
      }
  }
  void store(float* p, const Acc& c, unsigned ld) const {
    if (!lead()) return;
    check_rules(p, ld * sizeof(float));
    for (int i = 0; i < 16; ++i)
      for (int n = 0; n < 16; ++n) p[i * ld + n] = c.v[16 * i + n];
  }

 private:
  bool lead() const { return thread_ % 32 == 0; }
  static void check_rules(const void* p, std::size_t ld_bytes) {
    if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0 || ld_bytes % 16 != 0) ++wmma_rule_violations;
  }
  //! A 16 x 16 bf16 tile: element (row, col) of the fragment at p[row ld + col], or at
  //! p[col ld + row] where `column_major`.
  void load_bf16(float* v, const bf16* p, unsigned ld, bool column_major) const {
    if (!lead()) return;
    check_rules(p, ld * sizeof(bf16));
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) v[16 * i + j] = static_cast<float>(column_major ? p[j * ld + i] : p[i * ld + j]);
  }

  HostBlock& block_;
  int thread_;
};

//! Runs `body(HostThread&)` for every block of a grid_x x grid_y grid, one block at a time.
template <class Body>
void run_grid(std::int64_t grid_x, std::int64_t grid_y, std::size_t shared_bytes, Body&& body) {
  for (std::int64_t y = 0; y < grid_y; ++y)
    for (std::int64_t x = 0; x < grid_x; ++x) {
      HostBlock block(x, y, shared_bytes);
      std::vector<std::jthread> threads;
      threads.reserve(fl::threads);
      for (int t = 0; t < fl::threads; ++t)
        threads.emplace_back([&block, &body, t] {
          HostThread th(block, t);
          body(th);
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Cases, data and the double reference.

using Case = AttentionCase;

//! Partial tiles (T % 64 != 0), one token, exactly one and two tiles, each head size.
std::vector<Case> host_cases() {
  return {{1, 1, 1, 32}, {2, 70, 2, 32}, {1, 64, 1, 64}, {1, 129, 2, 64}, {2, 33, 1, 128}, {1, 100, 1, 128}};
}

std::vector<bf16> random_bf16(std::int64_t n, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  const std::vector<float> f = random_floats(n, seed, lo, hi);
  std::vector<bf16> v(f.size());
  std::transform(f.begin(), f.end(), v.begin(), [](float x) { return bf16(x); });
  return v;
}

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

//! The exact forward and backward from the bf16 inputs, in double. The kernels' backward reads
//! their own bf16 out for D = dout·out; the dq and dk magnitudes include sum |dout| |out| for it.
Reference reference(const Case& c, const Data& data) {
  const std::vector<double> qkv = widen(data.qkv), dout = widen(data.dout), dqkv0 = widen(data.dqkv0);
  const std::int64_t T = c.T, C = c.C(), hs = c.hs;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  const auto q = [&](std::int64_t b, std::int64_t t, std::int64_t part, std::int64_t h, std::int64_t i) {
    return (b * T + t) * 3 * C + part * C + h * hs + i;
  };
  const auto o = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t i) {
    return (b * T + t) * C + h * hs + i;
  };
  Reference r;
  r.out = {std::vector<double>(static_cast<std::size_t>(c.B * T * C)), std::vector<double>(c.B * T * C)};
  r.lse = {std::vector<double>(static_cast<std::size_t>(c.B * c.NH * T)), std::vector<double>(c.B * c.NH * T)};
  r.dqkv = {dqkv0, std::vector<double>(dqkv0.size())};
  std::vector<double> p(static_cast<std::size_t>(T * T)), dp(p.size()), ds(p.size()), ds_mag(p.size());
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.NH; ++h) {
      for (std::int64_t t = 0; t < T; ++t) {
        double max = -std::numeric_limits<double>::infinity();
        for (std::int64_t s = 0; s <= t; ++s) {
          double x = 0;
          for (std::int64_t i = 0; i < hs; ++i) x += qkv[q(b, t, 0, h, i)] * qkv[q(b, s, 1, h, i)];
          p[t * T + s] = x * scale;
          max = std::max(max, x * scale);
        }
        double sum = 0;
        for (std::int64_t s = 0; s <= t; ++s) sum += std::exp(p[t * T + s] - max);
        const std::int64_t row = (b * c.NH + h) * T + t;
        r.lse.value[row] = max + std::log(sum);
        r.lse.magnitude[row] = 1 + std::abs(r.lse.value[row]);
        for (std::int64_t s = 0; s <= t; ++s) p[t * T + s] = std::exp(p[t * T + s] - max) / sum;
        for (std::int64_t i = 0; i < hs; ++i) {
          double value = 0, magnitude = 0;
          for (std::int64_t s = 0; s <= t; ++s) {
            value += p[t * T + s] * qkv[q(b, s, 2, h, i)];
            magnitude += p[t * T + s] * std::abs(qkv[q(b, s, 2, h, i)]);
          }
          r.out.value[o(b, t, h, i)] = value;
          r.out.magnitude[o(b, t, h, i)] = magnitude;
        }
      }
      // The backward: dP = dout v^T, D = sum_s P dP, dS = P (dP - D) scale.
      for (std::int64_t t = 0; t < T; ++t) {
        double d = 0, d_mag = 0;
        for (std::int64_t s = 0; s <= t; ++s) {
          double x = 0;
          for (std::int64_t i = 0; i < hs; ++i) x += dout[o(b, t, h, i)] * qkv[q(b, s, 2, h, i)];
          dp[t * T + s] = x;
          d += p[t * T + s] * x;
          d_mag += p[t * T + s] * std::abs(x);
        }
        for (std::int64_t i = 0; i < hs; ++i) d_mag += std::abs(dout[o(b, t, h, i)] * r.out.value[o(b, t, h, i)]);
        for (std::int64_t s = 0; s <= t; ++s) {
          ds[t * T + s] = p[t * T + s] * (dp[t * T + s] - d) * scale;
          ds_mag[t * T + s] = p[t * T + s] * (std::abs(dp[t * T + s]) + d_mag) * scale;
        }
      }
      for (std::int64_t i = 0; i < hs; ++i)
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t s = 0; s <= t; ++s) {
            const double pts = p[t * T + s];
            r.dqkv.value[q(b, s, 2, h, i)] += pts * dout[o(b, t, h, i)];  // dv
            r.dqkv.magnitude[q(b, s, 2, h, i)] += pts * std::abs(dout[o(b, t, h, i)]);
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

std::vector<float> to_floats(const std::vector<bf16>& v) {
  std::vector<float> f(v.size());
  std::transform(v.begin(), v.end(), f.begin(), [](bf16 x) { return static_cast<float>(x); });
  return f;
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
  check_expected(to_floats(out), r.out, bf16_tolerance, bf16_rounding, "out");
  check_expected(lse, r.lse, lse_error, 0.0, "lse");
  check_expected(to_floats(dqkv), r.dqkv, bf16_tolerance, bf16_rounding, "dqkv");
}

//! What one forward and backward gave, on the host emulation or on the GPU.
struct Result {
  std::vector<bf16> out, dqkv;
  std::vector<float> lse;
};

//! The forward, then the backward from its own out and lse (the training path), on the host.
Result run_on_host(const Case& c, const Data& data) {
  const fl::Shape shape{c.T, c.C(), static_cast<int>(c.NH), 1.0f / std::sqrt(static_cast<float>(c.hs))};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Result r{std::vector<bf16>(static_cast<std::size_t>(c.B * c.T * c.C()), bf16(nan)), data.dqkv0,
               std::vector<float>(static_cast<std::size_t>(c.B * c.NH * c.T), nan)};
  std::vector<float> delta(r.lse.size(), nan);
  const std::int64_t grid_x = c.B * c.NH, grid_y = fl::tiles(c.T), rows = c.B * c.NH * c.T;
  detail::cuda_attention::with_head_size(c.dims(), [&]<int HS>() {
    const fl::ForwardArgs fa{shape, data.qkv.data(), r.out.data(), r.lse.data()};
    run_grid(grid_x, grid_y, fl::ForwardSmem<HS>::total, [&](HostThread& th) { fl::forward_block<HS>(th, fa); });
    run_grid((rows + fl::warps - 1) / fl::warps, 1, 0, [&](HostThread& th) {
      fl::delta_block<HS>(th, r.out.data(), data.dout.data(), delta.data(), shape, rows);
    });
    const fl::BackwardArgs ba{shape, data.qkv.data(), data.dout.data(), r.lse.data(), delta.data(), r.dqkv.data()};
    run_grid(grid_x, grid_y, fl::BackwardSmem<HS>::total,
             [&](HostThread& th) { fl::key_value_grad_block<HS>(th, ba); });
    run_grid(grid_x, grid_y, fl::BackwardSmem<HS>::total, [&](HostThread& th) { fl::query_grad_block<HS>(th, ba); });
  });
  return r;
}

TEST_CASE("flash attention's shared memory fits an H100 block and keeps WMMA's alignment") {
  // 227 KiB is the H100's (sm_90) largest dynamic shared memory per block.
  constexpr std::size_t h100 = 227 * 1024;
  CHECK(fl::ForwardSmem<64>::total == 64 * 1024);
  CHECK(fl::ForwardSmem<128>::total <= h100);
  CHECK(fl::BackwardSmem<128>::total <= h100);
  for (const std::size_t offset : {fl::ForwardSmem<32>::p, fl::ForwardSmem<32>::o, fl::BackwardSmem<32>::floats,
                                   fl::BackwardSmem<32>::p, fl::BackwardSmem<32>::ds, fl::BackwardSmem<64>::total})
    CHECK(offset % 128 == 0);
  CHECK(fl::supported_head_size(64));
  CHECK_FALSE(fl::supported_head_size(48));
}

TEST_CASE("the tiled kernels' bodies match the reference (host emulation of the blocks and of WMMA)") {
  std::uint32_t seed = 100;
  for (const Case& c : host_cases()) {
    CAPTURE(c);
    const Data data = make_data(c, seed += 10);
    wmma_rule_violations = 0;
    const Result got = run_on_host(c, data);
    CHECK(wmma_rule_violations == 0);
    check_all(reference(c, data), got.out, got.lse, got.dqkv);
  }
}

TEST_CASE("the tiled kernels' bodies give the same bits for the same input (host emulation)") {
  const Case c{1, 129, 2, 64};
  const Data data = make_data(c, 7);
  const Result a = run_on_host(c, data), b = run_on_host(c, data);
  CHECK(std::equal(a.out.begin(), a.out.end(), b.out.begin()));
  CHECK(std::equal(a.dqkv.begin(), a.dqkv.end(), b.dqkv.begin()));
  CHECK(std::equal(a.lse.begin(), a.lse.end(), b.lse.begin(),
                   [](float x, float y) { return std::bit_cast<std::uint32_t>(x) == std::bit_cast<std::uint32_t>(y); }));
}

// ---------------------------------------------------------------------------------------------
// On the GPU.

//! The forward and backward through the public kernels on `be` (flash or cuBLAS per its switch).
Result run_on_device(cuda& be, const Case& c, const Data& data) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const Shape qkv_shape{c.B, c.T, 3 * c.C()}, out_shape{c.B, c.T, c.C()};
  const DeviceArray<bf16> qkv(be, data.qkv, qkv_shape), dout(be, data.dout, out_shape),
      dqkv(be, data.dqkv0, qkv_shape);
  const DeviceArray<bf16> out(be, std::vector<bf16>(static_cast<std::size_t>(out_shape.numel()), bf16(nan)),
                              out_shape);
  const DeviceArray<float> lse(be, std::vector<float>(static_cast<std::size_t>(c.B * c.NH * c.T), nan),
                               Shape{c.B, c.NH, c.T});
  const int heads = static_cast<int>(c.NH);
  attention_forward_lse<bf16>(be, out.view(), lse.view(), qkv.cview(), heads);
  attention_backward_lse<bf16>(be, dqkv.view(), dout.cview(), qkv.cview(), out.cview(), lse.cview(), heads);
  return {out.to_host(be), dqkv.to_host(be), lse.to_host(be)};
}

std::vector<Case> device_cases() {
  std::vector<Case> cases = host_cases();
  cases.push_back({4, 1024, 12, 64});  // GPT-2 small's attention at sequence 1024
  cases.push_back({2, 333, 4, 128});
  return cases;
}

//! Whether the GPU is sm_80 or newer; then this program must have the tiled kernels for it (it is
//! built with compute_80 PTX beside CMake's architectures; tests/cuda/CMakeLists.txt).
bool tiled_kernels_run(cuda& be) {
  int major = 0;
  REQUIRE(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, be.device()) == cudaSuccess);
  if (major < 8) {
    MESSAGE("GPU older than sm_80: no bf16 WMMA, the tiled kernels are not used or tested");
    CHECK_FALSE(flash_attention_available(be));
    return false;
  }
  REQUIRE(flash_attention_available(be));
  CHECK_FALSE(be.flash_attention());  // off by default (slower than cuBLAS so far)
  be.set_flash_attention(true);
  return true;
}

TEST_CASE("attention_forward_lse/backward_lse on the tiled kernels match the reference; same bits each run") {
  if (!have_gpu()) return;
  cuda be(0);
  if (!tiled_kernels_run(be)) return;
  std::uint32_t seed = 300;
  for (const Case& c : device_cases()) {
    CAPTURE(c);
    const Data data = make_data(c, seed += 10);
    const Reference ref = reference(c, data);
    const Result first = run_on_device(be, c, data);
    check_all(ref, first.out, first.lse, first.dqkv);
    const Result second = run_on_device(be, c, data);
    CHECK(std::equal(first.dqkv.begin(), first.dqkv.end(), second.dqkv.begin()));
    CHECK(std::equal(first.out.begin(), first.out.end(), second.out.begin()));
  }
}

TEST_CASE("the tiled kernels and the cuBLAS path agree; the tiled forward takes no workspace, its backward B NH T "
          "floats") {
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
}

}  // namespace

int main(int argc, char** argv) { return run_tests(argc, argv); }
