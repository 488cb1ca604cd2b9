#!/bin/bash
# Issue 27 on one H200, one call (about 8 minutes): the CUDA window tests of the flex path and bench_window.py's
# kernel table under the image's Triton 3.6; then, under Triton 3.7.1 (issue27_fla.sh says how it travels), the
# gated DeltaNet layer against fla's kernels alone at 256k.
#   bash benchmarks/results/2026-12-02/issue27_window_fla.sh $OUT   (after .whl/*.whl are installed into /tmp/site)
set -u
OUT=$1
mkdir -p "$OUT"
timeout 120 python3 -m pytest tests/test_window_cuda.py -q -x -k "flex or auto" -p no:cacheprovider 2>&1 \
  | tee "$OUT/window_cuda_tests.log" | tail -3
python3 benchmarks/bench_window.py --only kernels --budget-s "${WINDOW_BUDGET:-270}" --out "$OUT/window" \
  --candidates band_cudnn flash_window auto auto_sinks flex flex_lib flex_lib_sinks 2>&1 | tee "$OUT/window.log" \
  | grep -v '^{' | tail -25
tar -xJf .tw/triton371.tar.xz -C /tmp/site
python3 benchmarks/bench_deltanet.py --out "$OUT/deltanet" --budget-s "${DELTANET_BUDGET:-240}" 2>&1 \
  | tee "$OUT/deltanet.log" | grep -v '^{"kind": "time"' | tail -12
