"""The first hour of a user (issue 14): packaging, cheap checks, run directories, checkpoints, failure reports,
the console and --dry-run. Each test fails when its item is undone."""

import json
import os
import shutil
import socket
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from tests._dist import _free_port, run_distributed, run_shared
from ulysses_lc.parallel.ds_config import CONFIG_NAMES, deepspeed_config_path, load_deepspeed_config
from ulysses_lc.train import CheckFailed, NonFiniteError, TrainConfig, dry_run, parse_args, train
from ulysses_lc.train.console import RunLogger

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent


def _env():
    # Subprocesses import this checkout, whatever else is installed.
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


# -- a. packaging -----------------------------------------------------------------------------------------

def test_ds_config_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in CONFIG_NAMES:
        assert load_deepspeed_config(name)["zero_optimization"]["stage"] == 3
        # From a checkout the one copy is the top-level ds_configs/ (no second copy inside the package).
        assert deepspeed_config_path(name) == REPO / "ds_configs" / f"{name}.json"
    assert not (REPO / "ulysses_lc" / "ds_configs").exists()
    with pytest.raises(ValueError, match="zero3, zero3_offload_optimizer, zero3_offload_all"):
        load_deepspeed_config("zero4")


def test_wheel_ships_configs_and_finds_them_from_another_folder(tmp_path):
    """A non-editable install (the wheel, unpacked into a target folder) finds its configs by name."""
    # Built from a copy: setuptools' in-tree build/ folder would otherwise keep stale modules between builds.
    src = tmp_path / "src"
    for folder in ("ulysses_lc", "ds_configs"):
        shutil.copytree(REPO / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, cwd=tmp_path, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("ulysses_lc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    # The top-level ds_configs/ ships inside the package; pyproject lists the packages by hand, so every module
    # of the checkout must be in the wheel (a new subpackage left off the list fails here).
    assert {f"ulysses_lc/ds_configs/{n}.json" for n in CONFIG_NAMES} <= names
    shipped = {p.relative_to(REPO).as_posix() for p in (REPO / "ulysses_lc" / "model_configs").rglob("*")
               if p.is_file()}
    assert shipped and shipped <= names, sorted(shipped - names)  # a dry run of a hub name needs no network
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "ulysses_lc").rglob("*.py")}
    assert modules <= names, sorted(modules - names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    probe = ("import ulysses_lc, ulysses_lc.parallel.ds_config as d; print(ulysses_lc.__file__); "
             "print(d.load_deepspeed_config('zero3_offload_all')['zero_optimization']['offload_param']); "
             "from ulysses_lc.train.loading import shipped_config; print(shipped_config('Qwen/Qwen3-8B'))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)},
                         check=True, capture_output=True, text=True).stdout
    assert out.startswith(str(site)), out
    assert "'device': 'cpu'" in out
    assert f"{site}/ulysses_lc/model_configs/Qwen__Qwen3-8B" in out, out


# -- b. cheap checks before heavy work ----------------------------------------------------------------------

def _no_heavy_work(monkeypatch):
    import deepspeed

    import ulysses_lc.train.loop as loop

    def heavy(*a, **k):
        raise AssertionError("heavy work started before the checks")

    for name in ("load_tokenizer", "load_model", "build_token_stream"):
        monkeypatch.setattr(loop, name, heavy)
    monkeypatch.setattr(deepspeed, "init_distributed", heavy)


def test_checks_refuse_before_any_heavy_work(tmp_path, monkeypatch):
    _no_heavy_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "a_file").write_text("")
    base = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=1)
    cases = {
        "is a file, not a folder": replace(base, output_dir="a_file"),
        "cannot be created: a_file is a file": replace(base, output_dir="a_file/run"),
        "no file or folder exists": replace(base, data="missing.txt", output_dir="out"),
        "zero3, zero3_offload_optimizer": replace(base, ds_config="zero3.json", output_dir="out"),
        "--keep-checkpoints -1": replace(base, keep_checkpoints=-1, output_dir="out"),
    }
    monkeypatch.setitem(sys.modules, "wandb", None)
    cases["pip install 'ulysses_lc[wandb]'"] = replace(base, wandb_project="p", output_dir="out")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # not installed
    cases["pip install 'ulysses_lc[tensorboard]'"] = replace(base, tensorboard=True, output_dir="out")
    for fragment, cfg in cases.items():
        with pytest.raises(CheckFailed) as e:
            train(cfg)
        assert fragment in str(e.value), (fragment, str(e.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # nothing written by a refused run


# -- c. runs and checkpoints --------------------------------------------------------------------------------

class Killed(Exception):
    pass


def _runs_worker(rank, world_size, tmp):
    # On the session's shared ranks: the folder and the stand-in wandb are this body's, and undone after it.
    # accelerate lists the trackers it finds when first imported: imported first, its list is the rank's own.
    import accelerate.tracking  # noqa: F401

    home, real_wandb = os.getcwd(), sys.modules.get("wandb")
    os.chdir(tmp)
    sys.modules["wandb"] = _fake_wandb(Path(tmp) / "wandb.jsonl")
    try:
        return _runs(tmp)
    finally:
        os.chdir(home)
        if real_wandb is None:
            sys.modules.pop("wandb", None)
        else:
            sys.modules["wandb"] = real_wandb


def _runs(tmp):
    import deepspeed.runtime.engine as ds_engine

    base = TrainConfig(model="tiny", data="tiny", seq_len=512, steps=4, lr=3e-3, cache_dir=f"{tmp}/cache", export=False)
    result = {}
    # Every step saved, two kept.
    full = train(replace(base, output_dir="full", save_every=1, keep_checkpoints=2, wandb_project="p"))
    result["losses"] = [r["loss"] for r in full]
    result["kept"] = sorted(p.name for p in Path("full/checkpoints").glob("step*"))

    # A crash inside the step-4 save, after DeepSpeed wrote its files but with one rank's shard missing.
    original = ds_engine.DeepSpeedEngine.save_checkpoint

    def crashing_save(self, save_dir, tag=None, *args, **kwargs):
        original(self, save_dir, tag, *args, **kwargs)
        if tag == "step4":
            for f in Path(save_dir, tag).glob("*rank_1*"):
                f.unlink(missing_ok=True)
            raise Killed

    ds_engine.DeepSpeedEngine.save_checkpoint = crashing_save
    try:
        train(replace(base, output_dir="crashed", save_every=2))
    except Killed:
        result["latest_after_crash"] = Path("crashed/checkpoints/latest").read_text()
    finally:
        ds_engine.DeepSpeedEngine.save_checkpoint = original
    resumed = train(replace(base, output_dir="crashed", resume=True))
    result["resumed"] = [r["loss"] for r in resumed]

    # A diverging run stops at the step that blew the weights up, before saving it.
    try:
        train(replace(base, output_dir="diverged", lr=1e30, save_every=1))
    except NonFiniteError as e:
        result["nonfinite"] = str(e)
    result["diverged_saved"] = Path("diverged/checkpoints").exists()
    return result


FAKE_WANDB = """
import json

LOG = None  # the file each call is written to

def _write(*call):
    with open(LOG, "a") as f:
        f.write(json.dumps(call) + "\\n")

class _Run:
    def log(self, data, step=None):
        _write("log", step, data["loss"])

    def finish(self):
        _write("finish")

def init(**kwargs):
    _write("init", kwargs["project"], kwargs["name"])
    return _Run()
"""


def _fake_wandb(log: Path):
    """A stand-in wandb module (the real one is an optional extra) that writes each call to `log`."""
    import importlib.machinery
    import importlib.util

    # a spec, as an installed module has: accelerate and transformers ask importlib.util.find_spec("wandb")
    module = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("wandb", None))
    exec(FAKE_WANDB, module.__dict__)
    module.LOG = str(log)
    return module


def test_keep_atomic_save_resume_nonfinite_stop_and_wandb(tmp_path):
    result = run_shared(_runs_worker, 2, str(tmp_path), kind="deepspeed")[0]
    calls = [json.loads(line) for line in (tmp_path / "wandb.jsonl").read_text().splitlines()]
    assert calls[0] == ["init", "p", "full"] and calls[-1] == ["finish"]  # rank 0 only: one run
    assert [c[2] for c in calls[1:-1]] == result["losses"] and [c[1] for c in calls[1:-1]] == [1, 2, 3, 4]
    assert result["kept"] == ["step3", "step4"]
    assert result["latest_after_crash"] == "step2"  # not the half-written step4
    assert len(result["resumed"]) == 2
    np.testing.assert_allclose(result["resumed"], result["losses"][2:], rtol=1e-6)
    message = result.get("nonfinite")
    assert message is not None, "a blown-up update did not stop the run"
    assert message.startswith("step 1: ") and "Last good checkpoint: none." in message and "Lower --lr" in message
    assert "--lr 0.003 --output-dir diverged" in message and not result["diverged_saved"]  # start again, as printed


# -- c, d, e: the command line as a user runs it ------------------------------------------------------------

LAUNCHERS = {  # two ranks each, on a free port: torchrun's default 29500 would meet a suite running beside this one
    "torchrun": lambda port: [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                              "--master_port", str(port)],
    "deepspeed": lambda port: [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2",
                               "--master_port", str(port)],
}


def _launch(args, cwd, timeout=600, entry=("-m", "ulysses_lc.train"), launcher="torchrun"):
    """The job under a launcher, as a user starts it; (the finished process, its port). Retried once on a port
    taken between finding it free and binding it."""
    for attempt in range(2):
        port = _free_port()
        cmd = [*LAUNCHERS[launcher](port), *entry, *args]
        proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
        if "address already in use" not in (proc.stdout + proc.stderr).lower():
            break
    out = proc.stdout + proc.stderr
    assert "deepspeed_shm_comm" not in out, out  # DeepSpeed's CPU shm op is neither built nor loaded (its lock)
    return proc, port


def test_failure_is_reported_once_last_and_fast(tmp_path):
    (tmp_path / "a_file").write_text("")
    proc, _ = _launch(["--output-dir", "a_file"], tmp_path, entry=[str(REPO / "examples" / "train_1m.py")])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "ulysses_lc run" not in out, out  # fast: refused before the start-up block, the model and DeepSpeed
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    cause = "--output-dir a_file is a file, not a folder; pass a folder"
    assert sum(line.startswith("error") and cause in line for line in lines) == 1, out  # once, by rank 0
    assert any(cause in line for line in lines[-3:]), out  # the last thing printed (torchrun's summary ends with it)
    assert "Traceback" not in out.split("Root Cause")[0] or "ChildFailedError" in out, out
    for noise in ("Connection closed", "gloo", "DistBackendError"):
        assert noise not in out, out


def test_readme_commands_run_twice_from_another_folder_and_leave_nothing(tmp_path):
    # README's two commands, from a folder of their own: the deepspeed launcher on examples/train_1m.py (the one
    # that maps DeepSpeed's CPU shm buffers), then torchrun on the module.
    args = ["--steps", "2", "--seq-len", "512", "--no-export"]
    first, port = _launch(args, tmp_path, entry=[str(REPO / "examples" / "train_1m.py")], launcher="deepspeed")
    assert first.returncode == 0, first.stdout + first.stderr
    assert_nothing_left(port, tmp_path)
    second, port = _launch(args, tmp_path)
    assert second.returncode == 0, second.stdout + second.stderr  # a rerun is a new run, not a refusal
    assert_nothing_left(port, tmp_path)
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2 and all(p.name.startswith("tiny-") for p in runs)
    out = first.stdout + first.stderr
    assert f"writing to runs/{runs[0].name}" in out and f"done: 2 steps in runs/{runs[0].name}" in out
    steps = [line for line in first.stdout.splitlines() if line.startswith("step ")]
    assert [s.split(" |")[0] for s in steps] == ["step 1/2", "step 2/2"]  # one line each, no bar in between
    assert all("TFLOPS/GPU - | MFU - | gpu -" in s for s in steps)  # no "0.0 TFLOPS/GPU" without a GPU
    assert out.count("ulysses_lc run") == 1 and ("YaRN" in out or "RoPE" in out) and "predicted" in out
    for noise in ("FutureWarning", "Failed to recv", "training:"):
        assert noise not in out, out


def assert_nothing_left(port: int, cwd: Path) -> None:
    """A finished run left no shared memory, port or process behind. DeepSpeed's CPU shm all-reduce named its
    buffers /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> (69 MB each, never unlinked); only this
    run's port and folder are looked for, since runs beside this one may hold their own."""
    import psutil

    left = [p.name for p in Path("/dev/shm").glob("deepspeed_*") if f"_{port}_" in p.name]
    assert left == [], left
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT is not a holder
        s.bind(("127.0.0.1", port))  # no process listens on the rendezvous port any more
    alive = []
    for proc in psutil.process_iter(["pid", "cwd", "cmdline"]):
        if proc.info["cwd"] == str(cwd):
            alive.append(proc.info)
    assert alive == [], alive  # every rank and launcher has exited


def test_step_line_dashes_what_does_not_apply():
    record = {"step": 1, "total_steps": 2, "loss": 1.0, "grad_norm": None, "lr": None, "tokens": 8, "step_time_s": 1.0,
              "tokens_per_s": 8.0, "tflops_per_gpu": None, "mfu": None, "gpu_mem_gb": None, "host_rss_gb": 1.0,
              "host_used_gb": 2.0}
    line = RunLogger.format_line(record)
    assert "grad_norm - | lr - |" in line and "TFLOPS/GPU - | MFU - | gpu - |" in line


# -- f. --dry-run -------------------------------------------------------------------------------------------

def test_dry_run_predicts_without_loading(tmp_path, monkeypatch):
    import torch
    from transformers import Qwen3Config

    _no_heavy_work(monkeypatch)

    def no_gpu(*a, **k):
        raise AssertionError("the dry run touched the GPU")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_gpu)
    # Qwen3-8B's shape, as a local folder holding only its config.
    folder = tmp_path / "qwen3-8b"
    Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rope_theta=1e6, tie_word_embeddings=False).save_pretrained(folder)
    cfg = TrainConfig(model=str(folder), data="tiny", seq_len=1_048_576, dry_run=True, world_size=8, sp_size=8,
                      host_memory_gb=250)
    text = dry_run(cfg)
    assert "8 ranks = sp 8" in text and "YaRN factor 25.6" in text
    params = 8_190_735_360
    state = float(text.split("ZeRO-3 state ")[1].split(",")[0])
    assert abs(state - 18 * params / 8 / 1e9) < 0.1  # bf16 + fp32 master + fp32 grad + Adam, over 8 ranks
    assert "predicted: gpu" in text and "nothing was loaded" in text
    offload = dry_run(replace(cfg, ds_config="zero3_offload_all"))
    assert "ZeRO-3 state 0.0" in offload  # everything on the host
    with pytest.raises(CheckFailed, match="pick sp_size in"):
        dry_run(replace(cfg, sp_size=3))
    assert json.loads((folder / "config.json").read_text())["num_hidden_layers"] == 36


