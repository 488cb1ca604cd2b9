"""Start the process group the same way under every launcher: deepspeed, torchrun, accelerate launch, plain python.

Each launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT before the script runs; plain
`python script.py` sets none of them. `deepspeed.init_distributed` then tries MPI discovery (and stops with
"No module named 'mpi4py'" where mpi4py is not installed), so here a single process gets its defaults
instead and MPI discovery stays off. Launchers that set none of torch's variables are read in their own terms:
mpirun (`deepspeed --launcher openmpi` / `mvapich`, or mpirun itself) from MPI's (`mpi_variables`, with
MASTER_ADDR exported by the user), and SLURM's `srun` (one task per GPU: `srun python train_1m.py`, or `deepspeed
--launcher slurm`) from SLURM's (`slurm_variables`).

Nodes: `node_id` names the node this rank runs on, from the host name and the launcher's node index, so that
the SP groups can be placed inside nodes (layout.py) and files written once per node or once per shared folder
(train/files.py), also for simulated nodes that share one host name.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import socket
import sys
import time
import warnings
from pathlib import Path

import torch

SHM_COMM_BUILDER = "ShareMemCommBuilder"  # DeepSpeed's name for its CPU shared-memory all-reduce op builder
STALE_LOCK_S = 300.0  # a live build's lock is younger, or has its compiler working in the folder (cpu_adam: ~95 s)
logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The launcher's index of this rank's node: torchrun (GROUP_RANK), DeepSpeed's per-node launcher (CROSS_RANK), srun.
NODE_INDEX_VARIABLES = ("GROUP_RANK", "CROSS_RANK", "SLURM_NODEID")
SLURM_PORT_BASE = 20000  # srun without MASTER_PORT: a port every task derives from the job id alike


def launcher_node_index() -> str | None:
    """The launcher's index of this rank's node (torchrun, DeepSpeed's launcher, srun), or None where none is set."""
    for name in NODE_INDEX_VARIABLES:
        if os.environ.get(name, "") != "":
            return os.environ[name]
    return None


def node_id() -> str:
    """This rank's node: the host name, and the launcher's node index where it sets one ("gpu-07", "gpu-07/1").
    Ranks with the same id share a node's memory, disks and fast links."""
    index = launcher_node_index()
    return socket.gethostname() if index is None else f"{socket.gethostname()}/{index}"


def number_nodes(ids) -> tuple[int, ...]:
    """Node numbers for every rank's node id (in rank order): nodes numbered by their lowest rank, from 0."""
    order = list(dict.fromkeys(ids))
    return tuple(order.index(key) for key in ids)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compact host list as names: "gpu[01-03,07],login1" -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            first, _, last = part.partition("-")
            for n in range(int(first), int(last or first) + 1):
                hosts.append(f"{prefix}{n:0{len(first)}d}")
    return hosts


def _tasks_on_node(tasks_per_node: str, node: int) -> int:
    """SLURM_STEP_TASKS_PER_NODE ("8(x2),4") for node index `node`."""
    counts = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node):
        counts += [int(count)] * int(repeat or 1)
    return counts[node]


def slurm_variables(env=os.environ) -> dict[str, str] | None:
    """torch's launcher variables for a task of an `srun` step (SLURM_STEP_NUM_TASKS is set only inside one: a
    batch script's own process, where SLURM_NTASKS names the whole allocation, is one process), or None.
    MASTER_ADDR: the step's first node unless set; MASTER_PORT: unless set, one port derived from the job id."""
    if "SLURM_STEP_NUM_TASKS" not in env or "SLURM_PROCID" not in env:
        return None
    node = int(env.get("SLURM_NODEID", "0"))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or socket.gethostname()
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or env["SLURM_STEP_NUM_TASKS"]
    return {
        "RANK": env["SLURM_PROCID"], "WORLD_SIZE": env["SLURM_STEP_NUM_TASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"), "LOCAL_WORLD_SIZE": str(_tasks_on_node(per_node, node)),
        "MASTER_ADDR": env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0],
        "MASTER_PORT": env.get("MASTER_PORT") or str(SLURM_PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % 20000),
    }


# (world size, rank, local rank, local size) as each MPI sets them: Open MPI, MPICH / Intel MPI (PMI), MVAPICH.
MPI_VARIABLES = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
)


