"""TRL's DPOTrainer through `ulysses_trainer(DPOTrainer)` on 2 gloo ranks (sp 2, DeepSpeed ZeRO-3) against TRL's own
DPOTrainer on one process for the same row: the first step's loss (1e-5 relative), its reward margin, and every
gradient as ZeRO-3 reduced it (1e-4 relative norm); with a frozen reference copy and with LoRA (the reference is
the adapters off). And each refusal of a setting or row it cannot train as TRL does.
"""

import tempfile

import pytest

from tests._dist import run_shared
from tests.test_hf_trainer import DS
from tests.test_preference import GRAD_RTOL, LOSS_RTOL, MARGIN_ATOL, OVERRIDES, ROWS, lora, trl_dpo

pytest.importorskip("trl")
pytest.importorskip("peft")

LEVERS = dict(chunked_loss=5, tiled_mlp=3, min_offload_bytes=0)


def dpo_args(out, **overrides):
    from trl import DPOConfig

    kwargs = dict(output_dir=out, deepspeed=DS, per_device_train_batch_size=1, per_device_eval_batch_size=1,
                  max_steps=1, learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                  lr_scheduler_type="constant", disable_tqdm=True, use_cpu=True, bf16=False, beta=0.3,  # seed: 42 as TRL
                  activation_checkpointing=False, max_length=128)
    kwargs.update(overrides)
    return DPOConfig(**kwargs)


def dpo_worker(rank, world, out, reference):
    import datasets
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad
    from trl import DPOTrainer

    from tests.models import build
    from ulysses_lc.integrations.hf_trainer import ulysses_trainer
    from ulysses_lc.tiny import tiny_tokenizer

    record = {}
    original = DeepSpeedEngine.step

    def step(engine, *args, **kwargs):  # the first step's full gradients, as ZeRO-3 reduced them (test only)
        if "grads" not in record and engine.optimizer is not None:
            record["grads"] = {name: g.clone() for name, p in engine.module.plain_named_parameters()
                               if (g := safe_get_full_grad(p)) is not None}
        return original(engine, *args, **kwargs)

    # Both models before the DPOConfig, as TRL's one-process reference builds them (after it, ZeRO-3's zero.Init
    # would draw them partitioned).
    policy, ref_model = build("qwen3", **OVERRIDES), build("qwen3", seed=1, **OVERRIDES)
    DeepSpeedEngine.step = step
    try:
        trainer = ulysses_trainer(DPOTrainer)(
            model=policy, args=dpo_args(out), ref_model=ref_model if reference == "copy" else None,
            peft_config=lora() if reference == "adapters" else None, train_dataset=datasets.Dataset.from_list(ROWS[:1]),
            processing_class=tiny_tokenizer(), sp_size=world, levers=LEVERS)
        trainer.train()
    finally:
        DeepSpeedEngine.step = original
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return logs[0]["loss"], logs[0]["rewards/margins"], record["grads"]


@pytest.mark.parametrize("reference", ["copy", "adapters"])
def test_dpo_trainer_sp2_equals_trl_on_one_process(tmp_path, reference):
    ref_loss, ref_grads, ref_margin = trl_dpo(ROWS[:1], reference=reference, beta=0.3)[:3]
    for loss, margin, grads in run_shared(dpo_worker, 2, str(tmp_path), reference, kind="trainer"):
        # The Trainer logs the loss rounded to 4 significant digits.
        assert abs(loss - ref_loss) <= max(LOSS_RTOL * abs(ref_loss), 5e-5), (loss, ref_loss)
        assert abs(margin - ref_margin) <= MARGIN_ATOL, (margin, ref_margin)
        assert grads.keys() == ref_grads.keys()
        for name, ref in ref_grads.items():
            err = (grads[name] - ref).norm() / ref.norm().clamp(min=1e-12)
            assert err <= GRAD_RTOL, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("overrides, words", [
    (dict(loss_type=["hinge"]), "sigmoid and ipo"),
    (dict(loss_type=["sigmoid", "sft"]), "one at a"),
    (dict(label_smoothing=0.1), "does not use it"),
    (dict(precompute_ref_log_probs=True), "precompute"),
    (dict(use_weighting=True), "use_weighting"),
])
def test_dpo_settings_refused(overrides, words):
    from tests.models import build
    from ulysses_lc.integrations.hf_dpo import check_dpo_setup

    with tempfile.TemporaryDirectory() as out:
        args = dpo_args(out, deepspeed=None, **overrides)  # no DeepSpeed in the test process
    with pytest.raises(ValueError, match=words):
        check_dpo_setup(args, build("qwen3"), build("qwen3"), None)


def test_dpo_without_a_reference_and_rows_that_do_not_fit_are_refused():
    from tests.models import build
    from ulysses_lc.integrations.hf_dpo import check_dpo_setup, check_row

    with tempfile.TemporaryDirectory() as out:
        args = dpo_args(out, deepspeed=None)
    with pytest.raises(ValueError, match="needs a reference model"):
        check_dpo_setup(args, build("qwen3"), None, None)
    row = {"prompt_ids": [1] * 10, "chosen_ids": [2] * 5, "rejected_ids": [3] * 7}
    check_row(row, 17, "row 0")
    with pytest.raises(ValueError, match="TRL would cut"):
        check_row(row, 16, "row 0")
    with pytest.raises(ValueError, match="no chosen completion tokens"):
        check_row({**row, "chosen_ids": []}, None, "row 0")