def _train_in(rank, world_size, cwd, cfg):
    """train(cfg) run from the folder `cwd` (relative paths as a job started there reads them) with one thread, as
    _env gives a launched job's ranks (the same sums); then the folder and threads back, for the next body."""
    import torch

    home, threads, given = os.getcwd(), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    os.chdir(cwd)
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        return train(cfg)
    finally:
        os.chdir(home)
        torch.set_num_threads(threads)
        if given is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = given


# -- g. faults ----------------------------------------------------------------------------------------------

def test_sigkill_of_a_rank_ends_the_job_and_resume_replays_it(tmp_path):
    """A rank killed mid-run ends every rank, without waiting out a collective's timeout; --resume replays the steps after the last checkpoint
    with the same losses the killed run logged."""
    import signal

    import psutil

    # A constant lr: the resumed run asks for fewer steps, which must not change the schedule of the replayed ones.
    args = ["--steps", "40", "--seq-len", "512", "--save-every", "2", "--lr-schedule", "constant", "--no-export",
            "--output-dir", "run"]
    cmd = [*LAUNCHERS["torchrun"](_free_port()), "-m", "ulysses_lc.train", *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if line.startswith("step 5/"):
            break
    workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if "ulysses_lc.train" in " ".join(p.cmdline())]
    assert len(workers) == 2, workers
    os.kill(workers[-1].pid, signal.SIGKILL)
    proc.stdout.read()
    # A hang would wait out a collective's timeout (gloo's 30 min): 300 s tells the two apart on a loaded machine.
    proc.wait(timeout=300)
    assert proc.returncode != 0
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in workers)

    logged = {}
    for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        logged.setdefault(record["step"], record["loss"])
    # The resume is the main job's own (its launcher is not what this checks): on the session's shared ranks, from
    # the same folder and flags.
    resume = parse_args([*args[:-2], "--output-dir", "run", "--resume", "--steps", str(max(logged) + 1)])
    run_shared(_train_in, 2, str(tmp_path), resume, kind="deepspeed")
    start = int((tmp_path / "run" / "checkpoints" / "latest").read_text()[4:])  # after the resumed run: its end
    replayed = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()][len(logged):]
    assert replayed and start == max(logged) + 1
    for record in replayed:
        if record["step"] in logged:
            np.testing.assert_allclose(record["loss"], logged[record["step"]], rtol=1e-6)


