#!/bin/bash
# What issue 27 still needs from one H200, one call (about 6 minutes): (1) where the library's flex path loses its
# 1-3% to torch's own flex call, by swapping one half at a time (bench_window.py's flex_ourmask and
# flex_lib_torchmask) at window 128; (2) stock transformers' longest fitting length on the 24-layer Qwen3.5-0.8B
# shape, each length in a clean process with expandable segments (2026-12-02: 48k out of memory, 40k ran once, then
# its second step ran out of memory after the 48k failure, in a process without them).
#   bash benchmarks/results/2026-12-02/issue27_next.sh $OUT   (after .whl/*.whl are installed into /tmp/site;
#   carry .whl and .tw: .tw/triton371.tar.xz and .tw/triton_cache_autotune.tar.xz, issue27_fla.sh's last $OUT file)
set -u
OUT=$1
mkdir -p "$OUT" /tmp/site /tmp/triton_cache
python3 benchmarks/bench_window.py --only kernels --shapes gpt-oss-20b --iters 10 --warmup 5 --budget-s 200 \
  --candidates flex flex_ourmask flex_lib_torchmask flex_lib_direct auto flex --out "$OUT/window_swap" 2>&1 | tee "$OUT/window_swap.log" \
  | grep -v '^{' | grep -v Warning | grep -v 'masks\[T\]' | tail -7
tar -xJf .tw/triton371.tar.xz -C /tmp/site
[ -f .tw/triton_cache_autotune.tar.xz ] && tar -xJf .tw/triton_cache_autotune.tar.xz -C /tmp/triton_cache
export TRITON_CACHE_DIR=/tmp/triton_cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for n in 45056 40960; do
  timeout 150 python3 benchmarks/bench_hybrid.py --phase stock --child-out "$OUT/stock_$n.json" \
    --deadline $(( $(date +%s) + 140 )) --shape qwen3.5-0.8b --layers 24 --lengths $n 2>&1 | grep '^stock'
done
