"""The MoE routers' load-balancing loss under SP: sp 1, 2 and 4 against plain transformers, tiled MLP on and off.

Reference: plain transformers with output_router_logits=True: `outputs.loss` (the token cross-entropy plus
router_aux_loss_coef x load_balancing_loss_func over every MoE layer) and its backward, no ulysses_lc code.
Cases, one sequence each:
  plain       40 tokens, the first 5 labels ignored (an ignored prompt is still routed, and counted);
  padded      31 tokens then 6 of padding (attention_mask 0, labels ignored), which transformers leaves out of the
              router loss; 37 is no multiple of 2 or 4, so shard_batch pads as well;
  packed      documents of 13, 17 and 10 tokens, positions restarting: transformers' forward over the packed row
              (with use_cache=False its masks keep the documents apart; a cache turns that detection off);
  packed_pad  documents of 13 and 17, then a padding segment of 7 (the main job's packed windows): transformers
              over the 30 tokens of the documents alone.
gpt-oss and the gated DeltaNet hybrids take plain and padded only: transformers' own forward over a packed row
lets their documents read each other (gpt-oss: the second document's logits 0.14 off its forward alone, on full
and sliding layers alike; the hybrids' torch DeltaNet carries its state across), where ulysses_lc keeps them apart.
Levers: none; every lever but the tiled MLP (checkpointed, offloaded layers: the routers' sums cross a recompute);
every lever with the tiled MLP in 3 tiles.
router_aux_loss_coef 0.5: the default 0.001 leaves the router term below the tolerances (a dropped term would pass).
Tolerances (fp32): loss 1e-5 relative, every gradient 1e-4 relative norm (test_sp_parity's), the routers' included.
One body on the session's 4 shared gloo ranks runs every family at sp 4, sp 2 (2 DP groups) and sp 1 (4), each DP
group cases of its own; a gradient is the sum over its SP group / sp, what ZeRO-3's average over all ranks makes of
it (layout.py).
"""

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_shared
from tests.models import VOCAB, build
from tests.test_sp_parity import LOSS_RTOL, assert_close
from ulysses_lc import IGNORE_INDEX, MemoryPlan, ParallelLayout, SequenceParallelCausalLM, shard_batch
from ulysses_lc.levers.tiled_mlp import plain_parameter_name

MOE = dict(output_router_logits=True, router_aux_loss_coef=0.5)
NONE = dict(chunked_loss=False, tiled_mlp=False, checkpointing=False, offload=False, efficient_norm=False)
UNTILED = dict(chunked_loss=4, tiled_mlp=False, checkpointing=True, offload=True, plan=MemoryPlan(2, 0, 1))
LEVER_SETS = {"none": NONE, "untiled": UNTILED, "tiled": dict(UNTILED, tiled_mlp=3)}


