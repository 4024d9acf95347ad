// loom_cuda_attention_bench: the CUDA attention kernels on bf16, one layer's shape, side by side:
//   stored   attention_forward/backward: cuBLAS strided-batched GEMMs, the probabilities
//            [B,H,T,T] kept between them;
//   cublas   attention_forward_lse/backward_lse with cuda::set_flash_attention(false): the same
//            GEMMs through [H,T,T] workspace of one batch element, only lse [B,H,T] kept;
//   tiled    attention_forward_lse/backward_lse on the SRAM-tiled tensor-core kernels
//            (cuda::set_flash_attention(true); bf16, head size 32, 64 or 128): nothing T x T.
// Prints each kernel's median time (CUDA events around each call), TFLOP/s and the workspace it
// took, and the ratios of the tiled pair to the other two. With attention dropout (--dropout, 0.1
// by default; 0: none), the cublas and tiled pairs again with the mask drawn: the cuBLAS path
// drops a copy of each batch element's probabilities through the dropout kernel, the tiled
// kernels draw the mask in registers; it prints what dropout costs each. Then, at head size 64,
// each tiled kernel in three layouts side by side: a warp owning 1 block of 16 rows, bounded for
// 2 or for 3 blocks an SM, and a warp owning 2 (blocks of 128 rows, 2 an SM); and, with dropout,
// its key/value kernel bounded for 2 and for 3 blocks. Where the program is built for sm_90a
// (-DCMAKE_CUDA_ARCHITECTURES=90a) and the head size is 64, the tiled pair again on wgmma
// (cuda::set_warpgroup_attention(true)), against the mma.sync pair of the same rounds.
//
//   loom_cuda_attention_bench                              # B=8, T=1024, C=768, 12 heads (GPT-2 small)
//   loom_cuda_attention_bench --seq 2048 --batch 4 --json attention_gpu.json
//
// FLOPs follow FlashAttention-2's convention for causal attention (Dao, 2023): forward
// 4·B·H·T²·hs / 2, backward 2.5 times the forward, whatever each implementation recomputes, so
// TFLOP/s compares like with like. The kernels take turns, round by round; the first round is
// not timed. Without a GPU it says so and exits 77 (ctest: skipped).

#include <CLI/CLI.hpp>
#include <cuda_runtime_api.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "loom/backend/cuda/kernels.cuh"
#include "loom/core/buffer.hpp"

