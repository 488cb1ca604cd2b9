"""Sizing a user can trust (issue 21): a plan that does not fit is never called one, host memory is a limit like
device memory and the dry run names the one that binds, and --max-seq-len finds the longest sequence that fits,
consistently with the dry run's own arithmetic. Dry runs of public shapes written in code: no weights, no GPU."""

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_memory_prediction import qwen3_config
from ulysses_lc import ModelShape, memory
from ulysses_lc.plan.memory_model import PINNED_NODE_SHARE
from ulysses_lc.plan.sizing import Job, Limits
from ulysses_lc.train import TrainConfig, dry_run
from ulysses_lc.train.estimate import DoesNotFit

REPO = Path(__file__).resolve().parent.parent
GB = 1e9
PARAMS = {"qwen3-0.6b": 596_049_920, "qwen3-8b": 8_190_735_360, "qwen3-32b": 32_762_123_264}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Local folders holding only a public shape's config (as `--model ./Qwen3-8B` would, without the weights)."""
    root = tmp_path_factory.mktemp("configs")
    for name in PARAMS:
        qwen3_config(name).save_pretrained(root / name)
    return root


def _cfg(folders, name, world, seq, gpu=149, host=250, **kw):
    return TrainConfig(model=str(folders / name), data="tiny", seq_len=seq, dry_run=True, world_size=world,
                       gpu_memory_gb=gpu, host_memory_gb=host, **kw)


def _job(name, world, **kw):
    return Job(ModelShape.from_config(qwen3_config(name)), PARAMS[name], world, world, **kw)


# -- a plan that does not fit is never called one ---------------------------------------------------------------

@pytest.mark.parametrize("seq, gpu", [(4 << 20, 80), (1 << 20, 40), (16 << 20, 149)])
def test_the_issues_plans_that_do_not_fit_are_refused_with_what_would(folders, seq, gpu):
    """Issue 21's examples (Qwen3-8B shape, 8 GPUs), each printed as a plan before: now refused, by how much, with
    what would fit, each alternative itself priced by the same arithmetic."""
    with pytest.raises(DoesNotFit) as refused:
        dry_run(_cfg(folders, "qwen3-8b", 8, seq, gpu=gpu))
    message = str(refused.value)
    assert message.startswith("does not fit: gpu ") and "gpu over by" in message and "What would fit:" in message
    over = float(message.split("gpu over by ")[1].split(" GB")[0])
    needed = float(message.split("does not fit: gpu ")[1].split(" GB")[0])
    assert abs(needed - gpu - over) < 0.2
    assert "--world-size" in message and "zero3_offload_optimizer" in message
    report = refused.value.report  # what the dry run prints before the error: the plan is not called one
    assert "limits    " in report and ": does not fit: gpu" in report and "fastest plan that fits" not in report
    assert "the least memory a plan can take, and it does not fit" in report


