"""What ulysses_lc.parallel.distributed keeps off the machine: DeepSpeed's CPU shm op, and silent waits on a stale build lock.

The end of a run (no shared memory, port or process left; no abort at exit) is checked where runs end: every
run_distributed/run_shared rank, and README's commands in test_run.py.
"""

import os
import subprocess
import sys
import time

import pytest

from ulysses_lc.parallel.distributed import SHM_COMM_BUILDER, _without_shm_comm_op, stale_build_locks


def test_shm_comm_op_is_kept_out_and_the_accelerator_given_back():
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        pytest.skip("the CUDA accelerator has no shm op builder to keep out")
    with _without_shm_comm_op():
        assert accelerator.create_op_builder(SHM_COMM_BUILDER) is None
        assert accelerator.create_op_builder("CPUAdamBuilder") is not None  # only the one op
    assert "create_op_builder" not in vars(accelerator)
    assert accelerator.create_op_builder(SHM_COMM_BUILDER) is not None


def test_a_stale_build_lock_is_named_and_a_live_build_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale, building, just_started = (tmp_path / name for name in ("cpu_adam", "fused_adam", "deepspeed_shm_comm"))
    hour_ago = time.time() - 3600
    for folder in (stale, building, just_started):
        folder.mkdir()
        (folder / "lock").touch()
    for folder in (stale, building):
        os.utime(folder / "lock", (hour_ago, hour_ago))
    # A long build: a compiler still works in its folder.
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], cwd=building)
    try:
        assert stale_build_locks() == [stale / "lock"]
    finally:
        compiler.kill()
        compiler.wait()


def test_ranks_draw_different_dropout_masks_and_a_step_draws_the_same_on_resume():
    """One seed on every rank repeated LoRA's dropout masks on each SP slice and in each DP group, and a resume
    continued every rank from old rank 0's RNG (issue 28, item 4): the loop and the Trainer seed each micro step of
    each rank with distributed.seed_step."""
    import torch

    from ulysses_lc.parallel.distributed import seed_step

    def mask(rank, step, micro=0):
        seed_step(0, rank, step, micro)
        return torch.nn.functional.dropout(torch.ones(4096), p=0.5) > 0

    assert not torch.equal(mask(0, 3), mask(1, 3))  # two ranks, one step
    assert not torch.equal(mask(0, 3), mask(0, 4)) and not torch.equal(mask(0, 3), mask(0, 3, micro=1))
    assert torch.equal(mask(1, 3), mask(1, 3))  # a function of the step: the resumed run draws the same


def test_a_lost_peer_is_told_by_error_type_not_by_a_backend_name():
    """cli.py called any error mentioning "nccl" or "gloo" a lost peer and hid its traceback (issue 28, item 4)."""
    import torch.distributed as dist

    from ulysses_lc.train.cli import _is_lost_peer

    gone = [RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:6861. This is "
                         "typically caused by a remote worker crashing."),  # what gloo raised here, measured
            dist.DistBackendError("NCCL error: remote process exited or there was a network error, ncclRemoteError"),
            dist.DistNetworkError("Connection reset by peer"), dist.DistStoreError("Socket Timeout")]
    bugs = [RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1234, invalid argument"),
            RuntimeError("gloo: the size of tensor a (16) must match the size of tensor b (15)"),
            ValueError("Connection closed by peer"), dist.DistBackendError("NCCL error: invalid usage")]
    assert [_is_lost_peer(e) for e in gone] == [True] * 4
    assert [_is_lost_peer(e) for e in bugs] == [False] * 4
