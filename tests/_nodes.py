"""Simulated nodes on one machine: one launcher per node rank, all on 127.0.0.1, as a user starts a job on a cluster.

`launch_nodes` starts `nnodes` launchers (torchrun with --nnodes/--node_rank, or DeepSpeed's runner with --no_ssh
and --node_rank, which needs no ssh), or for launcher "srun" one process per rank with only the variables an srun
step sets, each node in its own working folder when `cwds` names several (node-local disks) or all in one (a
shared file system), and returns each node's result. Every rank of node n sees
the launcher's own node variables (torchrun's GROUP_RANK, DeepSpeed's CROSS_RANK), which is how ulysses_lc tells
simulated nodes apart when they share a host name.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests._dist import _free_port

REPO = Path(__file__).resolve().parent.parent


def node_env(extra: dict | None = None) -> dict:
    """The environment of a node's launcher: this checkout first on the path, offline, one thread per rank."""
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(extra or {})}


def node_command(launcher: str, node_rank: int, nnodes: int, nproc_per_node: int, port: int, hostfile: Path | None = None) -> list[str]:
    """The launcher's command line for one node of the job (rendezvous on 127.0.0.1:port)."""
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
                "--nproc_per_node", str(nproc_per_node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    if launcher == "deepspeed":
        assert hostfile is not None, "the deepspeed launcher reads its nodes from a hostfile"
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
                "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port)]
    raise ValueError(f"unknown launcher {launcher!r}")


def start_nodes(entry: list[str], cwds: list[Path], *, nproc_per_node: int = 2, launcher: str = "torchrun",
                env: dict | None = None, port: int | None = None,
                node_args: list[list[str]] | None = None) -> list[subprocess.Popen]:
    """Start one launcher per folder in `cwds` (node n runs in cwds[n], with node_args[n] after `entry` where given);
    output is piped, stderr into stdout."""
    nnodes = len(cwds)
    port = port or _free_port()
    if launcher == "srun":
        return [_srun_task(entry, cwds[rank // nproc_per_node], rank, nnodes, nproc_per_node, port, env)
                for rank in range(nnodes * nproc_per_node)]
    hostfile = None
    if launcher == "deepspeed":
        # Distinct names for one machine: DeepSpeed's runner only counts slots; --no_ssh starts this node's share.
        Path(cwds[0]).mkdir(parents=True, exist_ok=True)
        hostfile = Path(cwds[0]) / "hostfile"
        hostfile.write_text("".join(f"node{n} slots={nproc_per_node}\n" for n in range(nnodes)))
    procs = []
    for node_rank, cwd in enumerate(cwds):
        Path(cwd).mkdir(parents=True, exist_ok=True)
        cmd = [*node_command(launcher, node_rank, nnodes, nproc_per_node, port, hostfile), *entry,
               *(node_args[node_rank] if node_args else [])]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=node_env(env), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    return procs


def _srun_task(entry, cwd, rank, nnodes, nproc_per_node, port, env) -> subprocess.Popen:
    """One task of an srun step: SLURM's variables only (no RANK or WORLD_SIZE: ulysses_lc reads SLURM's), with
    MASTER_PORT given as a user's sbatch script would."""
    task_env = node_env({
        "SLURM_STEP_NUM_TASKS": str(nnodes * nproc_per_node), "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank % nproc_per_node), "SLURM_NODEID": str(rank // nproc_per_node),
        "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_STEP_TASKS_PER_NODE": f"{nproc_per_node}(x{nnodes})",
        "SLURM_JOB_ID": "7", "MASTER_PORT": str(port), **(env or {})})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "GROUP_RANK", "CROSS_RANK"):
        task_env.pop(name, None)
    Path(cwd).mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, *entry], cwd=cwd, env=task_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def launch_nodes(entry: list[str], cwds: list[Path], *, timeout: float = 600, **kwargs) -> list[tuple[int, str, float]]:
    """Run the job to its end on simulated nodes; each launcher's (exit code, output, seconds after the first one
    ended): one per node, or under "srun" one per rank. A hang guard, not a speed test: `timeout` ends a job that
    would wait out a collective's timeout."""
    procs = start_nodes(entry, cwds, **kwargs)
    deadline = time.monotonic() + timeout
    outputs, ended = [""] * len(procs), [None] * len(procs)
    import threading

    def drain(i, proc):
        outputs[i] = proc.stdout.read()
        proc.wait()
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=drain, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in hung:
        _kill_tree(procs[i])
    for t in threads:
        t.join(30)
    assert not hung, f"node(s) {hung} still running after {timeout:.0f} s:\n" + "\n".join(
        f"--- node {i} ---\n{out[-4000:]}" for i, out in enumerate(outputs))
    first = min(ended)
    return [(p.returncode, outputs[i], ended[i] - first) for i, p in enumerate(procs)]


def _kill_tree(proc: subprocess.Popen) -> None:
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in [*children, psutil.Process(proc.pid)]:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


class WatchEnded(Exception):
    """A JobWatch's end, raised by `watch_without_store`'s watch instead of ending the process."""


def watch_without_store(monkeypatch, table, **kwargs):
    """A JobWatch over `table` whose store is gone (every call raises "Connection reset by peer", as a TCPStore
    whose host ended), under torchrun's agent store, on a clock the test moves (`now[0]`); its end raises
    WatchEnded with the report's message. Returns (watch, now)."""
    import ulysses_lc.train.job_watch as job_watch

    class GoneStore:
        def __getattr__(self, name):
            raise RuntimeError("Connection reset by peer")

    now = [1000.0]
    monkeypatch.setattr(job_watch.time, "monotonic", lambda: now[0])
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    watch = job_watch.JobWatch(table, GoneStore(), "t/", **kwargs)

    def end(report, **_):
        raise WatchEnded(report.message)

    watch._end = end
    return watch, now
