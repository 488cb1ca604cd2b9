"""Published checkpoints' config.json (ulysses_lc/model_configs, each one's source in its SOURCES.md), one by one.

- The dry run of each hub name at 1,048,576 tokens on 8 GPUs (an H200's 149 GB, a GPU node's 225 GB of host per
  rank), with no network: it reads the shipped config, says so, and plans (fits, or does not fit and says what would)
  or refuses with the documented reason. VERDICTS lists which, so a change in either direction fails here.
- A shrunken copy of each (tests/shrink.py: 2 layers, widths divided down; the layer types, RoPE type and recipe, head
  ratios, MoE and composite layout kept) trains one step at sp 2 on 2 gloo ranks with every lever on, against plain
  transformers' forward and backward of the same class on the same sequence: loss within 1e-5 relative, every
  gradient within 1e-4 relative norm (fp32). One launch for all of them; the references are computed here.
"""

import json
import os
from pathlib import Path

import pytest
import torch

from tests._dist import run_shared
from tests.shrink import VOCAB, shrink
from tests.test_sp_parity import assert_close

SHIPPED_CONFIGS = Path(__file__).resolve().parent.parent / "ulysses_lc" / "model_configs"  # as train/loading.py reads

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the point of the dry-run test: no hub

SEQ_LEN = 1_048_576
FITS = "fits"
DOES_NOT_FIT = "does not fit"
# The dry run's verdict per shipped config: FITS, DOES_NOT_FIT (a plan, over the limits: the run is refused before
# loading with what would fit), or a fragment of the refusal the docs give for it (docs/models.md).
VERDICTS = {
    "HuggingFaceTB/SmolLM2-135M": "cannot split num_attention_heads=9 / num_key_value_heads=3",  # no sp 8 divides 9
    "Qwen/Qwen3-30B-A3B": FITS,
    "Qwen/Qwen3-8B": FITS,
    "Qwen/Qwen3-Next-80B-A3B-Instruct": DOES_NOT_FIT,
    "Qwen/Qwen3.5-0.8B": FITS,
    "Qwen/Qwen3.5-35B-A3B": DOES_NOT_FIT,
    "deepseek-ai/DeepSeek-V3-0324": DOES_NOT_FIT,
    "google/gemma-3-1b-it": "cannot split num_attention_heads=4 / num_key_value_heads=1",  # sp 8 > 4 query heads
    "google/gemma-3-27b-it": FITS,  # its language model only: the vision tower stays frozen (composite.py)
    "meta-llama/Llama-3.1-8B": "llama3 has no well-defined longer form",  # covers 131,072 tokens
    "meta-llama/Llama-3.2-3B": "llama3 has no well-defined longer form",
    "meta-llama/Llama-3.3-70B-Instruct": "llama3 has no well-defined longer form",
    "microsoft/Phi-4-mini-instruct": "longrope has no well-defined longer form",
    "mistralai/Mistral-7B-Instruct-v0.3": FITS,
    "mistralai/Mistral-7B-v0.1": FITS,
    "openai/gpt-oss-120b": DOES_NOT_FIT,
    "openai/gpt-oss-20b": FITS,
}
SHIPPED = sorted(p.parent.name.replace("__", "/") for p in SHIPPED_CONFIGS.glob("*/config.json"))


def test_every_shipped_config_has_a_verdict_and_a_source():
    assert len(SHIPPED) >= 15 and sorted(VERDICTS) == SHIPPED
    sources = (SHIPPED_CONFIGS / "SOURCES.md").read_text()
    assert all(f"`{name}`" in sources for name in SHIPPED), [n for n in SHIPPED if f"`{n}`" not in sources]


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_dry_run_of_the_hub_name_at_1m_tokens_on_8_gpus(name):
    from ulysses_lc.train import TrainConfig, dry_run
    from ulysses_lc.train.config import CheckFailed
    from ulysses_lc.train.estimate import DoesNotFit

    cfg = TrainConfig(model=name, dry_run=True, world_size=8, seq_len=SEQ_LEN)
    try:
        text, verdict = dry_run(cfg), FITS
    except DoesNotFit as e:
        text, verdict = e.report, DOES_NOT_FIT
    except CheckFailed as e:
        text, verdict = str(e), str(e)
    expected = VERDICTS[name]
    assert verdict == expected if expected in (FITS, DOES_NOT_FIT) else expected in verdict, verdict
    if expected in (FITS, DOES_NOT_FIT):  # it read the shipped file, and says so
        assert f"the config.json of {name} shipped with ulysses_lc" in text, text