def mpi_variables(env=os.environ) -> dict[str, str] | None:
    """torch's launcher variables for a process started by mpirun (`deepspeed --launcher openmpi`/`mvapich`, or
    mpirun itself), or None. MPI names no rendezvous address: MASTER_ADDR must be exported to every rank (mpirun
    -x MASTER_ADDR=<first node>); without it every rank would start a job of its own, so that is refused."""
    for size, rank, local_rank, local_size in MPI_VARIABLES:
        if size in env and rank in env:
            break
    else:
        return None
    if int(env[size]) > 1 and not env.get("MASTER_ADDR"):
        raise ValueError(
            f"started by mpirun ({size}={env[size]}) but MASTER_ADDR is not set, so the ranks cannot find each other: "
            "export it to every rank (mpirun -x MASTER_ADDR=<first node's address> -x MASTER_PORT=29500), or launch "
            "with torchrun, srun or the deepspeed launcher's default (pdsh).")
    return {"RANK": env[rank], "WORLD_SIZE": env[size], "LOCAL_RANK": env.get(local_rank, "0"),
            "LOCAL_WORLD_SIZE": env.get(local_size, "1"), "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": env.get("MASTER_PORT") or "29500"}


def single_process_defaults() -> bool:
    """Fill the launcher variables where no launcher set them: from SLURM's inside an srun step or MPI's under
    mpirun, else for one process; True when it filled them."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return False
    launched = slurm_variables() or mpi_variables()
    if launched is not None:
        os.environ.update(launched)
        return True
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    return True


def default_backend() -> str:
    """nccl where there are GPUs, gloo on CPU."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(backend: str | None = None) -> None:
    """Initialise torch.distributed through DeepSpeed, from the launcher's variables or as one process.

    Where the process group already exists (accelerate, a Trainer or a test started it), DeepSpeed's comm layer is
    pointed at it: without that, `zero.Init` (transformers' from_config/from_pretrained under a ZeRO-3
    TrainingArguments) counts a world of one and stops at its train_batch_size check. Local rank 0 first warns of
    any stale build lock of DeepSpeed's JIT ops (stale_build_locks), the one cause of a run that hangs silently.
    backend: None picks nccl with GPUs, gloo without.
    """
    import deepspeed

    ignore_unactionable_warnings()
    if not torch.distributed.is_initialized():
        single_process_defaults()
    bind_cuda_device()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        for lock in stale_build_locks():
            logger.warning(f"{lock} is a build lock that no running build holds: every run that builds DeepSpeed's "
                           f"{lock.parent.name} op (on first use) waits on it forever, with no message. Remove it: "
                           f"rm {lock}")
    with _without_shm_comm_op():
        deepspeed.init_distributed(dist_backend=backend or default_backend(), auto_mpi_discovery=False)


def ignore_unactionable_warnings() -> None:
    """Hide the warnings no user can act on, by their text, so every other warning still shows.

    DeepSpeed's ZeRO-3 (0.17-0.20) gathers and reduce-scatters parameters through torch.distributed calls that torch
    2.11+ deprecates; the FutureWarning names torch's wrapper (c10d_logger.py) as its source and prints once per rank
    and call site. init_distributed calls this, so a script of one's own does not flood its console."""
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def bind_cuda_device() -> None:
    """Make this rank's GPU (LOCAL_RANK) the current CUDA device, where there are GPUs and none was chosen.

    NCCL's object collectives (all_gather_object, broadcast_object_list: the layout's node ids, the run folder's
    name) run on the current device: left at cuda:0 on every rank, ranks of one node collide on one GPU."""
    if not torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        return
    local = int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count()
    if torch.cuda.current_device() == 0 and local != 0:  # still the default: nobody chose one
        torch.cuda.set_device(local)


