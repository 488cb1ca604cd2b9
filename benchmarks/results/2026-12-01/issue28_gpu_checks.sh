#!/usr/bin/env bash
# Issue 28 on one H200: the CUDA kernel tests (window, sinks, documents, kept outputs, the loss without syncs), then
# the memory model's held-out points (a window, sinks with MoE, a fine-grained MoE) through the memory ladder.
#   bash benchmarks/results/2026-12-01/issue28_gpu_checks.sh $OUT
set -uo pipefail
out=${1:?usage: issue28_gpu_checks.sh OUT_DIR}
mkdir -p "$out"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a "$out/gpu.txt"
python3 -m pytest tests/test_window_cuda.py tests/test_packing.py tests/test_kept_attention.py tests/test_chunked_loss.py \
    tests/test_fallbacks.py -q -rs -p no:cacheprovider 2>&1 | tee "$out/cuda_tests.log" | tail -25
python3 benchmarks/bench_memory_ladder.py --only mistral-7b-4L@128k gpt-oss-20b-2L@64k qwen3-30b-a3b-2L@64k \
    --budget-s 330 --out "$out/ladder" 2>&1 | tail -12
