"""SP=2 through NCCL on two GPUs against SP=1, bf16, with the levers of the training path: loss and every gradient.

Skipped unless two CUDA devices are visible (CI has none; run it on a machine with two GPUs). Each of the two
ranks computes the step twice on its own GPU: at sp 1 (the whole sequence, one rank's work) and at sp 2 (its
half, Ulysses all-to-alls over NCCL), from the same seed weights and tokens, gradients averaged over the ranks as
ZeRO-3 does (`reduce_gradients`). Levers on both sides: chunked loss, tiled MLP, RMSNorm saving bf16,
checkpointing with every layer's input offloaded to pinned host memory on the side stream, the last layer
keeping its attention output (the recompute then runs no attention kernel), the cuDNN kernel called over 2 head
groups. What this adds to the CPU tests (which hold the same paths to fp32 tolerances on gloo): NCCL's
all-to-all on the compute stream, the CUDA offload streams and the cuDNN kernels under the exchange.

Tolerances (bf16 weights and activations, fp32 loss): the two runs differ by rounding only (half-length
matmuls pick other cuBLAS kernels and accumulation orders, the two ranks' weight gradients are summed in bf16,
cuDNN's backward accumulates dq with atomics), so loss within 2e-3 relative and each parameter's gradient
within 3e-2 relative norm. A wrong exchange, position, shard border or reduction divisor gives errors of
order 1 (a gradient scaled by sp_size is 1.0 off).
"""

import pytest
import torch

from tests._dist import run_distributed
from ulysses_lc.levers.tiled_mlp import plain_parameter_name

LOSS_RTOL = 2e-3
GRAD_RTOL = 3e-2
VOCAB = 1024
SEQ = 4096

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)"
)


def _build(device, dtype):
    from transformers import AutoModelForCausalLM, Qwen3Config

    # cuDNN's attention needs head_dim a multiple of 8 (64 here); 4 kv heads leave 2 per rank at sp 2, so the
    # kernel can run over 2 head groups on both sides.
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=SEQ,
                         tie_word_embeddings=True, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).train()


def _step(sp_size, input_ids, device, dtype):
    """(loss, {name: fp32 gradient}, host bytes offloaded) of one forward and backward at sp_size."""
    from ulysses_lc import MemoryPlan, ParallelLayout, SequenceParallelCausalLM, reduce_gradients, shard_batch

    layout = ParallelLayout.build(sp_size)
    model = SequenceParallelCausalLM(_build(device, dtype), layout, plan=MemoryPlan(2, 0, 1),
                                     attention_head_groups=2, min_offload_bytes=0)
    batch = shard_batch(input_ids, layout, vocab_size=VOCAB).to(device)
    loss = model(**batch.as_kwargs())
    loss.backward()
    reduce_gradients(model.parameters(), layout)
    grads = {plain_parameter_name(name): p.grad.float()
             for name, p in model.model.named_parameters() if p.grad is not None}
    return loss.item(), grads, model.checkpointing.host_bytes


def compare_worker(rank, world_size, device_type="cuda", dtype=torch.bfloat16):
    """On each rank: the sp 1 and sp 2 runs' losses, each gradient's relative error, host bytes of both."""
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    input_ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    loss1, grads1, host1 = _step(1, input_ids, device, dtype)
    loss2, grads2, host2 = _step(world_size, input_ids, device, dtype)
    assert grads1.keys() == grads2.keys()
    errors = {name: float((grads2[name] - ref).norm() / ref.norm().clamp(min=1e-12)) for name, ref in grads1.items()}
    return dict(loss_sp1=loss1, loss_sp2=loss2, grad_rel_errors=errors, host_bytes=(host1, host2))


def test_sp2_over_nccl_matches_sp1():
    results = run_distributed(compare_worker, 2, backend="nccl", timeout=300)
    for rank, r in enumerate(results):
        worst = max(r["grad_rel_errors"].items(), key=lambda kv: kv[1])
        print(f"rank {rank}: loss sp1 {r['loss_sp1']:.6f} sp2 {r['loss_sp2']:.6f}, "
              f"{len(r['grad_rel_errors'])} gradients, worst relative error {worst[1]:.2e} ({worst[0]})")
        assert abs(r["loss_sp2"] - r["loss_sp1"]) <= LOSS_RTOL * abs(r["loss_sp1"]), r
        for name, err in r["grad_rel_errors"].items():
            assert err <= GRAD_RTOL, f"rank {rank} {name}: relative gradient error {err:.2e}"
        assert min(r["host_bytes"]) > 0  # the offload really held activations on the host
