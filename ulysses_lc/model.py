"""The training model: a Hugging Face causal LM whose forward returns the SP-reduced loss.

`SequenceParallelCausalLM` is what goes into `deepspeed.initialize`: its forward takes a ShardedBatch's
tensors, runs the decoder (with Ulysses attention when sp_size > 1), and computes the loss from hidden
states, so the [tokens x vocab] logits are never built when the chunked loss head is installed. Running
the loss inside the engine's forward keeps every ZeRO-3 hook (parameter gather before use, release after,
re-gather before backward) in charge of the LM head as of any other layer.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .composite import freeze_outside_language_model
from .mixers import fallbacks
from .mixers.attention import install_ulysses_attention
from .levers.checkpointing import install_checkpointing
from .levers.chunked_loss import ChunkedLossHead, final_logit_softcap, install_chunked_loss_head
from .constants import IGNORE_INDEX
from .mixers.explicit_attention import explicit_attention, keeps_attention_outputs
from .parallel.layout import ParallelLayout
from .objectives.loss import sp_mean_loss
from .objectives.router_loss import install_router_loss
from .plan.memory import MemoryPlan, optimizer_reserved_bytes, plan_step_memory
from .peft_support import base_model, causal_lm, check_peft_model
from .objectives.preference import document_log_probs
from .recompute import RecomputeContext
from .levers.rmsnorm import install_efficient_rmsnorm
from .levers.rope import install_fused_rope, wanted as wants_fused_rope
from .levers.swiglu import wanted as wants_fused_swiglu
from .shape import ModelShape, text_config
from .levers.tiled_mlp import install_tiled_mlp, plain_parameter_name


def plain_loss_sum(logits_bsv: torch.Tensor, labels_bs: torch.Tensor):
    """(summed fp32 cross-entropy, valid-label count) from full logits; labels already shifted."""
    loss_sum = F.cross_entropy(
        logits_bsv.float().flatten(0, 1), labels_bs.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (labels_bs != IGNORE_INDEX).sum()


def without_hub_kernels(model: nn.Module) -> bool:
    """Put back transformers' own forwards where the model was kernelized with hub kernels (from_pretrained's
    use_kernels, on by default from transformers 5.25 where the `kernels` package is installed): those replace
    forwards of the layers the levers patch (norms, MLPs), and every lever is tested against transformers' torch
    forwards. `model.use_kernels = False` is transformers' own reset (reset_kernels). Returns whether it reset."""
    if not getattr(model, "use_kernels", False):
        return False
    model.use_kernels = False
    if getattr(model, "use_kernels", False):
        raise ValueError("the model was kernelized with hub kernels (use_kernels=True) and transformers could not "
                         "reset them (is the `kernels` package importable?); load it with use_kernels=False.")
    return True


