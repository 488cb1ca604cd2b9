#!/bin/bash
# Issue 27 item 7 on one H200, one call (about 9 minutes), the image's Triton 3.6: bench_window.py's kernel table at
# the three windows after flex_window.py's mask_mod took torch's form (kv > q - window; issue27_next.sh showed the
# mask, not the compiled call, cost the 3%), then whole gpt-oss-20b-shape steps (4 layers, 256k) with flex as the
# windowed layers' default, beside stock transformers.
#   bash benchmarks/results/2026-12-02/issue27_window_final.sh $OUT   (after .whl/*.whl are installed into /tmp/site)
set -u
OUT=$1
mkdir -p "$OUT"
python3 benchmarks/bench_window.py --only kernels --budget-s "${WINDOW_BUDGET:-320}" --iters 5 --warmup 3 \
  --out "$OUT/window" \
  --candidates band_cudnn flash_window band_cudnn_sinks flash_window_sinks auto flex auto_sinks 2>&1 \
  | tee "$OUT/window.log" | grep -v '^{' | grep -v Warning | grep -v 'masks\[T\]' | tail -26
python3 benchmarks/bench_window.py --only steps --budget-s "${STEPS_BUDGET:-190}" --out "$OUT/steps" 2>&1 \
  | tee "$OUT/steps.log" | grep -v '^{' | grep -v Warning | tail -8
