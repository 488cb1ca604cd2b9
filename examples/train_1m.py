"""Fine-tune a causal LM on one ~1M-token sequence per step: Ulysses SP + ZeRO-3 + all memory levers.

    deepspeed --num_gpus 8 examples/train_1m.py                       # Qwen3-8B on PG-19, 1,048,576 tokens
    deepspeed --num_gpus 2 examples/train_1m.py                       # no GPU: the embedded tiny default
    deepspeed --num_gpus 8 examples/train_1m.py --model ./my-model --data ./books/ --seq-len 524288

Without GPUs (or with --model tiny) the defaults switch to the embedded tiny Qwen3, generated text and a
short sequence, so the whole pipeline runs on a laptop in minutes and prints steps in the same format.
"""

import argparse
import logging

import torch

from ulysses_lc.training import TINY, TrainConfig, train

TINY_DEFAULTS = dict(model=TINY, data=TINY, seq_len=4096, steps=8, lr=3e-3, output_dir="runs/tiny")


def _head_groups(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give 'auto' or a whole number of groups") from None


def parse_args(argv=None) -> TrainConfig:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help=f"hub name or local folder, or 'tiny' (default {d.model}; tiny without GPUs)")
    p.add_argument("--seq-len", type=int, help=f"tokens per sequence, one sequence per step (default {d.seq_len:,})")
    p.add_argument("--sp-size", type=int, help="ranks sharing one sequence (default: all ranks; DP over the rest)")
    p.add_argument("--data", help="'pg19', a .txt file, a folder of .txt, a .npy/.bin of token ids, or 'tiny'")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default=d.lr_schedule,
                   help="decay after warmup, down to --min-lr-ratio x lr")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup steps")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr as a fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--ds-config", default=d.ds_config,
                   help="DeepSpeed JSON: ds_configs/zero3.json, zero3_offload_optimizer.json or zero3_offload_all.json")
    p.add_argument("--output-dir", help=f"checkpoints, metrics.jsonl and the HF export (default {d.output_dir})")
    p.add_argument("--resume", action="store_true", help="continue the run whose checkpoint is in --output-dir")
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (0: at the end)")
    p.add_argument("--yarn-factor", type=float, help="YaRN factor (default: seq-len / the model's trained length)")
    p.add_argument("--kernel", default=d.kernel, choices=["auto", "sdpa", "cudnn", "flash_attention_2", "flash_attention_3"],
                   help="attention kernel (auto: cuDNN SDPA on Hopper)")
    p.add_argument("--keep-on-gpu", type=int, help="checkpointed layers whose input stays on the GPU (default: as many as fit)")
    p.add_argument("--recompute-layers", type=int,
                   help="layers checkpointed and recomputed in backward (default: only as many as memory requires)")
    p.add_argument("--cache-attention-layers", type=int,
                   help="checkpointed layers that keep their attention output so the recompute skips the kernel "
                        "(default: as many as device and host memory allow)")
    p.add_argument("--attention-head-groups", type=_head_groups, default=d.attention_head_groups,
                   help="run the attention kernel over this many groups of kv heads, one after another, so its "
                        "backward's working block exists one group at a time (default auto: under 1 GiB)")
    p.add_argument("--cache-dir", help="token cache folder (default ~/.cache/ulysses_lc/tokens)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--tensorboard", action="store_true", help="also log to TensorBoard in --output-dir")
    p.add_argument("--no-export", dest="export", action="store_false", help="skip the final HF export")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    args = vars(p.parse_args(argv))
    args.pop("local_rank")
    tiny = args["model"] == TINY or (args["model"] is None and not torch.cuda.is_available())
    defaults = TINY_DEFAULTS if tiny else {}
    values = {k: (v if v is not None else defaults.get(k, getattr(d, k))) for k, v in args.items()}
    return TrainConfig(**values)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    train(parse_args())
