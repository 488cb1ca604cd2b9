"""`ulysses-lc-eval` on CPU at sp 2 (issue 41, section 2): under torchrun with each rank holding the weights, and
in-process under ZeRO-3, both against plain transformers' forward on the same window (loss and loss by position
within 1e-5 relative, fp32), with the before / after comparison of two model folders and what it writes."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._dist import _free_port, run_shared

REPO = Path(__file__).resolve().parent.parent
SEQ = 2048  # twice the tiny model's trained 1,024: the RoPE is planned (YaRN factor 2) as the main job plans it
RTOL = 1e-5


def _folders(tmp_path: Path) -> Path:
    """A second tiny model (seed 1) saved as a model folder with its tokenizer, as a run's hf_export is."""
    from transformers import AutoModelForCausalLM

    from ulysses_lc.tiny import tiny_model_config, tiny_tokenizer

    folder = tmp_path / "other" / "hf_export"
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(tiny_model_config("tiny")).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _args(tmp_path: Path, other: Path, out: str) -> list[str]:
    return ["--model", "tiny", "--compare", str(other), "--seq-len", str(SEQ), "--data", "tiny", "--buckets", "4",
            "--passkey-depths", "0,1", "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / out)]


def _reference(tmp_path: Path, other: Path) -> dict:
    """{model: (loss, [bucket losses])} from plain transformers on the command's window (its first of tiny text)."""
    from transformers import AutoModelForCausalLM

    from ulysses_lc import apply_yarn
    from ulysses_lc.eval.data import eval_windows
    from ulysses_lc.tiny import tiny_model_config, tiny_tokenizer

    ids = eval_windows("tiny", tiny_tokenizer(), SEQ, 1, cache_dir=tmp_path / "cache")[0].input_ids
    config = apply_yarn(tiny_model_config("tiny"), SEQ)
    torch.manual_seed(0)  # the embedded model's weights: seed 0, as the command loads it
    models = {"tiny": AutoModelForCausalLM.from_config(config),
              "hf_export": AutoModelForCausalLM.from_pretrained(other, config=config)}
    out = {}
    with torch.no_grad():
        for name, model in models.items():
            loss = F.cross_entropy(model.eval()(ids[None]).logits[0, :-1], ids[1:], reduction="none")
            out[name] = (loss.mean().item(), [loss[a:b].mean().item() for a, b in ((0, 512), (512, 1024),
                                                                                   (1024, 1536), (1536, SEQ - 1))])
    return out


def _assert_matches(results: dict, reference: dict) -> None:
    assert set(results) == set(reference)
    for name, (loss, buckets) in reference.items():
        r = results[name]
        assert math.isclose(r["loss"], loss, rel_tol=RTOL), (name, r["loss"], loss)
        assert [b["start"] for b in r["buckets"]] == [0, 512, 1024, 1536] and r["trained_length"] == 1024
        np.testing.assert_allclose([b["loss"] for b in r["buckets"]], buckets, rtol=RTOL)
        assert [p["depth"] for p in r["passkey"]] == [0.0, 1.0]


def test_eval_command_at_sp_2_under_torchrun_compares_two_folders_as_plain_transformers_scores_them(tmp_path):
    other = _folders(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           "-m", "ulysses_lc.eval", *_args(tmp_path, other, "out")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    record = json.loads((tmp_path / "out" / "eval.json").read_text())
    _assert_matches(record["results"], _reference(tmp_path, other))
    assert record["settings"]["compare"] == str(other) and record["comparison"]
    assert "tiny: eval | loss " in output and "| by position " in output and "[1,024]" in output, output
    assert any(line.startswith("pos 1,024-1,536 *") for line in output.splitlines()), output  # the comparison
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "out" / "loss_by_position.png").stat().st_size > 0
    except ImportError:
        assert "no PNG: matplotlib is not installed (pip install 'ulysses_lc[plot]')" in output, output


def _zero3_worker(rank, world_size, args):
    from ulysses_lc.eval.cli import run

    return {name: result.to_dict() for name, result in run(args).items()}


def test_eval_command_under_zero3_in_process_matches_plain_transformers(tmp_path):
    other = _folders(tmp_path)
    reference = _reference(tmp_path, other)  # also builds the token cache the ranks then read
    results = run_shared(_zero3_worker, 2, [*_args(tmp_path, other, "zero3"), "--ds-config", "zero3"],
                         kind="deepspeed")
    assert results[0] == results[1]
    _assert_matches(results[0], reference)


def test_eval_command_refuses_names_that_do_not_match_the_models():
    from ulysses_lc.eval.cli import build_parser, _names

    with pytest.raises(ValueError, match="give one name per model"):
        _names(build_parser().parse_args(["--model", "a", "--compare", "b", "--names", "x", "--seq-len", "8"]))
    assert _names(build_parser().parse_args(["--model", "r1/hf_export", "--compare", "r2/hf_export",
                                             "--seq-len", "8"])) == ["r1/hf_export", "r2/hf_export"]
