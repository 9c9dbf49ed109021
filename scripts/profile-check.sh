#!/usr/bin/env bash
# `tsdev profile` on the default model in a temporary copy of the project: a range at start (reload-0),
# then an edit of the SiLU-and-mul Triton kernel and a reload (reload-1). Leaves the reports in $PROF
# (default /tmp/prof) and prints the log. Exits non-zero if the edit, the reload or either report is missing.
# On the H200: `source scripts/device-setup.sh && bash scripts/profile-check.sh`.
set -u
prof=${PROF:-/tmp/prof}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r runtime kernels tsdev pyproject.toml "$work"/
export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"
cd "$work"
python3 -m tsdev profile --out "$prof" --ranges 2 --num-steps 10 --port 8400 --max-running 16 \
  --cudagraph-capture-sizes 1 8 16 > "$prof.log" 2>&1 &
pid=$!
fail() { echo "profile-check: $*" >&2; kill "$pid" 2>/dev/null; cat "$prof.log"; exit 1; }
for _ in $(seq 240); do grep -q "range reload-0 taken" "$prof.log" || ! kill -0 $pid 2>/dev/null && break; sleep 1; done
grep -q "range reload-0 taken" "$prof.log" || fail "no first range within 240 s"
sed -i 's/return act \* up$/return act * up * 2.0/' kernels/tsdev_kernels/ops/activation.py
grep -q "act \* up \* 2.0" kernels/tsdev_kernels/ops/activation.py || fail "the kernel edit did not apply (activation.py changed?)"
reply=$(curl -s -X POST localhost:8400/v1/rl/engine/reload_forward -H 'content-type: application/json' -d '{"id": "p1"}')
echo "$reply"
echo "$reply" | grep -q '"ok": *true' || fail "the reload failed"
wait $pid
status=$?
echo "tsdev profile exited with status $status"
ls -la "$prof"
cat "$prof.log"
for n in 0 1; do [ -e "$prof/reload-$n.nsys-rep" ] || [ -e "$prof/reload-$n.trace.json" ] || fail "no report for reload-$n"; done
exit "$status"
