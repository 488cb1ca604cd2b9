"""Multimodal checkpoints (*ForConditionalGeneration, composite.py): their language model trains, the rest is kept.

Tiny Qwen3.5, Qwen3.5-MoE and Gemma 3 checkpoints saved with transformers' own classes, as Qwen/Qwen3.5-* and
google/gemma-3-4b-it and larger are published (a vision tower, a projector, the text settings under text_config):
  - at sp 2 on 2 gloo ranks, the loss and every gradient equal the plain class's own forward on the same text
    (loss 1e-5 relative, gradients 1e-4 relative norm, fp32), with no lever and with every lever; only the language
    model's parameters train;
  - the main job (dry run, then 2 steps at sp 2 and the export) writes back a checkpoint of the same class, which
    that class's from_pretrained loads whole, with the trained text weights in it and every other tensor
    byte-identical to the input's;
  - load_model_for_length gives the checkpoint's own class, YaRN written into its text_config.
"""

import json
import os

import pytest
import torch
from safetensors import safe_open

from tests._dist import run_shared
from tests.models import COMPOSITE_FAMILIES, build_composite, composite_config
from tests.test_sp_parity import NO_LEVERS, assert_close, make_sequence
from ulysses_lc import ParallelLayout, SequenceParallelCausalLM, reduce_gradients, shard_batch
from ulysses_lc.levers.tiled_mlp import plain_parameter_name

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ALL_LEVERS = dict(chunked_loss=2, tiled_mlp=3, checkpointing=True, offload=True)


def plain_reference(family, input_ids, labels):
    """The class's own forward (text only: no pixels) and backward, as a user of the checkpoint runs it."""
    model = build_composite(family)
    # Gemma 3's class asks for token_type_ids in training (which tokens are image tokens): none here.
    extra = {"token_type_ids": torch.zeros_like(input_ids)} if family == "gemma3" else {}
    loss = model(input_ids=input_ids, labels=labels, **extra).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def sp_worker(rank, world_size, families, input_ids, labels, lever_sets):
    layout = ParallelLayout.build(world_size)
    results = {}
    for lever_name, levers in lever_sets.items():
        for family in families:
            model = SequenceParallelCausalLM(build_composite(family), layout, min_offload_bytes=0, **levers)
            loss = model(**shard_batch(input_ids, layout, labels=labels).as_kwargs())
            loss.backward()
            reduce_gradients(model.parameters(), layout)
            grads = {plain_parameter_name(n): p.grad for n, p in model.model.named_parameters() if p.grad is not None}
            trained = sorted(plain_parameter_name(n) for n, p in model.model.named_parameters() if p.requires_grad)
            model.undo()
            results[lever_name, family] = loss.item(), grads, trained
    return results


def _is_language_model(name: str) -> bool:
    return "language_model" in name or name.startswith("lm_head")


def test_sp2_trains_the_language_model_as_the_plain_class():
    # One body for both lever sets: no lever, and every lever.
    input_ids, labels = make_sequence(48, seed=3, ignore_prefix=5)
    lever_sets = {"no_levers": NO_LEVERS, "all_levers": ALL_LEVERS}
    results = run_shared(sp_worker, 2, COMPOSITE_FAMILIES, input_ids, labels, lever_sets)
    for family in COMPOSITE_FAMILIES:
        ref_loss, ref_grads = plain_reference(family, input_ids, labels)
        for lever_name in lever_sets:
            for loss, grads, trained in (r[lever_name, family] for r in results):
                try:
                    assert_close(loss, grads, ref_loss, ref_grads)
                except AssertionError as e:
                    raise AssertionError(f"{family}, {lever_name}: {e}") from None
                assert trained and all(_is_language_model(n) for n in trained), trained  # the vision tower is frozen


def _save_checkpoint(family, folder):
    from ulysses_lc.tiny import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    model = build_composite(family, vocab_size=len(tokenizer) + 3, max_position_embeddings=1024)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def _tensors(folder):
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8).flatten(),
                                                                     b.contiguous().view(torch.uint8).flatten())


