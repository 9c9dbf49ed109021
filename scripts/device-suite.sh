#!/usr/bin/env bash
# The whole GPU suite in one device call of a few minutes: four pytest-xdist workers, one test file each at a time
# (a fresh machine compiles every kernel: one process would need two calls), then tests/test_sleep_gpu.py alone --
# it measures the device's free memory (cudaMemGetInfo), which other workers' allocations move.
# run: source scripts/device-setup.sh; bash scripts/device-suite.sh      (carry .whl .debs)
# The device's copy has your working tree but an older .git: never `git checkout`/`stash`/`clean` there (it brings
# back that older commit's files, as on 2026-12-07), and `git log` there does not name the code that runs.
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
# Servers and engines size their KV pools from the GPU's free memory: four side by side outgrew an H100's 80 GB
# (2026-12-07: pools of 105 and -122380 pages), so a GPU under 100 GiB gets three workers.
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
workers=$([ "${memory_mib:-0}" -lt 102400 ] && echo 3 || echo 4)
TAIL=15 step suite-parallel 420 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -n "$workers" --dist loadfile \
  --deselect tests/test_sleep_gpu.py --ignore tests/test_sleep_gpu.py
TAIL=8 step suite-sleep 250 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -s tests/test_sleep_gpu.py
