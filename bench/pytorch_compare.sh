#!/usr/bin/env bash
# pytorch_compare.sh: loom and PyTorch side by side on the CPU, one GPT-2 small training step
# (forward, backward, gradient clipping, AdamW) and one forward pass, in one run.
#
#   bench/pytorch_compare.sh                        # B=4, T=64, 2 threads, 2 warm-up + 5 timed steps
#   bench/pytorch_compare.sh --steps 5 --json compare.json
#   bench/pytorch_compare.sh --recompute            # both recompute every block (activation checkpointing)
#   bench/pytorch_compare.sh --python VENV/bin/python --compile   # a PyPI PyTorch, torch.compile'd
#
# 1. checks Debian's python3-torch and libopenblas0-pthread (apt-get installs them only when
#    missing; skipped with --python), 2. says which BLAS PyTorch uses, 3. builds loom_step_bench
# (Release, -march=native), 4. runs it on GPT-2 small, 5. runs bench/pytorch_compare.py with
# /usr/bin/python3 (or --python) on the same settings, which prints both medians and their ratio
# (target: loom >= 1.5x faster).
set -euo pipefail

warmup=2 steps=5 batch=4 seq=64 threads=2 vocab=padded json="" foreach="" recompute="" compile="" python=""
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build-bench"

usage() {
  sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
  cat <<EOF

options: --warmup N (2)  --steps N (5)  --batch B (4)  --seq T (64)  --threads N (2)
         --vocab padded|real (padded: PyTorch embeds 50304 rows as loom does)
         --foreach | --fused (PyTorch AdamW multi-tensor, or fused: PyTorch >= 2.4)
         --build-dir DIR ($build)  --json FILE
         --recompute (loom: recompute_layers all; PyTorch: torch.utils.checkpoint on every block)
         --python PATH (a Python whose torch to time; default Debian's /usr/bin/python3)
         --compile (torch.compile the PyTorch model: PyTorch >= 2.0; compiles in the warm-up)
EOF
}

while (($#)); do
  case "$1" in
    --warmup) warmup="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --batch) batch="$2"; shift 2 ;;
    --seq) seq="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --vocab) vocab="$2"; shift 2 ;;
    --foreach) foreach="--foreach"; shift ;;
    --fused) foreach="--fused"; shift ;;
    --recompute) recompute="--recompute"; shift ;;
    --compile) compile="--compile"; shift ;;
    --python) python="$2"; shift 2 ;;
    --build-dir) build="$2"; shift 2 ;;
    --json) json="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "pytorch_compare.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

# 1. Packages: install only what is missing. Debian's torch is for the system Python, not a pyenv
#    python3 on PATH; a Python given with --python brings its own torch and BLAS.
missing=()
packages=(python3-torch libopenblas0-pthread)
if [[ -n "$python" ]]; then
  packages=()
else
  python=/usr/bin/python3
fi
for package in ${packages[@]+"${packages[@]}"}; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if ((${#missing[@]})); then
  echo "== installing ${missing[*]}"
  sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { echo "pytorch_compare.sh: need root or sudo to install ${missing[*]}" >&2; exit 1; }
    sudo=(sudo)
  fi
  ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get update
  ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}"
elif ((${#packages[@]})); then
  echo "== python3-torch and libopenblas0-pthread are installed"
fi
"$python" -c "import torch" || { echo "pytorch_compare.sh: $python cannot import torch" >&2; exit 1; }

# 2. Which BLAS: Debian's torch calls the system libblas.so.3, which the alternatives system
#    points at one implementation (OpenBLAS when libopenblas0-pthread is installed).
multiarch="$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)"
echo "== BLAS: update-alternatives --display libblas.so.3-$multiarch"
update-alternatives --display "libblas.so.3-$multiarch" 2>/dev/null | sed 's/^/   /' ||
  echo "   (no libblas.so.3 alternative registered)"
echo "== PyTorch build: $("$python" -c 'import torch; c = torch.__config__.show(); i = c.find("BLAS_INFO="); print(torch.__version__, c[i:].split(",")[0] if i >= 0 else "BLAS_INFO unknown")')"

# 3. Build loom's benchmark.
echo "== building loom_step_bench in $build"
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DLOOM_BUILD_TESTS=OFF \
  -DLOOM_BUILD_EXAMPLES=OFF -DLOOM_BUILD_BENCH=ON >/dev/null
cmake --build "$build" -j "$(nproc)" --target loom_step_bench >/dev/null

# 4. loom, then 5. PyTorch, one after the other (never at once: they would share the cores).
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
common=(--warmup "$warmup" --steps "$steps" --batch "$batch" --seq "$seq" --threads "$threads")
echo "== loom (load average $(cut -d' ' -f1 /proc/loadavg))"
"$build/bench/loom_step_bench" --configs small "${common[@]}" $recompute --json "$work/loom.json"
echo "== PyTorch ${compile:+compiled}${compile:-eager} (load average $(cut -d' ' -f1 /proc/loadavg))"
"$python" "$root/bench/pytorch_compare.py" "${common[@]}" --vocab "$vocab" $foreach $recompute $compile \
  --loom-json "$work/loom.json" ${json:+--json "$json"}
