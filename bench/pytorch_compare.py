#!/usr/bin/python3
"""GPT-2 small in PyTorch on the CPU, eager or compiled, timed the way loom_step_bench times loom.

    /usr/bin/python3 bench/pytorch_compare.py --loom-json loom.json   # side by side
    /usr/bin/python3 bench/pytorch_compare.py --steps 5               # PyTorch alone
    VENV/bin/python bench/pytorch_compare.py --compile                # torch.compile (PyTorch >= 2)

bench/pytorch_compare.sh builds and runs loom_step_bench, then this script; see
docs/benchmarks.md. By default run it with Debian's /usr/bin/python3 (python3-torch is installed
for the system Python, not for a pyenv or virtualenv python3 on PATH); any Python with torch
will do (pytorch_compare.sh --python).

The model is a plain GPT-2 written here: pre-LayerNorm blocks, causal self-attention, GELU
(tanh), tied input/output embeddings, learned position embeddings, no dropout. It is timed in two
modes, after --warmup untimed calls each:
  forward  loss of one batch under torch.inference_mode()          (loom: Trainer::evaluate)
  train    zero_grad, forward, backward, clip_grad_norm_(1.0), AdamW (loom: Trainer::step)
Vocabulary: by default the padded 50304 rows that loom's wte holds (llm.c's padding; token ids
and targets stay below 50257), so both frameworks compute the same 50304 logits per token;
--vocab real uses the unpadded 50257.
"""

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per mode (default 2)")
    p.add_argument("--steps", type=int, default=5, help="timed calls per mode (default 5)")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--vocab", choices=["padded", "real"], default="padded",
                   help="embedding rows: padded = 50304 as loom stores them, real = 50257")
    p.add_argument("--foreach", action="store_true",
                   help="use AdamW's multi-tensor (foreach) implementation")
    p.add_argument("--fused", action="store_true",
                   help="use AdamW's fused implementation (on the CPU since PyTorch 2.4)")
    p.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default 3e-4)")
    p.add_argument("--recompute", action="store_true",
                   help="checkpoint every block (torch.utils.checkpoint; loom_step_bench --recompute)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (Inductor's C++ kernels; PyTorch >= 2.0, a C++ compiler);"
                        " compiling happens in the warm-up calls")
    p.add_argument("--loom-json", help="loom_step_bench --json output to compare with")
    p.add_argument("--json", help="write PyTorch's numbers (and the comparison) to this file")
    args = p.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or not 1 <= args.seq <= 1024:
        p.error("need --steps >= 1, --warmup >= 0, --batch >= 1, 1 <= --seq <= 1024")
    if args.foreach and args.fused:
        p.error("--foreach and --fused are two AdamW implementations: choose one")
    if args.compile and args.warmup < 2:
        p.error(f"--compile needs --warmup >= 2 (got {args.warmup}): the first calls of each mode compile"
                " (and a train step's second may compile again), which must not be timed")
    return args


ARGS = parse_args()
# Debian's torch runs its own ops on OpenMP threads and its GEMMs on OpenBLAS's pthreads (the
# system libblas.so.3). OpenBLAS reads its thread count when it loads; and OpenMP threads that
# spin after a parallel region (the default "active" wait) take the cores from OpenBLAS's
# threads, which costs PyTorch several times over on 2 cores. PASSIVE is PyTorch's best
# setting here; the environment wins where it says otherwise.
os.environ.setdefault("OPENBLAS_NUM_THREADS", str(ARGS.threads))
os.environ.setdefault("OMP_NUM_THREADS", str(ARGS.threads))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# GPT-2 small (DESIGN.md, include/loom/models/gpt2/config.hpp), shared with pytorch_gpu.py.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_torch import GPT2, LAYERS, PADDED_VOCAB, VOCAB  # noqa: E402


PEER = "compiled" if ARGS.compile else "eager"
ADAMW = "fused" if ARGS.fused else "foreach" if ARGS.foreach else "for-loop"
ADAMW_KIND = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}[ADAMW]