def test_a_dry_run_that_does_not_fit_exits_nonzero_with_the_cause_last(folders):
    cmd = [sys.executable, "-m", "ulysses_lc.train", "--dry-run", "--model", str(folders / "qwen3-8b"), "--data",
           "tiny", "--world-size", "8", "--seq-len", str(4 << 20), "--gpu-memory-gb", "80", "--host-memory-gb", "250"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode != 0
    assert "plan      0 plain layers, 36 checkpointed" in done.stdout and "nothing was loaded" in done.stdout
    error = done.stderr.strip().split("error: ", 1)[1]
    assert error.startswith("does not fit: gpu ") and "--world-size 16 --sp-size 16" in error


def test_the_run_refuses_the_same_plan(folders):
    """The run's start-up check is the dry run's arithmetic on the run's limits (estimate_memory(...).check())."""
    from ulysses_lc.train.estimate import estimate_memory
    from ulysses_lc.train.preflight import preflight
    from ulysses_lc.train.settings import RunSettings

    cfg = replace(_cfg(folders, "qwen3-8b", 8, 4 << 20, gpu=80), dry_run=False, output_dir=str(folders / "run"))
    run = RunSettings(cfg)
    checked = preflight(run, 8)
    job = _job("qwen3-8b", 8)
    limits = Limits(80 * GB, 250 * GB)
    estimate = estimate_memory(run, checked, job.plan(cfg.seq_len, limits), PARAMS["qwen3-8b"], limits)
    with pytest.raises(DoesNotFit, match="gpu over by .* What would fit:\n  --world-size 16"):
        estimate.check()


# -- host memory as a limit -------------------------------------------------------------------------------------

def test_the_dry_run_names_the_limit_that_binds(folders):
    # 8B at 4M on 8 x 149 GB: 250 GB of host a rank holds the offloaded inputs and outputs, and is the tighter one.
    text = dry_run(_cfg(folders, "qwen3-8b", 8, 4 << 20))
    assert "host memory binds" in text and "not the limit" not in text
    host = float(text.split("), host ")[1].split(" GB")[0])
    assert host <= 250
    # 0.6B at 256k on one GPU: the GPU binds.
    assert "gpu memory binds" in dry_run(_cfg(folders, "qwen3-0.6b", 1, 1 << 18))


def test_a_short_host_keeps_inputs_on_the_gpu_and_recomputes_more():
    # 8B at 3M on 8 x 149 GB: less host drops kept attention outputs first, then keeps inputs on the GPU, which
    # then holds fewer layers that skip the recompute.
    job, seq = _job("qwen3-8b", 8), 3 << 20
    plans = [job.fit(seq, Limits(149 * GB, host * GB)) for host in (250, 150, 100)]
    assert all(f.fits for f in plans) and [f.binds for f in plans] == ["gpu", "host", "host"]
    for more, less in zip(plans, plans[1:]):
        assert less.memory.act_host < more.memory.act_host and less.memory.host <= less.limits.host_bytes
        assert less.plan.cache_attention_layers < more.plan.cache_attention_layers
        assert less.plan.keep_on_gpu >= more.plan.keep_on_gpu
        assert less.plan.recompute_layers >= more.plan.recompute_layers
    assert plans[-1].plan.keep_on_gpu > plans[0].plan.keep_on_gpu
    assert plans[-1].plan.recompute_layers > plans[0].plan.recompute_layers
    # Too little host for the inputs the GPU cannot take: refused.
    assert not job.fit(seq, Limits(149 * GB, 50 * GB)).fits


def test_optimizer_offload_moves_the_state_to_the_host_in_the_prediction_and_the_plan():
    seq, limits = 1 << 20, Limits(80 * GB, 250 * GB)
    plain, offloaded = _job("qwen3-8b", 8), _job("qwen3-8b", 8, offload_optimizer=True)
    a, b = plain.fit(seq, limits), offloaded.fit(seq, limits)
    per_rank = -(-PARAMS["qwen3-8b"] // 8)
    moved = 16 * per_rank  # fp32 master and gradient, AdamW's moments
    assert abs((a.memory.state_gpu - b.memory.state_gpu) - moved) < 1e6
    # On the host DeepSpeed holds a second fp32 gradient copy, in pinned blocks rounded up to powers of two: the flat
    # buffer (1,023,841,920 elements, 4.1 GB -> 2^32 bytes) and the sub-groups' of at most 1e9 elements (4.0 GB ->
    # 2^32, and the 23.8 M left, 95 MB -> 2^27).
    host = b.memory.state_host - a.memory.state_host
    assert host == 12 * per_rank + 2 * 2**32 + 2**27 and host > moved + 4 * per_rank
    assert host == memory.zero3_offload_host_bytes(per_rank, 0, True, False)
    unpinned = Job.from_ds_config(offloaded.shape, offloaded.num_params, 8, 1, {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}}})  # DeepSpeed's default: pin_memory false, no rounding
    assert unpinned.fit(seq, limits).memory.state_host == moved + 4 * per_rank
    # The planner's host budget is what the state leaves (in pinned bytes, each with the node's share of it).
    assert offloaded.budget(limits)[1] == pytest.approx(plain.budget(limits)[1] - host / (1 + PINNED_NODE_SHARE))


