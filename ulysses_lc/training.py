"""The training loop behind examples/train_1m.py: one long sequence per step, on DeepSpeed ZeRO-3.

Every piece is a library call a user can take on its own (see examples/embed_in_your_loop.py); this
module strings them together with the run's bookkeeping: checks before any heavy work, the token
cache, the engine, logging, checkpoints with resume, and the final Hugging Face export.

Order of work, chosen so that mistakes cost seconds: flags and the DeepSpeed config are checked, the
output directory is checked, the model config is read (no weights) and the SP split checked against
it, the data source is checked; only then are weights loaded and the data tokenized.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from .attention import check_model_for_ulysses
from .data import build_token_stream, parse_source
from .ds_config import check_deepspeed_config, load_deepspeed_config
from .layout import ParallelLayout
from .kernels import valid_head_groups
from .memory import MemoryPlan, plan_step_memory
from .metrics import StepLogger, measure_peak_bf16_tflops, model_flops_per_step
from .model import SequenceParallelCausalLM
from .shape import ModelShape
from .sharding import shard_batch
from .yarn import apply_yarn

logger = logging.getLogger(__name__)

TINY = "tiny"
CHECKPOINT_DIR = "checkpoints"
EXPORT_DIR = "hf_export"
RUN_FILE = "run.json"


@dataclass
class TrainConfig:
    """What one run trains. Field names match examples/train_1m.py's flags."""

    model: str = "Qwen/Qwen3-8B"
    seq_len: int = 1_048_576
    sp_size: int | None = None  # None: every rank in one SP group
    data: str = "pg19"
    steps: int = 12
    lr: float = 1e-5
    lr_schedule: str = "cosine"  # constant | linear | cosine
    warmup_steps: int = 1
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    ds_config: str = "ds_configs/zero3.json"
    output_dir: str = "runs/train_1m"
    resume: bool = False
    save_every: int = 0  # 0: only at the end
    seed: int = 0
    yarn_factor: float | None = None
    kernel: str = "auto"
    keep_on_gpu: int | None = None  # None: from the memory plan, see _memory_plan
    recompute_layers: int | None = None  # None: from the memory plan
    cache_attention_layers: int | None = None  # None: from the memory plan
    attention_head_groups: int | str = "auto"  # the attention kernel over this many kv-head groups
    cache_dir: str | None = None
    tensorboard: bool = False
    export: bool = True

    def check(self) -> None:
        if self.seq_len < 2:
            raise ValueError(f"--seq-len {self.seq_len} is too short: a step needs at least 2 tokens.")
        if self.steps < 1:
            raise ValueError(f"--steps {self.steps}: train at least one step.")
        if self.lr <= 0:
            raise ValueError(f"--lr {self.lr} must be positive.")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"--lr-schedule {self.lr_schedule!r}: pick constant, linear or cosine.")
        if self.save_every < 0:
            raise ValueError(f"--save-every {self.save_every} must be >= 0 (0 saves only at the end).")
        if not valid_head_groups(self.attention_head_groups):
            raise ValueError(f"--attention-head-groups {self.attention_head_groups!r}: give 'auto' or a whole "
                             "number >= 1.")
        for flag in ("keep_on_gpu", "recompute_layers", "cache_attention_layers"):
            value = getattr(self, flag)
            if value is not None and value < 0:
                raise ValueError(f"--{flag.replace('_', '-')} {value} must be >= 0 (leave it out to plan from memory).")


# -- model ---------------------------------------------------------------------------------------

def tiny_model_config():
    """The embedded default: a small Qwen3 (full attention, GQA) over the byte-level tiny tokenizer.

    Its "trained length" is 1024 tokens, so the default 4096-token run goes through YaRN (factor 4)
    exactly as a real model stretched to 1M does.
    """
    from transformers import Qwen3Config

    from .tiny import tiny_tokenizer

    vocab = len(tiny_tokenizer())
    return Qwen3Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        max_position_embeddings=1024, rope_theta=10000.0, eos_token_id=vocab - 1,
        pad_token_id=vocab - 1,
    )