def test_resume_with_other_settings_is_refused_and_another_world_or_sp_size_is_not(tmp_path, monkeypatch):
    # A checkpoint resumes on another world or SP size (its ZeRO-3 state resharded: tests/test_reshard.py trains
    # those resumes); what it trained on must stay: another seq_len would move the data position into other
    # windows. Both refused before anything starts.
    from ulysses_lc.train import RunSettings, preflight

    monkeypatch.delenv("RANK", raising=False)
    run = tmp_path / "run"
    (run / "checkpoints" / "step2").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step2")
    cfg = TrainConfig(model="tiny", data="tiny", seq_len=512, output_dir=str(run), resume=True)
    (run / "run.json").write_text(json.dumps({"model": "tiny", "seq_len": 512, "data": "tiny", "sp_size": 2, "world_size": 2}))
    with pytest.raises(CheckFailed, match="seq_len=512, not 1024; resume with the same settings"):
        preflight(RunSettings(replace(cfg, seq_len=1024)), 2)
    # The world and SP sizes pass the run.json check; the checkpoint's own files are then read for the saved layout.
    with pytest.raises(CheckFailed, match=r"has no zero_pp_rank_\*_mp_rank_00_model_states.pt: it is incomplete"):
        preflight(RunSettings(replace(cfg, sp_size=4)), 4)


