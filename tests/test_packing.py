"""Packed documents under Ulysses: each document trained as if alone, at SP 1, 2 and 4.

Reference: plain transformers on each document alone (its own positions 0..n-1, labels = its tokens), the
losses combined token-weighted (sum of token losses / all predicted tokens) and backpropagated once. The packed
side: one sequence of the documents end to end through shard_batch(document_lengths=...), every lever on.
Tolerances (fp32): loss 1e-5 relative, each gradient 1e-4 relative norm (test_sp_parity's).
"""

import pytest
import torch

from tests._dist import run_shared
from tests.models import VOCAB, build
from tests.test_sp_parity import assert_close
from ulysses_lc import IGNORE_INDEX, MemoryPlan, ParallelLayout, SequenceParallelCausalLM, reduce_gradients, shard_batch
from ulysses_lc.levers.tiled_mlp import plain_parameter_name

# 48 tokens over sp 4 -> shards of 12: document 0 (17) crosses the first border, document 1 (5) is shorter than a
# shard, document 2 is one token, document 3 (25) crosses two borders.
LENGTHS = [17, 5, 1, 25]


def _documents(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def reference(docs, ignore_first=0):
    model = build("qwen3")
    total, count = 0.0, 0
    for doc in docs:
        labels = doc.clone()
        labels[:ignore_first] = IGNORE_INDEX
        n = int((labels[1:] != IGNORE_INDEX).sum())
        if n == 0:  # a one-token document predicts nothing
            continue
        loss = model(input_ids=doc[None], labels=labels[None]).loss
        total = total + loss * n
        count += n
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_worker(rank, world_size, docs, levers, ignore_first=0):
    layout = ParallelLayout.build(world_size)
    model = SequenceParallelCausalLM(build("qwen3"), layout, min_offload_bytes=0, **levers)
    labels = [d.clone() for d in docs]
    for lab in labels:
        lab[:ignore_first] = IGNORE_INDEX
    batch = shard_batch(torch.cat(docs), layout, labels=torch.cat(labels), document_lengths=LENGTHS)
    loss = model(**batch.as_kwargs())
    loss.backward()
    reduce_gradients(model.parameters(), layout)
    grads = {plain_parameter_name(n): p.grad for n, p in model.model.named_parameters() if p.grad is not None}
    return loss.item(), grads


ALL_LEVERS = dict(chunked_loss=4, tiled_mlp=3, checkpointing=True, offload=True, plan=MemoryPlan(2, 0, 2))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_packed_documents_equal_each_alone(world):
    docs = _documents()
    ref = reference(docs)
    for loss, grads in run_shared(packed_worker, world, docs, ALL_LEVERS):
        assert_close(loss, grads, *ref)


def test_packed_with_masked_prompts():
    # Each document's first 3 labels ignored (a prompt): still the per-document reference.
    docs = _documents(seed=1)
    ref = reference(docs, ignore_first=3)
    for loss, grads in run_shared(packed_worker, 2, docs, ALL_LEVERS, 3):
        assert_close(loss, grads, *ref)


def test_packing_changes_the_numbers():
    # The same tokens as one causal stream read across borders: another loss (the test above can fail).
    docs = _documents()
    ref_loss, _ = reference(docs)
    layout = ParallelLayout(world_size=1, sp_size=1)
    model = build("qwen3")
    ids = torch.cat(docs)[None]
    stream_loss = model(input_ids=ids, labels=ids).loss.item()
    assert abs(stream_loss - ref_loss) > 1e-3 * ref_loss
    batch = shard_batch(torch.cat(docs), layout, document_lengths=LENGTHS)
    assert batch.position_ids.tolist()[0][:19] == list(range(17)) + [0, 1]
    assert batch.labels[0, 16] == IGNORE_INDEX and batch.labels[0, 21] == IGNORE_INDEX  # last tokens of docs 0, 1
    assert batch.cu_seqlens.tolist() == [0, 17, 22, 23, 48]


def test_bad_document_lengths_refused():
    layout = ParallelLayout(world_size=2, sp_size=2)
    ids = torch.arange(10)
    with pytest.raises(ValueError, match="add up to the sequence length 10"):
        shard_batch(ids, layout, document_lengths=[4, 4])
    with pytest.raises(ValueError, match="must be positive"):
        shard_batch(ids, layout, document_lengths=[10, 0])
    with pytest.raises(ValueError, match="one sequence per call"):
        shard_batch(ids.expand(2, 10), layout, document_lengths=[5, 5])
    with pytest.raises(ValueError, match="document_lengths"):  # packed positions without lengths
        shard_batch(ids, layout, position_ids=torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4]))
    # Padding to a multiple of sp is a segment of its own.
    assert shard_batch(torch.arange(9), layout, document_lengths=[4, 5]).cu_seqlens.tolist() == [0, 4, 9, 10]


def _per_document_reference(q, k, v, bounds):
    import torch.nn.functional as F

    outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=2)


def _attention_and_grads(fn, q, k, v):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(torch.ones_like(out) * torch.linspace(-1, 1, out.shape[2], device=out.device)[:, None])
    return out.detach(), q.grad, k.grad, v.grad


