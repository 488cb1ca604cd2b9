#!/bin/bash
# Issue 27 item 7 on one H200, one call (about 7 minutes), the image's Triton 3.6: the CUDA window tests, then
# bench_window.py's kernel table at the three windows, after flex_window.py's compile became static and auto
# started picking flex (window_attention.WINDOW_RATES).
#   bash benchmarks/results/2026-12-02/issue27_window_static.sh $OUT   (after .whl/*.whl are installed into /tmp/site)
set -u
OUT=$1
mkdir -p "$OUT"
timeout 150 python3 -m pytest tests/test_window_cuda.py -q -p no:cacheprovider 2>&1 \
  | tee "$OUT/window_cuda_tests.log" | tail -3
python3 benchmarks/bench_window.py --only kernels --budget-s "${WINDOW_BUDGET:-330}" --out "$OUT/window" \
  --candidates band_cudnn flash_window band_cudnn_sinks flash_window_sinks auto flex auto_sinks 2>&1 \
  | tee "$OUT/window.log" | grep -v '^{' | grep -v Warning | grep -v 'masks\[T\]' | tail -30