_HELD = []  # a script's module-level layout: held until the interpreter is torn down


def _exit_worker(rank, world_size):
    """Collectives left pending on a group of a held layout, then main() around a stubbed loop; whether a group is
    left. run_distributed's ranks end with destroy_distributed and a full interpreter exit, and an exit code other
    than 0 fails the run."""
    import torch
    import torch.distributed as dist

    import ulysses_lc.train.loop as loop
    from ulysses_lc import ParallelLayout
    from ulysses_lc.train import main

    layout = ParallelLayout.build(world_size)
    _HELD.append(layout)
    for _ in range(200):  # handles and tensors dropped at once, as a step's own collectives are
        torch.distributed.all_reduce(torch.ones(100_000), group=layout.sp_group, async_op=True)
    loop.train = lambda cfg: None  # the loop itself is tested above; here only what main does around it
    main(["--steps", "1"])
    return dist.is_initialized()


def test_main_and_pending_collectives_end_the_process_group_cleanly():
    # Two checks of how ranks end, in one start of 2 fresh ranks (a start costs ~13 s of imports on 2 cores), each
    # failing alone. main() destroys the process group at exit: with NCCL, ranks that exit with their group alive
    # print TCPStore "Failed to recv" warnings (gloo is silent, so this checks the teardown itself). Collectives
    # pending on a group still end cleanly: a barrier on the default group alone left them to gloo's workers during
    # interpreter teardown, and 7 launches of 8 aborted ("terminate called without an active exception"), an exit
    # code run_distributed fails.
    assert run_distributed(_exit_worker, 2) == [False, False]


