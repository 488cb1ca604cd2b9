"""Suite-wide: DeepSpeed's CPU Adam op built in the background while the suite runs.

The shipped zero3_offload_optimizer config steps with DeepSpeed's CPU Adam, a C++ op DeepSpeed JIT-builds on first
use (into torch's extension folder, ~/.cache/torch_extensions by default): about 50 s of compiling on 2 idle cores
and 90 s on a loaded pair, which the first test to use it (marked `cpu_adam`) waited out in full. When such a test
is collected, a process at the lowest priority builds the op as the suite starts, in the CPU time the suite leaves
idle (a quarter to a third on 2 cores by vmstat: its ranks wait on each other and on process starts); the marked
tests then find it built, or wait on torch's build lock as they would on their own build. The build is the one a run
makes (the same builder, sources and flags), so nothing else is left on the machine. Its output goes to the pytest
cache folder; a failed build fails nothing here: the marked tests build again and fail with the compiler's message.
"""

import os
import subprocess
import sys

_BUILD = """
import os
os.nice(19)
from deepspeed.ops.op_builder import CPUAdamBuilder  # the import DeepSpeedCPUAdam makes
CPUAdamBuilder().load()
"""
_builder: subprocess.Popen | None = None


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_adam: steps DeepSpeed's CPU Adam (a JIT-built op; conftest.py builds it "
                                       "in the background when such a test is collected)")


def pytest_collection_finish(session):
    global _builder
    config = session.config
    if _builder is not None or not any(item.get_closest_marker("cpu_adam") for item in session.items):
        return  # session.items: what runs, after -k / -m deselection
    log = config.cache.mkdir("cpu_adam_build") / "build.log" if getattr(config, "cache", None) else None
    out = open(log, "w") if log else subprocess.DEVNULL
    _builder = subprocess.Popen([sys.executable, "-c", _BUILD], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if log:
        out.close()


def pytest_sessionfinish(session, exitstatus):
    # Waited for, never killed: a build killed mid-way leaves torch's lock behind, and every later load of the op
    # waits on it forever (ulysses_lc.parallel.distributed.stale_build_locks).
    if _builder is not None:
        _builder.wait()
