#!/usr/bin/env bash
# The CuTe DSL (tsdev[cute], for tests/test_cute_watch_gpu.py) for the H200 machine, on a CPU machine with network.
# Its wheels (~103 MB, the CUDA 13 libraries 92 MB of it) and .whl/ (~26 MB) are over the device tool's 64 MiB per
# call, so they come in three git-ignored folders, each carried by its own call of the same warm machine (it keeps
# the ignored folders earlier calls brought):
#   call 1: carry .cute1              command: true
#   call 2: carry .cute2 .whl .debs   command: true
#   call 3: carry .cute3              command: source scripts/device-setup.sh; source scripts/device-cute-setup.sh; ...
# Not yet run on the H200 (fourteenth session: no device time left); versions as tested on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=4.8.1
rm -rf .cute1 .cute2 .cute3 /tmp/cute-wheels && mkdir -p .cute1 .cute2 .cute3 /tmp/cute-wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d /tmp/cute-wheels \
  "nvidia-cutlass-dsl==$VERSION" "nvidia-cutlass-dsl-libs-base==$VERSION" "nvidia-cutlass-dsl-libs-core==$VERSION" \
  "nvidia-cutlass-dsl-libs-cu13==$VERSION" "cuda-bindings>=13,<14" cuda-pathfinder protobuf
big=$(ls /tmp/cute-wheels/nvidia_cutlass_dsl_libs_cu13-*.whl)
mv $(ls /tmp/cute-wheels/*.whl | grep -v libs_cu13) .cute1/
split -n 3 -d "$big" /tmp/cute-wheels/part.
for i in 0 1 2; do mv "/tmp/cute-wheels/part.0$i" ".cute$((i + 1))/$(basename "$big").part$i"; done
du -sh .cute1 .cute2 .cute3 .whl .debs
