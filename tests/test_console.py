"""The first run and the console, and messages that lead somewhere (issue 42): each test fails when its item is undone.

In-process where the item is a check or a line (a run of one process, the tiny model); a launch only where the
launcher is what is tested.
"""

import json
import os
from dataclasses import replace

import pytest

from ulysses_lc.train import CheckFailed, TrainConfig, train

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _no_heavy_work(monkeypatch):
    import ulysses_lc.train.loop as loop

    def heavy(*a, **k):
        raise AssertionError("heavy work started before the checks")

    for name in ("load_tokenizer", "load_model", "build_token_stream"):
        monkeypatch.setattr(loop, name, heavy)


BASE = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=1, output_dir="run")
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    """Each test a job of one process, as plain `python` starts it: no launcher's variables (an earlier in-process run
    left its own), and no process group left behind for the tests after it."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.setenv(name, "")  # recorded, so that what a run sets is undone after the test
        monkeypatch.delenv(name)
    yield
    from ulysses_lc.parallel.distributed import destroy_distributed

    destroy_distributed()


# -- messages that lead somewhere ------------------------------------------------------------------------------

def test_deepspeed_config_keys_unknown_to_deepspeed_are_named_with_the_closest_before_any_work(tmp_path, monkeypatch):
    """An unknown top-level key trained on ZeRO stage 0 (DeepSpeed skips it) and was refused as "stage=0"; an unknown
    ZeRO key failed with DeepSpeed's pydantic error after the weights loaded and the run folder was made."""
    _no_heavy_work(monkeypatch)
    monkeypatch.chdir(tmp_path)
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"zero_optimisation": {"stage": 3}}))
    nested = tmp_path / "nested.json"
    nested.write_text(json.dumps({"zero_optimization": {"stage": 3, "overlap_comms": True,
                                                        "offload_param": {"devic": "cpu"}},
                                  "tensorboard": {"enabled": False, "output_pth": "tb"}}))
    with pytest.raises(CheckFailed) as e:
        train(replace(BASE, ds_config=str(typo)))
    assert "'zero_optimisation' is no key DeepSpeed knows" in str(e.value), str(e.value)
    assert "did you mean 'zero_optimization'?" in str(e.value) and "stage=0" not in str(e.value)
    with pytest.raises(CheckFailed) as e:
        train(replace(BASE, ds_config=str(nested)))
    message = str(e.value)
    for key, close in [("zero_optimization.overlap_comms", "overlap_comm"),
                       ("zero_optimization.offload_param.devic", "device"), ("tensorboard.output_pth", "output_path")]:
        assert f"'{key}' is no key DeepSpeed knows" in message and f"did you mean '{close}'?" in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nested.json", "typo.json"]  # no run folder made


def test_shipped_deepspeed_configs_and_the_examples_keys_are_known():
    from ulysses_lc.parallel.ds_config import CONFIG_NAMES, check_known_keys, load_deepspeed_config

    for name in CONFIG_NAMES:
        check_known_keys(load_deepspeed_config(name))
    # HF's "auto" values and the keys the README names as applied on a resume
    check_known_keys({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_max_live_parameters": 1e9},
                      "flops_profiler": {"enabled": False}, "comms_logger": {"enabled": False}, "activation_checkpointing": {},
                      "train_batch_size": "auto", "sequence_parallel_size": 2, "optimizer": {"type": "AdamW"}})


def test_a_model_path_that_looks_local_and_is_missing_says_the_folder_does_not_exist(tmp_path, monkeypatch):
    """It was taken for a hub name: offline, "no local copy in the Hugging Face cache"; online, a hub error."""
    from ulysses_lc.train.loading import load_model_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "Qwen3-8B").mkdir()
    with pytest.raises(ValueError) as e:
        load_model_config("./Qwen3-8b-typo")
    assert str(e.value).startswith(f"--model ./Qwen3-8b-typo: no such folder ({tmp_path}/Qwen3-8b-typo does not "
                                   "exist); did you mean --model ./Qwen3-8B?"), str(e.value)
    for name in ("../elsewhere", "/no/such/model", "~/no-such-model", "models/qwen/8b"):
        with pytest.raises(ValueError, match="no such folder"):
            load_model_config(name)
    with pytest.raises(ValueError) as e:  # a hub name (one slash) is still a hub name
        load_model_config("no-such-org/no-such-model")
    assert "no such folder" not in str(e.value)


