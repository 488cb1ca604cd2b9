"""A rank that fails on any node ends every rank of the job within seconds, and its cause is printed last on global
rank 0's console (where the user looks) as well as on the node where it happened (issue 20).

Why: launchers end the ranks of *their* node when one fails, nothing more (node 0 waited 30 min in NCCL for a failed
node 1). Every rank has the default group's store (a TCPStore, in node 0's torchrun agent or rank 0): reports use it.

Contract (in a job of one process only the stop is watched: signals, the launcher's end, the grace period):
  start(failure, ...)  collective, right after the process group starts: gathers each rank's host, node, pid and
                       preflight outcome; where any rank's checks failed (a file on node 0's disk only), every rank
                       raises the same CheckFailed naming the first failing rank. Otherwise arms the watcher.
  JobWatch.stop(clean) at the end of train(): clean marks this rank done on the store (its exit is no fault);
                       restores the signals, except in a failing rank of many (cli's report decides then).
  publish(message)     a failing rank's report (rank, node, host, pid, message) on the store; the first one wins.
  await_cause(timeout) a rank that lost a peer runs the watcher's checks until one finds the cause and ends the
                       process, or `timeout` passes (the caller then says "lost contact").
  speaks_for_node()    whether this rank prints for its node: rank 0 on node 0, the lowest rank elsewhere.

The watcher, one daemon thread per rank waking once a second (POLL_S), off the step's path:
  - every rank checks its node's peers' pids (psutil reads /proc). A peer gone without a report (SIGKILL, the OOM
    killer): the lowest live rank of the node publishes "rank 5 (pid N on host h) exited without a report: ..."; rank
    0's node peers read its report too where its process holds the store, to tell its own failure from a SIGKILL.
  - SIGTERM and SIGINT wake the thread through signal.set_wakeup_fd, even while the main thread waits in a collective.
    Launchers send SIGTERM to the siblings of a rank that died (torchrun within 0.1 s, before any poll could see the
    death), so a sibling checks the pids then, reports, and exits. Otherwise it is a stop asked of the run (stop.py),
    as the launcher's death seen by a poll is: for the loop's next step boundary, ended here past the grace period.
  - only each node's lowest rank (its leader) talks to the store: it reads the report key and adds one to its node's
    heartbeat counter; rank 0 also reads every node's counter in one multi_get (2 requests a second per node).
  - a report from another node: the node's leader prints it as its last line, records it for the launcher's summary
    and exits 1 (the launcher ends the node's other ranks). A report from this node is printed by its reporter.
  - a node whose counter stays still for node_timeout_s (no rank left to report: power, network): rank 0 reports it.
  - the store gone: node 0's torchrun agent ended (its ranks may live on): a stop asked of the run, as above; rank 0,
    where its process held it: the leader says so after SETTLE_S (a report of its own node prints first), and exits.
    A store that hangs instead (a network partition) blocks the thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import torch

from .job_table import (Heartbeats, RankTable, Report, agent_hosts_store, alive, ends_last, gather,
                        record_for_launcher, single)
from .stop import SignalHook, StopRequest, launcher_pids, signal_reason

POLL_S = 1.0
GRACE_S = 3.0  # a failing rank other than its node's speaker prints after this (cli.py): its launcher may end it first
SETTLE_S = GRACE_S + 3.0  # a rank that knows no cause yet waits this long for one of its node's to be printed
LINGER_S = 2.0  # a rank that ends quietly waits this long, so that its node's speaker exits (and is named) first

_current: JobWatch | None = None  # the watch of the running train() or the last one: cli's failure report reads it
_ending = threading.Lock()  # held by whichever thread ends the process, so one report is printed
_ending_own_failure = False  # True while cli reports this rank's own failure: a SIGTERM then ends the rank at once


def start(failure: BaseException | None, *, node_timeout_s: float, stop_grace_s: float = 25.0) -> JobWatch:
    """Agree on every rank's checks and arm the watcher (collective; call on every rank once the group is up).

    failure: this rank's preflight exception, or None; when any rank has one, every rank raises (preflight.
    raise_agreed). node_timeout_s, stop_grace_s: TrainConfig's."""
    from .preflight import outcome, raise_agreed

    global _current
    if _current is not None:
        _current.signals.disarm()  # a train() before this one that failed kept its signal hooks
    if torch.distributed.get_world_size() == 1:
        if failure is not None:
            raise failure
        _current = JobWatch(single(), None, "", node_timeout_s, stop_grace_s)
        _current._arm()  # no peers, no store: a stop asked (a signal, the launcher's end) and its grace period
        return _current
    table, extras = gather((uuid.uuid4().hex[:12], outcome(failure)))
    if any(o is not None for _, o in extras):
        _current = JobWatch(table, None, "", node_timeout_s, stop_grace_s)  # no thread: who speaks for the node
        raise_agreed(failure, [o for _, o in extras], table)
    store = torch.distributed.distributed_c10d._get_default_store()
    _current = JobWatch(table, store, f"ulysses_lc/job_watch/{extras[0][0]}/", node_timeout_s, stop_grace_s)
    _current._arm()
    return _current


