#!/usr/bin/env bash
# Prepare what the H200 test machine lacks (the device machine has no network), on a CPU machine with network:
#   .whl/   cp312 manylinux wheels of the Python packages missing there (with their dependencies)
#   .debs/  libdw1 + libelf1, which nsys's report importer needs
# Both folders are git-ignored; name them in the device tool's `carry`, then start each device command
# with scripts/device-setup.sh (source it).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl .debs
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any -d .whl \
  fastapi uvicorn watchfiles nvtx textual openai aiohttp schemathesis  # schemathesis: tests/test_api_fuzz.py is collected by `pytest -m gpu` too
# torch, triton, numpy and friends are on the device machine already: never ship them.
rm -f .whl/torch-* .whl/triton-* .whl/numpy-* .whl/nvidia_* 2>/dev/null || true
if command -v apt-get >/dev/null && [ -z "$(ls .debs/*.deb 2>/dev/null)" ]; then
  (apt-get update -qq >/dev/null 2>&1 || true; cd .debs && apt-get download -qq libdw1 libelf1)
fi
du -sh .whl .debs
