#!/usr/bin/env bash
# hpsweep's GPU promises, checked on a lent GPU machine in one command of at most 7.5 minutes:
#
#   1. the GPU tests: pytest -m gpu (tests/devices/test_gpu.py; a 2-GPU test skips on one GPU);
#   2. packing: trials per minute of the same sweep as a hand loop, gpu=1 --n-jobs 1,
#      gpu=0.5 --n-jobs 2 and gpu=0.25 --n-jobs 4, with GPU utilisation and peak memory
#      (bench/gpu/packing.py);
#   3. bf16 and fp16 against fp32: step time and final metric of one trial (precision.py);
#   4. a 50-trial sweep in which trial 2 runs out of GPU memory for real: the sweep goes on, and
#      the 50th trial's free GPU memory is the first's (memory_oom.py).
#
# Results go to $OUT: results.json, results.md (rewritten after every step, so a run cut short
# still brings back what it measured), pytest.txt and log.txt. No other file is written there.
#
#     bench/gpu/check.sh                 # on the GPU machine, from the repository root
#     bench/gpu/check.sh --dry-run       # anywhere: tiny sizes on the CPU, everything but CUDA
#
# The GPU machine has torch but not optuna or pytest: where they are not importable, the wheels
# in .whl/ (bench/gpu/fetch_wheels.sh, bench/gpu/wheels.txt) are installed into $HPSWEEP_GPU_SITE
# (default /tmp/site) and put on PYTHONPATH. hpsweep itself runs from this working tree
# (python3 -m hpsweep.cli with the repository on PYTHONPATH), never installed.
#
# Environment: PYTHON (default python3); OUT (default ./gpu-check-output);
# HPSWEEP_GPU_DRY_RUN=1 (the same as --dry-run); HPSWEEP_GPU_BUDGET_S, the seconds all steps may
# take together (default 450): each step gets at most its share of what is left, the packing
# runs (last) what remains, and a step with too little left is skipped and marked so.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
dry="${HPSWEEP_GPU_DRY_RUN:-0}"
for arg in "$@"; do
    case "$arg" in
    --dry-run) dry=1 ;;
    -h | --help)
        sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *)
        echo "check.sh: unknown argument $arg (--dry-run, --help)" >&2
        exit 2
        ;;
    esac
done
if [ "$dry" != 0 ]; then export HPSWEEP_GPU_DRY_RUN=1; else unset HPSWEEP_GPU_DRY_RUN; fi
py="${PYTHON:-python3}"
out="${OUT:-$PWD/gpu-check-output}"
budget="${HPSWEEP_GPU_BUDGET_S:-450}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
parts="$work/parts"
mkdir -p "$parts"
log="$out/log.txt"
: >"$log"
started=$(date +%s)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
cd "$root" || exit 1
failed=0

say() { echo "[check.sh +$(($(date +%s) - started))s] $*" | tee -a "$log"; }
summarize() { "$py" bench/gpu/summary.py --parts "$parts" --out "$out" >>"$log" 2>&1 || say "summary failed"; }
record() { # step status seconds
    printf '{"step": "%s", "status": "%s", "seconds": %s}\n' "$1" "$2" "$3" >>"$parts/steps.jsonl"
}

# plan NAME MAX_S MIN_S: sets $step_s, the seconds step NAME may run: at most MAX_S, less when the
# budget has less left (20 s kept for the summary); fails (the step is marked skipped) when that
# is under MIN_S.
plan() {
    local left=$((budget - ($(date +%s) - started) - 20))
    step_s=$((left < $2 ? left : $2))
    if [ "$step_s" -lt "$3" ]; then
        say "$1: skipped, ${left}s left"
        record "$1" "skipped (out of time)" 0
        failed=1
        summarize
        return 1
    fi
}

# step NAME OUTPUT_FILE COMMAND...: run COMMAND for at most $step_s seconds, its output appended to
# OUTPUT_FILE; its exit status and time go to the results.
step() {
    local name="$1" to="$2"
    shift 2
    say "$name: up to ${step_s}s: $*"
    local t0 rc=0
    t0=$(date +%s)
    timeout -k 10 "$step_s" "$@" >>"$to" 2>&1 || rc=$?
    local status="$rc"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status="$rc (cut at ${step_s}s)"; fi
    [ "$rc" = 0 ] || failed=1
    say "$name: exit $status after $(($(date +%s) - t0))s"
    record "$name" "$status" $(($(date +%s) - t0))
    summarize
}

say "dry run: $dry; python: $(command -v "$py"); out: $out; budget ${budget}s"

# 0. what the GPU machine lacks, from the carried wheels
if ! "$py" -c 'import optuna, pytest, pytest_timeout' >/dev/null 2>&1; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        site="${HPSWEEP_GPU_SITE:-/tmp/site}"
        say "installing .whl/ into $site"
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" .whl/*.whl >>"$log" 2>&1 || say "pip install failed"
        export PYTHONPATH="$site:$PYTHONPATH"
    else
        say "optuna, pytest or pytest-timeout is missing and .whl/ has no wheels (bench/gpu/fetch_wheels.sh)"
    fi
fi

plan env 60 5 && step env "$log" "$py" bench/gpu/summary.py --env "$parts/env.json"

# 1. the GPU tests, one line each as they finish (-v: a run cut short still says which passed); a
# test that hangs fails alone (pytest-timeout) instead of using up the step
timeout_arg=()
if "$py" -c 'import pytest_timeout' >/dev/null 2>&1; then timeout_arg=(--timeout 150); fi
plan gpu-tests 240 30 && step gpu-tests "$out/pytest.txt" "$py" -m pytest -m gpu \
    tests/devices/test_gpu.py -p no:cacheprovider -v -rA "${timeout_arg[@]}" \
    --junitxml="$parts/pytest.xml"

# 3. precision, and 4. memory and the OOM, before the packing, which takes whatever is left; each
# script's own limits sit inside the step's, so that it writes its results before being cut
plan precision 120 30 && step precision "$log" "$py" bench/gpu/precision.py \
    --json "$parts/precision.json" --timeout $(((step_s - 5) / 3))
plan memory-oom 150 30 && step memory-oom "$log" "$py" bench/gpu/memory_oom.py \
    --json "$parts/memory_oom.json" --timeout $((step_s - 10))

# 2. packing
plan packing 400 60 && step packing "$log" "$py" bench/gpu/packing.py \
    --json "$parts/packing.json" --budget $((step_s - 10))

summarize
say "done after $(($(date +%s) - started))s; results in $out"
exit "$failed"
