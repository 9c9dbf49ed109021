#!/usr/bin/env bash
# nsys of 100 batch-256 engine steps in which every request uses penalties and top-5 logprobs (issue 28's missed
# target): GPU busy and idle time per step, and the kernels (benchmarks/nsys_timeline.py).
#   run: source scripts/device-setup.sh; bash scripts/device-requests-profile.sh      (carry .whl .debs)
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
step nsys-features 200 "$NSYS" profile --trace=cuda,nvtx --sample=none --cpuctxsw=none --cuda-graph-trace=node \
    --force-overwrite=true --capture-range=nvtx --nvtx-capture=engine-steps-256 -e NSYS_NVTX_PROFILER_REGISTER_ONLY=0 \
    -o "$out/features" python3 benchmarks/request_features.py --rounds 1 --iters 30 --cases "penalties+logprobs"
step nsys-features-stats 60 "$NSYS" stats --report cuda_gpu_trace,nvtx_pushpop_trace --format csv \
    -o "$out/features" "$out/features.nsys-rep"
TAIL=45 step nsys-features-timeline 30 python3 benchmarks/nsys_timeline.py "$out/features_cuda_gpu_trace.csv" \
    --nvtx "$out/features_nvtx_pushpop_trace.csv" --step tsdev:schedule
rm -f "$out/features.nsys-rep" "$out/features.sqlite" "$out"/features_*trace.csv
