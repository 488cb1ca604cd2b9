"""The main job's evaluation (--eval-every, --eval-at-start, --eval-data; issue 41, section 2) on 2 gloo ranks at sp 2:
in the training engine (ZeRO-3), on held-out text training never reads, equal to plain transformers' forward of the
model as loaded (before the first step) and as exported (after the last), loss within 1e-5 relative (fp32)."""

import io
import json
import math
import sys
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_shared
from ulysses_lc.data import build_token_stream
from ulysses_lc.plan.metrics import StepLogger
from ulysses_lc.tiny import tiny_model_config, tiny_tokenizer
from ulysses_lc.train import EXPORT_DIR, TrainConfig, parse_args, train

RTOL = 1e-5
SEQ = 1024


def _train_worker(rank, world_size, cfg):
    return train(cfg)


def _loss(model, ids) -> float:
    with torch.no_grad():
        return F.cross_entropy(model.eval()(ids[None]).logits[0, :-1], ids[1:]).item()


def test_main_job_evaluates_before_every_n_steps_and_after_the_last_on_held_out_text_at_sp_2(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = TrainConfig(model="tiny", data="tiny", seq_len=SEQ, steps=3, lr=3e-3, output_dir=str(tmp_path / "run"),
                      cache_dir=str(tmp_path / "cache"), eval_every=2, eval_at_start=True, eval_passkey_depths="0,1")
    run_shared(_train_worker, 2, cfg, kind="deepspeed")
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval"] for r in lines if "eval" in r}
    assert sorted(evals) == [0, 2, 3] and [r["step"] for r in lines if "eval" not in r] == [1, 2, 3]
    assert all(e["seq_len"] == SEQ and e["tokens"] == SEQ - 1 and len(e["buckets"]) == 8 for e in evals.values())
    assert [p["depth"] for p in evals[3]["passkey"]] == [0.0, 1.0]

    stream = build_token_stream("tiny", tiny_tokenizer(), SEQ, num_steps=3, held_out=1, cache_dir=tmp_path / "cache",
                                progress=False)
    held = stream.held_out.sample(0).input_ids
    assert torch.equal(held, torch.from_numpy(stream.held_out.tokens[:SEQ].astype("int64")))
    assert stream.tokens.shape[0] == 3 * SEQ  # training's three windows end where the held-out one starts
    torch.manual_seed(0)  # the embedded model as the run loads it
    start = AutoModelForCausalLM.from_config(tiny_model_config("tiny"), dtype=torch.float32)
    end = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / EXPORT_DIR, dtype=torch.float32)
    assert math.isclose(evals[0]["loss"], _loss(start, held), rel_tol=RTOL)
    assert math.isclose(evals[3]["loss"], _loss(end, held), rel_tol=RTOL)
    assert evals[3]["loss"] < evals[0]["loss"]  # it trained


def test_eval_data_is_read_as_data_is_and_refused_with_the_fix_when_shorter_than_the_length(tmp_path):
    from ulysses_lc.train.evaluation import RunEvaluation
    from ulysses_lc.train.settings import RunSettings

    text = tmp_path / "book.txt"
    text.write_text("It was a long evening. " * 200)  # 4,600 bytes: four windows of 1,024 byte tokens
    run = RunSettings(TrainConfig(model="tiny", data="tiny", seq_len=SEQ, eval_data=str(text), eval_sequences=2,
                                  cache_dir=str(tmp_path / "cache")))
    layout = types.SimpleNamespace(dp_size=1)
    evaluation = RunEvaluation.build(run.eval, None, run.stream, tiny_tokenizer(), layout, True, False, 257, 256)
    assert len(evaluation.samples) == 2 and len(evaluation.haystacks) == 5
    assert tiny_tokenizer().decode(evaluation.samples[0].input_ids[:23]) == "It was a long evening. "
    short = replace(run.eval, source=str(tmp_path / "short.txt"))
    (tmp_path / "short.txt").write_text("Too short.")
    with pytest.raises(ValueError, match="cannot be read as windows of 1,024 tokens.*give a longer text"):
        RunEvaluation.build(short, None, run.stream, tiny_tokenizer(), layout, True, False, 257, 256)


@pytest.mark.parametrize("flags,message", [
    (["--eval-every", "-1"], "--eval-every -1 must be >= 0"),
    (["--eval-sequences", "2"], "--eval-sequences set up an evaluation, which this run does not do"),
    (["--eval-every", "2", "--eval-passkey-depths", "0,1.5"], r"--eval-passkey-depths '0,1.5': give shares"),
    (["--eval-at-start", "--method", "dpo"], "evaluate its export with ulysses-lc-eval"),
])
def test_eval_flags_no_run_can_use_are_refused_with_the_fix(flags, message):
    with pytest.raises(ValueError, match=message):
        parse_args(["--model", "tiny", *flags]).check()


def test_an_evaluation_is_one_line_a_metrics_record_and_tensorboard_scalars(tmp_path, monkeypatch):
    from tests.test_eval import _result

    scalars = []
    fake = types.ModuleType("torch.utils.tensorboard")

    class SummaryWriter:
        def __init__(self, log_dir):
            pass

        def add_scalar(self, name, value, step):
            scalars.append((name, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    fake.SummaryWriter = SummaryWriter
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    out = io.StringIO()
    with StepLogger(tmp_path, 4, tokens_per_step=8, tensorboard=True, progress=False, stream=out) as log:
        log.log_eval(4, _result())
    assert out.getvalue().startswith("eval step 4 | loss 3.3000 | by position 3.00 3.10 [8,192] 3.60 | passkey 4/4")
    record = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert record["step"] == 4 and record["eval"]["buckets"][2]["beyond_trained"]
    assert ("eval/loss", 3.3, 4) in scalars and ("eval/loss_pos_8192", 3.6, 4) in scalars
