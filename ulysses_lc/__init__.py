"""ulysses_lc: million-token fine-tuning of Hugging Face causal LMs on DeepSpeed ZeRO-3 with Ulysses SP."""

from .attention import UlyssesAttention, check_model_for_ulysses
from .constants import IGNORE_INDEX
from .layout import ParallelLayout, reduce_gradients, valid_sp_sizes
from .loss import sp_mean_loss
from .model import SequenceParallelCausalLM
from .sharding import ShardedBatch, shard_batch

__all__ = [
    "IGNORE_INDEX",
    "ParallelLayout",
    "SequenceParallelCausalLM",
    "ShardedBatch",
    "UlyssesAttention",
    "check_model_for_ulysses",
    "reduce_gradients",
    "shard_batch",
    "sp_mean_loss",
    "valid_sp_sizes",
]
