"""Kept attention outputs (selective recompute), the deferred prefetch and the host buffer pool.

A checkpointed layer that keeps its attention output recomputes q, k, v but not the attention kernel.
Everything here is against the same model with plain checkpointing (no kept outputs), same inputs:
  - loss and every gradient bitwise equal (torch.equal): the recompute hands back the forward's own
    output and log-sum-exp, and the backward is the same kernel's backward op;
  - the attention kernel's forward runs layers + (checkpointed - kept) times per step, not 2 x layers;
  - the previous layer's tensors come back from the host only after this layer's attention block backward;
  - host buffers are exactly the offloaded bytes and are reused by the next step.
CPU, fp32, sp 1 and 2 (gloo); the CUDA variant runs where a GPU is present.
"""

import pytest
import torch
from transformers import Qwen3Config

from tests._dist import run_distributed, run_shared
from tests.models import VOCAB, build
from ulysses_lc import LayerRun, ParallelLayout, SequenceParallelCausalLM, shard_batch
from ulysses_lc import explicit_attention as attention_mod
from ulysses_lc.levers.checkpointing import install_checkpointing
from ulysses_lc.plan.memory import MemoryPlan, plan_memory
from ulysses_lc.shape import ModelShape

LAYERS, SEQ = 3, 64


def _step(model, ids, layout):
    loss = model(**shard_batch(ids, layout).as_kwargs())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _count_kernel_forwards(monkeypatch_target):
    """Wrap the explicit CPU kernel and F.scaled_dot_product_attention; return the call counter."""
    calls = {"n": 0}
    forward, backward = attention_mod._EXPLICIT["cpu"]

    def counted(*args):
        calls["n"] += 1
        return forward(*args)

    monkeypatch_target["cpu"] = (counted, backward)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted_sdpa(*args, **kwargs):
        calls["n"] += 1
        return sdpa(*args, **kwargs)

    return calls, counted_sdpa


def kept_worker(rank, world_size, sp, cases):
    import torch.nn.functional as F

    layout = ParallelLayout.build(sp)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    out = {}
    for name, levers in cases.items():
        explicit = dict(attention_mod._EXPLICIT)
        calls, counted_sdpa = _count_kernel_forwards(attention_mod._EXPLICIT)
        real_sdpa, F.scaled_dot_product_attention = F.scaled_dot_product_attention, counted_sdpa
        try:
            model = SequenceParallelCausalLM(build("qwen3", num_hidden_layers=LAYERS), layout, min_offload_bytes=0,
                                             chunked_loss=2, tiled_mlp=2, **levers)
            steps = []
            live_loss = None  # held into the next forward, as a training loop holds its last loss (and graph)
            for _ in range(2):
                calls["n"] = 0
                live_loss = model(**shard_batch(ids, layout).as_kwargs())
                live_loss.backward()
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
                model.zero_grad(set_to_none=True)
                steps.append((live_loss.detach(), grads, calls["n"], model.checkpointing.report()))
        finally:
            F.scaled_dot_product_attention = real_sdpa
            attention_mod._EXPLICIT.clear()
            attention_mod._EXPLICIT.update(explicit)
        out[name] = steps
    return out


CASES = {
    "plain_ckpt": dict(offload=True),
    "kept_all": dict(offload=True, plan=MemoryPlan(LAYERS, 0, LAYERS)),
    "kept_last2": dict(offload=True, plan=MemoryPlan(LAYERS, 0, 2)),
    "kept_all_keep1": dict(offload=True, plan=MemoryPlan(LAYERS, 1, LAYERS)),
    "kept_no_offload": dict(offload=False, plan=MemoryPlan(LAYERS, LAYERS, LAYERS)),
    "kept_partial_recompute": dict(offload=True, plan=MemoryPlan(2, 0, 2)),
}


@pytest.mark.parametrize("sp", [1, 2])
def test_kept_attention_bitwise_and_skips_kernel(sp):
    results = run_shared(kept_worker, sp, sp, CASES)[0]
    ref_loss, ref_grads, ref_calls, _ = results["plain_ckpt"][0]
    assert ref_calls == 2 * LAYERS  # forward + recompute of every layer
    expected_calls = {"kept_all": LAYERS, "kept_last2": LAYERS + 1, "kept_all_keep1": LAYERS,
                      "kept_no_offload": LAYERS, "kept_partial_recompute": LAYERS}
    for name, steps in results.items():
        for loss, grads, calls, report in steps:  # the second step reuses the host buffers
            assert torch.equal(loss, ref_loss), name
            assert grads.keys() == ref_grads.keys()
            for param, grad in grads.items():
                assert torch.equal(grad, ref_grads[param]), (name, param)
            if name != "plain_ckpt":
                assert calls == expected_calls[name], (name, calls)
        first, second = steps[0][3], steps[1][3]
        # Exact-size host buffers, reused: the pool holds what one step offloads, no more.
        assert first["host_pool_bytes"] == first["host_bytes"] == second["host_pool_bytes"], (name, first, second)


