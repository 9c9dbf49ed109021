#!/usr/bin/env bash
# Issue 70's "decode step and reload pause unchanged on the GPU (same call, before and after)": this tree against the
# tree before the refactors (5461bb2) in .baseline/, alternately, in one device call of about 8 minutes.
#   here, first:  rm -rf .baseline && mkdir .baseline && git archive 5461bb2 | tar -x -C .baseline
#   run (device): source scripts/device-setup.sh; bash scripts/device-house.sh      (carry .whl .debs .baseline)
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
before="/tmp/site:$PWD/.baseline:$PWD/.baseline/runtime:$PWD/.baseline/kernels"
for round in 1 2; do
  (cd .baseline && export PYTHONPATH=$before && TAIL=8 step "decode-before-$round" 150 \
    python3 benchmarks/decode_step.py --batch-sizes 1 64 256)
  TAIL=8 step "decode-after-$round" 150 python3 benchmarks/decode_step.py --batch-sizes 1 64 256
done
(cd .baseline && export PYTHONPATH=$before && TAIL=6 step reload-before 120 python3 benchmarks/first_reload.py --edits 4)
TAIL=6 step reload-after 120 python3 benchmarks/first_reload.py --edits 4
