"""The Trainer's DeepSpeed engine gets our mpu: accelerate's `deepspeed.initialize` call is reached while the Trainer
trains (`deepspeed_initialize_with_mpu`), and the engine it built is checked at the first step (`check_engine_mpu`)."""

from __future__ import annotations

import contextlib

from ..parallel.ds_config import check_deepspeed_config
from ..parallel.layout import ParallelLayout


@contextlib.contextmanager
def deepspeed_initialize_with_mpu(layout: ParallelLayout):
    """While inside, `deepspeed.initialize` gets `layout.mpu` and a train_batch_size counted over the DP axis.

    accelerate calls `deepspeed.initialize` itself and passes an mpu only on its own sequence-parallel path
    (DeepSpeed's attention and dataloader adapter); this is the one call we need to reach. Re-entrant; the
    original function is back on leaving.
    """
    import deepspeed

    original = deepspeed.initialize
    if getattr(original, "_ulysses_lc_layout", None) is not None:
        yield
        return

    def initialize(*args, mpu=None, config=None, config_params=None, **kwargs):
        if mpu is not None:
            raise ValueError("deepspeed.initialize got another mpu (accelerate's sequence parallelism?); ulysses_lc "
                             "brings its own: remove parallelism_config from the TrainingArguments.")
        ds_config = config if config is not None else config_params
        if isinstance(ds_config, dict):
            ds_config = {k: v for k, v in ds_config.items() if k != "train_batch_size"}
            ds_config = check_deepspeed_config(ds_config, layout)
        return original(*args, mpu=layout.mpu, config=ds_config, **kwargs)

    initialize._ulysses_lc_layout = layout
    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def check_engine_mpu(engine, layout: ParallelLayout) -> None:
    """RuntimeError unless the DeepSpeed engine the Trainer trains holds `layout.mpu` (an mpu of this layout).
    `deepspeed_initialize_with_mpu` reaches accelerate's call only because accelerate looks `deepspeed.initialize` up
    at call time; an engine built without our mpu would reduce gradients and shard ZeRO-3 over the whole world, SP
    ranks included."""
    if getattr(getattr(engine, "mpu", None), "layout", None) is not layout:  # layout.mpu makes a DeepSpeedMPU of it
        raise RuntimeError(
            f"the DeepSpeed engine ({type(engine).__name__}) was initialised without ulysses_lc's mpu (it holds "
            f"{getattr(engine, 'mpu', None)!r}): gradients would be averaged over the ranks of one sequence. The "
            "accelerate in use no longer calls deepspeed.initialize where UlyssesTrainer reaches it; report it "
            "with the accelerate and transformers versions.")


__all__ = ["check_engine_mpu", "deepspeed_initialize_with_mpu"]
