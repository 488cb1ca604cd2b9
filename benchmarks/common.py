"""What the step runners share (bench_step.py on one GPU, bench_sp.py over a process group).

- the model: public Qwen3 shapes with random weights, random tokens, the cuDNN-first SDPA priority;
- DeepSpeed's ALST pieces both runners wire (TiledMLP, TiledFusedLogitsLoss);
- one variant's record: memory before and after its timed step, a failure as the record's status;
- the parent: each variant in a process of its own (its group killed when out of time), the time guard over
  --budget-s, the flags, and the results_<suite>.json / table_<suite>.txt / log_<suite>.txt it writes.

GB are 1e9 bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(REPO))  # the repo, when not pip-installed
from ulysses_lc.constants import IGNORE_INDEX  # noqa: E402

K = 1024
GB = 1e9
SHORT_WARMUP_TOKENS = 8192

# The public configs (huggingface.co/Qwen/Qwen3-0.6B, Qwen3-4B, Qwen3-8B: config.json); rope_theta 1e6;
# 0.6B and 4B tie their embeddings, 8B does not.
SHAPES = {
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=1000),
}


# ---- the model and its inputs ----

def local_device() -> torch.device:
    """This process's device: GPU LOCAL_RANK (0 outside torchrun) when there is one."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def sync(dev: torch.device):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_model(shape: str, num_layers: int | None = None, seed: int = 0, dtype=torch.bfloat16, device=None):
    """Random-weight Qwen3 causal LM of a public shape (bf16 unless told), built directly on the device."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    kw = dict(SHAPES[shape])
    kw.setdefault("tie_word_embeddings", True)
    if num_layers:
        kw["num_hidden_layers"] = num_layers
    config = Qwen3Config(**kw, max_position_embeddings=40960, rope_theta=1e6, use_cache=False,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device or local_device()):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.train()
    return model


def random_tokens(seq_len: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (1, seq_len), generator=torch.Generator().manual_seed(seed))


def warmup_tokens(spec: dict) -> int:
    """The first warm-up step's length: the variant's own ("full"), or 8k ("short": the timed step then also pays
    that length's first-time costs, used where one step takes minutes; "steady": 8k, then, after the plan, one more
    untimed step at full length, so the timed step is a steady one)."""
    return spec["seq"] if spec.get("warmup", "full") == "full" else min(SHORT_WARMUP_TOKENS, spec["seq"])


def cudnn_first():
    """SDPA backend priority with cuDNN first (what ulysses_lc's kernel='auto' applies on Hopper)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    return sdpa_kernel(order, set_priority=True)


# ---- DeepSpeed's ALST pieces, as deepspeed/runtime/sequence_parallel/ulysses_sp.py documents them ----

def install_alst_tiled_mlp(group=None):
    """DeepSpeed's TiledMLP as its docstring wires it: Qwen3MLP.forward monkey-patched (for every Qwen3 model
    in the process), shards = ceil(seqlen / hidden) agreed by an all-reduce MAX over `group` (one .item() per
    layer call, as documented)."""
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP
    from transformers.models.qwen3 import modeling_qwen3

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def tiled_mlp_forward(self, x):
        bs, seqlen, hidden = x.shape
        num_shards = math.ceil(seqlen / hidden)
        tensor = torch.tensor(num_shards, device=x.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        num_shards = tensor.item()
        compute_params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(mlp_forward, self, x, num_shards, compute_params)

    modeling_qwen3.Qwen3MLP.forward = tiled_mlp_forward


def alst_loss_sum(model, hidden, labels, logits_shard_gib: float = 1.0):
    """Summed fp32 cross-entropy of `hidden` against shifted `labels` through DeepSpeed's TiledFusedLogitsLoss,
    in shards of ~`logits_shard_gib` GiB of fp32 logits (ArcticTraining's slice size), output_reduction="sum"
    (the docstring's advice when shards may hold different numbers of valid labels)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    vocab = model.config.vocab_size

    def loss_fn(lm_model, x, y):
        logits = lm_model.lm_head(x).float()
        return F.cross_entropy(logits.view(-1, vocab), y.view(-1), ignore_index=IGNORE_INDEX, reduction="sum")

    shards = max(1, math.ceil(labels.numel() * vocab * 4 / 2**30 / logits_shard_gib))
    return TiledFusedLogitsLoss.apply(loss_fn, model, hidden, labels, None, shards, [model.lm_head.weight], "sum")


# ---- one variant's record ----

def median_seconds(fn, iters: int, warmup: int = 1) -> float:
    """The median wall time of `iters` calls of fn() after `warmup` untimed ones: CUDA events on a GPU, the
    clock elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def host_gb():
    """(RSS, peak RSS) of this process in GB."""
    import psutil

    return psutil.Process().memory_info().rss / GB, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def is_oom(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def start_peak(rec: dict, dev: torch.device):
    """Before the timed step: what is allocated already (params, optimizer state, batch); peak counted from here."""
    sync(dev)
    if dev.type == "cuda":
        rec["static_gb"] = torch.cuda.memory_allocated(dev) / GB
        torch.cuda.reset_peak_memory_stats(dev)
        rec["_allocator_before"] = _allocator_counts(dev)


# The caching allocator's counters that cost the GPU time: a failed allocation frees the cache and retries (a device
# synchronize), and device mallocs / frees (with expandable segments, maps and unmaps). Near a full GPU, as the
# memory plan runs, these are what can leave the GPU idle mid-step.
ALLOCATOR_COUNTS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free", "num_ooms")


def _allocator_counts(dev: torch.device) -> dict:
    stats = torch.cuda.memory_stats(dev)
    return {k: stats.get(k, 0) for k in ALLOCATOR_COUNTS}


def end_peak(rec: dict, dev: torch.device):
    """After the timed step: its peak GPU memory (allocated, reserved), the allocator's counters over it
    (ALLOCATOR_COUNTS) and the host's RSS and peak RSS."""
    if dev.type == "cuda":
        rec["peak_gb"] = torch.cuda.max_memory_allocated(dev) / GB
        rec["peak_reserved_gb"] = torch.cuda.max_memory_reserved(dev) / GB
        before = rec.pop("_allocator_before", None)
        if before is not None:
            after = _allocator_counts(dev)
            rec["allocator"] = {k: after[k] - before[k] for k in ALLOCATOR_COUNTS}
    rec["host_rss_gb"], rec["host_maxrss_gb"] = host_gb()


def record_failure(rec: dict, e: BaseException, dev: torch.device):
    """A benchmark records every failure and moves on: out of memory or error, with the peak before it."""
    rec.pop("_allocator_before", None)
    rec["status"] = "oom" if is_oom(e) else "error"
    rec["error"] = "".join(traceback.format_exception_only(type(e), e)).strip()[-600:]
    if rec["status"] == "error":
        rec["traceback"] = traceback.format_exc()[-3000:]
    if dev.type == "cuda":
        rec["peak_gb_at_failure"] = torch.cuda.max_memory_allocated(dev) / GB
    try:
        rec["host_rss_gb"], rec["host_maxrss_gb"] = host_gb()
    except Exception:  # noqa: BLE001
        pass


def write_record(rec: dict, path: Path, hide=("traceback",)):
    """A child's record for the parent, and one line of it (and any traceback) on the child's output."""
    path.write_text(json.dumps(rec, indent=1, default=str))
    print(json.dumps({k: v for k, v in rec.items() if k not in hide}, default=str), flush=True)
    if rec.get("traceback"):
        print(rec["traceback"], flush=True)


def slug(name: str) -> str:
    return name.replace("/", "_").replace("@", "_")


# ---- the parent ----

def child_env(**defaults) -> dict:
    """The environment of a variant's process: this checkout importable, unbuffered output, `defaults` unless set."""
    env = dict(os.environ)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    for key, value in defaults.items():
        env.setdefault(key, value)
    if torch.cuda.is_available():
        env.setdefault("DS_ACCELERATOR", "cuda")
    return env


def launch(cmd: list[str], env: dict, timeout_s: float, log, name: str) -> tuple[str, int | None, bool, float]:
    """Run one variant's process (its own session: torchrun's ranks included) until it ends or `timeout_s`
    passes, then kill its whole tree. Appends its output to `log`; returns (output, returncode, timed_out,
    wall seconds)."""
    t0 = time.monotonic()
    timed_out = False
    with tempfile.TemporaryFile("w+") as output:
        proc = subprocess.Popen(cmd, env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() - t0 > timeout_s:
                    timed_out = True
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:  # out of time (or interrupted): end the process and every rank it started
                _kill_tree(proc)
        output.seek(0)
        text = output.read()
    wall = time.monotonic() - t0
    log.write(f"===== {name} rc={'timeout' if timed_out else proc.returncode} wall={wall:.1f}s\n{text}\n")
    log.flush()
    return text, proc.returncode, timed_out, wall


def _kill_tree(proc):
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for p in children:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    psutil.wait_procs(children, timeout=30)


def time_guard(variants: list[dict], budget_s: float):
    """Yield (spec, seconds left, reason to skip or None) for each variant to consider, in order.

    A variant is skipped when its est_s no longer fits. Variants with the same "group" are compared with each
    other, so a group runs only if all of it fits when its first variant comes up; one skipped variant skips
    the rest of its group. A variant with "only_if_skipped" is a fallback, considered only when that group
    was skipped."""
    deadline = time.monotonic() + budget_s
    skipped, seen = set(), set()
    for i, spec in enumerate(variants):
        left = deadline - time.monotonic()
        group = spec.get("group")
        if spec.get("only_if_skipped") and spec["only_if_skipped"] not in skipped:
            continue  # a fallback whose first choice ran
        if group is not None and group not in skipped and group not in seen:
            if left < sum(v["est_s"] for v in variants[i:] if v.get("group") == group):
                skipped.add(group)
        if group is not None:
            seen.add(group)
        reason = None
        if group in skipped:
            reason = f"{left:.0f} s left < the {group} group's estimate"
        elif left < spec["est_s"]:
            reason = f"{left:.0f} s left < estimated {spec['est_s']} s"
        if reason and group is not None:
            skipped.add(group)
        yield spec, left, reason


def skipped(spec: dict, reason: str) -> dict:
    print(f"[skip] {spec['name']}: {reason}", flush=True)
    return dict(spec, status="skipped", reason=reason)


def short(r: dict, fields, error_chars: int) -> str:
    """One line of a record for the console: `fields` as (key, format), the error's last line cut short."""
    bits = []
    for key, fmt in (*fields, ("error", None)):
        if r.get(key) is not None:
            bits.append(fmt.format(r[key]) if key != "error" else r[key].splitlines()[-1][:error_chars])
    return " ".join(bits)


def cell(r: dict, key: str, fmt: str) -> str:
    value = r.get(key)
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def peak_cell(r: dict) -> str:
    """The step's peak, or the peak before a failure marked with *."""
    if r.get("peak_gb") is None and r.get("peak_gb_at_failure") is not None:
        return cell(r, "peak_gb_at_failure", ".1f") + "*"
    return cell(r, "peak_gb", ".1f")


def runner_args(doc: str, suites: dict, default_suite: str, budget_s: float, argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=sorted(suites), default=default_suite)
    p.add_argument("--smoke", action="store_true", help="the tiny CPU suite (same as --suite smoke)")
    p.add_argument("--only", nargs="*", help="run only these variant names")
    p.add_argument("--list", action="store_true", help="print the suite's variants (after --only) and exit")
    p.add_argument("--budget-s", type=float, default=budget_s, help="skip variants that no longer fit in this time")
    p.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.suite = "smoke" if args.smoke else args.suite
    args.variants = [v for v in suites[args.suite] if not args.only or v["name"] in args.only]
    return args


def list_variants(suite: str, variants: list[dict]) -> str:
    """The variants a run would consider, one line each (no process started, no device touched)."""
    lines = [f"suite {suite}: {len(variants)} variants"]
    for v in variants:
        extra = {k: x for k, x in v.items() if k not in ("name", "kind", "seq", "est_s", "shape")}
        lines.append(f"  {v['name']:26} {v['kind']:6} {v.get('shape', '-'):11} seq {v.get('seq', '-')!s:>8} "
                     f"est {v['est_s']:>4} s  {json.dumps(extra) if extra else ''}".rstrip())
    return "\n".join(lines)


def write_outputs(out: Path, suite: str, meta: dict, results: list[dict], table: str, *, extra=None, shown_meta=None):
    """results_<suite>.json (meta, `extra`, results) and table_<suite>.txt; prints the meta and the table."""
    (out / f"results_{suite}.json").write_text(
        json.dumps(dict(meta=meta, **(extra or {}), results=results), indent=1, default=str))
    (out / f"table_{suite}.txt").write_text(table + "\n")
    print(json.dumps(meta if shown_meta is None else shown_meta))
    print(table)
