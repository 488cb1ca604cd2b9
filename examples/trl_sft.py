"""A normal TRL SFTTrainer script, trained with ulysses_lc: the trainer class is swapped, nothing else.

    python examples/trl_sft.py                                      # one CPU process, tiny Qwen3, generated chats
    torchrun --nproc_per_node 2 examples/trl_sft.py                 # SP=2 on CPU (gloo) or 2 GPUs
    accelerate launch --num_processes 2 --config_file examples/accelerate_zero3.yaml examples/trl_sft.py
    deepspeed --num_gpus 8 examples/trl_sft.py --model Qwen/Qwen3-8B --dataset HuggingFaceH4/ultrachat_200k \\
        --split train_sft --max-length 131072

--model a hub name or folder (YaRN for --max-length), default the embedded tiny Qwen3 with random weights;
--dataset a hub name, a folder or data files (.json/.jsonl/.csv/.parquet) with "messages" or "prompt"/"completion"
rows (TRL's formats), default generated chats. TRL builds the labels: the loss is on the assistant's turns
(assistant_only_loss, for messages) or the completion (prompt/completion rows).
"""

import argparse
import os
import random

import datasets
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig

from ulysses_lc import (
    UlyssesSFTTrainer,
    apply_yarn,
    destroy_distributed,
    init_distributed,
    load_deepspeed_config,
    load_model_for_length,
)
from ulysses_lc.tiny import tiny_model_config, tiny_text, tiny_tokenizer
from ulysses_lc.train.console import quiet_warnings

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=None, help="hub name or local folder (default: the tiny Qwen3)")
parser.add_argument("--tokenizer", default=None, help="default: the model's, or the tiny byte tokenizer")
parser.add_argument("--dataset", default=None, help="hub name, folder or data files (default: generated chats)")
parser.add_argument("--dataset-config", default=None, help="the dataset's configuration name, if it has several")
parser.add_argument("--split", default="train")
parser.add_argument("--max-length", type=int, default=2048, help="longest sequence in tokens (longer rows are cut)")
parser.add_argument("--packing", action="store_true", help="TRL's bfd packing (documents train apart)")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--sp-size", type=int, default=None, help="default: every rank shares one sequence")
parser.add_argument("--ds-config", default="zero3", help="a config of ds_configs/ by name (zero3, ...) or a JSON path")
parser.add_argument("--output-dir", default="runs/trl_sft")
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()

DATA_FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


def generated_chats(n: int, max_length: int, seed: int = 0) -> list[dict]:
    """n conversations from tiny_text's prose: a user line, then an assistant reply that continues it.

    At most max_length // 2 bytes (tokens of the tiny tokenizer), so no reply is cut away: TRL drops a row whose
    every label is masked."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        text = tiny_text(rng.randint(max_length // 4, max_length // 2), seed=seed + i)
        cut = rng.randint(len(text) // 4, len(text) // 2)
        rows.append({"messages": [{"role": "user", "content": f"Continue the story: {text[:cut]}"},
                                  {"role": "assistant", "content": text[cut:]}]})
    return rows


def load_rows(name: str | None) -> datasets.Dataset:
    if name is None:
        return datasets.Dataset.from_list(generated_chats(4 * (args.steps + 1), args.max_length))
    file_type = DATA_FILE_TYPES.get(os.path.splitext(name)[1])
    if file_type is not None:
        return datasets.load_dataset(file_type, data_files=name, split=args.split)
    return datasets.load_dataset(name, args.dataset_config, split=args.split)


quiet_warnings()  # each warning once (rank 0's), as the main job prints them
init_distributed()  # deepspeed, torchrun, accelerate launch or plain python
gpu = torch.cuda.is_available()
dtype = torch.bfloat16 if gpu else torch.float32
ds_config = load_deepspeed_config(args.ds_config)  # shipped names are found from any directory
ds_config.update(train_micro_batch_size_per_gpu="auto", train_batch_size="auto", gradient_accumulation_steps="auto")
train = load_rows(args.dataset)
sft_args = SFTConfig(
    output_dir=args.output_dir, deepspeed=ds_config, per_device_train_batch_size=1, per_device_eval_batch_size=1,
    max_steps=args.steps, learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to=[], bf16=gpu,
    use_cpu=not gpu, lr_scheduler_type="constant", disable_tqdm=True, max_length=args.max_length,
    activation_checkpointing=False,  # ulysses_lc checkpoints and offloads layers itself (its memory plan)
    assistant_only_loss="messages" in train.column_names, packing=args.packing,
)

if args.model:  # after the SFTConfig: ZeRO-3 then loads each rank's partition only
    model = load_model_for_length(args.model, args.max_length, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
else:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(apply_yarn(tiny_model_config(), args.max_length), dtype=dtype)
    tokenizer = tiny_tokenizer() if args.tokenizer is None else AutoTokenizer.from_pretrained(args.tokenizer)
if len(tokenizer) > model.config.vocab_size:
    raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the model {model.config.vocab_size}; "
                     "pass a matching --tokenizer.")

trainer = UlyssesSFTTrainer(model=model, args=sft_args, train_dataset=train, eval_dataset=train.select([0]),
                            processing_class=tokenizer, sp_size=args.sp_size, seq_len=args.max_length)
trainer.train()
metrics = trainer.evaluate()
if trainer.is_world_process_zero():
    print("memory plan:", trainer.model.plan)
    print("eval loss:", metrics["eval_loss"])
destroy_distributed()
