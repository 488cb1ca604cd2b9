#!/bin/bash
# Issue 27: the gated DeltaNet layer's recompute working set on fla, one H200 call (about 3 minutes). The 12-layer
# step at the dry run's longest (1,713,152 tokens, issue27_longest.sh with LAYERS=12) ran out of memory in its
# second layer's forward, beyond 149 GB against 127.9 predicted: a recomputed DeltaNet's forward holds more than the
# memory model's recompute term. Every layer recomputed (the plan forced to 12 / 0 / 12), the step's peak is one layer's recompute
# beside what is held, at two lengths.
#   bash benchmarks/results/2026-12-02/issue27_probe.sh $OUT   (after .whl/*.whl are installed into /tmp/site;
#   carry .whl and .tw)
set -u
OUT=$1
. benchmarks/results/2026-12-02/fla_env.sh
timeout 300 python3 benchmarks/bench_hybrid.py --phase ours --child-out "$OUT/probe_12layers.json" \
  --deadline $(( $(date +%s) + 285 )) --shape qwen3.5-0.8b --layers 12 --force-plan 12 0 12 \
  --lengths 262144 524288 --names p256k p512k 2>&1 | tee "$OUT/probe_12layers.log" | grep '^p' | cut -c1-900
