"""The run's end product: a consolidated Hugging Face model folder (weights, config with YaRN, tokenizer); for a LoRA
run the adapter folder peft loads (adapter_config.json, adapter_model.safetensors, the config with YaRN the base
must be loaded with), and with --export-merged the adapters merged into the base weights in `merged/`. A multimodal
checkpoint comes back as its own class and files, its language model trained (composite.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..composite import save_model
from ..parallel.layout import ParallelLayout
from ..model import SequenceParallelCausalLM
from ..peft_support import base_model, is_peft_model, merged_model

EXPORT_DIR = "hf_export"
MERGED_DIR = "merged"


def gather_state_dict(module: torch.nn.Module, rank0: bool, trainable_only: bool = False) -> dict[str, torch.Tensor] | None:
    """The full state dict of `module` on the host of rank 0 (None elsewhere), one module's parameters at a time
    (`trainable_only`: the parameters that train, no buffers: a LoRA run's adapters, not the frozen base).

    Collective under ZeRO-3: every rank must call it. deepspeed.zero.GatheredParameters assembles each
    module's partitioned parameters and frees them again on leaving, so no rank ever holds more than one
    module's full weights on the device; plain (not partitioned) parameters pass through unchanged.
    Tied parameters stay tied: the second name points at the first name's tensor.
    """
    import deepspeed

    state = {} if rank0 else None
    first_name: dict[int, str] = {}
    persistent = set(module.state_dict(keep_vars=True))  # state_dict leaves non-persistent buffers out
    for prefix, sub in module.named_modules():
        params = [(n, p) for n, p in sub.named_parameters(recurse=False) if p.requires_grad or not trainable_only]
        with deepspeed.zero.GatheredParameters([p for _, p in params], modifier_rank=None):
            if not rank0:
                continue
            for name, p in params:
                key = f"{prefix}.{name}" if prefix else name
                if id(p) in first_name:
                    state[key] = state[first_name[id(p)]]
                else:
                    # A copy: on leaving the context the gathered storage is released (on CPU, .cpu() would alias it).
                    state[key] = p.detach().to("cpu", copy=True)
                    first_name[id(p)] = key
            for name, buf in [] if trainable_only else sub.named_buffers(recurse=False):
                key = f"{prefix}.{name}" if prefix else name
                if buf is not None and key in persistent:
                    state[key] = buf.detach().to("cpu", copy=True)
    return state


def export_hf_model(engine, model: SequenceParallelCausalLM, tokenizer, export_dir: Path, layout: ParallelLayout,
                    merged: bool = False):
    """Write a consolidated Hugging Face model (the trained dtype's weights, config with its YaRN rope_parameters);
    for a PeftModel the adapter (peft's save_pretrained) and the config its base is loaded with, and with `merged`
    also the adapters merged into the base weights in `export_dir / "merged"`.

    Collective: every rank must call it (ZeRO-3 gathers the partitioned weights to rank 0).
    """
    peft = is_peft_model(model.model)
    state = gather_state_dict(engine.module, layout.rank == 0, trainable_only=peft and not merged)
    if layout.rank == 0:
        state = model.plain_state_dict(state)
        model.undo()  # the plain attention implementation, LM head and MLP modules in the saved config
        save_model(model.model, state, export_dir)
        tokenizer.save_pretrained(export_dir)
        if peft:
            # The base must be loaded with this config (YaRN): AutoConfig.from_pretrained(export_dir) reads it.
            base_model(model.model).config.save_pretrained(export_dir)
        if peft and merged:
            plain = merged_model(model.model, state)
            save_model(plain, plain.state_dict(), export_dir / MERGED_DIR)
            tokenizer.save_pretrained(export_dir / MERGED_DIR)
    torch.distributed.barrier()
