"""Where the kernels a run tunes or compiles on its first step are kept for the next run (--kernel-cache), and whether
this run's are there already.

Three kinds of kernel cost time on a fresh machine (plan/first_step.py has the measured seconds):
  - fla-core's gated DeltaNet kernels autotune on first use (`triton.autotune(..., cache_results=True)`, on unless
    FLA_CACHE_RESULTS=0): Triton writes each kernel's winner to TRITON_CACHE_DIR as `<hash>/<kernel>.autotune.json`,
    the hash over Triton's version, the GPU's architecture, the kernel's source and its autotune key (fla's: heads,
    head dims, chunk size; never the length), beside the compiled kernels;
  - flex attention for the window layers compiles once per length (torch.compile), into TORCHINDUCTOR_CACHE_DIR
    (inductor's FX graph and AOTAutograd caches) and its Triton kernels into TRITON_CACHE_DIR;
  - FlashAttention-4 (kernel 'fa4') JIT-compiles its CuTe DSL kernels on first use, seconds per variant (full
    causal, each window, sinks), into FLASH_ATTENTION_CUTE_DSL_CACHE_DIR where FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED
    is 1 (flash-attn-4's cache_utils: off by default; the job turns it on unless you set it). flash-attn-4 reads both
    when `flash_attn.cute` is first imported, which the job does inside this block.
All default to folders of the home or /tmp that a fresh node lacks. The job points all into one folder: --kernel-cache,
default `kernel_cache/` beside the run folder (runs/kernel_cache beside runs/<model>-<time>), so a resume and later runs
of any model find what earlier ones built; a variable the user set is kept. Every rank computes the folder from the
same flags (same_flags.py compares them on every rank), so the ranks of a node share one copy. Across nodes the
folder is one where it lies on a shared file system (Triton and inductor write each file under a temporary name and
rename it, so ranks writing at once do not clash), else one copy per node, each filled by its node's first run;
files.folder_owner finds which and the start-up block says it.

Triton's files cannot be read for "is this run's kernel there" without building it, so the folder also holds
KERNELS_FILE: after a run's first step on a GPU, the folder's writer records what that step tuned or compiled (the
GPU, the versions, and per kind the shapes that key it); the next run's start-up block and step prediction read it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from ..plan.first_step import FIRST_STEP_S, WHAT
from .run_state import RUNS_DIR

KERNEL_CACHE_DIR = "kernel_cache"  # the default folder's name, beside the run folder
KERNELS_FILE = "kernels.json"
# The variable each compiler reads its cache folder from, and the subfolder of --kernel-cache it gets.
CACHE_VARS = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor",
              "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "fa4"}
# flash-attn-4 keeps its compiled kernels on disk only with this set to 1; the job sets it where unset.
FA4_CACHE_SWITCH = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"


def kernel_cache_dir(flag: str | None, run_folder: Path | None) -> Path:
    """The folder: --kernel-cache, else kernel_cache/ beside the run folder (runs/ for a new default run), absolute so
    that a rank's later change of directory keeps it."""
    if flag:
        return Path(flag).expanduser().absolute()
    return ((run_folder.parent if run_folder is not None else RUNS_DIR) / KERNEL_CACHE_DIR).absolute()


def cache_vars(folder: Path, environ=None) -> dict[str, tuple[str, str]]:
    """{variable: (path, "--kernel-cache" or "set by you")}: the user's value where set, else `folder`'s subfolder.
    Importing torch's compiler sets TORCHINDUCTOR_CACHE_DIR to its default when unset (torch._dynamo.package, torch
    2.13), and inductor's first Triton kernel sets TRITON_CACHE_DIR inside it: a value in torch's default folder
    counts as unset, since a process that compiled before (a notebook, a test) made no user's choice."""
    environ = os.environ if environ is None else environ
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    def yours(value: str | None) -> bool:
        return bool(value) and not Path(value).is_relative_to(default_cache_dir())

    return {var: (environ[var], "set by you") if yours(environ.get(var)) else (str(folder / sub), "--kernel-cache")
            for var, sub in CACHE_VARS.items()}


