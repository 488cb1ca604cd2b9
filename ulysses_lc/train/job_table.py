"""Who runs where, and one failure as every node prints it: the pieces of job_watch.py that need no thread.

  RankTable            host, node and pid of every global rank, gathered once at start (`gather`)
  Report               one failure: "error (rank 5 on node 1, host h): <message>", JSON on the job's store
  record_for_launcher  the text torchrun's closing summary ends with
  Heartbeats           rank 0's view of every node's heartbeat counter: a node whose counter stops is silent
  ends_last            whether DeepSpeed's launch.py ends this rank last, after its other lines
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass

import torch

from ..parallel.distributed import launcher_node_index, number_nodes


@dataclass(frozen=True)
class RankTable:
    """Host, node and pid of every global rank, gathered once at start."""

    hosts: tuple[str, ...]
    nodes: tuple[int, ...]
    pids: tuple[int, ...]
    rank: int

    @property
    def node(self) -> int:
        return self.nodes[self.rank]

    @property
    def num_nodes(self) -> int:
        return len(set(self.nodes))

    def on_node(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def local(self) -> list[int]:
        """Ranks on this rank's node whose pids this rank can see (the same host)."""
        return [r for r in self.on_node(self.node) if self.hosts[r] == self.hosts[self.rank]]

    def where(self, rank: int) -> str:
        return f"rank {rank} on node {self.nodes[rank]}, host {self.hosts[rank]}"

    def describe_node(self, node: int) -> str:
        ranks = self.on_node(node)
        if len(ranks) == 1:
            span = f"rank {ranks[0]}"
        elif ranks == list(range(ranks[0], ranks[-1] + 1)):
            span = f"ranks {ranks[0]}-{ranks[-1]}"
        else:
            span = f"ranks {', '.join(map(str, ranks))}"
        return f"node {node} (host {self.hosts[ranks[0]]}, {span})"

    @classmethod
    def from_entries(cls, entries: list[tuple[str, int | str | None, int]], rank: int) -> RankTable:
        """entries[r] = (host, the launcher's node index or None, pid). A node is a host and launcher index, numbered
        as the layout numbers them (distributed.number_nodes: by lowest rank), so reports and the start-up block
        name the same node numbers."""
        hosts = tuple(h for h, _, _ in entries)
        nodes = number_nodes([(h, n) for h, n, _ in entries])
        return cls(hosts, nodes, tuple(p for _, _, p in entries), rank)


@dataclass(frozen=True)
class Report:
    """One failure, as every node prints it: "error (rank 5 on node 1, host h): <message>"."""

    rank: int | None  # the rank it is about; None: a whole node
    node: int
    host: str
    pid: int | None
    message: str
    by: int  # the rank that published it

    def line(self) -> str:
        origin = f"rank {self.rank} on node {self.node}" if self.rank is not None else f"node {self.node}"
        return f"error ({origin}, host {self.host}): {self.message}"

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, raw: bytes) -> Report:
        return cls(**json.loads(raw))


class Heartbeats:
    """Rank 0's view of every node's heartbeat counter on the job's store (each node's leader adds one a poll)."""

    def __init__(self, table: RankTable, now: float):
        self.table = table
        self.seen = {n: (-1, now) for n in set(table.nodes)}  # node -> (counter, when it last moved)

    def silent(self, store, key, node_timeout_s: float) -> list[tuple[int, float]]:
        """Nodes whose counter has not moved for node_timeout_s, and for how long; never one whose leader finished
        its run. key(name): the store key of `name`."""
        nodes = sorted(n for n in self.seen if n != self.table.node)
        if not nodes:
            return []
        counts = store.multi_get([key(f"beat/{n}") for n in nodes])
        now, silent = time.monotonic(), []
        for node, raw in zip(nodes, counts):
            count, since = self.seen[node]
            if int(raw) != count:
                self.seen[node] = (int(raw), now)
            elif now - since > node_timeout_s:
                leader = min(self.table.on_node(node))
                if not store.check([key(f"done/{leader}")]):
                    silent.append((node, now - since))
        return silent

    def hint(self, after_s: float) -> str:
        """Rank 0, for a "lost contact" line: the node silent the longest, where one has been for after_s."""
        if self.table.rank != 0:
            return ""
        now = time.monotonic()
        quiet = [(now - since, n) for n, (_, since) in self.seen.items() if n != self.table.node]
        quiet_s, node = max(quiet, default=(0.0, None))
        if quiet_s < after_s:
            return ""
        return f"; {self.table.describe_node(node)} has sent no heartbeat for {quiet_s:.0f} s: it is down or unreachable"