def _cases(packed: bool) -> list[dict]:
    """Each case: (shard_batch's arguments, transformers' arguments) for one sequence."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (1, 40), generator=g)
    plain = ids.clone()
    plain[:, :5] = IGNORE_INDEX
    padded_ids, padded = ids[:, :37].clone(), ids[:, :37].clone()
    mask = torch.ones(1, 37, dtype=torch.long)
    mask[:, 31:], padded[:, 31:], padded_ids[:, 31:] = 0, IGNORE_INDEX, 0
    cases = [
        ("plain", dict(input_ids=ids, labels=plain), dict(input_ids=ids, labels=plain)),
        ("padded", dict(input_ids=padded_ids, labels=padded, attention_mask=mask),
         dict(input_ids=padded_ids, labels=padded, attention_mask=mask)),
    ]
    if packed:
        docs = ids.clone()
        docs[:, [13, 30]] = IGNORE_INDEX  # a document's first label: the one before it is not predicted across
        positions = torch.cat([torch.arange(n) for n in (13, 17, 10)])[None]
        pad_mask = torch.ones(1, 37, dtype=torch.long)
        pad_mask[:, 30:] = 0
        pad_labels = docs[:, :37].clone()
        pad_labels[:, 30:] = IGNORE_INDEX
        cases += [
            ("packed", dict(input_ids=ids, labels=docs, document_lengths=[13, 17, 10]),
             dict(input_ids=ids, labels=docs, position_ids=positions, use_cache=False)),
            ("packed_pad", dict(input_ids=ids[:, :37], labels=pad_labels, document_lengths=[13, 17, 7],
                                attention_mask=pad_mask),
             dict(input_ids=ids[:, :30], labels=docs[:, :30], position_ids=positions[:, :30], use_cache=False)),
        ]
    return cases


def reference(family, kwargs):
    model = build(family, **MOE)
    out = model(**kwargs)
    assert out.aux_loss is not None and out.aux_loss.item() > 0  # transformers adds the router term
    out.loss.backward()
    return out.loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def router_worker(rank, world_size, cases_of):
    """Every (family, levers, case) at sp 1, 2 and 4, the DP groups taking them in turn; the layouts built once."""
    results = []
    for sp in (1, 2, 4):
        layout = ParallelLayout.build(sp)
        work = [(family, lever_name, index) for family, cases in cases_of.items() for lever_name in LEVER_SETS
                for index in range(len(cases))]
        for family, lever_name, index in work[layout.dp_rank::layout.dp_size]:
            loss, grads = _loss_and_grads(family, layout, LEVER_SETS[lever_name], cases_of[family][index][1])
            if layout.sp_rank == 0:
                results.append((family, sp, lever_name, index, loss, grads))
    return results


def _loss_and_grads(family, layout, levers, batch_kwargs):
    model = SequenceParallelCausalLM(build(family, **MOE), layout, min_offload_bytes=0, **levers)
    loss = model(**shard_batch(layout=layout, **batch_kwargs).as_kwargs())
    loss.backward()
    grads = {}
    for name, p in model.model.named_parameters():
        if p.grad is not None:
            if layout.sp_size > 1:
                dist.all_reduce(p.grad, group=layout.sp_group)
            grads[plain_parameter_name(name)] = p.grad / layout.sp_size
    return loss.item(), grads


FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_5_moe", "qwen3_next")


def test_router_loss_equals_transformers_at_sp_1_2_4():
    # One body for every family: the 4 shared ranks build their layouts once, not once a family.
    cases_of = {family: _cases(packed=family in ("qwen3_moe", "mixtral")) for family in FAMILIES}
    seen = set()
    results = run_shared(router_worker, 4, cases_of)
    for family, cases in cases_of.items():
        refs = [reference(family, ref_kwargs) for _, _, ref_kwargs in cases]
        for rank_results in results:
            for result_family, sp, lever_name, index, loss, grads in rank_results:
                if result_family != family:
                    continue
                where = (family, sp, lever_name, cases[index][0])
                assert any("gate" in n or "router" in n for n in grads)  # the routers' gradients are compared
                try:
                    assert_close(loss, grads, *refs[index])
                except AssertionError as e:
                    raise AssertionError(f"{family}, sp {sp}, levers {lever_name}, case {where[3]}: {e}") from None
                seen.add(where)
    assert seen == {(family, sp, lever, case[0]) for family, cases in cases_of.items() for sp in (1, 2, 4)
                    for lever in LEVER_SETS for case in cases}


def switch_worker(rank, world_size):
    layout = ParallelLayout.build(world_size)
    hooks = {}
    for name, overrides in (("off", {}), ("on", MOE)):
        model = SequenceParallelCausalLM(build("qwen3_moe", **overrides), layout, **NONE)
        routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate")]
        hooks[name] = (model.router_loss is None, sum(len(r._forward_hooks) for r in routers))
    batch = shard_batch(torch.arange(8), layout)
    try:  # preference training (documents) does not add the router loss: refused, not dropped
        model(**batch.as_kwargs(), documents=1)
        refused = ""
    except ValueError as e:
        refused = str(e)
    model.undo()
    return hooks, sum(len(r._forward_hooks) for r in routers), refused


def test_router_loss_switch():
    # output_router_logits off (every config's default): no hook, no sums, the loss as before. On: one hook per router,
    # gone with undo(); the preference loss refuses it.
    hooks, after_undo, refused = run_shared(switch_worker, 4)[0]
    assert hooks == {"off": (True, 0), "on": (False, 2)} and after_undo == 0
    assert "output_router_logits=False" in refused


def test_shard_batch_marks_padding():
    # 7 tokens, the last 2 the caller's padding, over sp 2 (padded to 8): rank 1 holds 2 tokens, then 2 of padding.
    mask = torch.tensor([1, 1, 1, 1, 1, 0, 0])
    batches = [shard_batch(torch.arange(7), ParallelLayout(2, 2, r), attention_mask=mask) for r in (0, 1)]
    assert batches[0].token_mask.tolist() == [[True] * 4]
    assert batches[1].token_mask.tolist() == [[True, False, False, False]]
    assert batches[1].as_kwargs()["token_mask"] is batches[1].token_mask
    assert shard_batch(torch.arange(8), ParallelLayout(2, 2, 0)).token_mask is None  # no padding, nothing sent
    assert shard_batch(torch.arange(7), ParallelLayout(2, 2, 0)).token_mask.tolist() == [[True] * 4]
    with pytest.raises(ValueError, match="pad on the right"):
        shard_batch(torch.arange(7), ParallelLayout(1, 1), attention_mask=torch.tensor([0, 1, 1, 1, 1, 1, 1]))


def test_a_packed_window_marks_its_padding_segment():
    from ulysses_lc.data.stream import Sample

    ids = torch.arange(10)
    sample = Sample(ids, ids, [4, 3, 3], num_documents=2, padding_tokens=3)
    assert sample.attention_mask.tolist() == [1] * 7 + [0] * 3
    assert Sample(ids, ids, None, 1, 0).attention_mask is None


def trainer_worker(rank, world_size, out, rows):
    import datasets

    from tests.test_hf_trainer import training_args
    from ulysses_lc.integrations.hf_trainer import UlyssesTrainer

    ds = datasets.Dataset.from_dict(rows)
    trainer = UlyssesTrainer(model=build("qwen3_moe", **MOE), args=training_args(out, 1), train_dataset=ds,
                             eval_dataset=ds, sp_size=2, levers={"tiled_mlp": False})
    return trainer.evaluate()["eval_loss"]


def test_trainer_loss_holds_the_router_loss(tmp_path):
    # The Trainer path (tiled MLP off, the case that trained silently without the router loss): its eval loss is
    # transformers' outputs.loss with the router term, padding (attention_mask 0) left out of it as transformers does.
    (_, plain, _), (_, padded, _) = _cases(packed=False)[:2]
    rows = {"input_ids": [plain["input_ids"][0, :37].tolist(), padded["input_ids"][0].tolist()],
            "labels": [plain["labels"][0, :37].tolist(), padded["labels"][0].tolist()],
            "attention_mask": [[1] * 37, padded["attention_mask"][0].tolist()]}
    model = build("qwen3_moe", **MOE).eval()
    with torch.no_grad():
        ref = sum(model(**{k: torch.tensor([v[i]]) for k, v in rows.items()}).loss.item() for i in range(2)) / 2
    for loss in run_shared(trainer_worker, 2, str(tmp_path), rows, kind="trainer"):
        assert abs(loss - ref) <= LOSS_RTOL * ref, (loss, ref)


def test_step_line_shows_the_router_loss():
    from ulysses_lc.plan.metrics import StepLogger

    record = {"step": 1, "total_steps": 2, "loss": 1.0, "grad_norm": None, "lr": None, "tokens": 8, "step_time_s": 1.0,
              "tokens_per_s": 8.0, "tflops_per_gpu": None, "mfu": None, "gpu_mem_gb": None, "host_rss_gb": 1.0,
              "host_used_gb": 2.0}
    assert "aux_loss" not in StepLogger.format_line(record)
    assert "| loss 1.0000 |" in StepLogger.format_line(record) and \
        "aux_loss 2.0625" in StepLogger.format_line({**record, "aux_loss": 2.0625})
