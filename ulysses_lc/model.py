"""The training model: a Hugging Face causal LM whose forward returns the SP-reduced loss.

`SequenceParallelCausalLM` is what goes into `deepspeed.initialize`: its forward takes a ShardedBatch's
tensors, runs the decoder (with Ulysses attention when sp_size > 1), and computes the loss from hidden
states, so the [tokens x vocab] logits are never built when the chunked loss head is installed. Running
the loss inside the engine's forward keeps every ZeRO-3 hook (parameter gather before use, release after,
re-gather before backward) in charge of the LM head as of any other layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import UlyssesAttention
from .chunked_loss import ChunkedLossHead, install_chunked_loss_head
from .constants import IGNORE_INDEX
from .layout import ParallelLayout
from .loss import sp_mean_loss
from .offload import enable_checkpointing
from .rmsnorm import install_memory_efficient_rmsnorm
from .tiled_mlp import install_tiled_mlp


def plain_loss_sum(logits_bsv: torch.Tensor, labels_bs: torch.Tensor):
    """(summed fp32 cross-entropy, valid-label count) from full logits; labels already shifted."""
    loss_sum = F.cross_entropy(
        logits_bsv.float().flatten(0, 1), labels_bs.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (labels_bs != IGNORE_INDEX).sum()


class SequenceParallelCausalLM(nn.Module):
    """Wraps `model` (a transformers *ForCausalLM) for sequence-parallel training over `layout`.

    forward(input_ids, position_ids, labels) -> loss: mean over the valid tokens of the whole sequence
    (all SP ranks), identical on each of them; `last_num_tokens` holds the valid-token count (a device
    tensor, read it after the step). The wrapped model stays a normal HF model (`.model`): save or
    export it as usual, after `undo()` if you want the plain modules back.

    The memory levers, each exact, are on by default; build this wrapper before `deepspeed.initialize`
    (ZeRO-3 registers its hooks on the modules as they are then):
      chunked_loss: loss from hidden states in row chunks, never the [tokens x vocab] logits (True =
        automatic chunk rows, or an int).
      tiled_mlp: each MLP runs over sequence tiles (None = automatic tile count, or an int).
      checkpointing: non-reentrant activation checkpointing of the first `recompute_layers` decoder layers
        (default all; `self.checkpointing.configure` changes the plan later).
      offload: checkpointed layer inputs wait in host memory, except the last `keep_on_gpu` layers
        (and tensors under `min_offload_bytes`).
      cache_attention_layers: the last this-many checkpointed layers keep their attention output from the
        forward (with their input: on the host when offloaded), so their recompute skips the attention
        kernel (off by default here: it costs 2 x heads x head_dim bytes per token and layer; the training
        path turns it on from its memory plan, `offload.plan_activation_memory`).
      efficient_norm: RMSNorms save their bf16 input instead of fp32 copies (rmsnorm.py).
      attention_head_groups: run the attention kernel over this many groups of kv heads one after another,
        so its backward's own working block (an fp32 dq accumulator and, for GQA, dk/dv at every query
        head) exists one group at a time ("auto": the fewest groups that keep it under 1 GiB, CUDA only;
        attention.attention_head_groups). Exact: the kernel's numbers per head.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParallelLayout,
        kernel: str = "auto",
        *,
        chunked_loss: bool | int = True,
        tiled_mlp: bool | int = True,
        checkpointing: bool = True,
        offload: bool = True,
        keep_on_gpu: int = 0,
        recompute_layers: int | None = None,
        cache_attention_layers: int = 0,
        min_offload_bytes: int | None = None,
        efficient_norm: bool = True,
        attention_head_groups: int | str = "auto",
    ):
        super().__init__()
        if offload and not checkpointing:
            raise ValueError("offload=True moves checkpointed activations to the host; it needs checkpointing=True.")
        self.model = model
        self.layout = layout
        self.last_num_tokens = None
        self._undo = []
        # Also at sp_size 1: the attention kernel (and its backend priority) is then ours.
        self.attention = UlyssesAttention(layout, kernel=kernel, head_groups=attention_head_groups)
        self._undo.append(self.attention.apply(model))
        if efficient_norm:
            self._undo.append(install_memory_efficient_rmsnorm(model))
        if chunked_loss:
            self._undo.append(install_chunked_loss_head(model, None if chunked_loss is True else int(chunked_loss)))
        if tiled_mlp:
            self._undo.append(install_tiled_mlp(model, None if tiled_mlp is True else int(tiled_mlp)))
        self.checkpointing = None
        if checkpointing:
            extra = {} if min_offload_bytes is None else {"min_offload_bytes": min_offload_bytes}
            self.checkpointing = enable_checkpointing(
                model, offload=offload, keep_on_gpu=keep_on_gpu, recompute_layers=recompute_layers,
                cache_attention_layers=cache_attention_layers, **extra,
            )
            self._undo.append(self.checkpointing.undo)

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids, position_ids=None, labels=None):
        if position_ids is None and self.layout.sp_size > 1:
            raise ValueError(
                "position_ids are required under sequence parallelism: each rank holds a slice of the sequence "
                "and needs its global positions; build the batch with ulysses_lc.shard_batch()."
            )
        if labels is None:
            raise ValueError("labels are required to compute the loss; build the batch with ulysses_lc.shard_batch().")
        hidden_bsh = self.model.base_model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        head = self.model.get_output_embeddings()
        if isinstance(head, ChunkedLossHead):
            loss_sum, n_valid = head(hidden_bsh, labels)
        else:
            loss_sum, n_valid = plain_loss_sum(head(hidden_bsh), labels)
        loss, self.last_num_tokens = sp_mean_loss(loss_sum, n_valid, self.layout)
        return loss

    def undo(self) -> None:
        """Give the wrapped model back as it was (attention implementation and any installed lever)."""
        while self._undo:
            self._undo.pop()()