def fail(message):
    sys.stdout.flush()
    sys.exit(f"pytorch_compare: {message}")


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())  # tied weight counted once


def loaded_blas():
    """The BLAS libraries mapped into this process (after a matmul has run)."""
    found = set()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                # numpy's own OpenBLAS and CUDA's cuBLAS (a PyPI torch maps both) do not run
                # torch's CPU products.
                name = os.path.basename(path)
                if any(k in name for k in ("blas", "mkl", "blis")) and not any(
                        k in path for k in ("numpy", "cublas")):
                    found.add(os.path.realpath(path))
    except OSError:
        pass
    return sorted(found)


def blas_report():
    config = torch.__config__.show()
    info = {}
    for key in ("BLAS_INFO", "LAPACK_INFO"):
        start = config.find(key + "=")
        if start >= 0:
            info[key] = config[start + len(key) + 1:].split(",")[0].strip()
    libraries = loaded_blas()
    info["loaded"] = libraries
    blas_info = info.get("BLAS_INFO", "")
    info["openblas"] = "open" in blas_info or ("mkl" not in blas_info and any("openblas" in lib for lib in libraries))
    capability = [l.strip() for l in config.splitlines() if "CPU capability" in l]
    info["cpu_capability"] = capability[0].split(":", 1)[1].strip() if capability else "unknown"
    return info


def summarize(seconds):
    mean = statistics.fmean(seconds)
    return {
        "step_seconds": seconds,
        "mean_ms": 1e3 * mean,
        "std_ms": 1e3 * (statistics.stdev(seconds) if len(seconds) > 1 else 0.0),
        "median_ms": 1e3 * statistics.median(seconds),
        "min_ms": 1e3 * min(seconds),
    }


