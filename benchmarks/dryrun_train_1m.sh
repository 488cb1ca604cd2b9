#!/usr/bin/env bash
# Dry run of the main job on one GPU: examples/train_1m.py end to end (ZeRO-3, NCCL, bf16, cuDNN, offload,
# checkpoint, resume) on the Qwen3-0.6B shape with random weights saved to a local folder, since the GPU
# machine has no network. Usage: bash benchmarks/dryrun_train_1m.sh OUT_DIR [SEQ_LEN]
set -euo pipefail
out=${1:?output dir}
seq=${2:-131072}
model=/tmp/qwen3-0.6b-shape
python3 - "$model" <<'PY'
import sys, torch
from transformers import AutoModelForCausalLM, Qwen3Config
from ulysses_lc.tiny import tiny_tokenizer
cfg = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                  rope_theta=1e6, tie_word_embeddings=True)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(sys.argv[1])
tiny_tokenizer().save_pretrained(sys.argv[1])  # byte-level ids are valid ids of the 151,936-entry vocab
PY
export HF_HUB_OFFLINE=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
run() { torchrun --nproc_per_node 1 examples/train_1m.py --model "$model" --data tiny --seq-len "$seq" \
          --output-dir "$out/run" --cache-dir "$out/cache" --lr 1e-5 "$@"; }
run --steps 3 --save-every 2 --no-export
run --steps 4 --resume --export   # step 4 from the step-3 (final) checkpoint, then the HF export (the saved run said --no-export)
ls "$out/run/hf_export"
