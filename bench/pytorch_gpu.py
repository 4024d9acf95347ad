#!/usr/bin/env python3
"""GPT-2 small training steps in PyTorch on a GPU: the peer figures for loom's GPU benchmark.

    python3 bench/pytorch_gpu.py                       # B=8, T=1024, eager fp32/bf16, compile bf16
    python3 bench/pytorch_gpu.py --modes eager-bf16,compile-bf16 --batch 16 --json torch.json
    python3 bench/pytorch_gpu.py --modes eager-bf16,compile-bf16 --batch 128,96,64   # the largest that fits

Each mode trains the model of gpt2_torch.py (the padded 50304-row vocabulary that loom stores)
with AdamW (fused) and gradient clipping at 1.0, times --steps steps after --warmup untimed ones
with CUDA events, and prints the median step, tokens/s and MFU. FLOPs per token are loom's
(DESIGN.md): 6·N + 12·L·C·T with N = 124,439,808, GPT-2 small's published parameter count.
MFU is given against the bf16 (or TF32) GEMM rate measured here on an 8192³ product of random
data, and against the datasheet's dense peak (--peak-bf16, --peak-tf32: H100 SXM by default).
Modes: eager-fp32 (TF32 matmuls, as loom's float default), eager-bf16 and compile-bf16 (autocast
to bf16, fp32 master weights), compile-fp32. --batch may list several sizes, largest first: each
mode runs at the first that fits in the GPU's memory, and the row says which (the others are
reported as out of memory).
"""

import gc

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_torch import CHANNELS, GPT2, LAYERS, PADDED_VOCAB, VOCAB  # noqa: E402

# GPT-2 small's published parameter count (tied embedding counted once, padding rows not), as
# loom's gpt2::Config::parameter_count().
PUBLISHED_PARAMETERS = 124_439_808


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="8", help="micro-batch, or several (comma-separated, largest first): "
                   "each mode runs at the first that fits")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default="eager-fp32,eager-bf16,compile-bf16")
    p.add_argument("--peak-bf16", type=float, default=989.4, help="dense bf16 TFLOP/s (H100 SXM: 989.4)")
    p.add_argument("--peak-tf32", type=float, default=494.7, help="dense TF32 TFLOP/s (H100 SXM: 494.7)")
    p.add_argument("--json", help="write the results to this file")
    p.add_argument("--profile", action="store_true",
                   help="after timing, one more step under torch.profiler: device time per kernel, largest first "
                        "(to set beside loom's scripts/kernel_profile.py table)")
    return p.parse_args()


def flops_per_token(seq):
    """Training FLOPs per token: 6·N + 12·L·C·T (loom's gpt2::Model::flops_per_token)."""
    return 6.0 * PUBLISHED_PARAMETERS + 12.0 * LAYERS * CHANNELS * seq