def publish(message: str) -> bool:
    """Put this rank's failure on the store for every node to print; True when it is the job's first report."""
    watch = _current
    if watch is None or watch.store is None:
        return False
    t = watch.table
    report = Report(t.rank, t.node, t.hosts[t.rank], t.pids[t.rank], message, by=t.rank)
    first = watch._publish(report) == report
    watch._let_other_nodes_read()
    return first


def claim_own_failure() -> None:
    """This rank reports its own failure (cli.py): the watcher stays quiet, a SIGTERM ends the rank as by default."""
    global _ending_own_failure
    _ending.acquire(blocking=False)
    _ending_own_failure = True


def speaks_for_node() -> bool:
    """Whether this rank prints failures for its node: rank 0 on node 0, the lowest rank on each other node."""
    # Fixed at start, not the lowest live rank: a leader that printed and exited leaves the others quiet.
    return _current.leader if _current is not None else int(os.environ.get("RANK", "0")) == 0


def ends_last_rank() -> tuple[RankTable, list[int]] | None:
    """Where DeepSpeed's launch.py ends this rank last (a line it prints then follows launch.py's), the arguments of
    job_table.await_launch_py: this rank's table and launchers. None otherwise."""
    return (_current.table, _current._chain) if _current and ends_last(_current.table, _current._chain) else None


def where(rank: int) -> str:
    """How a report names this rank: with its node and host where the job spans nodes."""
    return _current.table.where(rank) if _current is not None and _current.table.num_nodes > 1 else f"rank {rank}"


def await_cause(timeout: float) -> str:
    """Run the watcher's checks until one finds the cause of a lost peer (and ends the process); after `timeout`,
    return what is known: a hint naming a silent node, or ""."""
    watch = _current
    if watch is None or watch.store is None:
        time.sleep(timeout)
        return ""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        watch._poll()
        time.sleep(POLL_S)
    lost = watch._store_lost_at is not None and agent_hosts_store()
    return f"; the job's store at {_store_address()} (node 0's launcher) is gone too: node 0 ended or is unreachable" \
        if lost else watch._beats.hint(3 * POLL_S)


def _store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"


