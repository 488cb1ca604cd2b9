"""SP=2 through NCCL on two GPUs against SP=1: loss and every gradient after one step, per model family.

Skipped unless two CUDA devices are visible (CI has none; run it on a machine with two GPUs):

    NCCL_NVLS_ENABLE=0 python -m pytest tests/test_nccl_sp.py -q -s

Each of the two ranks computes the step twice on its own GPU: at sp 1 (the whole sequence, one rank's work; dp 2 on
the same tokens, so the reduction averages two equal gradients) and at sp 2 (its half, Ulysses all-to-alls over
NCCL), from the same seed weights and tokens, through the same levers, gradients averaged over the ranks as ZeRO-3
does (`reduce_gradients`). What this adds to the CPU tests (which hold the same paths against plain transformers on
gloo): NCCL's all-to-all and all-reduce on the compute stream, device placement before the first collective, the
CUDA offload streams and the CUDA kernels under the exchange.

Cases (CASES): the Qwen3 tiny model; tiny Mistral (every layer windowed) and Gemma 3 (local / global layers, logit
soft-cap); gpt-oss tiny (sinks on every layer, local / global, MoE); a Qwen3 + LoRA (peft, every projection, random
A and B so every adapter gradient is non-zero); the Qwen3.5 hybrid (a gated DeltaNet layer, then a gated full-
attention one). Every case with every lever: chunked loss, tiled MLP, checkpointing with every layer's input
offloaded, the last layer keeping its attention output (on CUDA in fp32 no explicit kernel takes the call, so that
layer falls back to SDPA's fp32 kernel and recomputes it: explicit_attention.explicit_backends). 45 tokens (padded to 46 at sp 2), the first 9 labels
ignored, windows of 5 (smaller than a shard). And the bf16 case of before: a 512-wide Qwen3 at 4096 tokens with
the cuDNN kernel over 2 head groups.

Tolerances. fp32 (TF32 off): the two runs differ only in the order of reductions (half-length matmuls, the sp sum
of the loss and of the weight gradients), so loss within 1e-5 relative and each gradient within 1e-4 relative norm,
as on CPU (tests/test_sp_parity.py). The window and sink cases run in bf16: their CUDA kernels (cuDNN's and flash's,
window_attention.py) take no fp32, so the fp32 bounds cannot be reached; they are held, like the bf16 Qwen3 case,
to bf16's rounding: loss within 2e-3 relative, each gradient within 3e-2 relative norm (half-length matmuls pick
other cuBLAS kernels and accumulation orders, the ranks' gradients are summed in bf16, cuDNN's backward accumulates
dq with atomics). A wrong exchange, position, shard border or reduction gives errors of order 1 (a gradient scaled
by sp_size is 1.0 off), beyond either bound.

The same bodies on gloo and CPU, to check this file's own logic where no two GPUs are (not part of the suite; the
parity on gloo is covered by the CPU tests above):

    ULYSSES_NCCL_TEST_BACKEND=gloo python -m pytest tests/test_nccl_sp.py -q -s
"""

import traceback

import pytest
import torch

from tests._dist import nccl_test_backend, run_distributed
from tests.test_sp_parity import make_sequence

BACKEND, pytestmark = nccl_test_backend()  # "gloo": the same bodies on CPU (docstring)
TOLERANCES = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-3, 3e-2)}  # (loss, gradient) relative
SEQ, IGNORED = 45, 9
WINDOW = 5
LEVERS = dict(chunked_loss=2, tiled_mlp=3, checkpointing=True, offload=True, min_offload_bytes=0)
# name: (tests.models family, dtype, overrides); "lora" is the qwen3 family with peft's LoRA on every projection.
CASES = {
    "qwen3": ("qwen3", torch.float32, {}),
    "mistral_window": ("mistral", torch.bfloat16, {"sliding_window": WINDOW}),
    "gemma3_window": ("gemma3", torch.bfloat16, {"sliding_window": WINDOW}),
    "gpt_oss_sinks": ("gpt_oss", torch.bfloat16, {"sliding_window": WINDOW}),
    "qwen3_lora": ("qwen3", torch.float32, {"lora": True}),
    "qwen3_5_hybrid": ("qwen3_5", torch.float32, {}),
}
BF16_VOCAB, BF16_SEQ = 1024, 4096  # the bf16 case with the cuDNN kernel over head groups



def _device(rank):
    if BACKEND != "nccl":
        return torch.device("cpu")
    # fp32 means fp32: TF32 matmuls and convolutions (the DeltaNet's) would round to 10 mantissa bits.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", rank)


def _build_case(name):
    from tests.models import build

    family, dtype, overrides = CASES[name]
    overrides = dict(overrides)
    lora = overrides.pop("lora", False)
    model = build(family, **overrides)
    if lora:
        from peft import get_peft_model

        from tests.test_peft import peft_config

        torch.manual_seed(1)  # the adapters' initial values
        model = get_peft_model(model, peft_config("lora"))
    return model.to(dtype)


def _grads(model):
    return {name: p.grad.float().cpu() for name, p in model.plain_named_parameters() if p.grad is not None}


