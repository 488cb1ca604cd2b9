"""Pins the CPU numbers of the levers: loss and every gradient bitwise equal to those recorded in
tests/data/parity_pin.pt, written by this file's `--write` before the package was restructured (issue 11).

A restructuring that moves code must not move a bit. Two configurations, fp32, one thread per rank:
  sp 2 on two gloo ranks, every lever (chunked loss in 2-row chunks, 3 MLP tiles, offloaded checkpoints,
      the last layer keeping its attention output), Qwen3 and Qwen3-MoE;
  sp 1, every layer keeping its attention output, the kernel over 2 head groups.
Bitwise equality is only meaningful on the CPU kernels the pin was written with (same ISA level); on another
CPU capability the check falls back to 1e-6 relative (the parity tests hold the 1e-5 / 1e-4 contract anyway).

    python -m tests.test_refactor_pin --write      # only to re-pin after an intended change of numbers
"""

import sys
from pathlib import Path

import torch

from tests._dist import run_distributed
from tests.models import VOCAB, build
from ulysses_lc.tiled_mlp import plain_parameter_name

PIN = Path(__file__).parent / "data" / "parity_pin.pt"
LEVERS_SP2 = dict(chunked_loss=2, tiled_mlp=3, checkpointing=True, offload=True)


def _sequence():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (1, 45), generator=g)
    labels = ids.clone()
    labels[:, :9] = -100
    return ids, labels


def _run(model, layout, ids, labels):
    from ulysses_lc import reduce_gradients, shard_batch

    loss = model(**shard_batch(ids, layout, labels=labels).as_kwargs())
    loss.backward()
    reduce_gradients(model.parameters(), layout)
    grads = {plain_parameter_name(n): p.grad.clone()
             for n, p in model.model.named_parameters() if p.grad is not None}
    return loss.detach().clone(), grads


def pin_worker(rank, world_size):
    from ulysses_lc import MemoryPlan, ParallelLayout, SequenceParallelCausalLM

    ids, labels = _sequence()
    out = {}
    layout = ParallelLayout.build(world_size)
    for family in ("qwen3", "qwen3_moe"):
        model = SequenceParallelCausalLM(build(family, tie_word_embeddings=True), layout, min_offload_bytes=0,
                                         plan=MemoryPlan(2, 0, 1), **LEVERS_SP2)
        out[f"sp2_{family}"] = _run(model, layout, ids, labels)
    groups = [torch.distributed.new_group([0]) for _ in range(3)]  # new_group is collective: every rank
    if rank != 0:
        return None
    single = ParallelLayout(world_size=1, sp_size=1, rank=0, sp_group=groups[0], dp_group=groups[1],
                            world_group=groups[2])
    model = SequenceParallelCausalLM(build("qwen3", num_hidden_layers=3), single, min_offload_bytes=0,
                                     chunked_loss=2, tiled_mlp=2, plan=MemoryPlan(3, 0, 3),
                                     attention_head_groups=2)
    out["sp1_groups_kept"] = _run(model, single, ids, labels)
    return out


def _current():
    return run_distributed(pin_worker, 2)[0]


def test_numbers_bitwise_as_pinned():
    pinned = torch.load(PIN)
    now = _current()
    same_cpu = pinned["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    for case, (loss, grads) in pinned["cases"].items():
        now_loss, now_grads = now[case]
        assert now_grads.keys() == grads.keys(), case
        for name, ref in [("loss", loss), *grads.items()]:
            got = now_loss if name == "loss" else now_grads[name]
            if same_cpu:
                assert torch.equal(got, ref), f"{case} {name}: not bitwise equal to the pin"
            else:
                torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-9)


if __name__ == "__main__" and "--write" in sys.argv:
    PIN.parent.mkdir(exist_ok=True)
    torch.save({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": str(torch.__version__),
                "cases": _current()}, PIN)
    print(f"wrote {PIN}")
