#!/usr/bin/env bash
# The GPU work of the mixture-of-experts issue, in one device call:
#   tests (tests/test_moe_gpu.py), the tuner for Qwen3-30B-A3B's layer (quick grid; the JSON lands in $OUT),
#   the layer benchmark with the tuned file, and the default-moe decode step.
# run: source scripts/device-setup.sh; bash scripts/device-moe.sh      (carry .whl .debs)
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
TAIL=20 step moe-tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_moe_gpu.py
TAIL=10 step moe-layer-default 60 python3 benchmarks/moe_layer.py
TAIL=10 step tune-moe 200 python3 benchmarks/tune_moe.py --experts 128 --intermediate 768 --hidden 2048 --tokens 1 16 64 256 --quick --rep 20
cp kernels/moe_configs/*.json "${OUT:-/tmp}/" 2>/dev/null
TAIL=10 step moe-layer-tuned 60 python3 benchmarks/moe_layer.py
