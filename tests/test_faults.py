"""Faults that lose nothing and say what happened (issues 23 and 30). Each test fails when its item is undone.

Launches are few and short (the tiny model, 2 ranks, seq-len 256): a two-core CI machine pays ~10 s per launch
for imports alone, so one in-process run covers the cases that need no launcher, and each launcher run shows
several things.
"""

import json
import math
import os
import re
import shlex

from pathlib import Path

import numpy as np
import pytest

from ulysses_lc.data import build_token_stream
from ulysses_lc.tiny import tiny_text, tiny_tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# -- data identity by content -------------------------------------------------------------------------------

def test_an_edit_that_keeps_size_and_mtime_is_noticed_on_resume(tmp_path):
    tokenizer = tiny_tokenizer()
    book = tmp_path / "book.txt"
    book.write_text(tiny_text(20_000, seed=3))

    def stream(cache):
        return build_token_stream(book, tokenizer, 256, 4, cache_dir=tmp_path / cache, progress=False)

    checkpoint = stream("cache")
    checkpoint.position = 2
    saved = checkpoint.state_dict()
    os.utime(book)  # a new time, the same bytes: resumes (no size-and-time identity to trip on)
    stream("cache").load_state_dict(saved)

    stat = book.stat()
    with open(book, "r+b") as f:  # edited in place, same size, its time put back (as cp -p, rsync -t, tar do)
        f.seek(100)
        f.write(b"XYZ")
    os.utime(book, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert book.stat().st_size == stat.st_size and book.stat().st_mtime_ns == stat.st_mtime_ns
    for cache in ("cache", "empty-cache-of-another-node"):
        with pytest.raises(ValueError, match="the data changed since the checkpoint was written"):
            stream(cache).load_state_dict(saved)
    fresh = stream("cache")
    assert not np.array_equal(fresh.tokens, checkpoint.tokens)  # the old cache's stale tokens are not reused


# -- flags on resume (issue 30) -------------------------------------------------------------------------------

def _resume_worker(rank, world_size, tmp):
    import logging
    from dataclasses import replace

    from tests.test_training import train_worker
    from ulysses_lc.train import NonFiniteError, TrainConfig, parse_args

    os.chdir(tmp)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ulysses_lc.train.loop").addHandler(handler)
    logging.getLogger("ulysses_lc.train.loop").setLevel(logging.INFO)
    base = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=4, lr=3e-3, save_every=1, cache_dir="cache",
                       export=False, output_dir="full")
    result = {}
    try:
        result["full"] = train_worker(rank, world_size, base)
        # Killed after step 3 (checkpoint at 2), resumed from the command line with more steps and nothing else.
        killed = replace(base, output_dir="longer", save_every=2)
        train_worker(rank, world_size, killed, 3)
        result["killed_lrs"] = [json.loads(line)["lr"] for line in open("longer/metrics.jsonl")]
        longer = parse_args(["--resume", "--output-dir", "longer", "--steps", "8"])
        result["longer"] = train_worker(rank, world_size, longer)
        # A resume with lr 1e30 (issue 45): the step-3 update leaves finite weights of ~1e29, whose step 4 would
        # overflow; the divergence guard stops the run before step 3 is saved.
        train_worker(rank, world_size, replace(base, output_dir="div"), 2)
        try:
            train_worker(rank, world_size, replace(base, output_dir="div", resume=True, lr=1e30))
        except NonFiniteError as e:
            result["nonfinite"] = str(e)
        result["div_latest"] = open("div/checkpoints/latest").read()
        # The advised resume, with a DeepSpeed config that changes only logging and ZeRO-3's bucket and prefetch
        # sizes: applied.
        advised = re.search(r"continue from it with (--resume .*?) \(", result.get("nonfinite", "")).group(1)
        result["recovered"] = train_worker(rank, world_size, parse_args([*shlex.split(advised), "--ds-config",
                                                                          "ds_logging.json"]))
    finally:
        logging.getLogger("ulysses_lc.train.loop").removeHandler(handler)
    result["lines"] = lines
    return result


def test_flags_on_resume_apply_with_a_line_and_metrics_hold_each_step_once(tmp_path):
    from tests._dist import run_shared
    from tests.test_training import losses_of

    from ulysses_lc.parallel.ds_config import load_deepspeed_config

    zero3 = load_deepspeed_config("zero3")
    (tmp_path / "ds_logging.json").write_text(json.dumps({**zero3, "steps_per_print": 1, "zero_optimization": {
        **zero3["zero_optimization"], "reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 4096,
        "stage3_param_persistence_threshold": 0}}))
    result = run_shared(_resume_worker, 2, str(tmp_path), kind="deepspeed")[0]
    text = "\n".join(result["lines"])
    assert "--ds-config on resume: steps_per_print 1000000 -> 1, zero_optimization.reduce_bucket_size 500000000.0 " \
           "-> 4096, zero_optimization.stage3_param_persistence_threshold 1000000.0 -> 0, " \
           "zero_optimization.stage3_prefetch_bucket_size 500000000.0 -> 4096: logging, or how ZeRO schedules" in text
    # A longer run: the settings not named (seq_len 256, save_every 2, the cache) are the saved run's; the cosine
    # decay continues from the lr it had, with no jump, and says so.
    assert "--steps 4 -> 8: the cosine decay continues from" in text and "(no jump)" in text, text
    lrs = [r["lr"] for r in result["longer"]]
    assert len(lrs) == 6 and lrs[0] < result["killed_lrs"][1], (result["killed_lrs"], lrs)  # from step 2's lr, down
    assert all(b <= a for a, b in zip(lrs, lrs[1:])), lrs
    # Each logged lr is the one its step trained with (issue 40): step 3's is the killed run's step 3's (no jump), and
    # the decay spans the 6 resumed steps down to the floor (min_lr_ratio 0.1) after the last, 5/6 of the way at it.
    floor = 0.1 * 3e-3
    assert abs(lrs[0] - result["killed_lrs"][2]) < 1e-12, (result["killed_lrs"], lrs)
    assert abs(lrs[-1] - (floor + (lrs[0] - floor) * 0.5 * (1 + math.cos(math.pi * 5 / 6)))) < 1e-12, lrs
    metrics = [json.loads(line) for line in (tmp_path / "longer" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 9))  # step 3 of the killed run replaced, not repeated
    run = json.loads((tmp_path / "longer" / "run.json").read_text())
    assert run["steps"] == 8 and run["seq_len"] == 256
    assert [(r["step"], r["changed"]) for r in run["resumes"]] == [(2, {"steps": [4, 8]})]
    # A new --lr applies (1e30: the run stops at once), and the state it made is never saved nor named as good.
    message = result.get("nonfinite")
    assert message is not None, "the resumed --lr 1e30 was ignored"
    assert "--lr 0.003 -> 1e+30 on resume" in text
    assert "step 3:" in message and "its update grew the trained weights' norm" in message, message
    assert "Last good checkpoint: div/checkpoints/step2." in message, message
    assert "continue from it with --resume --output-dir div --lr 0.003 (" in message, message
    assert result["div_latest"] == "step2"
    # The advised resume from the named checkpoint goes on to the end, on the uninterrupted run's trajectory (its
    # DeepSpeed config's smaller buckets and no persistent parameters schedule the same values).
    np.testing.assert_allclose(losses_of(result["recovered"]), losses_of(result["full"])[2:], rtol=1e-6)


# -- bad learning rates (issue 45) -----------------------------------------------------------------------------

