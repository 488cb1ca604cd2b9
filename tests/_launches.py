"""Jobs under a real launcher (torchrun, DeepSpeed's runner, accelerate, processes started by hand), side by side.

A launch on a two-core machine spends much of its wall time with one core idle: one process imports at a time (the
launcher, then launch.py), a launcher polls its ranks once a second, a failing or stopping rank waits out GRACE_S,
SETTLE_S or LINGER_S. A module's launches therefore start together, a few at a time (`Launches`), the first time
one of its tests asks for them, and each test waits for its own job and checks it as before. Only the jobs of the
tests pytest selected start (`-k one_test` pays for that test's jobs alone).
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest


class Job:
    """Started processes (one launcher per node, or one process per rank), their output drained as it comes (a full
    pipe would stall a rank), which a test can act on (`wait_for` a line, then signal or kill) and then `finish`."""

    def __init__(self, procs):
        self.procs = list(procs)
        self.lines = [[] for _ in self.procs]
        self.ended = [None] * len(self.procs)
        self.threads = [threading.Thread(target=self._drain, args=(i,), daemon=True) for i in range(len(self.procs))]
        for t in self.threads:
            t.start()

    def _drain(self, i):
        for line in self.procs[i].stdout:
            self.lines[i].append(line)
        self.procs[i].wait()
        self.ended[i] = time.monotonic()

    def wait_for(self, prefix: str, proc: int = 0, timeout: float = 300) -> None:
        """Until process `proc` prints a line starting with `prefix`; a hang guard ends the job otherwise."""
        deadline = time.monotonic() + timeout
        while not any(line.startswith(prefix) for line in list(self.lines[proc])):
            if time.monotonic() > deadline or self.ended[proc] is not None:
                self.kill()
                raise AssertionError(f"no line {prefix!r} from process {proc}:\n" + self.output(proc)[-4000:])
            time.sleep(0.2)

    def finish(self, timeout: float) -> None:
        """Until every process has ended and its output is read; past `timeout` (a hang guard) their trees are
        killed and the test fails with each one's output."""
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [i for i, p in enumerate(self.procs) if p.poll() is None]
        if hung:
            self.kill()
        for t in self.threads:
            t.join(30)
        assert not hung, f"process(es) {hung} still running after {timeout:.0f} s:\n" + "\n".join(
            f"--- process {i} ---\n{self.output(i)[-4000:]}" for i in range(len(self.procs)))

    def kill(self) -> None:
        from tests._nodes import _kill_tree

        for proc in self.procs:
            _kill_tree(proc)

    def output(self, proc: int = 0) -> str:
        return "".join(self.lines[proc])


class Launches:
    """Named jobs (functions of no arguments) run by `workers` threads; `launches[name]` waits for one and returns
    what it returned (or raises its error)."""

    def __init__(self, jobs: dict[str, Callable[[], Any]], workers: int):
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="launch")
        self._futures = {name: self._pool.submit(job) for name, job in jobs.items()}

    def __getitem__(self, name: str) -> Any:
        return self._futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def launches_fixture(jobs: dict[str, tuple[str, Callable]], workers: int):
    """A module-scoped fixture over `jobs` (name -> (the test that checks it, its function of a folder)): the first
    test that asks for it starts the jobs of every selected test of the module together."""

    @pytest.fixture(scope="module")
    def launches(request, tmp_path_factory):
        selected = {getattr(item, "originalname", item.name) for item in request.session.items
                    if item.module is request.module}
        # One empty folder a job, named after it (no spaces or dashes for a launcher to misread).
        folders = {name: tmp_path_factory.mktemp(re.sub(r"\W+", "_", name)) for name, (test, _) in jobs.items()
                   if test in selected}
        started = Launches({name: (lambda job=jobs[name][1], tmp=tmp: job(tmp)) for name, tmp in folders.items()},
                           workers)
        yield started
        started.close()

    return launches
