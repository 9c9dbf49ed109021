#!/usr/bin/env bash
# `tsdev profile` on the default model in a temporary copy of the project: a range at start (reload-0),
# then an edit of the SiLU-and-mul Triton kernel and a reload (reload-1). Leaves the reports in $PROF
# (default /tmp/prof) and prints the log. On the H200: `source scripts/device-setup.sh && bash scripts/profile-check.sh`.
set -u
prof=${PROF:-/tmp/prof}
work=$(mktemp -d)
cp -r runtime kernels tsdev pyproject.toml "$work"/
export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"
cd "$work"
python3 -m tsdev profile --out "$prof" --ranges 2 --num-steps 10 --port 8400 --max-running 16 \
  --cudagraph-capture-sizes 1 8 16 > "$prof.log" 2>&1 &
pid=$!
for _ in $(seq 240); do grep -q "range reload-0 taken" "$prof.log" || ! kill -0 $pid 2>/dev/null && break; sleep 1; done
sed -i 's/(act \* up).to(OUT.dtype.element_ty)/(act * up * 2.0).to(OUT.dtype.element_ty)/' kernels/ops/activation.py
curl -s -X POST localhost:8400/v1/rl/engine/reload_forward -H 'content-type: application/json' -d '{"id": "p1"}'; echo
wait $pid
echo "tsdev profile exited with status $?"
ls -la "$prof"
cat "$prof.log"
rm -rf "$work"
