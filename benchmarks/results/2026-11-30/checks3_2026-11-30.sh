#!/usr/bin/env bash
# Third device call on a two-GPU machine, 2026-11-30 (issues 12 and 13), the GPUs side by side:
#   GPU 0: the CUDA packing tests (per-document loop and varlen against per-document SDPA);
#   GPU 1: the Trainer path (examples/hf_trainer.py) at 131,072 tokens on the Qwen3-0.6B shape, random weights,
#          to compare with the main job's step time and plan at the same length (checks_2026-11-30.sh, beside this one).
# Usage: bash benchmarks/results/2026-11-30/checks3_2026-11-30.sh OUT_DIR
#   from any folder: it runs from the checkout's root
set -u
out=$(realpath -m "${1:?output dir}")
cd "$(dirname "$0")/../../.."   # the checkout root: the paths below are relative to it
mkdir -p "$out"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 HF_HUB_OFFLINE=1
CUDA_VISIBLE_DEVICES=0 python3 -m pytest tests/test_packing.py -k cuda -q -rA > "$out/packing_cuda_test.txt" 2>&1 &
python3 - <<'PY'
from transformers import Qwen3Config
Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6,
            tie_word_embeddings=True).to_json_file("/tmp/qwen3-0.6b-shape.json")
PY
CUDA_VISIBLE_DEVICES=1 torchrun --nproc_per_node 1 --master_port 29641 examples/hf_trainer.py \
  --model-config /tmp/qwen3-0.6b-shape.json --seq-len 131072 --steps 4 --output-dir /tmp/hft > "$out/trainer_128k.txt" 2>&1
wait
tail -n 4 "$out/packing_cuda_test.txt"; grep -E "^step|memory plan|train_runtime|eval_loss|Error" "$out/trainer_128k.txt"
