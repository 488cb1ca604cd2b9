"""The first optimizer step's gradients as ZeRO-3 reduced them, and their comparison with a reference's."""

import contextlib

GRAD_RTOL = 1e-4  # relative norm of each parameter's gradient error


@contextlib.contextmanager
def first_step_grads(record):
    """Patch the engine's step (test only, undone on exit) to keep the full gradients of the first optimizer step in
    record["grads"] (names as the engine's module gives them), as ZeRO-3 reduced them over every micro step: taken at
    the first accumulation boundary, before the step clips and applies them."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import safe_get_full_grad

    original = DeepSpeedEngine.step

    def step(engine, *args, **kwargs):
        # Collective: every rank gathers every gradient.
        if "grads" not in record and engine.is_gradient_accumulation_boundary():
            record["grads"] = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()
                               if p.requires_grad}
        return original(engine, *args, **kwargs)

    DeepSpeedEngine.step = step
    try:
        yield
    finally:
        DeepSpeedEngine.step = original


def train_first_step(rank, world_size, cfgs):
    """A run_shared body: each TrainConfig trained by the main job, with its first step's gradients (names under
    SequenceParallelCausalLM). Returns [(records, grads)] in the order of cfgs."""
    from ulysses_lc.train import train

    out = []
    for cfg in cfgs:
        record = {}
        with first_step_grads(record):
            records = train(cfg)
        out.append((records, record["grads"]))
    return out


def assert_grads_close(grads, ref, rtol=GRAD_RTOL):
    assert grads.keys() == ref.keys()
    for name, g in ref.items():
        err = (grads[name] - g).norm() / g.norm().clamp(min=1e-12)
        assert err <= rtol, f"{name}: relative gradient error {err:.2e}"
