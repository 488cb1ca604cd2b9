"""`ulysses-lc-eval` (also `python -m ulysses_lc.eval`): loss by position and passkey retrieval of model folders.

    ulysses-lc-eval --model ./base --compare runs/x/hf_export --seq-len 65536 --data book.txt --out eval/
    torchrun --nproc_per_node 8 -m ulysses_lc.eval --model ./my-model --seq-len 1048576 --data ./books/

A model folder is the base model or a run's `hf_export`; it loads as the main job loads one (train/loading.py), its
RoPE planned for the length as the main job plans it (`--rope-scaling pretrained`), or left as saved (`as-saved`:
positions past its trained length extrapolated, what the base model does untouched). Under any launcher the main job
takes (torchrun, deepspeed, srun, plain python) the ranks share each sequence over SP (all ranks by default), each
holding the whole weights, or ZeRO-3 partitions of them with --ds-config. With --compare both models read the same
windows and haystacks, and the tables show the change. Rank 0 writes eval.json (settings, every result, the
comparison) and loss_by_position.png (with matplotlib: pip install 'ulysses_lc[plot]') to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
from pathlib import Path

import torch

from ..data.cache import default_cache_dir
from ..data.settings import DataSettings
from ..levers.yarn import plan_rope, trained_length
from ..model import SequenceParallelCausalLM
from ..mixers.kernels import KERNELS
from ..parallel.distributed import destroy_distributed, init_distributed
from ..parallel.layout import ParallelLayout
from ..shape import text_config
from ..tiny import TINY_MODELS
from ..train.console import quiet_warnings
from ..train.files import folder_owner
from ..train.loading import load_model, load_model_config, load_tokenizer
from ..train.run_state import run_name
from .data import eval_windows
from .evaluate import evaluate
from .passkey import DEPTHS, build_haystacks
from .report import compare_lines, plot

logger = logging.getLogger(__name__)
RESULTS_FILE = "eval.json"
PLOT_FILE = "loss_by_position.png"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ulysses-lc-eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model folder (the base model or a run's hf_export), a hub name, "
                                                  f"or an embedded model ({', '.join(TINY_MODELS)}: random weights)")
    p.add_argument("--compare", help="a second model, evaluated on the same text: before / after tables and plot")
    p.add_argument("--names", help="the two models' names in the tables, comma-separated (default: folder names)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per evaluated sequence and haystack")
    p.add_argument("--data", help="the evaluation text, any source --data of the main job takes (default tiny for an "
                                  "embedded model, else pg19:test)")
    p.add_argument("--text-column", help="column of plain text of a dataset source")
    p.add_argument("--sequences", type=int, help="windows of the text to evaluate (default one per DP group)")
    p.add_argument("--buckets", default="8", help="position buckets: a count of equal-width ones, or their start "
                                                  "positions (0,4096,8192,...); the trained length is always an edge")
    p.add_argument("--trained-length", type=int, help="the length marked (default: the model's pre-scaling length)")
    p.add_argument("--passkey-depths", default=",".join(f"{d:g}" for d in DEPTHS),
                   help="depths of the hidden key, shares of the haystack in [0, 1], comma-separated; 'none' skips "
                        "the passkey (default %(default)s)")
    p.add_argument("--passkey-seeds", type=int, default=1, help="haystacks per depth, each with its own key and text")
    p.add_argument("--passkey-digits", type=int, default=5, help="digits of the key")
    p.add_argument("--rope-scaling", choices=["pretrained", "yarn", "as-saved"], default="pretrained",
                   help="pretrained (default): as the main job, the model's own scaling kept or extended, YaRN added "
                        "to an unscaled model beyond its length; yarn: YaRN replacing any; as-saved: the config "
                        "untouched")
    p.add_argument("--yarn-factor", type=float, help="YaRN factor (default: seq-len / the trained length)")
    p.add_argument("--sp-size", type=int, help="ranks sharing one sequence (default: all)")
    p.add_argument("--kernel", default="auto", choices=list(KERNELS), help="attention kernel")
    p.add_argument("--ds-config", help="partition the weights with DeepSpeed ZeRO-3 (a shipped config by name, e.g. "
                                       "zero3, or a JSON file) instead of each rank holding them whole")
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="default bf16 on GPUs, fp32 on CPU")
    p.add_argument("--cache-dir", help="token cache folder (default ~/.cache/ulysses_lc/tokens)")
    p.add_argument("--out", help="where eval.json and the plot go (default eval-<model>)")
    p.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    return p


def run(argv=None) -> dict:
    """Evaluate as the command line says; returns {name: EvalResult} (every rank), rank 0 writing --out."""
    args = build_parser().parse_args(argv)
    names = _names(args)
    init_distributed()
    layout = ParallelLayout.build(args.sp_size)
    rank0 = layout.rank == 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype) or \
        (torch.bfloat16 if device.type == "cuda" else torch.float32)
    buckets = [int(b) for b in args.buckets.split(",")] if "," in args.buckets else int(args.buckets)
    depths = [] if args.passkey_depths.strip().lower() == "none" else \
        [float(d) for d in args.passkey_depths.split(",") if d.strip()]
    tokenizer = load_tokenizer(args.model)  # one text for both models: a compared model must share the tokenizer
    config = load_model_config(args.model)
    mark = args.trained_length or _trained_length(config)
    data = args.data or ("tiny" if args.model in TINY_MODELS else "pg19:test")
    cache_dir = Path(args.cache_dir) if args.cache_dir else default_cache_dir()
    # One builder per copy of the cache folder: shared by the nodes or one on each node's disk (train/files.py).
    builder = folder_owner(cache_dir, layout).writes if layout.world_size > 1 else None
    windows = eval_windows(data, tokenizer, args.seq_len, args.sequences or layout.dp_size,
                           shape=DataSettings(text_column=args.text_column), cache_dir=cache_dir, builder=builder,
                           progress=rank0)
    haystacks = build_haystacks(tokenizer, [w.input_ids for w in windows], args.seq_len, depths, args.passkey_seeds,
                                args.passkey_digits) if depths else []
    results = {}
    for name, folder in zip(names, [args.model, args.compare]):
        if folder is None:
            continue
        model, rope = _load(folder, args, layout, device, dtype)
        if rank0:
            logger.info("%s (%s): %s, RoPE %s", name, folder, f"{len(windows)} window(s) of {args.seq_len:,} tokens, "
                        f"{len(haystacks)} haystack(s)", rope)
        results[name] = evaluate(model, windows, haystacks, buckets=buckets, trained_length=mark,
                                 pad_token_id=tokenizer.pad_token_id or 0, vocab_size=text_config(config).vocab_size)
        _release(model)
    if rank0:
        _report(results, args, data)
    return results


def _names(args) -> list[str]:
    if args.names:
        names = [n.strip() for n in args.names.split(",")]
        if len(names) != (2 if args.compare else 1):
            raise ValueError(f"--names {args.names!r}: give one name per model ({2 if args.compare else 1}), "
                             "comma-separated.")
        return names
    if not args.compare:
        return [run_name(args.model)]
    a, b = (Path(args.model), Path(args.compare))
    if a.name == b.name:  # two hf_export folders: name them by their runs
        return [f"{a.parent.name}/{a.name}", f"{b.parent.name}/{b.name}"]
    return [run_name(args.model), run_name(args.compare)]


def _trained_length(config) -> int | None:
    try:
        return trained_length(config)
    except ValueError:  # no RoPE: no length to mark
        return None


def _load(name: str, args, layout: ParallelLayout, device, dtype):
    """The model (a SequenceParallelCausalLM, or its ZeRO-3 engine) and a phrase for its RoPE."""
    if Path(name, "adapter_config.json").is_file():
        raise ValueError(f"{name} holds LoRA adapters, not a model: evaluate the merged export (train with "
                         "--export-merged, then --model .../hf_export/merged).")
    config = load_model_config(name)
    rope = "as saved"
    if args.rope_scaling != "as-saved":
        plan = plan_rope(config, args.seq_len, args.yarn_factor, rope_scaling=args.rope_scaling,
                         sp_size=layout.sp_size)
        plan.apply(config)
        rope = plan.summary
    ds_config = {}
    if args.ds_config:
        from ..parallel.ds_config import check_deepspeed_config, load_deepspeed_config, resolve_precision

        ds_config = resolve_precision(check_deepspeed_config(load_deepspeed_config(args.ds_config), layout), dtype)
        for key in ("optimizer", "scheduler"):  # forward only: no optimizer state to hold
            ds_config.pop(key, None)
    hf_model = load_model(name, config, dtype, 0, device, ds_config)
    # Forward only, in eval mode: no checkpoint or offload to arm; the tiled MLP and chunked head keep their savings.
    model = SequenceParallelCausalLM(hf_model, layout, kernel=args.kernel, checkpointing=False, offload=False)
    if ds_config:
        import deepspeed

        model, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=layout.mpu)
    return model, rope


def _release(model) -> None:
    """Free one model before the next loads (ZeRO-3's hooks and partitions go with its engine)."""
    if hasattr(model, "destroy"):
        model.destroy()
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _report(results: dict, args, data: str) -> None:
    out = Path(args.out or f"eval-{run_name(args.model)}")
    out.mkdir(parents=True, exist_ok=True)
    for name, result in results.items():
        print(f"{name}: {result.line()}")
        print("\n".join("  " + line for line in result.table()), flush=True)
    names = list(results)
    comparison = compare_lines(*results.values(), names=names) if len(results) == 2 else []
    if comparison:
        print("\n".join(comparison), flush=True)
    settings = {k: v for k, v in vars(args).items() if k != "local_rank"}
    record = {"settings": {**settings, "data": data}, "results": {n: r.to_dict() for n, r in results.items()},
              "comparison": comparison}
    (out / RESULTS_FILE).write_text(json.dumps(record, indent=2))
    why_not = plot(results, out / PLOT_FILE)
    print(f"wrote {out / RESULTS_FILE}" + (f"; {why_not}" if why_not else f" and {out / PLOT_FILE}"), flush=True)


def main(argv=None) -> None:
    """The command line: a user mistake prints its fix (rank 0) and exits 1 without a traceback."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    quiet_warnings(rank)
    try:
        run(argv)
    except ValueError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # every rank raised it; a normal exit could wait on a process group a peer already left
    destroy_distributed()


__all__ = ["build_parser", "main", "run"]
