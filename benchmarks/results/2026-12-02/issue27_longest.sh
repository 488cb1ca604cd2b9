#!/bin/bash
# Issue 27, the longest length that fits on one H200, one call (about 7 minutes): the Qwen3.5-0.8B shape, LAYERS
# (default 24) of its layers, on fla over Triton 3.7.1: warm-ups, the steps at LENGTHS named NAMES (none by default),
# then one step at the dry run's longest, with its predicted peak. 2026-12-02 first with LAYERS=12 LENGTHS=262144
# NAMES=256k: its longest ran out of memory (next/hybrid_12layers.json), which led to issue27_probe.sh and
# linear_attention.FLA_RECURRENCE_RECOMPUTE_BYTES_PER_HEAD_TOKEN; then with the defaults (next/hybrid_24layers.json).
#   bash benchmarks/results/2026-12-02/issue27_longest.sh $OUT   (after .whl/*.whl are installed into /tmp/site;
#   carry .whl and .tw: .tw/triton371.tar.xz and .tw/triton_cache_autotune.tar.xz)
set -u
OUT=$1
. benchmarks/results/2026-12-02/fla_env.sh
timeout "${TOTAL_S:-560}" python3 benchmarks/bench_hybrid.py --phase ours --child-out "$OUT/hybrid_${LAYERS:-24}layers.json" \
  --deadline $(( $(date +%s) + ${TOTAL_S:-560} - 15 )) --shape qwen3.5-0.8b --layers "${LAYERS:-24}" \
  --lengths ${LENGTHS:-} --names ${NAMES:-} --longest 2>&1 | tee "$OUT/hybrid_${LAYERS:-24}layers.log" | grep -v Warning | tail -12