def load_model_config(name: str, seq_len: int):
    """The model's config (no weights), or a ValueError that says whether the name or the network is wrong."""
    if name == TINY:
        return tiny_model_config()
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        text = str(e).lower()
        bad_name = "valid model identifier" in text or "repo id" in text or "repo_id" in text
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or "offline" in text or "connect" in text
        if Path(name).exists():
            why = f"the local path {name} holds no loadable model config ({e})"
        elif offline and not bad_name:
            why = f"no network and no local copy of {name} in the Hugging Face cache"
        else:
            why = f"{name} is not a model on the Hugging Face hub or a local folder ({type(e).__name__})"
        raise ValueError(
            f"cannot load --model {name}: {why}. Pass a local model folder, or --model tiny to try the "
            "pipeline on the embedded tiny model."
        ) from e


def load_tokenizer(name: str):
    if name == TINY:
        from .tiny import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def load_model(name: str, config, dtype: torch.dtype, seed: int, device: torch.device, ds_config: dict):
    """Weights for `config` (YaRN already applied to it): from the hub/local folder, or fresh for tiny.

    Under ZeRO-3 a real model is loaded through transformers' DeepSpeed integration (zero.Init), so each
    rank only ever holds its partition: eight ranks of an 8B model do not each materialise 16 GB.
    """
    from transformers import AutoModelForCausalLM

    if name == TINY:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    if ds_config.get("zero_optimization", {}).get("stage") == 3:
        from transformers.integrations import HfDeepSpeedConfig

        # zero.Init reads only the ZeRO and precision settings; without our mpu DeepSpeed would size the batch by
        # the world size, so the batch keys are left for it to derive.
        init_config = {k: v for k, v in ds_config.items() if k != "train_batch_size"}
        zero3 = HfDeepSpeedConfig(init_config)  # must stay alive while from_pretrained runs
        model = AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype)
        del zero3
        return model
    return AutoModelForCausalLM.from_pretrained(name, config=config, dtype=dtype).to(device)


# -- schedule and state ----------------------------------------------------------------------------

def lr_lambda(cfg: TrainConfig):
    """Multiplier of the base learning rate at optimizer step `step` (0-based): warmup, then the schedule."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        if cfg.lr_schedule == "constant":
            return 1.0
        if cfg.lr_schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return factor


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def check_output_dir(cfg: TrainConfig, sp_size: int, world_size: int) -> Path:
    """Refuse to overwrite another run's checkpoints; on --resume, require the same run."""
    out = Path(cfg.output_dir)
    run_file = out / RUN_FILE
    has_ckpt = (out / CHECKPOINT_DIR / "latest").exists()
    if has_ckpt and not cfg.resume:
        raise ValueError(
            f"{out} already holds a checkpoint of a run; pass --resume to continue it, or choose another "
            "--output-dir (nothing is overwritten)."
        )
    if cfg.resume and not has_ckpt:
        raise ValueError(f"--resume: {out} holds no checkpoint to resume from; drop --resume to start a new run.")
    if cfg.resume and run_file.exists():
        saved = json.loads(run_file.read_text())
        # The ZeRO-3 partitions and the DP split of the data follow the world size and sp_size.
        now = {"model": cfg.model, "seq_len": cfg.seq_len, "data": cfg.data, "sp_size": sp_size, "world_size": world_size}
        for key, value in now.items():
            if saved.get(key) != value:
                raise ValueError(
                    f"--resume: the checkpoint in {out} was trained with {key}={saved.get(key)!r}, not "
                    f"{value!r}; resume with the same settings (number of GPUs included) or use another --output-dir."
                )
    return out