def _bad_lr_worker(rank, world_size, tmp):
    import ulysses_lc.train.loop as loop
    from tests.test_training import train_worker
    from ulysses_lc.train import CheckFailed, NonFiniteError, parse_args

    os.chdir(tmp)
    result = {"refused": {}}
    flags = ["--model", "tiny", "--data", "tiny", "--seq-len", "256", "--steps", "4", "--save-every", "1",
             "--cache-dir", "cache", "--no-export"]
    load = loop.load_model

    def loading(*args, **kwargs):
        raise AssertionError("the weights loaded before the flags were checked")

    loop.load_model = loading
    try:
        for lr in ("inf", "nan", "-1"):
            try:
                train_worker(rank, world_size, parse_args([*flags, "--lr", lr, "--output-dir", f"refused{lr}"]))
            except CheckFailed as e:
                result["refused"][lr] = str(e)
    finally:
        loop.load_model = load
    # From the start at lr 1e30: step 1's update blows the weights up; nothing was saved, so the advice is a new
    # start, whose flags are then run as printed.
    try:
        train_worker(rank, world_size, parse_args([*flags, "--lr", "1e30", "--output-dir", "scratch"]))
    except NonFiniteError as e:
        result["scratch"] = str(e)
    result["scratch_saved"] = os.path.exists("scratch/checkpoints")
    again = re.search(r"your launcher and script as before: (.*)$", result.get("scratch", "")).group(1)
    result["again"] = train_worker(rank, world_size, parse_args(shlex.split(again)))
    # With the guard off, step 3's blown-up weights are saved and step 4 is not finite: the checkpoint of step 3 led
    # to it, so step 2's is named and `latest` points at it; the advised resume trains on to the end.
    off = [*flags, "--lr", "3e-3", "--output-dir", "off", "--max-weight-growth", "0"]
    train_worker(rank, world_size, parse_args(off), 2)
    try:
        train_worker(rank, world_size, parse_args(["--resume", "--output-dir", "off", "--lr", "1e30"]))
    except NonFiniteError as e:
        result["off"] = str(e)
    result["off_latest"] = open("off/checkpoints/latest").read()
    advised = re.search(r"continue from it with (--resume .*?) \(", result.get("off", "")).group(1)
    result["off_resumed"] = train_worker(rank, world_size, parse_args(shlex.split(advised)))
    return result


