#!/usr/bin/env bash
# The GPU work of the DeepSeek/MLA issue, in one device call (each step's log under $OUT):
#   tests     tests/test_mla_gpu.py (kernels at V3's shapes, bf16 and e4m3; tiny V2/V3 with graphs vs transformers;
#             the drill 10 rounds with graphs and its negative control; the fp8 latent cache) and the watch edit
#   kernel    benchmarks/mla_decode.py: decode attention at batch 1/64/256, context 4096, vs the KV-read floor, each
#             tile of the sweep; a 4096-token prompt's attention
#   tiles     the same for the default tile beside the untimed ones only (the transposed tiles, 64 heads x 512
#             columns): a minute or two, not the sweep's many
#   step      the decode step of default-mla (V3's attention shapes, 3 layers, 16 experts) at batch 1/64/256
#   ttft      default-mla's prefill forward of one 1024- and one 4096-token prompt (eager and with prefill graphs), its
#             attention expanded (the default from 256 rows), then absorbed: which form to keep, and from what length
# run: source scripts/device-setup.sh; bash scripts/device-mla.sh [STEP...]      (carry .whl .debs)
set -u
source "$(dirname "$0")/device-check.sh" --steps-only
for s in ${@:-tests kernel step ttft}; do
  case $s in
    tests) TAIL=12 step mla-tests 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE -s tests/test_mla_gpu.py \
             tests/test_mla_watch_gpu.py ;;
    kernel) TAIL=200 step mla-kernel 420 python3 benchmarks/mla_decode.py --sweep --prefill 4096 ;;
    tiles) TAIL=40 step mla-tiles 300 python3 benchmarks/mla_decode.py --batch 64 256 --tile 64,512,32,8,t \
             --tile 64,512,32,16,t --tile 64,512,16,8 ;;
    step) TAIL=10 step mla-step 300 python3 benchmarks/decode_step.py --model default-mla --batch-sizes 1 64 256 \
            --context 4096 ;;
    ttft) TAIL=10 step mla-ttft-expanded 200 python3 benchmarks/prefill_graphs.py --model default-mla --tokens 1024 4096
          TAIL=10 step mla-ttft-absorbed 200 python3 benchmarks/prefill_graphs.py --model default-mla --tokens 1024 4096 \
            --mla-expanded-min-rows 1000000 ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
