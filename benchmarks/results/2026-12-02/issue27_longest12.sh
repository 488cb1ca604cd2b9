#!/bin/bash
# Issue 27, the longest length that fits on one H200, one call (about 8 minutes): the Qwen3.5-0.8B shape cut to 12
# of its 24 layers (the 24-layer step at its predicted longest, 1,656,832 tokens, takes about 12 minutes, over the
# device's 10-minute command limit), on fla over Triton 3.7.1: warm-ups, 256k (the step the time model is scaled
# to), then one step at the dry run's longest for 12 layers, with its predicted peak.
#   bash benchmarks/results/2026-12-02/issue27_longest12.sh $OUT   (after .whl/*.whl are installed into /tmp/site;
#   carry .whl and .tw: .tw/triton371.tar.xz and .tw/triton_cache_autotune.tar.xz)
set -u
OUT=$1
mkdir -p "$OUT" /tmp/site /tmp/triton_cache
tar -xJf .tw/triton371.tar.xz -C /tmp/site
tar -xJf .tw/triton_cache_autotune.tar.xz -C /tmp/triton_cache
export TRITON_CACHE_DIR=/tmp/triton_cache PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout "${TOTAL_S:-560}" python3 benchmarks/bench_hybrid.py --phase ours --child-out "$OUT/hybrid_12layers.json" \
  --deadline $(( $(date +%s) + ${TOTAL_S:-560} - 15 )) --shape qwen3.5-0.8b --layers 12 \
  --lengths 262144 --names 256k --longest 2>&1 | tee "$OUT/hybrid_12layers.log" | grep -v Warning | tail -12
