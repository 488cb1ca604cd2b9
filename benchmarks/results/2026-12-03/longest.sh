#!/bin/bash
# Issue 44, the longest sequence, measured on one H200 (its host 128 GiB): one step at the dry run's longest for each
# rung, the run's plan made the main job's way, measured torch.cuda.max_memory_allocated / max_memory_reserved and peak
# RSS printed beside the prediction (sizing.Job.predict) by bench_memory_ladder.py's table; every rung is a point held
# out of the fit (the terms it checks were fitted on tests/data/h200_peaks.json's Qwen3 points).
#   llama-8b-1L-longest  the Llama-3.1-8B shape cut to 1 layer, zero3_offload_all: its longest (~1.72M tokens on the
#                        whole GPU; the full model's 1,610,752 is bound by the same terms: one layer's recompute at its
#                        attention and MLP backward, the query-head groups' block, the loss head, 5% allocator slack);
#                        ~175 s predicted. 2 layers take ~344 s, too long beside the start-up for one call; 8 layers
#                        are what the host takes (1,376,256 tokens, ~1,080 s).
#   0.6b-longest-40gb    the full Qwen3-0.6B shape (28 layers, zero3) at its longest for a 40 GB cap (~602k tokens,
#                        ~290 s); on the whole GPU its longest, 2,530,304 tokens, would take ~6,200 s.
# One rung a call (each fits the 10-minute limit with its start-up):
#   bash benchmarks/results/2026-12-03/longest.sh $OUT llama-8b-1L-longest
#   bash benchmarks/results/2026-12-03/longest.sh $OUT 0.6b-longest-40gb
# Then put $OUT/points.json's points into tests/data/h200_peaks.json (held_out: true) and run
# tests/test_memory_prediction.py: each GPU peak must be predicted within 10% (issue 44's must-show).
set -u
OUT=$1
RUNG=${2:-llama-8b-1L-longest}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
timeout "${TOTAL_S:-570}" python3 benchmarks/bench_memory_ladder.py --only "$RUNG" --budget-s "${BUDGET_S:-560}" \
  --out "$OUT/$RUNG" 2>&1 | tee "$OUT/$RUNG.log" | grep -v Warning | tail -8
