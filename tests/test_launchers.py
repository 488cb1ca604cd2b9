"""The examples under each launcher, as a user starts them: torchrun, accelerate launch, plain python.

Each is a two-step run of the tiny model on CPU in a subprocess, with a bounded timeout and its own free port
(suites run side by side on one machine). They check that the job starts, trains and ends, not its numbers:
those are test_hf_trainer.py's and test_training.py's.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests._dist import _free_port

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 600  # a hang guard, not a speed test: a run takes ~15 s here, and 10x that on a machine shared 8 ways


def run(cmd: list[str], expect_ok: bool = True) -> str:
    """Run cmd from the repository root; its stdout and stderr together. Retried once on a port taken meanwhile."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for attempt in range(2):
        port = str(_free_port())
        argv = [port if a == "{port}" else a for a in cmd]
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
        out = proc.stdout + proc.stderr
        if "EADDRINUSE" not in out and "address already in use" not in out.lower():
            break
    assert (proc.returncode == 0) == expect_ok, f"{' '.join(argv)} -> {proc.returncode}\n{out[-4000:]}"
    assert "deepspeed_shm_comm" not in out, out  # DeepSpeed's CPU shm op neither built nor loaded (distributed.py)
    return out


def assert_quiet(out: str) -> None:
    """As quiet as the main job: no rank repeats rank 0's warnings, DeepSpeed's deprecation warnings filtered,
    and the example's own print of evaluate() (unquoted numbers, unlike the Trainer's log line) once."""
    assert "FutureWarning" not in out, out
    assert len(re.findall(r"'eval_loss': \d", out)) == 1, out


def test_torchrun_hf_trainer_on_two_nodes(tmp_path):
    # The Trainer path on a cluster: torchrun on each of two (simulated) nodes, one rank each, sp 2 over both.
    from tests._nodes import launch_nodes

    (rc0, out, _), (rc1, out1, _) = launch_nodes(
        [str(ROOT / "examples" / "hf_trainer.py"), "--steps", "2", "--seq-len", "512", "--output-dir", str(tmp_path)],
        [tmp_path / "node0", tmp_path / "node1"], nproc_per_node=1, timeout=600)
    assert rc0 == 0 and rc1 == 0, out[-4000:] + out1[-4000:]
    assert "ulysses_lc nodes: 2 nodes x 1 rank: SP groups span up to 2 nodes" in out
    assert out.count("'loss'") == 2 and "eval_loss" in out
    assert_quiet(out)


def test_accelerate_launch_hf_trainer(tmp_path):
    out = run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--main_process_port",
               "{port}", "--config_file", "examples/accelerate_zero3.yaml", "examples/hf_trainer.py", "--steps", "2",
               "--seq-len", "512", "--output-dir", str(tmp_path)])
    assert out.count("'loss'") == 2 and "eval_loss" in out
    assert_quiet(out)


def test_accelerate_launch_cpu_is_refused(tmp_path):
    # accelerate's --cpu path turns DeepSpeed off and starts one process without MPI: refused with the launch that works.
    out = run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
               "--main_process_port", "{port}", "--config_file", "examples/accelerate_zero3.yaml",
               "examples/hf_trainer.py", "--steps", "1", "--seq-len", "256", "--output-dir", str(tmp_path)],
              expect_ok=False)
    assert "leave --cpu out" in out


def test_python_train_1m_one_process(tmp_path):
    out = run([sys.executable, "examples/train_1m.py", "--model", "tiny", "--steps", "2", "--seq-len", "1024",
               "--output-dir", str(tmp_path), "--no-export"])
    assert "step 2/2" in out


def test_python_trl_sft_one_process(tmp_path):
    out = run([sys.executable, "examples/trl_sft.py", "--steps", "1", "--max-length", "512",
               "--output-dir", str(tmp_path)])
    assert "eval loss:" in out


def test_torchrun_trl_dpo_two_ranks(tmp_path):
    # TRL's DPOTrainer swapped for ulysses_lc's, sp 2 on two CPU ranks, generated pairs: the reward margin grows.
    out = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "{port}",
               "examples/trl_dpo.py", "--steps", "3", "--lora", "4", "--lr", "3e-3", "--output-dir", str(tmp_path)])
    margins = [float(m) for m in out.split("reward margins:")[1].split("\n")[0].split()]
    assert len(margins) == 3 and margins[-1] > margins[0], out[-3000:]
    assert "eval loss:" in out