def test_a_bad_lr_is_refused_and_a_blown_up_update_stops_before_its_save_with_advice_that_works(tmp_path):
    from tests._dist import run_shared
    from tests.test_training import losses_of

    result = run_shared(_bad_lr_worker, 2, str(tmp_path), kind="deepspeed")[0]
    # Refused in the start-up checks, before the weights load, naming the flag and its fix.
    for lr in ("inf", "nan", "-1"):
        assert f"--lr {lr} must be a positive finite number: the peak learning rate" in result["refused"].get(lr, ""), \
            result["refused"]
        assert not (tmp_path / f"refused{lr}").exists()
    # Step 1 at lr 1e30: stopped by the guard before its save (finite weights of ~1e30 were saved and named "last
    # good" before), with the flags that start the run again at a lower lr; those train the 4 steps finitely.
    message = result.get("scratch")
    assert message is not None and message.startswith("step 1: loss "), message
    assert "its update grew the trained weights' norm from " in message and "Last good checkpoint: none." in message
    assert not result["scratch_saved"]
    assert message.endswith("--model tiny --seq-len 256 --data tiny --steps 4 --lr 0.003 --output-dir scratch "
                            "--save-every 1 --cache-dir cache --no-export"), message
    losses = losses_of(result["again"])
    assert len(losses) == 4 and all(np.isfinite(losses)), losses
    metrics = [json.loads(line) for line in (tmp_path / "scratch" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4] and metrics[0]["loss"] == losses[0]  # the new start's, once
    assert (tmp_path / "scratch" / "checkpoints" / "latest").read_text() == "step4"
    # Guard off: a non-finite step 4 names step 2's checkpoint, not the blown-up step 3's its resume would meet again.
    message = result.get("off")
    assert message is not None and message.startswith("step 4: loss ") and "not finite" in message, message
    assert "`latest` now names step2" in message and "Last good checkpoint: off/checkpoints/step2." in message, message
    assert result["off_latest"] == "step2"
    losses = losses_of(result["off_resumed"])
    assert len(losses) == 2 and all(np.isfinite(losses)), losses


def test_resume_takes_the_saved_settings_and_refuses_what_cannot_change(tmp_path):
    from ulysses_lc.train import parse_args
    from ulysses_lc.train.preflight import CheckFailed, preflight
    from ulysses_lc.train.settings import RunSettings
    from ulysses_lc.train.resume import _classified

    _classified()  # every TrainConfig field has a rule on resume
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step2")
    (run / "run.json").write_text(json.dumps({"model": "tiny", "data": "tiny", "seq_len": 512, "lora_r": 4,
                                              "lora_targets": "q_proj", "lr": 1e-3, "save_every": 2,
                                              "export_merged": False, "warmup_steps": 1}))
    resume = ["--resume", "--output-dir", str(run)]
    cfg = parse_args([*resume, "--export-merged"])  # LoRA's flags not repeated: the saved run's
    from ulysses_lc.train.resume import resolve

    resolved, changed = resolve(cfg, run)
    assert (resolved.lora_r, resolved.lora_targets, resolved.seq_len, resolved.lr) == (4, "q_proj", 512, 1e-3)
    assert changed == {"export_merged": (False, True)}
    for flags, fragment in [(["--lora-r", "0"], "lora_r=4, not 0"), (["--seq-len", "1024"], "seq_len=512, not 1024"),
                            (["--warmup-steps", "3"], "change --lr or --steps instead")]:
        with pytest.raises(CheckFailed, match=re.escape(fragment)):
            preflight(RunSettings(parse_args([*resume, *flags])), 1)
    with pytest.raises(ValueError, match=r"--lora-r 0: give the adapters' rank, >= 1"):
        parse_args(["--lora-r", "0"]).check()
    with pytest.raises(ValueError, match=r"^--export-merged only applies to LoRA adapters; add --lora-r"):
        parse_args(["--export-merged"]).check()


def test_a_resume_refuses_another_deepspeed_config_by_what_it_holds_not_by_its_name(tmp_path):
    from ulysses_lc.parallel.ds_config import load_deepspeed_config
    from ulysses_lc.train import TrainConfig, parse_args
    from ulysses_lc.train.resume import _ABSENT as ABSENT, change_lines, resolve
    from ulysses_lc.train.run_state import write_run_file

    mine = tmp_path / "ds.json"
    mine.write_text(json.dumps(load_deepspeed_config("zero3")))
    for name in ("zero3", str(mine)):
        run = tmp_path / Path(name).stem
        (run / "checkpoints").mkdir(parents=True)
        (run / "checkpoints" / "latest").write_text("step2")
        write_run_file(run, TrainConfig(model="tiny", data="tiny", seq_len=256, ds_config=name), 1, 1)
    resume = ["--resume", "--output-dir"]
    # The same settings under another name (the shipped file copied, or a path to it): no change.
    cfg, changed = resolve(parse_args([*resume, str(tmp_path / "zero3"), "--ds-config", str(mine)]), tmp_path / "zero3")
    assert cfg.ds_config == str(mine) and changed == {}
    # Another shipped config: refused, naming what differs.
    with pytest.raises(ValueError, match=r"was trained with another DeepSpeed config than --ds-config "
                                         r"zero3_offload_optimizer holds now \(optimizer: absent -> \{'type': "
                                         r"'AdamW'.*; zero_optimization\.offload_optimizer: absent -> \{'device'"):
        resolve(parse_args([*resume, str(tmp_path / "zero3"), "--ds-config", "zero3_offload_optimizer"]),
                tmp_path / "zero3")
    # The run's own file edited since it started, the flag not repeated: refused too (the name alone would pass).
    zero3 = load_deepspeed_config("zero3")
    mine.write_text(json.dumps({**zero3, "gradient_clipping": 0.5}))
    with pytest.raises(ValueError, match=r"\(gradient_clipping: 1\.0 -> 0\.5\); put the saved settings back "
                                         r"\(run\.json's ds_config_settings holds them\) or use another --output-dir "
                                         r"\(the DeepSpeed config cannot change on a resume: the optimizer state"):
        resolve(parse_args([*resume, str(tmp_path / "ds")]), tmp_path / "ds")
    # Logging and ZeRO-3's bucket and prefetch sizes apply, with a line; the trajectory is held by the resume in
    # test_flags_on_resume_apply_with_a_line_and_metrics_hold_each_step_once.
    logging_only = {**zero3, "steps_per_print": 5, "wall_clock_breakdown": True, "flops_profiler": {"enabled": False},
                    "zero_optimization": {**zero3["zero_optimization"], "stage3_prefetch_bucket_size": 1000}}
    mine.write_text(json.dumps(logging_only))
    cfg, changed = resolve(parse_args([*resume, str(tmp_path / "ds")]), tmp_path / "ds")
    assert changed == {"ds_config_settings": (
        {"flops_profiler": ABSENT, "steps_per_print": 1000000, "wall_clock_breakdown": False,
         "zero_optimization.stage3_prefetch_bucket_size": 5e8},
        {"flops_profiler": {"enabled": False}, "steps_per_print": 5, "wall_clock_breakdown": True,
         "zero_optimization.stage3_prefetch_bucket_size": 1000})}, changed
    assert change_lines(changed) == [
        "--ds-config on resume: flops_profiler absent -> {'enabled': False}, steps_per_print 1000000 -> 5, "
        "wall_clock_breakdown False -> True, zero_optimization.stage3_prefetch_bucket_size 500000000.0 -> 1000: "
        "logging, or how ZeRO schedules the same gathers and reductions (the trained values do not change)"]
    # What changes the trained values stays refused, each with the reason, also beside a change that would apply.
    for edit, shown in [({"zero_optimization": {**zero3["zero_optimization"], "stage": 2}},
                         r"zero_optimization\.stage: 3 -> 2"),
                        ({"bf16": {"enabled": False}, "fp16": {"enabled": True}},
                         r"bf16\.enabled: 'auto' -> False; fp16: absent -> \{'enabled': True\}"),
                        ({"optimizer": {"type": "Lamb"}}, r"optimizer: absent -> \{'type': 'Lamb'\}"),
                        ({"gradient_clipping": 0.0, "steps_per_print": 5}, r"\(gradient_clipping: 1\.0 -> 0\.0\);"),
                        ({"zero_optimization": {**zero3["zero_optimization"], "offload_optimizer": {"device": "cpu"},
                                                "reduce_bucket_size": 1e6}},
                         r"\(zero_optimization\.offload_optimizer: absent -> \{'device': 'cpu'\}\);")]:
        mine.write_text(json.dumps({**zero3, **edit}))
        with pytest.raises(ValueError, match=shown + r".*the optimizer state was saved in this config's form"):
            resolve(parse_args([*resume, str(tmp_path / "ds")]), tmp_path / "ds")


# -- verified checkpoints (issue 30) --------------------------------------------------------------------------

def _damaged_worker(rank, world_size, tmp):
    import logging
    from dataclasses import replace

    import torch.distributed as dist

    from tests.test_training import train_worker
    from ulysses_lc.train import TrainConfig

    os.chdir(tmp)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("ulysses_lc.train")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=4, lr=3e-3, save_every=2, keep_checkpoints=0,
                      cache_dir="cache", export=False, output_dir="run")
    result = {}
    try:
        result["full"] = train_worker(rank, world_size, cfg)
        step4 = Path("run/checkpoints/step4")
        result["manifest"] = json.loads((step4 / "manifest.json").read_text())["files"]
        if rank == 0:  # copies for resumes on one rank (the test's next body), damaged otherwise
            _damaged_copies(Path("run"))
        for case in ("truncated", "zeroed"):
            lines.clear()
            if rank == 0:
                if case == "truncated":  # a model file cut short (a copy or save interrupted)
                    path = step4 / "zero_pp_rank_0_mp_rank_00_model_states.pt"
                    os.truncate(path, path.stat().st_size // 2)
                else:  # 4 KB zeroed inside rank 1's optimizer file: the same size, and torch.load reads it silently
                    (path,) = step4.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")
                    with open(path, "r+b") as f:
                        f.seek(path.stat().st_size // 2)
                        f.write(bytes(4096))
            dist.barrier()
            result[case] = train_worker(rank, world_size, replace(cfg, resume=True))
            result[f"{case}_lines"] = list(lines)
    finally:
        log.removeHandler(handler)
    return result


def _cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _damaged_copies(run: Path) -> None:
    import shutil

    cut = _cut
    for case in ("zeroed", "manifest", "none"):
        shutil.copytree(run, case)
    (optim4,) = Path("zeroed/checkpoints/step4").glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with open(optim4, "r+b") as f:  # as in the 2-rank case: the same size, read by torch.load without a word
        f.seek(optim4.stat().st_size // 2)
        f.write(bytes(4096))
    cut(Path("manifest/checkpoints/step4/manifest.json"))  # a copy cut short at its last file
    Path("none/checkpoints/step4/manifest.json").unlink()  # left out of a copy; and step 2 cut short too
    cut(next(Path("none/checkpoints/step2").glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt")))


def _resharded_resume_worker(rank, world_size, tmp):
    import logging
    from dataclasses import replace

    from tests.test_training import train_worker
    from ulysses_lc.train import TrainConfig

    os.chdir(tmp)
    lines, result = [], {}
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("ulysses_lc.train")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        for case in ("zeroed", "manifest", "none"):
            lines.clear()
            cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=4, lr=3e-3, save_every=2,
                              keep_checkpoints=0, cache_dir="cache", export=False, output_dir=case, resume=True)
            try:
                result[case] = train_worker(rank, world_size, cfg)
            except ValueError as e:
                result[case] = str(e)
            result[f"{case}_lines"] = list(lines)
        # "zeroed" now holds step 2 of 2 ranks and step 4 of this rank, saved anew: none of the 2-rank step 4's files
        # is left beside its own. Step 4 damaged too, the next is of 2 ranks, which the engine built for step 4's
        # layout cannot load; the refusal says how to reshard it.
        step4 = Path("zeroed/checkpoints/step4")
        result["resaved"] = sorted(p.name for p in step4.iterdir() if "rank_1" in p.name or p.is_dir())
        _cut(next(step4.glob("*optim_states.pt")))
        cfg = replace(cfg, output_dir="zeroed")
        try:
            result["mixed"] = train_worker(rank, world_size, cfg)
        except ValueError as e:
            result["mixed"] = str(e)
        Path("zeroed/checkpoints/latest").write_text("step2")  # as the refusal says
        result["mixed_resumed"] = train_worker(rank, world_size, cfg)
    finally:
        log.removeHandler(handler)
    return result


def test_a_damaged_checkpoint_is_named_and_the_newest_good_one_resumes(tmp_path):
    from tests._dist import run_shared
    from tests.test_training import losses_of

    result = run_shared(_damaged_worker, 2, str(tmp_path), kind="deepspeed")[0]
    files = result["manifest"]
    assert {"zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"} <= set(files)
    assert all(len(e["crc32"]) == 8 and e["bytes"] > 0 for e in files.values())
    for case, fragment in [("truncated", r"zero_pp_rank_0_mp_rank_00_model_states\.pt: [\d,]+ bytes, the manifest "
                                         r"says [\d,]+ \(cut short"),
                           ("zeroed", r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: CRC-32 [0-9a-f]{8}, the manifest "
                                      r"says [0-9a-f]{8}")]:
        text = "\n".join(result[f"{case}_lines"])
        assert "resuming from step2, the newest checkpoint whose files check against its manifest; step4 is " \
               "damaged:" in text, text
        assert re.search(fragment, text), text
        assert "resumed step 2 on the layout that saved it" in text, text  # the step loaded, not the damaged one's
        # From step 2, steps 3 and 4 again: the uninterrupted run's (and step 4 saved anew).
        np.testing.assert_allclose(losses_of(result[case]), losses_of(result["full"])[2:], rtol=1e-6)
    # Saved on 2 ranks, resumed on 1 (the ZeRO-3 state resharded from every old rank's files): a damaged file or
    # manifest passes the checkpoint over, as on the layout that saved it; with none that checks, the resume refuses.
    resharded = run_shared(_resharded_resume_worker, 1, str(tmp_path), kind="deepspeed")[0]
    for case, fragment in [("zeroed", r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: CRC-32 [0-9a-f]{8}, the manifest "
                                      r"says [0-9a-f]{8}"),
                           ("manifest", r"step4/manifest\.json: cannot be read \(JSONDecodeError: .*; cut short or "
                                        r"overwritten\)")]:
        text = "\n".join(resharded[f"{case}_lines"])
        assert "resuming from step2, the newest checkpoint whose files check against its manifest; step4 is " \
               "damaged:" in text and re.search(fragment, text), text
        assert "resumed step 2 saved on 2 ranks (sp 2 x dp 1) on 1 rank (sp 1 x dp 1): ZeRO-3 state resharded" in text
        # Within float32 reduction order (tests/test_reshard.py measured 9.6e-8 on 1 rank).
        np.testing.assert_allclose(losses_of(resharded[case]), losses_of(result["full"])[2:], rtol=1e-6)
    refusal = resharded["none"]
    assert isinstance(refusal, str) and refusal.startswith("--resume: no checkpoint in none/checkpoints checks "
                                                           "against its manifest"), refusal
    assert re.search(r"step4: \S*step4/manifest\.json: missing, while the older step2 has one .*; step2: \S*"
                     r"zero_pp_rank_1_mp_rank_00_optim_states\.pt: [\d,]+ bytes, the manifest says [\d,]+ \(cut short",
                     refusal), refusal
    assert resharded["resaved"] == [], resharded["resaved"]
    assert resharded["mixed"] == ("--resume: the newest checkpoint that checks, step2, was saved on 2 ranks, not "
                                  "the 1 that step4 was (the lines above say what is wrong with step4); point `latest` "
                                  "at it (echo step2 > zeroed/checkpoints/latest) and resume again, which reshards it, "
                                  "or resume on 2 ranks."), resharded["mixed"]
    np.testing.assert_allclose(losses_of(resharded["mixed_resumed"]), losses_of(result["full"])[2:], rtol=1e-6)


# -- clear I/O errors (issue 30) -------------------------------------------------------------------------------

def _disk_full_worker(rank, world_size, tmp, out, inject):
    import errno

    import torch

    from tests.test_training import train_worker
    from ulysses_lc.train import TrainConfig, train

    os.chdir(tmp)
    cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=4, lr=3e-3, save_every=2, cache_dir="cache",
                      export=False, output_dir=out)
    if not out.endswith("small/run"):  # the reference, on the roomy disk
        return train_worker(rank, world_size, cfg)
    save, fail = torch.save, []

    def full_disk(obj, f, **kwargs):  # no tmpfs here: the disk fills up after step 2's checkpoint
        if fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, **kwargs)

    torch.save = full_disk if inject else save
    try:
        train(cfg, on_step=lambda step, record: fail.append(step) if step == 2 else None)
    except OSError as e:
        return str(e)
    finally:
        torch.save = save
    return "saved"


def test_a_full_disk_names_the_folder_and_the_bytes_and_the_run_resumes(tmp_path):
    import subprocess

    from tests._dist import run_shared
    from tests.test_training import losses_of
    from ulysses_lc.train import TrainConfig

    small = tmp_path / "small"
    small.mkdir()
    # A 2.4 MB tmpfs where the machine allows it (root): the step-2 checkpoint (1.4 MB) fits, step 4's does not.
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2400k", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    try:
        reference = run_shared(_disk_full_worker, 2, str(tmp_path), str(tmp_path / "roomy"), False, kind="deepspeed")[0]
        messages = run_shared(_disk_full_worker, 2, str(tmp_path), str(small / "run"), not mounted, kind="deepspeed")
        for message in messages:  # every rank stops with the cause
            assert re.match(rf"saving the checkpoint in {re.escape(str(small))}/run/checkpoints(/step4)? failed at "
                            r"\S+: its file system is full \(ENOSPC\)\. Each rank writes about [\d.]+ KB \(fp32 "
                            r"weights and optimizer moments\), the checkpoint about 1\.4 MB over 2 ranks; [\d.]+ \w+ "
                            r"is free there\. To go on, free [\d.]+ \w+ or more there, lower --keep-checkpoints "
                            r"\(now 2\), or pass another --output-dir; the previous checkpoint step2 is intact: "
                            r"--resume continues from it\.", message), message
        assert (small / "run" / "checkpoints" / "latest").read_text() == "step2"
        if mounted:
            subprocess.run(["mount", "-o", "remount,size=8m", str(small)], check=True)
        cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=4, lr=3e-3, save_every=2, cache_dir="cache",
                          export=False, output_dir=str(small / "run"), resume=True)
        resumed = run_shared(_resume_in, 2, str(tmp_path), cfg, kind="deepspeed")[0]
        np.testing.assert_allclose(losses_of(resumed), losses_of(reference)[2:], rtol=1e-6)
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=True)
    from ulysses_lc.train import dry_run

    text = dry_run(TrainConfig(model="tiny", data="tiny", seq_len=256, dry_run=True, world_size=2, host_memory_gb=8))
    assert "disk      a checkpoint takes 1.4 MB (12 bytes per trained parameter" in text, text


