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

import signal
import time

import torch
import torch.distributed as dist

LAUNCHERS = ("torch.distributed.run", "torchrun", "deepspeed", "accelerate", "mpirun")


class Stopped(Exception):
    """The run stopped at a step boundary as asked, its checkpoint written; `code` is the process's exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


class StopRequest:
    """What this process was asked: why, when, and the exit code that says it."""

    def __init__(self, grace_s: float):
        self.grace_s = grace_s
        self.reason: str | None = None
        self.code = 1
        self.at: float | None = None

    def request(self, reason: str, code: int) -> bool:
        """Remember a stop; False where one was asked already (a second signal: the caller ends the process)."""
        if self.reason is not None:
            return False
        self.reason, self.code, self.at = reason, code, time.monotonic()
        return True

    def overdue(self) -> bool:
        return self.at is not None and time.monotonic() - self.at > self.grace_s

    def agreed(self, layout, device) -> str | None:
        """Collective at a step boundary: this rank's reason, or another rank's stop, or None to go on."""
        flag = torch.tensor([0 if self.reason is None else self.code], device=device)
        if layout.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=layout.world_group)
        code = int(flag.item())
        if not code:
            return None
        if self.reason is None:
            self.request("another rank was asked to stop", code)
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
