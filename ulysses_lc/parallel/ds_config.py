"""DeepSpeed config checks: refuse settings under which sequence-parallel training would be silently wrong.

`check_deepspeed_config` checks every key against DeepSpeed's own schema (`check_known_keys`) and the batch and
ZeRO keys against the layout; `resolve_precision` and `check_optimizer_block` fill the "auto" values the training
path owns (precision, lr, weight decay).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import typing
from pathlib import Path

from .layout import ParallelLayout


# The configs found by name from any folder: the one copy is the checkout's top-level ds_configs/, which a wheel
# ships as ulysses_lc/ds_configs/ (pyproject's package-dir). An installed wheel has the first folder, a checkout
# (editable install, PYTHONPATH) the second.
_PACKAGE = Path(__file__).resolve().parent.parent  # ulysses_lc/
CONFIG_DIRS = (_PACKAGE / "ds_configs", _PACKAGE.parent / "ds_configs")
CONFIG_NAMES = ("zero3", "zero3_offload_optimizer", "zero3_offload_all")


def shipped_config_path(name: str) -> Path:
    """The file of a shipped config (one of `CONFIG_NAMES`), in the installed package or the checkout."""
    for folder in CONFIG_DIRS:
        path = folder / f"{name}.json"
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the shipped DeepSpeed config {name}.json is in none of {', '.join(map(str, CONFIG_DIRS))}; reinstall "
        "ulysses_lc (`pip install .` from a checkout that has ds_configs/), or pass a JSON path."
    )


def deepspeed_config_path(config: str | Path) -> Path:
    """The file a --ds-config value names: one of `CONFIG_NAMES` (ds_configs/, shipped), or a JSON path."""
    text = str(config)
    if text in CONFIG_NAMES:
        return shipped_config_path(text)
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(
            f"DeepSpeed config {text} does not exist; pass a JSON file or one of the shipped configs by name: "
            f"{', '.join(CONFIG_NAMES)}."
        )
    return path


def load_deepspeed_config(config: str | Path | dict) -> dict:
    """Read a DeepSpeed JSON config (a shipped name, a path, or a dict) into a new dict."""
    if isinstance(config, dict):
        return json.loads(json.dumps(config))
    path = deepspeed_config_path(config)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {e}") from e


# The blocks DeepSpeed reads through its pydantic models (extra="forbid": an unknown key is refused, but only when
# deepspeed.initialize runs, after the weights load). Checked here with the same models, before any heavy work.
PYDANTIC_BLOCKS = {
    "zero_optimization": "deepspeed.runtime.zero.config:DeepSpeedZeroConfig",
    "tensorboard": "deepspeed.monitor.config:TensorBoardConfig",
    "wandb": "deepspeed.monitor.config:WandbConfig",
    "csv_monitor": "deepspeed.monitor.config:CSVConfig",
    "comet": "deepspeed.monitor.config:CometConfig",
    "compile": "deepspeed.runtime.compiler:CompileConfig",
}
OUR_KEYS = ("sequence_parallel_size",)  # read by check_deepspeed_config (and DeepSpeed's zero.Init without an mpu)


@functools.lru_cache(maxsize=None)
def deepspeed_top_level_keys() -> frozenset[str] | None:
    """The top-level keys DeepSpeed reads: those its DeepSpeedConfig looks up while parsing a minimal config (every
    block is asked for, present or not), with the names in deepspeed.runtime.constants. None where that parse fails
    (a DeepSpeed whose config class changed): top-level keys then go unchecked rather than refused wrongly."""
    import deepspeed.runtime.constants as constants
    from deepspeed.runtime.config import DeepSpeedConfig

    seen = {value for name, value in vars(constants).items() if name.isupper() and isinstance(value, str)}

    class Keys:  # DeepSpeed asks `key in param_dict.keys()` as often as param_dict.get(key)
        def __init__(self, d):
            self.d = d

        def __contains__(self, key):
            seen.add(key)
            return key in self.d

        def __iter__(self):
            return iter(self.d)

    class Reads(dict):
        def get(self, key, *default):
            seen.add(key)
            return super().get(key, *default)

        def __getitem__(self, key):
            seen.add(key)
            return super().__getitem__(key)

        def __contains__(self, key):
            seen.add(key)
            return super().__contains__(key)

        def keys(self):
            return Keys(dict(self))

    class OneRank:  # the mpu keeps DeepSpeedConfig off torch.distributed
        def get_data_parallel_world_size(self):
            return 1

    minimal = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": 3}}
    try:
        DeepSpeedConfig(Reads(minimal), mpu=OneRank())
    except Exception:  # noqa: BLE001 - see the docstring
        return None
    return frozenset(seen | set(OUR_KEYS))


def _model_keys(model) -> list[str]:
    """A pydantic model's field names and their aliases (DeepSpeed's stage3_* keys are aliases)."""
    keys = []
    for name, field in model.model_fields.items():
        keys += [name] + ([field.alias] if field.alias else [])
    return keys


def _nested_model(model, path: tuple):
    """The pydantic model that holds the key at the end of `path` inside `model` (offload_param's model for
    ("offload_param", "devic")); None where a step is no model."""
    for key in path[:-1]:
        field = next((f for n, f in model.model_fields.items() if key in (n, f.alias)), None)
        if field is None:
            return None
        models = [t for t in (field.annotation, *typing.get_args(field.annotation))
                  if isinstance(t, type) and hasattr(t, "model_fields")]
        if not models:
            return None
        model = models[0]
    return model


def _unknown(key: str, path: str, known, then: str) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else "see DeepSpeed's config documentation for the keys it reads"
    return f"{path!r} is no key DeepSpeed knows ({then}); {hint}"


def check_known_keys(config: dict) -> None:
    """ValueError naming each key of `config` that DeepSpeed does not know and the closest one it does
    (`zero_optimisation` -> `zero_optimization`, `zero_optimization.overlap_comms` -> `overlap_comm`), and any value
    DeepSpeed's pydantic models refuse, before any weight loads."""
    import pydantic

    problems = []
    known = deepspeed_top_level_keys()
    if known is not None:
        # DeepSpeed skips an unknown top-level key: `zero_optimisation` trained on ZeRO stage 0.
        problems += [_unknown(key, key, known, "it would be ignored") for key in config if key not in known]
    for block, where in PYDANTIC_BLOCKS.items():
        value = config.get(block)
        if not isinstance(value, dict):
            continue
        module, name = where.split(":")
        try:
            model = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):  # another DeepSpeed version: its engine checks the block itself
            continue
        try:
            model(**value)
        except pydantic.ValidationError as e:
            for error in e.errors():
                path = ".".join(map(str, (block, *error["loc"])))
                if error["type"] == "extra_forbidden":
                    inner = _nested_model(model, error["loc"])
                    problems.append(_unknown(str(error["loc"][-1]), path, _model_keys(inner) if inner else (),
                                             "its engine would refuse it after the weights load"))
                else:
                    problems.append(f"{path!r}: {error['msg']} (DeepSpeed's {name})")
    if problems:
        raise ValueError("the DeepSpeed config: " + "; ".join(problems))


