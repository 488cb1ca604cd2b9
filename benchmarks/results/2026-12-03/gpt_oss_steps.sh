#!/bin/bash
# Issue 43 item 4, one H200 call (about 5 minutes): the gpt-oss-20b shape's whole step (4 of its 24 layers, 256k
# tokens) with flex as the window default, now that bench_window runs an untimed step at the timed length first
# (2026-12-02: 21.29 s with the timed step paying flex's compile for that length, against 17.12 s on 2026-12-01).
#   bash benchmarks/results/2026-12-03/gpt_oss_steps.sh $OUT   (carry .whl)
set -u
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || exit 1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 420 python3 benchmarks/bench_window.py --only steps --budget-s 400 --out "$OUT" 2>&1 | grep -v Warning \
  | tee "$OUT/gpt_oss_steps.log" | tail -14
