"""What one run trains: `TrainConfig`, its checks, and the command line that fills it.

The command line lives here, not in examples/, so that every script (examples/train_1m.py, a user's
own) gets the same flags, defaults and help. Without GPUs, or with --model tiny, the defaults switch to
the embedded tiny Qwen3 on generated text and a short sequence (`TINY_DEFAULTS`); a --model given on a machine
without GPUs keeps the generated text and short sequence (`CPU_DEFAULTS`), except in a dry run, which sizes the GPU
run.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import shlex
from dataclasses import dataclass, fields

from ..mixers.kernels import KERNELS
from ..parallel.layout import PLACEMENTS
from ..tiny import TINY_MODELS
from .config_checks import TINY_LR, check_config, flag_of  # noqa: F401  (flag_of: resume.py reads it here)
from .evaluation import EVAL_PASSKEY_DEPTHS
from .launcher import LAUNCH_FIELDS, add_launch_flags
from .schedule import SCHEDULES

TINY = "tiny"


class CheckFailed(ValueError):
    """A user mistake found before any collective; the message names the fix.

    origin: where it was found ("rank 2 on node 1, host h"), when not every rank found it (job_watch.start).
    """

    def __init__(self, message: str, origin: str | None = None):
        super().__init__(message)
        self.origin = origin


@contextlib.contextmanager
def as_check_failed():
    """A ValueError raised inside becomes a CheckFailed: a user mistake, agreed across ranks (job_watch.start)."""
    try:
        yield
    except CheckFailed:
        raise
    except ValueError as e:
        raise CheckFailed(str(e)) from e


@dataclass
class TrainConfig:
    """What one run trains. Field names match the command-line flags (`parse_args`)."""

    model: str = "Qwen/Qwen3-8B"
    seq_len: int = 1_048_576
    sp_size: int | None = None  # None: every rank in one SP group
    sp_placement: str = "node"  # node: SP groups inside a node, DP across nodes; across: the reverse (layout.py)
    data: str = "pg19"
    text_column: str | None = None  # None: messages, then prompt + completion, then text (data/samples.py)
    data_config: str | None = None  # a hub dataset's config name
    loss_on: str | None = None  # completion | all; None: completion for chat and prompt/completion data
    packing: bool = False  # whole samples per window, each attending only to itself
    long_samples: str = "split"  # with packing: split | refuse a sample longer than seq_len
    steps: int = 12
    global_batch: int | None = None  # sequences per optimizer step; None: dp_size (on --resume: the saved run's)
    lr: float = 1e-5
    lr_schedule: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 1
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    # Stop before saving a step that grew the trained weights' norm past (1 + this) x its norm before (divergence.py);
    # 0: off.
    max_weight_growth: float = 1.0
    ds_config: str = "zero3"  # a shipped config by name (ds_config.CONFIG_NAMES) or a JSON path
    output_dir: str | None = None  # None: a new runs/<model>-<time> per run (the latest one on --resume)
    resume: bool = False
    save_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2  # 0: keep every checkpoint
    seed: int = 0
    yarn_factor: float | None = None
    rope_scaling: str = "pretrained"  # yarn.ROPE_SCALING_CHOICES: keep the model's own scaling, or replace it
    kernel: str = "auto"
    keep_on_gpu: int | None = None  # None: from the memory plan (SequenceParallelCausalLM.plan_step)
    recompute_layers: int | None = None  # None: from the memory plan
    cache_attention_layers: int | None = None  # None: from the memory plan
    attention_head_groups: int | str = "auto"  # the attention kernel over this many head groups
    cache_dir: str | None = None
    kernel_cache: str | None = None  # None: kernel_cache/ beside the run folder (kernel_cache.py)
    tensorboard: bool = False
    wandb_project: str | None = None  # also report to Weights & Biases, in this project
    export: bool = True
    lora_r: int = 0  # 0: full fine-tune; > 0: LoRA adapters of this rank, the base weights frozen
    lora_alpha: float | None = None  # None: 2 x lora_r
    lora_targets: str = "all"  # module names, comma-separated; all: every attention and MLP projection
    lora_dropout: float = 0.0
    export_merged: bool = False  # with LoRA: also write the adapters merged into the base weights
    dry_run: bool = False  # every check and the memory prediction; no weights, no GPU
    world_size: int | None = None  # --dry-run only: the world size to plan for (default: this launch)
    gpus_per_node: int | None = None  # --dry-run only: GPUs per node (default: this launch's, else up to 8)
    gpu_memory_gb: float | None = None  # device memory per GPU (default: this GPU's; a dry run elsewhere: an H200's)
    host_memory_gb: float | None = None  # host memory per rank (default: the node's share; a dry run elsewhere: 225)
    max_seq_len: bool = False  # --dry-run only: find the longest --seq-len that fits
    node_timeout_s: float = 60.0  # a node silent this long (no heartbeat, no report) ends the job (job_watch.py)
    stop_grace_s: float = 25.0  # SIGTERM/SIGINT: the step boundary and checkpoint must come within this (stop.py)
    # The fields set on the command line (parse_args); None: set in code, every field meant. On --resume the others
    # are the saved run's (resume.py).
    flags_given: tuple[str, ...] | None = None
    method: str = "sft"  # sft: next-token loss; dpo: preference pairs (train/preference_step.py)
    dpo_beta: float = 0.1
    dpo_loss: str = "sigmoid"  # sigmoid | ipo
    dpo_label_smoothing: float = 0.0  # sigmoid: cDPO's probability of a flipped preference
    dpo_reference: str = "auto"  # auto | copy | adapters | precomputed (train/preference_step.py)
    # The evaluation at --seq-len (train/evaluation.py), on when any of eval_data, eval_every, eval_at_start is set.
    eval_data: str | None = None  # None: the held-out windows right after those the run reads from --data
    eval_every: int = 0  # steps between evaluations; 0: at the end only
    eval_at_start: bool = False  # also before the first step
    eval_sequences: int | None = None  # windows of eval text; None: one per DP group
    eval_passkey_depths: str = EVAL_PASSKEY_DEPTHS  # comma-separated shares in [0, 1]; "none": no passkey

    @property
    def evaluates(self) -> bool:
        """Whether the run evaluates (every --eval-every steps, and always at the end)."""
        return self.eval_data is not None or self.eval_every > 0 or self.eval_at_start

    def check(self) -> None:
        """ValueError naming the flag and the fix for a setting no run can use (config_checks.py)."""
        check_config(self)


TINY_DEFAULTS = dict(model=TINY, data=TINY, seq_len=4096, steps=8, lr=TINY_LR)
# Without GPUs, for any --model: the laptop's run needs no network and ends in minutes. The tiny model's lr stays
# with it (3e-3 would throw a real model's weights off).
CPU_DEFAULTS = {k: v for k, v in TINY_DEFAULTS.items() if k not in ("model", "lr")}

DESCRIPTION = """\
Fine-tune a causal LM on one ~1M-token sequence per step: Ulysses SP + ZeRO-3 + all memory levers.

    deepspeed --num_gpus 8 examples/train_1m.py                       # Qwen3-8B on PG-19, 1,048,576 tokens
    deepspeed --num_gpus 2 examples/train_1m.py                       # no GPU: the embedded tiny default
    deepspeed --num_gpus 8 examples/train_1m.py --model ./my-model --data ./books/ --seq-len 524288

