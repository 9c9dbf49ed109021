# Source at the start of every device command: installs the carried wheels and nsys's libraries.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD:$PWD/runtime:$PWD/kernels${PYTHONPATH:+:$PYTHONPATH} || return 1
for f in .debs/*.deb; do [ -e "$f" ] && dpkg -x "$f" /tmp/nsysdeps; done
export LD_LIBRARY_PATH=/tmp/nsysdeps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NSYS=${NSYS:-/opt/nvidia/nsight-compute/2025.3.1/host/target-linux-x64/nsys}
export PATH=/tmp/site/bin:$PATH
