#!/usr/bin/env bash
# The registers and spills of the tiled attention kernels (detail/flash_attention.cuh) at each head
# size, as ptxas reports them for one architecture: the occupancy side of their speed, checked
# without a GPU.
#
#   scripts/flash_resources.sh [arch]            arch: 90 (default, H100/H200), 80 (A100), 90a, ...
#   scripts/flash_resources.sh 90a --check       the ctest flash_kernels_ptxas_sm90a: fails where
#                                                ptxas cannot build a kernel, or says it had to
#                                                serialize or fence the wgmma products
#
# Prints one line per kernel: registers, spill stores and loads (bytes), and the blocks of 128
# threads that the registers let share an SM (65536 registers an SM on sm_80 and sm_90). Each
# kernel is named <HS, M, Blocks>: head size, 16-row blocks a warp owns, and the blocks an SM its
# __launch_bounds__ asks for; the library's M (flash::row_blocks) and, at hs <= 64, M = 2; and the
# *_dropout_kernel builds (attention dropout) at the library's M; at arch 90a, the wgmma builds too.
#
# Where nvdisasm is found (NVDISASM, PATH or the CUDA toolkit; the toolkit here lacks it: `pip
# install nvidia-cuda-nvdisasm` puts one under site-packages/nvidia/cu13/bin), it then prints the
# instructions of one step of each kernel's tile loop (scripts/flash_instructions.py).
#
# --check: CI compiles the tiled kernels only as compute_80 PTX (no GPU there, and CMake's
# default architecture below sm_80), so neither ptxas's view of the mma.sync kernels nor the
# sm_90a wgmma kernels would be built before a GPU session. With --check the table still prints,
# and the script fails (exit 1) on any ptxas message about the products ("(C75..)" codes, e.g.
# "Potential Performance Loss: wgmma.mma_async instructions are serialized", or an injected
# warpgroup.arrive), which mean the asynchronous products wait for each other.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
arch=${1:-90}
check=false
[[ ${2:-} == --check ]] && check=true
if [[ $# -gt 2 || ( $# -eq 2 && $check == false ) ]]; then
  echo "usage: scripts/flash_resources.sh [arch] [--check]" >&2
  exit 2
fi
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

{
  echo '#include "loom/backend/cuda/detail/flash_attention.cuh"'
  echo 'namespace fl = loom::detail::flash;'
  for hs in 32 64 128; do
    echo "template __global__ void fl::forward_kernel<$hs>(fl::ForwardArgs);"
    echo "template __global__ void fl::key_value_grad_kernel<$hs>(fl::BackwardArgs);"
    echo "template __global__ void fl::query_grad_kernel<$hs>(fl::BackwardArgs);"
  done
  for hs in 32 64 128; do
    for k in forward:ForwardArgs key_value_grad:BackwardArgs query_grad:BackwardArgs; do
      echo "template __global__ void fl::${k%%:*}_dropout_kernel<$hs>(fl::${k##*:}, loom::AttentionDropout);"
    done
  done
  for hs in 32 64; do
    echo "template __global__ void fl::forward_kernel<$hs, 2>(fl::ForwardArgs);"
    echo "template __global__ void fl::key_value_grad_kernel<$hs, 2>(fl::BackwardArgs);"
    echo "template __global__ void fl::query_grad_kernel<$hs, 2>(fl::BackwardArgs);"
  done
  if [[ $arch == 90a ]]; then
    for drop in false true; do
      echo "template __global__ void fl::forward_group_kernel<$drop>(fl::ForwardArgs, loom::AttentionDropout);"
      echo "template __global__ void fl::key_value_grad_group_kernel<$drop>(fl::BackwardArgs, loom::AttentionDropout);"
      echo "template __global__ void fl::query_grad_group_kernel<$drop>(fl::BackwardArgs, loom::AttentionDropout);"
    done
  fi
} > "$work/kernels.cu"

"$nvcc" -std=c++20 -O3 -arch="sm_$arch" -Iinclude --expt-relaxed-constexpr --resource-usage \
  -cubin "$work/kernels.cu" -o "$work/kernels.cubin" 2>&1 | tee "$work/ptxas.txt" | awk '
  /Compiling entry function/ {
    if (match($0, /flash[0-9]+[a-z_]+ILi[0-9]+ELi[0-9]+ELi[0-9]+/)) {
      s = substr($0, RSTART, RLENGTH)
      sub(/^flash[0-9]+/, "", s); gsub(/ELi/, ",", s); split(s, part, "ILi"); name = part[1] "<" part[2] ">"
    } else if (match($0, /flash[0-9]+[a-z_]+ILb[01]/)) {  # the wgmma kernels: <dropout>
      s = substr($0, RSTART, RLENGTH); sub(/^flash[0-9]+/, "", s)
      split(s, part, "ILb"); name = part[1] "<" (part[2] == "1" ? "true" : "false") ">"
    }
  }
  /bytes spill stores/ { stores[name] = $5; loads[name] = $9 }
  /Used [0-9]+ registers/ { for (i = 1; i <= NF; ++i) if ($i == "Used") regs[name] = $(i + 1); order[++n] = name }
  /error/ { print; failed = 1 }
  END {
    printf "%-40s %9s %13s %12s %13s\n", "kernel (sm_'"$arch"')", "registers", "spill stores", "spill loads", "blocks an SM"
    for (i = 1; i <= n; ++i) {
      k = order[i]; r = regs[k]
      # Registers are allocated per warp in units of 256 (8 a thread).
      per_thread = int((r + 7) / 8) * 8
      printf "%-40s %9d %13d %12d %13d\n", k, r, stores[k], loads[k], int(65536 / (per_thread * 128))
    }
    exit failed
  }'

if $check; then
  if grep -E "\(C75[0-9][0-9]\)|Performance Loss|serializ|warpgroup.arrive is injected" "$work/ptxas.txt"; then
    echo "flash_resources.sh: ptxas waits between the asynchronous products of the kernels above (sm_$arch)" >&2
    exit 1
  fi
  echo "flash_resources.sh: every kernel built for sm_$arch, no product serialized"
  exit 0
fi

nvdisasm=${NVDISASM:-$(command -v nvdisasm || echo /usr/local/cuda/bin/nvdisasm)}
if [[ -x $nvdisasm ]]; then
  echo
  echo "instructions of one step of each kernel's tile loop (static; unmasked: without the masking)"
  "$nvdisasm" "$work/kernels.cubin" | python3 scripts/flash_instructions.py
fi
