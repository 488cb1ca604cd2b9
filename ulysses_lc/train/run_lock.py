"""One job writes a run folder: a lock held for the life of the run, by the rank that writes the folder's own files.

Two jobs on one --output-dir (a resubmitted job while the first still runs, two users, a copy-pasted script) would
interleave metrics.jsonl and mix one checkpoint's files with the other's. The folder's writer (files.folder_owner:
one rank per copy of the folder, so node-local disks each lock their own copy and a shared folder has one) takes an
exclusive flock on `.ulysses_lc-lock` before any work and holds it until train() ends; the kernel drops it when the
process dies however it dies, so a lock file nobody holds that still names a holder is a dead run's, and the next
run takes it over, saying whose it was (a run that ended empties the file). The file names the holder (host, pid,
start time) for the refusal of a second job.

flock reaches across nodes on NFS (through its lock manager) and Lustre mounted with -o flock; where the file
system refuses locks (ENOLCK, EOPNOTSUPP) the run goes on with a warning that nothing guards the folder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

LOCK = ".ulysses_lc-lock"

logger = logging.getLogger(__name__)


class FolderBusy(ValueError):
    """Another job holds the run folder's lock."""


class RunLock:
    """The exclusive lock of one run folder, held by this process until `release`."""

    def __init__(self, fd: int, path: Path, note: str | None, made: list[Path]):
        self.fd, self.path, self.note, self.made = fd, path, note, made

    @classmethod
    def acquire(cls, folder: Path) -> RunLock | None:
        """Lock `folder` for this process: FolderBusy naming the holder when another job has it; None where the file
        system takes no locks. `note` says when a dead run's lock was taken over."""
        made, missing = [], folder
        while not missing.exists():
            made.append(missing)
            missing = missing.parent
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(fd)
            os.close(fd)
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                logger.warning("%s: its file system takes no locks (%s): nothing stops a second job from writing to "
                               "this run folder at the same time", folder, os.strerror(e.errno))
                return None
            raise FolderBusy(f"{folder} is the run folder of another job that is still running ({_who(holder)}): two "
                             "jobs on one folder would mix their checkpoints and metrics. Wait for it to end, stop it, "
                             "or pass another --output-dir.") from None
        previous = _read(fd)
        note = (f"{folder}: took over the lock of a run that is no longer running ({_who(previous)}); its checkpoints "
                "stay as they were") if previous else None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}).encode(), 0)
        return cls(fd, path, note, made)

    def release(self) -> None:
        """The run ended: the file is emptied (a run that ended is no holder to name) and the lock dropped. The file
        stays (unlinked, a job that had opened it could lock the old file while a third locked a new one), except in
        a folder this lock made that holds nothing else (a run refused after the lock, before writing): that goes."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
            if self.made and [p.name for p in self.path.parent.iterdir()] == [LOCK]:
                self.path.unlink()
                for folder in self.made:  # deepest first
                    folder.rmdir()
        except OSError:
            pass  # something else was written there meanwhile: it stays
        finally:
            os.close(self.fd)  # closing drops the flock
            self.fd = None


def _read(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return None


def _who(holder: dict | None) -> str:
    if not holder:
        return "its lock file names no holder"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


@contextmanager
def hold_run_folder(folder: Path, writes: bool, layout):
    """Collective: this folder's writer takes the lock (`writes`: files.FolderOwner.writes); where any writer finds
    it held, every rank raises the same FolderBusy before any work. Held until the block ends."""
    lock, refusal = None, None
    if writes:
        try:
            lock = RunLock.acquire(folder)
        except FolderBusy as e:
            refusal = str(e)
    every = [None] * layout.world_size
    dist.all_gather_object(every, (refusal, lock.note if lock is not None else None), group=layout.world_group)
    refusals = [r for r, _ in every if r is not None]
    if refusals:
        if lock is not None:
            lock.release()
        raise FolderBusy(refusals[0])
    if layout.rank == 0:
        for note in dict.fromkeys(n for _, n in every if n is not None):  # one line per folder copy
            logger.info(note)
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()
