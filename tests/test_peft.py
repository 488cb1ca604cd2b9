"""PEFT models through every lever: SP=2 and 4 on gloo against single-process transformers + peft.

The reference is plain transformers + peft: `peft_model(input_ids, labels=labels).loss` and its backward. The SP
side wraps the same PeftModel with every lever on (chunked loss in 2-row chunks, tiled MLP in 3 tiles, every layer
checkpointed with its input offloaded, the last keeping its attention output). The adapters start from random A and
B (init_lora_weights=False), so every adapter gradient is non-zero and a dropped one shows. Tolerances (fp32): loss
within 1e-5 relative, each adapter gradient within 1e-4 relative norm; the base weights take no gradient.
"""

import pytest
import torch

from tests._dist import run_distributed
from tests.models import build
from tests.test_sp_parity import GRAD_RTOL, LOSS_RTOL, make_sequence
from ulysses_lc import MemoryPlan, ParallelLayout, SequenceParallelCausalLM, reduce_gradients, shard_batch

pytest.importorskip("peft")

LEVERS = dict(chunked_loss=2, tiled_mlp=3, checkpointing=True, offload=True, plan=MemoryPlan(2, 0, 1))


def peft_config(variant: str):
    from peft import IA3Config, LoraConfig

    if variant == "lora":  # every projection, attention and MLP
        return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"], init_lora_weights=False)
    if variant == "dora":
        return LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True,
                          init_lora_weights=False)
    if variant == "ia3":
        return IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                         init_ia3_weights=False)
    raise ValueError(variant)


def build_peft(variant: str, **overrides):
    from peft import get_peft_model

    model = build("qwen3", **overrides)
    torch.manual_seed(1)  # the adapters' initial values
    return get_peft_model(model, peft_config(variant))


VARIANTS = ("lora", "dora", "ia3")


def reference(variant, input_ids, labels):
    model = build_peft(variant, tie_word_embeddings=True)
    loss = model(input_ids=input_ids, labels=labels).loss
    loss.backward()
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def sp_worker(rank, world_size, input_ids, labels):
    layout = ParallelLayout.build(world_size)
    out = {}
    for variant in VARIANTS:
        model = SequenceParallelCausalLM(build_peft(variant, tie_word_embeddings=True), layout, min_offload_bytes=0,
                                         **LEVERS)
        loss = model(**shard_batch(input_ids, layout, labels=labels).as_kwargs())
        loss.backward()
        reduce_gradients(model.parameters(), layout)
        grads = {name: p.grad for name, p in model.plain_named_parameters() if p.grad is not None}
        frozen_with_grad = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
        out[variant] = loss.item(), grads, frozen_with_grad, model.checkpointing.host_bytes
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_peft_sp_with_all_levers_equals_single_process_peft(world):
    # 45 tokens (padded to 46 / 48), the first 9 labels ignored.
    input_ids, labels = make_sequence(45, seed=4, ignore_prefix=9)
    refs = {variant: reference(variant, input_ids, labels) for variant in VARIANTS}
    for result in run_distributed(sp_worker, world, input_ids, labels):
        for variant, (loss, grads, frozen_with_grad, host_bytes) in result.items():
            ref_loss, ref_grads = refs[variant]
            assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), (variant, loss, ref_loss)
            assert grads.keys() == ref_grads.keys(), variant  # adapters only, every one of them
            assert all(("lora_" in n or "ia3_" in n) for n in grads), variant
            for name, ref in ref_grads.items():
                assert ref.norm() > 0, name
                err = (grads[name] - ref).norm() / ref.norm()
                assert err <= GRAD_RTOL, f"{variant} {name}: relative gradient error {err:.2e}"
            assert frozen_with_grad == [], variant
            assert host_bytes > 0


def test_tiled_mlp_replays_the_adapter_dropout_in_backward():
    # A LoRA adapter with dropout inside the MLP: the tiled backward recomputes each tile and must draw the masks
    # the forward drew. The reference runs the same tiles one after another under autograd (same RNG order).
    from peft import LoraConfig, get_peft_model

    from ulysses_lc.levers.tiled_mlp import TiledMLP

    model = get_peft_model(build("qwen3"), LoraConfig(r=4, target_modules=["up_proj", "down_proj"], lora_dropout=0.5,
                                                      init_lora_weights=False))
    mlp = model.get_base_model().model.layers[0].mlp
    x = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(1, 12, 32, generator=torch.Generator().manual_seed(1))

    def grads(run):
        mlp.zero_grad()
        x_ = x.clone().requires_grad_()
        torch.manual_seed(7)
        y = run(x_)
        (y * weight).sum().backward()
        return y.detach(), x_.grad, [p.grad.clone() for p in mlp.parameters() if p.requires_grad]

    y_ref, gx_ref, gp_ref = grads(lambda x_: torch.cat([mlp(x_[:, a:a + 4]) for a in (0, 4, 8)], dim=1))
    y, gx, gp = grads(TiledMLP(mlp, 64, num_tiles=3))
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-6)
    for g, g_ref in zip(gp, gp_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-6, atol=1e-6)


def test_peft_setups_that_cannot_be_exact_are_refused():
    from peft import LoraConfig, PromptTuningConfig, get_peft_model

    from ulysses_lc.peft_support import lora_config

    layout = ParallelLayout(2, 2)
    prompt = get_peft_model(build("qwen3"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match="virtual tokens.*Use LoRA"):
        SequenceParallelCausalLM(prompt, layout)
    for config in (LoraConfig(r=2, target_modules=["q_proj", "lm_head"]),
                   LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])):
        with pytest.raises(ValueError, match="Leave 'lm_head' out"):
            SequenceParallelCausalLM(get_peft_model(build("qwen3"), config), layout)
    with pytest.raises(ValueError, match="leave lm_head out"):
        lora_config(4, targets="q_proj,lm_head")


def test_lora_all_adapts_the_gated_deltanet_projections_too():
    """`--lora-targets all` covered the attention and MLP projections only, leaving a hybrid's DeltaNet layers (three
    in four of Qwen3.5's) without adapters; now their in_proj_* and out_proj get them, and a dense model still takes
    "all" without being told of modules it lacks."""
    from tests.models import tiny_config
    from ulysses_lc.peft_support import apply_peft, count_trainable_parameters, lora_config

    config = lora_config(4, targets="all")
    model = apply_peft(build("qwen3_5"), config)
    adapted = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if hasattr(m, "lora_A")}
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "down_proj"} <= adapted
    assert count_trainable_parameters(tiny_config("qwen3"), config)[1] > 0
    with pytest.raises(ValueError, match=r"LoRA targets \['in_proj_qkv'\] are not modules"):
        count_trainable_parameters(tiny_config("qwen3"), lora_config(4, targets="q_proj,in_proj_qkv"))