def _late_disk_full_worker(rank, world_size, tmp, where):
    import errno

    import deepspeed.runtime.engine as ds_engine

    import ulysses_lc.train.run_state as run_state
    from ulysses_lc.train import TrainConfig, train

    os.chdir(tmp)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    # Rank 0's own small writes of a save: DeepSpeed's copy of zero_to_fp32.py beside the tags, then the manifest.
    target, name = (ds_engine, "copyfile") if where == "script" else (run_state, "write_manifest")
    real = getattr(target, name)
    setattr(target, name, full)
    try:
        train(TrainConfig(model="tiny", data="tiny", seq_len=256, steps=2, lr=3e-3, save_every=2, cache_dir="cache",
                          export=False, output_dir=where))
    except OSError as e:
        return str(e)
    finally:
        setattr(target, name, real)
    return "saved"


def test_a_full_disk_at_rank_0s_last_small_writes_stops_every_rank_with_the_cause(tmp_path):
    """The disk can fill up at the writes only rank 0 makes after the ranks' files: a rank that raised alone there left
    the others waiting in the save's last barrier (until the watch or a timeout ended them) and printed a bare
    OSError."""
    from tests._dist import run_shared

    for where, at in [("script", r"checkpoints failed at zero_to_fp32\.py"),
                      ("manifest", r"checkpoints/step2 failed at manifest\.json")]:
        messages = run_shared(_late_disk_full_worker, 2, str(tmp_path), where, kind="deepspeed", timeout=120)
        assert messages[0] == messages[1], messages
        assert re.match(rf"saving the checkpoint in {where}/{at}: its file system is full \(ENOSPC\)\. .*; no earlier "
                        r"checkpoint exists\. \(rank 0\)$", messages[0]), messages[0]
        assert not (tmp_path / where / "checkpoints" / "latest").exists()


