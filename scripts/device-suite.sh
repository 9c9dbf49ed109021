#!/usr/bin/env bash
# The whole GPU suite: pytest-xdist workers, one test file each at a time (a fresh machine compiles every kernel),
# then tests/test_sleep_gpu.py alone -- it measures the device's free memory (cudaMemGetInfo), which other workers'
# allocations move. On an H100 the two parts took 320 + 216 s at 389a279 and 383 + over 230 s at 7b41ff5, so they
# are two calls of their own; with failures the first can run past its limit before pytest prints why, so each
# failure is written as it happens to $OUT/failures.txt (tests/conftest.py, TSDEV_FAILURES):
# run: source scripts/device-setup.sh; [FIRST="tests/x.py ..."] bash scripts/device-suite.sh [parallel|sleep]
# (carry .whl .debs)
# The device's copy has your working tree but an older .git: never `git checkout`/`stash`/`clean` there (it brings
# back that older commit's files, as on 2026-12-07), and `git log` there does not name the code that runs.
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
# Servers and engines size their KV pools from the GPU's free memory: four side by side outgrew an H100's 80 GB
# (2026-12-07: pools of 105 and -122380 pages), so a GPU under 100 GiB gets three workers.
memory_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
workers=$([ "${memory_mib:-0}" -lt 102400 ] && echo 3 || echo 4)
part=${1:-all}
out=${OUT:-/tmp/device-out}
export TSDEV_FAILURES=$out/failures.txt
limit=${LIMIT:-$([ "$part" = all ] && echo 340 || echo 560)}
# FIRST="tests/a.py tests/b.py": those files first (what failed last time answers early), then the others in the time
# left of the part's limit -- the whole suite still, in two pytest runs.
first=${FIRST:-}
if [ "$part" != sleep ]; then
  parallel=(python3 -m pytest -v -m gpu -p no:cacheprovider -rfE -n "$workers" --dist loadfile --durations 15
            --ignore tests/test_sleep_gpu.py)
  started=$SECONDS
  if [ -n "$first" ]; then
    TAIL=15 step suite-first "$limit" "${parallel[@]}" $first
    grep -oE "\] (PASSED|FAILED|ERROR|SKIPPED) " "$out/suite-first.txt" | sort | uniq -c
    parallel+=($(printf -- "--ignore %s " $first))
  fi
  TAIL=15 step suite-parallel $((limit - (SECONDS - started))) "${parallel[@]}"
  # the tests' outcomes counted, should the run be cut off before pytest's summary
  grep -oE "\] (PASSED|FAILED|ERROR|SKIPPED) " "$out/suite-parallel.txt" | sort | uniq -c
fi
[ "$part" = parallel ] || TAIL=8 step suite-sleep 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -s \
  tests/test_sleep_gpu.py
[ -s "$TSDEV_FAILURES" ] && { echo "== failures (also in $TSDEV_FAILURES):"; grep "^=====" "$TSDEV_FAILURES"; }
true