def _qkv(device="cpu", dtype=torch.float32, s=40):
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(1, h, s, 8, generator=g, device=device, dtype=dtype) for h in (4, 2, 2)]


def test_equal_length_documents_run_as_one_batched_call():
    from ulysses_lc.mixers.kernels import _equal_runs, document_attention

    bounds = [0, 8, 16, 24, 27, 40]  # three documents of 8 (one batched call), then 3 and 13
    assert _equal_runs(bounds) == [(0, 24, 3), (24, 27, 1), (27, 40, 1)]
    q, k, v = _qkv()
    got = _attention_and_grads(lambda q, k, v: document_attention(q, k, v, bounds, None, "sdpa", how="loop"), q, k, v)
    want = _attention_and_grads(lambda q, k, v: _per_document_reference(q, k, v, bounds), q, k, v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # fp32: same kernel, batched
    with pytest.raises(ValueError, match="how='loop'"):
        document_attention(q, k, v, bounds, None, "sdpa", how="varlen")  # CPU: no variable-length kernel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: torch.nn.attention.varlen")
@pytest.mark.parametrize("how", ["loop", "varlen"])
def test_cuda_document_attention_matches_per_document_sdpa(how):
    # bf16 on the GPU: outputs and gradients within 2e-2 of the per-document SDPA calls (different kernels'
    # accumulation orders; the CPU tests hold the exact contract).
    from ulysses_lc.mixers.kernels import document_attention

    bounds = [0, 512, 1024, 1536, 1664, 4096]
    q, k, v = _qkv("cuda", torch.bfloat16, s=4096)
    q, k, v = (t.repeat_interleave(16, -1) for t in (q, k, v))  # head dim 128
    got = _attention_and_grads(lambda q, k, v: document_attention(q, k, v, bounds, None, "cudnn", how=how), q, k, v)
    want = _attention_and_grads(lambda q, k, v: _per_document_reference(q, k, v, bounds), q, k, v)
    for a, b in zip(got, want):
        err = (a.float() - b.float()).norm() / b.float().norm()
        assert err < 2e-2, (how, err)


def test_packed_plans_no_kept_outputs():
    # Packed documents run attention per document, which keeps no output for the recompute: the plan must not
    # reserve (or promise) kept outputs for them.
    from ulysses_lc import ModelShape
    from ulysses_lc.plan.memory import plan_step_memory

    shape = ModelShape.from_config(build("qwen3").config)
    layout = ParallelLayout(world_size=1, sp_size=1)
    cpu = torch.device("cpu")
    assert plan_step_memory(shape, 64, layout, cpu, kernel="sdpa").cache_attention_layers == 2
    assert plan_step_memory(shape, 64, layout, cpu, kernel="sdpa", packed=True).cache_attention_layers == 0


def test_document_lengths_from_restarting_positions():
    from ulysses_lc import document_lengths_from_positions

    assert document_lengths_from_positions(torch.tensor([0, 1, 2, 0, 1, 0])) == [3, 2, 1]
    assert document_lengths_from_positions(torch.arange(6)) is None  # one run: nothing packed
    with pytest.raises(ValueError, match="restart at 0"):
        document_lengths_from_positions(torch.tensor([1, 2, 0, 1]))


def test_a_layer_that_drops_the_borders_is_refused(monkeypatch):
    """Document borders reach the attention function through transformers' layer **kwargs: a model (or a release)
    whose layers drop them let packed documents attend to each other silently. Now each attention call checks."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    layout = ParallelLayout(world_size=1, sp_size=1)
    model = SequenceParallelCausalLM(build("qwen3"), layout, checkpointing=False, offload=False)
    batch = shard_batch(torch.cat(_documents()), layout, document_lengths=LENGTHS)
    model(**batch.as_kwargs())  # borders delivered: trains
    forward = Qwen3DecoderLayer.forward

    def dropping(self, hidden_states, *args, **kwargs):
        kwargs.pop("document_bounds", None)
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(Qwen3DecoderLayer, "forward", dropping)
    with pytest.raises(ValueError, match="got no document borders though the batch is packed"):
        model(**batch.as_kwargs())
    unpacked = shard_batch(torch.cat(_documents()), layout)
    model(**unpacked.as_kwargs())  # unpacked: nothing to deliver, nothing refused


def test_a_gated_deltanet_layer_that_drops_the_borders_is_refused(monkeypatch):
    """The same guard on the linear-attention layers (Qwen3.5): their conv and recurrence restart at the borders only
    if the borders reach them."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    layout = ParallelLayout(world_size=1, sp_size=1)
    model = SequenceParallelCausalLM(build("qwen3_5"), layout, checkpointing=False, offload=False)
    batch = shard_batch(torch.cat(_documents()), layout, document_lengths=LENGTHS)
    model(**batch.as_kwargs())
    forward = Qwen3_5DecoderLayer.forward

    def dropping(self, hidden_states, *args, **kwargs):
        kwargs.pop("document_bounds", None)
        return forward(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(Qwen3_5DecoderLayer, "forward", dropping)
    with pytest.raises(ValueError, match=r"\(Qwen3_5GatedDeltaNet\) got no document borders"):
        model(**batch.as_kwargs())