def gemm_rate(dtype, size=8192, repeats=10):
    """TFLOP/s of a size³ product of random data, the median of `repeats` after 3 warm-ups."""
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    times = []
    for i in range(3 + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    return 2.0 * size**3 / statistics.median(times) / 1e12


def run_mode(mode, args, batch):
    compiled, precision = mode.split("-")
    torch.manual_seed(1337)
    model = GPT2(PADDED_VOCAB).cuda()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    forward = torch.compile(model) if compiled == "compile" else model
    generator = torch.Generator(device="cuda").manual_seed(1234)
    batches = [(torch.randint(0, VOCAB, (batch, args.seq), device="cuda", generator=generator),
                torch.randint(0, VOCAB, (batch, args.seq), device="cuda", generator=generator))
               for _ in range(4)]

    def step(tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss = forward(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss

    seconds = []
    for i in range(args.warmup + args.steps):
        tokens, targets = batches[i % len(batches)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(tokens, targets)
        end.record()
        torch.cuda.synchronize()
        if i >= args.warmup:
            seconds.append(start.elapsed_time(end) / 1e3)
    if args.profile:
        try:
            print_kernel_profile(mode, batch, lambda: step(*batches[0]))
        except Exception as e:  # the timing stands without the profile
            print(f"{mode}: torch.profiler failed: {e}", flush=True)
    median = statistics.median(seconds)
    tokens = batch * args.seq
    tflops = flops_per_token(args.seq) * tokens / median / 1e12
    result = {"mode": mode, "batch": batch, "median_ms": 1e3 * median, "min_ms": 1e3 * min(seconds),
              "tokens_per_second": tokens / median, "tflops": tflops, "last_loss": loss.item(),
              "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    del model, optimizer, forward
    release_memory()
    return result


def print_kernel_profile(mode, batch, run_step, rows=40):
    """One step under torch.profiler (device activity only): each kernel's launches and device
    milliseconds, summed by name, the largest `rows` first, and the total."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_step()
        torch.cuda.synchronize()
    def device_us(e):  # the attribute's name changed in torch 2.4
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
    events = sorted((e for e in prof.key_averages() if device_us(e) > 0), key=device_us, reverse=True)
    total = sum(device_us(e) for e in events) / 1e3
    print(f"kernels of one {mode} step at batch {batch}: {total:.3f} ms of device time")
    print(f"{'kernel':90s} {'launches':>8s} {'ms':>9s} {'share':>6s}")
    for e in events[:rows]:
        ms = device_us(e) / 1e3
        print(f"{e.key[:90]:90s} {e.count:8d} {ms:9.3f} {100 * ms / total:5.1f}%")
    print(flush=True)


def release_memory():
    """Gives back what a finished (or failed) mode held, and restarts the peak count."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def run_largest(mode, args, batches):
    """run_mode at the first of `batches` that fits; the result lists the ones that did not."""
    too_large = []
    for batch in batches:
        result = None
        try:
            result = run_mode(mode, args, batch)
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError, or one that torch.compile wrapped
            if "out of memory" not in str(e).lower():
                raise
        if result is None:
            # Out of the except block: the failed run's frames (its model, its optimizer) are gone.
            too_large.append(batch)
            print(f"{mode:14s} batch {batch}: out of memory", flush=True)
            release_memory()
            continue
        result["out_of_memory_batches"] = too_large
        return result
    return {"mode": mode, "out_of_memory_batches": too_large}


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("pytorch_gpu: no CUDA device")
        return 77
    torch.backends.cuda.matmul.allow_tf32 = True  # loom's float GEMMs use TF32 by default
    torch.backends.cudnn.allow_tf32 = True
    device = torch.cuda.get_device_name()
    rates = {"bf16": gemm_rate(torch.bfloat16), "fp32": gemm_rate(torch.float32)}
    peaks = {"bf16": args.peak_bf16, "fp32": args.peak_tf32}
    print(f"PyTorch {torch.__version__} on {device}; GEMM 8192^3 measured: bf16 {rates['bf16']:.0f}, "
          f"fp32 (TF32) {rates['fp32']:.0f} TFLOP/s; datasheet dense: bf16 {args.peak_bf16}, TF32 {args.peak_tf32}")
    batches = [int(b) for b in args.batch.split(",")]
    print(f"GPT-2 small (vocab {PADDED_VOCAB}), batch {args.batch} x seq {args.seq}, AdamW fused, clip 1.0, "
          f"{args.warmup} warm-up + {args.steps} timed steps, medians")
    print(f"{'mode':14s} {'batch':>5s} {'step ms':>9s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU meas.':>9s} "
          f"{'MFU peak':>9s} {'GiB':>6s}")
    results = []
    for mode in args.modes.split(","):
        r = run_largest(mode, args, batches)
        if "batch" not in r:
            results.append(r)
            print(f"{mode:14s} out of memory at every batch ({args.batch})", flush=True)
            continue
        precision = mode.split("-")[1]
        r["mfu_measured"] = r["tflops"] / rates[precision]
        r["mfu_peak"] = r["tflops"] / peaks[precision]
        results.append(r)
        print(f"{mode:14s} {r['batch']:5d} {r['median_ms']:9.1f} {r['tokens_per_second']:10.0f} {r['tflops']:8.1f} "
              f"{100 * r['mfu_measured']:8.1f}% {100 * r['mfu_peak']:8.1f}% {r['peak_memory_gib']:6.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "pytorch_gpu", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "torch": torch.__version__, "device": device, "gemm_tflops": rates,
                       "settings": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
