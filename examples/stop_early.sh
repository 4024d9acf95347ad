#!/bin/bash
# A run with --save-state stops on a signal after the step under way, on every rank, saves its
# training state and exits with 128 + the signal's number; resumed, it trains as the run that was
# never stopped. --stop-after-minutes stops the same way, with status 0; --no-save-on-signal lets
# the signal end the process as usual; --resume-if-exists lets one command line start and resume.
# Usage: stop_early.sh TRAIN DIR [MPIEXEC WORD...]: with an mpiexec command, the same over two MPI
# processes, signalled through mpiexec with SIGUSR1 (which it forwards; its SIGTERM ends the job).
set -u
train=$1
dir=$2
shift 2
mpiexec=("$@")
mkdir -p "$dir"
program=$(basename "$train")
# --steps far beyond what runs: the signal ends every run here, and a lost one times the test out.
run=(--demo --steps 100000 --log-every 1)

fail() {
  echo "FAIL: $*"
  for f in "$dir"/*.out "$dir"/*.err; do [ -s "$f" ] && { echo "--- $f"; tail -n 15 "$f"; }; done
  exit 1
}

# Starts the command after -- in the background, its output in $dir/$1.out and .err; sets $pid.
start() {
  local name=$1
  shift 2
  "$@" >"$dir/$name.out" 2>"$dir/$name.err" &
  pid=$!
}

# Waits until $dir/$1.out has printed step $2 (the process $pid still running).
wait_for_step() {
  for _ in $(seq 1200); do
    grep -qE "^step +$2 \|" "$dir/$1.out" && return 0
    kill -0 "$pid" 2>/dev/null || fail "$1 ended before step $2"
    sleep 0.1
  done
  fail "$1 did not reach step $2 in 120 s"
}

# The step a run says it stopped after on signal $2.
stopped_step() {
  sed -nE "s/^stopped after step ([0-9]+) of 100000: got $2\$/\1/p" "$dir/$1.out"
}

# "loss X | lr Y | grad norm Z" of step $2 in $dir/$1.out.
step_values() {
  sed -nE "s/^step +$2 \| (loss [^|]*\| lr [^|]*\| grad norm [^|]*)\|.*/\1/p" "$dir/$1.out"
}

