#!/usr/bin/env bash
# Issue 49's tuning files: the full grid of benchmarks/tune_moe.py (kernels compiled in parallel first) for the MoE
# shapes users serve, bf16 and FP8 experts, one rank and a tensor-parallel rank of 2 (its intermediate halved), each
# written to $OUT/tuned-E-I-H-KIND.json (the device tool returns no "=" or "," in a name) and resumed from
# .tuned/ (git-ignored; carry it) where an earlier call left a partial file. Then, on this machine:
#   bash scripts/device-tune-moe.sh --install DIR      # DIR: where the call's files came back; copies them under the
#                                                      # names moe_config reads (kernels/tsdev_kernels/moe_configs/)
# run: source scripts/device-setup.sh; bash scripts/device-tune-moe.sh [SHAPE ...]   (carry .whl .debs .tuned)
# SHAPE: qwen3-30b-a3b qwen3-30b-a3b-tp2 qwen3-235b-a22b qwen3-235b-a22b-tp2 deepseek-v3 deepseek-v3-tp2 default-moe
set -u
declare -A SHAPES=(  # experts intermediate hidden top-k
  [qwen3-30b-a3b]="128 768 2048 8" [qwen3-30b-a3b-tp2]="128 384 2048 8"
  [qwen3-235b-a22b]="128 1536 4096 8" [qwen3-235b-a22b-tp2]="128 768 4096 8"
  [deepseek-v3]="256 2048 7168 8" [deepseek-v3-tp2]="256 1024 7168 8" [default-moe]="32 512 1024 4")
if [ "${1:-}" = --install ]; then
  for f in "$2"/tuned-*.json; do
    IFS=- read -r _ e i h kind <<< "$(basename "$f" .json)"
    dtype=$([ "$kind" = fp8 ] && echo float8_e4m3fn || echo bfloat16)
    cp -v "$f" "kernels/tsdev_kernels/moe_configs/E=$e,I=$i,H=$h,dtype=$dtype,device=NVIDIA_H200.json"
  done
  exit 0
fi
out=${OUT:-/tmp/device-out}
source "$(dirname "$0")/device-check.sh" --steps-only
names=("$@")
[ $# -gt 0 ] || names=(qwen3-30b-a3b qwen3-235b-a22b)
for name in "${names[@]}"; do
  read -r e i h k <<< "${SHAPES[$name]:?unknown shape $name (one of: ${!SHAPES[*]})}"
  for kind in bf16 fp8; do
    file="tuned-$e-$i-$h-$kind.json"
    [ -f ".tuned/$file" ] && cp ".tuned/$file" "$out/$file"
    TAIL=7 step "tune-$name-$kind" 540 python3 benchmarks/tune_moe.py --experts "$e" --intermediate "$i" \
      --hidden "$h" --topk "$k" $([ "$kind" = fp8 ] && echo --fp8) --resume --out "$out/$file"
  done
done
