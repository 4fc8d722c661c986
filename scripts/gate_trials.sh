#!/usr/bin/env bash
# Counts the bench regression gate's false alarms and detections (the figures of docs/ci.md), on this checkout's
# spec-cli, sequentially, TRIALS times each:
#   self      paired gate, this build against itself                       exit 1 = a false alarm
#   slow1.5   paired gate, every model forward of the current build 1.5x slower   exit 1 = caught
#   slow1.15  the same, 1.15x                                                       exit 1 = caught
#   stored    the stored-file flow: one baseline run, then TRIALS runs against it   exit 1 = a false alarm
# (slowF for any F: tests/altered_build.py. The time outside the forwards is not slowed, so a row's slowdown is a
# little less than F: the median ratio in each log says how much.)
# Usage: scripts/gate_trials.sh [TRIALS] [OUT_DIR]     (from the repository root, with its venv active)
# PAIRED_ARGS and STORED_ARGS replace the bench flags of the paired and the stored-file runs; KINDS picks kinds.
# Every run's stdout (jsonl) and stderr (pairs, verdicts) are kept in OUT_DIR; the last lines are the counts.
# Run one at a time on an otherwise idle machine.
set -euo pipefail

trials=${1:-20}
out=${2:-gate-trials}
paired_args=${PAIRED_ARGS:--m qwen2.5-coder-0.5b -p 0 -n 64 -r 10 --max-regression 5}
stored_args=${STORED_ARGS:--m qwen2.5-coder-0.5b -p 0 -n 64 -r 5 --max-regression 35}
kinds=${KINDS:-self slow1.5 slow1.15 stored}
mkdir -p "$out"

run() {  # run KIND TRIAL CMD...: one gate run, its exit code appended to OUT/KIND.codes
    local kind=$1 trial=$2
    shift 2
    local code=0
    "$@" > "$out/$kind.$trial.jsonl" 2> "$out/$kind.$trial.log" || code=$?
    echo "$code" >> "$out/$kind.codes"
    echo "$kind $trial: exit $code" >&2
}

for kind in $kinds; do
    rm -f "$out/$kind.codes"
    if [ "$kind" = stored ]; then
        # shellcheck disable=SC2086
        spec-cli bench $stored_args -o jsonl > "$out/stored.baseline.jsonl"
    fi
    for trial in $(seq 1 "$trials"); do
        case $kind in
            # shellcheck disable=SC2086
            self) run self "$trial" spec-cli bench $paired_args --baseline-cmd spec-cli -o jsonl ;;
            slow*) ALTERED_BUILD_SLOWDOWN=${kind#slow} run "$kind" "$trial" \
                       python tests/altered_build.py bench $paired_args --baseline-cmd spec-cli -o jsonl ;;
            stored) run stored "$trial" spec-cli bench $stored_args --baseline "$out/stored.baseline.jsonl" -o jsonl ;;
            *) echo "unknown kind $kind" >&2; exit 2 ;;
        esac
    done
done

for kind in $kinds; do
    codes=$(sort "$out/$kind.codes" | uniq -c | tr '\n' ' ')
    echo "$kind: exit codes (count code): $codes"
done