def test_a_column_of_role_content_lists_under_text_column_is_read_as_messages(tmp_path):
    """`--text-column conversation` said "holds list, not text": a dead end for a chat dataset whose column has
    another name. It trains as the same rows under `messages` do (the reference), assistant turns only."""
    from ulysses_lc.data import build_token_stream, check_source
    from ulysses_lc.tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    rows = [[{"role": "user", "content": f"question {i} " * 3}, {"role": "assistant", "content": f"answer {i} " * 4}]
            for i in range(40)]
    (tmp_path / "conv.jsonl").write_text("".join(json.dumps({"conversation": r, "id": i}) + "\n"
                                                 for i, r in enumerate(rows)))
    (tmp_path / "msgs.jsonl").write_text("".join(json.dumps({"messages": r, "id": i}) + "\n"
                                                 for i, r in enumerate(rows)))
    found = check_source(str(tmp_path / "conv.jsonl"), tok, text_column="conversation")
    assert found["format"] == "messages" and found["loss_on"] == "completion", found

    def windows(name, **kw):
        stream = build_token_stream(str(tmp_path / name), tok, 128, 4, cache_dir=tmp_path / "cache", local_rank=0,
                                    progress=False, **kw)
        return [(s.input_ids.tolist(), s.labels.tolist()) for s in map(stream.sample, range(4))]

    assert windows("conv.jsonl", text_column="conversation") == windows("msgs.jsonl")


def test_resume_of_a_run_that_reached_its_steps_says_so_and_writes_nothing(tmp_path, monkeypatch):
    """It loaded the model, trained nothing, and rewrote the export and run.json."""
    import ulysses_lc.train.cli as cli

    def fail(e):  # cli's report ends the process (os._exit): here, the test's
        raise e

    monkeypatch.setattr(cli, "_fail", fail)
    main = cli.main
    monkeypatch.chdir(tmp_path)
    args = ["--model", "tiny", "--steps", "1", "--seq-len", "256", "--output-dir", "run", "--cache-dir", "cache"]
    main(args)
    written = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*") if p.is_file()}
    assert any(p.parent.name == "hf_export" for p in written)
    _no_heavy_work(monkeypatch)
    import sys
    from io import StringIO

    out = StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    main([*args, "--resume"])
    assert out.getvalue().strip() == (
        "run already reached step 1 (--steps 1): nothing to train, and its checkpoint, export and run.json stay as "
        "they are. To train on, pass --resume with a larger --steps (e.g. --steps 2); the schedule then continues "
        "from the factor reached."), out.getvalue()
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*") if p.is_file()} == written


