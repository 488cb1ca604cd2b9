#!/usr/bin/env bash
# One device call on a two-GPU machine, 2026-11-30 (issues 11 and 12), the two GPUs used side by side:
#   GPU 0: bench_step --suite refactor (the 128k plan after the restructuring), then --suite packing (256k as one
#          sequence, as 8k and as 4k documents, each with the memory plan);
#   GPU 1: bench_packing.py (the per-document kernel at 256k), then the main job at 128k (dryrun_train_1m.sh).
# Usage: bash benchmarks/results/2026-11-30/checks_2026-11-30.sh OUT_DIR
#   from any folder: it runs from the checkout's root
set -u
out=$(realpath -m "${1:?output dir}")
cd "$(dirname "$0")/../../.."   # the checkout root: the paths below are relative to it
mkdir -p "$out/a" "$out/b"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
(
  export CUDA_VISIBLE_DEVICES=0
  python3 benchmarks/bench_step.py --suite refactor --budget-s 150 --out "$out/a"
  python3 benchmarks/bench_step.py --suite packing --budget-s 330 --out "$out/a"
) > "$out/a/log.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1 MASTER_PORT=29631
  python3 benchmarks/bench_packing.py --out "$out/b"
  bash benchmarks/dryrun_train_1m.sh /tmp/dryrun 131072
  cp /tmp/dryrun/run/metrics.jsonl "$out/b/dryrun_128k_metrics.jsonl"
) > "$out/b/log.txt" 2>&1 &
wait
rm -f "$out"/a/.*.json  # per-variant copies of what results_<suite>.json holds
tail -n 30 "$out/a/log.txt" "$out/b/log.txt"
