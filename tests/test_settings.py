"""The flags are resolved once, at the top (train/settings.py): each part takes its own settings, not the TrainConfig.

Two kinds of test: what RunSettings resolves (once, here, so nothing below derives it again), and a rule read from the
source: inside train/, only the functions that work on the flags as such (parsing, checking, a resume's merge, the
record of a run, the comparison across ranks) and the two entry points take the whole TrainConfig.
"""

import ast
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ulysses_lc.train import CheckFailed, RunSettings, TrainConfig
from ulysses_lc.train.config import TINY_DEFAULTS

TRAIN = Path(__file__).resolve().parent.parent / "ulysses_lc" / "train"

# Where the whole TrainConfig may go: (module, function) or (module, "*") for a module that is about the flags.
WHOLE_CONFIG = {
    ("config.py", "*"),  # TrainConfig itself, the command line
    ("config_checks.py", "*"),  # TrainConfig's checks (TrainConfig.check), split out of config.py for length
    ("resume.py", "*"),  # a resume's merge of the flags with the saved run's, and its record
    ("settings.py", "RunSettings.__init__"),  # the one place the flags are split into settings
    ("loop.py", "train"), ("dry_run.py", "dry_run"),  # the entry points: each builds RunSettings first
    ("same_flags.py", "check_same_flags"),  # every flag compared across ranks
    ("run_state.py", "write_run_file"), ("loop.py", "_start_wandb"),  # run.json and the W&B run record the flags
}


def _takes_the_config(path: Path) -> list[str]:
    """Functions of `path` with a parameter named cfg or flags, or annotated TrainConfig, outside WHOLE_CONFIG."""
    found = []

    def visit(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                args = [*child.args.posonlyargs, *child.args.args, *child.args.kwonlyargs]
                whole = [a.arg for a in args if a.arg in ("cfg", "flags")
                         or (a.annotation is not None and "TrainConfig" in ast.unparse(a.annotation))]
                if whole and (path.name, "*") not in WHOLE_CONFIG and (path.name, name) not in WHOLE_CONFIG:
                    found.append(f"train/{path.name}: {name}({', '.join(whole)})")
                visit(child, f"{name}.")

    visit(ast.parse(path.read_text()))
    return found


def test_below_the_entry_points_the_parts_take_their_settings():
    found = [f for p in sorted(TRAIN.glob("*.py")) for f in _takes_the_config(p)]
    assert not found, ("these take the whole TrainConfig; give them the settings part they read (train/settings.py):\n"
                       + "\n".join(found))


def test_the_rule_catches_a_planted_function(tmp_path):
    planted = tmp_path / "estimate.py"
    planted.write_text("def job_for(cfg, checked):\n    return cfg.kernel\n\n\nclass A:\n    def f(self, x: 'TrainConfig'):\n"
                       "        pass\n")
    assert _takes_the_config(planted) == ["train/estimate.py: job_for(cfg)", "train/estimate.py: A.f(x)"]
    assert _takes_the_config(TRAIN / "config.py") == []  # a module about the flags may


def test_no_part_below_train_names_the_config():
    package = TRAIN.parent
    named = [str(p.relative_to(package)) for p in package.rglob("*.py")
             if p.parent.name != "train" and "TrainConfig" in p.read_text()]
    assert not named, named


def _tiny(**kw) -> TrainConfig:
    return TrainConfig(**{**TINY_DEFAULTS, "seq_len": 512, **kw})


def test_what_the_settings_resolve(tmp_path):
    run = RunSettings(_tiny(cache_dir=str(tmp_path / "cache"), packing=True, recompute_layers=2))
    assert run.model.name == "tiny" and run.model.dtype == (torch.bfloat16 if torch.cuda.is_available()
                                                             else torch.float32)
    assert run.stream.cache_dir == tmp_path / "cache" and run.stream.shape.packing and run.stream.packed_documents
    assert run.plan.overrides == (2, None, None) and run.plan.overridden() == ["--recompute-layers"]
    assert run.objective.reference is None and not run.objective.dpo
    assert run.output.folder is None and run.flags == run.given
    # A dry run sizes the GPU run: bf16 whatever this machine has.
    assert RunSettings(_tiny(dry_run=True)).model.dtype == torch.bfloat16
    # DPO's reference, auto: the adapters off with LoRA, else a frozen copy; DPO's two documents per pair are packed.
    dpo = _tiny(method="dpo")
    assert RunSettings(dpo).objective.reference == "copy" and RunSettings(dpo).stream.packed_documents
    assert RunSettings(replace(dpo, lora_r=4)).objective.reference == "adapters"
    assert RunSettings(replace(dpo, dpo_reference="precomputed")).objective.reference == "precomputed"
    assert RunSettings(TrainConfig(method="dpo", seq_len=262144)).stream.long_documents
    assert not RunSettings(TrainConfig(method="dpo", seq_len=262144, packing=True)).stream.long_documents


def test_a_flag_no_run_can_use_is_a_check_failure():
    """Raised as CheckFailed (agreed across ranks as every check is), naming the flag."""
    with pytest.raises(CheckFailed, match="--steps 0: train at least one step"):
        RunSettings(_tiny(steps=0))


def test_a_resume_without_output_dir_finds_the_latest_run_once(tmp_path, monkeypatch):
    """--resume alone: the newest runs/<model>-* with a checkpoint, resolved here and nowhere else."""
    from ulysses_lc.train.run_state import CHECKPOINT_DIR, LATEST

    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckFailed, match="no run of tiny under runs/ holds a checkpoint"):
        RunSettings(_tiny(resume=True))
    for age, name in [(100, "tiny-20261201-000001"), (0, "tiny-20261201-000000")]:  # the newest checkpoint wins
        (tmp_path / "runs" / name / CHECKPOINT_DIR).mkdir(parents=True)
        latest = tmp_path / "runs" / name / CHECKPOINT_DIR / LATEST
        latest.write_text("step1")
        os.utime(latest, (1e9 + age, 1e9 + age))
    run = RunSettings(_tiny(resume=True))
    assert run.output.folder == Path("runs") / "tiny-20261201-000001"


def test_a_resume_can_turn_a_saved_switch_back_on(tmp_path):
    """A run saved with --no-export (or --tensorboard) keeps that on --resume unless the flag is given either way."""
    from ulysses_lc.train import parse_args
    from ulysses_lc.train.run_state import CHECKPOINT_DIR, LATEST, RUN_FILE

    run = tmp_path / "run"
    (run / CHECKPOINT_DIR).mkdir(parents=True)
    (run / CHECKPOINT_DIR / LATEST).write_text("step3")
    saved = {**vars(_tiny(export=False, tensorboard=True)), "flags_given": None}
    (run / RUN_FILE).write_text(__import__("json").dumps(saved))
    resume = ["--model", "tiny", "--resume", "--output-dir", str(run)]
    kept = RunSettings(parse_args(resume))
    assert (kept.output.export, kept.output.tensorboard) == (False, True) and kept.changed == {}
    turned = RunSettings(parse_args([*resume, "--export", "--no-tensorboard"]))
    assert (turned.output.export, turned.output.tensorboard) == (True, False)
    assert turned.changed == {"export": (False, True), "tensorboard": (True, False)}
