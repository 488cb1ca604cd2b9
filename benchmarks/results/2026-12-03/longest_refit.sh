#!/bin/bash
# Issue 44's refit, one H200 call: the Llama-3.1-8B shape cut to 1 layer (zero3_offload_all), whose longest measured
# 125.8 GB against 141.0 predicted (longest.sh). Three runs of bench_memory_ladder.py:
#   new-1120k   today's package at the old longest, 1,146,880 tokens (the longest before issue 44's levers on one
#               141 GB GPU): its step time
#   old-1120k   the package as it was before the levers (cf038dd^, copied to .old/ with today's ladder script): the
#               same step, the time to match
#   new-768k    today's package at 768k with MEMORY_BREAKDOWN=1: what is live at the GPU peak (torch.cuda.memory's
#               history), the terms to refit; a point other than the 1.72M one it is checked on
# Made here:  rm -rf .old && mkdir .old && git archive cf038dd^ ulysses_lc ds_configs | tar -x -C .old &&
#             mkdir -p .old/benchmarks .old/tests/data && cp benchmarks/bench_memory_ladder.py .old/benchmarks/ &&
#             cp tests/__init__.py tests/test_memory_prediction.py .old/tests/ && cp tests/data/h200_peaks.json .old/tests/data/
#   bash benchmarks/results/2026-12-03/longest_refit.sh $OUT        (carry .whl and .old)
set -u
OUT=$1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
keep() {  # at most 8 files come back: each run's record and log
  cp "/tmp/$1"/rung_*.json "$OUT/$1.json" 2>/dev/null; cp "/tmp/$1"/log_*.txt "$OUT/$1.log" 2>/dev/null; }
python3 benchmarks/bench_memory_ladder.py --only llama-8b-1L@1120k --budget-s 250 --out /tmp/new-1120k 2>&1 | tail -2
keep new-1120k
(cd .old && python3 benchmarks/bench_memory_ladder.py --only llama-8b-1L@1120k --budget-s 250 --out /tmp/old-1120k 2>&1 | tail -2)
keep old-1120k
MEMORY_BREAKDOWN=1 python3 benchmarks/bench_memory_ladder.py --only llama-8b-1L@768k --budget-s 150 --out /tmp/new-768k \
  2>&1 | tail -2
keep new-768k
# Second call (the 768k breakdown above was skipped by the time guard, and at 768k the plan is all plain): the
# breakdown at 1,572,864 tokens, where the plan checkpoints the layer (plan [1, 0, 1]) as at the 1.72M longest.
#   MEMORY_BREAKDOWN=1 python3 benchmarks/bench_memory_ladder.py --only llama-8b-1L@1536k --budget-s 400 --out /tmp/b
