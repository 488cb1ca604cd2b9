"""A normal TRL DPOTrainer script, trained with ulysses_lc: the trainer class is swapped, nothing else.

    python examples/trl_dpo.py                                      # one CPU process, tiny Qwen3, generated pairs
    torchrun --nproc_per_node 2 examples/trl_dpo.py                 # SP=2 on CPU (gloo) or 2 GPUs
    deepspeed --num_gpus 8 examples/trl_dpo.py --model Qwen/Qwen3-8B --dataset trl-lib/ultrafeedback_binarized \\
        --max-length 65536 --lora 16

--model a hub name or folder, default the embedded tiny Qwen3 with random weights; --dataset a hub name, a folder
or data files (.json/.jsonl/.csv/.parquet) with TRL's preference rows ("prompt" / "chosen" / "rejected", chat or
plain), default generated pairs (the chosen completion continues the prompt's story, the rejected one is another
story's). The reference is a frozen copy of the model, or with --lora the model with its adapters off. Each pair
trains as one sequence [prompt + chosen | prompt + rejected] of up to 2 x --max-length tokens.
"""

import argparse
import os
import random

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer

from ulysses_lc import (
    apply_yarn,
    destroy_distributed,
    init_distributed,
    load_deepspeed_config,
    load_model_for_length,
    lora_config,
    ulysses_trainer,
)
from ulysses_lc.tiny import tiny_model_config, tiny_text, tiny_tokenizer
from ulysses_lc.train.console import quiet_warnings

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=None, help="hub name or local folder (default: the tiny Qwen3)")
parser.add_argument("--tokenizer", default=None, help="default: the model's, or the tiny byte tokenizer")
parser.add_argument("--dataset", default=None, help="hub name, folder or data files (default: generated pairs)")
parser.add_argument("--split", default="train")
parser.add_argument("--max-length", type=int, default=512, help="longest prompt + completion in tokens")
parser.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning against a frozen copy)")
parser.add_argument("--beta", type=float, default=0.1)
parser.add_argument("--loss-type", default="sigmoid", choices=["sigmoid", "ipo"])
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--sp-size", type=int, default=None, help="default: every rank shares one sequence")
parser.add_argument("--ds-config", default="zero3", help="a config of ds_configs/ by name (zero3, ...) or a JSON path")
parser.add_argument("--output-dir", default="runs/trl_dpo")
parser.add_argument("--lr", type=float, default=1e-3)
args = parser.parse_args()

DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def generated_pairs(n: int, max_length: int, seed: int = 0) -> list[dict]:
    """n plain-text pairs from tiny_text's prose, each prompt + completion within max_length bytes (tokens)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        text = tiny_text(max_length - 8, seed=seed + i)
        other = tiny_text(max_length - 8, seed=seed + n + i)
        cut = rng.randint(len(text) // 3, len(text) // 2)
        length = rng.randint(len(text) // 8, len(text) // 3)
        rows.append({"prompt": text[:cut], "chosen": text[cut:cut + length], "rejected": other[:length]})
    return rows


def load_rows(name: str | None) -> datasets.Dataset:
    if name is None:
        return datasets.Dataset.from_list(generated_pairs(2 * (args.steps + 1), args.max_length))
    file_type = DATA_FILE_TYPES.get(os.path.splitext(name)[1])
    if file_type is not None:
        return datasets.load_dataset(file_type, data_files=name, split=args.split)
    return datasets.load_dataset(name, split=args.split)


def load_model(dtype):
    if args.model:
        return load_model_for_length(args.model, args.max_length, dtype=dtype)
    torch.manual_seed(0)  # the reference copy draws the same random weights
    return AutoModelForCausalLM.from_config(apply_yarn(tiny_model_config(), args.max_length), dtype=dtype)


quiet_warnings()  # each warning once (rank 0's), as the main job prints them
init_distributed()  # deepspeed, torchrun, accelerate launch or plain python
gpu = torch.cuda.is_available()
dtype = torch.bfloat16 if gpu else torch.float32
ds_config = load_deepspeed_config(args.ds_config)  # shipped names are found from any directory
ds_config.update(train_micro_batch_size_per_gpu="auto", train_batch_size="auto", gradient_accumulation_steps="auto")
train = load_rows(args.dataset)
dpo_args = DPOConfig(
    output_dir=args.output_dir, deepspeed=ds_config, per_device_train_batch_size=1, per_device_eval_batch_size=1,
    max_steps=args.steps, learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to=[], bf16=gpu,
    use_cpu=not gpu, lr_scheduler_type="constant", disable_tqdm=True, max_length=args.max_length,
    activation_checkpointing=False,  # ulysses_lc checkpoints and offloads layers itself (its memory plan)
    beta=args.beta, loss_type=[args.loss_type],
)

model = load_model(dtype)  # after the DPOConfig: ZeRO-3 then loads each rank's partition only
ref_model = None if args.lora else load_model(dtype)
if args.model:
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
else:
    tokenizer = tiny_tokenizer() if args.tokenizer is None else AutoTokenizer.from_pretrained(args.tokenizer)
if len(tokenizer) > model.config.vocab_size:
    raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the model {model.config.vocab_size}; "
                     "pass a matching --tokenizer.")

trainer = ulysses_trainer(DPOTrainer)(
    model=model, ref_model=ref_model, args=dpo_args, train_dataset=train, eval_dataset=train.select([0]),
    processing_class=tokenizer, peft_config=lora_config(args.lora) if args.lora else None, sp_size=args.sp_size)
trainer.train()
metrics = trainer.evaluate()
if trainer.is_world_process_zero():
    margins = [h["rewards/margins"] for h in trainer.state.log_history if "rewards/margins" in h]
    print("reward margins:", " ".join(f"{m:.4f}" for m in margins))
    print("eval loss:", metrics["eval_loss"])
destroy_distributed()