def check_deepspeed_config(config: dict, layout: ParallelLayout, gradient_accumulation_steps: int | None = None) -> dict:
    """Check (and complete) a DeepSpeed config for one sequence per micro step on `layout`.

    Refuses keys DeepSpeed does not know (`check_known_keys`); fills train_micro_batch_size_per_gpu=1 and derives
    train_batch_size when absent ("auto" counts as absent); raises ValueError when the config contradicts the run.
    """
    check_known_keys(config)
    config = dict(config)
    for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps"):
        if config.get(key) == "auto":
            del config[key]
    micro = config.setdefault("train_micro_batch_size_per_gpu", 1)
    if micro != 1:
        raise ValueError(
            f"train_micro_batch_size_per_gpu={micro}: ulysses_lc trains one long sequence per step per SP group; "
            "set it to 1 (use gradient_accumulation_steps for more sequences per optimizer step)."
        )
    if gradient_accumulation_steps is not None:
        ga = config.setdefault("gradient_accumulation_steps", gradient_accumulation_steps)
        if ga != gradient_accumulation_steps:
            raise ValueError(
                f"the DeepSpeed config has gradient_accumulation_steps={ga} but the run asks for "
                f"{gradient_accumulation_steps}; remove it from the config or make them agree."
            )
    ga = config.setdefault("gradient_accumulation_steps", 1)
    # With our mpu DeepSpeed sizes batches by the DP axis: sequences per optimizer step.
    expected = micro * ga * layout.dp_size
    tbs = config.setdefault("train_batch_size", expected)
    if tbs != expected:
        raise ValueError(
            f"train_batch_size={tbs} does not match 1 sequence x gradient_accumulation_steps={ga} x "
            f"dp_size={layout.dp_size} = {expected} sequences; remove train_batch_size from the config."
        )
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage != 3:
        raise ValueError(
            f"zero_optimization.stage={stage}: ulysses_lc trains on ZeRO-3 only. Under sequence parallelism "
            "DeepSpeed's stage 0-2 gradient reduction divides by the data-parallel size only, which does not "
            "match the sequence-parallel loss, and the tiled MLP's once-per-layer reduction relies on ZeRO-3; "
            "use stage 3 (the shipped configs: zero3, zero3_offload_optimizer, zero3_offload_all)."
        )
    if layout.sp_size > 1 and zero.get("reduce_scatter", True) is False:
        raise ValueError(
            "zero_optimization.reduce_scatter=false with sequence parallelism: DeepSpeed then averages gradients "
            "over dp_size instead of all ranks, scaling them by sp_size; remove the setting."
        )
    if config.get("sequence_parallel_size", layout.sp_size) != layout.sp_size:
        raise ValueError(
            f"the DeepSpeed config says sequence_parallel_size={config['sequence_parallel_size']} but the run uses "
            f"sp_size={layout.sp_size}; remove the key or make them agree."
        )
    return config


def resolve_precision(ds_config: dict, dtype) -> dict:
    """Fill bf16 "auto" from the training dtype (bf16 on GPU, fp32 on CPU); an explicit setting must agree.

    dtype: the torch dtype the weights train in. Changes and returns `ds_config`.
    """
    import torch

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


def check_optimizer_block(ds_config: dict, lr: float, weight_decay: float) -> dict:
    """Fill a DeepSpeed "optimizer" block's "auto" lr and weight_decay from the run; refuse a different lr.

    The block is needed for optimizer offload (DeepSpeed's CPU Adam); a "scheduler" block is refused, since
    the run sets the schedule. Changes and returns `ds_config`.
    """
    block = ds_config.get("optimizer")
    if block is None:
        return ds_config
    params = block.setdefault("params", {})
    if params.get("lr", "auto") not in ("auto", lr):
        raise ValueError(
            f"the DeepSpeed config's optimizer has lr={params['lr']} but --lr is {lr}; set it to \"auto\"."
        )
    params["lr"] = lr
    if params.get("weight_decay", "auto") == "auto":
        params["weight_decay"] = weight_decay
    if "scheduler" in ds_config:
        raise ValueError("the DeepSpeed config has a scheduler block; remove it, --lr-schedule sets the schedule.")
    return ds_config
