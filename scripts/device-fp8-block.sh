#!/usr/bin/env bash
# Issue 50's GPU work (each step's log under $OUT, the tails printed), in two device calls of under 10 minutes:
# `kernels`: the block-FP8 tests; whether the FP8 MoE may multiply on the e4m3 wgmma (each instruction path's error
# against the exact layer beside the W8A8 reference's, and its time); the experts' tuning for Qwen3-30B-A3B's layer
# (as $OUT/moe-block-tuned.json -- the device tool returns no "=" in a name -- and under its moe_config name for the
# steps after it: commit it by that name; add --fp8-wgmma to the tuner once the accuracy table says "yes"); the layer
# against its floor. `steps`: the projections beside _scaled_mm, the best config per M written as the block GEMM's
# tuned files for Qwen3-8B's shapes (returned as $OUT/gemm-N@..+K@...json: commit them under gemm_configs/ with
# "@" -> "=" and "+" -> ","), then the decode step bf16 against block-FP8 at the default's and Qwen3-8B's shapes
# with their logits' cosine (~26 GB written on first use).
# run: source scripts/device-setup.sh; bash scripts/device-fp8-block.sh kernels|steps      (carry .whl .debs)
set -u
out=${OUT:-/tmp/device-out}
source "$(dirname "$0")/device-check.sh" --steps-only
case "${1:-}" in
kernels)
  TAIL=6 step block-tests 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_fp8_block_gpu.py \
    tests/test_sleep_gpu.py::test_drill_ten_rounds_with_graphs_on_block_fp8_checkpoints
  TAIL=30 step fp8-accuracy 150 python3 benchmarks/fp8_moe_accuracy.py
  TAIL=8 step tune-block 180 python3 benchmarks/tune_moe.py --experts 128 --intermediate 768 --hidden 2048 \
    --block-fp8 --quick --tokens 1 16 64 256 --out "$out/moe-block-tuned.json"
  cp "$out/moe-block-tuned.json" \
    "kernels/tsdev_kernels/moe_configs/E=128,I=768,H=2048,dtype=float8_e4m3fn,block=128x128,device=NVIDIA_H200.json"
  TAIL=8 step moe-block 60 python3 benchmarks/moe_layer.py --block-fp8 --tokens 1 16 64 256
  ;;
steps)
  TAIL=40 step fp8-linear 120 python3 benchmarks/fp8_block_linear.py --tune
  for f in kernels/tsdev_kernels/gemm_configs/*.json; do  # "=" and "," out of the names: commit them as they were
    [ -e "$f" ] || continue  # (the tuning failed: none written)
    cp "$f" "$out/gemm-$(basename "$f" | tr '=,' '@+')"
  done
  TAIL=12 step steps-fp8-blocks 420 python3 benchmarks/model_shapes.py --shapes qwen3-0.6b qwen3-8b --fp8-blocks \
    --batch-sizes 1 256 --iters 30
  ;;
*)
  echo "usage: bash scripts/device-fp8-block.sh kernels|steps" >&2
  exit 2
  ;;
esac