def stale_build_locks(min_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Locks in torch's extension build folders (where DeepSpeed JIT-builds its ops: cpu_adam, ...) that no build
    holds: older than min_age_s and no process working in the folder (ninja and the compiler run there). torch's
    file_baton writes no owner into the lock, and one left by a killed build makes every later load of that op
    wait for it, silently."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    locks = [*Path(root).glob("*/lock"), *Path(root).glob("*/*/lock")]
    now = time.time()
    locks = [lock for lock in locks if now - lock.stat().st_mtime > min_age_s]
    if not locks:
        return []
    busy = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            busy.add(Path(os.readlink(proc / "cwd")))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return [lock for lock in locks if not any(d == lock.parent or lock.parent in d.parents for d in busy)]


@contextlib.contextmanager
def _without_shm_comm_op():
    """Keep DeepSpeed's CPU shared-memory all-reduce op (`deepspeed_shm_comm`) out of the process group it builds.

    On the CPU accelerator DeepSpeed's TorchBackend JIT-compiles that op on every start (into
    ~/.cache/torch_extensions, under one file lock shared by every venv, each of which rebuilds it: minutes on a
    loaded machine; a lock left by a killed build hangs every later run in torch's file_baton, with no message), and
    under the deepspeed launcher (LOCAL_SIZE set) maps one 69 MB /dev/shm/deepspeed_allreduce_buffer_* segment
    per rank that nothing ever unlinks. The op serves only DeepSpeed-inference's `inference_all_reduce`; ZeRO-3
    training never calls it, and without it that call falls back to torch's all_reduce. The CUDA accelerator has
    no such builder, so GPUs see no change. Scoped to this call and undone after it."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        yield
        return
    own = vars(accelerator).get("create_op_builder")  # None: the class's method, which shows through again after
    create_op_builder = accelerator.create_op_builder
    accelerator.create_op_builder = lambda name: None if name == SHM_COMM_BUILDER else create_op_builder(name)
    try:
        yield
    finally:
        if own is None:
            del accelerator.create_op_builder
        else:
            accelerator.create_op_builder = own


def destroy_distributed() -> None:
    """End the process groups cleanly at the end of a run, on every rank. Call it on the normal path only (a rank
    that failed would wait here for the others).

    First a barrier on every gloo group this rank belongs to, in creation order (the same on every rank: creating
    a group is collective), so that no collective is still queued or finishing on any of them; then the groups are
    destroyed, through DeepSpeed where it started them, which also drops its own references to them.
    Why every gloo group: gloo's shutdown does not stop a group's worker threads; they live as long as the group
    object, which the layout, the model and the engine hold until the interpreter is torn down. A worker that
    finishes a collective then frees a tensor whose Python object needs the GIL, and Python 3.11 ends a thread that
    asks for the GIL during finalization with pthread_exit, whose unwinding through gloo's noexcept work destructor
    calls std::terminate: rank exit -6, "terminate called without an active exception" (gdb: THPVariable_dealloc
    -> take_gil -> PyThread_exit_thread in a pt_gloo_runloop thread). With async all-reduces pending on an SP
    group, a barrier on the default group only aborted 7 launches of 8, one on every group 0 of 8. NCCL groups
    stop their own threads and keep the one barrier on the default group (without it NCCL warns from the TCPStore
    of ranks still exiting)."""
    if not torch.distributed.is_initialized():
        return
    from torch.distributed.distributed_c10d import GroupMember, _world  # no public list of a rank's groups

    for group in list(_world.pg_map):  # NCCL groups stop their own threads: only the default one waits there
        if group is GroupMember.WORLD or "gloo" in torch.distributed.get_backend(group):
            torch.distributed.barrier(group=group)
    ds_comm = sys.modules.get("deepspeed.comm")  # not imported: DeepSpeed started nothing
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()


def world_size() -> int:
    """Ranks in this job: the process group's, else the launcher's WORLD_SIZE (or an srun step's), else 1."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    launched = slurm_variables() or mpi_variables()
    return int(launched["WORLD_SIZE"]) if launched else 1


def local_world_size() -> int | None:
    """Ranks on this node as the launcher started them (LOCAL_WORLD_SIZE, DeepSpeed's LOCAL_SIZE, an srun
    step's), or None where no launcher says."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name):
            return int(os.environ[name])
    launched = slurm_variables() or mpi_variables()
    return int(launched["LOCAL_WORLD_SIZE"]) if launched else None


def share_cpu_threads() -> str:
    """Give this rank its share of the node's cores as CPU threads (torch's intra-op pool, and OMP_NUM_THREADS for
    the processes it starts), where OMP_NUM_THREADS is unset; returns the start-up block's line.

    torch takes every core for each process, so N ranks on a node ran N x cores threads: `deepspeed --num_gpus 2` on
    2 CPU cores took 212-297 s for the run that takes 52 s with one thread each (issue 42). torchrun sets
    OMP_NUM_THREADS=1 itself for more than one rank; a value set by the user or launcher is kept."""
    given = os.environ.get("OMP_NUM_THREADS")
    if given:
        return f"{torch.get_num_threads()} per rank (OMP_NUM_THREADS={given}, as set)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = local_world_size() or 1
    threads = max(1, cores // ranks)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return (f"{threads} per rank ({cores} core{'s' * (cores > 1)} / {ranks} rank{'s' * (ranks > 1)} on this node; "
            "set OMP_NUM_THREADS to choose)")


def seed_step(seed: int, rank: int, step: int, micro: int = 0) -> None:
    """Seed every torch RNG for one micro step of one rank from (seed, rank, step, micro).

    A step's random draws (dropout: LoRA's, attention's) then differ between ranks, where one seed on every rank
    repeated the same masks on each slice of the sequence and in each DP group, and they are a function of the step
    alone: a resumed run draws what the uninterrupted one drew, on any world size, with no RNG state to carry (a
    ZeRO-3 checkpoint holds rank 0's only)."""
    digest = hashlib.blake2b(f"{seed}/{rank}/{step}/{micro}".encode(), digest_size=8).digest()
    torch.manual_seed(int.from_bytes(digest, "little") >> 1)


__all__ = ["bind_cuda_device", "default_backend", "destroy_distributed", "expand_nodelist", "init_distributed",
           "launcher_node_index", "local_world_size", "mpi_variables", "node_id", "number_nodes", "seed_step",
           "single_process_defaults", "slurm_variables", "stale_build_locks", "world_size"]
