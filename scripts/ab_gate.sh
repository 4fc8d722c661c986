#!/usr/bin/env bash
# The paired bench regression gate between two git revisions (docs/ci.md): each revision is installed into its own
# virtualenv, then the head's `spec-cli bench` runs the tests with --baseline-cmd set to the base's spec-cli,
# alternating the two builds, and leaves in OUT_DIR the head's rows with their pairs (gate.jsonl), the plot of a
# speculative sweep (gate.png) and the log with the verdicts (gate.log).
#
# Usage: scripts/ab_gate.sh BASE_REV HEAD_REV OUT_DIR [BENCH FLAGS...]
#   scripts/ab_gate.sh origin/main HEAD gate-out
#   scripts/ab_gate.sh origin/main HEAD gate-out -m smollm2-135m -p 0 -n 64 -r 10
# Without BENCH FLAGS it runs DEFAULT_FLAGS below. PIP_INSTALL_ARGS: extra arguments for both installs (an index
# for torch's CPU wheels, say). Exit code: the gate's (0 ok; 1 a row surely slower, an exact counter changed, or
# a failed run; 2 bad flags).
set -euo pipefail

usage="usage: scripts/ab_gate.sh BASE_REV HEAD_REV OUT_DIR [BENCH FLAGS...]"
base_rev=${1:?$usage}
head_rev=${2:?$usage}
out=${3:?$usage}
shift 3
# a tg test plus a greedy speculative sweep at a fixed draft length (so its acceptance counters are gated exactly)
DEFAULT_FLAGS=(-m qwen2.5-coder-0.5b -p 0 -n 64 --spec-type ngram-mod --draft-max 8 --prompt-set code-edit -r 10
               --max-regression 5)
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=("${DEFAULT_FLAGS[@]}")

root=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
cleanup() {
    for side in base head; do
        [ -d "$work/$side" ] && git -C "$root" worktree remove --force "$work/$side"
    done
    rm -rf "$work"
}
trap cleanup EXIT

install() {  # install SIDE REV: REV's source in a worktree, installed into its own virtualenv
    git -C "$root" worktree add --quiet --detach "$work/$1" "$2"
    python3 -m venv "$work/$1/.venv"
    # shellcheck disable=SC2086
    "$work/$1/.venv/bin/pip" install --quiet ${PIP_INSTALL_ARGS:-} "$work/$1[plot]"
    echo "$1: $(git -C "$root" rev-parse --short "$2") installed in $work/$1/.venv" >&2
}
install base "$base_rev"
install head "$head_rev"

mkdir -p "$out"
plot=()
case " ${flags[*]} " in  # a plot needs a speculative sweep or verify-cost rows
    *" --spec-type "* | *" -md "* | *" --prompt-set "* | *" --prompts "* | *" --verify-cost "*) plot=(--plot "$out/gate.png") ;;
esac
set +e
"$work/head/.venv/bin/spec-cli" bench "${flags[@]}" --baseline-cmd "$work/base/.venv/bin/spec-cli" -o jsonl \
    "${plot[@]}" 2>&1 > "$out/gate.jsonl" | tee "$out/gate.log" >&2
code=${PIPESTATUS[0]}
set -e
exit "$code"
