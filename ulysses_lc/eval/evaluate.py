"""`evaluate`: the loss by position and the passkey of a model under its SP layout, forward only.

Call it from any loop that holds a `SequenceParallelCausalLM`, bare or inside its DeepSpeed engine, on every rank
with the same sequences and haystacks (each rank shards them itself, as shard_batch does for training):

    from ulysses_lc.eval import build_haystacks, evaluate
    result = evaluate(engine, sequences=[ids_s], haystacks=build_haystacks(tokenizer, [ids_s], len(ids_s)))
    print(result.line(step))          # eval step 40 | loss 3.2100 | by position ... | passkey 5/5 found ...

Each DP group takes every dp_size-th item; a group left short repeats one and discards it, since under ZeRO-3 every
rank must run the same forwards (each gathers the weights with all the others). The model runs in eval mode (no
dropout; transformers skips checkpointing there, so no layer input is kept or offloaded, no attention output kept)
under no_grad, and goes back to the mode it was in. The head scores rows in chunks (levers/chunked_loss.py), so the
[tokens x vocab] logits never exist; a passkey forward scores only its key's rows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..constants import IGNORE_INDEX
from ..levers.yarn import trained_length as rope_trained_length
from ..model import SequenceParallelCausalLM
from ..parallel.sharding import shard_batch
from .passkey import Haystack
from .positions import Buckets
from .report import BucketLoss, EvalResult, PasskeyDepth


def evaluate(model, sequences=(), haystacks: list[Haystack] = (), *, buckets: int | list[int] = 8,
             trained_length: int | None = None, pad_token_id: int = 0, vocab_size: int | None = None) -> EvalResult:
    """The mean loss and loss by position bucket over `sequences`, and passkey retrieval by depth over `haystacks`.

    model: a SequenceParallelCausalLM, or a DeepSpeed engine of one. Collective: every rank calls it with the same
        arguments.
    sequences: token ids [s] (every token a label), or data.Sample's (labels and packed documents as in training),
        all of one length.
    buckets: equal-width buckets, or their start positions (positions.Buckets).
    trained_length: the base model's trained length, marked among the buckets (default: the model config's
        pre-scaling length, levers/yarn.py).
    vocab_size: check the labels on the host (shard_batch), where a GPU's loss could only assert.
    """
    inner = getattr(model, "module", model)
    if not isinstance(inner, SequenceParallelCausalLM):
        raise ValueError(f"evaluate takes a SequenceParallelCausalLM or a DeepSpeed engine of one, got "
                         f"{type(inner).__name__}; wrap the model first (ulysses_lc.SequenceParallelCausalLM).")
    samples = [_as_sample(s) for s in sequences]
    haystacks = list(haystacks)
    lengths = {len(s[0]) for s in samples} | {len(h.input_ids) for h in haystacks}
    if not lengths:
        raise ValueError("evaluate got no sequences and no haystacks: pass at least one.")
    if len(lengths) > 1:
        raise ValueError(f"evaluate takes sequences and haystacks of one length; got lengths {sorted(lengths)}.")
    seq_len = lengths.pop()
    if trained_length is None:
        trained_length = _trained_length(inner.config)
    layout = inner.layout
    bucket_set = Buckets.make(seq_len, buckets, trained_length)
    device = next(inner.parameters()).device
    shard = dict(pad_token_id=pad_token_id, vocab_size=vocab_size)
    was_training = inner.training
    model.eval()
    try:
        with torch.no_grad():
            sums = torch.zeros(2, bucket_set.count, dtype=torch.float64, device=device)
            for (input_ids, labels, documents), counted in _share(samples, layout):
                batch = shard_batch(input_ids, layout, labels=labels, document_lengths=documents, **shard).to(device)
                loss_bs, _ = model(**batch.as_kwargs(), per_token=True)
                if counted:
                    sums += bucket_set.sums(loss_bs, batch.labels != IGNORE_INDEX, batch.position_ids)
            keys = torch.zeros(len(haystacks), 3, dtype=torch.float64, device=device)  # logp sum, right, key tokens
            for index, counted in _share(list(range(len(haystacks))), layout):
                h = haystacks[index]
                batch = shard_batch(h.input_ids, layout, labels=h.labels, **shard).to(device)
                loss_bs, correct_bs = model(**batch.as_kwargs(), per_token=True)
                if counted:
                    valid_bs = batch.labels != IGNORE_INDEX
                    keys[index] += torch.stack([-loss_bs[valid_bs].double().sum(), correct_bs[valid_bs].double().sum(),
                                                valid_bs.double().sum()])
        if layout.world_size > 1:  # every rank's slices of every group's sequences
            dist.all_reduce(sums, group=layout.world_group)
            dist.all_reduce(keys, group=layout.world_group)
    finally:
        model.train(was_training)
    return _result(seq_len, len(samples), bucket_set, sums.cpu(), haystacks, keys.cpu())


def _as_sample(item):
    """(input_ids [s], unshifted labels [s], document lengths or None) of a tensor or a data.Sample."""
    if isinstance(item, torch.Tensor):
        ids = item.reshape(-1).long()
        return ids, ids, None
    return item.input_ids, item.labels, item.document_lengths


def _share(items: list, layout):
    """This DP group's items, each with whether it counts: group j takes items j, j + dp, ...; every group runs the
    same number of forwards (ZeRO-3 gathers weights with every rank), a short one repeating its last, uncounted."""
    dp, j = layout.dp_size, layout.dp_rank
    per_group = -(-len(items) // dp)
    for i in range(per_group):
        k = i * dp + j
        yield items[min(k, len(items) - 1)], k < len(items)


def _trained_length(config) -> int | None:
    try:
        return rope_trained_length(config)
    except ValueError:  # no RoPE: no trained length to mark
        return None


def _result(seq_len: int, n_sequences: int, bucket_set: Buckets, sums, haystacks, keys) -> EvalResult:
    loss_sum, count = sums.sum(dim=1).tolist()
    buckets = [BucketLoss(bucket_set.edges[i], bucket_set.edges[i + 1], s / n if n else None, int(n),
                          bucket_set.beyond_trained(i)) for i, (s, n) in enumerate(zip(*sums.tolist()))]
    depths = {}
    for h, (logp, right, n) in zip(haystacks, keys.tolist()):
        depths.setdefault(h.depth, []).append((h.needle_position, logp, right, n))
    passkey = [PasskeyDepth(depth, round(sum(r[0] for r in rows) / len(rows)), len(rows),
                            sum(r[2] == r[3] for r in rows) / len(rows), sum(r[2] for r in rows) / sum(r[3] for r in rows),
                            sum(r[1] for r in rows) / sum(r[3] for r in rows))
               for depth, rows in depths.items()]
    return EvalResult(seq_len, loss_sum / count if count else None, int(count), n_sequences, buckets,
                      bucket_set.trained_length, passkey)


__all__ = ["evaluate"]
