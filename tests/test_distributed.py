"""What ulysses_lc.distributed keeps off the machine: DeepSpeed's CPU shm op, and silent waits on a stale build lock.

The end of a run (no shared memory, port or process left; no abort at exit) is checked where runs end: every
run_distributed/run_shared rank, and README's commands in test_run.py.
"""

import os
import subprocess
import sys
import time

import pytest

from ulysses_lc.distributed import SHM_COMM_BUILDER, _without_shm_comm_op, stale_build_locks


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
