"""Sliding-window and sink families under Ulysses at sp 2 and 4 against single-process transformers.

Tiny Mistral (every layer windowed), Gemma 3 text (local / global layers, final logit soft-capping), gpt-oss
(sinks on every layer, local / global, MoE) and a Qwen3 config with use_sliding_window, 37 tokens (not divisible by
sp): a window of 5, smaller than a shard, and one of 24, wider than a shard (at sp 4 it spans three); packed documents
against each document alone; at sp 2 also every lever (chunked loss with the soft-cap, tiled MLP over the MoE,
checkpoints offloaded, every layer keeping its attention output for the recompute, bf16-saving RMSNorm in each
family's form). One body on the session's 4 shared ranks runs every case: sp 4, then sp 2 as two data-parallel groups
taking alternate cases (each gradient summed over its SP group / sp, what ZeRO-3's average over all ranks makes of
it). The SP side would pass against a wrong window too if the window did not matter: each family's result is also
held against the reference with the window one token wider and with no window, and must miss both. Tolerances (fp32,
test_sp_parity's): loss 1e-5 relative, every gradient 1e-4 relative norm.
"""

import functools

import torch.distributed as dist

from tests._dist import run_shared
from tests.models import WINDOW_FAMILIES, build
from tests.test_sp_parity import GRAD_RTOL, NO_LEVERS, assert_close, make_sequence
from ulysses_lc import MemoryPlan, ParallelLayout, SequenceParallelCausalLM, reduce_gradients, shard_batch

SEQ = 37
DOCS = [13, 9, 15]  # at sp 4 (shards of 10) the first and last cross a border
ALL_LEVERS = dict(chunked_loss=4, tiled_mlp=3, checkpointing=True, offload=True, plan=MemoryPlan(2, 0, 2))


CASES = [(sp, f, w, None, NO_LEVERS) for sp in (4, 2) for f in WINDOW_FAMILIES for w in (5, 24)]
CASES += [(sp, f, 5, DOCS, NO_LEVERS) for sp in (4, 2) for f in WINDOW_FAMILIES]
CASES += [(2, f, 5, None, ALL_LEVERS) for f in WINDOW_FAMILIES]
CASES += [(2, "qwen3_sliding", 5, None, NO_LEVERS)]


@functools.lru_cache(maxsize=None)
def reference(family, window, docs):
    """Plain transformers: the whole sequence, or each document alone (losses combined token-weighted)."""
    input_ids, labels = make_sequence(SEQ, seed=7)
    model = build(family, sliding_window=window)
    pieces = [(0, SEQ)] if docs is None else [(a, a + n) for a, n in zip([0, 13, 22], docs)]
    total, count = 0.0, 0
    for a, b in pieces:
        n = b - a - 1
        total = total + model(input_ids=input_ids[:, a:b], labels=labels[:, a:b]).loss * n
        count += n
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def cases_worker(rank, world_size, cases):
    """(case index, loss, gradients) of each case this rank took: every case at sp 4 (one group of all ranks), and
    at sp 2 the cases of its data-parallel group (alternate ones, the two groups side by side)."""
    layouts = {sp: ParallelLayout.build(sp) for sp in sorted({case[0] for case in cases})}
    at_sp = {sp: [i for i, case in enumerate(cases) if case[0] == sp] for sp in layouts}
    input_ids, labels = make_sequence(SEQ, seed=7)
    results = []
    for index, (sp, family, window, docs, levers) in enumerate(cases):
        layout = layouts[sp]
        if at_sp[sp].index(index) % layout.dp_size != layout.dp_rank:
            continue
        docs = list(docs) if docs else None
        model = SequenceParallelCausalLM(build(family, sliding_window=window), layout, min_offload_bytes=0, **levers)
        batch = shard_batch(input_ids, layout, labels=labels, document_lengths=docs)
        loss = model(**batch.as_kwargs())
        loss.backward()
        if layout.dp_size == 1:
            reduce_gradients(model.parameters(), layout)
        else:  # the DP groups hold different cases: the SP group's sum / sp, as reduce_gradients makes of one case
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=layout.sp_group)
                    p.grad.div_(layout.sp_size)
        grads = {n.replace(".mlp.mlp.", ".mlp."): p.grad for n, p in model.model.named_parameters()
                 if p.grad is not None}
        results.append((index, loss.item(), grads))
    return results


def _misses(result, ref):
    """Whether `result` fails assert_close against `ref` (loss or some gradient outside the tolerances)."""
    try:
        assert_close(*result, *ref)
    except AssertionError:
        return True
    return False


def test_window_families_equal_single_process():
    cases = [(sp, f, w, tuple(docs) if docs else None, levers) for sp, f, w, docs, levers in CASES]
    per_case = {}
    for rank_results in run_shared(cases_worker, 4, cases):
        for index, *result in rank_results:
            per_case.setdefault(index, []).append(result)
    # every case on each rank of its SP group: all 4 at sp 4, 2 at sp 2
    assert {i: len(r) for i, r in per_case.items()} == {i: case[0] for i, case in enumerate(cases)}
    for index, (sp, family, window, docs, levers) in enumerate(cases):
        ranks = per_case[index]
        ref = reference(family, window, docs)
        for result in ranks:
            assert_close(*result, *ref)
        if sp == 2 and docs is None and levers is NO_LEVERS:
            # The same results against a window one token wider, and against no window: both must fail.
            assert _misses(ranks[0], reference(family, window + 1, None)), (family, window, "off by one passed")
            assert _misses(ranks[0], reference(family, SEQ, None)), (family, window, "full causal passed")
    assert GRAD_RTOL == 1e-4