def gather(extra) -> tuple[RankTable, list]:
    """Collective over the world: the rank table, and every rank's `extra` (picklable) in rank order."""
    entries = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(entries, (socket.gethostname(), launcher_node_index(), os.getpid(), extra))
    table = RankTable.from_entries([e[:3] for e in entries], torch.distributed.get_rank())
    return table, [e[3] for e in entries]


def single() -> RankTable:
    """The table of a job of one process."""
    return RankTable((socket.gethostname(),), (0,), (os.getpid(),), 0)


def record_for_launcher(text: str) -> None:
    """Write `text` where torchrun's closing summary reads the root cause (TORCHELASTIC_ERROR_FILE), so the summary,
    printed last, ends with the cause and its fix rather than a pointer to the docs. The file format is
    torch.distributed.elastic's error file ({"message": {"message", "extraInfo": {"py_callstack"}}})."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": text, "extraInfo": {"py_callstack": text, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass  # the report above already reached the user


def agent_hosts_store() -> bool:
    """torchrun's agent on node 0 hosts the store (it outlives the ranks); otherwise rank 0's process does."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def ends_last(table: RankTable, launchers: list[int] | None) -> bool:
    """Whether this rank is the last that DeepSpeed's launch.py ends (`launchers`: stop.launcher_pids at start). Once a
    rank exits non-zero, launch.py prints "Killing subprocess <pid>" for each of its ranks in local-rank order, SIGTERMs
    that rank and waits for it to exit before the next, then prints "<cmd> exits with return code = N" and exits. A
    line the last live rank prints as that SIGTERM ends it follows every "Killing" line of a live rank; only those of
    dead ranks later in the order and the exit code's come after it, and nothing of the job can print after those
    (their process has exited; launch.py's parent, the runner, exits at once)."""
    import psutil

    try:
        ours = bool(launchers) and "deepspeed.launcher.launch" in " ".join(psutil.Process(launchers[0]).cmdline())
    except psutil.Error:
        return False
    others = [r for r in table.local() if r != table.rank]  # alone, it has no line to follow: it ends first
    return ours and bool(others) and not any(alive(table.pids[r]) for r in others if r > table.rank)


def await_launch_py(table: RankTable, launchers: list[int], ended: list, settle_s: float, limit_s: float) -> None:
    """In the rank that DeepSpeed's launch.py ends last (ends_last), until its SIGTERM comes (`ended` gets an item then).
    launch.py ends the node's other ranks first, one by one, each waited for, and a rank's exit can take long (a large
    job's pinned host buffers and CUDA context; seconds on a loaded CPU): so this waits while launch.py and any of them
    live, then `settle_s` more (launch.py polls its ranks once a second), and never more than `limit_s` in all."""
    others = [r for r in table.local() if r != table.rank]
    start, settled = time.monotonic(), None  # settled: when the other ranks were all seen gone
    while not ended and time.monotonic() - start < limit_s and launchers and alive(launchers[0]):
        if any(alive(table.pids[r]) for r in others):
            settled = None
        elif settled is None:
            settled = time.monotonic()
        elif time.monotonic() - settled >= settle_s:
            return
        time.sleep(0.05)
