"""ulysses_lc: million-token fine-tuning of Hugging Face causal LMs on DeepSpeed ZeRO-3 with Ulysses SP.

The package is laid out by what each part is, lowest floor first; a floor imports only the floors below it
(tests/test_structure.py holds the rule). README.md, "How a step flows", follows one step through them.

  ground         constants, handle (what every install_* returns), layers (where a model keeps its decoder
                 layers), shape (ModelShape, read once from the config), composite (the language model of a
                 multimodal checkpoint, and its export in the checkpoint's own files), recompute (the checkpointing
                 <-> attention channel), peft_support, tiny (the tiny model and text of the embedded default)
  parallel/      process groups and data placement: distributed, layout, sharding, exchange, zero_reshard, ds_config
  mixers/        what runs on the whole sequence after the exchange: attention, kernels, explicit_attention,
                 window_attention, linear_attention, fallbacks
  levers/        the memory levers: chunked_loss, checkpointing, host_pool, tiled_mlp, rmsnorm, yarn
  objectives/    what a step minimises over the SP group: loss, router_loss (MoE), preference (DPO / IPO)
  plan/          the sizing model: memory, memory_model, sizing, metrics
  data/          the token stream: sources, tokenize, cache, packing, pairs
  model.py       SequenceParallelCausalLM: the pieces around a HF model; plan_step, plain names
  integrations/  transformers' Trainer, TRL's SFT and DPO trainers, accelerate's engine
  eval/          evaluation at length: loss by position bucket, passkey retrieval by depth, ulysses-lc-eval
  train/         the main job: flags resolved into each part's settings, checks, loop, checkpoints, export

Every install_* returns a Handle whose undo() gives the model back as it was. The names below are the public
face; the flat paths of before (ulysses_lc.exchange, ...) still import, as aliases (ulysses_lc/moved.py).
"""

from . import moved

moved.install()

from .constants import IGNORE_INDEX  # noqa: E402
from .data import TokenStream, build_token_stream  # noqa: E402
from .eval import EvalResult, build_haystacks, evaluate  # noqa: E402
from .handle import Handle  # noqa: E402
from .levers.checkpointing import CheckpointHandle, install_checkpointing  # noqa: E402
from .levers.chunked_loss import ChunkedLossHead, chunked_cross_entropy, install_chunked_loss_head  # noqa: E402
from .levers.rmsnorm import install_efficient_rmsnorm  # noqa: E402
from .levers.rope import install_fused_rope  # noqa: E402
from .levers.tiled_mlp import TiledMLP, install_tiled_mlp  # noqa: E402
from .levers.yarn import apply_yarn, load_model_for_length, yarn_rope_parameters  # noqa: E402
from .mixers.attention import UlyssesAttention, check_model_for_ulysses, install_ulysses_attention  # noqa: E402
from .mixers.explicit_attention import attention_head_groups  # noqa: E402
from .mixers.linear_attention import install_linear_attention  # noqa: E402
from .model import SequenceParallelCausalLM  # noqa: E402
from .objectives.loss import sp_mean_loss, step_num_items  # noqa: E402
from .objectives.preference import PreferenceBatch, PreferenceLoss, reference_log_probs, shard_pairs  # noqa: E402
from .parallel.distributed import destroy_distributed, init_distributed  # noqa: E402
from .parallel.ds_config import check_deepspeed_config, load_deepspeed_config  # noqa: E402
from .parallel.layout import ParallelLayout, reduce_gradients, valid_sp_sizes  # noqa: E402
from .parallel.sharding import ShardedBatch, document_lengths_from_positions, shard_batch  # noqa: E402
from .peft_support import lora_config  # noqa: E402
from .plan.memory import MemoryPlan, plan_memory, plan_step_memory  # noqa: E402
from .plan.metrics import StepLogger, model_flops_per_step  # noqa: E402
from .recompute import LayerRun, RecomputeContext  # noqa: E402
from .shape import ModelShape  # noqa: E402

# The integrations import transformers' Trainer (and TRL where asked): loaded on first use, not with the package.
_LAZY = {"UlyssesTrainer": "hf_trainer", "UlyssesSFTTrainer": "hf_trainer", "ulysses_trainer": "hf_trainer"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".integrations.{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'ulysses_lc' has no attribute {name!r}")


__all__ = [
    "UlyssesTrainer",
    "UlyssesSFTTrainer",
    "ulysses_trainer",
    "init_distributed",
    "destroy_distributed",
    "lora_config",
    "IGNORE_INDEX",
    "CheckpointHandle",
    "ChunkedLossHead",
    "EvalResult",
    "Handle",
    "LayerRun",
    "MemoryPlan",
    "ModelShape",
    "ParallelLayout",
    "PreferenceBatch",
    "PreferenceLoss",
    "RecomputeContext",
    "SequenceParallelCausalLM",
    "ShardedBatch",
    "StepLogger",
    "TiledMLP",
    "TokenStream",
    "UlyssesAttention",
    "apply_yarn",
    "attention_head_groups",
    "build_haystacks",
    "build_token_stream",
    "check_deepspeed_config",
    "check_model_for_ulysses",
    "chunked_cross_entropy",
    "document_lengths_from_positions",
    "evaluate",
    "install_checkpointing",
    "install_chunked_loss_head",
    "install_efficient_rmsnorm",
    "install_fused_rope",
    "install_linear_attention",
    "install_tiled_mlp",
    "install_ulysses_attention",
    "load_deepspeed_config",
    "load_model_for_length",
    "model_flops_per_step",
    "plan_memory",
    "plan_step_memory",
    "reduce_gradients",
    "reference_log_probs",
    "shard_batch",
    "shard_pairs",
    "sp_mean_loss",
    "step_num_items",
    "valid_sp_sizes",
    "yarn_rope_parameters",
]