Without GPUs (or with --model tiny) the defaults switch to the embedded tiny Qwen3, generated text and a
short sequence, so the whole pipeline runs on a laptop in minutes and prints steps in the same format; a --model
given without GPUs (a local folder too) also trains on generated text unless --data says otherwise. A --dry-run
keeps the GPU defaults for a given --model: it sizes the GPU run.
"""


def _head_groups(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give 'auto' or a whole number of groups") from None


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose refusal is one line, from rank 0 only, naming the flag closest to a mistyped one: every
    rank parses the same command line, and each printed its own 36-line usage block, which buried the cause."""

    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) != 0:
            self.exit(2)
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        unknown = [w for w in message.partition("unrecognized arguments:")[2].split() if w.startswith("-")]
        hints = "".join(f"; did you mean {c[0]} (for {w})?" for w in unknown
                        if (c := difflib.get_close_matches(w.replace("_", "-"), flags, n=1)))
        self.exit(2, f"{self.prog}: error: {message}{hints} (--help lists every flag)\n")


def build_parser(description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The main job's flags; each defaults to None where `parse_args` fills it from the (tiny) defaults."""
    d = TrainConfig()
    p = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = TINY_DEFAULTS
    p.add_argument("--model", help=f"hub name or local folder, or an embedded model: {', '.join(TINY_MODELS)} (default "
                                   f"{d.model}; tiny without GPUs)")
    p.add_argument("--seq-len", type=int,
                   help=f"tokens per sequence, one sequence per step (default {d.seq_len:,}; tiny or without GPUs: "
                        f"{t['seq_len']:,})")
    p.add_argument("--sp-size", type=int, help="ranks sharing one sequence (default: all ranks; DP over the rest)")
    p.add_argument("--sp-placement", choices=list(PLACEMENTS), default=d.sp_placement,
                   help="node (default): each SP group inside one node, so the all-to-all stays on NVLink, DP across "
                        "nodes; SP groups span nodes only where --sp-size exceeds the GPUs per node. across: SP over "
                        "the nodes, DP inside each")
    p.add_argument("--data", help="(default pg19; without GPUs tiny) 'pg19', a hub dataset 'org/name[:split]', a .jsonl/.json/.parquet/.arrow/.csv file "
                                  "or a folder of them, a .txt file or folder of .txt, a .npy/.bin of token ids, or 'tiny'")
    p.add_argument("--text-column", help="column of plain text (default: messages, then prompt/completion, then text)")
    p.add_argument("--data-config", help="a hub dataset's config name")
    p.add_argument("--loss-on", choices=["completion", "all"],
                   help="train on completions / assistant turns only, or on every token (default: completion for "
                        "chat and prompt/completion data, all for plain text)")
    p.add_argument("--packing", action="store_true", default=None,
                   help="fill each sequence with whole samples, each attending only to itself (positions restart "
                        "per sample); default: samples joined into one causal stream")
    p.add_argument("--long-samples", choices=["split", "refuse"],
                   help="with --packing: cut a sample longer than --seq-len into pieces, or refuse it (default split)")
    p.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps}; tiny or without GPUs: {t['steps']})")
    p.add_argument("--global-batch", type=int,
                   help="sequences per optimizer step, a multiple of dp_size: each DP group accumulates gradients over "
                        "global-batch / dp_size sequences (default: dp_size; on --resume the saved run's, so a resume "
                        "on another dp_size follows the same trajectory)")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {d.lr}; tiny: {t['lr']})")
    p.add_argument("--lr-schedule", choices=list(SCHEDULES), default=d.lr_schedule,
                   help="decay after warmup, down to --min-lr-ratio x lr")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="linear warmup steps")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr as a fraction of --lr")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay")
    p.add_argument("--max-weight-growth", type=float, default=d.max_weight_growth,
                   help="stop the run, before saving it, at a step whose update grew the trained weights' norm by more "
                        f"than this fraction (default {d.max_weight_growth:g}: the norm doubled, where a fine-tune's "
                        "step grows it by ~1e-7 and the tiny model's by ~2e-3; 0: off)")
    p.add_argument("--ds-config", default=d.ds_config,
                   help="DeepSpeed config: a shipped one by name (zero3, zero3_offload_optimizer, zero3_offload_all; "
                        f"default {d.ds_config}) or a JSON file")
    p.add_argument("--output-dir", help="checkpoints, metrics.jsonl and the HF export (default: a new "
                                        "runs/<model>-<date>-<time> per run)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --output-dir (default: the latest runs/<model>-* with a checkpoint)")
    p.add_argument("--save-every", type=int, default=d.save_every, help="checkpoint every N steps (0: at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=d.keep_checkpoints,
                   help=f"keep the newest N checkpoints, delete older ones (default {d.keep_checkpoints}; 0 keeps all)")
    p.add_argument("--yarn-factor", type=float, help="YaRN factor (default: seq-len / the model's trained length)")
    p.add_argument("--rope-scaling", default=d.rope_scaling, choices=["pretrained", "yarn"],
                   help="pretrained (default): keep the model's own RoPE scaling (llama3, yarn, longrope, ...) where it "
                        "covers --seq-len, extend yarn / linear beyond it, add YaRN to an unscaled model; yarn: replace "
                        "any pretrained scaling with YaRN over its pre-scaling length (a RoPE it was not trained with)")
    p.add_argument("--kernel", default=d.kernel, choices=list(KERNELS), help="attention kernel (auto: cuDNN SDPA on Hopper)")
    p.add_argument("--keep-on-gpu", type=int, help="checkpointed layers whose input stays on the GPU (default: as many as fit)")
    p.add_argument("--recompute-layers", type=int,
                   help="layers checkpointed and recomputed in backward (default: only as many as memory requires)")
    p.add_argument("--cache-attention-layers", type=int,
                   help="checkpointed layers that keep their attention output so the recompute skips the kernel "
                        "(default: as many as device and host memory allow)")
    p.add_argument("--attention-head-groups", type=_head_groups, default=d.attention_head_groups,
                   help="run the attention kernel over this many head groups, one after another, so its backward's "
                        "working block exists one group at a time: a divisor of a rank's kv heads, or a multiple of "
                        "them dividing its query heads (default auto: under 1 GiB)")
    p.add_argument("--cache-dir", help="token cache folder (default ~/.cache/ulysses_lc/tokens)")
    p.add_argument("--kernel-cache", metavar="DIR",
                   help="keep fla's autotune results, torch.compile's and FlashAttention-4's kernels here "
                        "(TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, where not "
                        "set already), so later runs and resumes skip the first "
                        "step's minutes of tuning (default: kernel_cache/ beside the run folder, runs/kernel_cache)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=d.tensorboard,
                   help="also log to TensorBoard in --output-dir (--no-tensorboard: not, on a resume of a run that did)")
    p.add_argument("--wandb", dest="wandb_project", metavar="PROJECT",
                   help="also report each step to Weights & Biases in PROJECT (pip install 'ulysses_lc[wandb]')")
    p.add_argument("--export", action=argparse.BooleanOptionalAction, default=d.export,
                   help="write the Hugging Face export at the end (default); --no-export skips it. On --resume the "
                        "saved run's choice holds unless one of the two is given")
    p.add_argument("--lora-r", type=int, default=d.lora_r,
                   help="train LoRA adapters of this rank instead of every weight (needs ulysses_lc[peft]); the "
                        "export is then the adapter (default 0: full fine-tune)")
    p.add_argument("--lora-alpha", type=float, help="LoRA scale alpha (the update is alpha / r x BA; default 2 x r)")
    p.add_argument("--lora-targets", default=d.lora_targets,
                   help="modules that get adapters, comma-separated (default all: q,k,v,o,gate,up,down projections)")
    p.add_argument("--lora-dropout", type=float, default=d.lora_dropout, help="dropout on the adapters' input")
    p.add_argument("--export-merged", action=argparse.BooleanOptionalAction, default=d.export_merged,
                   help="with --lora-r: also export the adapters merged into the base weights (hf_export/merged)")
    p.add_argument("--dry-run", action="store_true",
                   help="run every check and print the memory plan and predicted GPU and host memory per rank; "
                        "loads no weights and touches no GPU")
    p.add_argument("--world-size", type=int, help="--dry-run: GPUs to plan for (default: this launch's)")
    p.add_argument("--gpus-per-node", type=int,
                   help="--dry-run: GPUs per node, for the SP groups' placement and the host memory each rank "
                        "shares (default: this launch's, else --world-size up to 8)")
    p.add_argument("--gpu-memory-gb", type=float,
                   help="memory per GPU the plan may use (default: this GPU's; a dry run without the node's GPUs: 149, "
                        "an H200). On a CPU the run then plans as for a GPU of that size")
    p.add_argument("--host-memory-gb", type=float,
                   help="host memory per rank the plan may use, offloaded state, activations and the launcher's share "
                        "included (default: 9/10 of this node's memory over its local ranks; a dry run without the "
                        "node's GPUs: 225, a 2 TB node's share over 8 GPUs, said in its limits line)")
    p.add_argument("--max-seq-len", action="store_true", default=None,
                   help="--dry-run: the longest --seq-len that fits --world-size, --sp-size, --gpu-memory-gb and "
                        "--host-memory-gb, with its plan and predicted step time")
    p.add_argument("--node-timeout-s", type=float, default=d.node_timeout_s,
                   help="end the job when a node sends no heartbeat for this long, with no rank left there to report "
                        f"why (default {d.node_timeout_s:g})")
    p.add_argument("--method", choices=["sft", "dpo"], default=d.method,
                   help="sft (default): the next-token loss; dpo: preference pairs from --data rows with prompt, "
                        "chosen and rejected (a .jsonl, chat or plain; tiny: generated), each pair one sequence of "
                        "two documents (with --packing: as many whole pairs as fit)")
    p.add_argument("--dpo-beta", type=float, default=d.dpo_beta, help="DPO's beta (IPO's tau)")
    p.add_argument("--dpo-loss", choices=["sigmoid", "ipo"], default=d.dpo_loss, help="the preference loss")
    p.add_argument("--dpo-label-smoothing", type=float, default=d.dpo_label_smoothing,
                   help="sigmoid: the probability of a flipped preference (cDPO), in [0, 0.5)")
    p.add_argument("--dpo-reference", choices=["auto", "copy", "adapters", "precomputed"], default=d.dpo_reference,
                   help="the reference model: a frozen copy, the model with its LoRA adapters off, or precomputed "
                        "(the model as loaded, run once over the data before training, kept in the token cache; no "
                        "second model, no reference forward per step). auto: adapters with --lora-r, else copy")
    p.add_argument("--stop-grace-s", type=float, default=d.stop_grace_s,
                   help="on SIGTERM or SIGINT (a preemption, a time limit, Ctrl-C) or the launcher's end, every rank "
                        "stops at the next step boundary and saves a checkpoint; past this many seconds it exits "
                        f"without one (default {d.stop_grace_s:g}: launchers SIGKILL their ranks 30 s after SIGTERM)")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help="evaluate every N steps at --seq-len, in the training engine (loss over the sequence and by "
                        "position bucket, passkey retrieval by depth), and always at the end (default 0: only at the "
                        "end, when --eval-data or --eval-at-start asks for an evaluation)")
    p.add_argument("--eval-data", help="the evaluation text, any source --data takes (default: the held-out windows "
                                       "right after those the run reads from --data, which training never reads)")
    p.add_argument("--eval-at-start", action="store_true", default=d.eval_at_start,
                   help="also evaluate before the first step: the model as loaded")
    p.add_argument("--eval-sequences", type=int,
                   help="windows of evaluation text (default one per DP group); each is one forward at --seq-len")
    p.add_argument("--eval-passkey-depths", default=d.eval_passkey_depths,
                   help="where the passkey is hidden, shares of the haystack in [0, 1], one forward each "
                        "(default %(default)s); 'none': no passkey")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    add_launch_flags(p)  # main() takes them before this parser (launcher.split); listed here for --help
    return p


