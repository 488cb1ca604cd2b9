"""A rank SIGKILLed mid-step of the main job at sp 2 over NCCL (issue 33, item 3): every rank exits within seconds,
and the cause, naming the killed rank, is the last thing the job prints.

What NCCL does that gloo does not: a survivor's main thread sits in a collective whose kernel spins on the GPU
(gloo's would raise once its peer's socket closed), so only the watch (train/job_watch.py, a thread off the step's
path) can see the peer gone, name it and end the process. tests/test_faults.py holds the same on gloo for rank 0
killed at a step boundary under every launcher; here both ranks in turn, mid-step, under DeepSpeed's launcher as
issue 33 runs the job (`deepspeed --num_gpus 2`).

Skipped unless two CUDA devices are visible; on a machine with two GPUs:

    NCCL_NVLS_ENABLE=0 python -m pytest tests/test_nccl_faults.py -q -s

Mid-step: the kill comes a tenth of a step after the step-3 line (of the interval between the step-2 and step-3
lines: past the step boundary's agreement, early in step 4, whose line must never come), at 131,072 tokens of the
tiny model on the GPUs so that a step is long enough to land in.

The bound: every process of the job (launcher and ranks) gone within EXIT_S of the kill. The watch polls each
second; the node's speaker prints at once, a quiet rank lingers LINGER_S (2 s), a rank that knows no cause waits
SETTLE_S (6 s); DeepSpeed's launcher polls each second and then ends the rest. 30 s is these with room for a
loaded machine's interpreter and CUDA teardown, and far below what a survivor would wait otherwise (NCCL's
collective timeout, 10 minutes).

The same body on gloo and CPU, to check this file's logic where no two GPUs are (not part of the suite):

    ULYSSES_NCCL_TEST_BACKEND=gloo python -m pytest tests/test_nccl_faults.py -q -s
"""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests._dist import _free_port, nccl_test_backend

REPO = Path(__file__).resolve().parent.parent

BACKEND, pytestmark = nccl_test_backend()  # "gloo": the same body on CPU (docstring)
EXIT_S = 30.0
INTO_STEP = 0.1  # the kill, after the step-3 line, in step intervals (the step-2 to step-3 lines' time)
SEQ_LEN = {"nccl": 131072, "gloo": 2048}  # tokens per step: a step long enough to be killed in



def _env():
    # This checkout first, then whatever the caller had (on the GPU machine: the folder DeepSpeed's wheel went to).
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if BACKEND == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU run, wherever this runs
    return env


def _is_launchers(line: str) -> bool:
    """DeepSpeed's runner and launch.py log lines ("[... launch.py:259:main] ... exits with return code = -9")."""
    return re.search(r"\[(launch|runner)\.py:\d+:", line) is not None


def _ranks(launcher_pid: int):
    import psutil

    return {int(p.environ().get("RANK", -1)): p for p in psutil.Process(launcher_pid).children(recursive=True)
            if "train_1m.py" in " ".join(p.cmdline()) and "launch" not in " ".join(p.cmdline())}


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_step_ends_every_rank_within_seconds_naming_it_last(tmp_path, victim):
    """victim 1: rank 0 (which holds the job's store) is left in NCCL's collective; victim 0: the store goes too."""
    import psutil

    args = ["--model", "tiny", "--sp-size", "2", "--seq-len", str(SEQ_LEN[BACKEND]), "--steps", "8",
            "--save-every", "0", "--no-export", "--output-dir", "run", "--cache-dir", "cache"]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", str(_free_port()),
           str(REPO / "examples" / "train_1m.py"), *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines, step_at, ranks = [], {}, {}
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if m := re.match(r"step (\d+)/", line):
                step_at[int(m.group(1))] = time.monotonic()
                if int(m.group(1)) == 1:
                    ranks = _ranks(proc.pid)  # now, so that the kill below follows the step-3 line at once
                if int(m.group(1)) == 3:
                    break
        assert 3 in step_at, "\n".join(lines[-40:])
        assert sorted(ranks) == [0, 1], ranks
        time.sleep(INTO_STEP * (step_at[3] - step_at[2]))  # past the step boundary's agreement, early in step 4
        killed = time.monotonic()
        pid = ranks[victim].pid
        ranks[victim].send_signal(signal.SIGKILL)
        rest = []
        reader = threading.Thread(target=lambda: rest.extend(l.rstrip("\n") for l in proc.stdout), daemon=True)
        reader.start()
        proc.wait(timeout=EXIT_S + 60)  # a hang guard; the bound is checked below
        ended = time.monotonic() - killed
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    alive = [p.pid for p in ranks.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    out = [line for line in rest if line.strip()]
    steps_after = [line for line in out if re.match(r"step \d+/", line)]
    print(f"rank {victim} killed {INTO_STEP * (step_at[3] - step_at[2]):.2f} s after the step-3 line (a step: "
          f"{step_at[3] - step_at[2]:.2f} s); the launcher exited {ended:.1f} s after the kill with code "
          f"{proc.returncode}; step lines after the kill: {len(steps_after)}")
    print("last lines:\n  " + "\n  ".join(out[-6:]))
    assert not any(line.startswith("step 4/") for line in steps_after), "step 4 ended: the kill was not mid-step"
    assert alive == [], f"ranks still running {EXIT_S} s after the kill: {alive}"
    assert ended <= EXIT_S, f"the job took {ended:.1f} s to end after rank {victim}'s kill (bound {EXIT_S} s)"
    assert proc.returncode != 0
    ours = [line for line in out if not _is_launchers(line)]
    cause = re.compile(rf"^error \(rank {victim} on node 0, host .*\): rank {victim} \(pid {pid} on host .*\) exited "
                       "without a report")
    assert ours and cause.match(ours[-1]), "the job's last line is not the cause:\n" + "\n".join(out[-12:])
    # One cause: no rank blames another (under DeepSpeed's launcher it is said again after its kill lines, as the last
    # rank ends: train/job_watch.py)
    assert all(cause.match(line) for line in out if line.startswith("error (")), "\n".join(out)