def _expected_host_bytes(sp, cached_layers, offloaded_layers):
    s_local = SEQ // sp
    hidden, q_heads, head_dim = 32, 4, 8
    input_bytes = s_local * hidden * 4
    out_bytes = SEQ * (q_heads // sp) * head_dim * 4  # whole sequence, this rank's heads
    lse_bytes = SEQ * (q_heads // sp) * 4
    return offloaded_layers * input_bytes + cached_layers * (out_bytes + lse_bytes)


@pytest.mark.parametrize("sp", [1, 2])
def test_kept_attention_host_bytes(sp):
    cases = {"kept_all": CASES["kept_all"], "kept_all_keep1": CASES["kept_all_keep1"]}
    results = run_shared(kept_worker, sp, sp, cases)[0]
    assert results["kept_all"][0][3]["host_bytes"] == _expected_host_bytes(sp, LAYERS, LAYERS)
    # keep_on_gpu=1: the last layer keeps its input and its attention output on the device.
    assert results["kept_all_keep1"][0][3]["host_bytes"] == _expected_host_bytes(sp, LAYERS - 1, LAYERS - 1)


def order_worker(rank, world_size, cache):
    layout = ParallelLayout.build(1)
    model = SequenceParallelCausalLM(build("qwen3", num_hidden_layers=4), layout, min_offload_bytes=0,
                                     plan=MemoryPlan(4, 0, cache))
    handle = model.checkpointing
    events = []
    copy, done = handle._copy_to_device, handle._attention_block_backward_done

    def logged_copy(saved):
        events.append(("copy", saved.index))
        return copy(saved)

    def logged_done(saved, grad):
        events.append(("attention block backward", saved.index))
        return done(saved, grad)

    handle._copy_to_device, handle._attention_block_backward_done = logged_copy, logged_done
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    _step(model, ids, layout)
    return events, handle.report()


@pytest.mark.parametrize("cache", [0, 4])
def test_prefetch_waits_for_attention_backward(cache):
    events, report = run_shared(order_worker, 1, cache)[0]
    # Only the first layer in backward waits for its copy; the other three came back ahead of need.
    assert (report["waited_copies"], report["prefetched_copies"]) == (1, 3), report
    # The last layer's input has nothing to hide under (copied when its recompute starts); every other
    # layer's tensors are copied right after the next layer's attention block backward, not before.
    assert events == [("copy", 3), ("attention block backward", 3), ("copy", 2), ("attention block backward", 2),
                      ("copy", 1), ("attention block backward", 1), ("copy", 0), ("attention block backward", 0)], events


def _plan(config, seq_local, free, sp_size=1, **kwargs):
    return plan_memory(ModelShape.from_config(config), seq_local * sp_size, free, sp_size=sp_size, **kwargs)


def test_memory_plan_with_kept_attention():
    shape = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936)
    # 1M tokens, 120 GB free, by the memory model's terms (memory.step_terms: a plain layer 29.0 GB, an input 2.15,
    # an attention output 4.36), each peak x 1.05 for the allocator's slack (memory_model.allocator_slack: one GPU, a
    # dense shape): 3 plain layers peak at 101.9 GB, a fourth at 132.4; two inputs and their outputs kept on the
    # device at 115.6, a third at 122.4; with unlimited host memory every other checkpointed layer keeps its
    # attention output there.
    assert _plan(shape, 1 << 20, 120e9) == MemoryPlan(25, 2, 25)
    # 100 GB of RAM: 23 offloaded inputs x 2.15 GB = 49.5 GB -> 11 offloaded attention outputs of 4.36 GB.
    assert _plan(shape, 1 << 20, 120e9, host_free_bytes=100e9) == MemoryPlan(25, 2, 13)
    # 30 GB of RAM: 13 inputs; the other 13 stay on the device, which then holds one plain layer fewer.
    assert _plan(shape, 1 << 20, 120e9, host_free_bytes=30e9) == MemoryPlan(26, 13, 4)
    # 128k tokens: every layer skips the recompute.
    assert _plan(shape, 1 << 17, 120e9) == MemoryPlan(0, 0, 0)
    # Without offload every input stays on the device; outputs come before plain layers: 6 of them fit at 1M, 140 GB.
    assert _plan(shape, 1 << 20, 140e9, offload=False) == MemoryPlan(28, 28, 6)
    # No room beyond one layer's working set: recompute and offload everything (outputs to the host).
    assert _plan(shape, 1 << 20, 10e9) == MemoryPlan(28, 0, 28)
    assert _plan(shape, 1 << 20, 10e9, keep_attention=False) == MemoryPlan(28, 0, 0)


def test_configure_checks_cache_range():
    handle = install_checkpointing(build("qwen3", num_hidden_layers=LAYERS), cache_attention_layers=2)
    assert handle.report()["cached_attention_layers"] == 2
    handle.configure(recompute_layers=1)  # the cached count follows recompute_layers down
    assert handle.report()["cached_attention_layers"] == 1
    with pytest.raises(ValueError, match="cache_attention_layers=2 must be in"):
        handle.configure(cache_attention_layers=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: cuDNN/FLASH ops, pinned buffers")
def test_cuda_kept_attention_bitwise():
    import torch.distributed as dist

    if not dist.is_initialized():
        import os

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1)
    layout = ParallelLayout.build(1)
    ids = torch.randint(0, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    results = {}
    for cache in (0, LAYERS):
        torch.manual_seed(0)
        hf = build("qwen3", num_hidden_layers=LAYERS, hidden_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64).to("cuda", torch.bfloat16)
        model = SequenceParallelCausalLM(hf, layout, min_offload_bytes=0, plan=MemoryPlan(LAYERS, 0, cache))
        batch = shard_batch(ids, layout).to("cuda").as_kwargs()
        for _ in range(2):
            loss = model(**batch)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
        report = model.checkpointing.report()
        results[cache] = (loss.detach(), grads, report)
    (l0, g0, _), (l1, g1, r1) = results[0], results[LAYERS]
    assert r1["pinned"] and r1["host_pool_bytes"] == r1["host_bytes"]
    assert torch.equal(l0, l1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


def test_second_backward_through_offloaded_graph_is_refused():
    from tests.test_offload import _input_ids, _model
    model = _model()
    install_checkpointing(model, offload=True, min_offload_bytes=0)
    logits = model(input_ids=_input_ids(), use_cache=False).logits
    logits.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        logits.sum().backward()


def test_host_pool_drops_buffers_a_new_plan_or_length_no_longer_uses():
    model = build("qwen3", num_hidden_layers=LAYERS)
    handle = install_checkpointing(model, offload=True, min_offload_bytes=0)

    def step(seq):
        ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(seq))
        model(input_ids=ids, labels=ids).loss.backward()
        return handle.report()

    per_layer = 32 * 4  # hidden 32, fp32: bytes per token of one layer input
    assert step(64)["host_pool_bytes"] == LAYERS * 64 * per_layer
    assert step(64)["host_pool_bytes"] == LAYERS * 64 * per_layer  # reused, nothing new
    # Another length: new buffers; the 64-token ones go once two passes have not used them.
    assert step(48)["host_pool_bytes"] == LAYERS * (64 + 48) * per_layer
    step(48)
    assert step(48)["host_pool_bytes"] == LAYERS * 48 * per_layer
    # A new plan drops the free buffers at once: one layer offloaded from here on.
    handle.configure(keep_on_gpu=LAYERS - 1)
    assert handle.report()["host_pool_bytes"] == 0
    assert step(48)["host_pool_bytes"] == step(48)["host_bytes"] == 48 * per_layer


def test_kept_outputs_released_after_backward_while_the_loss_lives():
    # A loop holds its last loss (and graph) into the next forward: no record reachable from that graph
    # may still hold a kept attention output (device memory the next step's plan does not count).
    held, records = run_distributed(_leak_worker, 1)[0]
    assert records > 0 and held == 0, (held, records)


def _leak_worker(rank, world_size):
    import gc

    layout = ParallelLayout.build(1)
    model = SequenceParallelCausalLM(build("qwen3", num_hidden_layers=LAYERS), layout, offload=False,
                                     plan=MemoryPlan(LAYERS, LAYERS, LAYERS))
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    loss = model(**shard_batch(ids, layout).as_kwargs())
    loss.backward()
    gc.collect()
    records = [o for o in gc.get_objects() if isinstance(o, LayerRun)]
    held = sum(r.kept_attention is not None for r in records)
    assert loss.grad_fn is not None  # the graph is still alive
    return held, len(records)