if [ ${#mpiexec[@]} -eq 0 ]; then
  # 1. SIGTERM to DP 2 thread ranks after step 5.
  state=$dir/term.state
  rm -f "$state" "$state.tmp"
  start term -- "$train" "${run[@]}" --dp 2 --threads 2 --save-state "$state"
  wait_for_step term 5
  kill -TERM "$pid"
  wait "$pid"
  rc=$?
  [ $rc -eq 143 ] || fail "status $rc after SIGTERM; expected 143 (128 + 15)"
  grep -q "^$program: got SIGTERM; the run stops after the step under way and saves its training state" "$dir/term.err" ||
    fail "no notice of the signal on stderr"
  k=$(stopped_step term SIGTERM)
  [ -n "$k" ] || fail "no 'stopped after step K of 100000: got SIGTERM'"
  [ "$k" -ge 5 ] || fail "stopped after step $k, before the signal was sent"
  grep -qE "^step +$((k + 1)) \|" "$dir/term.out" && fail "step $((k + 1)) ran after the stop"
  grep -q "^saved training state $state after step $k " "$dir/term.out" || fail "the state of step $k was not saved"
  grep -q "^go on with --resume $state\$" "$dir/term.out" || fail "no hint to resume"
  [ -e "$state.tmp" ] && fail "a partial $state.tmp was left"

  # 2. Resumed, it trains as the run that was never stopped (the same mesh: the same bits).
  last=$((k + 3))
  "$train" "${run[@]}" --dp 2 --threads 2 --resume "$state" --stop-after $last >"$dir/resumed.out" 2>"$dir/resumed.err" ||
    fail "the resumed run failed"
  "$train" "${run[@]}" --dp 2 --threads 2 --stop-after $last >"$dir/whole.out" 2>"$dir/whole.err" ||
    fail "the uninterrupted run failed"
  got=$(step_values resumed $last)
  want=$(step_values whole $last)
  [ -n "$want" ] && [ "$got" = "$want" ] || fail "step $last resumed: '$got'; uninterrupted: '$want'"
  echo "stopped after step $k on SIGTERM (status 143); resumed, step $last: $got (as uninterrupted)"

  # 3. --stop-after-minutes: stops before the step that would end past it, saves, status 0.
  state=$dir/minutes.state
  rm -f "$state"
  "$train" "${run[@]}" --threads 2 --stop-after-minutes 0.0001 --save-state "$state" >"$dir/minutes.out" 2>"$dir/minutes.err"
  rc=$?
  [ $rc -eq 0 ] || fail "status $rc at --stop-after-minutes; expected 0"
  k=$(sed -nE 's/^stopped after step ([0-9]+) of 100000: --stop-after-minutes 0.0001: .* the next step would end past it$/\1/p' \
      "$dir/minutes.out")
  [ -n "$k" ] || fail "no 'stopped after step K of 100000: --stop-after-minutes'"
  grep -q "^saved training state $state after step $k " "$dir/minutes.out" || fail "the state of step $k was not saved"
  echo "--stop-after-minutes 0.0001 stopped after step $k (status 0)"

  # 4. --no-save-on-signal: the signal ends the process as usual; nothing is saved.
  state=$dir/plain.state
  rm -f "$state"
  start plain -- "$train" "${run[@]}" --threads 2 --save-state "$state" --no-save-on-signal
  wait_for_step plain 3
  kill -TERM "$pid"
  wait "$pid"
  rc=$?
  [ $rc -eq 143 ] || fail "status $rc with --no-save-on-signal; expected 143"
  grep -q "^stopped after" "$dir/plain.out" && fail "--no-save-on-signal stopped and saved"
  [ -e "$state" ] && fail "--no-save-on-signal wrote $state"
  echo "--no-save-on-signal: SIGTERM ended the process (status 143), nothing saved"

  # 5. One command line for a job that is started again after each stop (--resume-if-exists):
  # the first start finds no file and begins at step 1, the next goes on from the saved state.
  state=$dir/requeue.state
  rm -f "$state"
  requeue=("$train" --demo --steps 12 --warmup 2 --log-every 1 --threads 2 --save-state "$state" --resume "$state" --resume-if-exists)
  "${requeue[@]}" --stop-after 4 >"$dir/requeue1.out" 2>&1 || fail "the first start failed"
  grep -q -e "^--resume $state: no such file yet; starting at step 1 (--resume-if-exists)\$" "$dir/requeue1.out" ||
    fail "the first start should say it begins at step 1"
  grep -q "over steps 1\.\.4 of 12" "$dir/requeue1.out" || fail "the first start should run steps 1..4"
  "${requeue[@]}" >"$dir/requeue2.out" 2>&1 || fail "the second start failed"
  grep -q "^resumed from $state after step 4 " "$dir/requeue2.out" || fail "the second start should resume after step 4"
  grep -q "over steps 5\.\.12 of 12" "$dir/requeue2.out" || fail "the second start should run steps 5..12"
  echo "--resume-if-exists: one command line ran steps 1..4, then 5..12"
else
  # 6. Two MPI processes: SIGUSR1 to mpiexec, which forwards it to both.
  state=$dir/mpi.state
  rm -f "$state"
  start mpi -- "${mpiexec[@]}" "$train" "${run[@]}" --comm mpi --threads 1 --save-state "$state"
  wait_for_step mpi 5
  kill -USR1 "$pid"
  wait "$pid"
  rc=$?
  [ $rc -eq 138 ] || fail "status $rc after SIGUSR1; expected 138 (128 + 10)"
  k=$(stopped_step mpi SIGUSR1)
  [ -n "$k" ] || fail "no 'stopped after step K of 100000: got SIGUSR1'"
  grep -q "^saved training state $state after step $k " "$dir/mpi.out" || fail "the state of step $k was not saved"
  [ "$(grep -c "^$program: got SIGUSR1" "$dir/mpi.err")" -eq 2 ] || fail "both processes should announce the signal"
  "$train" --demo --steps 100000 --threads 2 --resume "$state" --stop-after $((k + 1)) >"$dir/mpi_resumed.out" 2>&1 ||
    fail "the state saved by two processes did not resume on one"
  echo "two MPI processes stopped after step $k on SIGUSR1 (status 138); the state resumes on one rank"
fi
