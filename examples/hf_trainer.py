"""A normal Hugging Face Trainer script, trained with ulysses_lc: the Trainer class is swapped, nothing else.

    python examples/hf_trainer.py                                   # one CPU process, the embedded tiny Qwen3
    torchrun --nproc_per_node 2 examples/hf_trainer.py              # SP=2 on CPU (gloo) or 2 GPUs
    accelerate launch --num_processes 2 --config_file examples/accelerate_zero3.yaml examples/hf_trainer.py  # no --cpu
    deepspeed --num_gpus 1 examples/hf_trainer.py --model-config qwen3-0.6b.json --seq-len 131072 --steps 3

--model a hub name or folder (weights, YaRN for --seq-len); --model-config a config JSON (or "tiny") for random
weights, no network; --data any ulysses_lc.data source (tiny, a folder, a dataset).
Without a GPU the script sets use_cpu=True itself; `accelerate launch --cpu` is refused (accelerate's CPU path
turns DeepSpeed off and starts one process without MPI).
"""

import argparse
import json
import time

import datasets
import torch
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback, TrainingArguments

from ulysses_lc import (
    UlyssesTrainer,
    apply_yarn,
    build_token_stream,
    destroy_distributed,
    init_distributed,
    load_deepspeed_config,
    load_model_for_length,
)
from ulysses_lc.tiny import tiny_model_config, tiny_tokenizer
from ulysses_lc.train.console import quiet_warnings

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--model", default=None, help="hub name or local folder (default: --model-config)")
parser.add_argument("--model-config", default="tiny", help="config JSON for random weights, or 'tiny'")
parser.add_argument("--tokenizer", default=None, help="tokenizer name (default: the model's, or the tiny one)")
parser.add_argument("--data", default="tiny")
parser.add_argument("--seq-len", type=int, default=2048)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--sp-size", type=int, default=None, help="default: every rank shares one sequence")
parser.add_argument("--ds-config", default="zero3", help="a config of ds_configs/ by name (zero3, ...) or a JSON path")
parser.add_argument("--output-dir", default="runs/hf_trainer")
parser.add_argument("--lr", type=float, default=3e-3)
args = parser.parse_args()

quiet_warnings()  # each warning once (rank 0's), as the main job prints them
init_distributed()  # deepspeed, torchrun, accelerate launch or plain python
gpu = torch.cuda.is_available()
dtype = torch.bfloat16 if gpu else torch.float32
ds_config = load_deepspeed_config(args.ds_config)  # shipped names are found from any directory
ds_config.update(train_micro_batch_size_per_gpu="auto", train_batch_size="auto", gradient_accumulation_steps="auto")
training_args = TrainingArguments(
    output_dir=args.output_dir, deepspeed=ds_config, per_device_train_batch_size=1, per_device_eval_batch_size=1,
    max_steps=args.steps, learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to=[], bf16=gpu,
    use_cpu=not gpu, lr_scheduler_type="constant", disable_tqdm=True,
)

if args.model:  # after TrainingArguments: ZeRO-3 then loads each rank's partition only
    tokenizer_name = args.tokenizer or args.model
    model = load_model_for_length(args.model, args.seq_len, dtype=dtype)
else:
    config = tiny_model_config() if args.model_config == "tiny" else AutoConfig.for_model(**json.load(open(args.model_config)))
    tokenizer_name = args.tokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(apply_yarn(config, args.seq_len), dtype=dtype)
tokenizer = tiny_tokenizer() if tokenizer_name is None else __import__("transformers").AutoTokenizer.from_pretrained(tokenizer_name)

stream = build_token_stream(args.data, tokenizer, args.seq_len, num_steps=args.steps + 1)
if max(stream.sequence(i).max() for i in range(args.steps + 1)) >= model.config.vocab_size:
    raise ValueError("the tokenizer's ids exceed the model's vocab_size; pass a matching --tokenizer.")
train = datasets.Dataset.from_dict({"input_ids": [stream.sequence(i).tolist() for i in range(args.steps + 1)]})

class StepTimes(TrainerCallback):
    """Seconds per optimizer step (device synced), for comparing this path with examples/train_1m.py."""

    def on_step_begin(self, args, state, control, **kwargs):
        torch.cuda.synchronize() if gpu else None
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize() if gpu else None
        if state.is_world_process_zero:
            print(f"step {state.global_step}: {time.perf_counter() - self.t0:.2f} s", flush=True)


trainer = UlyssesTrainer(model=model, args=training_args, train_dataset=train, eval_dataset=train.select([0]),
                         processing_class=tokenizer, sp_size=args.sp_size, seq_len=args.seq_len, callbacks=[StepTimes()])
trainer.train()
metrics = trainer.evaluate()  # every rank evaluates (a collective); rank 0 prints
if trainer.is_world_process_zero():
    print("memory plan:", trainer.model.plan)
    print(metrics)
destroy_distributed()
