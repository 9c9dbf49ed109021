#!/usr/bin/env bash
# One device run for issue 18's numbers and issue 17's one-GPU measurement; each log under $OUT (default
# /tmp/device-out), the tails printed. About 6 minutes on the H200.
#   run: source scripts/device-setup.sh; bash scripts/device-speed.sh      (carry .whl and .debs)
set -u
out=${OUT:-/tmp/device-out}
mkdir -p "$out"
source "$(dirname "$0")/device-check.sh" --steps-only
step speed 300 python3 benchmarks/speed.py --cycles 5
step breakdown 90 python3 benchmarks/decode_step.py --batch-sizes 1 256 --breakdown --iters 50
if [ -x "${NSYS:-}" ]; then
    step nsys-decode 120 "$NSYS" profile --trace=cuda,nvtx --sample=none --cuda-graph-trace=node --force-overwrite=true \
        --capture-range=nvtx --nvtx-capture=decode-replay-1 -e NSYS_NVTX_PROFILER_REGISTER_ONLY=0 \
        -o "$out/decode" python3 benchmarks/decode_step.py --batch-sizes 1 --iters 50
    step nsys-stats 60 "$NSYS" stats --report cuda_gpu_kern_sum --format csv -o "$out/decode" "$out/decode.nsys-rep"
    rm -f "$out/decode.nsys-rep" "$out/decode.sqlite"
    # the engine's steps at batch 256 (host ranges tsdev:* and the GPU's kernels, gaps included)
    step nsys-engine-256 150 "$NSYS" profile --trace=cuda,nvtx --sample=none --cuda-graph-trace=node --force-overwrite=true \
        --capture-range=nvtx --nvtx-capture=engine-steps-256 -e NSYS_NVTX_PROFILER_REGISTER_ONLY=0 \
        -o "$out/engine256" python3 benchmarks/decode_step.py --batch-sizes 256 --iters 30
    step nsys-engine-stats 60 "$NSYS" stats --report nvtx_sum,cuda_gpu_kern_sum,cuda_gpu_trace,nvtx_pushpop_trace \
        --format csv -o "$out/engine256" "$out/engine256.nsys-rep"
    TAIL=40 step nsys-engine-timeline 30 python3 benchmarks/nsys_timeline.py "$out/engine256_cuda_gpu_trace.csv" \
        --nvtx "$out/engine256_nvtx_pushpop_trace.csv"
    rm -f "$out/engine256.nsys-rep" "$out/engine256.sqlite" "$out"/engine256_*trace.csv
fi
step tensor-parallel 240 python3 benchmarks/tensor_parallel.py --tp 1
