"""YaRN config vs a config written by hand the documented transformers v5 way.

Inverse frequencies and attention factor are compared exactly (same fp32 arithmetic);
logits of the reloaded model vs a hand-configured model with the same weights exactly too.
"""

import logging

import pytest
import torch
from transformers import GPT2Config, Qwen3Config, Qwen3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ulysses_lc.levers.yarn import apply_yarn, covered_length, load_model_for_length, plan_rope, trained_length, yarn_rope_parameters

TRAINED, THETA = 64, 50_000.0


def _config(**overrides):
    kwargs = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=TRAINED,
        rope_parameters={"rope_type": "default", "rope_theta": THETA}, attn_implementation="sdpa",
    )
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def _hand_yarn_config(factor, trained=TRAINED):
    return _config(
        max_position_embeddings=int(trained * factor),
        rope_parameters={
            "rope_type": "yarn", "rope_theta": THETA, "factor": factor, "original_max_position_embeddings": trained,
        },
    )


def test_fields():
    config = apply_yarn(_config(), 256)
    assert config.rope_parameters == {
        "rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": TRAINED,
    }
    assert config.max_position_embeddings == 256
    # Not rounded down: 100 / 64 = 1.5625 covers exactly the target.
    assert yarn_rope_parameters(_config(), 100)["factor"] == 100 / 64


def test_inv_freq_and_attention_factor_match_transformers():
    ours = apply_yarn(_config(), 4 * TRAINED)
    yarn = ROPE_INIT_FUNCTIONS["yarn"]
    inv_freq, attention_factor = yarn(ours)
    ref_inv_freq, ref_attention_factor = yarn(_hand_yarn_config(4.0))
    assert torch.equal(inv_freq, ref_inv_freq)
    assert attention_factor == ref_attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    # And YaRN really changed something: the low frequencies are interpolated.
    default_inv_freq = 1.0 / (THETA ** (torch.arange(0, 8, 2, dtype=torch.float) / 8))
    assert not torch.equal(inv_freq, default_inv_freq)
    torch.testing.assert_close(inv_freq[-1], default_inv_freq[-1] / 4)


def test_no_scaling_within_trained_length(caplog):
    config = _config()
    with caplog.at_level(logging.INFO, logger="ulysses_lc.levers.yarn"):
        assert yarn_rope_parameters(config, TRAINED) is None
        assert yarn_rope_parameters(config, TRAINED) is None
    assert sum("no RoPE scaling" in r.message for r in caplog.records) == 1  # logged once
    assert apply_yarn(config, 32) is config
    assert config.rope_parameters["rope_type"] == "default" and config.max_position_embeddings == TRAINED


def test_explicit_factor():
    config = apply_yarn(_config(), 200, factor=8)
    assert config.rope_parameters["factor"] == 8.0
    # Raised to trained * factor so transformers' factor consistency check holds.
    assert config.max_position_embeddings == 8 * TRAINED
    inv_freq, _ = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert torch.equal(inv_freq, ROPE_INIT_FUNCTIONS["yarn"](_hand_yarn_config(8.0))[0])
    with pytest.raises(ValueError, match="factor must be > 1"):
        apply_yarn(_config(), 200, factor=0.5)


def test_config_already_scaled():
    config = _config(
        max_position_embeddings=4 * TRAINED,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": TRAINED,
            "beta_fast": 16, "attention_factor": 1.5,
        },
    )
    assert trained_length(config) == TRAINED
    params = yarn_rope_parameters(config, 16 * TRAINED)
    assert params["factor"] == 16.0 and params["original_max_position_embeddings"] == TRAINED
    assert params["beta_fast"] == 16  # model recipe carried over
    assert "attention_factor" not in params  # derived from factor: recomputed
    assert yarn_rope_parameters(config, 4 * TRAINED) is None  # covered as pretrained: kept


def test_model_without_rope_refused():
    with pytest.raises(ValueError, match="no RoPE parameters"):
        yarn_rope_parameters(GPT2Config(n_layer=1, n_embd=8, n_head=2), 4096)
    with pytest.raises(ValueError, match="positive int"):
        yarn_rope_parameters(_config(), 0)


