#!/usr/bin/env bash
# One plan, and the node's host memory against its prediction (issue 31): the dry run and the job on one GPU, the
# Qwen3-8B shape with LoRA r 16 at 262,144 tokens and --host-memory-gb 128, random weights in a local folder (the
# GPU machine has no network). Prints both plan lines, the job's predicted host memory on the node and the node's
# peak used memory (sampled every 0.5 s over the whole job), and whether they agree.
# Usage: bash benchmarks/plan_check_8b_lora.sh OUT_DIR [STEPS] [RUN_DIR]   (RUN_DIR: the run's folder, default
# OUT_DIR/run; its checkpoint holds the adapters and their optimizer state, ~0.7 GB)
set -euo pipefail
out=${1:?output dir}
steps=${2:-1}
run_dir=${3:-$out/run}
model=/tmp/qwen3-8b-shape
mkdir -p "$out"
python3 - "$model" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, Qwen3Config
from ulysses_lc.tiny import tiny_tokenizer
cfg = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1e6, tie_word_embeddings=False)
torch.manual_seed(0)
with torch.device("cuda"):  # random init on the GPU: seconds, where the CPU takes minutes for 8B
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(sys.argv[1])
tiny_tokenizer().save_pretrained(sys.argv[1])  # byte-level ids are valid ids of the 151,936-entry vocab
PY
export HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
flags=(--model "$model" --data tiny --seq-len 262144 --lora-r 16 --host-memory-gb 128 --lr 1e-5 --steps "$steps"
       --no-export --output-dir "$run_dir" --cache-dir "$run_dir.cache")
python3 -m ulysses_lc.train --dry-run "${flags[@]}" 2>&1 | tee "$out/dry_run.log"
# The node's used memory as the step line's "node" figure reads it (psutil), its peak over the job.
python3 -c "
import psutil, sys, time
peak = 0
while True:
    peak = max(peak, psutil.virtual_memory().used)
    open(sys.argv[1], 'w').write(str(peak))
    time.sleep(0.5)
" "$out/node_peak_bytes" &
sampler=$!
torchrun --nproc_per_node 1 -m ulysses_lc.train "${flags[@]}" 2>&1 | tee "$out/run.log" || true
kill "$sampler"
python3 - "$out" <<'PY'
import re, sys
from pathlib import Path
out = Path(sys.argv[1])
dry, run = (out / "dry_run.log").read_text(), (out / "run.log").read_text()
plan = lambda text: [l.strip() for l in text.splitlines() if l.strip().startswith("plan ")]
print("dry run:", plan(dry))
print("job:    ", plan(run))
print("plan lines equal:", plan(dry) == plan(run))
node = re.search(r"node +([\d.]+) GB host predicted on this node", run)
peak = float((out / "node_peak_bytes").read_text()) / 1e9
steps = re.findall(r"^step .*", run, re.M)
print("\n".join(steps))
if node:
    predicted = float(node.group(1))
    print(f"node host: predicted {predicted:.1f} GB, peak used {peak:.1f} GB (sampled), ratio {predicted / peak:.3f}")
PY
