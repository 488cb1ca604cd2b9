"""ulysses_lc: million-token fine-tuning of Hugging Face causal LMs on DeepSpeed ZeRO-3 with Ulysses SP.

One module per idea (README.md, "How a step flows", follows a step through them):
  shape.py          ModelShape read once from the config; the package's one shape legend
  layout.py         ParallelLayout: SP/DP process groups and the DeepSpeed mpu
  sharding.py       shard_batch: shift, pad and slice one sequence for this rank
  exchange.py       the all-to-alls around attention (who sends what to whom)
  kernels.py        causal attention kernels: SDPA (cuDNN first), flash-attn, per document for packed sequences
  explicit_attention.py  SDPA's forward/backward ops called directly: kept outputs, head groups
  window_attention.py  sliding-window causal attention and attention sinks (Mistral, Gemma 3, gpt-oss), exact
  fallbacks.py      which kernel errors mean "no kernel for these inputs"; each fallback taken, for the step record
  linear_attention.py  gated DeltaNet layers (Qwen3.5, Qwen3-Next): exchange, then conv and recurrence whole (fla/torch)
  attention.py      UlyssesAttention / install_ulysses_attention: exchange + kernel, registered with transformers
  recompute.py      RecomputeContext: which checkpointed layer is running, handed from checkpointing to attention
  checkpointing.py  install_checkpointing: per-layer checkpoints, what is offloaded and when
  host_pool.py      pinned host buffers and the side-stream round trip through them
  tiled_mlp.py      install_tiled_mlp: the MLP over sequence tiles
  rmsnorm.py        install_efficient_rmsnorm: RMSNorm saving its bf16 input
  chunked_loss.py   chunked_cross_entropy / install_chunked_loss_head: no [tokens x vocab] logits
  loss.py           sp_mean_loss: the sequence's mean loss over the SP group
  preference.py     DPO / IPO: pairs packed as two documents, completion log-probs in chunks, the loss, references
  memory.py         plan_memory -> MemoryPlan: what each layer keeps, from free device and host memory
  memory_model.py   what a step holds per rank, in terms fitted to measured H200 peaks (the planner's prices)
  sizing.py         Job: predicted memory per rank, whether it fits, the longest sequence, the step time
  model.py          SequenceParallelCausalLM: all of the above around a HF model; plan_step, plain names
  yarn.py           apply_yarn: YaRN RoPE scaling in the config, before weights load
  ds_config.py      DeepSpeed config checks
  hf_trainer.py     UlyssesTrainer: the same step inside transformers' Trainer or TRL's SFTTrainer
  trainer_engine.py the Trainer's DeepSpeed engine gets our mpu (accelerate's initialize reached, the engine checked)
  hf_dpo.py         ulysses_trainer(DPOTrainer): TRL's DPO rows as packed pairs, its loss on SP log-probabilities
  distributed.py    init_distributed: one process-group start for deepspeed, torchrun, accelerate and plain python
Every install_* returns a Handle whose undo() gives the model back as it was. The main job that strings them
together (flags, checks, loop, checkpoints, export) is `ulysses_lc.train`.
"""

from .attention import UlyssesAttention, check_model_for_ulysses, install_ulysses_attention
from .checkpointing import CheckpointHandle, install_checkpointing
from .chunked_loss import ChunkedLossHead, chunked_cross_entropy, install_chunked_loss_head
from .constants import IGNORE_INDEX
from .data import TokenStream, build_token_stream
from .ds_config import check_deepspeed_config, load_deepspeed_config
from .handle import Handle
from .explicit_attention import attention_head_groups
from .layout import ParallelLayout, reduce_gradients, valid_sp_sizes
from .linear_attention import install_linear_attention
from .loss import sp_mean_loss
from .memory import MemoryPlan, plan_memory, plan_step_memory
from .preference import PreferenceBatch, PreferenceLoss, reference_log_probs, shard_pairs
from .metrics import StepLogger, model_flops_per_step
from .model import SequenceParallelCausalLM
from .recompute import LayerRun, RecomputeContext
from .rmsnorm import install_efficient_rmsnorm
from .shape import ModelShape
from .sharding import ShardedBatch, document_lengths_from_positions, shard_batch
from .tiled_mlp import TiledMLP, install_tiled_mlp
from .yarn import apply_yarn, load_model_for_length, yarn_rope_parameters

__all__ = [
    "IGNORE_INDEX",
    "CheckpointHandle",
    "ChunkedLossHead",
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
    "build_token_stream",
    "check_deepspeed_config",
    "check_model_for_ulysses",
    "chunked_cross_entropy",
    "document_lengths_from_positions",
    "install_checkpointing",
    "install_chunked_loss_head",
    "install_efficient_rmsnorm",
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
    "valid_sp_sizes",
    "yarn_rope_parameters",
]