def test_round_trip_through_load_model_for_length(tmp_path):
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(_config())
    base.save_pretrained(tmp_path / "base")

    model = load_model_for_length(str(tmp_path / "base"), 4 * TRAINED, attn_implementation="sdpa")
    assert model.config.rope_parameters["rope_type"] == "yarn"

    hand = Qwen3ForCausalLM(_hand_yarn_config(4.0))
    hand.load_state_dict(base.state_dict())
    assert torch.equal(model.model.rotary_emb.inv_freq, hand.model.rotary_emb.inv_freq)
    assert model.model.rotary_emb.attention_scaling == hand.model.rotary_emb.attention_scaling
    assert not torch.equal(model.model.rotary_emb.inv_freq, base.model.rotary_emb.inv_freq)

    input_ids = torch.randint(0, 128, (1, 3 * TRAINED), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits
        assert torch.equal(logits, hand(input_ids=input_ids).logits)
        assert not torch.allclose(logits, base(input_ids=input_ids).logits)

    # The saved config carries the scaling.
    model.save_pretrained(tmp_path / "scaled")
    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path / "scaled", attn_implementation="sdpa")
    assert reloaded.config.rope_parameters == model.config.rope_parameters
    assert reloaded.config.max_position_embeddings == 4 * TRAINED
    assert torch.equal(reloaded.model.rotary_emb.inv_freq, hand.model.rotary_emb.inv_freq)


# -- a pretrained RoPE scaling is kept as pretrained (issue 28, item 1) ------------------------------------------

