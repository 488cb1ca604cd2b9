"""Gated DeltaNet hybrids under Ulysses at sp 2 and 4 against single-process transformers.

Tiny Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next text models (tests/models.py: a linear-attention layer, then a gated
full-attention layer with partial rotary; 2 key heads for 4 value heads, so at sp 4 each key head is replicated to
two ranks), 37 tokens (not divisible by sp); packed documents against each document alone (the convolution and the
recurrence restart at each document's start); at sp 2 also every lever. One set of 4 ranks runs every case: sp 4,
then sp 2 as two data-parallel groups on the same sequence (their averaged gradient is the sequence's own).
Tolerances (fp32, test_sp_parity's): loss 1e-5 relative, every gradient 1e-4 relative norm. The reference is
transformers' own forward, whose conv and recurrence are its torch path, as the SP side's are on CPU.
"""

import functools

import pytest
import torch

from tests._dist import run_shared
from tests.models import LINEAR_FAMILIES, build, tiny_config
from tests.test_sp_parity import GRAD_RTOL, LOSS_RTOL, NO_LEVERS, assert_close, make_sequence
from tests.test_window_parity import ALL_LEVERS
from ulysses_lc import ParallelLayout, check_model_for_ulysses, SequenceParallelCausalLM, reduce_gradients, shard_batch

SEQ = 37
DOCS = (13, 9, 15)  # at sp 4 (shards of 10) the first and last cross a shard border
STARTS = (0, 13, 22)

# YaRN over a trained length of 16 on the full-attention layers' partial rotary dims (factor 4 for 64 tokens).
YARN = (("max_position_embeddings", 16), ("yarn_to", 64))

CASES = [(sp, f, None, NO_LEVERS, ()) for sp in (4, 2) for f in LINEAR_FAMILIES]
CASES += [(sp, f, DOCS, NO_LEVERS, ()) for sp in (4, 2) for f in LINEAR_FAMILIES]
# Every lever: chunked loss, tiled MLP (the MoE blocks with their shared expert and its gate), checkpoints offloaded,
# the bf16-saving norms in the "1 + weight" and gated forms; with YaRN, and with packed documents.
CASES += [(2, f, None, ALL_LEVERS, YARN) for f in LINEAR_FAMILIES] + [(2, "qwen3_next", DOCS, ALL_LEVERS, ())]
# LoRA on every projection (`--lora-targets all`): attention, MLP and the DeltaNet's own in_proj_* and out_proj.
CASES += [(2, "qwen3_5", None, ALL_LEVERS, (("lora", True),))]


def build_case(family, overrides):
    overrides = dict(overrides)
    if not overrides.pop("lora", False):
        return build(family, **overrides)
    from peft import get_peft_model

    from ulysses_lc.peft_support import lora_config

    model = build(family, **overrides)
    torch.manual_seed(1)
    config = lora_config(4, 8)
    config.init_lora_weights = False  # random A and B: every adapter gradient non-zero
    return get_peft_model(model, config)


@functools.lru_cache(maxsize=None)
def reference(family, docs, overrides=()):
    """Plain transformers: the whole sequence, or each document alone (losses combined token-weighted)."""
    input_ids, labels = make_sequence(SEQ, seed=7)
    model = build_case(family, overrides)
    pieces = [(0, SEQ)] if docs is None else [(a, a + n) for a, n in zip(STARTS, docs)]
    total, count = 0.0, 0
    for a, b in pieces:
        n = b - a - 1
        total = total + model(input_ids=input_ids[:, a:b], labels=labels[:, a:b]).loss * n
        count += n
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def cases_worker(rank, world_size, cases):
    layouts = {sp: ParallelLayout.build(sp) for sp in sorted({case[0] for case in cases})}
    input_ids, labels = make_sequence(SEQ, seed=7)
    results = []
    for sp, family, docs, levers, overrides in cases:
        layout = layouts[sp]
        model = SequenceParallelCausalLM(build_case(family, overrides), layout, min_offload_bytes=0, **levers)
        batch = shard_batch(input_ids, layout, labels=labels, document_lengths=list(docs) if docs else None)
        loss = model(**batch.as_kwargs())
        loss.backward()
        reduce_gradients(model.parameters(), layout)
        grads = {n.replace(".mlp.mlp.", ".mlp."): p.grad for n, p in model.model.named_parameters()
                 if p.grad is not None}
        results.append((loss.item(), grads))
        model.undo()
    return results