def test_a_hub_name_not_shipped_says_a_config_folder_is_enough():
    from ulysses_lc.train import TrainConfig, dry_run
    from ulysses_lc.train.config import CheckFailed

    with pytest.raises(CheckFailed, match="a folder holding only the model's config.json"):
        dry_run(TrainConfig(model="Qwen/Qwen3-4B", dry_run=True, world_size=8, seq_len=SEQ_LEN))


def shrunken_configs() -> dict:
    """name -> (config class name, shrunken config dict), every shipped config."""
    from transformers import AutoConfig

    from ulysses_lc.shape import text_config

    out = {}
    for name in SHIPPED:
        folder = SHIPPED_CONFIGS / name.replace("/", "__")
        full = AutoConfig.from_pretrained(folder)
        raw = json.loads((folder / "config.json").read_text())
        out[name] = type(full).__name__, shrink(raw, getattr(text_config(full), "layer_types", None))
    return out


def build(class_name: str, config_dict: dict):
    """The shrunken model, fp32, train mode, the same weights in every process (seed 0)."""
    import transformers

    from ulysses_lc.composite import model_class

    config = getattr(transformers, class_name).from_dict(config_dict)
    config._attn_implementation = "eager" if config.model_type == "gpt_oss" else "sdpa"  # gpt-oss's only path
    torch.manual_seed(0)
    model = model_class(config).from_config(config, dtype=torch.float32)
    with torch.no_grad():  # DeltaNet decay rates that keep every head's state alive (tests/models.build says why)
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                module.A_log.copy_(torch.linspace(0.1, 1.0, module.A_log.numel()).log())
    return model.train()


def sequence():
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, VOCAB, (1, 48), generator=g)
    labels = input_ids.clone()
    labels[:, :5] = -100
    return input_ids, labels


def plain_reference(class_name, config_dict, input_ids, labels):
    model = build(class_name, config_dict)
    extra = {"token_type_ids": torch.zeros_like(input_ids)} if model.config.model_type == "gemma3" else {}
    loss = model(input_ids=input_ids, labels=labels, **extra).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def sp2_worker(rank, world_size, cases, input_ids, labels):
    from ulysses_lc import ParallelLayout, SequenceParallelCausalLM, reduce_gradients, shard_batch
    from ulysses_lc.levers.tiled_mlp import plain_parameter_name

    layout = ParallelLayout.build(world_size)
    results = {}
    for name, (class_name, config_dict) in cases.items():
        model = SequenceParallelCausalLM(build(class_name, config_dict), layout, chunked_loss=16, tiled_mlp=2,
                                         min_offload_bytes=0)
        loss = model(**shard_batch(input_ids, layout, labels=labels).as_kwargs())
        loss.backward()
        reduce_gradients(model.parameters(), layout)
        grads = {plain_parameter_name(n): p.grad for n, p in model.model.named_parameters() if p.grad is not None}
        results[name] = loss.item(), grads
        model.undo()
    return results


def test_shrunken_copies_train_one_step_at_sp2_as_plain_transformers():
    cases = shrunken_configs()
    input_ids, labels = sequence()
    results = run_shared(sp2_worker, 2, cases, input_ids, labels)
    for name, (class_name, config_dict) in cases.items():
        ref_loss, ref_grads = plain_reference(class_name, config_dict, input_ids, labels)
        for rank_results in results:
            loss, grads = rank_results[name]
            try:
                assert_close(loss, grads, ref_loss, ref_grads)
            except AssertionError as e:
                raise AssertionError(f"{name}: {e}") from e
