#!/usr/bin/env bash
# `tsdev watch --no-tui` on the default model, in a temporary copy of the project: edit the SiLU-and-mul
# Triton kernel (one reload line), then the scheduler (a restart), then kill -9 the server (a restart),
# then stop the daemon. Prints its lines; leaves watch.txt and server.log in $OUT (default /tmp).
# On the H200: `source scripts/device-setup.sh && bash scripts/watch-check.sh`. On a CPU box, add
# `--device cpu` (the kernel is then not launched: CPU runs the torch reference).
set -u
out=${OUT:-/tmp}
work=$(mktemp -d)
cp -r runtime kernels tsdev pyproject.toml "$work"/
export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"
cd "$work"
python3 -m tsdev watch --no-tui --port 8123 --cudagraph-capture-sizes 1 8 16 --server-log "$out/server.log" "$@" \
  > "$out/watch.txt" 2>&1 &
daemon=$!

wait_for() {  # a line matching $1 within $2 seconds
  for _ in $(seq "$2"); do
    grep -qE "$1" "$out/watch.txt" && return 0
    kill -0 "$daemon" 2>/dev/null || break
    sleep 1
  done
  echo "watch-check: no line matching '$1'" >&2
  return 1
}

wait_for "^.{9}watching" 600 &&
  sed -i 's/return act \* up$/return act * up * 2.0/' kernels/tsdev_kernels/ops/activation.py &&
  grep -q "act \* up \* 2.0" kernels/tsdev_kernels/ops/activation.py &&
  wait_for "reload #1 (ok|FAILED)" 300 &&
  sed -i '1s/^"""/"""Edited by watch-check. /' runtime/tsdev_runtime/engine/scheduler.py &&
  wait_for "restart #1: .*(restarted|FAILED)" 600 &&
  kill -9 "$(grep -oE 'pid [0-9]+' "$out/watch.txt" | tail -1 | cut -d' ' -f2)" &&
  wait_for "restart #2: .*(restarted|FAILED)" 600
status=$?
kill -INT "$daemon" 2>/dev/null
wait "$daemon"
echo "tsdev watch exited with status $?; checks: $status"
cat "$out/watch.txt"
rm -rf "$work"
exit "$status"
