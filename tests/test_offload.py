"""Checkpointing with host offload vs transformers' own non-reentrant checkpointing and vs none.

Shape legend: b batch, s sequence, h hidden.
Offload vs checkpointing: bitwise (torch.equal), since the copies are exact.
Checkpointing vs no checkpointing: fp32 rtol 1e-6 / atol 1e-7 (same ops recomputed; the
only freedom is kernel choice, and in practice these match exactly too).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

from ulysses_lc.levers.checkpointing import install_checkpointing

B, S, H, LAYERS = 2, 16, 32, 3


def _model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=128, hidden_size=H, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.train()
    return model


def _input_ids(device="cpu"):
    return torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(1)).to(device)


def _loss_and_grads(model, input_ids):
    logits = model(input_ids=input_ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), input_ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _hf_checkpointed(model, input_ids):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # renamed entry point in transformers 5.24
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        return _loss_and_grads(model, input_ids)
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model.gradient_checkpointing_disable()


@pytest.fixture(scope="module")
def references():
    model = _model()
    input_ids = _input_ids()
    plain = _loss_and_grads(model, input_ids)
    ckpt = _hf_checkpointed(model, input_ids)
    return plain, ckpt


@pytest.mark.parametrize("keep_on_gpu", [0, 1, LAYERS])
def test_offload_bitwise_equal_to_checkpointing(references, keep_on_gpu):
    (plain_loss, plain_grads), (ckpt_loss, ckpt_grads) = references
    model = _model()
    handle = install_checkpointing(model, offload=True, keep_on_gpu=keep_on_gpu, min_offload_bytes=0)
    loss, grads = _loss_and_grads(model, _input_ids())

    assert torch.equal(loss, ckpt_loss)
    assert list(grads) == list(ckpt_grads)
    for name, grad in grads.items():
        assert torch.equal(grad, ckpt_grads[name]), name
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-6, atol=1e-7, msg=name)
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7)

    # Exactly one layer input [b, s, h] fp32 per offloaded layer went to the host.
    assert handle.host_bytes == (LAYERS - keep_on_gpu) * B * S * H * 4
    assert handle.report()["offloaded_layers"] == LAYERS - keep_on_gpu


def test_without_offload_matches_checkpointing(references):
    _, (ckpt_loss, ckpt_grads) = references
    model = _model()
    handle = install_checkpointing(model, offload=False)
    loss, grads = _loss_and_grads(model, _input_ids())
    assert torch.equal(loss, ckpt_loss)
    assert all(torch.equal(grads[n], ckpt_grads[n]) for n in grads)
    assert handle.host_bytes == 0


def test_backward_reads_the_host_copy(references):
    """Scaling the host copies between forward and backward must change the gradients."""
    _, (_, ckpt_grads) = references
    model = _model()
    handle = install_checkpointing(model, offload=True, min_offload_bytes=0)
    input_ids = _input_ids()
    logits = model(input_ids=input_ids, use_cache=False).logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), input_ids[:, 1:].reshape(-1))
    saved = handle._last_saved()
    while saved is not None:
        for host in saved.host:
            host.mul_(2.0)
        saved = saved.prev
    loss.backward()
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.allclose(dict(model.named_parameters())[name].grad, ckpt_grads[name])


def test_small_tensors_stay_and_second_step_recounts():
    model = _model()
    handle = install_checkpointing(model, offload=True)  # default 256 KiB threshold > 4 KiB inputs
    _loss_and_grads(model, _input_ids())
    assert handle.host_bytes == 0

    handle.undo()
    handle = install_checkpointing(model, offload=True, min_offload_bytes=0)
    for _ in range(2):
        _loss_and_grads(model, _input_ids())
        assert handle.host_bytes == LAYERS * B * S * H * 4


def test_undo_restores_model(references):
    (plain_loss, plain_grads), _ = references
    model = _model()
    layer_cls = type(model.model.layers[0])
    handle = install_checkpointing(model, offload=True, min_offload_bytes=0)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    handle.undo()
    for layer in model.model.layers:
        assert "_gradient_checkpointing_func" not in layer.__dict__
        assert "gradient_checkpointing" not in layer.__dict__
        assert layer.gradient_checkpointing is layer_cls.gradient_checkpointing is False
    handle.host_bytes = 0
    loss, grads = _loss_and_grads(model, _input_ids())
    assert handle.host_bytes == 0
    assert torch.equal(loss, plain_loss)


def test_bad_arguments():
    model = _model()
    with pytest.raises(ValueError, match="keep_on_gpu"):
        install_checkpointing(model, keep_on_gpu=LAYERS + 1)
    with pytest.raises(ValueError, match="use_reentrant"):
        install_checkpointing(model, checkpoint_kwargs={"use_reentrant": True})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host memory and side-stream copies")
@pytest.mark.parametrize("keep_on_gpu", [0, 1])
def test_cuda_offload_bitwise_equal(keep_on_gpu):
    model = _model().cuda()
    input_ids = _input_ids("cuda")
    ckpt_loss, ckpt_grads = _hf_checkpointed(model, input_ids)
    handle = install_checkpointing(model, offload=True, keep_on_gpu=keep_on_gpu, min_offload_bytes=0)
    for _ in range(2):
        loss, grads = _loss_and_grads(model, input_ids)
        assert torch.equal(loss, ckpt_loss)
        assert all(torch.equal(grads[n], ckpt_grads[n]) for n in grads)
    assert handle.pinned and handle.host_bytes == (LAYERS - keep_on_gpu) * B * S * H * 4


def test_partial_recompute_matches_plain():
    # recompute_layers=1 of 3: layer 0 checkpointed and offloaded, layers 1-2 keep their activations.
    ids = _input_ids()
    ref_model = _model()
    ref_loss = ref_model(input_ids=ids, labels=ids).loss
    ref_loss.backward()
    model = _model()
    handle = install_checkpointing(model, offload=True, min_offload_bytes=0, recompute_layers=1)
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, False]
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert handle.host_bytes == B * S * H * 4 and handle.report()["plain_layers"] == 2
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="keep_on_gpu=2 must be in"):
        handle.configure(recompute_layers=1, keep_on_gpu=2)


def test_memory_plan_arithmetic():
    from transformers import Qwen3Config

    from tests.test_kept_attention import _plan

    shape = Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                        num_key_value_heads=8, head_dim=128, vocab_size=151936)
    # Without kept attention outputs (keep_attention=False; tests/test_kept_attention.py has the default). The
    # counts are the fitted memory model's (memory_model.py, held to measured H200 peaks by
    # tests/test_memory_prediction.py): 1M tokens on one H200 with ~120 GB free (5% allocator slack: one GPU, a dense
    # shape): 3 layers skip the recompute, 8 checkpointed inputs stay on the device.
    assert _plan(shape, 1 << 20, 120e9, keep_attention=False).counts == (25, 8, 0)
    # The attention kernel over one call instead of 8 head groups: its backward block is 17.2 GB instead of
    # 2.1 GB, so the room of 7 inputs on the device goes to it.
    assert _plan(shape, 1 << 20, 120e9, keep_attention=False, head_groups=1).counts == (25, 1, 0)
    # At sp 2 a rank plans for its 512k tokens: more layers skip the recompute.
    assert _plan(shape, 1 << 19, 120e9, keep_attention=False, sp_size=2).counts == (23, 10, 0)
    # 128k tokens: every layer skips the recompute.
    assert _plan(shape, 1 << 17, 120e9, keep_attention=False).counts == (0, 0, 0)
    # No room beyond one layer's working set: recompute and offload everything.
    assert _plan(shape, 1 << 20, 10e9, keep_attention=False).counts == (28, 0, 0)


def test_release_cached_memory_comes_at_each_recompute_and_attention_backward_and_changes_nothing(
        references, monkeypatch):
    """release_cached_memory: torch.cuda.empty_cache once at each checkpointed layer's recompute and once before its
    attention backward (the layer's peaks), not in the forward, not for plain layers; gradients bitwise as without.
    Off CUDA the call is a no-op, so the test counts the calls the handle makes through a stand-in."""
    import ulysses_lc.levers.cached_memory as cached_memory

    _, (ckpt_loss, ckpt_grads) = references
    events = []
    monkeypatch.setattr(cached_memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cached_memory.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cached_memory.torch.cuda, "empty_cache", lambda: events.append("release"))
    model = _model()
    handle = install_checkpointing(model, offload=True, min_offload_bytes=0, recompute_layers=2)
    for layer in model.model.layers:  # the order the calls come in: recompute (forward hook), attention backward
        layer.self_attn.register_forward_hook(lambda *_: events.append("attention"))
    handle.configure(release_cached_memory=True)
    input_ids = _input_ids()
    logits = model(input_ids=input_ids, use_cache=False).logits
    assert "release" not in events  # nothing in the forward
    events.clear()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 128), input_ids[:, 1:].reshape(-1))
    loss.backward()
    # Layers 1 then 0 (checkpointed; layer 2 plain): a release before each recompute's attention forward, then one
    # before its attention backward.
    assert events == ["release", "attention", "release"] * 2, events
    assert handle.report()["released_cached_memory"] == 4
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert torch.equal(loss.detach(), ckpt_loss)
    assert all(torch.equal(grads[n], ckpt_grads[n]) for n in grads)
    events.clear()
    handle.configure(release_cached_memory=False)
    model.zero_grad(set_to_none=True)
    _loss_and_grads(model, input_ids)
    assert "release" not in events and handle.report()["released_cached_memory"] == 0
