"""What makes a checkpoint good: finite values before it is written, and its files as written when it is read.

  finite_state(engine)      collective: True where every rank's optimizer state (fp32 weights, moments) is finite
  recording_files(engine)   context: the size and CRC-32 of each file this rank's engine writes, taken as it writes
  save_failure(...)         a failed write as the user can act on it: the folder, the bytes needed and free, the fix
  write_manifest(...)       the tag's manifest.json: every file of this folder's copy, its size and checksum
  verify(tag_dir, rank)     what is wrong with the files of one rank (or all) against the manifest, as lines

The manifest is written last, after every rank's files and before `latest` moves (run_state.save_checkpoint), so a
tag with a manifest is complete; on --resume each rank checks its own files (in parallel) and the ranks take the
newest checkpoint whose files all check (`choose_checkpoint`), saying which they passed over and why. A manifest
that cannot be read, or is missing where an older tag has one, makes its tag damaged; a tag older than any manifest
was saved before checkpoints had them, and is read unchecked.

The checksum: CRC-32 (zlib: 2.1 GB/s on one core of the 2-core CI machine, twice blake2b's and sha1's 1.0-1.1), taken
on the bytes as torch.save hands them to the file, so a save reads nothing back; each rank sums only its own shards
(an 8B model's 131 GB of ZeRO-3 state over 8 ranks: ~16 GB and ~8 s a rank, beside a write of the same 16 GB). It
guards against damage (a file cut short, a zeroed block, a copy gone wrong), not against an adversary.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

MANIFEST = "manifest.json"
_CHUNK = 16 << 20


def finite_state(engine) -> bool:
    """Collective: whether every rank's optimizer holds finite values only, its fp32 weights and moments both. A step
    whose loss and gradient norm were finite can still leave inf in them (an lr of inf, an overflow in the update):
    such a state is not saved, so a checkpoint named as the last good one never holds one."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO's wrapper holds the torch optimizer
    # ZeRO-3 hands its fp32 partitions to the torch optimizer only inside step(): its own list holds them.
    tensors = [*getattr(engine.optimizer, "fp32_partitioned_groups_flat", []),
               *(p for group in inner.param_groups for p in group["params"])]
    for state in inner.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v) and v.is_floating_point()]
    finite = all(bool(torch.isfinite(t).all()) for t in tensors)
    flag = torch.tensor([int(finite)], device=engine.device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class _Summing:
    """A file that sums what is written through it."""

    def __init__(self, f):
        self.f, self.crc, self.bytes = f, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.bytes += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


@contextmanager
def recording_files(engine, failed: list):
    """Within: each file `engine` saves goes through a summing file; yields {file name: [bytes, crc32]}. A write that
    fails (a full disk), or DeepSpeed's copy of its recovery scripts, is appended to `failed` as (path, OSError)
    instead of raised, so that this rank still meets the others in DeepSpeed's barrier after the files and every rank
    can stop with the cause (save_checkpoint). The engine and its checkpoint engine get their methods back on exit."""
    written = {}
    checkpoint_engine = engine.checkpoint_engine
    serialization = getattr(checkpoint_engine, "zipfile_serialization", True)

    def save(state_dict, path):
        if failed:
            return  # the disk refused a file already: the others would fail alike
        try:
            with open(path, "wb") as f:
                summing = _Summing(f)
                torch.save(state_dict, summing, _use_new_zipfile_serialization=serialization)
        except (OSError, RuntimeError) as e:
            cause = _os_error(e)
            if cause is None:
                raise
            failed.append((Path(path), cause))
            return
        written[Path(path).name] = [summing.bytes, summing.crc]

    copy_scripts = getattr(engine, "_copy_recovery_script", None)

    def copy(save_path):  # DeepSpeed's rank 0 copies zero_to_fp32.py beside the tags at each save: a write too
        if failed:
            return
        try:
            copy_scripts(save_path)
        except OSError as e:
            failed.append((copy_target(e, save_path), e))

    checkpoint_engine.save = save  # an attribute of this instance, over its class's method: deleted on exit
    if copy_scripts is not None:
        engine._copy_recovery_script = copy
    try:
        yield written
    finally:
        del checkpoint_engine.save
        if copy_scripts is not None:
            del engine._copy_recovery_script


def copy_target(error: OSError, save_path) -> Path:
    """The file a failed copy into `save_path` was writing. shutil's copy names its source in `filename` and its
    destination in `filename2` (a full disk fails the write, not the read): the one under `save_path`, else the
    script DeepSpeed copies there, so that the message names the checkpoint's folder, not DeepSpeed's install."""
    folder = Path(save_path).resolve()
    for name in (error.filename2, error.filename):
        if name and folder in Path(name).resolve().parents:
            return Path(name)
    return Path(save_path) / "zero_to_fp32.py"


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind a failed torch.save: torch's zip writer raises "unexpected pos" while closing a file whose
    write failed, with the OSError (ENOSPC) as its context."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


def state_bytes(engine) -> int:
    """The bytes of this rank's share of a checkpoint: its fp32 weights and optimizer moments (the model_states
    file beside them is small under ZeRO-3)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    tensors = [*getattr(engine.optimizer, "fp32_partitioned_groups_flat", []),
               *(p for group in inner.param_groups for p in group["params"])]
    for state in inner.state.values():
        tensors += [v for v in state.values() if torch.is_tensor(v)]
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())


def file_sum(path: Path) -> tuple[int, int]:
    """(bytes, crc32) of a file, read in 16 MiB chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return size, crc


def write_manifest(tag_dir: Path, every: list[dict]) -> None:
    """The manifest of this folder's copy of a tag: every[r] is rank r's written files ({name: [bytes, crc32]}); the
    files of other nodes' ranks, absent from a node-local copy, are left out; any file no rank wrote through the
    engine (DeepSpeed's zero_to_fp32.py) is summed by reading it. Written through a temporary file and renamed."""
    files = {name: {"rank": rank, "bytes": size, "crc32": f"{crc:08x}"}
             for rank, written in enumerate(every) for name, (size, crc) in written.items()
             if (tag_dir / name).is_file()}
    for path in sorted(tag_dir.iterdir()):
        if path.is_file() and path.name not in files and path.name != MANIFEST and not path.name.startswith("."):
            size, crc = file_sum(path)
            files[path.name] = {"rank": None, "bytes": size, "crc32": f"{crc:08x}"}
    tmp = tag_dir / f".{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tag_dir / MANIFEST)


def read_manifest(tag_dir: Path) -> dict | None:
    """The tag's {file: {rank, bytes, crc32}}, or None for a tag saved before checkpoints had manifests. ValueError
    naming the manifest where it cannot be read, or is missing from a tag newer than one that has one."""
    path = tag_dir / MANIFEST
    if not path.is_file():
        step = tag_dir.name.removeprefix("step")
        older = [s for s in _steps(tag_dir.parent) if step.isdigit() and s < int(step)
                 and (tag_dir.parent / f"step{s}" / MANIFEST).is_file()]
        if older:
            raise ValueError(f"{path}: missing, while the older step{older[-1]} has one (deleted, or left out of a "
                             "copy): its files cannot be checked")
        return None
    try:
        return json.loads(path.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: cannot be read ({type(e).__name__}: {e}; cut short or overwritten)") from None


def verify(tag_dir: Path, names=None) -> list[str]:
    """What is wrong with `names` of the tag (default: every file its manifest lists), one line each: the file,
    what the manifest expects and what is there. [] when all check, or when the tag has no manifest."""
    try:
        manifest = read_manifest(tag_dir)
    except ValueError as e:
        return [str(e)]
    if manifest is None:
        return []
    problems = []
    for name in sorted(manifest if names is None else names):
        want = manifest.get(name)
        path = tag_dir / name
        if want is None:
            problems.append(f"{path}: not in its manifest (the save was cut short, or the file was copied in later)")
        elif not path.is_file():
            problems.append(f"{path}: missing; the manifest lists {want['bytes']:,} bytes")
        elif path.stat().st_size != want["bytes"]:
            problems.append(f"{path}: {path.stat().st_size:,} bytes, the manifest says {want['bytes']:,} (cut short "
                            "or overwritten)")
        else:
            found = f"{file_sum(path)[1]:08x}"
            if found != want["crc32"]:
                problems.append(f"{path}: CRC-32 {found}, the manifest says {want['crc32']} (its bytes changed after "
                                "the save: a damaged disk or copy)")
    return problems


def own_files(tag_dir: Path, rank: int) -> list[str] | None:
    """The files of `rank` the tag's manifest lists (None: no manifest)."""
    try:
        manifest = read_manifest(tag_dir)
    except ValueError:
        return []  # verify says what is wrong with it
    return None if manifest is None else [n for n, e in manifest.items() if e["rank"] == rank]


def choose_checkpoint(ckpt_dir: Path, latest: str, layout, *, every_file: bool = False) -> tuple[str, list[str]]:
    """Collective: the newest checkpoint up to `latest` whose files check against their manifest, and the lines that
    say why it is not `latest` where it is not. Each rank checks its own files (same world size: the newest every
    rank holds its files of, files.agree_on_checkpoint), or a share of all of them (every_file: a resharded resume
    reads every old rank's). ValueError naming what is wrong when none checks."""
    from .files import agree_on_checkpoint

    passed, newest = [], latest
    while True:
        if every_file:
            tag, note = newest, None
        else:
            try:
                tag, note = agree_on_checkpoint(ckpt_dir, newest, layout)
            except ValueError:
                if not passed:
                    raise
                break
        tag_dir = ckpt_dir / tag
        if every_file:
            try:
                manifest = read_manifest(tag_dir)
            except ValueError:
                manifest = {}  # verify says what is wrong with it
            names = None if manifest is None else sorted(manifest)[layout.rank::layout.world_size]
        else:
            names = own_files(tag_dir, layout.rank)
        problems = verify(tag_dir, names) if names is not None else []
        every = [None] * layout.world_size
        dist.all_gather_object(every, problems, group=layout.world_group)
        bad = list(dict.fromkeys(p for ps in every for p in ps))  # a manifest's own damage: once, not once a rank
        if not bad:
            lines = [note] if note else []
            if passed:
                lines.append(f"resuming from {tag}, the newest checkpoint whose files check against its manifest; "
                             + "; ".join(f"{t} is damaged: {p}" for t, p in passed))
            return tag, lines
        passed.append((tag, bad[0] + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")))
        older = [s for s in _steps(ckpt_dir) if s < int(tag.removeprefix("step"))]
        if not older:
            break
        newest = f"step{max(older)}"
    raise ValueError(f"--resume: no checkpoint in {ckpt_dir} checks against its manifest ("
                     + "; ".join(f"{t}: {p}" for t, p in passed) + "); restore the files from a copy, or start a new "
                     "run (another --output-dir, or drop --resume).")


def _steps(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name[4:]) for p in Path(ckpt_dir).glob("step*") if p.is_dir() and p.name[4:].isdigit())


class SaveFailed(OSError):
    """A file of the run (a checkpoint, metrics.jsonl, run.json) could not be written (a full disk, a read-only file
    system, a quota): the message names the file and folder and the fix; the previous checkpoint is intact."""


def raise_first_failure(failures: list[str | None]) -> None:
    """Every rank raises SaveFailed with the first failing rank's cause, where any rank's write failed (`failures`: one
    per rank, gathered)."""
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if failed:
        rank, failure = failed[0]
        others = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
        raise SaveFailed(failure + (f" (rank {rank}{others})" if len(failures) > 1 else ""))


def agree_on_write(failure: str | None) -> None:
    """Collective after a write only some ranks make (run.json: one a folder): every rank stops with its cause."""
    every = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, failure)
    raise_first_failure(every)


def write_failure(path: Path, error: OSError, previous: str | None) -> str:
    """The line for a run file the disk refused (metrics.jsonl, run.json): which, where, why, and what is kept."""
    existing = path.parent
    while not existing.exists():
        existing = existing.parent
    kept = f"the checkpoint {previous} is intact: --resume continues from it" if previous else "no checkpoint exists yet"
    return (f"writing {path.name} in {path.parent} failed: {_CAUSES.get(error.errno, f'the write failed ({error})')}; "
            f"{human_bytes(shutil.disk_usage(existing).free)} is free there. To go on, free space there or pass "
            f"another --output-dir; {kept}.")


_CAUSES = {
    errno.ENOSPC: "its file system is full (ENOSPC)",
    errno.EDQUOT: "the disk quota there is used up (EDQUOT; `quota -s` shows it)",
    errno.EROFS: "its file system is read-only (EROFS: mounted read-only, or remounted so after a disk error)",
    errno.EACCES: "this user may not write there (EACCES)",
    errno.EPERM: "this user may not write there (EPERM)",
}


def save_failure(path: Path, error: OSError, *, rank_bytes: int, world_size: int, previous: str | None,
                 keep: int) -> str:
    """The line for a checkpoint write that failed: what failed where, the bytes this rank and the whole
    checkpoint need against those free, and what to do."""
    folder = path.parent
    existing = folder
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    cause = _CAUSES.get(error.errno, f"the write failed ({error})")
    total = rank_bytes * world_size
    elsewhere = "pass a folder this user can write to"
    fix = {errno.EROFS: "remount it read-write or pass another --output-dir", errno.EACCES: elsewhere,
           errno.EPERM: elsewhere}.get(
        error.errno, f"free {human_bytes(max(0, total - free))} or more there"
        + (f", lower --keep-checkpoints (now {keep})" if keep != 1 else "") + ", or pass another --output-dir")
    kept = (f"the previous checkpoint {previous} is intact: --resume continues from it" if previous
            else "no earlier checkpoint exists")
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    return (f"saving the checkpoint in {folder} failed at {path.name}: {cause}. Each rank writes about "
            f"{human_bytes(rank_bytes)} (fp32 weights and optimizer moments), the checkpoint about "
            f"{human_bytes(total)} over {ranks}; {human_bytes(free)} is free there. To go on, {fix}; {kept}.")


def human_bytes(n: float) -> str:
    """1.4 MB, 16.2 GB: three figures in the largest unit that fits."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n} bytes"
