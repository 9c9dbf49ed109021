#!/usr/bin/env bash
# One device run for the open issues: the whole GPU suite, then the weight and speed benchmarks; each log under
# $OUT (the device tool's output folder; default /tmp/device-out), the tails printed. About 7 minutes on the H200.
#   run: source scripts/device-setup.sh; bash scripts/device-check.sh      (carry .whl and .debs)
set -u
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
step() {  # step NAME SECONDS COMMAND...: run with a time limit, keep the log, show its tail
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    echo "(exit $?)"
    tail -"${TAIL:-6}" "$out/$name.txt" | cut -c1-400
}
[ "${1:-}" = --steps-only ] && return 0  # sourced for `step` alone (device-speed.sh)
step gpu-suite 420 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE
step update-weights 120 python3 benchmarks/update_weights.py
step decode-step 120 python3 benchmarks/decode_step.py --batch-sizes 1 256
step load-weights 90 python3 benchmarks/load_weights.py --rounds 2
