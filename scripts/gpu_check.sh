#!/usr/bin/env bash
# gpu_check.sh: the CUDA tests and gpt2_train on a GPU, in one call on a lent device machine.
#
#   scripts/gpu_check.sh build [ARCH]   # here (the dev VM): build the CUDA test programs and
#                                       # gpt2_train for sm_ARCH (default 90a: Hopper, with the
#                                       # wgmma attention) into build-gpu/,
#                                       # packed into .gpu/build-gpu.tar.xz
#   scripts/gpu_check.sh run [GROUP...] # there (run with carry [".gpu"]): run them all, or
#                                       # only the groups named: tests, demo, train, bench, torch,
#                                       # step, best, large, sweep, profile (the last five not in
#                                       # the default)
#
# The device machine has the CUDA runtime and PyTorch's NCCL but not Debian's Eigen, doctest,
# CLI11 or OpenMPI, so the programs are built here without MPI, for a generic x86-64 (no
# -march=native), and carried: the binaries only, stripped and packed with xz (81 MiB built,
# 75 stripped, 13 packed on 2026-11-27; a device call carries 64 at most).
# `run` finds the CUDA and NCCL libraries the binaries need, runs every CUDA test program and a
# few gpt2_train layouts, then bench/pytorch_gpu.py (PyTorch's GPT-2 small steps on the same GPU),
# packs their output into $OUT/logs.tgz (or build-gpu/logs), and prints a table last: name, exit
# code (77 = skipped), seconds, and the line that matters.
#
# Device time is short (15 minutes a session, machine start included), so by default the test
# programs run only their GPU cases there: the host cases (host emulation of the kernel bodies,
# host-side checks) are CPU code that ctest runs here and in CI, and the emulation alone took
# test_cuda_flash_attention past a 60 s limit on 2026-11-28. GPU_CHECK_TEST_ARGS replaces the
# test programs' arguments ("" runs every case). GPU_CHECK_DEADLINE (seconds from the start; 540
# by default, under a device call's 600) bounds the whole call: each program gets at most what
# is left of it, a program that would start with under 20 s left is skipped (its row says so),
# and the table still prints.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bin="$root/build-gpu"
programs=(test_cuda_backend test_cuda_kernels test_cuda_gemm_epilogues test_cuda_attention test_cuda_flash_attention test_cuda_vocab_parallel
          test_cuda_adafactor test_cuda_bf16 test_nccl test_cuda_training)

