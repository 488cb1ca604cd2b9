"""Throughput accounting (FLOPs per step, TFLOPS, MFU) and per-step logging for the training loop.

Symbols (shape.py's legend): s tokens in the sequence (one causal stream), h query heads, d head dim,
n_layers. "Matmul params" N are the weights that multiply activations once per token:
attention projections, MLP (for MoE: the router and the active experts only) and the LM head.
The input embedding is a lookup, not a matmul, and norms/biases are negligible; both are left out.
"""

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..mixers import fallbacks
from ..shape import ModelShape


@dataclass(frozen=True)
class FlopsPerStep:
    """FLOPs of one training step on one sequence of `tokens` tokens (all ranks together).

    model: what the step must compute (MFU counts these): dense 6*N*s + causal attention
        fwd 2*s^2*h*d*n_layers, bwd twice that (a sliding-window layer 4*(s*w - w^2/2)*h*d instead of 2*s^2*h*d).
    hardware: model + the activation-checkpoint recompute of each decoder layer's forward
        (layer matmuls 2*N_layers*s + attention fwd); equals model when recompute is off.
    effective: the ALST/Megatron "effective TFLOPS" convention, for comparison with the
        published ALST figures: 4.5 * 2*s^2*h*d*n_layers + 8 * N * s.
    attention_share: share of attention in `model`.
    """

    tokens: int
    matmul_params: int  # N, including the LM head
    layer_matmul_params: int  # N without the LM head: what checkpoint recompute runs again
    dense: float
    attention: float
    model: float
    hardware: float
    effective: float

    @property
    def attention_share(self) -> float:
        return self.attention / self.model


def matmul_params(config) -> tuple[int, int]:
    """(N_layers, N_lm_head): matmul weights used per token in the decoder layers and in the LM head
    (ModelShape.layer_matmul_params and head_matmul_params)."""
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    return shape.layer_matmul_params, shape.head_matmul_params


def model_flops_per_step(
    config, seq_len: int, *, recompute: bool = True, recompute_layers: int | None = None,
    cached_attention_layers: int = 0,
) -> FlopsPerStep:
    """FLOPs of one step on one causal sequence of `seq_len` tokens (see `FlopsPerStep`).

    dense     = 6 * N * s                       (fwd 2Ns, bwd 4Ns; N includes the LM head)
    attention = 3 * 2 * s^2 * h * d * n_layers  (fwd: QK^T and PV, 2 FLOPs per MAC each, over the
                                                 causal half s^2/2; bwd 2x fwd)
    model     = dense + attention
    hardware  = model + [recompute] (r/n_layers * 2 * N_layers * s + (r - c)/n_layers * 2 * s^2 * h * d * n_layers)
    effective = 4.5 * 2 * s^2 * h * d * n_layers + 8 * N * s   (ALST/Megatron convention)
    h counts query heads (GQA shares K/V but every query head does its own QK^T and PV). A sliding-window
    layer's s^2/2 pairs are s*w - w^2/2 (ModelShape.attention_pairs), so 2*s^2 above reads 4*(s*w - w^2/2) there;
    a gated DeltaNet layer has none, and its recurrence's O(s) FLOPs join the attention term
    (ModelShape.recurrence_flops; its backward counted 2x, as attention's).
    r = recompute_layers (default all) layers are recomputed; c = cached_attention_layers of them keep
    their attention output, so their recompute skips the attention forward (attention.py).
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)
    n_layers_params, n_head_params = shape.layer_matmul_params, shape.head_matmul_params
    n_params = n_layers_params + n_head_params
    tokens = seq_len
    attn_fwd = 4.0 * shape.attention_pairs(tokens) * shape.heads * shape.head_dim + shape.recurrence_flops(tokens)
    dense = 6.0 * n_params * tokens
    attention = 3.0 * attn_fwd
    model = dense + attention
    n_layers = shape.layers
    r = (n_layers if recompute_layers is None else recompute_layers) if recompute else 0
    if not 0 <= cached_attention_layers <= r <= n_layers:
        raise ValueError(f"need 0 <= cached_attention_layers={cached_attention_layers} <= recompute_layers={r} "
                         f"<= {n_layers} layers")
    hardware = model + (r * 2.0 * n_layers_params * tokens + (r - cached_attention_layers) * attn_fwd) / n_layers
    effective = 4.5 * attn_fwd + 8.0 * n_params * tokens
    return FlopsPerStep(tokens, n_params, n_layers_params, dense, attention, model, hardware, effective)


def mfu(tflops_per_gpu: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation as a fraction (0.659 for 65.9%); None without a peak."""
    if not peak_tflops:
        return None
    return tflops_per_gpu / peak_tflops