class JobWatch:
    """The armed watch of one train() call: its rank table, the store, and the watcher thread."""

    def __init__(self, table: RankTable, store, prefix: str, node_timeout_s: float, stop_grace_s: float = 25.0):
        self.table, self.store, self.prefix, self.node_timeout_s = table, store, prefix, node_timeout_s
        self.leader = table.rank == min(table.on_node(table.node))
        self.stop_request, self._launchers = StopRequest(stop_grace_s, announce=self.leader), []  # stop.py
        self._chain = []  # the launchers above this rank (stop.launcher_pids; _launchers: None once one ended)
        self._halt = threading.Event()
        self._clean = False  # stopped at the normal end of the run: nothing may end the process from the thread
        self._thread = None
        self.signals = SignalHook()  # SIGTERM and SIGINT: a handler and the watcher's wake-up pipe (stop.py)
        self._store_lost_at = None  # monotonic time of the first failed store request
        self._own_node_report = None  # (report, monotonic time first seen): its reporter prints it
        now = time.monotonic()
        self._beats = Heartbeats(table, now)  # rank 0's: every node's counter, when it last moved

    def stop(self, clean: bool) -> None:
        """End the watch. clean: the run ended normally on this rank, so its exit is no fault."""
        if self._thread is None:  # never armed (a failed agreement)
            return
        self._clean = clean
        self._halt.set()
        self.signals.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * POLL_S)
        if self.store is not None:  # one process: no peer to report to, so a failing run keeps no hook either
            if not clean:
                return
            try:
                if self._store_lost_at is None:  # a store known gone is not asked again (it prints C++ frames)
                    self.store.set(self._key(f"done/{self.table.rank}"), "1")
            except Exception:  # noqa: BLE001 - a store gone at the end of a clean run: nobody is left to be misled
                pass
        self.signals.disarm()

    # -- arming ------------------------------------------------------------------------------------------------

    def _arm(self) -> None:
        if self.table.rank == 0 and self.store is not None:  # every node's counter exists before rank 0 reads them
            for node in self._beats.seen:
                self.store.add(self._key(f"beat/{node}"), 0)
        self.signals.arm(lambda signum: self._on_signal(signum, watcher=False))
        self._launchers = self._chain = launcher_pids()
        self._thread = threading.Thread(target=self._run, name="ulysses-job-watch", daemon=True)
        self._thread.start()

    # -- the thread --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._halt.is_set():
            signum = self.signals.wait(POLL_S, self._halt)
            if signum:
                self._on_signal(signum, watcher=True)
            if not self._halt.is_set():
                self._poll()

    def _poll(self) -> None:
        """One round of checks; ends the process when one finds a failure, or a stop asked is overdue."""
        ended = [pid for pid in self._launchers or [] if not alive(pid)]
        if ended:  # the ranks never outlive their launcher
            self._launchers = None  # ended
            t = self.table
            on = f" on node {t.node}, host {t.hosts[t.rank]}" if t.num_nodes > 1 else ""
            self.stop_request.request(f"its launcher (pid {ended[0]}{on}) ended", 1)
        if self.stop_request.overdue():  # published, so that other nodes' ranks, maybe waiting on this one, end too
            first = self._publish(self._report(self.table.rank, self.stop_request.overdue_line()))
            self._end(first, speak=first.by == self.table.rank, code=self.stop_request.code)
        if self.store is None:  # one process: nothing else to watch
            return
        gone = self._gone_peers()
        if gone:
            self._report_gone(gone)
        if not self.leader or self._store_lost_at is not None:
            self._read_rank0s_report()
            self._after_store_lost()
            return
        try:
            self.store.add(self._key(f"beat/{self.table.node}"), 1)
            report = self._read_report()
            silent = self._silent_nodes() if self.table.rank == 0 else []
        except Exception:  # noqa: BLE001 - DistNetworkError and kin: the store's host ended
            self._store_lost_at = time.monotonic()
            return
        if report is None and silent:
            node, quiet_s = silent[0]
            first = self._publish(self._report(
                None, f"{self.table.describe_node(node)} has sent no heartbeat for {quiet_s:.0f} s, and none of its "
                f"ranks reported a failure: the node is down, unreachable, or its processes are frozen (raise "
                f"--node-timeout-s, now {self.node_timeout_s:g}, if they can be busy that long without a thread "
                f"running)", node=node))
            if first.by == self.table.rank:
                self._end(first, speak=True)
            report = first
        if report is not None:
            self._on_report(report)

    def _on_report(self, report: Report) -> None:
        t = self.table
        if report.by == t.rank:
            return  # this rank's own failure, which cli reports
        if report.node != t.node:
            self._end(report, speak=self.leader)
        elif self._own_node_report is None:
            self._own_node_report = (report, time.monotonic())  # its reporter prints it; the launcher ends this rank
        elif time.monotonic() - self._own_node_report[1] > SETTLE_S:
            self._end(report, speak=False)  # its reporter should have ended this node by now

    def _after_store_lost(self) -> None:
        if self._store_lost_at is None or self._launchers is None:  # the launcher ended (torchrun's: with the store);
            return  # the stop needs neither
        if agent_hosts_store():  # node 0's torchrun agent ended, its ranks maybe not: a stop, saved at the boundary
            self.stop_request.request(f"the job's store at {_store_address()} is gone: node 0's launcher (torchrun's "
                                      "agent, which holds it) ended, or node 0 is unreachable", 1)
            return
        if time.monotonic() - self._store_lost_at < SETTLE_S:
            return
        if self._own_node_report is not None:  # printed by its reporter; the launcher has not ended this rank
            self._end(self._own_node_report[0], speak=False)
        self._end(self._report(self.table.rank, f"lost the job's store at {_store_address()}: its host (rank 0) "
                                                f"ended, so every rank stops; the cause is on node 0's console"),
                  speak=self.leader)

    # -- checks ------------------------------------------------------------------------------------------------

    def _gone_peers(self) -> list[int]:
        gone = [r for r in self.table.local() if r != self.table.rank and not alive(self.table.pids[r])]
        if 0 in gone and not agent_hosts_store():  # the store lived in rank 0's process: touching it only warns
            self._store_lost_at = self._store_lost_at or time.monotonic()
        if not gone or self.store is None or self._store_lost_at is not None:
            return gone
        try:  # a peer that ended its run cleanly (train() returned) is no fault
            return [r for r in gone if not self.store.check([self._key(f"done/{r}")])]
        except Exception:  # noqa: BLE001 - no store: what the pids say
            self._store_lost_at = time.monotonic()
            return gone

    def _report_gone(self, gone: list[int], ended_by: int | None = None) -> None:
        """The lowest live rank of the node reports a peer that exited without a report (ended_by: see `_end`)."""
        t = self.table
        if t.rank != min(r for r in t.local() if r not in gone):
            return  # another rank of this node reports it
        known = self._known_report()  # reported (maybe by the peer), or node 0 ended, printed there; rank 0 gone
        if known is not None or (self._store_lost_at is not None and 0 not in gone):  # here is this rank's to name
            self._end(known, speak=False, ended_by=ended_by)
        r = gone[0]
        also = f" (and {', '.join(f'rank {g}' for g in gone[1:])})" if len(gone) > 1 else ""
        first = self._publish(self._report(
            r, f"rank {r} (pid {t.pids[r]} on host {t.hosts[r]}){also} exited without a report: killed by a signal "
               f"(SIGKILL), or by the kernel's out-of-memory killer (`dmesg | grep -i 'killed process'` on "
               f"{t.hosts[r]} says which)?"))
        self._end(first, speak=first.by == t.rank, ended_by=ended_by)

    def _silent_nodes(self) -> list[tuple[int, float]]:
        """Rank 0: nodes whose heartbeat counter has not moved for node_timeout_s, and for how long."""
        return self._beats.silent(self.store, self._key, self.node_timeout_s)

    # -- the store ---------------------------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _report(self, rank: int | None, message: str, node: int | None = None) -> Report:
        """A report by this rank about `rank` (None: about `node`)."""
        t = self.table
        if rank is not None:
            return Report(rank, t.nodes[rank], t.hosts[rank], t.pids[rank], message, by=t.rank)
        return Report(None, node, t.hosts[t.on_node(node)[0]], None, message, by=t.rank)

    def _read_report(self) -> Report | None:
        key = self._key("report")
        if not self.store.check([key]):
            return None
        return Report.decode(self.store.get(key))

    def _known_report(self) -> Report | None:
        """The job's report as far as this rank can tell: the store's, else one of this node's seen before."""
        try:
            if self.store is not None and self._store_lost_at is None:
                return self._read_report()
        except Exception:  # noqa: BLE001
            self._store_lost_at = time.monotonic()
        return self._own_node_report[0] if self._own_node_report else None

    def _publish(self, report: Report) -> Report:
        """The job's first report: `report` when it is, the one before it otherwise (or `report` without a store)."""
        if self.store is None or self._store_lost_at is not None:
            return report
        try:
            return Report.decode(self.store.compare_set(self._key("report"), "", report.encode()))
        except Exception:  # noqa: BLE001 - the store's host ended: this rank can still say it here
            self._store_lost_at = time.monotonic()
            return report

    # -- ending ------------------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, watcher: bool) -> None:
        """A SIGTERM or SIGINT: where a sibling died or a failure is reported, say why where this rank is the one that
        can, then exit; otherwise a stop asked of the run, for the loop's next step boundary (stop.py). The watcher
        handles each signal (its wake-up byte); the main thread's handler acts only where no watcher runs."""
        if _ending.locked():
            if _ending_own_failure:
                os._exit(128 + signum)  # the rank's own report is under way: as the signal's default
            return  # another thread is ending the process with its report
        if not watcher and self._thread is not None and self._thread.is_alive():
            return
        gone = self._gone_peers()
        if gone:
            self._report_gone(gone, ended_by=signum)  # returns where another rank of this node reports it
        known = self._known_report()
        if known is None and not self._halt.is_set():
            # A repeat changes nothing: launchers forward the signal their group got too (torchrun, DeepSpeed's
            # launch.py), and the grace period bounds the wait.
            self.stop_request.request(signal_reason(signum), 128 + signum)
            return  # the loop stops at its next step boundary, with a checkpoint
        self._end(known, speak=False, code=128 + signum, ended_by=signum)

    def _end(self, report: Report | None, *, speak: bool, code: int = 1, ended_by: int | None = None) -> None:
        """End the process for `report`: printed as this rank's last line where `speak` or where DeepSpeed's launch.py
        ends this rank last (ended_by: its signal; job_table.ends_last), recorded for the launcher's summary either
        way, then exit `code`. Returns only where another thread is ending the process already."""
        if self._clean and threading.current_thread() is self._thread:
            return  # a request that outlived stop(): the run ended cleanly
        if not _ending.acquire(blocking=False):
            if threading.current_thread() is threading.main_thread():
                time.sleep(LINGER_S + SETTLE_S)  # the watcher is ending the process
            return
        self._halt.set()
        t = self.table
        if report is not None:
            sys.stdout.flush()
            if speak or ended_by and ends_last(t, self._chain):
                print(report.line(), file=sys.stderr, flush=True)
            record_for_launcher(report.line())
        if speak and report.by == t.rank:
            self._let_other_nodes_read()
        if report is not None and (not speak or report.rank not in (None, t.rank) and not agent_hosts_store()):
            # The node's speaker, or a dead peer, is seen to end first by the launcher naming it; a SIGTERM of
            # DeepSpeed's launch.py meanwhile, to the last rank it ends, has the line printed again after its own.
            if not ended_by and self.signals.wait(LINGER_S, self._halt, wakes=False) and ends_last(t, self._chain):
                print(report.line(), file=sys.stderr, flush=True)
        os._exit(code)

    def _let_other_nodes_read(self) -> None:
        """Where the store lives in this process (rank 0, under launchers other than torchrun), stay until every
        node's leader has polled it once, so that the report just published outlives this rank."""
        if self.table.rank == 0 and len(self.table.pids) > 1 and self.store is not None and not agent_hosts_store():
            time.sleep(2 * POLL_S)

    def _read_rank0s_report(self) -> None:
        """Rank 0's node peers read its report too where rank 0 holds the store: it tells its failure from a SIGKILL."""
        if self.table.node != self.table.nodes[0] or agent_hosts_store() or self._store_lost_at is not None:
            return
        try:
            report = self._read_report()
        except Exception:  # noqa: BLE001 - rank 0 ended, and its store with it
            self._store_lost_at, report = time.monotonic(), None
        if report is not None and self._own_node_report is None:
            self._own_node_report = (report, time.monotonic())