class SequenceParallelCausalLM(nn.Module):
    """Wraps `model` (a transformers *ForCausalLM, a multimodal *ForConditionalGeneration whose language model
    trains, or a peft PeftModel of either) for sequence-parallel training over `layout`.

    forward(input_ids, position_ids, labels, cu_seqlens=None, token_mask=None) -> loss: mean over the valid tokens of
    the whole sequence (all SP ranks), identical on each of them, plus the MoE routers' load-balancing term where the
    config has output_router_logits on (forward says how); `last_num_tokens` holds the valid-token count (a device
    tensor, read it after the step). The wrapped model stays a normal HF model (`.model`): save or
    export it as usual, after `undo()` if you want the plain modules back. A PeftModel stays one: the levers act
    on the transformers model under it (`.causal_lm`, peft_support.py), only its trainable parameters take
    gradients, and its `save_pretrained` writes the adapter. A multimodal model stays one too: the levers act on its
    language model, and everything else (the vision tower, the projector) is frozen here, so it is saved as loaded
    (composite.py).

    The memory levers, each exact, are on by default; build this wrapper before `deepspeed.initialize`
    (ZeRO-3 registers its hooks on the modules as they are then). Each is installed through its own
    `install_*` call (their Handles are in `self.levers`):
      chunked_loss: loss from hidden states in row chunks, never the [tokens x vocab] logits (True =
        automatic chunk rows, or an int).
      tiled_mlp: each MLP runs over sequence tiles (None = automatic tile count, or an int).
      checkpointing: non-reentrant activation checkpointing of the decoder layers, as `plan` says.
      offload: checkpointed layer inputs wait in host memory, except the plan's `keep_on_gpu` last ones
        (and tensors under `min_offload_bytes`).
      plan: a memory.MemoryPlan (which layers are checkpointed, keep their input on the device, keep their
        attention output). None: every layer checkpointed and offloaded, no kept outputs (the least device
        memory). `use_plan` changes it between steps; `plan_step` makes one from the memory free once ZeRO-3
        has allocated its partitions.
      efficient_norm: RMSNorms save their bf16 input instead of fp32 copies (rmsnorm.py).
      fused_rope: RoPE as one Triton kernel each way on CUDA instead of transformers' five eager passes, within one
        rounding of them (rope.py). None (the default): installed where CUDA is available (its CUDA test passed on
        an H100, and it took the Qwen3-4B step at 128k from 36.92 to 36.19 s, BENCHMARKS.md); on the CPU it would
        change nothing, so the model's own function stays. True: installed everywhere; False: never.
      fused_swiglu: the tiled MLP's tiles of a gated-SiLU MLP (Qwen3, Llama, Mistral) run silu(gate) * up as one
        Triton kernel each way instead of eager passes, within one rounding of them (swiglu.py). None (the default):
        where CUDA is available (its CUDA test passed on an H200; the Qwen3-4B tile's kernels 0.549 -> 0.41-0.48 s of
        the step at 128k, BENCHMARKS.md); True: wherever the kernels run; False: never.
      fused_ce_rows: the chunked loss's softmax cross-entropy as one Triton kernel a chunk on CUDA, reading the bf16
        logits twice and writing the gradient over them (ce_rows.py). None (the default): ce_rows.FUSED_ROWS, on
        (CUDA only); True: wherever the kernel runs; False: never (the eager chunk).
      attention_head_groups: run the attention kernel over this many groups of kv heads one after another,
        so its backward's own working block exists one group at a time ("auto": the fewest groups that keep
        it under 1 GiB, CUDA only; kernels.attention_head_groups). Exact: the kernel's numbers per head.
    Checkpointing and attention share one recompute.RecomputeContext, through which layers that keep their
    attention output hand it to their recompute.
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
        plan: MemoryPlan | None = None,
        min_offload_bytes: int | None = None,
        efficient_norm: bool = True,
        fused_rope: bool | None = None,
        fused_swiglu: bool | None = None,
        fused_ce_rows: bool | None = None,
        attention_head_groups: int | str = "auto",
    ):
        super().__init__()
        if offload and not checkpointing:
            raise ValueError("offload=True moves checkpointed activations to the host; it needs checkpointing=True.")
        if plan is not None and not checkpointing:
            raise ValueError("a memory plan chooses which layers are checkpointed; it needs checkpointing=True.")
        check_peft_model(model, chunked_loss=bool(chunked_loss))
        self.hub_kernels_reset = without_hub_kernels(base_model(model))
        freeze_outside_language_model(base_model(model))
        self.model = model
        self.layout = layout
        self.shape = ModelShape.from_config(model.config)
        self.offload = offload and checkpointing
        self.last_num_tokens = None
        self.last_aux_loss = None
        self.levers = []
        lm = causal_lm(model)
        # The MoE routers' load-balancing loss, where the config asks for it (output_router_logits): None costs nothing.
        self.router_loss = install_router_loss(lm)
        if self.router_loss is not None:
            self.levers.append(self.router_loss)
        context = RecomputeContext()
        # Also at sp_size 1: the attention kernel (and its backend priority) is then ours.
        attention = install_ulysses_attention(lm, layout, kernel, head_groups=attention_head_groups,
                                              recompute=context)
        self.levers.append(attention)
        self.attention = attention.attention
        linear = attention.linear  # the gated DeltaNet layers' kernel, for the start-up block (None: there are none)
        self.deltanet = None if linear.kernel is None else f"{linear.kernel}: {linear.why}"
        self.deltanet_kernel = linear.kernel or "torch"  # what the memory plan prices their recurrence at
        if efficient_norm:
            self.levers.append(install_efficient_rmsnorm(lm))
        if wants_fused_rope(fused_rope):
            self.levers.append(install_fused_rope(lm))
        if chunked_loss:
            self.levers.append(install_chunked_loss_head(lm, None if chunked_loss is True else int(chunked_loss),
                                                         fused_rows=fused_ce_rows))
        if tiled_mlp:
            tiles = None if tiled_mlp is True else int(tiled_mlp)
            self.levers.append(install_tiled_mlp(lm, tiles, router=self.router_loss,
                                                 fused_swiglu=wants_fused_swiglu(fused_swiglu)))
        self.checkpointing = None
        if checkpointing:
            plan = plan or MemoryPlan.everything_checkpointed(self.shape.layers)
            extra = {} if min_offload_bytes is None else {"min_offload_bytes": min_offload_bytes}
            self.checkpointing = install_checkpointing(
                lm, offload=offload, keep_on_gpu=plan.keep_on_gpu, recompute_layers=plan.recompute_layers,
                cache_attention_layers=plan.cache_attention_layers, context=context, **extra,
            )
            self.levers.append(self.checkpointing)
        self.plan = plan

    def probe_attention(self, device: torch.device, dtype: torch.dtype, tokens: int = 256) -> tuple:
        """Run this model's attention kernels once, forward and backward, on `tokens` random tokens of this rank's
        heads (each window size its layers use), so that a kernel that refuses them is known before the plan is
        made and named in the start-up block (fallbacks.py). Returns every fallback taken so far; where no explicit
        kernel takes the full-attention call, plans count no kept outputs or head groups (`plan_step`)."""
        from .mixers.window_attention import window_attention

        shape, sp = self.shape, self.layout.sp_size
        heads, kv_heads = shape.local_heads(sp), shape.local_kv_heads(sp)
        make = functools.partial(torch.randn, device=device, dtype=dtype, requires_grad=True)
        q, k, v = make(1, heads, tokens, shape.head_dim), make(1, kv_heads, tokens, shape.head_dim), \
            make(1, kv_heads, tokens, shape.head_dim)
        if keeps_attention_outputs(self.attention.kernel):
            out = explicit_attention(q, k, v, None, self.attention.kernel)
            self.attention.explicit_ok = out is not None
            if out is not None:
                out.sum().backward()
        sinks = torch.zeros(heads, device=device, dtype=dtype) if shape.sinks else None
        for window in sorted({w for w in shape.layer_windows if w is not None and w < tokens}):
            window_attention(q, k, v, None, window, sinks, self.attention.kernel).sum().backward()
        return fallbacks.taken()

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters of the wrapped model, each counted once, whole also when ZeRO-3 has partitioned it (where
        transformers' own `num_parameters`, which the Trainer calls, would count this rank's empty stubs)."""
        skip = set()
        if exclude_embeddings:
            skip = {id(m.weight) for m in self.model.modules() if isinstance(m, nn.Embedding)}
        params = {id(p): p for p in self.model.parameters() if (p.requires_grad or not only_trainable)
                  and id(p) not in skip}
        return sum(getattr(p, "ds_numel", p.numel()) for p in params.values())

    def plan_step(self, seq_len: int, device: torch.device, *, packed: bool = False, long_documents: bool = False,
                  reserved_bytes: int | None = None, budget: tuple[float, float] | None = None) -> MemoryPlan:
        """The memory plan for steps of `seq_len` tokens (the whole sequence, over the SP group) from the memory
        free now on every rank, with this model's kernel, head groups and offload setting (memory.plan_step_memory).
        Collective on CUDA: every rank calls it, and gets the same plan. Call it after `deepspeed.initialize`
        (ZeRO-3's partitions then exist) and hand the result to `use_plan`.

        packed: the steps train packed documents (no kept attention outputs, the kernel block whole);
            long_documents: each at least kernels.DOCUMENT_VARLEN_TOKENS long (DPO's pairs: memory.step_terms).
        reserved_bytes: memory still to be allocated; None reserves AdamW's moments, which come at the first step
            (memory.optimizer_reserved_bytes over the trainable parameters); 0 once the optimizer state exists.
        budget: (device, host) bytes at most, the dry run's for the run's limits (sizing.Job.budget).
        """
        if reserved_bytes is None:
            reserved_bytes = optimizer_reserved_bytes(self.num_parameters(only_trainable=True), self.layout.world_size)
        return plan_step_memory(self.shape, seq_len, self.layout, device, kernel=self.attention.kernel,
                                head_groups=self.attention.head_groups, offload=self.offload,
                                explicit_ok=self.attention.explicit_ok,
                                reserved_bytes=reserved_bytes, packed=packed, budget=budget,
                                long_documents=long_documents, deltanet=self.deltanet_kernel)

    @staticmethod
    def plain_name(name: str) -> str:
        """The plain Hugging Face model's name for a parameter or buffer name under this wrapper (as
        `named_parameters()`, `state_dict()` or a ZeRO-3 gather give it): what export, the Trainer's save and
        checkpoints written for `from_pretrained` use."""
        return plain_parameter_name(name.removeprefix("model."))

    def plain_state_dict(self, state: dict) -> dict:
        """`state` (keys under this wrapper) with the plain model's keys."""
        return {self.plain_name(k): v for k, v in state.items()}

    def plain_named_parameters(self):
        """(plain model's name, parameter) of every parameter, as the unwrapped model would name them."""
        for name, p in self.named_parameters():
            yield self.plain_name(name), p

    def summary(self, seq_len: int, device: torch.device, length_note: str = "") -> list[str]:
        """Start-up lines for a log: layout and where the SP groups sit, model, length and RoPE scaling, kernel, the
        plan in use (the Trainer path prints these; the main job's block, train/console.py, says the same and more)."""
        from .levers.yarn import describe_rope_scaling

        layout, config = self.layout, self.config
        layers = text_config(config).num_hidden_layers
        ranks = f"{layout.world_size} rank{'s' if layout.world_size > 1 else ''}"
        why = "the GPU" if device.type == "cuda" else "no GPU: every layer checkpointed"
        return [
            f"layout    {ranks} = sp {layout.sp_size} (ranks sharing one sequence) x dp {layout.dp_size} "
            "(sequences per step)",
            f"nodes     {layout.placement_line()}",
            f"model     {type(config).__name__}, {layers} layers, {self.num_parameters() / 1e6:,.1f} M params "
            f"({self.num_parameters(only_trainable=True) / 1e6:,.2f} M trained)",
            f"length    {seq_len:,} tokens per step{f' ({length_note})' if length_note else ''}, "
            f"{describe_rope_scaling(config)}",
            f"kernel    {self.attention.kernel}, attention head groups {self.attention.head_groups}",
            f"plan      {self.plan.describe(layers, self.offload)}; from the memory free on every rank ({why}, "
            "plan_step)",
        ]

    def use_plan(self, plan: MemoryPlan, release_cached_memory: bool | None = None) -> None:
        """Change the memory plan between steps (every rank the same plan: ranks that differ deadlock).
        release_cached_memory: give the CUDA allocator's cached memory back before each checkpointed layer's
        recompute and attention backward (CheckpointHandle.configure); sizing.Job.release_cached_memory says
        whether a job's plan counts on it (ZeRO-3's parameters offloaded). None leaves it as it is."""
        if self.checkpointing is None:
            raise ValueError("this model was built with checkpointing=False; a memory plan has nothing to change.")
        self.checkpointing.configure(recompute_layers=plan.recompute_layers, keep_on_gpu=plan.keep_on_gpu,
                                     cache_attention_layers=plan.cache_attention_layers,
                                     release_cached_memory=release_cached_memory)
        self.plan = plan

    @property
    def config(self):
        return self.model.config

    @property
    def causal_lm(self) -> nn.Module:
        """The transformers *ForCausalLM the levers act on: `.model`, or the one under a PeftModel."""
        return causal_lm(self.model)

    def hidden_states(self, input_ids, position_ids=None, cu_seqlens=None) -> torch.Tensor:
        """The decoder's last hidden states [b, s_local, e] for this rank's slice (what the loss head reads)."""
        if position_ids is None and self.layout.sp_size > 1:
            raise ValueError(
                "position_ids are required under sequence parallelism: each rank holds a slice of the sequence "
                "and needs its global positions; build the batch with ulysses_lc.shard_batch()."
            )
        # Packed documents: their boundaries reach the attention function through transformers' layer kwargs.
        extra = {} if cu_seqlens is None else {"document_bounds": tuple(int(n) for n in cu_seqlens.tolist())}
        if self.router_loss is not None:  # our hooks sum the router logits layer by layer; transformers would keep them
            extra["output_router_logits"] = False
        # Every attention call of this forward checks that the borders reached it (a model that drops **kwargs
        # would let the documents attend to each other).
        self.attention.expected_bounds = extra.get("document_bounds")
        try:
            return self.causal_lm.base_model(
                input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra
            ).last_hidden_state
        finally:
            self.attention.expected_bounds = None

    def forward(self, input_ids, position_ids=None, labels=None, cu_seqlens=None, documents=None, per_token=False,
                token_mask=None, num_items_in_batch=None, router_scale=1.0):
        """The sequence's loss, the same on every SP rank: the mean token cross-entropy over the valid labels of
        the whole sequence, plus, where config.output_router_logits is on (MoE), router_aux_loss_coef x the
        routers' load-balancing loss of the whole sequence, as transformers' `outputs.loss` (objectives/
        router_loss.py). `last_num_tokens` then holds the valid-label count and `last_aux_loss` the load-balancing
        loss before its coefficient (device tensors, detached; None when off): loss - coef x last_aux_loss is the
        token loss. One aux term per sequence (per forward), as transformers adds one per forward.

        token_mask: [b, s_local] bool, False on padding (ShardedBatch.token_mask), which the router loss does not
            count; None: every token counts.
        num_items_in_batch: the token cross-entropy is the sequence's summed token losses over this count instead of
            its own (the valid labels of the optimizer step, as transformers' Trainer passes it to a model: token
            weighting across gradient accumulation and DP, docs/weighting.md); the router term is unchanged by it.
        router_scale: the router term's weight (1: transformers' outputs.loss); TRL's SFTTrainer averages the term over
            the step's micro steps and DP ranks, which its swap asks for here (integrations/hf_trainer.py).
        documents: an int (preference training): the [documents] summed log-probabilities of the first packed
            documents' labels instead, the same on every SP rank (preference.py).
        per_token: (evaluation, under no_grad) this rank's slice scored row by row (`token_scores`), no router loss.
        """
        if labels is None:
            raise ValueError("labels are required to compute the loss; build the batch with ulysses_lc.shard_batch().")
        if per_token:
            return self.token_scores(self.hidden_states(input_ids, position_ids, cu_seqlens), labels)
        if documents is not None:
            if self.router_loss is not None:
                raise ValueError("config.output_router_logits=True: the preference loss does not add the MoE router's "
                                 "load-balancing loss; set output_router_logits=False in the model's config.")
            hidden_bse = self.hidden_states(input_ids, position_ids, cu_seqlens)
            return document_log_probs(self, hidden_bse, labels, cu_seqlens, int(documents), self.layout)
        tally = contextlib.nullcontext() if self.router_loss is None else self.router_loss.tally(token_mask)
        with tally as router_sums:
            hidden_bse = self.hidden_states(input_ids, position_ids, cu_seqlens)
        head = self.causal_lm.get_output_embeddings()
        if isinstance(head, ChunkedLossHead):
            loss_sum, n_valid = head(hidden_bse, labels)
        else:
            logits_bsv, cap = head(hidden_bse), final_logit_softcap(self.config)
            if cap:  # Gemma's final soft-capping, which the model's own forward applies after its head
                logits_bsv = torch.tanh(logits_bsv / cap) * cap
            loss_sum, n_valid = plain_loss_sum(logits_bsv, labels)
        loss, self.last_num_tokens = sp_mean_loss(loss_sum, n_valid, self.layout, num_items_in_batch)
        if router_sums is not None:
            aux_loss = router_sums.aux_loss(self.layout, loss.device)
            self.last_aux_loss = aux_loss.detach()
            loss = loss + router_scale * self.router_loss.coef * aux_loss
        return loss

    def token_scores(self, hidden_bse: torch.Tensor, labels_bs: torch.Tensor):
        """(loss_bs fp32, correct_bs bool): each row's cross-entropy and whether its label is the argmax, on this
        rank's slice, 0 and False where the label is IGNORE_INDEX; no gradient. Only the labelled rows go through the
        head (a passkey scores a handful of rows of a long sequence): selecting them reads their count on the host,
        a sync an evaluation can afford. Every rank calls the head once, with or without rows, as ZeRO-3's gather of
        its weight needs."""
        with torch.no_grad():
            valid_t = labels_bs.reshape(-1) != IGNORE_INDEX
            rows = valid_t.nonzero().squeeze(1)
            hidden_re = hidden_bse.reshape(-1, hidden_bse.shape[-1]).index_select(0, rows)
            labels_r = labels_bs.reshape(-1).index_select(0, rows)
            head = self.causal_lm.get_output_embeddings()
            if isinstance(head, ChunkedLossHead):
                loss_r, correct_r = head(hidden_re, labels_r, per_token=True)
            else:
                logits_rv, cap = head(hidden_re).float(), final_logit_softcap(self.config)
                if cap:
                    logits_rv = torch.tanh(logits_rv / cap) * cap
                loss_r = F.cross_entropy(logits_rv, labels_r, reduction="none")
                correct_r = logits_rv.argmax(dim=-1) == labels_r
            loss_t = torch.zeros(valid_t.shape, dtype=torch.float32, device=hidden_bse.device)
            correct_t = torch.zeros(valid_t.shape, dtype=torch.bool, device=hidden_bse.device)
            loss_t[rows], correct_t[rows] = loss_r.float(), correct_r
            return loss_t.view(labels_bs.shape), correct_t.view(labels_bs.shape)

    def undo(self) -> None:
        """Give the wrapped model back as it was (attention implementation and any installed lever)."""
        while self.levers:
            self.levers.pop().undo()