def main():
    torch.set_num_threads(ARGS.threads)
    torch.manual_seed(1337)
    vocab_rows = PADDED_VOCAB if ARGS.vocab == "padded" else VOCAB
    model = GPT2(vocab_rows, checkpoint_blocks=ARGS.recompute)
    # The optimizer takes the parameters of the module itself; compiling wraps its forward only.
    run_model = model
    if ARGS.compile:
        if not hasattr(torch, "compile"):
            fail(f"--compile needs PyTorch >= 2.0; {sys.executable} has torch {torch.__version__}")
        run_model = torch.compile(model)
    if ARGS.fused and "fused" not in inspect.signature(torch.optim.AdamW).parameters:
        fail(f"--fused needs a PyTorch whose AdamW has fused=; {sys.executable} has torch {torch.__version__}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=ARGS.lr, betas=(0.9, 0.95), eps=1e-8, **ADAMW_KIND)
    # Token ids below the real vocabulary, as loom's synthetic batches (timing does not depend on them).
    generator = torch.Generator().manual_seed(1234)
    calls = ARGS.warmup + ARGS.steps
    batches = [(torch.randint(0, VOCAB, (ARGS.batch, ARGS.seq), generator=generator),
                torch.randint(0, VOCAB, (ARGS.batch, ARGS.seq), generator=generator))
               for _ in range(calls)]

    def forward(tokens, targets):
        with torch.inference_mode():
            return run_model(tokens, targets).item()

    def train(tokens, targets):
        optimizer.zero_grad(set_to_none=True)
        loss = run_model(tokens, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return loss.item()

    results = {}
    for mode, work in (("forward", forward), ("train", train)):
        seconds, losses = [], []
        for i, (tokens, targets) in enumerate(batches):
            start = time.perf_counter()
            losses.append(work(tokens, targets))
            elapsed = time.perf_counter() - start
            if i >= ARGS.warmup:
                seconds.append(elapsed)
        results[mode] = summarize(seconds) | {"last_loss": losses[-1]}
        print(f"  pytorch {PEER} {mode:8s} median {results[mode]['median_ms']:9.1f} ms  "
              f"loss {losses[-1]:.3f}", flush=True)

    blas = blas_report()
    report = {
        "benchmark": "pytorch_compare",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "torch": torch.__version__,
        "python": sys.executable + " " + platform.python_version(),
        "blas": blas,
        "settings": {"batch": ARGS.batch, "seq": ARGS.seq, "threads": torch.get_num_threads(),
                     "warmup": ARGS.warmup, "steps": ARGS.steps, "vocab_rows": vocab_rows,
                     "vocab": ARGS.vocab, "recompute": ARGS.recompute, "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                     "openblas_num_threads": os.environ["OPENBLAS_NUM_THREADS"], "attention": "sdpa" if hasattr(F, "scaled_dot_product_attention")
                     else "explicit (masked softmax)", "adamw": ADAMW,
                     "compile": ARGS.compile, "params": parameter_count(model)},
        "results": results,
    }

    print(f"PyTorch {torch.__version__} ({sys.executable}), {torch.get_num_threads()} threads, "
          f"CPU capability {blas['cpu_capability']}, OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}, "
          f"OPENBLAS_NUM_THREADS={os.environ['OPENBLAS_NUM_THREADS']}")
    print(f"PyTorch BLAS: BLAS_INFO={blas.get('BLAS_INFO', '?')}, loaded: "
          f"{', '.join(blas['loaded']) or 'none found'} -> OpenBLAS: {'yes' if blas['openblas'] else 'no'}")
    print(f"PyTorch model: GPT-2 small, {parameter_count(model) / 1e6:.1f}M parameters, vocab "
          f"{vocab_rows} ({'padded like loom' if ARGS.vocab == 'padded' else 'unpadded'}), attention "
          f"{report['settings']['attention']}, AdamW {ADAMW}, {PEER}")

    if ARGS.loom_json:
        with open(ARGS.loom_json) as f:
            loom = json.load(f)
        rows = {r["mode"]: r for r in loom["results"] if r["config"] == "small"}
        if set(rows) != {"forward", "train"}:
            fail(f"{ARGS.loom_json}: no GPT-2 small forward and train results")
        settings = loom["settings"]
        for key in ("batch", "seq", "threads", "warmup", "steps", "recompute"):
            if settings.get(key, False) != report["settings"][key]:
                fail(f"loom ran with {key}={settings[key]}, PyTorch with {report['settings'][key]}")
        if rows["train"]["layers"] != LAYERS:
            fail("loom's GPT-2 small was scaled down; raise --max-gib")
        print(f"\nGPT-2 small, batch {ARGS.batch} x seq {ARGS.seq}, {ARGS.threads} threads, "
              f"{ARGS.warmup} warm-up + {ARGS.steps} timed steps, medians"
              f"{', every block recomputed' if ARGS.recompute else ''}")
        print(f"{'mode':8s} {'loom ms':>10s} {'PyTorch ms':>11s} {'PyTorch/loom':>13s}")
        comparison = {}
        for mode in ("train", "forward"):
            loom_ms, torch_ms = rows[mode]["median_ms"], results[mode]["median_ms"]
            comparison[mode] = {"loom_median_ms": loom_ms, "pytorch_median_ms": torch_ms,
                                "speedup": torch_ms / loom_ms}
            print(f"{mode:8s} {loom_ms:10.1f} {torch_ms:11.1f} {torch_ms / loom_ms:12.2f}x")
        speedup = comparison["train"]["speedup"]
        verdict = "met" if speedup >= 1.5 else "NOT met"
        relation = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
        print(f"training step: loom is {relation} than PyTorch {PEER} (target: >= 1.5x faster, {verdict})")
        report["loom"] = {"date": loom["date"], "machine": loom["machine"], "results": list(rows.values())}
        report["comparison"] = comparison
        report["target_met"] = speedup >= 1.5

    if ARGS.json:
        with open(ARGS.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {ARGS.json}")


if __name__ == "__main__":
    main()