def _disk_full_at_run_files_worker(rank, world_size, tmp):
    """The disk fills up at rank 0's metrics.jsonl line of step 3 (half of it written), then at run.json's rewrite by
    the resume, then at a new run's run.json: a rank that raised alone there left the other in the next collective."""
    import errno
    from dataclasses import replace

    import ulysses_lc.plan.metrics as metrics
    from ulysses_lc.train import TrainConfig, train
    from ulysses_lc.train.checkpoint_files import SaveFailed

    os.chdir(tmp)
    cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=4, lr=3e-3, save_every=2, cache_dir="cache",
                      export=False, output_dir="run")
    result = {"reference": [r["loss"] for r in train(replace(cfg, output_dir="reference"))]}
    full, write_text = [], Path.write_text

    class CutShort:  # a file whose write stops half-way: the disk is full
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(path, *args, **kwargs):
        f = open(path, *args, **kwargs)
        return CutShort(f) if full and Path(path).name == "metrics.jsonl" else f

    def full_write_text(path, *args, **kwargs):
        if full and path.name in ("run.json", ".run.json.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_text(path, *args, **kwargs)

    metrics.open, Path.write_text = full_open, full_write_text
    try:
        for case, run_cfg in [("metrics", cfg), ("resume", replace(cfg, resume=True)),
                              ("new", replace(cfg, output_dir="new"))]:
            full.clear()
            if case != "metrics":
                full.append(0)
                result["run.json"] = Path("run/run.json").read_bytes()
            try:
                train(run_cfg, on_step=lambda step, record: full.append(step) if step == 2 else None)
            except SaveFailed as e:
                result[case] = str(e)
            if case == "resume":
                result["run.json kept"] = Path("run/run.json").read_bytes() == result["run.json"]
    finally:
        del metrics.open
        Path.write_text = write_text
    result["latest"] = Path("run/checkpoints/latest").read_text()
    result["resumed"] = [r["loss"] for r in train(replace(cfg, resume=True))]  # nothing saved before was lost
    result["logged"] = [json.loads(line) for line in Path("run/metrics.jsonl").read_text().splitlines()]
    return result


def test_a_full_disk_at_metrics_jsonl_or_run_json_stops_every_rank_with_the_cause_and_loses_nothing(tmp_path):
    from tests._dist import run_shared

    results = run_shared(_disk_full_at_run_files_worker, 2, str(tmp_path), kind="deepspeed", timeout=240)
    for case in ("metrics", "resume", "new"):
        assert results[0][case] == results[1][case], (case, results[0][case], results[1][case])  # every rank
    assert re.match(r"step 3: writing metrics\.jsonl in run failed: its file system is full \(ENOSPC\); [\d.]+ \w+ is "
                    r"free there\. To go on, free space there or pass another --output-dir; the checkpoint "
                    r"run/checkpoints/step2 is intact: --resume continues from it\. \(rank 0\)$",
                    results[0]["metrics"]), results[0]["metrics"]
    assert re.match(r"writing run\.json in run failed: its file system is full \(ENOSPC\); .* the checkpoint "
                    r"run/checkpoints/step2 is intact", results[0]["resume"]), results[0]["resume"]
    assert re.match(r"writing run\.json in new failed: .*; no checkpoint exists yet\. \(rank 0\)$",
                    results[0]["new"]), results[0]["new"]
    result = results[0]
    assert result["run.json kept"] and result["latest"] == "step2"
    # Nothing saved before is lost: the resume from step 2 is the uninterrupted run's, metrics.jsonl holds each step
    # once (step 3's half line dropped), its first two lines as the first run wrote them.
    np.testing.assert_allclose(result["resumed"], result["reference"][2:], rtol=1e-6)
    assert [m["step"] for m in result["logged"]] == [1, 2, 3, 4]
    np.testing.assert_allclose([m["loss"] for m in result["logged"]], result["reference"], rtol=1e-6)


def _resume_in(rank, world_size, tmp, cfg):
    from tests.test_training import train_worker

    os.chdir(tmp)
    return train_worker(rank, world_size, cfg)


def test_a_full_disk_in_deepspeeds_script_copy_names_the_checkpoint_folder(tmp_path, monkeypatch):
    """DeepSpeed copies zero_to_fp32.py into each tag with shutil, whose error names its source (DeepSpeed's install)
    in `filename` and the destination in `filename2`: the failure names the checkpoint's file. CI's tmpfs filled up
    at this copy and the message sent the user to site-packages."""
    import errno
    import types

    from deepspeed.runtime.engine import DeepSpeedEngine

    from ulysses_lc.train.checkpoint_files import recording_files

    class Engine:
        _copy_recovery_script = DeepSpeedEngine._copy_recovery_script
        checkpoint_engine = types.SimpleNamespace()

        def _change_recovery_script_permissions(self, dst):
            pass

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "sendfile", full)
    import shutil
    monkeypatch.setattr(shutil, "copyfileobj", lambda *a, **k: full())  # where the platform copies without sendfile
    tag = tmp_path / "checkpoints" / "step4"
    tag.mkdir(parents=True)
    failed = []
    engine = Engine()
    with recording_files(engine, failed):
        engine._copy_recovery_script(str(tag))
    assert [(path, e.errno) for path, e in failed] == [(tag / "zero_to_fp32.py", errno.ENOSPC)], failed
    assert "_copy_recovery_script" not in vars(engine)


def test_read_only_and_quota_errors_name_the_cause_and_the_fix(tmp_path):
    import errno

    from ulysses_lc.train.checkpoint_files import save_failure

    path = tmp_path / "run" / "checkpoints" / "step4" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    args = dict(rank_bytes=16 * 10**9, world_size=8, previous="step2", keep=2)
    read_only = save_failure(path, OSError(errno.EROFS, "Read-only file system"), **args)
    assert "its file system is read-only (EROFS" in read_only and "remount it read-write or pass another " \
        "--output-dir" in read_only and "about 16.0 GB" in read_only and "about 128.0 GB over 8 ranks" in read_only
    quota = save_failure(path, OSError(errno.EDQUOT, "Disk quota exceeded"), **args)
    assert "the disk quota there is used up (EDQUOT; `quota -s` shows it)" in quota and "free " in quota
    assert f"saving the checkpoint in {path.parent} failed at {path.name}" in quota


# -- one writer per run folder (issue 30) ----------------------------------------------------------------------

def _second_job_worker(rank, world_size, tmp):
    import logging

    from ulysses_lc.train import TrainConfig, train
    from ulysses_lc.train.run_lock import FolderBusy

    os.chdir(tmp)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("ulysses_lc.train")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=1, lr=3e-3, cache_dir="cache", export=False,
                      output_dir="run")
    try:
        if os.path.exists("run/.ulysses_lc-lock") and os.path.getsize("run/.ulysses_lc-lock") and \
                "99999999" not in open("run/.ulysses_lc-lock").read():
            try:
                train(cfg)
            except FolderBusy as e:
                return {"refused": str(e), "cache_made": os.path.exists("cache")}
            return {"refused": None}
        train(cfg)
        return {"lines": list(lines)}
    finally:
        log.removeHandler(handler)


