#!/usr/bin/env python3
"""PyTorch's fused attention on a GPU at loom_cuda_attention_bench's shape: the peer figures for loom's tiled kernels.

    python3 bench/pytorch_attention.py                 # B=8, T=1024, 12 heads of 64, causal, bf16
    python3 bench/pytorch_attention.py --batch 16 --json attention_torch.json

For each scaled_dot_product_attention backend that runs here (FlashAttention-2 "flash", cuDNN's
"cudnn", "efficient"), the median forward and forward + backward times over --calls calls (CUDA
events, after warm-up), TFLOP/s in FlashAttention-2's convention (forward 4·B·H·T²·hs / 2 causal,
backward 2.5 times that: loom_cuda_attention_bench's), and whether two backwards from the same
inputs give the same bits (loom's tiled backward is deterministic; a backend that adds dQ with
atomics may not be).
"""

import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--json", help="write the results to this file")
    return p.parse_args()


def median_ms(run, calls):
    """Median milliseconds of run() over `calls` calls after 3 warm-ups, with CUDA events."""
    times = []
    for i in range(3 + calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        print("pytorch_attention: no CUDA device")
        return 77
    B, H, T, hs = args.batch, args.heads, args.seq, args.head_size
    forward_flop = 4.0 * B * H * T * T * hs / 2
    generator = torch.Generator(device="cuda").manual_seed(7)
    q, k, v = (torch.randn(B, H, T, hs, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
               for _ in range(3))
    dout = torch.randn(B, H, T, hs, device="cuda", dtype=torch.bfloat16, generator=generator)
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name()}; B={B} T={T} H={H} hs={hs}, causal, bf16, "
          f"median of {args.calls} calls")
    print(f"{'backend':10s} {'forward ms':>10s} {'TFLOP/s':>8s} {'backward ms':>11s} {'TFLOP/s':>8s} "
          f"{'pair ms':>8s} {'repeatable':>10s}")
    results = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with sdpa_kernel(backend):
                def forward():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                def pair():
                    q.grad = k.grad = v.grad = None
                    forward().backward(dout)

                forward_ms = median_ms(forward, args.calls)
                pair_ms = median_ms(pair, args.calls)
                pair()
                first = [t.grad.clone() for t in (q, k, v)]
                pair()
                repeatable = all(torch.equal(a, t.grad) for a, t in zip(first, (q, k, v)))
        except RuntimeError as e:
            print(f"{name:10s} not available here: {str(e).splitlines()[0][:100]}")
            continue
        backward_ms = pair_ms - forward_ms
        r = {"backend": name, "forward_ms": forward_ms, "backward_ms": backward_ms, "pair_ms": pair_ms,
             "forward_tflops": forward_flop / forward_ms / 1e9,
             "backward_tflops": 2.5 * forward_flop / backward_ms / 1e9, "repeatable": repeatable}
        results.append(r)
        print(f"{name:10s} {forward_ms:10.3f} {r['forward_tflops']:8.1f} {backward_ms:11.3f} "
              f"{r['backward_tflops']:8.1f} {pair_ms:8.3f} {str(repeatable):>10s}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "pytorch_attention", "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(), "settings": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
