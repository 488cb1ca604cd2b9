"""Start the process group the same way under every launcher: deepspeed, torchrun, accelerate launch, plain python.

Each launcher sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT before the script runs; plain
`python script.py` sets none of them. `deepspeed.init_distributed` then tries MPI discovery (and stops with
"No module named 'mpi4py'" where mpi4py is not installed), so here a single process gets its defaults
instead and MPI discovery stays off: a job started by mpirun goes through `deepspeed --launcher openmpi`, which
sets the variables too.
"""

from __future__ import annotations

import contextlib
import os
import socket

import torch

SHM_COMM_BUILDER = "ShareMemCommBuilder"  # DeepSpeed's name for its CPU shared-memory all-reduce op builder


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
    TrainingArguments) counts a world of one and stops at its train_batch_size check.
    backend: None picks nccl with GPUs, gloo without.
    """
    import deepspeed

    if not torch.distributed.is_initialized():
        single_process_defaults()
    with _without_shm_comm_op():
        deepspeed.init_distributed(dist_backend=backend or default_backend(), auto_mpi_discovery=False)


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
    """End the process group cleanly at the end of a run, on every rank: without it NCCL warns from the TCPStore of
    ranks still exiting, and a gloo rank can abort at interpreter exit ("terminate called without an active
    exception", seen one launch in three under accelerate). The barrier first: no rank tears its store down while
    another still talks to it. Call it on the normal path only (a rank that failed would wait here)."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def world_size() -> int:
    """Ranks in this job: the process group's, else the launcher's WORLD_SIZE, else 1 (no process group needed)."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


__all__ = ["default_backend", "destroy_distributed", "init_distributed", "single_process_defaults", "world_size"]
