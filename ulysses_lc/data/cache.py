"""The on-disk token cache: one file of tokens plus a JSON meta file per key, built by one rank.

A rerun memory-maps the cache in seconds. One rank builds (each node's local rank 0, or one rank of the job where
its nodes share the folder: train/files.py); the other ranks wait for the meta file (written last) and then map
the same file. Builders of different jobs on one key take turns under a lock file beside the cache (flock), and
the second finds the first's cache complete.
"""

import contextlib
import fcntl
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .tokenize import TOKEN_DTYPE

# Bump when the cache layout or the joining/chunking rules change, so old caches are not reused.
CACHE_FORMAT_VERSION = 2  # 2: the meta holds the content chain of what the build read (content.py)
CACHE_DTYPE = TOKEN_DTYPE


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "ulysses_lc" / "tokens"


def digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]



@dataclass(frozen=True)
class CachePaths:
    folder: Path
    key: str

    @property
    def tokens(self) -> Path:
        return self.array("tokens")

    def array(self, name: str) -> Path:
        return self.folder / f"{self.key}.{name}"

    @property
    def meta(self) -> Path:  # written last: its presence marks a complete cache
        return self.folder / f"{self.key}.json"

    @property
    def error(self) -> Path:
        return self.folder / f"{self.key}.error"

    @property
    def lock(self) -> Path:
        return self.folder / f"{self.key}.lock"


@contextlib.contextmanager
def build_lock(paths: CachePaths):
    """Hold an exclusive flock on the key's lock file: one builder at a time across processes and, where the file
    system supports flock (local disks, NFSv4; Lustre mounted with -o flock), across nodes. Where it refuses
    flock the build goes on unlocked: the atomic writes keep a second builder's identical files safe."""
    with open(paths.lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            pass
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(f, fcntl.LOCK_UN)


def atomic_write(path: Path, write) -> None:
    # A unique temporary name + rename: readers never see a half-written file, and two nodes
    # building the same key on a shared filesystem both succeed with identical contents.
    tmp = path.with_name(f"{path.name}.tmp-{os.uname().nodename}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _array_specs(meta: dict) -> dict[str, tuple[np.dtype, int]]:
    # Caches written before labels and packing hold only the tokens array, described by the top-level fields.
    if "arrays" not in meta:
        return {"tokens": (CACHE_DTYPE, meta["num_tokens"])}
    return {name: (np.dtype(spec["dtype"]), spec["length"]) for name, spec in meta["arrays"].items()}


def cache_complete(paths: CachePaths) -> bool:
    if not paths.meta.exists():
        return False
    meta = json.loads(paths.meta.read_text())
    for name, (dtype, length) in _array_specs(meta).items():
        path = paths.array(name)
        if not path.exists() or path.stat().st_size != length * dtype.itemsize:
            return False
    return True


def build_or_reuse(paths: CachePaths, build, key_fields: dict) -> bool:
    """Build the cache unless a complete one exists; returns whether it existed (a hit).

    build: a callable returning (arrays, stats): named 1-D numpy arrays ("tokens" first) and a
        JSON-able dict recorded in the meta file.
    """
    dist = _initialized_dist()
    hit = False
    try:
        paths.folder.mkdir(parents=True, exist_ok=True)
        paths.error.unlink(missing_ok=True)
        with build_lock(paths):
            hit = cache_complete(paths)  # under the lock: another job's builder may have just finished it
            if not hit:
                _build(paths, build, key_fields)
    except BaseException as e:
        # Tell the waiting ranks, so they fail now instead of at their timeout.
        try:
            paths.error.write_text(f"{type(e).__name__}: {e}")
        except OSError:
            pass
        raise
    # Only on success: after a failure the waiting ranks read the error marker and fail on their own.
    if dist is not None:
        dist.barrier()
    return hit


def _build(paths: CachePaths, build, key_fields: dict) -> None:
    """Run `build` and write its arrays, then the meta file last (its presence marks the cache complete)."""
    started = time.time()
    arrays, stats = build()
    meta = {
        **key_fields,
        "key": paths.key,
        "dtype": CACHE_DTYPE.str,
        "num_tokens": int(len(arrays["tokens"])),
        "arrays": {name: {"dtype": a.dtype.str, "length": int(len(a))} for name, a in arrays.items()},
        "build_seconds": round(time.time() - started, 3),
        **stats,
    }
    for name, array in arrays.items():
        atomic_write(paths.array(name), lambda f, a=array: f.write(np.ascontiguousarray(a).tobytes()))
    atomic_write(paths.meta, lambda f: f.write(json.dumps(meta, indent=1).encode()))


def _initialized_dist():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed
    return None


def wait_for(paths: CachePaths, timeout_s: float, poll_s: float) -> None:
    # Poll the file rather than sit in a collective: tokenizing a large source can outlast the process
    # group's timeout (30 min under DeepSpeed), which would end in a watchdog error instead of this message.
    # The first looks come soon (a small source is tokenized in well under a second), then one every poll_s at most,
    # so that many ranks waiting on a shared file system do not load its metadata server.
    started, delay = time.time(), min(0.05, poll_s)
    while not cache_complete(paths):
        # An error marker from an earlier, unrelated failure is older than this wait; ignore it.
        if paths.error.exists() and paths.error.stat().st_mtime >= started - 300:
            raise RuntimeError(f"local rank 0 failed to build the token cache {paths.key}: {paths.error.read_text()}")
        if time.time() - started > timeout_s:
            raise RuntimeError(
                f"no complete token cache at {paths.meta} after {timeout_s:.0f} s; is local rank 0 building "
                "into the same cache_dir (on the same filesystem)?"
            )
        time.sleep(delay)
        delay = min(2 * delay, poll_s)
    dist = _initialized_dist()
    if dist is not None:
        dist.barrier()  # pairs with local rank 0's barrier after a successful build


def read_cache(paths: CachePaths) -> tuple[dict[str, np.ndarray], dict]:
    """The cached arrays (read-only memory maps) and the meta dict."""
    meta = json.loads(paths.meta.read_text())
    arrays = {}
    for name, (dtype, length) in _array_specs(meta).items():
        arrays[name] = np.memmap(paths.array(name), dtype=dtype, mode="r", shape=(length,)) if length else np.zeros(0, dtype)
    return arrays, meta
