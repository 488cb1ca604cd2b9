"""The examples under each launcher, as a user starts them: torchrun, accelerate launch, plain python.

Each is a two-step run of the tiny model on CPU in a subprocess, with a bounded timeout and its own free port
(suites run side by side on one machine). They check that the job starts, trains and ends, not its numbers:
those are test_hf_trainer.py's and test_training.py's. The launches run side by side, three at a time
(tests/_launches.py): each leaves a core idle much of its start-up.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

from tests._dist import _free_port
from tests._launches import launches_fixture

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


def _hf_trainer_on_two_nodes(tmp):
    # The Trainer path on a cluster: torchrun on each of two (simulated) nodes, one rank each, sp 2 over both.
    from tests._nodes import launch_nodes

    (rc0, out, _), (rc1, out1, _) = launch_nodes(
        [str(ROOT / "examples" / "hf_trainer.py"), "--steps", "2", "--seq-len", "512", "--output-dir", str(tmp)],
        [tmp / "node0", tmp / "node1"], nproc_per_node=1, timeout=TIMEOUT_S)
    assert rc0 == 0 and rc1 == 0, out[-4000:] + out1[-4000:]
    return out


def test_torchrun_hf_trainer_on_two_nodes(launches):
    out = launches["torchrun hf_trainer two nodes"]
    assert "ulysses_lc nodes: 2 nodes x 1 rank: SP groups span up to 2 nodes" in out
    assert out.count("'loss'") == 2 and "eval_loss" in out
    assert_quiet(out)


def _accelerate_hf_trainer(tmp):
    return run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--main_process_port",
                "{port}", "--config_file", "examples/accelerate_zero3.yaml", "examples/hf_trainer.py", "--steps", "2",
                "--seq-len", "512", "--output-dir", str(tmp)])


def test_accelerate_launch_hf_trainer(launches):
    out = launches["accelerate hf_trainer"]
    assert out.count("'loss'") == 2 and "eval_loss" in out
    assert_quiet(out)


def _accelerate_cpu(tmp):
    return run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
                "--main_process_port", "{port}", "--config_file", "examples/accelerate_zero3.yaml",
                "examples/hf_trainer.py", "--steps", "1", "--seq-len", "256", "--output-dir", str(tmp)],
               expect_ok=False)


def test_accelerate_launch_cpu_is_refused(launches):
    # accelerate's --cpu path turns DeepSpeed off and starts one process without MPI: refused with the launch that works.
    assert "leave --cpu out" in launches["accelerate --cpu"]


def _train_1m_one_process(tmp):
    return run([sys.executable, "examples/train_1m.py", "--model", "tiny", "--steps", "2", "--seq-len", "256",
                "--output-dir", str(tmp), "--no-export"])


def test_python_train_1m_one_process(launches):
    assert "step 2/2" in launches["python train_1m"]


def _trl_sft_one_process(tmp):
    return run([sys.executable, "examples/trl_sft.py", "--steps", "1", "--max-length", "512", "--output-dir", str(tmp)])


def test_python_trl_sft_one_process(launches):
    assert "eval loss:" in launches["python trl_sft"]


def _trl_dpo_two_ranks(tmp):
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "{port}",
                "examples/trl_dpo.py", "--steps", "3", "--lora", "4", "--lr", "3e-3", "--output-dir", str(tmp)])


def test_torchrun_trl_dpo_two_ranks(launches):
    # TRL's DPOTrainer swapped for ulysses_lc's, sp 2 on two CPU ranks, generated pairs: the reward margin grows.
    out = launches["torchrun trl_dpo"]
    margins = [float(m) for m in out.split("reward margins:")[1].split("\n")[0].split()]
    assert len(margins) == 3 and margins[-1] > margins[0], out[-3000:]
    assert "eval loss:" in out


launches = launches_fixture({
    "torchrun hf_trainer two nodes": ("test_torchrun_hf_trainer_on_two_nodes", _hf_trainer_on_two_nodes),
    "accelerate hf_trainer": ("test_accelerate_launch_hf_trainer", _accelerate_hf_trainer),
    "torchrun trl_dpo": ("test_torchrun_trl_dpo_two_ranks", _trl_dpo_two_ranks),
    "python trl_sft": ("test_python_trl_sft_one_process", _trl_sft_one_process),
    "python train_1m": ("test_python_train_1m_one_process", _train_1m_one_process),
    "accelerate --cpu": ("test_accelerate_launch_cpu_is_refused", _accelerate_cpu),
}, workers=3)