namespace {

struct Options {
  std::int64_t batch = 8, seq = 1024, channels = 768;
  int heads = 12;
  int calls = 20;  // timed calls per kernel
  double dropout = 0.1;  // attention dropout of the dropout rows (0: none)
  std::string json;
};

//! A device array of bf16, uniform in [lo, hi), keyed by `name`.
loom::Buffer<loom::bf16, loom::cuda> random_device(loom::cuda& be, std::int64_t n, const char* name, float lo,
                                                   float hi) {
  const std::vector<float> values = loom::bench::uniform_values(n, 11, name, lo, hi);
  std::vector<loom::bf16> host(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) host[i] = loom::bf16(values[i]);
  loom::Buffer<loom::bf16, loom::cuda> buffer(be, n, loom::MemoryCategory::activations);
  be.copy_from_host(buffer.data(), host.data(), buffer.bytes());
  return buffer;
}

//! Milliseconds of `run` on the backend's stream, between two events.
double time_ms(loom::cuda& be, const std::function<void()>& run) {
  cudaEvent_t start, stop;
  LOOM_CUDA_CHECK(cudaEventCreate(&start));
  LOOM_CUDA_CHECK(cudaEventCreate(&stop));
  LOOM_CUDA_CHECK(cudaEventRecord(start, be.stream()));
  run();
  LOOM_CUDA_CHECK(cudaEventRecord(stop, be.stream()));
  LOOM_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  LOOM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  LOOM_CUDA_CHECK(cudaEventDestroy(start));
  LOOM_CUDA_CHECK(cudaEventDestroy(stop));
  return ms;
}

//! The tiled kernels one by one in three layouts, head size 64 (GPT-2's), interleaved round by
//! round: each warp owning M = 1 block of 16 rows with the registers bounded for 2 or for 3 blocks
//! an SM (__launch_bounds__; ptxas spills some at 3's 168), and M = 2 (a block of 128 rows, each
//! B fragment read from shared memory serving two mma; 2 blocks an SM). The library launches each
//! kernel's M (detail::flash::row_blocks) at detail::flash::blocks_per_sm(HS, M). With an active
//! `drop`, also the key/value dropout kernel at 2 blocks an SM (the library's) and 3. Prints each
//! variant's registers, spilled bytes and median time, and its time against the library's layout.
void compare_layouts(loom::cuda& be, std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t H,
                     const loom::bf16* qkv, const loom::bf16* dout, loom::bf16* out, float* lse, loom::bf16* dqkv,
                     const loom::AttentionDropout& drop, int calls, nlohmann::json& report) {
  namespace flash = loom::detail::flash;
  using loom::detail::cuda_attention::launch_tiled;
  if (C / H != 64) {
    std::puts("tiled layouts: compared at head size 64 only (this run's is another)");
    return;
  }
  constexpr int HS = 64;
  const flash::Shape shape{T, C, static_cast<int>(H), 1.0f / 8.0f, loom::AttentionMask::causal, nullptr};
  const std::int64_t rows = B * H * T;
  loom::Buffer<float, loom::cuda> delta(be, rows, loom::MemoryCategory::workspace);
  const flash::ForwardArgs forward{shape, qkv, out, lse};
  const flash::BackwardArgs backward{shape, qkv, dout, lse, delta.data(), dqkv};
  const auto grid = [&](int m) {
    return dim3(static_cast<unsigned>(B * H), static_cast<unsigned>(flash::row_tiles(T, m)));
  };
  // out and lse of this forward, and delta from them, for the backward kernels.
  launch_tiled(be, flash::forward_kernel<HS>, grid(flash::row_blocks.forward), flash::ForwardSmem<HS>::total,
               "bench", "forward", forward);
  launch_tiled(be, flash::delta_kernel<HS>, dim3(flash::delta_blocks<HS>(rows)), 0, "bench", "delta", out, dout,
               delta.data(), shape, rows);

  struct Variant {
    std::string kernel;
    int m, blocks, library_blocks;  // the last: the blocks an SM the library builds this kernel for
    std::function<void()> run;
    cudaFuncAttributes attributes{};
    std::vector<double> ms;
  };
  std::vector<Variant> variants;
  const auto add = [&](const char* kernel, int m, int blocks, auto function, std::size_t smem, const auto&... args) {
    const int library_blocks = std::string(kernel) == "key_value_grad_dropout"
                                   ? flash::dropout_key_value_blocks_per_sm(HS, m)
                                   : flash::blocks_per_sm(HS, m);
    Variant v{kernel, m, blocks, library_blocks, [&be, function, g = grid(m), smem, args..., kernel] {
                launch_tiled(be, function, g, smem, "bench", kernel, args...);
              }};
    LOOM_CUDA_CHECK(cudaFuncGetAttributes(&v.attributes, function));
    variants.push_back(std::move(v));
  };
  using FS = flash::ForwardSmem<HS>;
  using KS = flash::KeyValueGradSmem<HS>;
  using QS = flash::QueryGradSmem<HS>;
  add("forward", 1, 2, flash::forward_kernel<HS, 1, 2>, FS::total, forward);
  add("forward", 1, 3, flash::forward_kernel<HS, 1, 3>, FS::total, forward);
  add("forward", 2, 2, flash::forward_kernel<HS, 2, 2>, FS::total, forward);
  add("key_value_grad", 1, 2, flash::key_value_grad_kernel<HS, 1, 2>, KS::total, backward);
  add("key_value_grad", 1, 3, flash::key_value_grad_kernel<HS, 1, 3>, KS::total, backward);
  add("key_value_grad", 2, 2, flash::key_value_grad_kernel<HS, 2, 2>, KS::total, backward);
  add("query_grad", 1, 2, flash::query_grad_kernel<HS, 1, 2>, QS::total, backward);
  add("query_grad", 1, 3, flash::query_grad_kernel<HS, 1, 3>, QS::total, backward);
  add("query_grad", 2, 2, flash::query_grad_kernel<HS, 2, 2>, QS::total, backward);
  // With dropout the key/value kernel is bounded for 2 blocks an SM (at 3 ptxas spills 164 bytes).
  if (drop.mask.active()) {
    add("key_value_grad_dropout", 1, 2, flash::key_value_grad_dropout_kernel<HS, 1, 2>, KS::total, backward, drop);
    add("key_value_grad_dropout", 1, 3, flash::key_value_grad_dropout_kernel<HS, 1, 3>, KS::total, backward, drop);
  }
  for (int round = 0; round <= calls; ++round)
    for (Variant& v : variants) {
      const double ms = time_ms(be, v.run);
      if (round > 0) v.ms.push_back(ms);
    }
  const auto library_m = [](const std::string& kernel) {
    return kernel == "forward"                                              ? flash::row_blocks.forward
           : kernel == "key_value_grad" || kernel == "key_value_grad_dropout" ? flash::row_blocks.key_value_grad
                                                                            : flash::row_blocks.query_grad;
  };
  std::printf("tiled kernels by layout (M row blocks a warp, blocks an SM; the library's: M = %d, %d and %d)\n",
              flash::row_blocks.forward, flash::row_blocks.key_value_grad, flash::row_blocks.query_grad);
  // Each kernel's variants are consecutive.
  for (std::size_t first = 0, end = 0; first < variants.size(); first = end) {
    for (end = first; end < variants.size() && variants[end].kernel == variants[first].kernel;) ++end;
    double library_ms = 0;
    std::vector<double> medians;
    for (std::size_t i = first; i < end; ++i) {
      medians.push_back(loom::bench::summarize(variants[i].ms).median);
      if (variants[i].m == library_m(variants[i].kernel) && variants[i].blocks == variants[i].library_blocks)
        library_ms = medians.back();
    }
    for (std::size_t i = first; i < end; ++i) {
      const Variant& v = variants[i];
      const double ms = medians[i - first];
      std::printf("  %-22s M = %d, %d blocks: %3d registers, %4zu B local (spills), %8.3f ms, %.2fx the library's\n",
                  v.kernel.c_str(), v.m, v.blocks, v.attributes.numRegs, v.attributes.localSizeBytes, ms,
                  ms / library_ms);
      report["layouts"][v.kernel]["M" + std::to_string(v.m) + "_blocks" + std::to_string(v.blocks)] = {
          {"registers", v.attributes.numRegs},
          {"local_bytes", v.attributes.localSizeBytes},
          {"median_ms", ms},
          {"of_library", ms / library_ms}};
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  using namespace loom;
  Options o;
  CLI::App app("loom_cuda_attention_bench: stored, cuBLAS log-sum-exp and SRAM-tiled attention (CUDA, bf16)");
  app.add_option("--batch", o.batch, "B")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "T")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--channels", o.channels, "C")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--heads", o.heads, "H (must divide C)")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--calls", o.calls, "Timed calls per kernel")->capture_default_str()->check(CLI::PositiveNumber);
  app.add_option("--dropout", o.dropout, "Attention dropout rate of the dropout rows (0: no such rows)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 0.99));
  app.add_option("--json", o.json, "Also write the figures to this file");
  CLI11_PARSE(app, argc, argv);
  if (loom::cuda::device_count() == 0) {
    std::puts("loom_cuda_attention_bench: no CUDA device; nothing measured");
    return 77;
  }

  const std::int64_t B = o.batch, T = o.seq, C = o.channels, H = o.heads;
  loom::cuda be(0);
  const auto qkv_buffer = random_device(be, B * T * 3 * C, "qkv", -2.0f, 2.0f);
  const auto dout_buffer = random_device(be, B * T * C, "dout", -1.0f, 1.0f);
  Buffer<bf16, loom::cuda> out_buffer(be, B * T * C, MemoryCategory::activations),
      att_buffer(be, B * H * T * T, MemoryCategory::activations),
      dqkv_buffer(be, B * T * 3 * C, MemoryCategory::gradients);
  Buffer<float, loom::cuda> lse_buffer(be, B * H * T, MemoryCategory::activations);
  be.fill_zero(dqkv_buffer.data(), dqkv_buffer.bytes());
  const Tensor<const bf16> qkv(qkv_buffer.data(), {B, T, 3 * C}), dout(dout_buffer.data(), {B, T, C}),
      out_c(out_buffer.data(), {B, T, C}), att_c(att_buffer.data(), {B, H, T, T});
  const Tensor<bf16> out(out_buffer.data(), {B, T, C}), att(att_buffer.data(), {B, H, T, T}),
      dqkv(dqkv_buffer.data(), {B, T, 3 * C});
  const Tensor<float> lse(lse_buffer.data(), {B, H, T});
  const Tensor<const float> lse_c = lse;
  const int heads = o.heads;

  struct Kernel {
    const char* name;
    bool flash;
    std::function<void()> run;
    std::vector<double> ms;
    std::size_t workspace = 0;
    bool warpgroup = false;  // the tiled kernels on wgmma
  };
  std::vector<Kernel> kernels;
  kernels.push_back({"stored forward", false, [&] { attention_forward<bf16>(be, out, att, qkv, heads); }, {}});
  kernels.push_back(
      {"stored backward", false, [&] { attention_backward<bf16>(be, dqkv, dout, qkv, att_c, heads); }, {}});
  kernels.push_back({"cublas lse forward", false, [&] { attention_forward_lse<bf16>(be, out, lse, qkv, heads); }, {}});
  kernels.push_back({"cublas lse backward", false,
                     [&] { attention_backward_lse<bf16>(be, dqkv, dout, qkv, out_c, lse_c, heads); }, {}});
  kernels.push_back({"tiled forward", true, [&] { attention_forward_lse<bf16>(be, out, lse, qkv, heads); }, {}});
  kernels.push_back({"tiled backward", true,
                     [&] { attention_backward_lse<bf16>(be, dqkv, dout, qkv, out_c, lse_c, heads); }, {}});
  // A training pass's mask (step 0, layer 0), for the whole batch on one rank.
  const AttentionDropout drop{DropoutMask(DropoutKey{1, 0, 0}, 0, 0, o.dropout), 0, H, 0};
  const AttentionKeys causal = AttentionMask::causal;
  if (o.dropout > 0) {
    kernels.push_back({"cublas lse forward, dropout", false,
                       [&] { attention_forward_lse<bf16>(be, out, lse, qkv, heads, causal, drop); }, {}});
    kernels.push_back({"cublas lse backward, dropout", false,
                       [&] { attention_backward_lse<bf16>(be, dqkv, dout, qkv, out_c, lse_c, heads, causal, drop); },
                       {}});
    kernels.push_back({"tiled forward, dropout", true,
                       [&] { attention_forward_lse<bf16>(be, out, lse, qkv, heads, causal, drop); }, {}});
    kernels.push_back({"tiled backward, dropout", true,
                       [&] { attention_backward_lse<bf16>(be, dqkv, dout, qkv, out_c, lse_c, heads, causal, drop); },
                       {}});
  }
  const std::size_t warpgroup_first = kernels.size();
  const bool warpgroup = warpgroup_attention_available(be) && C / H == 64;
  if (warpgroup) {
    kernels.push_back(
        {"wgmma forward", true, [&] { attention_forward_lse<bf16>(be, out, lse, qkv, heads); }, {}, 0, true});
    kernels.push_back({"wgmma backward", true,
                       [&] { attention_backward_lse<bf16>(be, dqkv, dout, qkv, out_c, lse_c, heads); }, {}, 0, true});
  }
  for (int round = 0; round <= o.calls; ++round)
    for (Kernel& k : kernels) {
      be.set_flash_attention(k.flash);
      be.set_warpgroup_attention(k.warpgroup);
      const std::size_t before = be.memory().current(MemoryCategory::workspace);
      be.memory().reset_peaks();
      const double ms = time_ms(be, k.run);
      k.workspace = be.memory().peak(MemoryCategory::workspace) - before;
      if (round > 0) k.ms.push_back(ms);
    }

  cudaDeviceProp prop{};
  LOOM_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const double hs = static_cast<double>(C / H), forward_flop = 4.0 * B * H * T * T * hs / 2;
  std::printf("%s, %d SMs; B=%lld T=%lld C=%lld H=%lld, bf16, %d timed calls per kernel (median)\n", prop.name,
              prop.multiProcessorCount, static_cast<long long>(B), static_cast<long long>(T),
              static_cast<long long>(C), static_cast<long long>(H), o.calls);
  nlohmann::json report;
  report["gpu"] = prop.name;
  report["shape"] = {{"batch", B}, {"seq", T}, {"channels", C}, {"heads", H}};
  std::vector<double> medians;
  for (std::size_t i = 0; i < kernels.size(); ++i) {
    const bench::Stats s = bench::summarize(kernels[i].ms);
    medians.push_back(s.median);
    const double flop = i % 2 == 0 ? forward_flop : 2.5 * forward_flop;
    const double tflops = flop / (s.median * 1e9);
    const double workspace_mib = static_cast<double>(kernels[i].workspace) / (1 << 20);
    std::printf("  %-29s %9.3f ms  (min %.3f)  %7.1f TFLOP/s  workspace %9.2f MiB\n", kernels[i].name, s.median,
                s.min, tflops, workspace_mib);
    report["kernels"][kernels[i].name] = {
        {"median_ms", s.median}, {"min_ms", s.min}, {"tflops", tflops}, {"workspace_mib", workspace_mib}};
  }
  const double stored = medians[0] + medians[1], cublas = medians[2] + medians[3], tiled = medians[4] + medians[5];
  std::printf("forward + backward: stored %.3f ms, cublas lse %.3f ms, tiled %.3f ms; tiled is %.2fx stored's speed, "
              "%.2fx cublas lse's\n",
              stored, cublas, tiled, stored / tiled, cublas / tiled);
  const double att_mib = static_cast<double>(B * H * T * T) * sizeof(bf16) / (1 << 20),
               lse_mib = static_cast<double>(B * H * T) * sizeof(float) / (1 << 20);
  std::printf("kept per layer: att %.2f MiB (stored), lse %.3f MiB (cublas lse, tiled)\n", att_mib, lse_mib);
  report["speedup_of_tiled"] = {{"over_stored", stored / tiled}, {"over_cublas_lse", cublas / tiled}};
  if (o.dropout > 0) {
    const double cublas_drop = medians[6] + medians[7], tiled_drop = medians[8] + medians[9];
    std::printf("with attention dropout %.2f: cublas lse %.3f ms (%.2fx without), tiled %.3f ms (%.2fx without); "
                "tiled is %.2fx cublas lse's speed\n",
                o.dropout, cublas_drop, cublas_drop / cublas, tiled_drop, tiled_drop / tiled, cublas_drop / tiled_drop);
    report["dropout"] = {{"rate", o.dropout},
                         {"cublas_lse_ms", cublas_drop},
                         {"tiled_ms", tiled_drop},
                         {"tiled_cost", tiled_drop / tiled},
                         {"speedup_of_tiled_over_cublas_lse", cublas_drop / tiled_drop}};
  }
  if (warpgroup) {
    const double forward = medians[warpgroup_first], backward = medians[warpgroup_first + 1];
    std::printf("tiled on wgmma: forward %.3f ms (%.2fx mma.sync's speed), backward %.3f ms (%.2fx), pair %.3f ms "
                "(%.2fx)\n",
                forward, medians[4] / forward, backward, medians[5] / backward, forward + backward,
                tiled / (forward + backward));
    report["wgmma"] = {{"forward_ms", forward},
                       {"backward_ms", backward},
                       {"speedup_over_mma_sync", tiled / (forward + backward)}};
  } else {
    std::puts("tiled on wgmma: not built for this GPU (sm_90a) or head size not 64");
  }
  be.set_warpgroup_attention(false);
  if (flash_attention_available(be, C / H))
    compare_layouts(be, B, T, C, H, qkv.data(), dout.data(), out.data(), lse.data(), dqkv.data(), drop, o.calls,
                    report);
  report["kept_mib"] = {{"att", att_mib}, {"lse", lse_mib}};
  bench::write_json(o.json, report);
  return 0;
}