def _memory_plan(cfg: TrainConfig, model: SequenceParallelCausalLM, device: torch.device, num_params: int,
                 layout: ParallelLayout) -> MemoryPlan:
    """memory.plan_step_memory for this run, the flags winning over it. Called after deepspeed.initialize
    (ZeRO-3's partitions are then allocated); AdamW's two fp32 moments (8 bytes per parameter, partitioned
    over all ranks) come at the first step, so they are reserved."""
    plan = plan_step_memory(model.shape, cfg.seq_len, layout, device, kernel=model.attention.kernel,
                            head_groups=cfg.attention_head_groups, reserved_bytes=8 * num_params // layout.world_size)
    return plan.with_overrides(cfg.recompute_layers, cfg.keep_on_gpu, cfg.cache_attention_layers)


# -- the run -----------------------------------------------------------------------------------------

def train(cfg: TrainConfig, on_step=None) -> list[dict]:
    """Run (or resume) training; returns the per-step records (rank 0; other ranks get []).

    on_step(step, record) is called after every step on every rank (record None off rank 0); raising
    from it stops the run there, as a crash would (tests use this to kill a run mid-way).
    """
    import deepspeed

    cfg.check()
    ds_raw = load_deepspeed_config(cfg.ds_config)
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    world = torch.distributed.get_world_size()
    sp_size = cfg.sp_size or world
    layout = ParallelLayout.build(sp_size)  # ValueError when world is not divisible
    rank0 = layout.rank == 0
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # One optimizer step per sequence per DP group: the loop, schedule and checkpoints count in those steps.
    ds_config = _resolve_precision(check_deepspeed_config(ds_raw, layout, gradient_accumulation_steps=1), dtype)
    _check_optimizer_block(ds_config, cfg)
    out = check_output_dir(cfg, sp_size, world)
    if cfg.seq_len < sp_size:
        raise ValueError(f"--seq-len {cfg.seq_len} is shorter than sp_size={sp_size}: each rank needs a token.")

    model_config = load_model_config(cfg.model, cfg.seq_len)
    check_model_for_ulysses(model_config, sp_size)
    apply_yarn(model_config, cfg.seq_len, cfg.yarn_factor)
    parse_source(cfg.data, seed=cfg.seed)  # a missing path fails here, before any weights load

    tokenizer = load_tokenizer(cfg.model)
    stream = build_token_stream(
        cfg.data, tokenizer, cfg.seq_len, num_steps=cfg.steps * layout.dp_size, cache_dir=cfg.cache_dir,
        local_rank=local_rank, seed=cfg.seed, progress=rank0,
    )

    torch.manual_seed(cfg.seed)
    hf_model = load_model(cfg.model, model_config, dtype, cfg.seed, device, ds_config)
    num_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in hf_model.parameters())
    model = SequenceParallelCausalLM(hf_model, layout, kernel=cfg.kernel, attention_head_groups=cfg.attention_head_groups)

    optimizer = None
    if "optimizer" not in ds_config:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda"
        )
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, model_parameters=model.parameters() if optimizer is None else None,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
        config=ds_config, mpu=layout.mpu,
    )
    engine.train()  # from_pretrained returns eval mode, where transformers skips checkpointing altogether
    plan = _memory_plan(cfg, model, device, num_params, layout)
    model.use_plan(plan)
    if rank0:
        logger.info("memory plan: %s", model.checkpointing.report())

    start_step = 0
    if cfg.resume:
        _, client = engine.load_checkpoint(str(out / CHECKPOINT_DIR))
        start_step = client["step"]
        stream.load_state_dict(client["data"])
        _set_rng_state(client["rng"])
        if rank0:
            logger.info("resumed from step %d", start_step)
    elif rank0:
        out.mkdir(parents=True, exist_ok=True)
        (out / RUN_FILE).write_text(json.dumps({**asdict(cfg), "sp_size": sp_size, "world_size": world}, indent=2))

    # FLOPs of one sequence over the sp_size GPUs that share it: per-GPU figures hold for any DP size.
    flops = model_flops_per_step(model_config, cfg.seq_len, recompute_layers=plan.recompute_layers,
                                 cached_attention_layers=plan.cache_attention_layers)
    peak = measure_peak_bf16_tflops(device) if device.type == "cuda" else None
    records = []
    with StepLogger(
        out, cfg.steps, tokens_per_step=cfg.seq_len * layout.dp_size, world_size=sp_size, flops=flops,
        peak_tflops=peak, rank=layout.rank, start_step=start_step, tensorboard=cfg.tensorboard,
    ) as step_logger:
        for step in range(start_step, cfg.steps):
            # DP group j takes window position + j; the position then moves past all DP groups' windows.
            sequence = stream.sequence(stream.position + layout.dp_rank)
            batch = shard_batch(sequence, layout, pad_token_id=_pad_id(tokenizer),
                                vocab_size=model_config.vocab_size).to(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter()
            loss = engine(**batch.as_kwargs())
            engine.backward(loss)
            engine.step()
            # The one host sync of the step: the logged numbers.
            loss_value = _dp_mean(loss.detach(), layout)
            step_time = time.perf_counter() - t0
            grad_norm = engine.get_global_grad_norm()
            record = step_logger.log(
                step + 1, loss=loss_value, step_time_s=step_time,
                grad_norm=None if grad_norm is None else float(grad_norm),
                lr=scheduler.get_last_lr()[0], offload_host_gb=model.checkpointing.host_bytes / 1e9,
            )
            stream.position += layout.dp_size
            if record is not None:
                records.append(record)
            done = step + 1
            if (cfg.save_every and done % cfg.save_every == 0) or done == cfg.steps:
                engine.save_checkpoint(
                    str(out / CHECKPOINT_DIR), tag=f"step{done}",
                    client_state={"step": done, "data": stream.state_dict(), "rng": _rng_state()},
                )
            if on_step is not None:
                on_step(done, record)

    if cfg.export:
        export_hf_model(engine, model, tokenizer, out / EXPORT_DIR, layout)
    return records


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)