build() {
  local arch="${1:-90a}" build_dir="$root/build/gpu"
  set -e
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLOOM_ENABLE_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES="$arch" -DLOOM_BUILD_TESTS=ON -DLOOM_BUILD_EXAMPLES=ON \
        -DLOOM_BUILD_BENCH=ON -DLOOM_BENCH_NATIVE=OFF -DLOOM_EXAMPLES_NATIVE=OFF -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON
  cmake --build "$build_dir" --target "${programs[@]}" gpt2_train bert_train loom_cuda_attention_bench loom_option_sweep
  rm -rf "$bin" && mkdir -p "$bin"
  for p in "${programs[@]}"; do cp "$build_dir/tests/cuda/$p" "$bin/"; done
  cp "$build_dir/examples/gpt2_train" "$build_dir/examples/bert_train" "$build_dir/bench/loom_cuda_attention_bench" \
     "$build_dir/tests/sweep/loom_option_sweep" "$bin/"
  strip "$bin"/*
  mkdir -p "$root/.gpu"
  tar cf - -C "$root" build-gpu | xz -T2 -6 > "$root/.gpu/build-gpu.tar.xz"
  du -sh "$bin" "$root/.gpu/build-gpu.tar.xz"
  echo "carry: [\".gpu\"]; then: scripts/gpu_check.sh run"
}

#! The largest batch (a multiple of 8) predicted to fit on a card of CARD_MIB from the memory
#! report of a gpt2_train run at BATCH (LOG): the categories that do not grow with the batch, and
#! the rest of the peak per row; 5% of the card kept back. Prints nothing if the report is missing.
predict_batch() {  # LOG BATCH CARD_MIB
  awk -v batch="$2" -v card="$3" '
    /^(parameters|gradients|optimizer_state) +[0-9.]+ MiB/ { fixed += $2 }
    /^total +[0-9.]+ MiB \(peak [0-9.]+ MiB\)/ { peak = $5 }
    END {
      if (peak == "" || card == "" || peak <= fixed) exit
      rows = int((0.95 * card - fixed) / ((peak - fixed) / batch) / 8) * 8
      if (rows >= 8) print rows
    }' "$1"
}

#! Unpacks .gpu/build-gpu.tar.xz where build-gpu/ is missing (on the device machine), with tar or,
#! where tar has no xz, Python's tarfile.
unpack() {
  local pack="$root/.gpu/build-gpu.tar.xz"
  [[ -x "$bin/gpt2_train" || ! -f "$pack" ]] && return 0
  tar xJf "$pack" -C "$root" 2>/dev/null ||
    python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$pack" "$root"
}

#! Adds to LD_LIBRARY_PATH the folders that hold the libraries a binary cannot find.
find_libraries() {
  local missing lib dir
  missing=$(for f in "$bin"/*; do ldd "$f" 2>/dev/null; done | awk '/not found/ {print $1}' | sort -u)
  for lib in $missing; do
    dir=$(find /usr/local/cuda*/ /usr/lib /opt /usr/local/lib -name "$lib" -print -quit 2>/dev/null | xargs -r dirname)
    if [[ -n "$dir" ]]; then
      export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      echo "found $lib in $dir"
    else
      echo "missing: $lib"
    fi
  done
}