def main_job_worker(rank, world_size, cfg):
    from ulysses_lc.train import train

    return train(cfg)


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_main_job_exports_the_checkpoint_class_with_untrained_weights_byte_identical(tmp_path, family):
    from ulysses_lc.train import EXPORT_DIR, TrainConfig, dry_run

    source = tmp_path / "checkpoint"
    cls = type(_save_checkpoint(family, source))
    cfg = TrainConfig(model=str(source), data="tiny", seq_len=1024, steps=2, lr=1e-2, warmup_steps=0,
                      output_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"), export=True)
    plan = dry_run(TrainConfig(model=str(source), seq_len=1024, dry_run=True, world_size=2))
    assert "its language model trains" in plan, plan
    records = run_shared(main_job_worker, 2, cfg, kind="deepspeed")[0]
    assert len(records) == 2 and records[1]["loss"] < records[0]["loss"]

    export = tmp_path / "run" / EXPORT_DIR
    assert json.loads((export / "config.json").read_text())["architectures"] == [cls.__name__]
    loaded, info = cls.from_pretrained(export, output_loading_info=True)
    assert type(loaded) is cls and not info["missing_keys"] and not info["unexpected_keys"], info
    before, after = _tensors(source), _tensors(export)
    assert before.keys() == after.keys()  # the checkpoint's own layout, key for key
    kept = [k for k in before if not _is_language_model(k)]
    trained = [k for k in before if _is_language_model(k)]
    assert len(kept) > 10 and all(_same_bytes(before[k], after[k]) for k in kept)
    assert sum(not torch.equal(before[k], after[k]) for k in trained) >= len(trained) - 2  # (norms may stay put)
    # The loaded model holds the exported weights (the trained ones among them).
    state = dict(loaded.named_parameters())
    embed = next(k for k in state if k.endswith("language_model.embed_tokens.weight"))
    on_disk = next(k for k in after if k.endswith("embed_tokens.weight"))
    assert torch.equal(state[embed], after[on_disk]) and not torch.equal(after[on_disk], before[on_disk])


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_load_model_for_length_gives_the_checkpoint_class_with_yarn(tmp_path, family):
    from ulysses_lc import load_model_for_length

    saved = _save_checkpoint(family, tmp_path)
    model = load_model_for_length(str(tmp_path), 4096)
    assert type(model) is type(saved)
    rope = model.config.get_text_config().rope_parameters
    rope = rope.get("full_attention", rope)  # Gemma 3: per layer type, the full-attention layers' scaled
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 1024
    loaded, expected = model.state_dict(), saved.state_dict()
    assert loaded.keys() == expected.keys() and all(torch.equal(loaded[k], expected[k]) for k in expected)


def test_composite_config_is_read_through_text_config():
    from ulysses_lc import ModelShape
    from ulysses_lc.levers.yarn import covered_length, plan_rope, trained_length

    config = composite_config("qwen3_5", max_position_embeddings=2048)
    assert trained_length(config) == covered_length(config) == 2048
    assert plan_rope(config, 2048).action == "none"
    assert ModelShape.from_config(config).layers == 2


def trainer_worker(rank, world_size, source, out):
    import datasets
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from tests.test_hf_trainer import DS, sequences, training_args
    from ulysses_lc import load_model_for_length
    from ulysses_lc.integrations.hf_trainer import UlyssesTrainer

    model = load_model_for_length(source, 64, dtype=torch.float32)
    # _save writes weights only where ZeRO-3 gathers them for saving (the shipped zero3 config sets this too).
    config = {**DS, "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}
    args = training_args(out, 2, deepspeed=config, save_strategy="steps", save_steps=2)
    trainer = UlyssesTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict(
        {"input_ids": sequences()}), sp_size=2)
    try:
        trainer.train()
    finally:  # a "deepspeed" body on shared ranks: the state the Trainer leaves goes with it (as a "trainer" body's)
        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_saves_the_checkpoint_class_with_untrained_weights_byte_identical(tmp_path):
    source = tmp_path / "checkpoint"
    cls = type(_save_checkpoint("qwen3_5", source))
    # The "deepspeed" kind (the body resets the Trainer's state itself): the same ranks as the main job's test above.
    losses = run_shared(trainer_worker, 2, str(source), str(tmp_path / "out"), kind="deepspeed")[0]
    assert len(losses) == 2
    saved = tmp_path / "out" / "checkpoint-2"
    loaded, info = cls.from_pretrained(saved, output_loading_info=True)
    assert type(loaded) is cls and not info["missing_keys"] and not info["unexpected_keys"], info
    before, after = _tensors(source), _tensors(saved)
    assert before.keys() == after.keys()
    assert all(_same_bytes(before[k], after[k]) for k in before if not _is_language_model(k))
    assert not torch.equal(before["model.language_model.embed_tokens.weight"],
                           after["model.language_model.embed_tokens.weight"])


def test_lora_adapts_only_the_language_model():
    # Gemma 3's SigLIP tower has q_proj / k_proj / v_proj / out_proj too: they would take adapters that never train.
    import peft

    from ulysses_lc.peft_support import apply_peft, count_trainable_parameters, lora_config

    config = composite_config("gemma3")
    adapted = apply_peft(build_composite("gemma3"), lora_config(4))
    names = [n for n, m in adapted.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert names and all("language_model" in n for n in names), names
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert count_trainable_parameters(config, lora_config(4))[1] == trainable