def parse_args(argv=None) -> TrainConfig:
    """The TrainConfig for command-line `argv` (default sys.argv): flags over the (tiny) defaults."""
    import torch

    d = TrainConfig()
    args = vars(build_parser().parse_args(argv))
    args.pop("local_rank")
    if [f for f in LAUNCH_FIELDS if args.pop(f) is not None]:  # main() takes them first (launcher.split)
        raise ValueError("--nproc-per-node and its flags start the job's ranks: pass them to ulysses-lc-train.")
    no_gpu = not torch.cuda.is_available()
    tiny = args["model"] in TINY_MODELS or (args["model"] is None and no_gpu)
    defaults = TINY_DEFAULTS if tiny else CPU_DEFAULTS if no_gpu and not args["dry_run"] else {}
    values = {k: (v if v is not None else defaults.get(k, getattr(d, k))) for k, v in args.items()}
    return TrainConfig(**values, flags_given=_given(argv))


def as_flags(cfg: TrainConfig) -> str:
    """The flags that give `cfg` again: parse_args(shlex.split(as_flags(cfg))) trains what cfg does. From the command
    line, the flags it named (with their values in cfg); from code, every field off TrainConfig's defaults and the ones
    whose default the tiny model or a CPU changes."""
    default = TrainConfig()
    named = set(cfg.flags_given) if cfg.flags_given is not None else \
        {f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(default, f.name)} | set(TINY_DEFAULTS)
    words = []
    for action in build_parser()._actions:
        value = getattr(cfg, action.dest, None)
        if action.dest not in named or action.dest == "flags_given" or value is None or not action.option_strings:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(action.option_strings[0 if value else 1])
        elif action.nargs == 0:  # store_true
            words += [action.option_strings[0]] if value else []
        else:
            words += [action.option_strings[0], str(value)]
    return shlex.join(words)


def _given(argv) -> tuple[str, ...]:
    """The fields named on the command line: the parser again, with no defaults, keeps only those."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given = vars(parser.parse_args(argv))
    for field in ("local_rank", *LAUNCH_FIELDS):
        given.pop(field, None)
    return tuple(sorted(given))
