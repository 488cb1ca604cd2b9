"""The one setup path every driver shares: the wrapper plans its own step (its kernel, head groups and offload
setting), counts its parameters once, and names them as the plain model does.

Single process, no process group: `memory.measure_free_memory` (the collective that reads free memory on every
rank) is replaced by fixed figures, so the CUDA branch of the plan runs on a CPU machine.
"""

from types import SimpleNamespace

import pytest
import torch

from tests._memory import room_for_one_input
from tests.models import build
from ulysses_lc import SequenceParallelCausalLM, memory, memory_model
from ulysses_lc.plan.memory import optimizer_reserved_bytes, plan_memory

LAYOUT = SimpleNamespace(sp_size=1, world_size=1, rank=0)  # all the wrapper reads of a layout outside a step
CUDA = torch.device("cuda")  # never touched: the free memory is given
SEQ = 1 << 20


@pytest.fixture
def free_memory(monkeypatch):
    figures = {}

    def measured(device, layout):
        return figures["device"], figures["host"]

    monkeypatch.setattr(memory, "measure_free_memory", measured)
    return figures


def wrap(**levers):
    return SequenceParallelCausalLM(build("qwen3"), LAYOUT, **levers)


def test_plan_step_plans_with_the_models_own_offload_setting(free_memory):
    """levers={"offload": False} (as the Trainer path takes them) plans no host offload: every checkpointed
    input stays on the device. Before one spine the Trainer path planned offload for a model that did none."""
    kept = wrap(offload=False)
    offloaded = wrap(offload=True)
    # Room for one layer input on the device beside one layer's recompute (the tiny model's bytes at 1M tokens).
    free_memory.update(device=room_for_one_input(kept.shape, SEQ), host=1 << 40)
    plan_kept = kept.plan_step(SEQ, CUDA, reserved_bytes=0)
    plan_off = offloaded.plan_step(SEQ, CUDA, reserved_bytes=0)
    assert plan_kept.keep_on_gpu == plan_kept.recompute_layers  # nothing planned for the host
    assert plan_off.keep_on_gpu < plan_off.recompute_layers  # the offloading model sends inputs there
    # What plan_step_memory plans for: the free memory less NCCL's and ZeRO-3's still to come.
    device = free_memory["device"] - memory.LATER_CONTEXT_BYTES - (
        memory_model.zero3_working_bytes(kept.shape.largest_module_params) * (1 + memory_model.allocator_slack(kept.shape, 1)))
    assert plan_kept == plan_memory(kept.shape, SEQ, device, host_free_bytes=1 << 40, offload=False)


def test_plan_step_reserves_the_optimizer_moments_of_trainable_parameters(free_memory, monkeypatch):
    model = wrap()
    seen = {}
    monkeypatch.setattr("ulysses_lc.model.plan_step_memory", lambda *a, **kw: seen.update(kw) or "plan")
    model.plan_step(SEQ, CUDA)
    assert seen["reserved_bytes"] == optimizer_reserved_bytes(model.num_parameters(), 1) == 8 * model.num_parameters()
    assert seen["offload"] is True and seen["kernel"] == model.attention.kernel and seen["head_groups"] == "auto"
    model.model.model.embed_tokens.weight.requires_grad_(False)  # tied to the head: one parameter fewer
    model.plan_step(SEQ, CUDA)
    frozen = model.model.model.embed_tokens.weight.numel()
    assert seen["reserved_bytes"] == 8 * (model.num_parameters() - frozen)
    assert model.num_parameters(only_trainable=True) == model.num_parameters() - frozen
    # transformers' signature (the Trainer calls it): embeddings left out as its own count leaves them out.
    assert model.num_parameters(exclude_embeddings=True) == model.model.num_parameters(exclude_embeddings=True)
    model.plan_step(SEQ, CUDA, packed=True, reserved_bytes=0)
    assert seen["packed"] is True and seen["reserved_bytes"] == 0


def test_the_packed_policy_reaches_the_plan(free_memory):
    model = wrap()
    free_memory.update(device=room_for_one_input(model.shape, SEQ), host=1 << 40)  # every layer checkpointed
    assert model.plan_step(SEQ, CUDA, reserved_bytes=0).cache_attention_layers > 0
    assert model.plan_step(SEQ, CUDA, reserved_bytes=0, packed=True).cache_attention_layers == 0


def test_plain_names_are_the_unwrapped_models():
    model = wrap()
    plain = build("qwen3")
    assert {n for n, _ in model.plain_named_parameters()} == {n for n, _ in plain.named_parameters()}
    wrapped = {n: p for n, p in model.named_parameters()}
    assert any(".mlp.mlp." in n for n in wrapped)  # the tiled MLP keeps the MLP one level down
    assert set(model.plain_state_dict(wrapped)) == set(dict(plain.named_parameters()))
    assert set(model.plain_state_dict(model.state_dict())) == set(plain.state_dict())
    # The plain model's weights load under the plain names: the mapping is the model's, not a guess.
    model.model.load_state_dict(plain.state_dict())
