#!/usr/bin/env bash
# The GPU work of the request-features issue, in device calls of at most 10 minutes:
#   suite-a / suite-b   the GPU suite in two halves (a fresh machine compiles every kernel: one call is too short)
#   bench               the batch-256 decode step: this tree against the session-start tree in .baseline/ (git
#                       archive 23653e3, carried), alternately, then benchmarks/request_features.py
# run: source scripts/device-setup.sh; bash scripts/device-requests.sh PHASE      (carry .whl .debs .baseline)
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
A="tests/test_kernels_gpu.py tests/test_request_features_gpu.py tests/test_runtime_gpu.py tests/test_default_model_gpu.py tests/test_fp8_gpu.py tests/test_prefill_graphs_gpu.py tests/hotreload/test_hotreload_gpu.py"
B="tests/test_profile_gpu.py tests/test_reload_gpu.py tests/test_reload_server_gpu.py tests/test_sleep_gpu.py tests/test_tensor_parallel_gpu.py tests/test_update_weights_gpu.py tests/test_weights_gpu.py"
case "${1:-}" in
  suite-a) TAIL=15 step suite-a 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE $A ;;
  suite-b) TAIL=15 step suite-b 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE $B ;;
  bench)
    for round in 1 2; do
      (cd .baseline && export PYTHONPATH=/tmp/site:$PWD && TAIL=8 step "decode-256-baseline-$round" 150 \
        python3 benchmarks/decode_step.py --batch-sizes 256)
      TAIL=8 step "decode-256-new-$round" 150 python3 benchmarks/decode_step.py --batch-sizes 256
    done
    TAIL=12 step request-features 240 python3 benchmarks/request_features.py --rounds 3 ;;
  *) echo "usage: device-requests.sh suite-a|suite-b|bench"; exit 2 ;;
esac
