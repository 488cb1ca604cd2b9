"""ulysses_lc: million-token fine-tuning of Hugging Face causal LMs on DeepSpeed ZeRO-3 with Ulysses SP.

Each lever is a library call (see examples/embed_in_your_loop.py):
  ParallelLayout            SP/DP process groups and the DeepSpeed mpu         (layout.py)
  UlyssesAttention          all-to-all attention, registered with transformers (attention.py)
  shard_batch               shift, pad and slice one sequence for this rank    (sharding.py)
  sp_mean_loss              the sequence's mean loss over the SP group          (loss.py)
  chunked_cross_entropy     loss without [tokens x vocab] logits               (chunked_loss.py)
  apply_yarn                YaRN RoPE scaling for a target length              (yarn.py)
  enable_checkpointing      checkpointing with inputs offloaded to the host    (offload.py)
  install_tiled_mlp         the MLP over sequence tiles                        (tiled_mlp.py)
  SequenceParallelCausalLM  all of the above around a HF model                 (model.py)
The main job that strings them together (flags, checks, loop, checkpoints, export) is `ulysses_lc.train`.
"""

from .attention import UlyssesAttention, attention_head_groups, check_model_for_ulysses
from .chunked_loss import ChunkedLossHead, chunked_cross_entropy, install_chunked_loss_head
from .constants import IGNORE_INDEX
from .data import TokenStream, build_token_stream
from .ds_config import check_deepspeed_config, load_deepspeed_config
from .layout import ParallelLayout, reduce_gradients, valid_sp_sizes
from .loss import sp_mean_loss
from .metrics import StepLogger, model_flops_per_step
from .model import SequenceParallelCausalLM
from .offload import enable_checkpointing
from .sharding import ShardedBatch, shard_batch
from .tiled_mlp import TiledMLP, install_tiled_mlp
from .yarn import apply_yarn, load_model_for_length, yarn_rope_parameters

__all__ = [
    "IGNORE_INDEX",
    "ChunkedLossHead",
    "ParallelLayout",
    "SequenceParallelCausalLM",
    "ShardedBatch",
    "StepLogger",
    "TiledMLP",
    "TokenStream",
    "UlyssesAttention",
    "apply_yarn",
    "attention_head_groups",
    "build_token_stream",
    "check_deepspeed_config",
    "check_model_for_ulysses",
    "chunked_cross_entropy",
    "enable_checkpointing",
    "install_chunked_loss_head",
    "install_tiled_mlp",
    "load_deepspeed_config",
    "load_model_for_length",
    "model_flops_per_step",
    "reduce_gradients",
    "shard_batch",
    "sp_mean_loss",
    "valid_sp_sizes",
    "yarn_rope_parameters",
]
