#!/usr/bin/env bash
# Issue 65's tuned files, made with `tsdev tune` on the device's GPU, in calls of under 9 minutes that each go on
# from the last (resumable: every bucket is written as soon as it is searched). The work folder .tuned/ is
# git-ignored: carry it, and after each call put what came back into it and into the kernels' folders:
#   run (device):  source scripts/device-setup.sh; bash scripts/device-tune.sh [GROUP ...]   (carry .whl .debs .tuned)
#   here, after:   bash scripts/device-tune.sh --install FILES_AT   # unpacks $OUT/tuned.tgz into .tuned/ and copies
#                  # the JSON files into kernels/tsdev_kernels/moe_configs/ and gemm_configs/ (named for the GPU)
#   again until it prints "all tuned" (each call starts no bucket after BUDGET seconds, default 450).
#   the fast search against the full grid (issue: within 3 %), one call of its own:
#                  bash scripts/device-tune.sh --compare      # Qwen3-30B-A3B's bf16 layer, both ways; the table
# GROUP (default: all, in this order -- the H100's required set, most used first):
#   qwen3-30b-a3b qwen3-8b default-moe default-mla qwen3-235b-a22b deepseek-v3 deepseek-v3-tp8 qwen3-32b
set -u
if [ "${1:-}" = --install ]; then
  mkdir -p .tuned && tar xzf "$2/tuned.tgz" -C .tuned
  for kind in moe_configs gemm_configs; do
    mkdir -p "kernels/tsdev_kernels/$kind"
    for f in .tuned/$kind/*.json; do [ -e "$f" ] && cp "$f" "kernels/tsdev_kernels/$kind/"; done
  done
  ls kernels/tsdev_kernels/moe_configs kernels/tsdev_kernels/gemm_configs
  exit 0
fi
out=${OUT:-/tmp/device-out}
mkdir -p "$out" .tuned
budget=${BUDGET:-450}
MOE=bf16,fp8,block-fp8
declare -A SETS=(  # group -> tsdev tune arguments
  [qwen3-30b-a3b]="--model qwen3-30b-a3b --kinds $MOE"
  [qwen3-8b]="--model qwen3-8b --kinds gemm"
  [default-moe]="--model default-moe --kinds $MOE"
  [default-mla]="--model default-mla --kinds $MOE"
  [qwen3-235b-a22b]="--model qwen3-235b-a22b --kinds $MOE"
  [deepseek-v3]="--model deepseek-v3 --kinds $MOE,gemm"
  [deepseek-v3-tp8]="--model deepseek-v3 --tp 8 --kinds $MOE"
  [qwen3-32b]="--model qwen3-32b --kinds gemm")
ORDER=(qwen3-30b-a3b qwen3-8b default-moe default-mla qwen3-235b-a22b deepseek-v3 deepseek-v3-tp8 qwen3-32b)
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$out/gpu.txt"
if [ "${1:-}" = --compare ]; then  # the same shape and kind, the fast search then the full grid, each resumable
  for way in fast full; do
    timeout 540 python3 -m tsdev tune --moe 128,768,2048,8 --kinds bf16 --out ".tuned/compare-$way" --resume \
      --budget "$budget" $([ $way = full ] && echo --full) 2>&1 | tail -8
  done
  python3 - <<'EOF' | tee "$out/compare.md"
import json
rows = {way: {r["tokens"]: r for r in map(json.loads, open(f".tuned/compare-{way}/tune-log.jsonl"))} for way in ("fast", "full")}
print("| tokens | fast µs | configs timed | full grid µs | configs timed | fast / full |\n|---:|---:|---:|---:|---:|---:|")
for t in sorted(rows["full"]):
    fast, full = rows["fast"].get(t), rows["full"][t]
    if fast:
        print(f"| {t} | {fast['us']:.1f} | {fast['timed']} | {full['us']:.1f} | {full['timed']} | {fast['us'] / full['us']:.3f} |")
EOF
  tar czf "$out/tuned.tgz" -C .tuned .
  exit 0
fi
groups=("$@")
[ $# -gt 0 ] || groups=("${ORDER[@]}")
start=$SECONDS
for group in "${groups[@]}"; do
  args=${SETS[$group]:?unknown group $group (one of: ${ORDER[*]})}
  left=$((budget - (SECONDS - start)))
  [ $left -gt 30 ] || { echo "budget spent: call again"; break; }
  echo "== $group ($left s left): tsdev tune $args"
  timeout $((left + 90)) python3 -m tsdev tune $args --out .tuned --resume --budget "$left" > "$out/tune-$group.txt" 2>&1
  echo "(exit $?)"; grep -v "^\s*$" "$out/tune-$group.txt" | tail -4 | cut -c1-300
done
tar czf "$out/tuned.tgz" -C .tuned .
left_total=0
for group in "${ORDER[@]}"; do
  n=$(python3 -m tsdev tune ${SETS[$group]} --out .tuned --resume --dry-run 2>/dev/null | grep -vc "(done)")
  left_total=$((left_total + n))
done
[ $left_total -eq 0 ] && echo "all tuned" || echo "$left_total file(s) still have buckets to tune: call again"