def _step(sp_size, model, input_ids, labels, device, **levers):
    """(loss, {plain name: fp32 gradient}, host bytes offloaded) of one forward and backward at sp_size."""
    from ulysses_lc import MemoryPlan, ParallelLayout, SequenceParallelCausalLM, reduce_gradients, shard_batch

    layout = ParallelLayout.build(sp_size)
    wrapped = SequenceParallelCausalLM(model.to(device), layout, plan=MemoryPlan(2, 0, 1), **levers)
    batch = shard_batch(input_ids, layout, labels=labels).to(device)
    loss = wrapped(**batch.as_kwargs())
    loss.backward()
    reduce_gradients(wrapped.parameters(), layout)
    result = loss.item(), _grads(wrapped), wrapped.checkpointing.host_bytes
    wrapped.undo()
    return result


def _compare(one, two):
    """The sp 2 result against the sp 1 one: both losses, each gradient's relative error, both host byte counts."""
    (loss1, grads1, host1), (loss2, grads2, host2) = one, two
    assert grads1.keys() == grads2.keys(), sorted(grads1.keys() ^ grads2.keys())
    errors = {name: float((grads2[name] - ref).norm() / ref.norm().clamp(min=1e-12)) for name, ref in grads1.items()}
    return dict(loss_sp1=loss1, loss_sp2=loss2, grad_rel_errors=errors, host_bytes=(host1, host2),
                zero_grads=[name for name, ref in grads1.items() if ref.norm() == 0])


def cases_worker(rank, world_size, names):
    """On each rank, per case: sp 1 and sp 2 from fresh copies of the same weights, compared (_compare); a case that
    raises (on both ranks alike: a kernel refusal, a missing family) gives its traceback, so the others still run."""
    device = _device(rank)
    input_ids, labels = make_sequence(SEQ, seed=4, ignore_prefix=IGNORED)
    out = {}
    for name in names:
        try:
            out[name] = _compare(*(_step(sp, _build_case(name), input_ids, labels, device, **LEVERS)
                                   for sp in (1, world_size)))
        except Exception:  # noqa: BLE001 - reported as this case's failure
            out[name] = traceback.format_exc()
    return out


def _bf16_qwen3(device):
    from transformers import AutoModelForCausalLM, Qwen3Config

    # cuDNN's attention needs head_dim a multiple of 8 (64 here); 4 kv heads leave 2 per rank at sp 2, so the
    # kernel can run over 2 head groups on both sides.
    config = Qwen3Config(vocab_size=BF16_VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=BF16_SEQ,
                         tie_word_embeddings=True, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()


def bf16_worker(rank, world_size):
    """The 512-wide Qwen3 in bf16 at 4096 tokens, every lever, the kernel over 2 head groups: sp 1 against sp 2."""
    device = _device(rank)
    input_ids = torch.randint(0, BF16_VOCAB, (1, BF16_SEQ), generator=torch.Generator().manual_seed(1))
    runs = [_step(sp, _bf16_qwen3(device), input_ids, None, device, attention_head_groups=2, **LEVERS)
            for sp in (1, world_size)]
    return _compare(*runs)


@pytest.fixture(scope="module")
def results():
    """Every case on the same two ranks (one launch: a launch costs seconds of imports per rank)."""
    return run_distributed(cases_worker, 2, list(CASES), backend=BACKEND, timeout=600)


def _check(rank, name, r, dtype):
    if isinstance(r, str):
        pytest.fail(f"{name} rank {rank} raised:\n{r}")
    loss_rtol, grad_rtol = TOLERANCES[dtype]
    worst = max(r["grad_rel_errors"].items(), key=lambda kv: kv[1])
    print(f"{name} rank {rank}: loss sp1 {r['loss_sp1']:.6f} sp2 {r['loss_sp2']:.6f}, {len(r['grad_rel_errors'])} "
          f"gradients, worst relative error {worst[1]:.2e} ({worst[0]})")
    assert abs(r["loss_sp2"] - r["loss_sp1"]) <= loss_rtol * abs(r["loss_sp1"]), (name, rank, r["loss_sp1"],
                                                                                 r["loss_sp2"])
    for param, err in r["grad_rel_errors"].items():
        assert err <= grad_rtol, f"{name} rank {rank} {param}: relative gradient error {err:.2e} > {grad_rtol}"
    assert r["zero_grads"] == [], (name, r["zero_grads"])  # a gradient that is zero on both sides proves nothing
    assert min(r["host_bytes"]) > 0  # the offload really held activations on the host


@pytest.mark.parametrize("name", list(CASES))
def test_sp2_matches_sp1(results, name):
    for rank, per_case in enumerate(results):
        _check(rank, name, per_case[name], CASES[name][1])
    if name == "qwen3_lora":  # the adapters train, the base weights do not
        assert all("lora_" in p for p in results[0][name]["grad_rel_errors"]), list(results[0][name]["grad_rel_errors"])
    assert TOLERANCES[torch.float32] == (1e-5, 1e-4)


def test_sp2_bf16_with_head_groups_matches_sp1():
    for rank, r in enumerate(run_distributed(bf16_worker, 2, backend=BACKEND, timeout=600)):
        _check(rank, "qwen3 bf16 4096", r, torch.bfloat16)