def test_a_mistyped_flag_is_one_line_from_rank_0_naming_the_closest_flag(monkeypatch, capsys):
    """Every rank printed argparse's 36-line usage block, and no rank named the flag meant."""
    from ulysses_lc.train import parse_args

    for rank, expected in (("1", ""), ("0", "did you mean --seq-len (for --seq_len)?")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as e:
            parse_args(["--seq_len", "4096", "--steps", "2"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and expected in err and "usage:" not in err, err
        assert len(err.strip().splitlines()) == (1 if expected else 0), err


def test_each_rank_takes_its_share_of_the_nodes_cores_unless_told(monkeypatch):
    """Every rank took every core's threads: `deepspeed --num_gpus 2` on 2 cores ran 4-6x slower than one each."""
    import torch

    from ulysses_lc.parallel.distributed import share_cpu_threads

    before = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5}, raising=False)
    try:
        for env, threads, line in [
            ({"LOCAL_WORLD_SIZE": "2"}, 3, "3 per rank (6 cores / 2 ranks on this node; set OMP_NUM_THREADS to choose)"),
            ({"LOCAL_SIZE": "4"}, 1, "1 per rank (6 cores / 4 ranks on this node; set OMP_NUM_THREADS to choose)"),
            ({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "5"}, None, "OMP_NUM_THREADS=5, as set"),
        ]:
            for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS"):
                monkeypatch.delenv(name, raising=False)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            got = share_cpu_threads()
            assert line in got, got
            if threads is not None:
                assert torch.get_num_threads() == threads and os.environ["OMP_NUM_THREADS"] == str(threads)
    finally:
        torch.set_num_threads(before)


def test_the_explicit_kernel_is_said_once_a_process_whatever_the_shapes(caplog):
    """The start-up probe's shape is not the step's: the line came twice, the second inside the progress bar."""
    import logging

    import torch

    from ulysses_lc.mixers import explicit_attention as ea

    ea._LOGGED.clear()
    caplog.set_level(logging.INFO, logger="ulysses_lc.mixers.explicit_attention")
    for tokens in (16, 32):
        q = torch.randn(1, 2, tokens, 8)
        assert ea.explicit_attention(q, q, q, None, "auto") is not None
    assert sum("kernel called directly" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_dpo_pairs_that_leave_most_of_a_sequence_padding_suggest_packing(tmp_path):
    from ulysses_lc.data import parse_source
    from ulysses_lc.data.pairs import PairStream
    from ulysses_lc.tiny import tiny_tokenizer
    from ulysses_lc.train.console import pairs_line

    rows = [{"prompt": f"question {i}?", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(10)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    src, tok = parse_source(str(tmp_path / "pairs.jsonl")), tiny_tokenizer()
    one = PairStream.build(src, tok, 512)
    tokens = sum(2 * len(p) + len(c) + len(r) for (p, c, r), in one.windows)  # the reference: one pair a sequence
    line = pairs_line("pairs.jsonl", one, packing=False, steps=4, global_batch=1)
    assert line.startswith(f"pairs.jsonl: 10 preference pairs, {tokens:,} tokens, one per sequence: 10 sequences, "
                           f"{100 * (1 - tokens / (10 * 512)):.0f}% padding (over half of each sequence: --packing puts "
                           f"whole pairs together, about {512 * 10 // tokens} a sequence"), line
    packed = pairs_line("pairs.jsonl", PairStream.build(src, tok, 512, packing=True), packing=True, steps=4,
                        global_batch=1)
    assert "--packing" not in packed and "packed into 1 sequence," in packed and "repeats: 1 sequence for the 4" in \
        packed, packed


def test_a_run_says_its_threads_data_and_slow_stages_and_ends_with_a_summary(tmp_path, monkeypatch, caplog):
    """A data line in place of a raw UserWarning that the data repeats; a line before the weights load and before the
    engine starts (tens of silent seconds on a real model); a summary at the end, against the run's own records."""
    import logging
    import warnings

    import torch

    from ulysses_lc.data import DataRepeats

    monkeypatch.chdir(tmp_path)
    omp, threads = os.environ.pop("OMP_NUM_THREADS", None), torch.get_num_threads()
    (tmp_path / "book.txt").write_text("a plain book of ascii text. " * 25)  # 700 tokens: 2 windows of 256
    caplog.set_level(logging.INFO, logger="ulysses_lc")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            records = train(replace(BASE, data="book.txt", steps=3, lr=3e-3, cache_dir=str(tmp_path / "cache")))
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)
        if omp is not None:
            os.environ["OMP_NUM_THREADS"] = omp
        torch.set_num_threads(threads)
    assert not [w for w in caught if issubclass(w.category, DataRepeats)], [str(w.message) for w in caught]
    text = caplog.text
    cores = len(os.sched_getaffinity(0))
    assert f"  threads   {cores} per rank ({cores} core{'s' * (cores > 1)} / 1 rank on this node" in text, text
    assert (f"  data      book.txt: 1 plain-text document joined into one stream, 700 tokens; tokenized into the token "
            f"cache {tmp_path / 'cache'}; repeats: 2 sequences for the 3 of 3 steps, so the data is seen 1.5 times\n"
            in text), text
    order = [text.index(s) for s in ("loading the weights of tiny", "starting DeepSpeed's ZeRO-3 engine",
                                     "ulysses_lc run", "done: 3 steps in run (")]
    assert order == sorted(order), text
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in logged] == [r["loss"] for r in records]
    summary = text[text.index("done: 3 steps in run ("):]
    for line in ["  steps     1-3 trained in this run", "  tokens    768, ",
                 f"  loss      {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} (step 1 -> 3)",
                 "  memory    peak on rank 0: gpu -, host ", "  metrics   run/metrics.jsonl\n",
                 "  checkpoint run/checkpoints/step3 (--resume --output-dir run --steps N trains on)",
                 "  export    run/hf_export ("]:
        assert line in summary, summary


def test_a_run_that_never_started_leaves_no_folder_behind(tmp_path, monkeypatch):
    """A failure before the first step left runs/tiny-<time>/ holding only the lock (and run.json)."""
    import ulysses_lc.train.loop as loop

    monkeypatch.chdir(tmp_path)
    load = loop.load_model

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("out of memory while loading")

    monkeypatch.setattr(loop, "load_model", out_of_memory)
    cfg = replace(BASE, output_dir=None, cache_dir=str(tmp_path / "cache"), export=False)
    with pytest.raises(RuntimeError, match="out of memory while loading"):
        train(cfg)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]  # no runs/, no runs/tiny-*/
    (tmp_path / "mine").mkdir()
    with pytest.raises(RuntimeError):
        train(replace(cfg, output_dir="mine"))
    assert (tmp_path / "mine").is_dir()  # the user's folder stays
    monkeypatch.setattr(loop, "load_model", load)

    def fail_after_step_1(step, record):
        raise RuntimeError("after step 1")

    with pytest.raises(RuntimeError, match="after step 1"):
        train(cfg, on_step=fail_after_step_1)
    (run,) = (tmp_path / "runs").iterdir()
    assert (run / "metrics.jsonl").read_text().count("\n") == 1  # a step ended: the run is kept, with its record


def test_a_silent_failure_is_named_by_the_launcher_and_a_reported_one_is_left_last():
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ulysses_lc.train.launcher import _name_a_silent_failure

    killed = ProcessFailure(local_rank=1, pid=4242, exitcode=-9, error_file="/no/such/error.json")
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _name_a_silent_failure(ChildFailedError("ulysses_lc.train", {1: killed}))
    assert err.getvalue().startswith("error (rank 1, pid 4242 on host ") and \
        "it was killed by SIGKILL without a report (SIGKILL: the kernel's out-of-memory killer" in err.getvalue()


def test_the_launcher_ends_with_the_jobs_last_word_and_waits_for_its_ranks_on_ctrl_c(tmp_path):
    """`ulysses-lc-train --nproc-per-node 2`: torchrun ended each failure's cause with ~40 lines of its
    ChildFailedError, and DeepSpeed's runner gave the prompt back on Ctrl-C while the ranks trained on for ~14 s and
    printed over it. Here the last line is the job's (the stop's, the failure's cause) and no rank outlives the
    launcher; the start-up says each line once."""
    import re
    import signal
    import subprocess
    import sys

    import psutil

    from tests.test_run import _env

    env = {k: v for k, v in _env().items() if k not in LAUNCH_VARIABLES}  # the launcher's own job, not a rank of one
    env.pop("OMP_NUM_THREADS")  # the ranks take their share of the cores themselves
    main = [sys.executable, "-m", "ulysses_lc.train", "--nproc-per-node", "2"]
    typo = subprocess.run([*main, "--seq_len", "256"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert typo.returncode == 2 and typo.stdout == "", typo.stdout
    assert typo.stderr.strip().splitlines() == ["__main__.py: error: unrecognized arguments: --seq_len 256; did you "
                                                "mean --seq-len (for --seq_len)? (--help lists every flag)"], typo.stderr
    args = ["--steps", "50", "--seq-len", "256", "--no-export", "--output-dir", "run", "--cache-dir", "cache"]
    proc = subprocess.Popen([*main, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step 3/"):
            break
    ranks = psutil.Process(proc.pid).children(recursive=True)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal's group, which holds the launcher (not the ranks)
    os.killpg(proc.pid, signal.SIGINT)  # and again, impatient: the launcher still waits
    out = "".join(seen) + proc.stdout.read()
    proc.wait(timeout=120)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), out
    lines = [line for line in out.splitlines() if line.strip()]
    assert proc.returncode == 130 and re.fullmatch(r"stopped at step (\d+) of 50 by SIGINT .*; checkpoint "
                                                   r"run/checkpoints/step\1 written: --resume --output-dir run continues",
                                                   lines[-1]), lines[-4:]
    step = int(lines[-1].split()[3])
    start = out[:out.index("step 1/")]
    assert start.count("ulysses_lc run") == 1 and re.search(r"\n  threads   (\d+) per rank \((\d+) cores? / 2 ranks on "
                                                            r"this node; set OMP_NUM_THREADS", start), start
    for noise in ("attention:", "RoPE for", "Setting accelerator to CPU", "UserWarning", "FutureWarning", "usage:"):
        assert noise not in out, (noise, out)
    # A failure: its cause is the last line, with no launcher traceback or summary after it.
    failed = subprocess.run([*main, *args, "--resume", "--steps", str(step + 2), "--lr", "1e30"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    lines = [line for line in (failed.stdout + failed.stderr).splitlines() if line.strip()]
    # The divergence guard's refusal, which every rank finds: the job's first report names its rank where that is not
    # rank 0 (cli.py).
    assert failed.returncode == 1 and re.match(r"error( \(rank 1\))?: step \d+: loss ", lines[-1]) and \
        "--resume --output-dir run" in lines[-1], lines[-6:]
    assert "ChildFailedError" not in failed.stderr and "Traceback" not in failed.stderr, failed.stderr[-3000:]


def test_the_launchers_flags_reach_torchs_agent_and_a_job_of_many_nodes_needs_its_address(monkeypatch):
    """--nnodes/--node-rank/--master-addr/--master-port are torchrun's, passed to its agent's static rendezvous."""
    import torch.distributed.launcher.api as api

    from ulysses_lc.train.launcher import launch, split

    seen = {}

    def elastic_launch(config, entrypoint):
        seen.update(config=config, entrypoint=entrypoint)
        return lambda *args: seen.update(args=args)

    monkeypatch.setattr(api, "elastic_launch", elastic_launch)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what the launcher sets without a GPU, undone after the test
    flags, job = split(["--nproc-per-node", "8", "--steps", "3", "--nnodes", "2", "--node_rank", "1", "--master-addr",
                        "gpu-a", "--master-port", "29555"])
    assert job == ["--steps", "3"]
    assert launch(flags, job, stop_grace_s=25) == 0
    config = seen["config"]
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.rdzv_backend, config.rdzv_endpoint,
            config.rdzv_configs["rank"], config.max_restarts) == (2, 2, 8, "static", "gpu-a:29555", 1, 0)
    assert seen["args"] == ("-u", "-m", "ulysses_lc.train", "--steps", "3")
    assert split(["--steps", "3"]) == (None, ["--steps", "3"])
    for argv, words in [(["--nproc-per-node", "2", "--nnodes", "2"], "pass --master-addr"),
                        (["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "2", "--master-addr", "a"],
                         "--node-rank 2 of --nnodes 2"),
                        (["--nnodes", "2"], "go with --nproc-per-node")]:
        with pytest.raises(ValueError, match=words):
            launch(split(argv)[0], [], stop_grace_s=25)
    monkeypatch.setenv("RANK", "0")  # under torchrun or deepspeed already
    with pytest.raises(ValueError, match="already a rank"):
        launch(split(["--nproc-per-node", "2"])[0], [], stop_grace_s=25)
