"""YaRN config vs a config written by hand the documented transformers v5 way.

Inverse frequencies and attention factor are compared exactly (same fp32 arithmetic);
logits of the reloaded model vs a hand-configured model with the same weights exactly too.
"""

import logging

import pytest
import torch
from transformers import GPT2Config, Qwen3Config, Qwen3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ulysses_lc.yarn import apply_yarn, load_model_for_length, trained_length, yarn_rope_parameters

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
    with caplog.at_level(logging.INFO, logger="ulysses_lc.yarn"):
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
    assert yarn_rope_parameters(config, 4 * TRAINED)["factor"] == 4.0


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
