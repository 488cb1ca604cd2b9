"""Bad input is refused with a ValueError that names the fix, before any compute."""

import pytest
import torch
from transformers import AutoModelForCausalLM, KimiLinearConfig, Llama4TextConfig, MistralConfig

from tests.models import VOCAB, build, tiny_config
from ulysses_lc import ParallelLayout, SequenceParallelCausalLM, check_model_for_ulysses, shard_batch
from ulysses_lc.parallel.layout import check_heads, valid_sp_sizes


def layout(world, sp):
    # Groups are not needed for the checks under test: they all fire before any collective.
    return ParallelLayout(world_size=world, sp_size=sp)


def test_world_not_divisible_by_sp():
    with pytest.raises(ValueError, match=r"world size 6 is not divisible by sp_size=4; pick sp_size in \[1, 2, 3, 6\]"):
        layout(6, 4)


def test_heads_not_divisible_lists_valid_sizes():
    with pytest.raises(ValueError, match=r"pick sp_size in \[1, 2, 4\]"):
        check_heads(4, 2, 3)
    with pytest.raises(ValueError, match="sp_size=8 cannot split num_attention_heads=4"):
        SequenceParallelCausalLM(build("qwen3"), layout(8, 8))
    # 28 query heads / 4 KV heads (a Qwen2.5-7B-like shape): 7 and 14 split the query heads but not the KV heads.
    assert valid_sp_sizes(28, 4) == [1, 2, 4, 28]


@pytest.mark.parametrize(
    "config",
    [
        KimiLinearConfig(num_hidden_layers=4),  # linear attention of a kind other than the gated DeltaNet
        Llama4TextConfig(num_hidden_layers=2, attention_chunk_size=8192),
    ],
    ids=["kimi-linear", "llama4-chunked"],
)
def test_local_attention_models_refused(config):
    # Sliding-window and gated DeltaNet models are trained (test_window.py, test_linear_parity.py); these layer types
    # would be silently wrong.
    with pytest.raises(ValueError, match="would silently train as full causal attention"):
        check_model_for_ulysses(config, sp_size=2)
    check_model_for_ulysses(tiny_config("qwen3"), sp_size=2)  # full attention passes


def test_mistral_without_window_is_accepted():
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=None)
    check_model_for_ulysses(cfg, sp_size=2)


def test_eager_attention_refused():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3", attn_implementation="eager"))
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        SequenceParallelCausalLM(model, layout(2, 2))


def test_missing_position_ids_refused():
    model = SequenceParallelCausalLM(build("qwen3"), layout(2, 2), checkpointing=False, offload=False)
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(ValueError, match="position_ids are required"):
        model(input_ids=ids, labels=ids)
    with pytest.raises(ValueError, match="shard_batch"):  # the bare HF model, Ulysses attention installed
        model.model(input_ids=ids)
    model.undo()
    model.model(input_ids=ids)  # undone: a plain model again


def test_attention_mask_refused():
    model = SequenceParallelCausalLM(build("qwen3"), layout(1, 1), checkpointing=False, offload=False)
    ids = torch.randint(0, VOCAB, (1, 8))
    with pytest.raises(ValueError, match="attention_mask=None"):
        model.model(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_packed_positions_refused():
    ids = torch.randint(0, VOCAB, (1, 8))
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match="packed documents"):
        shard_batch(ids, layout(2, 2), position_ids=packed)


def test_registration_never_overwrites_and_is_reversible():
    from transformers import AttentionInterface

    from ulysses_lc import UlyssesAttention

    with pytest.raises(ValueError, match="already registered"):
        UlyssesAttention(layout(1, 1), kernel="sdpa", name="sdpa").register()
    attn = UlyssesAttention(layout(1, 1), kernel="sdpa").register()
    assert AttentionInterface._global_mapping[attn.name] is attn
    attn.unregister()
    assert attn.name not in AttentionInterface._global_mapping


def test_bidirectional_gemma3_is_refused_at_sp_1_as_at_sp_2():
    """The review's case: at sp 1 the wrapped bidirectional Gemma 3 trained as causal (loss 4.618591 against the plain
    model's 4.628541) because the refusal applied only at sp > 1 while the attention is installed at every sp."""
    config = tiny_config("gemma3", use_bidirectional_attention=True)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    causal = AutoModelForCausalLM.from_config(tiny_config("gemma3"), dtype=torch.float32)
    causal.load_state_dict(model.state_dict())
    with torch.no_grad():  # the plain model really attends both ways: training it as causal would be wrong
        assert not torch.allclose(model(input_ids=ids).logits, causal(input_ids=ids).logits)
    for sp in (1, 2):
        with pytest.raises(ValueError, match="use_bidirectional_attention=False"):
            SequenceParallelCausalLM(model, layout(sp, sp))
