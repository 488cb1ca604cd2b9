#!/bin/bash
# Issue 44, the allocator's slack on one GPU with ZeRO-3's parameters offloaded. At the refit's longest (the Llama-3.1-8B
# shape cut to one layer, zero3_offload_all, 1,637,376 tokens, plan [1, 0, 1]) the step reserved 137.6 GB for 119.9
# allocated (14.8%); the plan left 15% (memory_model.OFFLOADED_PARAMS_SLACK), which kept the dry run's one-GPU longest
# at 1,533,952 tokens. Giving the caching allocator's free pages back (torch.cuda.empty_cache, expandable segments)
# at the layer's recompute and before its attention backward: does the slack come down?
#   bash benchmarks/results/2026-12-04/slack.sh $OUT llama-8b-1L@1599k           (carry .whl)
#     first call, 2026-12-04: made with the two empty_cache points patched in by the ladder (now
#     CheckpointHandle.configure(release_cached_memory=True), the run's way where ZeRO-3's parameters are offloaded)
#   bash benchmarks/results/2026-12-04/slack.sh $OUT llama-8b-1L-longest-141gb
#     second call, after the slack went to 10%: the cut's longest with the caching allocator capped at 141 GB, a
#     point held out of that 10%
# Each record has the peaks after the forward and after the backward (phase_peaks: [allocated, reserved] GB).
set -u
OUT=$1
RUNG=$2
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
tag=${RUNG//@/-at-}
timeout 570 python3 benchmarks/bench_memory_ladder.py --only "$RUNG" --budget-s 560 --out /tmp/$tag 2>&1 \
  | grep -v Warning | tail -3
cp /tmp/$tag/rung_*.json "$OUT/$tag.json" 2>/dev/null; cp /tmp/$tag/log_*.txt "$OUT/$tag.log" 2>/dev/null
python3 - "$OUT/$tag.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print({k: r.get(k) for k in ("status", "seq", "plan", "release_cached_memory", "released", "phase_peaks", "gpu_peak",
                             "gpu_reserved", "predicted_gpu", "predicted_gpu_needed", "step_s", "predicted_step_s")})
PY
