"""Fused RoPE (levers/rope.py) against transformers' apply_rotary_pos_emb: the kernel, the switch, whole models.

On CPU the Triton kernel runs in Triton's interpreter (rope.INTERPRET_ON_CPU): the same kernel source, its
arithmetic in numpy; the CUDA test runs it compiled. Tolerances: fp32 within 1e-6 of float64 (values of a few
units). bf16, against float64 on the same bf16 inputs: compiled, within one rounding to nearest (2^-8 relative)
and never further than transformers' own bf16 result, which rounds three times; in the interpreter, which narrows
fp32 to bf16 toward zero (its create_fp_trunc; Triton's compiled cast rounds to nearest), within one bf16 step
(2^-7 relative).
"""

import pytest
import torch
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.qwen3 import modeling_qwen3

from tests.models import VOCAB, build
from ulysses_lc.levers import rope

pytest.importorskip("triton", reason="the fused RoPE kernel is Triton's (installed with the test extra)")

LLAMA_FORM = modeling_qwen3.apply_rotary_pos_emb
# transformers' own function of each form of rope.FORMS: the Llama form, and gpt-oss's (cos and sin half the head)
OWN = {"llama": LLAMA_FORM, "half": modeling_gpt_oss.apply_rotary_pos_emb}


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setattr(rope, "INTERPRET_ON_CPU", True)
    calls = []
    kernel = rope.rope_bhsd

    def counted(*args, **kwargs):
        calls.append(kwargs.get("backward", False))
        return kernel(*args, **kwargs)

    monkeypatch.setattr(rope, "rope_bhsd", counted)
    return calls


def _inputs(dtype, b, b_cos, h, h_kv, s, d, seed=0, layout="bshd", form="llama"):
    g = torch.Generator().manual_seed(seed)

    def heads(n):  # q and k as transformers hands them over: [b, h, s, d] views of [b, s, h, d] projections
        if layout == "bshd":
            return torch.randn(b, s, n, d, generator=g).to(dtype).transpose(1, 2)
        return torch.randn(b, n, s, d, generator=g).to(dtype)

    q, k = heads(h).requires_grad_(), heads(h_kv).requires_grad_()
    angles = torch.rand(b_cos, s, d // 2, generator=g) * 20
    if form == "llama":  # transformers' rotary modules repeat the half's angles
        angles = torch.cat((angles, angles), -1)
    return q, k, angles.cos().to(dtype), angles.sin().to(dtype)


def _forward_backward(fn, q, k, cos, sin, grad_dtype, seed=1):
    """(q_embed, k_embed, dq, dk) for gradients drawn in fp32, rounded to grad_dtype (the test's), then taken to q's."""
    q_out, k_out = fn(q, k, cos, sin)
    g = torch.Generator().manual_seed(seed)
    gq, gk = (torch.randn(x.shape, generator=g).to(grad_dtype).to(q.dtype).to(x.device) for x in (q_out, k_out))
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (gq, gk))
    return q_out, k_out, dq, dk


