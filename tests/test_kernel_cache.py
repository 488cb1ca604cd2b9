"""The kernel cache (train/kernel_cache.py, plan/first_step.py): Triton's and inductor's cache folders set from
--kernel-cache (the user's own variables kept), one folder for every rank of a run, the start-up block's line on it,
and the first step's tuning and compiling counted in the step prediction where the folder lacks this run's kernels.
"""

import logging
import os
from pathlib import Path

import pytest

from tests._dist import run_distributed
from ulysses_lc.plan import deltanet_time
from ulysses_lc.plan.first_step import (FA4_COMPILE_S, FLA_AUTOTUNE_S, FLEX_COMPILE_S, first_step_extra_seconds,
                                         kernel_kinds)
from ulysses_lc.shape import ModelShape
from ulysses_lc.tiny import tiny_model_config
from ulysses_lc.train import TrainConfig, main, train
from ulysses_lc.train.kernel_cache import (CACHE_VARS, FA4_CACHE_SWITCH, KERNELS_FILE, cache_environment,
                                           kernel_cache_dir, kernel_keys, record)


def test_the_variables_come_from_the_flag_unless_the_user_set_them(tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    folder = tmp_path / "kc"
    environ = {}
    fa4 = {"FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(folder / "fa4"), FA4_CACHE_SWITCH: "1"}
    with cache_environment(folder, environ) as used:
        assert environ == {"TRITON_CACHE_DIR": str(folder / "triton"),
                           "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"), **fa4}
        assert {source for _, source in used.values()} == {"--kernel-cache"}
    assert environ == {}  # as it was
    # The user's own folder stays; torch's default, which importing its compiler sets, is no user's choice; so does
    # the user's FA4 switch (0: flash-attn-4 keeps no kernel on disk).
    environ = {"TRITON_CACHE_DIR": "/mine", "TORCHINDUCTOR_CACHE_DIR": default_cache_dir(), FA4_CACHE_SWITCH: "0"}
    with cache_environment(folder, environ) as used:
        assert environ == {"TRITON_CACHE_DIR": "/mine", "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
                           **fa4, FA4_CACHE_SWITCH: "0"}
        assert used["TRITON_CACHE_DIR"] == ("/mine", "set by you")
    assert environ == {"TRITON_CACHE_DIR": "/mine", "TORCHINDUCTOR_CACHE_DIR": default_cache_dir(),
                       FA4_CACHE_SWITCH: "0"}
    # inductor's own Triton folder (its first kernel sets it) is torch's too
    environ = {"TRITON_CACHE_DIR": os.path.join(default_cache_dir(), "triton", "0")}
    with cache_environment(folder, environ):
        assert environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    # The folder: the flag, else kernel_cache/ beside the run folder (runs/ for a new run), absolute.
    assert kernel_cache_dir(str(tmp_path / "k"), Path("x/run")) == tmp_path / "k"
    assert kernel_cache_dir(None, Path("x/run")) == Path("x/kernel_cache").absolute()
    assert kernel_cache_dir(None, None) == Path("runs/kernel_cache").absolute()


def _run_worker(rank, world_size, tmp):
    os.chdir(tmp)
    os.environ["TRITON_CACHE_DIR"] = "/mine"  # the user's, on every rank
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    os.environ.pop("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", None)
    seen, lines = [], []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("ulysses_lc").addHandler(handler)
    logging.getLogger("ulysses_lc").setLevel(logging.INFO)
    cfg = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=1, export=False, cache_dir=f"{tmp}/tokens",
                      output_dir="runs/first")
    train(cfg, on_step=lambda step, _: seen.append({var: os.environ.get(var) for var in CACHE_VARS}))
    after = {var: os.environ.get(var) for var in CACHE_VARS}
    block = next((line for line in lines if "ulysses_lc run" in line), "")
    return seen, after, block


def test_every_rank_of_a_run_takes_one_folder_beside_the_run_and_says_so(tmp_path):
    results = run_distributed(_run_worker, 2, str(tmp_path))
    folder = tmp_path / "runs" / "kernel_cache"
    for seen, after, _ in results:
        # During the run: the user's Triton folder kept, inductor's in the folder beside the run, on both ranks.
        assert seen == [{"TRITON_CACHE_DIR": "/mine", "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
                         "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": str(folder / "fa4")}]
        assert after == {"TRITON_CACHE_DIR": "/mine", "TORCHINDUCTOR_CACHE_DIR": None,
                         "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": None}  # as before the run
    block = results[0][2]
    kernels = next(line for line in block.splitlines() if line.strip().startswith("kernels"))
    assert f"{folder} (TRITON_CACHE_DIR=/mine as you set; --kernel-cache)" in kernels, kernels
    assert "nothing of this model tunes or compiles on its first step" in kernels, kernels  # a CPU run
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["first"]  # nothing written where nothing built


def _dry_run(capsys, *flags) -> tuple[str, str]:
    main(["--dry-run", "--model", "tiny-qwen3_5", "--seq-len", "65536", *flags])
    out = capsys.readouterr().out.splitlines()
    return tuple(next(line for line in out if line.strip().startswith(name)) for name in ("kernels", "step "))


def _step_seconds(line: str) -> tuple[float, float | None]:
    steady = float(line.split("step")[1].split(" s predicted")[0].replace(",", ""))
    first = line.split("the first step ")[1].split(" s")[0] if "the first step" in line else None
    return steady, None if first is None else float(first.replace(",", ""))