FAIL_SCRIPT = """
import json
import os
import sys

import ulysses_lc.train.cli as cli
from ulysses_lc.train import CheckFailed

cli.GRACE_S = cli.LOST_PEER_S = 0  # the waits let the launcher stop this rank first; none here
errors = {"check": lambda: CheckFailed("--x is wrong; pass --y"), "bug": lambda: KeyError("boom"),
          "peer": lambda: RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")}
folder, cases = sys.argv[1], json.loads(sys.argv[2])
for i, (rank, case) in enumerate(cases):
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()  # each case a process of its own, as a rank is, after the imports (seconds) were done once
    if pid == 0:
        os.environ["RANK"] = rank
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(f"{folder}/{i}.{stream}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        try:
            raise errors[case]()
        except BaseException as e:
            cli._fail(e)
        os._exit(99)  # _fail returned
    status = os.waitpid(pid, 0)[1]
    with open(f"{folder}/{i}.rc", "w") as f:
        f.write(str(os.waitstatus_to_exitcode(status)))
"""
FAILURES = [
    ("0", "check", ["error: --x is wrong; pass --y"]),
    ("1", "check", []),  # rank 0 reports what every rank found
    ("1", "bug", ["Traceback", "KeyError: 'boom'", "error (rank 1): 'boom'"]),  # a bug: where it is, then what
    ("0", "peer", ["error: lost contact with another rank, which failed or was killed"]),  # no collective's traceback
]