def _dp_mean(loss: torch.Tensor, layout: ParallelLayout) -> float:
    """The step's loss averaged over DP groups (each SP group already holds its sequence's mean)."""
    if layout.dp_size > 1:
        loss = loss.clone()
        torch.distributed.all_reduce(loss, group=layout.dp_group)
        loss /= layout.dp_size
    return float(loss)


def _resolve_precision(ds_config: dict, dtype: torch.dtype) -> dict:
    """bf16 "auto" follows the device (bf16 on GPU, fp32 on CPU); an explicit setting must agree."""
    bf16 = ds_config.setdefault("bf16", {"enabled": "auto"})
    if bf16.get("enabled") == "auto":
        bf16["enabled"] = dtype == torch.bfloat16
    elif bool(bf16.get("enabled")) != (dtype == torch.bfloat16):
        raise ValueError(
            f"the DeepSpeed config sets bf16.enabled={bf16.get('enabled')} but this run trains in {dtype} "
            "(bf16 on GPUs, fp32 on CPU); set it to \"auto\"."
        )
    if ds_config.get("fp16", {}).get("enabled"):
        raise ValueError("fp16 is not supported for million-token training (overflow in long reductions); use bf16.")
    return ds_config


def _check_optimizer_block(ds_config: dict, cfg: TrainConfig) -> None:
    """A DeepSpeed "optimizer" block (needed for optimizer offload: DeepSpeed's CPU Adam) takes --lr and
    --weight-decay where it says "auto"; a different lr there is refused."""
    block = ds_config.get("optimizer")
    if block is None:
        return
    params = block.setdefault("params", {})
    if params.get("lr", "auto") not in ("auto", cfg.lr):
        raise ValueError(
            f"the DeepSpeed config's optimizer has lr={params['lr']} but --lr is {cfg.lr}; set it to \"auto\"."
        )
    params["lr"] = cfg.lr
    if params.get("weight_decay", "auto") == "auto":
        params["weight_decay"] = cfg.weight_decay
    if "scheduler" in ds_config:
        raise ValueError("the DeepSpeed config has a scheduler block; remove it, --lr-schedule sets the schedule.")


def export_hf_model(engine, model: SequenceParallelCausalLM, tokenizer, export_dir: Path, layout: ParallelLayout):
    """Write a consolidated Hugging Face model (16-bit weights, config with its YaRN rope_parameters).

    Collective: every rank must call it (ZeRO-3 gathers the partitioned weights to rank 0).
    """
    state = engine._zero3_consolidated_16bit_state_dict() if engine.zero_optimization_partition_weights() \
        else engine.module.state_dict()
    if layout.rank == 0:
        # Names under the wrapper (and inside TiledMLP) -> the plain model's names, matched by parameter.
        wrapped = dict(model.named_parameters(remove_duplicate=False))
        model.undo()  # plain attention name, LM head and MLP modules in the saved config and keys
        plain = {id(p): name for name, p in model.model.named_parameters(remove_duplicate=False)}
        rename = {name: plain[id(p)] for name, p in wrapped.items() if id(p) in plain}
        state = {rename.get(k, k.removeprefix("model.")): v for k, v in state.items()}
        model.model.save_pretrained(export_dir, state_dict=state)
        tokenizer.save_pretrained(export_dir)
    torch.distributed.barrier()
