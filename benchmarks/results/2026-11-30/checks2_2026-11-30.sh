#!/usr/bin/env bash
# Second device call on a two-GPU machine, 2026-11-30 (issues 12 and 15):
#   the CUDA packing tests (per-document loop and varlen against per-document SDPA), the per-document kernel's
#   rate at 256k (bench_packing.py: loop and varlen, equal and mixed lengths), then the Qwen3-8B shape at 131k on
#   both GPUs at sp 2 (bench_sp.py, ours only).
# Usage: bash benchmarks/results/2026-11-30/checks2_2026-11-30.sh OUT_DIR
#   from any folder: it runs from the checkout's root
set -u
out=$(realpath -m "${1:?output dir}")
cd "$(dirname "$0")/../../.."   # the checkout root: the paths below are relative to it
mkdir -p "$out" /tmp/c2/k /tmp/c2/sp
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests/test_packing.py -k cuda -q -rA > "$out/packing_cuda_test.txt" 2>&1
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_packing.py --out /tmp/c2/k > "$out/packing_kernel.txt" 2>&1
cp /tmp/c2/k/packing_kernel.json "$out/"
python3 benchmarks/bench_sp.py --suite sp2 --only ours-sp2-8B@128k --budget-s 330 --out /tmp/c2/sp > "$out/sp8b_log.txt" 2>&1
cp /tmp/c2/sp/results_sp2.json "$out/sp8b_results.json"; cp /tmp/c2/sp/table_sp2.txt "$out/sp8b_table.txt"
tail -n 5 "$out/packing_cuda_test.txt"; cat "$out/packing_kernel.txt" "$out/sp8b_table.txt"