SHAPES = [  # b, b_cos, h, h_kv, s, d: GQA; a batch with its own positions per row and a half of 6 (masked lanes)
    (1, 1, 6, 2, 7, 16),
    (2, 2, 3, 1, 5, 12),
    (2, 1, 4, 4, 3, 8),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout,form", [("bshd", "llama"), ("bhsd", "llama"), ("bshd", "half")])
def test_the_kernel_computes_each_form_forward_and_backward(interpreted, monkeypatch, dtype, shape, layout, form):
    # _PROGRAM_ELEMENTS small: two heads a program, so a token's heads span programs and the last one is ragged.
    monkeypatch.setattr(rope, "_PROGRAM_ELEMENTS", 2 * shape[-1])
    q, k, cos, sin = _inputs(dtype, *shape, layout=layout, form=form)
    assert rope.takes(q, k, cos, sin, form=form) and not rope.takes(q, k, cos, sin, form=next(
        other for other in rope.FORMS if other != form))
    ours = _forward_backward(rope.FusedRoPE.apply, q, k, cos, sin, q.dtype)
    assert interpreted == [False, False, True, True]  # q and k forward, then their gradients
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    exact = _forward_backward(OWN[form], q64, k64, cos.double(), sin.double(), q.dtype)
    for name, got, want in zip(("q", "k", "dq", "dk"), ours, exact):
        assert got.dtype == dtype and got.shape == want.shape, name
        err = (got.double() - want).abs()
        if dtype == torch.float32:
            assert err.max().item() <= 1e-6, name
        else:  # the interpreter's truncation: one bf16 step (the CUDA test holds the compiled kernel to half)
            assert (err <= 2**-7 * want.abs()).all(), (name, err.max().item())
    # laid out as transformers' own result (the Llama form keeps q's strides, gpt-oss's cat is contiguous), and a
    # tensor of its own, not a view: in-place ops on it work as on transformers'
    eager = OWN[form](q.detach(), k.detach(), cos, sin)
    for got, want in zip(ours[:2], eager):  # strides of the dims of more than one element
        assert [st for st, n in zip(got.stride(), got.shape) if n > 1] == [
            st for st, n in zip(want.stride(), want.shape) if n > 1]
    q_out, k_out = rope.FusedRoPE.apply(q, k, cos, sin)
    q_out.mul_(2)
    k_out.add_(1)


def test_calls_the_kernel_does_not_take_run_the_modules_own_function(interpreted):
    q, k, cos, sin = _inputs(torch.float32, 1, 1, 4, 2, 6, 8)
    wrapped = rope._fused_form(LLAMA_FORM, "llama")
    others = {
        "partial rotary (cos over half the head)": (q, k, cos[..., :4], sin[..., :4]),
        "float64": (q.double(), k.double(), cos.double(), sin.double()),
        "cos with a gradient": (q, k, cos.clone().requires_grad_(), sin),
        "cos in another dtype": (q, k, cos.double(), sin.double()),
    }
    for why, args in others.items():
        if why.startswith("partial"):
            args_own = args
            with pytest.raises(RuntimeError):  # the Llama form itself cannot broadcast it: the same error
                LLAMA_FORM(*args_own)
            with pytest.raises(RuntimeError):
                wrapped(*args)
            continue
        assert not rope.takes(*args), why
        for got, want in zip(wrapped(*args), LLAMA_FORM(*args)):
            assert torch.equal(got, want), why
    # unsqueeze_dim=2 (q and k as [b, s, h, d]): the module's own function, positionally or by keyword
    q_bshd, k_bshd = q.transpose(1, 2), k.transpose(1, 2)
    for got, want in zip(wrapped(q_bshd, k_bshd, cos, sin, unsqueeze_dim=2), LLAMA_FORM(q_bshd, k_bshd, cos, sin, 2)):
        assert torch.equal(got, want)
    assert interpreted == []
    rope.INTERPRET_ON_CPU = False  # and on the CPU without the interpreter, nothing is taken
    assert not rope.takes(q, k, cos, sin)


def test_install_switches_llama_forms_per_module_and_the_last_undo_gives_them_back(interpreted):
    qwen_a, qwen_b, gpt_oss = build("qwen3"), build("qwen3", seed=1), build("gpt_oss")
    first, second = rope.install_fused_rope(qwen_a), rope.install_fused_rope(qwen_b)
    assert first.switched == second.switched == ["transformers.models.qwen3.modeling_qwen3"]
    assert modeling_qwen3.apply_rotary_pos_emb.ulysses_lc_original is LLAMA_FORM
    assert modeling_qwen3.apply_rotary_pos_emb.ulysses_lc_form == "llama"
    first.undo()
    assert modeling_qwen3.apply_rotary_pos_emb is not LLAMA_FORM  # the second install still holds it
    second.undo()
    assert modeling_qwen3.apply_rotary_pos_emb is LLAMA_FORM
    # gpt-oss's form: cos and sin over half the head, the same rotation
    third = rope.install_fused_rope(gpt_oss)
    assert third.switched == ["transformers.models.gpt_oss.modeling_gpt_oss"] and third.left == {}
    assert modeling_gpt_oss.apply_rotary_pos_emb.ulysses_lc_form == "half"
    third.undo()
    assert modeling_gpt_oss.apply_rotary_pos_emb is OWN["half"]


def test_a_changed_upstream_form_is_caught_at_install(monkeypatch):
    def changed(q, k, cos, sin, unsqueeze_dim=1):  # e.g. the other rotation sign
        q_embed, k_embed = LLAMA_FORM(q, k, cos, -sin, unsqueeze_dim)
        return q_embed, k_embed

    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", changed)
    handle = rope.install_fused_rope(build("qwen3"))
    assert handle.switched == [] and "differs from the llama form" in handle.left[modeling_qwen3.__name__]
    assert modeling_qwen3.apply_rotary_pos_emb is changed


# The families whose attention runs a form of rope.FORMS over the whole head: the kernel must run in them (the others
# switch a function their attention does not reach at these configs: partial rotary, or MLA's interleaved RoPE).
KERNEL_RUNS = {"HuggingFaceTB/SmolLM2-135M", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-8B", "google/gemma-3-1b-it",
               "google/gemma-3-27b-it", "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.2-3B",
               "meta-llama/Llama-3.3-70B-Instruct", "mistralai/Mistral-7B-Instruct-v0.3", "mistralai/Mistral-7B-v0.1",
               "openai/gpt-oss-20b", "openai/gpt-oss-120b"}


def test_published_configs_train_the_same_with_the_fused_rope(interpreted):
    """Every shipped config, shrunk (their RoPE types: llama3, YaRN, partial rotary, Gemma's local / global,
    composite text_config): the loss and every gradient of one step with the fused RoPE against the plain model,
    fp32, within 1e-6 of the loss and 1e-5 relative norm per gradient."""
    from tests.test_published_configs import build as build_published
    from tests.test_published_configs import sequence, shrunken_configs

    input_ids, labels = sequence()
    ran = set()
    for name, (class_name, config) in shrunken_configs().items():
        results = []
        for fused in (False, True):
            model = build_published(class_name, config)
            handle = rope.install_fused_rope(model) if fused else None
            interpreted.clear()
            extra = {"token_type_ids": torch.zeros_like(input_ids)} if model.config.model_type == "gemma3" else {}
            loss = model(input_ids=input_ids, labels=labels, **extra).loss
            loss.backward()
            if handle is not None:
                handle.undo()
                if interpreted:
                    ran.add(name)
            results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        (plain_loss, plain_grads), (loss, grads) = results
        assert abs(loss - plain_loss) <= 1e-6, name
        assert grads.keys() == plain_grads.keys(), name
        for key, want in plain_grads.items():
            err = ((grads[key] - want).norm() / want.norm().clamp_min(1e-30)).item()
            assert err <= 1e-5, (name, key, err)
    assert ran == KERNEL_RUNS


def test_the_wrapper_option_installs_it_and_trains_the_same_at_global_positions(interpreted):
    """SequenceParallelCausalLM(fused_rope=True) at sp 1, positions starting at 1000 (a later rank's slice):
    loss and every gradient against fused_rope=False, fp32, 1e-6 / 1e-5 relative norm."""
    from ulysses_lc import ParallelLayout, SequenceParallelCausalLM

    layout = ParallelLayout(world_size=1, sp_size=1)
    ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(1000, 1024).unsqueeze(0)
    results = []
    for fused in (False, True):
        model = SequenceParallelCausalLM(build("qwen3"), layout, fused_rope=fused)
        assert any(h.name == "fused RoPE" for h in model.levers) == fused
        interpreted.clear()
        loss = model(input_ids=ids, position_ids=positions, labels=ids)
        loss.backward()
        assert bool(interpreted) == fused
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        model.undo()
    (plain_loss, plain_grads), (loss, grads) = results
    assert abs(loss - plain_loss) <= 1e-6
    for key, want in plain_grads.items():
        assert ((grads[key] - want).norm() / want.norm()).item() <= 1e-5, key


def test_the_default_installs_it_where_cuda_is_and_leaves_the_cpu_alone(monkeypatch):
    """fused_rope=None (SequenceParallelCausalLM's default) means: on where CUDA is available; given, as given. On
    this machine's CPU the default leaves transformers' function in place."""
    from ulysses_lc import ParallelLayout, SequenceParallelCausalLM

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert [rope.wanted(s) for s in (None, True, False)] == [True, True, False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert [rope.wanted(s) for s in (None, True, False)] == [False, True, False]
    monkeypatch.undo()
    if torch.cuda.is_available():
        pytest.skip("the CPU default: this machine has CUDA")
    before = modeling_qwen3.apply_rotary_pos_emb
    model = SequenceParallelCausalLM(build("qwen3"), ParallelLayout(world_size=1, sp_size=1))
    try:
        assert not any(h.name == "fused RoPE" for h in model.levers)
        assert modeling_qwen3.apply_rotary_pos_emb is before
    finally:
        model.undo()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel compiled by Triton)")
@pytest.mark.parametrize("h,h_kv,d,form", [(32, 8, 128, "llama"), (16, 8, 128, "llama"), (64, 8, 64, "half")])
def test_the_compiled_kernel_on_cuda_matches_each_form(h, h_kv, d, form):
    """The Qwen3-4B, Qwen3-0.6B and gpt-oss heads at 4,096 tokens, bf16 on the GPU: within one bf16 rounding of
    float64 and never further than transformers' own bf16 result (as on the CPU, compiled this time)."""
    q, k, cos, sin = (t.cuda() if not t.requires_grad else t.detach().cuda().requires_grad_()
                      for t in _inputs(torch.bfloat16, 1, 1, h, h_kv, 4096, d, form=form))
    assert rope.takes(q, k, cos, sin, form=form)
    ours = _forward_backward(rope.FusedRoPE.apply, q, k, cos, sin, q.dtype)
    q64, k64 = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    exact = _forward_backward(OWN[form], q64, k64, cos.double(), sin.double(), q.dtype)
    theirs = _forward_backward(OWN[form], q, k, cos, sin, q.dtype)
    for name, got, want, hf in zip(("q", "k", "dq", "dk"), ours, exact, theirs):
        err = (got.double() - want).abs()
        assert (err <= 2**-8 * want.abs()).all(), (name, err.max().item())
        assert err.max().item() <= (hf.double() - want).abs().max().item(), name


def test_the_wrapper_reads_arguments_by_the_modules_own_signature(interpreted):
    """Some modules' functions take k=None (a query-only call) or position_ids before unsqueeze_dim: the wrapper binds
    a call to the original's signature and takes only q, k, cos, sin with unsqueeze_dim 1, else calls the original."""
    q, k, cos, sin = _inputs(torch.float32, 1, 1, 4, 2, 6, 8)

    def query_only(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
        return LLAMA_FORM(q, q if k is None else k, cos, sin, unsqueeze_dim)

    def with_positions(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        return LLAMA_FORM(q, k, cos, sin, unsqueeze_dim)

    wrapped = rope._fused_form(query_only, "llama")
    q_bshd = q.transpose(1, 2)
    for got, want in zip(wrapped(q_bshd, cos=cos, sin=sin, unsqueeze_dim=2), query_only(q_bshd, cos=cos, sin=sin,
                                                                                          unsqueeze_dim=2)):
        assert torch.equal(got, want)
    assert interpreted == []
    wrapped(q, k, cos, sin)  # the whole set: the kernel
    assert interpreted == [False, False]
    interpreted.clear()
    wrapped = rope._fused_form(with_positions, "llama")
    for got, want in zip(wrapped(q, k, cos, sin, torch.arange(6)), with_positions(q, k, cos, sin, torch.arange(6))):
        assert torch.equal(got, want)
    assert interpreted == []


def test_a_function_replaced_after_the_switch_is_left_to_whoever_replaced_it(interpreted, monkeypatch):
    first = rope.install_fused_rope(build("qwen3"))
    def theirs(q, k, cos, sin, unsqueeze_dim=1):  # someone else's function put in its place since
        return LLAMA_FORM(q, k, cos, sin, unsqueeze_dim)

    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb", theirs)
    second = rope.install_fused_rope(build("qwen3"))
    assert second.switched == [] and "replaced since" in second.left[modeling_qwen3.__name__]
    first.undo()
    assert modeling_qwen3.apply_rotary_pos_emb is theirs
