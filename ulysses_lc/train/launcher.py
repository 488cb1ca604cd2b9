"""`ulysses-lc-train --nproc-per-node N [flags]`: the main job starts its own ranks, and its console ends with the job's
last word: the cause of a failure, the line of a stop, or the run's summary.

The ranks are started by torch.distributed's elastic agent (torchrun's own, `torch.distributed.launcher.api`), on a
static rendezvous at --master-addr:--master-port as torchrun's default is, with what torchrun itself adds around it
left out:
  - torchrun ends every failure with its ChildFailedError (a traceback and a summary, ~40 lines under the cause): here
    the failing rank's own report (cli.py) is the last line, and the agent's log lines are quiet. A rank that ended
    without a report (SIGKILL, a crash in native code) is named here, last;
  - Ctrl-C (or SIGTERM) reaches every rank, which stops at its step boundary with a checkpoint (stop.py): this process
    waits for them (up to --stop-grace-s and 5 s), so the prompt comes back after their last line, not before it.
    A second Ctrl-C while they save is said to wait, not to abandon them (DeepSpeed's runner returned the prompt at
    once and the ranks trained on for ~14 s, printing over it);
  - no OMP_NUM_THREADS=1 for every rank: each rank takes its share of the node's cores (distributed.share_cpu_threads).
The flags are checked once, here, before any rank starts (a mistyped flag is one line, not one usage block a rank).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
import uuid

from ..parallel.distributed import _free_port

STOP_WAIT_S = 5.0  # past --stop-grace-s: a rank's own watch ends it then, so this bound is never the one that acts
LAUNCH_FIELDS = ("nproc_per_node", "nnodes", "node_rank", "master_addr", "master_port")
MASTER_PORT = 29500  # torchrun's default, for a job of many nodes (each node's launcher must name the same)


def add_launch_flags(p) -> None:
    """--nproc-per-node and the flags of a job of many nodes, torchrun's spellings (- or _) both taken."""
    g = p.add_argument_group("launching (ulysses-lc-train as its own launcher, in place of torchrun or deepspeed)")
    g.add_argument("--nproc-per-node", "--nproc_per_node", type=int,
                   help="start this many ranks of the job on this node (one per GPU; on a CPU, 2 runs SP 2) and wait for "
                        "them: the console ends with the run's summary, a failure's cause or a stop's line, and Ctrl-C "
                        "stops every rank at its step boundary with a checkpoint")
    g.add_argument("--nnodes", type=int, help="with --nproc-per-node: nodes in the job, each running this command "
                                              "(default 1)")
    g.add_argument("--node-rank", "--node_rank", type=int, help="with --nnodes: this node's index, 0 to nnodes - 1")
    g.add_argument("--master-addr", "--master_addr",
                   help="with --nnodes: node 0's address, the same on every node (default 127.0.0.1 on one node)")
    g.add_argument("--master-port", "--master_port", type=int,
                   help=f"with --nnodes: a free port on node 0, the same on every node (default {MASTER_PORT}; one "
                        "node: any free port)")


