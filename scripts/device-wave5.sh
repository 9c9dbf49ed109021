#!/usr/bin/env bash
# The wave-5 measurements that need a GPU, in two device calls (after the GPU suite's own call):
#   issue 66  the MLA decode kernels side by side against their floor, and the default-mla decode step with each
#   issue 67  save -> serving with the unsaved buffer compiled ahead against without (one server, alternating)
#   issue 69  the notebook drill (the TUI's picture, tsdev history, the page)
#   issue 67  (warmup) a fresh machine's first start against one with the warm-up manifest the first wrote
#   issue 67  (sight-ab, restart-ab) never-seen edits without/with the first-sight build; restarts read/handed over
# run: source scripts/device-setup.sh; bash scripts/device-wave5.sh mla; then (another call) ... ahead notebook
#      (carry .whl .debs; all three together can pass the 10-minute limit of one call)
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
out=${OUT:-/tmp/device-out}
parts=("$@")
[ $# -gt 0 ] || parts=(mla ahead notebook)
# The carried wheels byte-compiled once, as `pip install` does by default (device-setup.sh installs them with
# --no-compile, which left a first start compiling fastapi's, pydantic's, rich's... modules: 5.7-6.7 s of "python and
# the CLI" on 2026-12-08's H100, not what a user's fresh machine does); the project's own modules stay uncompiled, as
# after `pip install -e .`. Every part that times a start or a standby runs it first.
compile_wheels() {
  [ -d /tmp/site ] && [ ! -e /tmp/site/.compiled ] || return 0
  python3 -m compileall -q -j 0 /tmp/site >/dev/null 2>&1; touch /tmp/site/.compiled
  echo "compiled the carried wheels' modules"
}
for part in "${parts[@]}"; do
  case $part in
    mla)
      TAIL=30 step mla-kernels 200 python3 benchmarks/mla_decode.py --flash-splits 16 32 64
      for k in tiles flash auto; do  # auto: the Gluon kernel on Hopper
        TAIL=8 step "mla-step-$k" 120 env TSDEV_MLA_DECODE=$k python3 benchmarks/decode_step.py --model default-mla \
          --batch-sizes 1 64 256 --context 4096
      done ;;
    mla-auto)  # issue 66: default-mla's decode step with what auto serves (the Gluon kernel on Hopper)
      TAIL=8 step mla-step-auto 150 env TSDEV_MLA_DECODE=auto python3 benchmarks/decode_step.py --model default-mla \
        --batch-sizes 1 64 256 --context 4096 ;;
    mla-small)  # issue 66: small batches, where the splits' merge counts (batch 1's target: 12 us)
      TAIL=30 step mla-small 150 python3 benchmarks/mla_decode.py --kernels gluon flash --batch 1 4 16 64 \
        --gluon-splits 8 16 64 ;;
    fp8-target)  # issue 65: the served block-FP8 projection against the best library GEMM (target 1.15x)
      TAIL=40 step fp8-target 150 python3 benchmarks/fp8_projection_target.py ;;
    moe-peer)  # issue 65: the MoE layer beside vLLM's Triton kernels (carry .peer: benchmarks/moe_vs_peer.py)
      TAIL=16 step moe-peer 200 python3 benchmarks/moe_vs_peer.py ;;
    changed)  # this session's GPU-facing changes first (when the whole suite does not fit): their GPU tests, then a
      # restart (the weights' hand-over through CUDA IPC)
      TAIL=15 step changed-tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/test_fp8_block_gpu.py \
        tests/test_moe_gpu.py tests/test_kernel_checks_gpu.py
      TAIL=16 step restart 150 python3 benchmarks/save_to_serving.py --cycles 0 --restarts 2 ;;
    restart) compile_wheels; TAIL=16 step restart 240 python3 benchmarks/save_to_serving.py --cycles 0 --restarts 3 ;;
    restart-ab)  # issue 67: the restart with the weights read (TSDEV_RESTART_WEIGHTS=read), then handed over
      compile_wheels
      TAIL=16 step restart-read 200 env TSDEV_RESTART_WEIGHTS=read python3 benchmarks/save_to_serving.py --cycles 0 \
        --restarts 3 --restart-gap 10
      TAIL=16 step restart-handover 200 python3 benchmarks/save_to_serving.py --cycles 0 --restarts 3 --restart-gap 10 ;;
    sight-ab)  # issue 67: never-seen edits with each saved text built only by its reload, then also at its first sight
      compile_wheels
      TAIL=8 step sight-off 200 env TSDEV_WATCH_BUILD_ON_SIGHT=0 python3 benchmarks/save_to_serving.py --cycles 8 \
        --restarts 0
      TAIL=8 step sight-on 200 python3 benchmarks/save_to_serving.py --cycles 8 --restarts 0 ;;
    shipped)  # issue 67 point 3: a fresh machine's first start (every cache empty) with the manifest tsdev/warmup/ ships
      compile_wheels
      fresh=$(mktemp -d)
      TAIL=8 step fresh-shipped 240 env TSDEV_CACHE_DIR=$fresh/tsdev TRITON_CACHE_DIR=$fresh/triton \
        python3 benchmarks/startup.py --starts 1 -- --allow-reload-forward ;;
    shipped-workers)  # issue 67 point 3: the same fresh first start with the compile pool at 14 workers (the default
      # is half the cores, at most 8): whether the pool's compiles bound a fresh machine's warm-up. After `shipped` on
      # the same machine Python's files are in the page cache: compare the warm-up parts, not healthy-after
      compile_wheels
      fresh=$(mktemp -d)
      TAIL=8 step fresh-shipped-14 240 env TSDEV_CACHE_DIR=$fresh/tsdev TRITON_CACHE_DIR=$fresh/triton \
        python3 benchmarks/startup.py --starts 1 -- --allow-reload-forward --compile-workers 14 ;;
    ahead) compile_wheels; TAIL=16 step save-ahead 240 python3 benchmarks/save_to_serving.py --cycles 8 --restarts 2 --ahead 1000 ;;
    notebook) OUT=$out TAIL=30 step notebook 150 python3 scripts/notebook_drill.py ;;
    warmup)  # issue 67 point 3: a fresh machine's first start (caches empty), then one with only the warm-up manifest
      # the first wrote (Triton's cache emptied again; the default checkpoint the first wrote stays: compare the
      # startup lines' warm-up parts and compile counts, not only healthy-after); the manifest comes back in $OUT
      # (ship it: cp FILES_AT/sm*.json tsdev/warmup/)
      fresh=$(mktemp -d)
      export TSDEV_CACHE_DIR=$fresh/tsdev TRITON_CACHE_DIR=$fresh/triton
      TAIL=8 step fresh-start 240 python3 benchmarks/startup.py --starts 1 -- --allow-reload-forward
      cp "$TSDEV_CACHE_DIR"/warmup/*.json "$out"/ 2>/dev/null || echo "no manifest written"
      rm -rf "$TRITON_CACHE_DIR"
      TAIL=8 step fresh-with-manifest 240 python3 benchmarks/startup.py --starts 1 -- --allow-reload-forward
      unset TSDEV_CACHE_DIR TRITON_CACHE_DIR ;;
    *) echo "unknown part $part (mla, mla-auto, mla-small, fp8-target, moe-peer, changed, restart, restart-ab, sight-ab, shipped, shipped-workers, ahead, notebook, warmup)"; exit 2 ;;
  esac
done