def test_the_dry_run_counts_fla_autotuning_until_the_cache_holds_it(tmp_path, capsys, monkeypatch):
    # fla-core over a Triton whose gated backward it runs on Hopper: the rule prices fla.
    monkeypatch.setattr(deltanet_time, "deltanet_path", lambda kernel="auto": ("fla", "fla-core, Triton 3.7.1"))
    for var in CACHE_VARS:
        monkeypatch.delenv(var, raising=False)
    folder = tmp_path / "kc"
    kernels, step = _dry_run(capsys, "--kernel-cache", str(folder))
    assert f"{folder} (TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR, FLASH_ATTENTION_CUTE_DSL_CACHE_DIR; --kernel-cache)" \
        in kernels, kernels
    assert "fla's autotuning of its gated DeltaNet kernels not cached: the first step adds about 183 s" in kernels
    steady, first = _step_seconds(step)
    assert first == pytest.approx(steady + FLA_AUTOTUNE_S, abs=0.1), step
    # An earlier run on an H200 built them (its first step's writer recorded them): counted no more.
    shape = ModelShape.from_config(tiny_model_config("tiny-qwen3_5"))
    record(folder, kernel_keys(("fla",), shape, 65536, 1), "NVIDIA H200", 204.9)
    kernels, step = _dry_run(capsys, "--kernel-cache", str(folder))
    assert "fla's autotuning of its gated DeltaNet kernels cached (NVIDIA H200, " in kernels, kernels
    assert _step_seconds(step) == (steady, None), step
    # Another sp size is another autotune key (heads per rank): not cached.
    other = kernel_keys(("fla",), shape, 65536, 2)
    assert other != kernel_keys(("fla",), shape, 65536, 1)
    assert (folder / KERNELS_FILE).is_file() and not list(folder.glob(".*"))  # no temporary file left


def test_flex_compiles_per_length_and_fla_tunes_once_per_shape():
    # gpt-oss's window layers take flex on a GPU; a length is a compile of its own, fla's keys have no length.
    from transformers import AutoConfig

    from ulysses_lc.train.loading import shipped_config

    gpt_oss = ModelShape.from_config(AutoConfig.from_pretrained(shipped_config("openai/gpt-oss-20b")))
    assert kernel_kinds(gpt_oss, "auto", 262144) == ("flex",)
    assert kernel_keys(("flex",), gpt_oss, 262144, 1) != kernel_keys(("flex",), gpt_oss, 131072, 1)
    hybrid = ModelShape.from_config(tiny_model_config("tiny-qwen3_5"))
    assert kernel_kinds(hybrid, "torch") == () and kernel_kinds(hybrid, "fla") == ("fla",)
    assert kernel_keys(("fla",), hybrid, 262144, 1) == kernel_keys(("fla",), hybrid, 131072, 1)
    assert first_step_extra_seconds(("fla", "flex")) == pytest.approx(FLA_AUTOTUNE_S + FLEX_COMPILE_S)
    assert first_step_extra_seconds(()) == 0


def test_fa4_compiles_once_per_head_shape_and_runs_the_windows_without_flex(tmp_path, capsys):
    # kernel 'fa4' runs every attention layer type, windows included: its compile counts, flex's does not.
    from transformers import AutoConfig

    from ulysses_lc.train.loading import shipped_config

    gpt_oss = ModelShape.from_config(AutoConfig.from_pretrained(shipped_config("openai/gpt-oss-20b")))
    assert kernel_kinds(gpt_oss, "auto", 262144, "fa4") == ("fa4",)
    assert kernel_kinds(gpt_oss, "auto", 262144, "cudnn") == ("flex",)
    qwen3 = ModelShape.from_config(tiny_model_config("tiny"))
    assert kernel_kinds(qwen3, "auto", 65536, "fa4") == ("fa4",) and kernel_kinds(qwen3, "auto", 65536) == ()
    hybrid = ModelShape.from_config(tiny_model_config("tiny-qwen3_5"))
    assert kernel_kinds(hybrid, "fla", 65536, "fa4") == ("fla", "fa4")
    # No length in its key; the heads per rank, the windows and the sinks are.
    assert kernel_keys(("fa4",), gpt_oss, 262144, 1) == kernel_keys(("fa4",), gpt_oss, 131072, 1)
    assert kernel_keys(("fa4",), gpt_oss, 262144, 1) != kernel_keys(("fa4",), gpt_oss, 262144, 2)
    assert "windows 128 with sinks" in kernel_keys(("fa4",), gpt_oss, 262144, 1)["fa4"]
    assert first_step_extra_seconds(("fa4",)) == pytest.approx(FA4_COMPILE_S)
    # The dry run with --kernel fa4 counts it until the folder records it.
    folder = tmp_path / "kc"
    main(["--dry-run", "--model", "tiny", "--seq-len", "65536", "--kernel", "fa4", "--kernel-cache", str(folder)])
    out = capsys.readouterr().out.splitlines()
    kernels = next(line for line in out if line.strip().startswith("kernels"))
    assert "FlashAttention-4's compile of its kernels not cached: the first step adds about 10 s" in kernels, kernels
    step = next(line for line in out if line.strip().startswith("step "))  # the rate it priced, FA4's
    assert "attention 633 (FlashAttention-4)" in step, step
    record(folder, kernel_keys(("fa4",), qwen3, 65536, 1), "NVIDIA H200", 9.0)
    main(["--dry-run", "--model", "tiny", "--seq-len", "65536", "--kernel", "fa4", "--kernel-cache", str(folder)])
    kernels = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("kernels"))
    assert "FlashAttention-4's compile of its kernels cached (NVIDIA H200, " in kernels, kernels
