#!/usr/bin/env bash
# The GPU work of the mixture-of-experts issue, in one device call (each step's log under $OUT):
#   tests         tests/test_moe_gpu.py (bf16 and FP8 layers vs the reference, graphs, the FP8 MoE drill)
#   layer         benchmarks/moe_layer.py: Qwen3-30B-A3B's layer vs its floor, both paths, FP8
#   shapes        the decode step of a 4-layer Qwen3-30B-A3B-shaped model vs its floor (benchmarks/model_shapes.py)
#   reload        an edit of the MoE kernels on that model: the pause, and the revert's tokens
#   offline       the nano-vllm offline workload on it
# run: source scripts/device-setup.sh; bash scripts/device-moe.sh [STEP...]      (carry .whl .debs)
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
dir=${SHAPES_DIR:-/tmp/model-shapes}
model=$dir/qwen3-30b-a3b-4l-v1
for s in ${@:-tests layer shapes reload offline}; do
  case $s in
    tests) TAIL=12 step moe-tests 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -s tests/test_moe_gpu.py ;;
    layer) TAIL=12 step moe-layer 150 python3 benchmarks/moe_layer.py ;;
    shapes) TAIL=8 step moe-shapes 200 python3 benchmarks/model_shapes.py --shapes qwen3-30b-a3b-4l \
              --batch-sizes 1 64 256 --dir "$dir" ;;
    reload) TAIL=12 step moe-reload 150 python3 benchmarks/reload_vs_restart.py --edit moe --cycles 3 -- "$model" ;;
    offline) TAIL=10 step moe-offline 150 python3 benchmarks/offline_throughput.py --model "$model" ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
