"""SP=N against one plain process: same model, same sequence, loss and every gradient.

The reference is plain transformers: `model(input_ids, labels=labels).loss` and its backward, with no
ulysses_lc code. The SP side runs on gloo ranks; gradients are then averaged over all ranks, which is what DeepSpeed
ZeRO-3 does with them (layout.py says why that is the exact gradient).
Tolerances (fp32): loss within 1e-5 relative, each parameter's gradient within 1e-4 relative norm.

The all-levers case is also held to the numbers recorded before issue 11's restructure (tests/data/parity_pin.pt),
ten times tighter than the contract: a change of numerics the contract lets through (the loss chunking, a lever's
reduction order) fails there. Not bitwise: the bits move with the CPU's kernels (on AVX2 against the pin's AVX512
the loss is equal, each gradient within 1.1e-6 of its largest element) and moved on a machine of the pin's own
ISA. `python -m tests.test_sp_parity --write-pin` records them again, only after an intended change of numbers.
"""

import sys
from pathlib import Path

import pytest
import torch

from tests._dist import run_shared
from tests.models import VOCAB, build
from ulysses_lc import IGNORE_INDEX, MemoryPlan, ParallelLayout, SequenceParallelCausalLM, reduce_gradients, shard_batch
from ulysses_lc.levers.tiled_mlp import plain_parameter_name

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
PIN = Path(__file__).parent / "data" / "parity_pin.pt"
PIN_LOSS_RTOL = 1e-6
PIN_GRAD_RTOL = 1e-5


def make_sequence(seq_len, seed, ignore_prefix=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (1, seq_len), generator=g)
    labels = input_ids.clone()
    labels[:, :ignore_prefix] = IGNORE_INDEX
    return input_ids, labels


def reference(family, input_ids, labels, **overrides):
    model = build(family, **overrides)
    with torch.no_grad():
        eval_loss = model.eval()(input_ids=input_ids, labels=labels).loss.item()
    loss = model.train()(input_ids=input_ids, labels=labels).loss
    assert abs(loss.item() - eval_loss) <= LOSS_RTOL * eval_loss  # no dropout: train and eval agree
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


NO_LEVERS = dict(chunked_loss=False, tiled_mlp=False, checkpointing=False, offload=False, efficient_norm=False)


def sp_worker(rank, world_size, family, sp_size, sequences, overrides, levers=NO_LEVERS):
    layout = ParallelLayout.build(sp_size)
    input_ids, labels = sequences[layout.dp_rank]
    model = SequenceParallelCausalLM(build(family, **overrides), layout, **levers)
    batch = shard_batch(input_ids, layout, labels=labels)
    loss = model(**batch.as_kwargs())
    loss.backward()
    reduce_gradients(model.parameters(), layout)
    grads = {name: p.grad for name, p in model.model.named_parameters() if p.grad is not None}
    return loss.item(), grads


