#!/usr/bin/env bash
# Fourth device call on a two-GPU machine, 2026-11-30 (issues 12, 14, 15): the main job as restructured, on NCCL.
#   1. the embedded tiny default on 2 GPUs (sp 2) from another folder: start-up block, step lines, clean exit
#      (no TCPStore "Failed to recv" warnings), twice (a new run folder each time);
#   2. the same on a local jsonl of prompt/completion rows with --packing (per-document attention on CUDA).
# Usage: bash benchmarks/results/2026-11-30/checks4_2026-11-30.sh OUT_DIR
#   from any folder: it runs from the checkout's root
set -u
out=$(realpath -m "${1:?output dir}")
cd "$(dirname "$0")/../../.."   # the checkout root: the paths below are relative to it
mkdir -p "$out" /tmp/c4
repo=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
python3 - <<'PY'
import json
from ulysses_lc.tiny import tiny_text
with open("/tmp/c4/pc.jsonl", "w") as f:
    for i in range(200):
        f.write(json.dumps({"prompt": f"Question {i}: " + tiny_text(150, seed=i),
                            "completion": tiny_text(300 + 97 * (i % 7), seed=1000 + i)}) + "\n")
PY
cd /tmp/c4
for run in 1 2; do
  torchrun --nproc_per_node 2 -m ulysses_lc.train --model tiny --steps 3 > "$out/tiny_nccl_$run.txt" 2>&1; echo "exit $?" >> "$out/tiny_nccl_$run.txt"
done
torchrun --nproc_per_node 2 -m ulysses_lc.train --model tiny --data /tmp/c4/pc.jsonl --packing --seq-len 4096 --steps 3 \
  > "$out/packed_nccl.txt" 2>&1; echo "exit $?" >> "$out/packed_nccl.txt"
cd "$repo"
for f in "$out"/*.txt; do echo "== $f"; grep -cE "Failed to recv|TCPStore" "$f"; grep -E "^step|exit|writing to|Error" "$f" | tail -5; done