@pytest.fixture(scope="module")
def failure_reports(tmp_path_factory):
    """Each case of FAILURES failed in a process of its own: (exit code, stdout, stderr) by (rank, case). One Python
    start for all (forked after its imports), not one each; what the imports printed is part of each case's output,
    as it was of a process started for the case alone."""
    folder = tmp_path_factory.mktemp("failures")
    cases = [(rank, case) for rank, case, _ in FAILURES]
    proc = subprocess.run([sys.executable, "-c", FAIL_SCRIPT, str(folder), json.dumps(cases)], env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {key: (int((folder / f"{i}.rc").read_text()), proc.stdout + (folder / f"{i}.stdout").read_text(),
                  proc.stderr + (folder / f"{i}.stderr").read_text()) for i, key in enumerate(cases)}


@pytest.mark.parametrize("rank,case,expected", FAILURES)
def test_each_failure_is_reported_by_one_rank_concisely(rank, case, expected, failure_reports):
    returncode, stdout, stderr = failure_reports[rank, case]
    assert returncode == 1
    lines = [line for line in stderr.splitlines() if line.strip() and "[WARNING]" not in line]
    if not expected:
        assert lines == [], lines
    else:
        assert lines[0].startswith(expected[0]) and lines[-1].startswith(expected[-1]), lines
        assert all(any(e in line for line in lines) for e in expected)
    assert stdout.strip() == "" or "[WARNING]" in stdout
