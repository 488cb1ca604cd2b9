#!/bin/bash
# Issue 27 on one H200, one call (10 minutes): bench_window.py again at window 128 (gpt-oss-20b heads), torch's
# flex first and the library's default after it, 5 warm-up and 10 timed calls each (the first call, 3 of each,
# had the default 1-3% under torch's flex at every window, always timed first after its compile); then
# issue27_fla.sh's whole steps of the 24-layer Qwen3.5-0.8B shape on fla (with the first call's autotune results).
#   bash benchmarks/results/2026-12-02/issue27_window128_and_steps.sh $OUT  (after .whl/*.whl are installed)
set -u
OUT=$1
mkdir -p "$OUT"
python3 benchmarks/bench_window.py --only kernels --shapes gpt-oss-20b --candidates flex auto auto_sinks --iters 10 \
  --warmup 5 --budget-s 90 --out "$OUT/window128" 2>&1 | tee "$OUT/window128.log" | grep -v '^{' \
  | grep -v Warning | grep -v 'masks\[T\]' | tail -6
echo "[$SECONDS s] window done"
TOTAL_S=$((585 - SECONDS)) bash benchmarks/results/2026-12-02/issue27_fla.sh "$OUT"