def test_a_second_job_on_a_run_folder_refuses_and_a_dead_runs_lock_is_taken_over(tmp_path):
    import socket

    from tests._dist import run_shared
    from ulysses_lc.train.run_lock import LOCK, RunLock

    (tmp_path / "run").mkdir()  # (a lock that made its folder removes it again where nothing else was written)
    held = RunLock.acquire(tmp_path / "run")  # the first job, still running (this process)
    try:
        second = run_shared(_second_job_worker, 2, str(tmp_path), kind="deepspeed")
    finally:
        held.release()
    for result in second:  # every rank refuses, naming the holder, before any work (no token cache, no metrics)
        assert result["refused"] is not None, result
        assert result["refused"].startswith(f"run is the run folder of another job that is still "
                                            f"running (pid {os.getpid()} on host {socket.gethostname()}, started ")
        assert "pass another --output-dir" in result["refused"] and not result["cache_made"]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [LOCK]
    # A run killed without a word (SIGKILL, a lost node) leaves its lock file behind, held by no one.
    (tmp_path / "run" / LOCK).write_text(json.dumps({"host": "n7", "pid": 99999999, "started": "then"}))
    taken = run_shared(_second_job_worker, 2, str(tmp_path), kind="deepspeed")[0]
    assert any(line.startswith("run: took over the lock of a run that is no longer running (pid 99999999 on host n7, "
                               "started then)") for line in taken["lines"]), taken["lines"]
    assert (tmp_path / "run" / LOCK).read_text() == ""  # ended: no holder to name


# -- preemption (issue 30) -------------------------------------------------------------------------------------

PREEMPT_ARGS = ["--steps", "200", "--seq-len", "256", "--lr-schedule", "constant", "--no-export", "--cache-dir",
                "cache", "--output-dir", "run"]


def _reference_and_resume(rank, world_size, tmp, steps):
    from tests.test_training import train_worker
    from ulysses_lc.train import TrainConfig

    os.chdir(tmp)
    cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=steps, lr=3e-3, lr_schedule="constant",
                      export=False, cache_dir="cache", output_dir="reference")
    from dataclasses import replace

    return train_worker(rank, world_size, cfg), train_worker(rank, world_size, replace(cfg, output_dir="run",
                                                                                          resume=True))


@pytest.mark.parametrize("launcher,target,signame", [("deepspeed", "launcher", "SIGTERM"), ("torchrun", "group", "SIGTERM"),
                                                   ("torchrun", "launcher", "SIGTERM"), ("deepspeed", "group", "SIGINT")])
def test_a_signal_stops_every_rank_at_a_step_with_a_checkpoint_and_the_resume_goes_on(tmp_path, launcher, target,
                                                                                       signame):
    """SIGTERM to DeepSpeed's runner alone (it forwards nothing: the ranks see it end), to torchrun's whole process
    group (every rank and the agent, which forwards it again) or to its agent alone (which forwards it, then SIGKILLs
    the ranks 30 s later), or Ctrl-C under DeepSpeed's launcher (SIGINT to the runner, launch.py and every rank;
    launch.py then SIGTERMs the ranks one by one and waits for each): every rank stops at one step boundary, saves
    there (--save-every 0: no other checkpoint), and exits; the resume continues the uninterrupted run."""
    import signal
    import subprocess

    import psutil

    from tests._dist import _free_port, run_shared
    from tests.test_run import LAUNCHERS, REPO, _env
    from tests.test_training import losses_of

    entry = [str(REPO / "examples" / "train_1m.py")] if launcher == "deepspeed" else ["-m", "ulysses_lc.train"]
    cmd = [*LAUNCHERS[launcher](_free_port()), *entry, *PREEMPT_ARGS]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("step 3/"):
            break
    ranks = [p for p in psutil.Process(proc.pid).children(recursive=True) if "train" in " ".join(p.cmdline())
             and "launch" not in " ".join(p.cmdline())]
    if target == "launcher":
        os.kill(proc.pid, getattr(signal, signame))
    else:
        os.killpg(proc.pid, getattr(signal, signame))
    out = "".join(seen) + proc.stdout.read()  # until every process holding the pipe (the ranks) has exited
    proc.wait(timeout=120)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), out
    why = "its launcher (pid" if (launcher, target) == ("deepspeed", "launcher") else f"{signame} (from the scheduler"
    if (launcher, signame) == ("deepspeed", "SIGINT"):  # launch.py answers Ctrl-C with a SIGTERM to rank 0 at once,
        why = "(from the scheduler"  # which can come first
    lines = [line for line in out.splitlines() if line.strip()]
    stopped = [line for line in lines if line.startswith("stopped at step ")]
    if launcher == "deepspeed":  # said again by the last rank launch.py ends, after its kill lines: only its own
        assert len(stopped) == 2 and stopped[0] == stopped[1] and lines[-2] == stopped[1], lines[-6:]  # last follows
        assert "Killing subprocess" in lines[-3], lines[-6:]
    assert len(set(stopped)) == 1 and why in stopped[0], out
    step = int(stopped[0].split()[3])
    assert f"checkpoint run/checkpoints/step{step} written: --resume --output-dir run continues" in stopped[0]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == f"step{step}"
    logged = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    reference, resumed = run_shared(_reference_and_resume, 2, str(tmp_path), step + 2, kind="deepspeed")[0]
    np.testing.assert_allclose(logged[:step], losses_of(reference)[:step], rtol=1e-6)
    np.testing.assert_allclose(losses_of(resumed), losses_of(reference)[step:], rtol=1e-6)


def _one_rank_signalled_worker(rank, world_size, tmp):
    import signal

    from ulysses_lc.train import TrainConfig, train
    from ulysses_lc.train.stop import Stopped

    os.chdir(tmp)
    cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=50, lr=3e-3, lr_schedule="constant", save_every=0,
                      export=False, cache_dir="cache", output_dir="run")

    def on_step(step, record):
        if rank == 1 and step == 2:  # a signal to rank 1 alone (kill <pid>, a node's own OOM guard, a job step)
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        train(cfg, on_step=on_step)
    except Stopped as e:
        return str(e), e.code
    return None