@contextlib.contextmanager
def cache_environment(folder: Path, environ=None):
    """Point Triton's, inductor's and flash-attn-4's caches into `folder` for the block, where the user has not set
    them (and flash-attn-4's switch on); yields cache_vars. Entered before anything compiles (the model's load probes
    fla's kernels); the variables are as they were afterwards. Triton and inductor read them at each use,
    flash-attn-4 at its import. A folder this block made and left without a file (a CPU run builds no kernel, yet
    torch makes inductor's folder) is removed again."""
    environ = os.environ if environ is None else environ
    before = {var: environ.get(var) for var in (*CACHE_VARS, FA4_CACHE_SWITCH)}
    existed = folder.exists()
    used = cache_vars(folder, environ)
    environ.update({var: path for var, (path, _) in used.items()})
    environ.setdefault(FA4_CACHE_SWITCH, "1")
    try:
        yield used
    finally:
        for var, value in before.items():
            if value is None:
                environ.pop(var, None)
            else:
                environ[var] = value
        if not existed:
            for parent, _, _ in sorted(os.walk(folder), reverse=True):  # the deepest first
                with contextlib.suppress(OSError):  # not empty: kernels were built; or another rank removed it
                    os.rmdir(parent)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "-"


def kernel_keys(kinds, shape, seq_len: int, sp_size: int) -> dict[str, str]:
    """{kind: what keys its tuning or compile}: the versions, and what one rank runs (fla: its gated DeltaNet heads and
    head dims, any length; flex: its attention heads, head dim, windows and the length)."""
    base = f"torch {_version('torch')}, Triton {_version('triton')}"
    windows = ", ".join(map(str, sorted({w for w in shape.layer_windows or () if w is not None})))
    keys = {}
    if "fla" in kinds:
        hk, hv, dk, dv = shape.linear_heads
        keys["fla"] = (f"fla-core {_version('fla-core')}, {base}: {max(hk // sp_size, 1)} key / {hv // sp_size} "
                       f"value heads of {dk} / {dv} per rank")
    if "fa4" in kinds:
        keys["fa4"] = (f"flash-attn-4 {_version('flash-attn-4')}, nvidia-cutlass-dsl {_version('nvidia-cutlass-dsl')}, "
                       f"torch {_version('torch')}: {shape.heads // sp_size} / {max(shape.kv_heads // sp_size, 1)} "
                       f"heads of {shape.head_dim} per rank"
                       + (f", windows {windows}" if windows else "")
                       + (" with sinks" if shape.sinks else ""))
    if "flex" in kinds:
        keys["flex"] = (f"{base}: {seq_len} tokens, {shape.heads // sp_size} heads of {shape.head_dim} per rank, "
                        f"windows {windows}{' with sinks' if shape.sinks else ''}")
    return keys


def read_entries(folder: Path) -> dict:
    try:
        return json.loads((folder / KERNELS_FILE).read_text())
    except (OSError, ValueError):  # none yet, or a file another tool broke: the kernels build again, and say so
        return {}


def cached(folder: Path, keys: dict[str, str], gpu: str | None) -> dict[str, str]:
    """{kind: where its entry came from} for the kinds of `keys` that KERNELS_FILE holds for this GPU (gpu None, the
    dry run: for any GPU)."""
    entries = read_entries(folder)
    found = {}
    for kind, key in keys.items():
        for entry in entries.get(kind, []):
            if entry.get("key") == key and (gpu is None or entry.get("gpu") == gpu):
                found[kind] = f"{entry.get('gpu')}, {entry.get('date')}"
                break
    return found


