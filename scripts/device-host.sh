#!/usr/bin/env bash
# Issue 53's numbers in one device call (~9 minutes on the H200): offline on nano-vllm's workload (bf16 and the fp8
# KV cache: tok/s, host ms/step, the GPU's idle share between steps), the same workload served at 256 streams with
# and without the API process (`tsdev bench`), and decode at batch 1 against graph replay. Run it on two different
# machines (fresh calls) for the spread; each log under $OUT, the tails printed.
#   run: source scripts/device-setup.sh; bash scripts/device-host.sh [offline|gpu-work]      (carry .whl and .debs)
# `offline`: the offline runs and decode at batch 1 alone (~3 minutes: the second machine's figures for the spread).
# `gpu-work`: where a ~139-row decode step's GPU time goes (the offline run is GPU-bound), and the row-tiled Triton
# GEMM against cuBLAS at decode batches (~6 minutes).
set -u
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
source "$(dirname "$0")/device-check.sh" --steps-only
echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
if [ "${1:-}" = gpu-work ]; then  # what the GPU spends a ~139-row decode step on, and the projections' alternative
  TAIL=40 step breakdown 120 python3 benchmarks/decode_step.py --batch-sizes 136 --context 1024 --breakdown
  TAIL=60 step sweep-rows 300 python3 benchmarks/kernels_bench.py --sweep-rows 64 139 256
  exit 0
fi
TAIL=14 step offline-bf16 240 python3 benchmarks/offline_throughput.py
TAIL=14 step offline-fp8 240 python3 benchmarks/offline_throughput.py --kv-cache-dtype fp8
TAIL=10 step decode-1 120 python3 benchmarks/decode_step.py --batch-sizes 1 --iters 200
[ "${1:-}" = offline ] && exit 0
# nano-vllm's lengths, uniform in 100..1024 (562 +- 82.2 %), in and out
WORKLOAD=(--num-prompts 256 --random-input-len 562 --random-output-len 562 --random-range-ratio 0.822
          --max-concurrency 256 --warmup 4)
for mode in api-process no-api-process; do
    python3 -m tsdev serve --port 8400 --max-running 256 "--$mode" > "$out/serve-$mode.txt" 2>&1 &
    pid=$!
    for _ in $(seq 600); do curl -sf http://127.0.0.1:8400/health > /dev/null && break; sleep 0.5; done
    TAIL=22 step "bench-$mode" 300 python3 -m tsdev bench --url http://127.0.0.1:8400 "${WORKLOAD[@]}"
    curl -s http://127.0.0.1:8400/metrics | grep -E '^tsdev_(gpu_|step_host_seconds_(sum|count))' > "$out/metrics-$mode.txt"
    cat "$out/metrics-$mode.txt"
    kill "$pid"
    wait "$pid"
done
# the API process's own ceiling on this host (a fake engine behind it): it must stay above the offline figure
TAIL=6 step api-ceiling 120 python3 benchmarks/api_process_ceiling.py
# what the API process costs a start (its imports run beside the load; its app is built after the engine's hello)
TAIL=4 step startup-two-processes 120 python3 benchmarks/startup.py
TAIL=4 step startup-one-process 120 python3 benchmarks/startup.py -- --no-api-process
