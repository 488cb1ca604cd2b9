"""Weight decay as Hugging Face's Trainer applies it (issue 40, item 6): the groups, and one step of the main job.

The groups are compared with `Trainer.get_decay_parameter_names` on the plain model (norm weights and biases exempt,
found by name), with ulysses_lc's levers installed (the bf16-saving RMSNorm, the tiled MLP), and with LoRA (peft's
model under the same rule). One step of the main job with a large --weight-decay, with the client torch AdamW
(zero3) and DeepSpeed's CPU Adam (zero3_offload_optimizer), must give the weights of torch's AdamW over the Trainer's
groups on the plain model from the same gradients: 1e-6 absolute on weights of order 1, where decaying a norm weight
would move it by lr x wd = 5e-3.
"""

import os
from dataclasses import replace

import pytest
import torch

from tests._dist import run_shared
from tests._grads import train_first_step
from tests.models import build
from ulysses_lc import ParallelLayout
from ulysses_lc.model import SequenceParallelCausalLM
from ulysses_lc.train import TrainConfig
from ulysses_lc.train.optimizer import NO_DECAY, param_groups

os.environ.setdefault("HF_HUB_OFFLINE", "1")

WEIGHT_ATOL = 1e-6


def trainer_decay_names(model) -> set[str]:
    from transformers import Trainer

    return set(Trainer.get_decay_parameter_names(None, model))  # the method reads nothing of the Trainer


def group_names(wrapper, groups) -> list[set[str]]:
    names = {id(p): SequenceParallelCausalLM.plain_name(n) for n, p in wrapper.named_parameters()}
    return [{names[id(p)] for p in group["params"]} for group in groups]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gpt_oss", "gemma3"])
def test_groups_are_the_trainers(family):
    plain = build(family)
    names = {n for n, _ in plain.named_parameters()}  # a tied head is listed once, as its embedding
    decayed = trainer_decay_names(plain) & names
    wrapper = SequenceParallelCausalLM(build(family), ParallelLayout(1, 1))  # every lever on, as the main job
    groups = param_groups(wrapper, 0.1)
    assert [(g["weight_decay"], g.get(NO_DECAY, False)) for g in groups] == [(0.1, False), (0.0, True)]
    decay, exempt = group_names(wrapper, groups)
    assert decay == decayed and exempt == names - decayed
    # What the rule is for: every norm weight (the patched RMSNorms included) and every bias is exempt.
    norms = {f"{m}.{p}" for m, module in plain.named_modules() if "Norm" in type(module).__name__
             for p, _ in module.named_parameters()}
    biases = {n for n, _ in plain.named_parameters() if n.endswith("bias")}
    assert norms and norms | biases <= exempt, (norms | biases) - exempt
    assert any(type(m).__name__.endswith("RMSNorm") and "forward" in m.__dict__ for m in wrapper.modules())
    if family == "gpt_oss":
        assert biases  # the family with biases


def test_lora_groups_are_the_trainers():
    from peft import LoraConfig, get_peft_model

    # The main job's adapters (peft_support.lora_config) and a trained copy of the final norm (modules_to_save).
    config = LoraConfig(r=2, target_modules=["q_proj", "v_proj", "up_proj"], modules_to_save=["norm"],
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(build("qwen3"), config)
    trainable = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    decayed = trainer_decay_names(peft_model) & trainable
    wrapper = SequenceParallelCausalLM(peft_model, ParallelLayout(1, 1))
    decay, exempt = group_names(wrapper, param_groups(wrapper, 0.1))
    assert decay == decayed and exempt == trainable - decayed
    assert decay and all(".lora_A." in n or ".lora_B." in n for n in decay)
    assert exempt and all(n.endswith("norm.modules_to_save.default.weight") for n in exempt), exempt


def reference_step(grads, lr, weight_decay, clip=1.0):
    """The plain model after one step of torch's AdamW over the Trainer's groups, from `grads` (plain names),
    clipped to `clip` as DeepSpeed clips (the shipped configs' gradient_clipping)."""
    from transformers import AutoModelForCausalLM

    from ulysses_lc.tiny import tiny_model_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_model_config())  # the main job's weights for seed 0
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    scale = max(1.0, (float(norm) + 1e-6) / clip)
    for name, p in model.named_parameters():
        p.grad = grads[name] / scale
    params = list(model.named_parameters())
    decayed = trainer_decay_names(model)
    torch.optim.AdamW([{"params": [p for n, p in params if n in decayed], "weight_decay": weight_decay},
                       {"params": [p for n, p in params if n not in decayed], "weight_decay": 0.0}],
                      lr=lr, eps=1e-8).step()
    return {n: p.detach() for n, p in model.state_dict().items()}


@pytest.mark.cpu_adam
def test_one_step_decays_as_the_trainer(tmp_path):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    base = TrainConfig(model="tiny", data="tiny", seq_len=256, steps=1, lr=1e-2, weight_decay=0.5, warmup_steps=1,
                       cache_dir=str(tmp_path / "cache"), export=False)
    cfgs = [replace(base, output_dir=str(tmp_path / name), ds_config=name)
            for name in ("zero3", "zero3_offload_optimizer")]
    results = run_shared(train_first_step, 2, cfgs, kind="deepspeed")[0]
    for cfg, (_, grads) in zip(cfgs, results):
        grads = {SequenceParallelCausalLM.plain_name(n): g for n, g in grads.items()}
        ref = reference_step(grads, cfg.lr, cfg.weight_decay)
        state = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / cfg.ds_config / "checkpoints"))
        state = {SequenceParallelCausalLM.plain_name(k): v for k, v in state.items()}
        for name, weight in state.items():
            torch.testing.assert_close(weight, ref[name], rtol=0, atol=WEIGHT_ATOL,
                                       msg=lambda m: f"{cfg.ds_config} {name}: {m}")
        assert any("norm" in name for name in state)