def record(folder: Path, keys: dict[str, str], gpu: str, first_step_s: float) -> None:
    """Add this run's kernels to KERNELS_FILE once its first step built them (the folder's writer only: files.py),
    through a temporary file and a rename, so a reader never sees half of it."""
    entries = read_entries(folder)
    date = time.strftime("%Y-%m-%d %H:%M")
    for kind, key in keys.items():
        kept = [e for e in entries.get(kind, []) if not (e.get("key") == key and e.get("gpu") == gpu)]
        entries[kind] = kept + [{"key": key, "gpu": gpu, "date": date, "first_step_s": round(first_step_s, 1)}]
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{KERNELS_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(entries, indent=1))
    os.replace(tmp, folder / KERNELS_FILE)


def kernels_line(folder: Path, keys: dict[str, str], found: dict[str, str], used: dict | None = None,
                 sharing: str | None = None) -> str:
    """The start-up block's line: where the cache is (and which variable the user set), who shares it, and for each
    kind of kernel this run tunes or compiles whether it is cached or what the first step adds for it."""
    where = str(folder)
    if used:
        yours = [f"{var}={path}" for var, (path, source) in used.items() if source == "set by you"]
        where += f" ({'; '.join(yours) + ' as you set' if yours else ', '.join(CACHE_VARS)}; " \
                 "--kernel-cache)"
    else:
        where += " (--kernel-cache)"
    if sharing:
        where += f", {sharing}"
    if not keys:
        return f"{where}: nothing of this model tunes or compiles on its first step"
    parts = []
    for kind in keys:
        if kind in found:
            parts.append(f"{WHAT[kind]} cached ({found[kind]})")
        else:
            parts.append(f"{WHAT[kind]} not cached: the first step adds about {FIRST_STEP_S[kind]:.0f} s")
    return f"{where}: " + "; ".join(parts)


@dataclass
class RunKernels:
    """A run's kernel cache: the folder, the variables it set, and what this run's first step tunes or compiles
    (`keys`, by kind) of which `found` are cached already; `writes`: this rank records them after the first step."""

    folder: Path
    used: dict
    keys: dict = field(default_factory=dict)
    found: dict = field(default_factory=dict)
    gpu: str | None = None
    writes: bool = False
    sharing: str | None = None

    @classmethod
    def build(cls, folder: Path, used: dict, shape, seq_len: int, deltanet: str, layout, device,
              kernel: str = "auto") -> "RunKernels":
        """What this run's step builds on first use (on a GPU; a CPU run tunes and compiles nothing) and which of it
        the folder holds (deltanet: the path the gated DeltaNet layers took, "fla" or "torch"; kernel: the attention
        kernel the model runs). Collective on a GPU (files.folder_owner: which nodes share the folder)."""
        if device.type != "cuda":
            return cls(folder, used)
        import torch

        from ..plan.first_step import kernel_kinds
        from .files import folder_owner

        keys = kernel_keys(kernel_kinds(shape, deltanet, seq_len, kernel), shape, seq_len, layout.sp_size)
        gpu = torch.cuda.get_device_name(device)
        owner = folder_owner(folder, layout)
        sharing = None if owner.num_nodes == 1 else (
            f"{owner.describe()}: on a node-local disk each node fills its own copy once" if owner.node_local
            else owner.describe())
        return cls(folder, used, keys, cached(folder, keys, gpu), gpu, owner.writes, sharing)

    @property
    def uncached(self) -> tuple[str, ...]:
        return tuple(kind for kind in self.keys if kind not in self.found)

    def line(self) -> str:
        return kernels_line(self.folder, self.keys, self.found, self.used, self.sharing)

    def first_step_done(self, seconds: float) -> None:
        """Record what the first step built (its writer only); the kinds count as cached from here on."""
        missing = {kind: self.keys[kind] for kind in self.uncached}
        if missing and self.writes:
            record(self.folder, missing, self.gpu, seconds)
        self.found.update({kind: "this run" for kind in missing})


__all__ = ["CACHE_VARS", "FA4_CACHE_SWITCH", "KERNELS_FILE", "RunKernels", "cache_environment", "cache_vars", "cached",
           "kernel_cache_dir", "kernel_keys", "kernels_line", "record"]
