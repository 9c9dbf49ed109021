# Source after scripts/device-setup.sh in the last of the three calls scripts/device-prep-cute.sh describes: joins
# the CUDA 13 wheel's parts and installs the CuTe DSL.
parts=$(ls .cute1/*.whl.part0 .cute2/*.whl.part1 .cute3/*.whl.part2 2>/dev/null)
[ "$(echo "$parts" | wc -w)" = 3 ] || { echo "device-cute-setup: .cute1/ .cute2/ .cute3/ are all needed" \
  "(scripts/device-prep-cute.sh)"; return 1; }
wheel=$(basename "${parts%%.part0*}") && mkdir -p /tmp/cute-wheels && cat $parts > "/tmp/cute-wheels/$wheel"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .cute1/*.whl "/tmp/cute-wheels/$wheel" || return 1
# the package's .pth (which puts its dsl_packages on sys.path) is not read from a --target folder
export PYTHONPATH=/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
