"""Start the process group the same way under every launcher: deepspeed, torchrun, accelerate launch, plain python.

Each launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT before the script runs; plain
`python script.py` sets none of them. `deepspeed.init_distributed` then tries MPI discovery (and stops with
"No module named 'mpi4py'" where mpi4py is not installed), so here a single process gets its defaults
instead and MPI discovery stays off: a job started by mpirun goes through `deepspeed --launcher openmpi`, which
sets the variables too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from pathlib import Path

import torch

SHM_COMM_BUILDER = "ShareMemCommBuilder"  # DeepSpeed's name for its CPU shared-memory all-reduce op builder
STALE_LOCK_S = 300.0  # a live build's lock is younger, or has its compiler working in the folder (cpu_adam: ~95 s)
logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def single_process_defaults() -> bool:
    """Fill the launcher variables for one process when no launcher set them; True when it did."""
    if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
        return False
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

    if not torch.distributed.is_initialized():
        single_process_defaults()
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        for lock in stale_build_locks():
            logger.warning(f"{lock} is a build lock that no running build holds: every run that builds DeepSpeed's "
                           f"{lock.parent.name} op (on first use) waits on it forever, with no message. Remove it: "
                           f"rm {lock}")
    with _without_shm_comm_op():
        deepspeed.init_distributed(dist_backend=backend or default_backend(), auto_mpi_discovery=False)


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
    """Ranks in this job: the process group's, else the launcher's WORLD_SIZE, else 1 (no process group needed)."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


__all__ = ["default_backend", "destroy_distributed", "init_distributed", "single_process_defaults", "stale_build_locks",
           "world_size"]
