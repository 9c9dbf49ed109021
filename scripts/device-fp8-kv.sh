#!/usr/bin/env bash
# Issue 35's numbers in two device calls of ~5 minutes on the H200 (logs under $OUT, tails printed):
#   throughput: the offline workload with an e4m3 KV pool on the machine as it came (first: its Triton cache is as
#               fresh as the machine), then bf16 and e4m3 again warm, then decode attention bf16 vs e4m3 against each
#               floor (benchmarks/fp8_kv.py);
#   profile:    the batch-256 decode step at context 2048 with each KV dtype, and the e4m3 offline run under nsys
#               (GPU time by kernel, and the timeline's kinds).
#   run: source scripts/device-setup.sh; bash scripts/device-fp8-kv.sh throughput|profile      (carry .whl and .debs)
set -u
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
source "$(dirname "$0")/device-check.sh" --steps-only
offline() { TAIL=4 step "$1" 150 python3 benchmarks/offline_throughput.py --device cuda --kv-cache-dtype "$2"; }
case "${1:-}" in
throughput)
    offline offline-fp8-first fp8
    offline offline-auto-warm auto
    offline offline-fp8-warm fp8
    TAIL=20 step fp8-kv-attention 120 python3 benchmarks/fp8_kv.py ;;
profile)
    for kv in auto fp8; do
        TAIL=3 step "decode-256-ctx2048-$kv" 150 python3 benchmarks/decode_step.py --batch-sizes 256 --context 2048 \
            --iters 30 --kv-cache-dtype "$kv"
    done
    [ -x "${NSYS:-}" ] || { echo "no nsys at NSYS=${NSYS:-}"; exit 1; }
    step nsys-offline-fp8 200 "$NSYS" profile --trace=cuda,nvtx --sample=none --cpuctxsw=none --cuda-graph-trace=node \
        --force-overwrite=true --capture-range=nvtx --nvtx-capture=offline-workload -e NSYS_NVTX_PROFILER_REGISTER_ONLY=0 \
        -o "$out/off-fp8" python3 benchmarks/offline_throughput.py --device cuda --kv-cache-dtype fp8
    step nsys-offline-fp8-stats 90 "$NSYS" stats --report cuda_gpu_kern_sum,cuda_gpu_trace --format csv \
        -o "$out/off-fp8" "$out/off-fp8.nsys-rep"
    TAIL=30 step nsys-offline-fp8-timeline 60 python3 benchmarks/nsys_timeline.py "$out/off-fp8_cuda_gpu_trace.csv"
    rm -f "$out/off-fp8.nsys-rep" "$out/off-fp8.sqlite" "$out/off-fp8_cuda_gpu_trace.csv" ;;
*) echo "usage: bash scripts/device-fp8-kv.sh throughput|profile"; exit 2 ;;
esac