def test_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Rank 0, never signalled, learns of rank 1's stop at the step boundary (one all-reduce) and saves with it; without
    that agreement rank 1 would save alone while rank 0 trains on, and the job would hang in mismatched collectives."""
    from tests._dist import run_shared

    stops = run_shared(_one_rank_signalled_worker, 2, str(tmp_path), kind="deepspeed", timeout=240)
    assert stops[0] is not None and stops[0] == stops[1], stops  # one step, one message, on both ranks
    message, code = stops[0]
    step = int((tmp_path / "run" / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert code == 143 and message.startswith(f"stopped at step {step} of 50 by SIGTERM (from the scheduler") and \
        message.split("; checkpoint")[0].endswith("(rank 1)"), message
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step*")) == [f"step{step}"]  # the stop's


def test_a_stop_under_way_outlives_the_loss_of_the_store(monkeypatch):
    """torchrun's agent killed (SIGKILL: an OOM kill, a node agent's restart) takes the job's store with it. Its ranks
    see their launcher gone and stop at the step boundary with a checkpoint, which needs no store; the store's loss
    must not end them first (after SETTLE_S, 6 s, shorter than a large model's step), only the grace period."""
    import ulysses_lc.train.job_watch as job_watch
    from tests._nodes import WatchEnded, watch_without_store
    from ulysses_lc.train.job_table import RankTable

    watch, now = watch_without_store(monkeypatch, RankTable(("a", "a"), (0, 0), (os.getpid(), os.getpid()), 0),
                                     node_timeout_s=60, stop_grace_s=25)
    watch._launchers = [2**31 - 1]  # no such process: the agent has ended
    watch.stop_request.training = True  # in a step (the loop's first step set it)
    watch._poll()  # sees the agent gone: a stop, for the step boundary; and the store gone
    assert watch.stop_request.reason.startswith("its launcher (pid 2147483647) ended") and watch._store_lost_at == 1000
    now[0] += job_watch.SETTLE_S + 4
    watch._poll()  # the stop is under way: the store's loss ends nothing
    now[0] += 25 - job_watch.SETTLE_S
    with pytest.raises(WatchEnded, match=r"^stopped by its launcher \(pid 2147483647\) ended, but the step and its "
                                    r"checkpoint did not end within --stop-grace-s 25"):
        watch._poll()


def _one_process_run():
    """A job of one process started by plain `python` (no launcher, no peers): Ctrl-C stops it at a step with a
    checkpoint and hands the signals back; a resume whose stop's save hangs (a stuck file system) ends past the grace
    period. Run in a fresh process by the test below: the grace period ends the process."""
    import logging
    import signal
    import time
    from dataclasses import replace

    import ulysses_lc.train.loop as loop
    from ulysses_lc.train import TrainConfig, train
    from ulysses_lc.train.stop import Stopped

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=200, lr=3e-3, lr_schedule="constant", save_every=0,
                      export=False, cache_dir="cache", output_dir="run", stop_grace_s=2)

    def send(signum, at):
        return lambda step, record: os.kill(os.getpid(), signum) if step == at else None

    result = {}
    try:
        train(cfg, on_step=send(signal.SIGINT, 3))  # Ctrl-C
    except Stopped as e:
        result["stopped"] = [str(e), e.code]
    result["signals_back"] = (signal.getsignal(signal.SIGINT) is signal.default_int_handler
                              and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    step = int(Path("run/checkpoints/latest").read_text().removeprefix("step"))
    result["reference"] = [r["loss"] for r in train(replace(cfg, steps=step + 2, output_dir="reference"))]
    print("RESULT " + json.dumps(result), flush=True)
    loop.save_checkpoint = lambda *args, **kwargs: time.sleep(600)  # the stop's save never returns
    train(replace(cfg, resume=True), on_step=send(signal.SIGTERM, step + 1))
    print("RESULT the resume did not stop", flush=True)


def test_a_job_of_one_process_stops_with_a_checkpoint_and_a_hung_save_ends_past_the_grace_period(tmp_path):
    import subprocess
    import sys

    from tests.test_run import _env

    proc = subprocess.run([sys.executable, "-c", "from tests.test_faults import _one_process_run; _one_process_run()"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    results = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT {")]
    assert results, out  # a SIGINT without the stop: KeyboardInterrupt, no checkpoint
    result = results[0]
    message, code = result["stopped"]
    step = int((tmp_path / "run" / "checkpoints" / "latest").read_text().removeprefix("step"))
    assert code == 130 and message.startswith(f"stopped at step {step} of 200 by SIGINT (from the scheduler, the "
                                              "launcher or Ctrl-C") and "(rank 0)" not in message, message
    assert f"checkpoint run/checkpoints/step{step} written: --resume --output-dir run continues" in message
    assert result["signals_back"], "a run of one process left its SIGINT/SIGTERM handlers behind"
    assert "stopping: SIGINT (from the scheduler" in out  # said when the signal came, not only at the step's end
    # The stop's save hung: the grace period ends the process with the signal's code, saying why, as its last line.
    last = proc.stderr.splitlines()[-1]
    assert proc.returncode == 128 + 15 and "stopped by SIGTERM (from the scheduler" in last, out
    assert "but the step and its checkpoint did not end within --stop-grace-s 2: exits without a new checkpoint" in last
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == f"step{step}"
    # Stopped at a step boundary: the steps before the stop and the resumed ones are the uninterrupted run's.
    logged = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(logged, result["reference"], rtol=1e-6)


def _interrupted_in_checks(argv):
    """Ctrl-C lands in the start-up checks, on this rank (the terminal's group: every rank), as the command line runs."""
    import signal

    import ulysses_lc.train.loop as loop
    from ulysses_lc.train.cli import main

    checks = loop.preflight

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return checks(*args, **kwargs)

    loop.preflight = interrupted
    main(argv)


def test_ctrl_c_in_the_start_up_checks_stops_every_rank_with_one_line_and_no_traceback(tmp_path):
    """Before the run's handlers are armed, Python's own SIGINT handler raises KeyboardInterrupt, which printed a
    traceback on every rank and exited 1."""
    import subprocess
    import sys

    from tests._dist import _free_port
    from tests.test_run import _env

    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    code = f"from tests.test_faults import _interrupted_in_checks; _interrupted_in_checks({PREEMPT_ARGS!r})"
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, env={**_env(), **env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    outs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [130, 130], outs
    assert not any("Traceback" in out or "KeyboardInterrupt" in out for out in outs), outs
    assert outs[0].strip().splitlines()[-1] == ("stopped by SIGINT (Ctrl-C) during the start-up checks, before "
                                                "training started: nothing was trained or written; the same command "
                                                "starts the run"), outs[0]
    assert outs[1].strip() == "", outs[1]  # one line for the job, from rank 0
    assert not (tmp_path / "run").exists()


def _interrupted_while_loading(rank, world_size, tmp):
    import signal

    import ulysses_lc.train.loop as loop
    from ulysses_lc.train import TrainConfig, train
    from ulysses_lc.train.stop import Stopped

    os.chdir(tmp)
    load = loop.load_model

    def interrupted(*args, **kwargs):  # Ctrl-C to rank 1 alone while the weights load, after the watch is armed
        if rank == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return load(*args, **kwargs)

    loop.load_model = interrupted
    try:
        train(TrainConfig(model="tiny", data="tiny", seq_len=256, steps=50, lr=3e-3, save_every=1, export=False,
                          cache_dir="cache", output_dir="run"))
    except Stopped as e:
        return str(e), e.code
    finally:
        loop.load_model = load
    return None


def test_a_stop_asked_while_the_run_starts_ends_it_before_a_step_on_every_rank(tmp_path):
    """Without a check before the loop, the run trained (and saved) a first step, which can take minutes, and past
    --stop-grace-s the watch ended it with a line about a step and checkpoint that never were."""
    from tests._dist import run_shared

    stops = run_shared(_interrupted_while_loading, 2, str(tmp_path), kind="deepspeed", timeout=240)
    assert stops[0] is not None and stops[0] == stops[1], stops
    message, code = stops[0]
    assert code == 130 and message.startswith("stopped before training started by SIGINT (from the scheduler"), message
    assert message.endswith("(rank 1): nothing was trained; the same command starts the run"), message
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "checkpoints").exists()


# -- blame (issue 30) ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "none"])
def test_rank_0_killed_is_named_in_the_last_lines_on_every_launcher(tmp_path, launcher):
    """SIGKILL of rank 0 (under DeepSpeed's launcher and by hand its process holds the job's store): the last lines
    name it, by global rank, and the other rank exits within the hang guard (a collective's timeout otherwise)."""
    import subprocess
    import sys

    import psutil

    from tests._dist import _free_port
    from tests.test_run import LAUNCHERS, REPO, _env

    args = ["--steps", "200", "--seq-len", "256", "--no-export", "--output-dir", "run"]
    port = _free_port()
    if launcher == "none":  # each rank started by hand, as a scheduler's own launch would
        env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs = [subprocess.Popen([sys.executable, "-m", "ulysses_lc.train", *args], cwd=tmp_path,
                                  env={**_env(), **env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in range(2)]
        watched, rank0 = procs[1], psutil.Process(procs[0].pid)
    else:
        entry = [str(REPO / "examples" / "train_1m.py")] if launcher == "deepspeed" else ["-m", "ulysses_lc.train"]
        procs = [subprocess.Popen([*LAUNCHERS[launcher](port), *entry, *args], cwd=tmp_path, env=_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
        watched = procs[0]
    seen = []
    for line in procs[0].stdout:
        seen.append(line)
        if line.startswith("step 3/"):
            break
    if launcher != "none":
        ranks = [p for p in psutil.Process(procs[0].pid).children(recursive=True) if p.environ().get("RANK") == "0"
                 and "train" in " ".join(p.cmdline())]
        rank0 = ranks[-1]
    pid = rank0.pid
    rank0.kill()
    out = (procs[0].stdout.read() if watched is procs[0] else watched.stdout.read())
    for proc in procs:
        proc.wait(timeout=120)  # a hang guard: without the watch the survivor waits out gloo's timeout
        proc.stdout.close()
    lines = [line for line in out.splitlines() if line.strip()]
    ours = [i for i, line in enumerate(lines) if line.startswith("error (rank 0 on node 0, host ")
            and f"rank 0 (pid {pid} on host" in line and "exited without a report" in line]
    assert ours, out
    if launcher == "torchrun":  # its closing summary, printed last, names the root cause by global rank
        assert "rank      : 0 (local_rank: 0)" in "\n".join(lines[-6:]) and "SIGKILL" in lines[-2], lines[-8:]
    elif launcher == "deepspeed":  # launch.py's "Killing subprocess" for each, the cause again, rank 0's exit code
        assert ours[-1] == len(lines) - 2 and lines[-1].endswith("exits with return code = -9"), lines[-6:]
        assert "Killing subprocess" in lines[-3], lines[-6:]
    else:
        assert ours[-1] == len(lines) - 1, lines[-4:]  # the survivor's last line


FAILING_RANK_0 = """
import sys

import ulysses_lc.train.loop as loop
from ulysses_lc.train.cli import main

shard_batch, calls = loop.shard_batch, []


def failing_shard_batch(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3 and loop.torch.distributed.get_rank() == 0:
        raise RuntimeError("injected failure on rank 0 at step 3")
    return shard_batch(*args, **kwargs)


loop.shard_batch = failing_shard_batch
main(sys.argv[1:])
"""


def test_under_deepspeeds_launcher_the_cause_follows_its_kill_lines(tmp_path):
    """DeepSpeed's launch.py, once a rank exits non-zero, prints "Killing subprocess <pid>" for each rank, ending each
    in turn, then its exit code: the failing rank's line came before all of them. The last live rank, ended last,
    prints the cause again, so only the exit code's line follows it (job_table.ends_last)."""
    import subprocess

    from tests._dist import _free_port
    from tests.test_run import LAUNCHERS, _env

    script = tmp_path / "failing_rank_0.py"
    script.write_text(FAILING_RANK_0)
    args = ["--steps", "20", "--seq-len", "256", "--no-export", "--output-dir", "run"]
    proc = subprocess.run([*LAUNCHERS["deepspeed"](_free_port()), str(script), *args], cwd=tmp_path, env=_env(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=180)
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    cause = "error (rank 0 on node 0, host "
    assert lines[-2].startswith(cause) and "RuntimeError: injected failure on rank 0 at step 3" in lines[-2], lines[-8:]
    assert "Killing subprocess" in lines[-3] and lines[-1].endswith("exits with return code = 1"), lines[-8:]


def test_the_rank_launch_py_ends_last_waits_while_the_ranks_it_ends_first_exit(monkeypatch):
    """Ctrl-C under DeepSpeed's launcher on a loaded machine: launch.py's SIGTERM to rank 0 waited 14 s for its exit,
    the last rank's fixed 5 s wait for its own SIGTERM ran out first, and launch.py's lines ended the job. The last rank
    waits while launch.py and a rank it ends first live, then LAUNCH_PY_S (its poll); at most LAUNCH_PY_LIMIT_S."""
    import ulysses_lc.train.job_table as job_table
    from ulysses_lc.train.cli import LAUNCH_PY_LIMIT_S, LAUNCH_PY_S
    from ulysses_lc.train.job_table import RankTable

    table = RankTable(("a", "a"), (0, 0), (11, 12), 1)  # this rank is 1 (pid 12); launch.py is pid 7
    now, living, exits, ended = [1000.0], {}, {}, []

    def sleep(seconds):
        now[0] += seconds
        for pid, at in exits.items():
            living[pid] = now[0] < at
        if now[0] >= signal_at:
            ended.append(15)

    monkeypatch.setattr(job_table, "alive", lambda pid: living[pid])
    monkeypatch.setattr(job_table.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(job_table.time, "sleep", sleep)

    def waited(rank_0_exits, launch_py_exits=math.inf, signalled=math.inf):
        nonlocal signal_at
        start, signal_at = now[0], now[0] + signalled
        exits.update({11: start + rank_0_exits, 7: start + launch_py_exits})
        living.update({7: True, 11: True, 12: True})
        ended.clear()
        job_table.await_launch_py(table, [7], ended, LAUNCH_PY_S, LAUNCH_PY_LIMIT_S)
        return now[0] - start

    signal_at = math.inf
    assert waited(14) == pytest.approx(14 + LAUNCH_PY_S, abs=0.2)  # the slow exit, then launch.py's poll
    assert waited(14, signalled=15) == pytest.approx(15, abs=0.2)  # its SIGTERM: at once
    assert waited(14, launch_py_exits=3) == pytest.approx(3, abs=0.2)  # launch.py gone: no SIGTERM will come
    assert waited(math.inf) == pytest.approx(LAUNCH_PY_LIMIT_S, abs=0.2)  # a rank that never exits
    assert LAUNCH_PY_LIMIT_S >= 60


def test_a_runs_end_wakes_the_watcher_at_once_and_a_linger_waits_for_a_signal_alone():
    """JobWatch.stop wakes the watcher's wait (SignalHook.wake) instead of leaving it to its next poll, which every
    rank paid at the end of every run (up to job_watch.POLL_S, 1 s); the linger before a quiet exit (wakes=False) is
    not cut short by a wake, only by a signal."""
    import signal
    import threading
    import time

    from ulysses_lc.train.stop import SignalHook

    hook, halt, got = SignalHook(), threading.Event(), []
    hook.arm(got.append)
    try:
        waiter = threading.Thread(target=lambda: got.append(hook.wait(60.0, halt)))
        waiter.start()
        hook.wake()
        waiter.join(30.0)
        assert not waiter.is_alive() and got == [None]  # woken, well before its 60 s
        hook.wake()
        start = time.monotonic()
        assert hook.wait(0.5, halt, wakes=False) is None and time.monotonic() - start >= 0.45
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
        assert hook.wait(60.0, halt, wakes=False) == signal.SIGTERM
        assert got == [None, signal.SIGTERM]  # the handler saw it too
    finally:
        hook.disarm()