def measure_peak_bf16_tflops(device=None, n: int = 8192, iters: int = 20) -> float | None:
    """Measured bf16 matmul TFLOP/s of an n^3 product on a CUDA device (None on CPU).

    The ceiling MFU is reported against: a measured peak (778 on an H200) is reachable,
    unlike the datasheet's dense figure.
    """
    device = torch.device(device) if device is not None else None
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):  # cuBLAS heuristics and clocks settle in the first calls
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1000.0
    del a, b
    return 2.0 * n**3 * iters / seconds / 1e12


def host_memory_gb() -> tuple[float, float]:
    """(this process + its children RSS, node-wide used memory), in GB (1e9 bytes).

    The RSS sum counts pinned host buffers of activation/optimizer offload that this rank
    touched, and double-counts pages shared with children; node-wide "used" covers all local
    ranks, which is what runs out when every rank offloads to host.
    """
    import psutil

    proc = psutil.Process()
    rss = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            rss += child.memory_info().rss
        except psutil.Error:  # a child may exit between listing and reading
            pass
    return rss / 1e9, psutil.virtual_memory().used / 1e9


def _fmt(value, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"


def _step_of(line: str) -> int | None:
    """The step of one metrics.jsonl line; None for a line cut short (a kill mid-write)."""
    try:
        return json.loads(line).get("step", 0)
    except json.JSONDecodeError:
        return None


class StepLogger:
    """Per-step log: one human line (rank 0), one JSON line in `metrics.jsonl`, a tqdm bar, TensorBoard.

    Only `rank == 0` writes anything; other ranks may call `log` freely. Values are Python
    floats: the caller syncs devices once per step and passes the results.
    tokens_per_step: tokens of all sequences in one optimizer step (seq_len * data-parallel size).
    flops: FLOPs of the whole step (`model_flops_per_step` times the number of sequences); gives
        TFLOPS/GPU (model FLOPs / step time / world_size), MFU, and the hardware and ALST figures.
    peak_tflops: per-GPU ceiling for MFU, e.g. `measure_peak_bf16_tflops()`.
    GPU memory is `torch.cuda.max_memory_allocated` of this rank since the start (or since the
    caller last reset it); pass `gpu_mem_gb` to `log` to report another figure (e.g. max over ranks).
    start_step: the step the run continues from; lines past it in an existing `metrics.jsonl` go (each step once).
    """

    def __init__(
        self,
        output_dir,
        total_steps: int,
        *,
        tokens_per_step: int,
        world_size: int = 1,
        flops: FlopsPerStep | None = None,
        peak_tflops: float | None = None,
        rank: int = 0,
        start_step: int = 0,
        tensorboard: bool = False,
        progress: bool = True,
        stream=None,
    ):
        self.enabled = rank == 0
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.world_size = world_size
        self.flops = flops
        self.peak_tflops = peak_tflops
        self.stream = stream if stream is not None else sys.stdout
        self.output_dir = Path(output_dir)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self._bar = None
        self._tb = None
        if not self.enabled:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if self.jsonl_path.is_file():  # a run from step 0 in the folder of a start that stopped before its first
            self._drop_after(start_step)  # checkpoint (divergence.py's advice) begins the file anew
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError(
                    f"tensorboard logging was asked for but cannot be imported ({e}); "
                    "pip install tensorboard, or turn the flag off"
                ) from e
            self._tb = SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))
        if progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", desc="training", file=self.stream)

    def log(
        self,
        step: int,
        *,
        loss: float,
        step_time_s: float,
        grad_norm: float | None = None,
        lr: float | None = None,
        gpu_mem_gb: float | None = None,
        **extra: float,
    ) -> dict | None:
        """Record step `step` (1-based, as printed); returns the JSON record on rank 0, else None."""
        if not self.enabled:
            return None
        if gpu_mem_gb is None and torch.cuda.is_available():
            gpu_mem_gb = torch.cuda.max_memory_allocated() / 1e9
        host_rss_gb, host_used_gb = host_memory_gb()
        record = {
            "step": step,
            "total_steps": self.total_steps,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": self.tokens_per_step,
            "step_time_s": step_time_s,
            "tokens_per_s": self.tokens_per_step / step_time_s,
            "tflops_per_gpu": None,
            "hardware_tflops_per_gpu": None,
            "effective_tflops_per_gpu": None,
            "mfu": None,
            "gpu_mem_gb": gpu_mem_gb,
            "host_rss_gb": host_rss_gb,
            "host_used_gb": host_used_gb,
            "time": time.time(),
            # Kernels that refused a call of this step and the one that ran instead (fallbacks.py): [] normally.
            "kernel_fallbacks": [f.line() for f in fallbacks.unreported()],
            **extra,
        }
        if self.flops is not None:
            per_gpu = step_time_s * self.world_size * 1e12
            record["tflops_per_gpu"] = self.flops.model / per_gpu
            record["hardware_tflops_per_gpu"] = self.flops.hardware / per_gpu
            record["effective_tflops_per_gpu"] = self.flops.effective / per_gpu
            record["mfu"] = mfu(record["tflops_per_gpu"], self.peak_tflops)

        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        line = self.format_line(record)
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
            self._bar.update(1)
        else:
            print(line, file=self.stream, flush=True)
        if self._tb is not None:
            for name, value in record.items():
                if name not in ("step", "total_steps", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{name}", value, step)
            self._tb.flush()
        return record

    def log_eval(self, step: int, result) -> dict | None:
        """Record an evaluation after step `step` (0: before the first): its line, a metrics.jsonl record
        {"step", "time", "eval"}, TensorBoard scalars under eval/. result: an eval.EvalResult. Rank 0 only."""
        if not self.enabled:
            return None
        record = {"step": step, "time": time.time(), "eval": result.to_dict()}
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self._bar is not None:
            self._bar.write(result.line(step), file=self.stream)
        else:
            print(result.line(step), file=self.stream, flush=True)
        if self._tb is not None:
            for name, value in result.scalars().items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        return record

    def _drop_after(self, step: int) -> None:
        """A resumed run replays the steps after its checkpoint: the lines a killed run wrote for them go, so that
        metrics.jsonl holds each step once (the kept lines are rewritten through a new file, then renamed)."""
        lines = self.jsonl_path.read_text().splitlines(keepends=True)
        kept = [line for line in lines if _step_of(line) is not None and _step_of(line) <= step]
        if len(kept) != len(lines):
            tmp = self.jsonl_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept))
            tmp.replace(self.jsonl_path)

    @staticmethod
    def format_line(r: dict) -> str:
        """The human line, e.g. `step 3/10 | loss 4.3110 | ... | MFU 65.9% | gpu 56.2 GB | host 12.0 GB (node 120.4 GB)`;
        "-" where a figure does not apply (no TFLOPS, MFU or GPU memory without a GPU). Packed steps add the
        labels trained, the documents and the padding share; MoE steps with the router loss on its aux_loss."""
        parts = [
            f"step {r['step']}/{r['total_steps']}", f"loss {r['loss']:.4f}", f"grad_norm {_fmt(r['grad_norm'], '.2f')}",
            f"lr {_fmt(r['lr'], '.1e')}", f"tokens {r['tokens']:,}",
        ]
        if r.get("trained_tokens") is not None:
            parts.append(f"trained {r['trained_tokens']:,}")
        if r.get("documents", 1) > 1:
            parts.append(f"docs {r['documents']} (pad {100 * r.get('padding_share', 0.0):.1f}%)")
        if r.get("aux_loss") is not None:  # MoE: the routers' load-balancing loss, which `loss` holds x its coefficient
            parts.append(f"aux_loss {r['aux_loss']:.4f}")
        if r.get("reward_margin") is not None:  # preference training (train/preference_step.py)
            parts.append(f"margin {r['reward_margin']:.3f} (acc {r['reward_accuracy']:.2f})")
        parts += [
            f"{r['step_time_s']:.1f} s", f"{r['tokens_per_s']:,.0f} tok/s", f"TFLOPS/GPU {_fmt(r['tflops_per_gpu'], '.1f')}",
            f"MFU {_fmt(None if r['mfu'] is None else 100 * r['mfu'], '.1f', '%')}",
            f"gpu {_fmt(r['gpu_mem_gb'], '.1f', ' GB')}", f"host {r['host_rss_gb']:.1f} GB (node {r['host_used_gb']:.1f} GB)",
        ]
        if r.get("kernel_fallbacks"):
            parts.append(f"kernel fallback: {'; '.join(r['kernel_fallbacks'])}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