run() {
  # Logs are kept in one folder and packed into $OUT/logs.tgz after each program: a device call
  # brings back at most 8 files.
  local out="${OUT:-$bin}" logs="${OUT:+/tmp/gpu_check_logs}" name rc start seconds summary row groups=" ${*:-tests demo train bench torch} "
  # Each program gets at most this many seconds, so that one hang leaves time for the rest of a
  # device call (10 minutes at most), and never more than is left before the call's deadline.
  local limit="${GPU_CHECK_TIMEOUT:-240}" deadline=$(( SECONDS + ${GPU_CHECK_DEADLINE:-540} ))
  # The test cases whose names say they run on the host (see the header).
  local test_args="${GPU_CHECK_TEST_ARGS-"--test-case-exclude=*host emulation*,*(host*,*host side*"}"
  logs="${logs:-$bin/logs}"
  unpack || { echo "cannot unpack $root/.gpu/build-gpu.tar.xz"; return 1; }
  rm -rf "$logs" && mkdir -p "$logs"
  # Where a failing layout test writes what it got (tests/cuda/mismatch_report.hpp), brought back
  # in logs.tgz with the logs.
  export LOOM_TEST_DUMP_DIR="$logs"
  want() { [[ "$groups" == *" $1 "* ]]; }
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$logs/gpu.txt"
  find_libraries
  run_one() {  # name, command...
    name="$1"; shift
    local left=$(( deadline - SECONDS ))
    if (( left < 20 )); then
      printf '%-34s %4s %7s  %s\n' "$name" "-" "-" "skipped: ${left} s left of GPU_CHECK_DEADLINE" | tee -a "$logs/table.txt"
      rc=124
      return
    fi
    start=$EPOCHREALTIME
    (cd "$bin" && timeout "$(( left < limit ? left : limit ))" "$@") > "$logs/$name.log" 2>&1
    rc=$?
    seconds=$(awk -v a="$start" -v b="$EPOCHREALTIME" 'BEGIN { print b - a }')
    summary=$(grep -E "test cases:|loss [0-9.]+ -> |loom: |error|Error|^(eager|compile)-|^forward \+ backward|^loom_option_sweep:" "$logs/$name.log" | tail -1 | cut -c1-400)
    # Training runs: the median tokens/s of the steps after the first (which loads and plans).
    local median
    median=$(awk '/^step +[0-9]+ \|/ && $2 > 1 { for (i = 1; i <= NF; ++i) if ($i == "tok/s") print $(i - 1) }' \
             "$logs/$name.log" | sort -n | awk '{ v[NR] = $1 } END { if (NR) print v[int((NR + 1) / 2)] }')
    [[ -n "$median" ]] && summary="$summary; median $median tok/s"
    # Written as each program ends, so a call cut off at its limit still shows what ran.
    row=$(printf '%-34s %4s %7.1f  %s' "$name" "$rc" "$seconds" "$summary")
    echo "$row" | tee -a "$logs/table.txt"
    (( rc != 0 && rc != 77 )) && grep -m 8 -E "ERROR|error|what\(\)|Assertion|failed" "$logs/$name.log" | cut -c1-300
    tar czf "$out/logs.tgz" -C "$logs" .
  }
  if want tests; then
    # GPU_CHECK_TESTS: only these test programs (names, space-separated).
    # shellcheck disable=SC2086
    for p in ${GPU_CHECK_TESTS:-${programs[*]}}; do run_one "$p" "./$p" ${test_args:+"$test_args"}; done
  fi
  local small=(./gpt2_train --device cuda --model small --seq 1024 --steps 8 --log-every 1 --lr 6e-4)
  if want train; then
    # The demo on the GPU with validation on held-out batches and a greedy sample after it (the
    # sample runs on the CPU from the gathered weights): the val loss should fall as on the CPU.
    run_one gpt2_train_demo_validation ./gpt2_train --device cuda --demo --steps 60 --log-every 20 --dtype bf16 \
            --val-data synthetic --eval-every 20 --sample-tokens 16 --temperature 0
    # GPT-2 small at sequence 1024 on one GPU (float, TF32); MFU against the H100 SXM's dense
    # TF32 peak, 494.7 TFLOP/s (NVIDIA's datasheet: 989 with sparsity).
    run_one gpt2_train_small_1024 "${small[@]}" --batch 8 --micro-batch 8 --peak-tflops 494.7
    # The issue's benchmark: bf16 (fp32 master weights), MFU against the dense bf16 peak, 989.4,
    # with the defaults (on an sm_80+ GPU: the tiled attention keeping only log-sum-exp, and the
    # GEMM epilogues), then each choice set aside in turn.
    run_one gpt2_train_small_1024_bf16 "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 --peak-tflops 989.4
    run_one gpt2_train_small_1024_bf16_32 "${small[@]}" --batch 32 --micro-batch 32 --dtype bf16 --peak-tflops 989.4
    # The tiled attention on wgmma (an sm_90a build; off by default until timed here).
    run_one gpt2_train_small_1024_bf16_warpgroup "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 \
            --warpgroup-attention --peak-tflops 989.4
    # The attention probabilities kept (B x 12 x 1024^2 values per block), with and without the
    # epilogues; the cuBLAS log-sum-exp kernels instead of the tiled ones.
    run_one gpt2_train_small_1024_bf16_stored "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 \
            --attention stored --no-gemm-epilogues --peak-tflops 989.4
    run_one gpt2_train_small_1024_bf16_stored_epilogues "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 \
            --attention stored --peak-tflops 989.4
    run_one gpt2_train_small_1024_bf16_cublas_lse "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 \
            --attention recompute --no-flash-attention --peak-tflops 989.4
    # Full recomputation and the chunked loss head (docs/recompute.md): what the head's extra GEMM
    # costs at micro-batch 16, and the largest micro-batch with everything recomputed.
    run_one gpt2_train_small_1024_bf16_chunked_logits "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 \
            --logits-chunk-rows 4096 --peak-tflops 989.4
    run_one gpt2_train_small_1024_bf16_recompute_all_128 "${small[@]}" --batch 128 --micro-batch 128 --dtype bf16 \
            --recompute-layers all --logits-chunk-rows 4096 --peak-tflops 989.4
    # BERT-base at sequence 512 (bidirectional attention, masked-LM head), bf16.
    run_one bert_train_base_512_bf16 ./bert_train --device cuda --model base --seq 512 --steps 8 --log-every 1 \
            --lr 1e-4 --batch 32 --micro-batch 32 --dtype bf16 --peak-tflops 989.4
  fi
  if want step; then
    # What a session without time for the train group needs first: the bf16 step at batch 16 with
    # the defaults, then with the tiled attention on wgmma (sm_90a), the defaults again (so that
    # the spread between two runs of one binary is known), and wgmma again.
    run_one step_bf16_defaults "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 --peak-tflops 989.4
    run_one step_bf16_warpgroup "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 --warpgroup-attention \
            --peak-tflops 989.4
    run_one step_bf16_defaults_again "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 --peak-tflops 989.4
    run_one step_bf16_warpgroup_again "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 --warpgroup-attention \
            --peak-tflops 989.4
  fi
  if want best; then
    # bf16 at batch 16, to set beside the torch group's runs of one call: the defaults, and the
    # attention probabilities kept with and without the GEMM epilogues.
    run_one best_bf16_defaults "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 --peak-tflops 989.4
    run_one best_bf16_stored "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 --attention stored \
            --no-gemm-epilogues --peak-tflops 989.4
    run_one best_bf16_stored_epilogues "${small[@]}" --batch 16 --micro-batch 16 --dtype bf16 --attention stored \
            --peak-tflops 989.4
    run_one best_bert_base_512_bf16 ./bert_train --device cuda --model base --seq 512 --steps 8 --log-every 1 \
            --lr 1e-4 --batch 32 --micro-batch 32 --dtype bf16 --peak-tflops 989.4
    # What --fp32-gradients costs (a drain of each layer's bf16 gradient into fp32 sums after every
    # micro-batch's backward; AdamW and the norm read fp32): 4 micro-batches of 4, with and without.
    run_one best_bf16_micro4 "${small[@]}" --batch 16 --micro-batch 4 --dtype bf16 --peak-tflops 989.4
    run_one best_bf16_micro4_fp32_gradients "${small[@]}" --batch 16 --micro-batch 4 --dtype bf16 --fp32-gradients \
            --peak-tflops 989.4
    # Padded batches (rows of 64 to 512 tokens): the tiled attention, which reads the lengths since
    # 2026-11-25, against the probabilities kept (the cuBLAS kernels).
    run_one best_bert_base_512_bf16_padded ./bert_train --device cuda --model base --seq 512 --steps 8 --log-every 1 \
            --lr 1e-4 --batch 32 --micro-batch 32 --dtype bf16 --pad-min 64 --peak-tflops 989.4
    run_one best_bert_base_512_bf16_padded_stored ./bert_train --device cuda --model base --seq 512 --steps 8 \
            --log-every 1 --lr 1e-4 --batch 32 --micro-batch 32 --dtype bf16 --pad-min 64 --attention stored \
            --peak-tflops 989.4
    # BERT's pre-training dropout (0.1 on the hidden states and the attention probabilities): the
    # tiled attention, which draws the mask since 2026-11-25, against the probabilities kept.
    run_one best_bert_base_512_bf16_dropout ./bert_train --device cuda --model base --seq 512 --steps 8 --log-every 1 \
            --lr 1e-4 --batch 32 --micro-batch 32 --dtype bf16 --dropout 0.1 --attention-dropout 0.1 \
            --peak-tflops 989.4
    run_one best_bert_base_512_bf16_dropout_stored ./bert_train --device cuda --model base --seq 512 --steps 8 \
            --log-every 1 --lr 1e-4 --batch 32 --micro-batch 32 --dtype bf16 --dropout 0.1 --attention-dropout 0.1 \
            --attention stored --peak-tflops 989.4
  fi
  if want large; then
    # The issue's "largest micro-batch that fits". loom first: one step at batch 32, whose memory
    # report gives what does not grow with the batch (parameters, gradients, optimizer state) and
    # what a row adds (the rest of the peak: 410 MiB for GPT-2 small bf16 on 2026-11-27, linear
    # from 16 to 192). From the card's memory that predicts the largest batch (a multiple of 8,
    # with 5% of the card kept for the CUDA context, cuBLAS and fragmentation); one step there,
    # then 16 rows fewer at a time until one fits (a size that does not fails in step 1 with
    # loom's out-of-memory message). GPU_CHECK_LARGE_BATCHES names the sizes to try instead. The
    # timed run follows at the size that fits. PyTorch then tries the same batch and, where it
    # does not fit, smaller ones (bench/pytorch_gpu.py --batch a,b,c): eager took 14.5 GiB at 16
    # and 104.3 at 128, torch.compile 8.5 at 16 and 81.9 at 192 (H200, 2026-11-27).
    local sizes=(${GPU_CHECK_LARGE_BATCHES:-}) fits="" b
    local probe=(./gpt2_train --device cuda --model small --seq 1024 --steps 1 --dtype bf16)
    if (( ${#sizes[@]} == 0 )); then
      run_one large_probe_32 "${probe[@]}" --batch 32 --micro-batch 32
      local card_mib predicted
      card_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      predicted=$(predict_batch "$logs/large_probe_32.log" 32 "$card_mib")
      echo "largest batch predicted from batch 32's memory on ${card_mib} MiB: ${predicted:-none}" | tee -a "$logs/table.txt"
      [[ -n "$predicted" ]] && sizes=($(seq "$predicted" -16 $(( predicted > 64 ? predicted - 64 : 16 ))))
    fi
    for b in "${sizes[@]}"; do
      run_one "large_probe_$b" "${probe[@]}" --batch "$b" --micro-batch "$b"
      if (( rc == 0 )); then fits=$b; break; fi
    done
    if [[ -n "$fits" ]]; then
      run_one "large_bf16_defaults_$fits" "${small[@]}" --batch "$fits" --micro-batch "$fits" --dtype bf16 \
              --peak-tflops 989.4
      # PyTorch's sizes: the same, then 7/8, 3/4, 5/8 and 1/2 of it (multiples of 8).
      local torch_sizes
      torch_sizes=$(for f in 8 7 6 5 4; do echo $(( fits * f / 64 * 8 )); done | awk '$1 > 0' | sort -rn -u | paste -sd, -)
      # torch.compile compiles again for each size it tries: more time than one program gets
      # (GPU_CHECK_TORCH_TIMEOUT seconds, 540 by default).
      local saved_limit=$limit
      limit=${GPU_CHECK_TORCH_TIMEOUT:-$(( limit > 540 ? limit : 540 ))}
      run_one "large_pytorch_gpu_$fits" python3 "$root/bench/pytorch_gpu.py" --batch "$torch_sizes" \
              --modes eager-bf16,compile-bf16 --steps 10 --warmup 3 --json "$logs/pytorch_gpu_large.json"
      limit=$saved_limit
    fi
  fi
  if want bench; then
    # The attention kernels alone at GPT-2 small's shape: stored, cuBLAS lse, tiled.
    run_one cuda_attention_bench ./loom_cuda_attention_bench --json "$logs/cuda_attention.json"
  fi
  local demo=(./gpt2_train --demo --device cuda --steps 60 --log-every 20)
  if want demo; then
    run_one gpt2_train_1gpu "${demo[@]}"
    run_one gpt2_train_dp2_staged "${demo[@]}" --dp 2
    run_one gpt2_train_zero3_staged "${demo[@]}" --dp 2 --zero 3
    run_one gpt2_train_dp2_tp2_staged "${demo[@]}" --dp 2 --tp 2
    run_one gpt2_train_pp2_staged "${demo[@]}" --pp 2
    run_one gpt2_train_recompute_dp2_tp2 "${demo[@]}" --dp 2 --tp 2 --attention recompute
    run_one gpt2_train_nccl_1 "${demo[@]}" --comm nccl
    run_one bert_train_dp2_tp2_staged ./bert_train --demo --device cuda --steps 60 --log-every 20 --dp 2 --tp 2
    # NCCL needs a GPU per rank: pipelines over it where the machine has two.
    if (( $(nvidia-smi -L 2>/dev/null | wc -l) >= 2 )); then
      run_one gpt2_train_nccl_pp2_1f1b "${demo[@]}" --comm nccl --pp 2 --gpus 2
      run_one gpt2_train_nccl_pp2_interleaved "${demo[@]}" --comm nccl --pp 2 --gpus 2 --schedule interleaved \
              --virtual-stages 2
    fi
  fi
  if want sweep; then
    # Random gpt2_train and bert_train layouts (DP, ZeRO, TP, SP, PP schedules, recomputation,
    # dropout, padding, bf16, resumes on another layout; tests/sweep/option_sweep.cpp) on the GPU,
    # heads of 32 and 64 channels among them, where bf16 runs the tiled attention kernels,
    # thread ranks sharing it through the staged communicator, each against one CPU rank: the same
    # losses and gradient norms, or a refusal before step one. Float GEMMs run TF32 on the GPU
    # (10-bit products) and bf16 kernels sum in other orders than the CPU's, hence the wider
    # tolerances than ctest's CPU sweep (3e-6 and 3e-3 on the loss).
    run_one option_sweep_cuda ./loom_option_sweep --gpt2-train ./gpt2_train --bert-train ./bert_train --seed 1 \
            --setups "${GPU_CHECK_SWEEP_SETUPS:-12}" --layouts 3 --head-sizes 8,32,64 --candidate-args="--device cuda" \
            --float-tolerance 2e-3 --bf16-tolerance 1e-2
  fi
  if want profile; then
    # Where a bf16 GPT-2 small step's device time goes, kernel by kernel (Nsight Compute, one
    # metric, clocks and caches left alone; 2 steps, totals halved).
    local ncu
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    # GPU_CHECK_PROFILE_ARGS: more gpt2_train options for the profiled run (the defaults: the fastest).
    # shellcheck disable=SC2086
    run_one ncu_gpt2_bf16 "$ncu" --csv --metrics gpu__time_duration.sum --cache-control none --clock-control none \
            --log-file "$logs/ncu_gpt2_bf16.csv" ./gpt2_train --device cuda --model small --seq 1024 --steps 2 \
            --batch 16 --micro-batch 16 --dtype bf16 ${GPU_CHECK_PROFILE_ARGS:-}
    python3 "$root/scripts/kernel_profile.py" "$logs/ncu_gpt2_bf16.csv" --divide 2 | tee "$logs/kernel_profile.txt"
    # One launch of each kernel NCU_DETAIL names (kernel-name regexes, space-separated), in
    # detail: throughputs, occupancy, warp stalls (also by SASS line), shared-memory bank
    # conflicts, instruction mix.
    local pattern i=0
    for pattern in ${NCU_DETAIL:-}; do
      run_one "ncu_detail_$((i++))" "$ncu" --section SpeedOfLight --section MemoryWorkloadAnalysis \
              --section MemoryWorkloadAnalysis_Tables --section Occupancy --section LaunchStats \
              --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
              --section InstructionStats --section SourceCounters --clock-control none \
              -k "regex:$pattern" --launch-count 1 ./gpt2_train --device cuda --model small \
              --seq 1024 --steps 1 --batch 16 --micro-batch 16 --dtype bf16
    done
  fi
  if want torch; then
    # PyTorch on the same GPU (the device image has it), at loom's bf16 batch: eager and
    # compiled bf16, eager fp32 (TF32).
    run_one pytorch_gpu python3 "$root/bench/pytorch_gpu.py" --batch 16 --modes eager-bf16,compile-bf16,eager-fp32 \
            --json "$logs/pytorch_gpu.json"
  fi
  echo
  printf '%-34s %4s %7s  %s\n' program rc seconds summary
  cat "$logs/table.txt"
}

case "${1:-}" in
  build) shift; build "$@" ;;
  run) shift; run "$@" ;;
  *) sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