def test_linear_families_equal_single_process():
    per_rank = run_shared(cases_worker, 4, CASES)
    for (sp, family, docs, levers, overrides), *ranks in zip(CASES, *per_rank):
        ref = reference(family, docs, overrides)
        for result in ranks:
            assert_close(*result, *ref)
        if docs is not None:  # the documents matter: the same results miss the unpacked sequence
            with pytest.raises(AssertionError):
                assert_close(*ranks[0], *reference(family, None, overrides))
        if "yarn_to" in dict(overrides):  # so does YaRN, on the partial rotary dims
            assert build(family, **dict(overrides)).config.rope_parameters["partial_rotary_factor"] == 0.5
            with pytest.raises(AssertionError):
                assert_close(*ranks[0], *reference(family, docs))
    assert (LOSS_RTOL, GRAD_RTOL) == (1e-5, 1e-4)


def test_linear_heads_checked_by_name():
    for family in LINEAR_FAMILIES:
        for sp in (2, 4):  # 2 key heads: replicated at sp 4
            check_model_for_ulysses(tiny_config(family), sp_size=sp)
    with pytest.raises(ValueError, match=r"linear_num_value_heads=6\): .*pick sp_size in \[1, 2, 6\]"):
        check_model_for_ulysses(tiny_config("qwen3_5", linear_num_value_heads=6), sp_size=4)


def test_torch_rule_in_segments_equals_one_call():
    # The torch path runs long documents in segments carrying the recurrent state (linear_attention.py says why):
    # against one call per document, output and every input gradient within 1e-6 (fp32; the same ops on the same
    # values, equal where measured).
    import torch.nn.functional as F

    from ulysses_lc.mixers.linear_attention import _torch_rule

    layer = build("qwen3_5").model.layers[0].linear_attn
    torch.manual_seed(0)
    T, bounds = 300, (0, 70, 300)  # the second document spans three segments of 128, the last one short
    xs = [torch.randn(1, T, 2, 8), torch.randn(1, T, 2, 8), torch.randn(1, T, 4, 8), torch.randn(1, T, 4),
          torch.randn(1, T, 4)]
    results = []
    for segment in (1 << 20, 128):
        leaves = [x.clone().requires_grad_() for x in xs]
        q, k, v, b, a = leaves
        g = -layer.A_log.exp() * F.softplus(a + layer.dt_bias)
        out = _torch_rule(layer, q, k, v, g, b.sigmoid(), bounds, segment=segment)
        out.square().mean().backward()
        results.append([out.detach()] + [x.grad for x in leaves])
    for got, want in zip(*reversed(results)):
        assert ((got - want).norm() / want.norm()) <= 1e-6


def test_shape_counts_the_hybrid_layers():
    # The memory plan and FLOPs read the model through ModelShape: a gated DeltaNet layer's own matmul weights (q, k,
    # v, z, b, a in, out), no attention pairs, an O(s) recurrence, and its recurrence's bytes in the plan's block.
    from ulysses_lc import ModelShape, model_flops_per_step
    from ulysses_lc.mixers.linear_attention import RECURRENCE_BYTES_PER_HEAD_TOKEN, recurrence_block_bytes
    from ulysses_lc.plan.memory import step_terms

    model = build("qwen3_5")
    shape = ModelShape.from_config(model.config)
    matmul = sum(p.numel() for n, p in model.model.layers.named_parameters() if p.dim() == 2 and "conv1d" not in n)
    assert shape.layer_matmul_params == matmul
    assert shape.attention_pairs(100) == 100 * 100 / 2  # the one full-attention layer
    assert shape.recurrence_flops(200) == 2 * shape.recurrence_flops(100) > 0
    flops = model_flops_per_step(shape, 100)
    assert flops.attention == 3 * (4 * 5000 * 4 * 8 + shape.recurrence_flops(100))
    assert recurrence_block_bytes(shape, 37, 2) == 38 * 2 * RECURRENCE_BYTES_PER_HEAD_TOKEN  # 2 of 4 value heads
    plain = step_terms(ModelShape.from_config(tiny_config("qwen3")), 37, sp_size=2)
    assert step_terms(shape, 37, sp_size=2).recompute >= recurrence_block_bytes(shape, 37, 2) > plain.recompute
