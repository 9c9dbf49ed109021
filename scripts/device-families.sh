#!/usr/bin/env bash
# The GPU work of the model-families issue, in device calls of at most 10 minutes:
#   new     the new GPU tests (families vs transformers, nothing compiles after startup), then
#           benchmarks/model_shapes.py (Llama-3.2-1B, Qwen2.5-1.5B, Qwen3-0.6B shapes against their weight-read floor)
#   decode  the default model's decode step at batch 1 and 256: this tree against .baseline/ (git archive dea720b,
#           carried), alternately
# The rest of the GPU suite: scripts/device-requests.sh suite-a / suite-b.
# run: source scripts/device-setup.sh; bash scripts/device-families.sh PHASE      (carry .whl .debs .baseline)
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
case "${1:-}" in
  new)
    TAIL=25 step new-tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE \
      tests/test_model_families_gpu.py tests/test_compile_at_startup_gpu.py
    TAIL=20 step model-shapes 280 python3 benchmarks/model_shapes.py ;;
  decode)
    for round in 1 2; do
      (cd .baseline && export PYTHONPATH=/tmp/site:$PWD && TAIL=8 step "decode-baseline-$round" 120 \
        python3 benchmarks/decode_step.py --batch-sizes 1 256)
      TAIL=8 step "decode-new-$round" 120 python3 benchmarks/decode_step.py --batch-sizes 1 256
    done ;;
  *) echo "usage: device-families.sh new|decode"; exit 2 ;;
esac