def test_packed_documents_and_moe_are_priced_on_their_own_terms():
    job = _job("qwen3-0.6b", 1)
    packed = replace(job, packed=True)
    limits = Limits(149 * GB, 250 * GB)
    assert packed.plan(1 << 18, limits).cache_attention_layers == 0  # no kept outputs for documents
    plan = job.plan(1 << 18, limits)
    assert packed.predict(1 << 18, plan).act_host < job.predict(1 << 18, plan).act_host
    from transformers import Qwen3MoeConfig

    moe = ModelShape.from_config(Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                                num_experts=128, num_experts_per_tok=8, num_hidden_layers=48,
                                                num_attention_heads=32, num_key_value_heads=4, head_dim=128))
    # ZeRO-3 gathers a whole MoE layer, every expert: 128 x 3 x 2048 x 768 weights and more.
    assert moe.largest_module_params > 128 * 3 * 2048 * 768 > moe.layer_matmul_params / 48


# -- the longest sequence -------------------------------------------------------------------------------------

def test_max_seq_len_is_the_longest_that_fits_by_the_dry_runs_own_arithmetic(folders):
    text = dry_run(_cfg(folders, "qwen3-8b", 8, 1 << 20, gpu=80, max_seq_len=True))
    longest = int(text.split("longest   ")[1].split(" tokens")[0].replace(",", ""))
    assert f"length    {longest:,} tokens per step" in text and "fits: gpu" in text and "step      " in text
    job, limits = _job("qwen3-8b", 8), Limits(80 * GB, 250 * GB)
    assert job.longest(limits) == longest
    assert job.fit(longest, limits).fits and not job.fit(int(longest * 1.1), limits).fits
    assert not job.fit(longest + 1024 * 8, limits).fits  # the next multiple does not fit either
    assert f"1.1x that, {int(longest * 1.1):,}: does not fit" in text


def test_max_seq_len_grows_with_every_resource():
    base = _job("qwen3-0.6b", 8)
    lengths = {gpu: base.longest(Limits(gpu * GB, 250 * GB)) for gpu in (40, 80, 141)}
    assert lengths[40] < lengths[80] < lengths[141]
    hosts = [base.longest(Limits(80 * GB, host * GB)) for host in (30, 60, 250)]
    assert hosts == sorted(hosts) and hosts[0] < hosts[-1]
    worlds = [_job("qwen3-0.6b", w).longest(Limits(80 * GB, 250 * GB)) for w in (1, 2, 4, 8)]
    assert worlds == sorted(worlds) and worlds[0] < worlds[-1]


def test_when_no_length_fits_max_seq_len_says_so_and_what_would(folders):
    # Qwen3-32B on 8 x 80 GB: ZeRO-3's state alone (18 bytes a parameter over 8 ranks: 73.7 GB) leaves no room.
    with pytest.raises(DoesNotFit, match="no sequence fits") as refused:
        dry_run(_cfg(folders, "qwen3-32b", 8, 1 << 20, gpu=80, max_seq_len=True))
    assert "--ds-config zero3_offload_optimizer: fits" in str(refused.value)


# -- the run plans no larger than its dry run -------------------------------------------------------------------

def test_the_runs_plan_is_capped_by_the_dry_runs_budget(monkeypatch):
    import torch

    from ulysses_lc.parallel.layout import ParallelLayout

    job, seq, limits = _job("qwen3-0.6b", 1), 1 << 18, Limits(149 * GB, 250 * GB)
    monkeypatch.setattr(memory, "measure_free_memory", lambda device, layout: (10**13, 10**13))  # plenty free
    monkeypatch.setattr(memory, "measure_foreign_bytes", lambda device, layout: 0)  # no other process on the GPU
    plan = memory.plan_step_memory(job.shape, seq, ParallelLayout(1, 1), torch.device("cuda"),
                                   budget=job.budget(limits))
    assert plan == job.plan(seq, limits)