def launch_parser() -> argparse.ArgumentParser:
    """The launcher's flags (also listed in the main job's --help, config.build_parser)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_launch_flags(p)
    return p


def split(argv: list[str]) -> tuple[argparse.Namespace | None, list[str]]:
    """(the launcher's flags, or None where none is given; the job's flags)."""
    flags, rest = launch_parser().parse_known_args(argv)
    return (flags if any(getattr(flags, f) is not None for f in LAUNCH_FIELDS) else None), rest


def launch(launch_flags: argparse.Namespace, job_argv: list[str], stop_grace_s: float) -> int:
    """Start --nproc-per-node ranks of `python -m ulysses_lc.train job_argv` here, wait for them, and return the
    job's exit code (0, 1 for a failure, 128 + the signal for a stop). job_argv: checked already (cli.py parses it
    once, here, so that a refused flag is said once: the ranks would each say it); stop_grace_s: its --stop-grace-s."""
    _check(launch_flags)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_agent()
    if "DS_ACCELERATOR" not in os.environ and not _has_gpu():
        # DeepSpeed's detection warns on every rank that it fell back to the CPU: without a GPU that is the plan.
        os.environ["DS_ACCELERATOR"] = "cpu"
    nnodes = launch_flags.nnodes or 1
    port = launch_flags.master_port or (MASTER_PORT if nnodes > 1 else _free_port())
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=launch_flags.nproc_per_node, run_id=uuid.uuid4().hex,
        rdzv_backend="static", rdzv_endpoint=f"{launch_flags.master_addr or '127.0.0.1'}:{port}",
        rdzv_configs={"rank": launch_flags.node_rank or 0}, max_restarts=0,
        # SIGINT is this module's (_Interrupts): torch's handler, raised again by a second Ctrl-C inside its own wait
        # for the ranks, would leave them running.
        signals_to_handle="SIGTERM,SIGHUP,SIGQUIT", shutdown_timeout=int(stop_grace_s + STOP_WAIT_S),
    )
    interrupts = _Interrupts(SignalException)
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "ulysses_lc.train", *job_argv)
    except ChildFailedError as e:
        _name_a_silent_failure(e)
        codes = {f.exitcode for f in e.failures.values()}
        return codes.pop() if len(codes) == 1 and codes <= {130, 143} else 1  # a stop signalled to the ranks
    except SignalException as e:  # the agent signalled the ranks and waited for them, or was stopped waiting
        _wait_for_ranks(stop_grace_s + STOP_WAIT_S)
        return 128 + int(e.sigval)
    finally:
        interrupts.restore()
    return 0


def _check(launch_flags) -> None:
    n, nnodes, node_rank = launch_flags.nproc_per_node, launch_flags.nnodes or 1, launch_flags.node_rank or 0
    if "RANK" in os.environ:
        raise ValueError("--nproc-per-node and the flags with it start the job's ranks, and this process is already a "
                         "rank of a launcher's (torchrun, deepspeed, srun): drop them, or run ulysses-lc-train "
                         "--nproc-per-node N alone.")
    if n is None:
        raise ValueError("--nnodes, --node-rank, --master-addr and --master-port go with --nproc-per-node N (ranks "
                         "on this node).")
    if n < 1:
        raise ValueError(f"--nproc-per-node {n}: start at least one rank.")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise ValueError(f"--node-rank {node_rank} of --nnodes {nnodes}: give each node an index from 0 to "
                         f"{nnodes - 1}.")
    if nnodes > 1 and not launch_flags.master_addr:
        raise ValueError(f"--nnodes {nnodes}: pass --master-addr (node 0's address) and the same --master-port on "
                         "every node.")


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _quiet_agent() -> None:
    """The elastic agent's own lines (its start, each rank's closing signal, its failure record) say nothing the
    ranks do not: off, so that the ranks' last line is the console's."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")):
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)


class _Interrupts:
    """Ctrl-C to the launcher: the first stops the ranks as the agent does a SIGTERM (it forwards the signal and waits
    for them); the ones after it say that the ranks are saving, and are waited for."""

    def __init__(self, signal_exception):
        self._exception, self._count = signal_exception, 0
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self._count += 1
        if self._count == 1:
            raise self._exception(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))
        print("stopping: the ranks are saving their checkpoint at the step boundary; waiting for them",
              file=sys.stderr, flush=True)

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _wait_for_ranks(timeout: float) -> None:
    """Wait for every process this launcher started to exit (the agent's wait may have been cut short by a second
    signal); past `timeout` they are killed, as the agent would."""
    import psutil

    ranks = psutil.Process().children(recursive=True)
    _, alive = psutil.wait_procs(ranks, timeout=timeout)
    for proc in alive:
        proc.kill()
    psutil.wait_procs(alive, timeout=5)


def _name_a_silent_failure(e) -> None:
    """The job failed: each rank that had something to say printed it, last (cli.py records the same text for the
    launcher). Where none did (every failed rank killed by a signal, or a crash below Python), this line says which
    rank ended first and how."""
    if any(os.path.isfile(f.error_file) for f in e.failures.values()):  # written by cli.py (job_table.py)
        return
    rank, failure = e.get_first_failure()
    how = (f"was killed by {failure.signal_name()}" if failure.exitcode < 0 else
           f"exited with code {failure.exitcode}")
    hint = " (SIGKILL: the kernel's out-of-memory killer, see `dmesg`, or a scheduler)" \
        if failure.signal_name() == "SIGKILL" else ""
    print(f"error (rank {rank}, pid {failure.pid} on host {socket.gethostname()}): it {how} without a report{hint}",
          file=sys.stderr, flush=True)