def assert_close(loss, grads, ref_loss, ref_grads, loss_rtol=LOSS_RTOL, grad_rtol=GRAD_RTOL):
    assert abs(loss - ref_loss) <= loss_rtol * abs(ref_loss), (loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        err = (grads[name] - ref).norm() / ref.norm().clamp(min=1e-12)
        assert err <= grad_rtol, f"{name}: relative gradient error {err:.2e}"


def eval_worker(rank, world_size, family, input_ids, labels):
    layout = ParallelLayout.build(world_size)
    model = SequenceParallelCausalLM(build(family), layout, **NO_LEVERS).eval()
    with torch.no_grad():
        return model(**shard_batch(input_ids, layout, labels=labels).as_kwargs()).item()


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe"])
@pytest.mark.parametrize("world", [2, 4])
def test_sp_equals_single_process(family, world):
    input_ids, labels = make_sequence(64, seed=1)
    ref_loss, ref_grads = reference(family, input_ids, labels)
    results = run_shared(sp_worker, world, family, world, [(input_ids, labels)], {})
    for loss, grads in results:
        assert_close(loss, grads, ref_loss, ref_grads)


def test_eval_loss_not_scaled_by_sp():
    # Evaluation goes through the same reduction: the plain model's eval loss, not sp_size times it.
    input_ids, labels = make_sequence(50, seed=5, ignore_prefix=20)
    model = build("qwen3").eval()
    with torch.no_grad():
        ref = model(input_ids=input_ids, labels=labels).loss.item()
    for loss in run_shared(eval_worker, 4, "qwen3", input_ids, labels):
        assert abs(loss - ref) <= LOSS_RTOL * ref


def test_kv_heads_replicated_when_sp_exceeds_them():
    # 4 query heads, 2 KV heads, sp 4: each rank gets one replicated KV head.
    input_ids, labels = make_sequence(48, seed=2)
    overrides = {"num_key_value_heads": 2}
    ref = reference("qwen3", input_ids, labels, **overrides)
    loss, grads = run_shared(sp_worker, 4, "qwen3", 4, [(input_ids, labels)], overrides)[0]
    assert_close(loss, grads, *ref)


def test_length_not_divisible_and_ignored_labels_on_one_shard():
    # 37 tokens over 4 ranks (padded to 40); the first 26 labels ignored, so rank 0 has no valid label
    # and rank 1 only a few: a mean of per-rank means would be wrong here.
    input_ids, labels = make_sequence(37, seed=3, ignore_prefix=26)
    ref = reference("llama", input_ids, labels)
    loss, grads = run_shared(sp_worker, 4, "llama", 4, [(input_ids, labels)], {})[0]
    assert_close(loss, grads, *ref)


def test_dp2_x_sp2_averages_sequences():
    seqs = [make_sequence(40, seed=10), make_sequence(40, seed=11, ignore_prefix=7)]
    refs = [reference("qwen3", *s) for s in seqs]
    mean_grads = {n: (refs[0][1][n] + refs[1][1][n]) / 2 for n in refs[0][1]}
    results = run_shared(sp_worker, 4, "qwen3", 2, seqs, {})
    for rank, (loss, grads) in enumerate(results):
        ref_loss = refs[rank // 2][0]  # ranks 0,1 share sequence 0; ranks 2,3 sequence 1
        assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss)
        for name, ref in mean_grads.items():
            err = (grads[name] - ref).norm() / ref.norm().clamp(min=1e-12)
            assert err <= GRAD_RTOL, f"{name}: relative gradient error {err:.2e}"


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_sp2_with_all_levers_equals_plain_single_process(family):
    # Chunked loss (2-row chunks, so several chunks and a ragged last one), tiled MLP (3 tiles),
    # checkpointing with every layer's input offloaded, the last layer keeping its attention output:
    # SP=2 against plain transformers with none.
    ref = reference(family, *ALL_LEVERS_SEQUENCE, **ALL_LEVERS_OVERRIDES)
    pin_loss, pin_grads = torch.load(PIN)["cases"][f"sp2_{family}"]
    for loss, grads, host_bytes in _all_levers_sp2(family):
        assert_close(loss, grads, *ref)
        assert host_bytes > 0  # the offload really held activations on the host
        assert_close(loss, grads, pin_loss.item(), pin_grads, PIN_LOSS_RTOL, PIN_GRAD_RTOL)


ALL_LEVERS_SEQUENCE = make_sequence(45, seed=4, ignore_prefix=9)
ALL_LEVERS_OVERRIDES = {"tie_word_embeddings": True}


def _all_levers_sp2(family):
    levers = dict(chunked_loss=2, tiled_mlp=3, checkpointing=True, offload=True, plan=MemoryPlan(2, 0, 1))
    return run_shared(_levers_worker, 2, family, ALL_LEVERS_OVERRIDES, levers, *ALL_LEVERS_SEQUENCE)


def _levers_worker(rank, world_size, family, overrides, levers, input_ids, labels):
    layout = ParallelLayout.build(world_size)
    model = SequenceParallelCausalLM(build(family, **overrides), layout, min_offload_bytes=0, **levers)
    batch = shard_batch(input_ids, layout, labels=labels)
    loss = model(**batch.as_kwargs())
    loss.backward()
    reduce_gradients(model.parameters(), layout)
    grads = {name: p.grad for name, p in model.model.named_parameters() if p.grad is not None}
    grads = {plain_parameter_name(name): g for name, g in grads.items()}
    return loss.item(), grads, model.checkpointing.host_bytes


if __name__ == "__main__" and "--write-pin" in sys.argv:
    cases = {}
    for family in ("qwen3", "qwen3_moe"):
        loss, grads, _ = _all_levers_sp2(family)[0]
        cases[f"sp2_{family}"] = (torch.tensor(loss), grads)
    torch.save({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": str(torch.__version__),
                "cases": cases}, PIN)
    print(f"wrote {PIN}")
