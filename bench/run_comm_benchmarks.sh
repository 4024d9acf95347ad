#!/usr/bin/env bash
# Runs loom's communication benchmarks on thread ranks and, when the build has MPI and mpiexec is
# on PATH, under mpiexec; writes one JSON file per run into the output folder.
#
#   bench/run_comm_benchmarks.sh                          # results in build/release/comm-results-<UTC time>
#   bench/run_comm_benchmarks.sh --build-dir build-bench --out /tmp/comm --no-mpi
#   bench/run_comm_benchmarks.sh --quick                  # tiny sizes: checks that everything runs
#   bench/run_comm_benchmarks.sh --pause 0                # no pause between runs (default 60 s)
#
# Runs, one at a time (never two at once: they would share the cores):
#   loom_collectives_bench                        threads, 2 ranks, 1 KiB .. 256 MiB
#   mpiexec -n 2 loom_collectives_bench --comm mpi
#   loom_broadcast_bench                          threads, 4 ranks, 1 .. 256 MiB
#   mpiexec -n 4 loom_broadcast_bench --comm mpi
#   loom_ddp_overlap_bench                        GPT-2 small, 2 thread ranks
#   mpiexec -n 2 loom_ddp_overlap_bench --comm mpi
# with --pause seconds between runs, so that each starts on a machine its predecessor has left
# (the load average each benchmark prints decays over about a minute).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
build_dir="$root/build/release"
out=""
use_mpi=1
quick=0
pause=60

usage() { sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build_dir="$(cd "$2" && pwd)"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --no-mpi) use_mpi=0; shift ;;
    --quick) quick=1; shift ;;
    --pause) pause="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "run_comm_benchmarks.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
[[ -n "$out" ]] || out="$build_dir/comm-results-$(date -u +%Y%m%dT%H%M%SZ)"
mkdir -p "$out"

# Build one target at a time (the machine has few cores and others may be building too).
for target in loom_collectives_bench loom_broadcast_bench loom_ddp_overlap_bench; do
  cmake --build "$build_dir" --target "$target" -j2
done
bin="$build_dir/bench"

if [[ $use_mpi == 1 ]] && ! command -v mpiexec >/dev/null; then
  echo "note: no mpiexec on PATH; the MPI runs are skipped"
  use_mpi=0
fi
if [[ $use_mpi == 1 ]] && ! grep -q "LOOM_BENCH_WITH_MPI" "$build_dir/bench/CMakeFiles/loom_collectives_bench.dir/flags.make" 2>/dev/null; then
  echo "note: this build has no MPI (loom::mpi was not found); the MPI runs are skipped"
  use_mpi=0
fi

# OpenMPI refuses root and more ranks than cores unless told (with more ranks than cores it
# makes idle ranks yield by itself: mpi_yield_when_idle).
mpiexec_flags=()
if mpiexec --version 2>/dev/null | grep -qE "Open MPI|OpenRTE"; then
  mpiexec_flags+=(--oversubscribe)
  if [[ "$(id -u)" == 0 ]]; then mpiexec_flags+=(--allow-run-as-root); fi
fi

if [[ $quick == 1 ]]; then
  collectives=(--max-bytes 64K --iters 2 --warmup 1)
  broadcast=(--sizes 64K,1M --chunks 16K --iters 2 --warmup 1)
  ddp=(--config tiny --seq 16 --warmup 1 --steps 2 --bucket-bytes 16K)
else
  collectives=()
  broadcast=()
  ddp=()
fi

first_run=1
run() {
  local name="$1"; shift
  if [[ $first_run == 0 && $quick == 0 && $pause != 0 ]]; then sleep "$pause"; fi
  first_run=0
  echo
  echo "=== $name: $* ($(date -u +%H:%M:%SZ), load $(cut -d' ' -f1 /proc/loadavg))"
  "$@"
}

run collectives_threads "$bin/loom_collectives_bench" "${collectives[@]}" --json "$out/collectives_threads.json"
if [[ $use_mpi == 1 ]]; then
  run collectives_mpi mpiexec -n 2 "${mpiexec_flags[@]}" "$bin/loom_collectives_bench" --comm mpi \
    "${collectives[@]}" --json "$out/collectives_mpi.json"
fi
run broadcast_threads "$bin/loom_broadcast_bench" "${broadcast[@]}" --json "$out/broadcast_threads.json"
if [[ $use_mpi == 1 ]]; then
  run broadcast_mpi mpiexec -n 4 "${mpiexec_flags[@]}" "$bin/loom_broadcast_bench" --comm mpi \
    "${broadcast[@]}" --json "$out/broadcast_mpi.json"
fi
run ddp_overlap_threads "$bin/loom_ddp_overlap_bench" "${ddp[@]}" --json "$out/ddp_overlap_threads.json"
if [[ $use_mpi == 1 ]]; then
  run ddp_overlap_mpi mpiexec -n 2 "${mpiexec_flags[@]}" "$bin/loom_ddp_overlap_bench" --comm mpi \
    "${ddp[@]}" --json "$out/ddp_overlap_mpi.json"
fi
echo
echo "results in $out"
