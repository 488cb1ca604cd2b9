"""A stop asked of the run (SIGTERM, SIGINT, or its launcher's death) ends it at a step boundary, with a checkpoint.

A scheduler preempts or times out a job by SIGTERM (SLURM's `--signal=TERM@<s>` sends it ahead of the time limit);
Ctrl-C sends SIGINT to every process of the terminal's group; a launcher that is itself signalled forwards SIGTERM to
its ranks (torchrun all at once; DeepSpeed's launch.py one rank at a time) and SIGKILLs them 30 s later. Any one rank
asked is enough: the loop agrees at each step boundary (`StopRequest.agreed`, one all-reduce of one number), every
rank saves the step's checkpoint and train() raises `Stopped`, which the command line turns into one line and an
exit code of 128 + the signal. A launcher that ended without a signal to the ranks (SIGKILL, or DeepSpeed's runner,
which forwards nothing on one node) is seen by the failure watch within a second (`launcher_pids`) and asks the same.

The request is only remembered where it arrives (a signal handler, the watcher thread); the watcher ends the process
when no boundary and save came within the grace period (--stop-grace-s), so a rank never outlives its launcher by
more than that.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from .checkpoint_files import raise_first_failure

SIGNALS = (signal.SIGTERM, signal.SIGINT)
LAUNCHERS = ("torch.distributed.run", "torchrun", "deepspeed", "accelerate", "mpirun", "--nproc-per-node", "--nproc_per_node")


class Stopped(Exception):
    """The run stopped at a step boundary as asked, its checkpoint written; `code` is the process's exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StopRequest:
    """What this process was asked: why, when, and the exit code that says it."""

    def __init__(self, grace_s: float, announce: bool = False):
        self.grace_s, self.announce = grace_s, announce  # announce: say at once that the stop was heard (rank 0)
        self.reason: str | None = None
        self.code = 1
        self.at: float | None = None
        self.training = False  # set by the loop at its first step: before it, a stop ends the start-up instead

    def request(self, reason: str, code: int) -> bool:
        """Remember a stop; False where one was asked already (a repeat: launchers forward their group's signal)."""
        if self.reason is not None:
            return False
        self.reason, self.code, self.at = reason, code, time.monotonic()
        if self.announce:  # a step can take minutes: the user learns now that the signal was heard
            where = "at the end of this step with a checkpoint" if self.training else \
                "before training starts (at the start-up's next stage)"
            print(f"stopping: {reason}; the run stops {where}, or exits without one past --stop-grace-s "
                  f"{self.grace_s:g}", file=sys.stderr, flush=True)
        return True

    def overdue(self) -> bool:
        return self.at is not None and time.monotonic() - self.at > self.grace_s

    def overdue_line(self) -> str:
        if not self.training:
            return (f"stopped by {self.reason} before training started, but the start-up's stage (loading, "
                    f"tokenizing) did not end within --stop-grace-s {self.grace_s:g}: exits; nothing was trained")
        return (f"stopped by {self.reason}, but the step and its checkpoint did not end within --stop-grace-s "
                f"{self.grace_s:g}: exits without a new checkpoint (raise --stop-grace-s where a step and a save "
                "take longer)")

    def agreed(self, layout, device, failure: str | None = None) -> str | None:
        """Collective at a step boundary: this rank's reason, or another rank's stop, or None to go on. failure: this
        rank's write that failed in the step (metrics.jsonl, rank 0's), which every rank raises (SaveFailed)."""
        flag = torch.tensor([0 if self.reason is None else self.code, int(failure is not None)], device=device)
        if layout.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=layout.world_group)
        code, failed = flag.tolist()
        if failed:
            every = [failure]
            if layout.world_size > 1:
                every = [None] * layout.world_size
                dist.all_gather_object(every, failure, group=layout.world_group)
            raise_first_failure(every)
        if not code:
            return None
        every = [self.reason]  # once, at the stop: what each rank was asked, so every rank says the first one
        if layout.world_size > 1:
            every = [None] * layout.world_size
            dist.all_gather_object(every, self.reason, group=layout.world_group)
        first = next(r for r, reason in enumerate(every) if reason is not None)
        self.reason, self.code = every[first] + (f" (rank {first})" if layout.world_size > 1 else ""), code
        return self.reason


def signal_reason(signum: int) -> str:
    name = signal.Signals(signum).name
    return f"{name} (from the scheduler, the launcher or Ctrl-C: a preemption, a time limit, scancel)"


def launcher_pids() -> list[int]:
    """The launcher processes above this rank, nearest first (torchrun's agent; DeepSpeed's launch.py and its runner):
    the ranks stop when one of them ends. None where the rank was started by hand or by a test harness."""
    import psutil

    chain = []
    try:
        parent = psutil.Process().parent()
        while parent is not None and len(chain) < 3 and any(k in " ".join(parent.cmdline()) for k in LAUNCHERS):
            chain.append(parent.pid)
            parent = parent.parent()
    except psutil.Error:
        pass
    return chain


class SignalHook:
    """SIGTERM and SIGINT to a Python handler (on the main thread, when it runs Python) and a wake-up byte for a
    watcher thread (at once, even while the main thread waits in a collective). Only the main thread may arm it."""

    def __init__(self):
        self._wake = None  # (read fd, write fd) of the wake-up pipe
        self._previous = None  # (SIGTERM handler, SIGINT handler, wake-up fd) before arming

    def arm(self, handler) -> None:
        """handler(signum) on the main thread; elsewhere nothing is armed (wait() then only waits)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._wake = os.pipe()
        for fd in self._wake:
            os.set_blocking(fd, False)
        handlers = [signal.signal(s, lambda signum, frame: handler(signum)) for s in SIGNALS]
        self._previous = (*handlers, signal.set_wakeup_fd(self._wake[1], warn_on_full_buffer=False))

    def disarm(self) -> None:
        if self._previous is None or threading.current_thread() is not threading.main_thread():
            return
        *handlers, wakeup_fd = self._previous
        for s, handler in zip(SIGNALS, handlers):
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(wakeup_fd)
        for fd in self._wake:
            os.close(fd)
        self._previous = self._wake = None

    def wake(self) -> None:
        """End the watcher's wait() now (a zero byte, which no signal writes): a run's end then takes no poll's wait."""
        try:
            os.write(self._wake[1], b"\0")
        except (OSError, TypeError):  # not armed (wait() then waits on `halt`), or the pipe is full: a wake is due
            pass

    def wait(self, timeout: float, halt: threading.Event, *, wakes: bool = True) -> int | None:
        """Wait `timeout`, or less where a signal arrives first: the SIGTERM or SIGINT that came, else None. wake()
        ends the wait too, unless `wakes` is False (the linger before a quiet exit waits for a signal alone)."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                ready, _, _ = select.select([self._wake[0]], [], [], max(deadline - time.monotonic(), 0.0))
                got = os.read(self._wake[0], 512) if ready else b""
                signum = next((s for s in got if s in SIGNALS), None)  # the first to come: Ctrl-C, then a SIGTERM
                if signum or not ready or wakes:
                    return signum
        except (OSError, ValueError, TypeError):  # no pipe (not armed on the main thread), or closed by disarm()
            halt.wait(max(deadline - time.monotonic(), 0.0))
            return None