def _llama31(max_positions=131072):
    """Llama 3.1's own RoPE (its hub config): llama3 scaling, factor 8 over 8,192 pretrained positions."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )


def test_llama31_within_its_range_keeps_llama3_untouched():
    """The review's case: 65,536 tokens asked of a model that covers 131,072 came back as a fresh YaRN over 8,192
    with max_position_embeddings cut to 65,536. Now the config, and so every inverse frequency, is as pretrained."""
    config, pretrained = _llama31(), _llama31()
    plan = plan_rope(config, 65536)
    assert plan.action == "kept" and "llama3" in plan.summary
    apply_yarn(config, 65536, sp_size=4)
    assert config.rope_parameters == pretrained.rope_parameters
    assert config.max_position_embeddings == 131072
    llama3 = ROPE_INIT_FUNCTIONS["llama3"]
    assert torch.equal(llama3(config)[0], llama3(pretrained)[0])
    assert covered_length(config) == 131072 and trained_length(config) == 8192


def test_llama31_beyond_its_range_is_refused_with_the_choices_or_replaced_on_request():
    with pytest.raises(ValueError, match=r"beyond the 131,072.*--seq-len 131072 or less.*--rope-scaling yarn"):
        apply_yarn(_llama31(), 262144)
    with pytest.raises(ValueError, match="has no YaRN factor"):
        apply_yarn(_llama31(), 65536, factor=4.0)
    config = apply_yarn(_llama31(), 262144, rope_scaling="yarn")
    assert config.rope_parameters == {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0,
                                      "original_max_position_embeddings": 8192}
    assert plan_rope(_llama31(), 262144, rope_scaling="yarn").action == "replaced"
    assert config.max_position_embeddings == 262144


def test_pretrained_yarn_and_linear_are_kept_within_and_extended_beyond():
    pretrained = {"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": TRAINED,
                  "beta_fast": 16}
    config = _config(max_position_embeddings=TRAINED, rope_parameters=dict(pretrained))  # max_position not raised
    assert plan_rope(config, 3 * TRAINED).action == "kept"
    assert apply_yarn(config, 3 * TRAINED).rope_parameters == pretrained and config.max_position_embeddings == TRAINED
    extended = plan_rope(config, 8 * TRAINED)
    assert extended.action == "extended" and extended.params["factor"] == 8.0 and extended.params["beta_fast"] == 16
    linear = _config(max_position_embeddings=2 * TRAINED,
                     rope_parameters={"rope_type": "linear", "rope_theta": THETA, "factor": 2.0})
    assert plan_rope(linear, 2 * TRAINED).action == "kept"
    apply_yarn(linear, 8 * TRAINED)
    assert linear.rope_parameters == {"rope_type": "linear", "rope_theta": THETA, "factor": 8.0}


def test_longrope_and_dynamic_are_kept_and_refused_where_the_sp_ranks_would_disagree():
    dynamic = _config(max_position_embeddings=TRAINED,
                      rope_parameters={"rope_type": "dynamic", "rope_theta": THETA, "factor": 2.0})
    before = dict(dynamic.rope_parameters)
    assert apply_yarn(dynamic, TRAINED, sp_size=2).rope_parameters == before
    with pytest.raises(ValueError, match="no well-defined longer form"):
        apply_yarn(dynamic, 4 * TRAINED)
    longrope = _config(max_position_embeddings=4 * TRAINED, rope_parameters={
        "rope_type": "longrope", "rope_theta": THETA, "original_max_position_embeddings": TRAINED,
        "short_factor": [1.0] * 4, "long_factor": [2.0] * 4})
    assert plan_rope(longrope, 4 * TRAINED, sp_size=1).action == "kept"
    with pytest.raises(ValueError, match="ranks of one sequence"):
        plan_rope(longrope, 4 * TRAINED, sp_size=2)
    assert plan_rope(longrope, TRAINED, sp_size=2).action == "kept"  # every position short of the switch


def test_the_main_job_keeps_llama3_and_says_so(tmp_path):
    """The main job used to replace the RoPE on every run (train/preflight.py); its start-up block names the plan."""
    from ulysses_lc.train import TrainConfig, dry_run

    config = _llama31()
    config.num_attention_heads, config.num_key_value_heads = 4, 4
    config.save_pretrained(tmp_path / "llama31")
    cfg = TrainConfig(model=str(tmp_path / "llama31"), data="tiny", seq_len=65536, dry_run=True, world_size=2,
                      gpu_memory_gb=149, host_memory_gb=64)
    text = dry_run(cfg)
    assert "the pretrained llama3 RoPE kept (it covers 131,072 tokens)" in text
    with pytest.raises(ValueError, match="--rope-scaling yarn"):
        dry_run(TrainConfig(**{**cfg.__dict__, "seq_len": 262144}))


def test_hub_kernels_are_not_loaded_and_a_kernelized_model_gets_transformers_forwards_back(tmp_path):
    """transformers 5.25 kernelizes every from_pretrained model by default (use_kernels, with the `kernels` package
    it now requires): hub kernels replace forwards of layers the levers patch. load_model_for_length loads without
    them; a model a user loaded with them is reset by SequenceParallelCausalLM (transformers' reset_kernels), not
    refused, and trains as the plain model does."""
    from ulysses_lc import ParallelLayout, SequenceParallelCausalLM, shard_batch

    torch.manual_seed(0)
    Qwen3ForCausalLM(_config()).save_pretrained(tmp_path / "base")
    assert not load_model_for_length(str(tmp_path / "base"), TRAINED).use_kernels
    plain = Qwen3ForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa", use_kernels=False)
    pytest.importorskip("kernels")
    user = Qwen3ForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa", use_kernels=True)
    assert user.use_kernels
    layout = ParallelLayout(world_size=1, sp_size=1)
    wrapped = SequenceParallelCausalLM(user, layout, checkpointing=False, offload=False)
    assert wrapped.hub_kernels_reset and not user.use_kernels
    input_ids = torch.randint(0, 128, (1, TRAINED), generator=torch.Generator().manual_seed(1))
    expected = plain(input_ids=input_ids, labels=input_ids).loss
    batch = shard_batch(input_ids, layout, vocab_size=128)
    loss = wrapped(batch.input_ids, position_ids=batch.position_ids, labels=batch.labels)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=0)
