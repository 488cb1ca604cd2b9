"""Preference training (DPO, IPO) under Ulysses SP: completion log-probabilities from hidden states, and the loss.

Legend (shape.py): t rows of this rank (its s_local tokens, already shifted), e hidden, v vocabulary, d documents.

Layout: one pair is ONE packed sequence of two documents, [prompt + chosen | prompt + rejected] (several pairs may
share a sequence: pair k is documents 2k and 2k + 1). Each document attends only to itself (sharding.py's packed
documents), so this is TRL's batch of two rows, prompt repeated, laid end to end. Why one sequence and not two:
DPO needs both completions' log-probabilities before any backward, so two sequences keep both forward graphs alive
anyway (the same activations as one of twice the length) unless the forwards run twice; and one sequence is one
pass of ZeRO-3's weight gathers and of the SP all-to-alls per layer instead of two, with one memory plan.

Log-probabilities: the sum over a document's completion tokens of log p(token | its document's prefix). Labels are
the completion's tokens, IGNORE_INDEX elsewhere, shifted over the whole sequence before slicing (shard_batch), so a
prompt or completion crossing a shard border loses nothing; each rank sums the rows of the documents its slice
holds, and the sums are added over the SP group (`sp_sum`). The head runs in row chunks as the SFT loss does
(chunked_loss.chunk_step): the [tokens x vocab] logits never exist. Chunks stop at document borders, so each is one
document's, and the gradient is computed in forward as there: the hidden-state gradient per row (scaled in backward
by its document's incoming gradient) and, when the head trains, one fp32 weight accumulator per document on this
rank's slice (v x e x 4 bytes each; none under LoRA, whose head is frozen).

The loss (`PreferenceLoss`, TRL's formulas): delta = (log pi(c) - log ref(c)) - (log pi(r) - log ref(r));
  sigmoid: -(1 - eps) log sigmoid(beta delta) - eps log sigmoid(-beta delta)   (eps = label smoothing, cDPO; eps = 0
           is DPO, TRL's "sigmoid"; eps > 0 is TRL's "aot" on one pair, the conservative DPO of Mitchell, 2023)
  ipo:     ((log-ratio of c / |c|) - (log-ratio of r / |r|) - 1 / (2 beta))^2   (TRL's length-normalised IPO)
The reference log-probabilities come from a frozen copy of the model (a second SequenceParallelCausalLM, ZeRO-3
sharded like the policy), from the policy with its adapters switched off (LoRA: no second model), or precomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..levers.chunked_loss import ChunkedLossHead, auto_chunk_rows, check_labels_on_device, chunk_step, final_logit_softcap
from ..constants import IGNORE_INDEX
from ..parallel.layout import ParallelLayout
from .loss import sp_sum
from ..peft_support import is_peft_model
from ..parallel.sharding import ShardedBatch, shard_batch

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class DocumentRows:
    """Which of this rank's rows belong to which document: (document, first row, end row) per run, in row order.
    Rows past the last real document (the end padding) have document index >= n_documents and are scored as 0."""

    n_documents: int
    runs: tuple[tuple[int, int, int], ...]

    @classmethod
    def for_rank(cls, cu_seqlens, sp_rank: int, s_local: int, n_documents: int) -> "DocumentRows":
        """cu_seqlens: boundaries over the whole padded sequence (host ints or a CPU tensor); this rank holds rows
        [sp_rank * s_local, (sp_rank + 1) * s_local)."""
        bounds = [int(b) for b in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        if len(bounds) - 1 < n_documents:
            raise ValueError(f"the batch has {len(bounds) - 1} documents, {n_documents} were asked for.")
        lo, hi = sp_rank * s_local, (sp_rank + 1) * s_local
        runs = tuple((d, max(a, lo) - lo, min(b, hi) - lo)
                     for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if max(a, lo) < min(b, hi))
        assert runs and runs[0][1] == 0 and runs[-1][2] == s_local, (bounds, sp_rank, s_local)
        return cls(n_documents, runs)

    def document_ids(self, device) -> torch.Tensor:
        """[t] each row's document (n_documents for rows past the last)."""
        return torch.cat([torch.full((b - a,), min(d, self.n_documents), dtype=torch.long) for d, a, b in self.runs]
                         ).to(device)

    def log_probs(self, hidden_te, weight_ve, bias_v, labels_t, chunk_rows=None, softcap=None,
                  fused_rows=None) -> torch.Tensor:
        """[n_documents] summed log-probabilities of each document's labels on this rank, through the chunked head."""
        if chunk_rows is None:
            chunk_rows = auto_chunk_rows(weight_ve.shape[0], (1 << 30) // (2 if softcap else 1))
        return ChunkedDocumentLogProbs.apply(hidden_te, weight_ve, bias_v, labels_t.long(), self, int(chunk_rows),
                                             softcap, fused_rows)

    def log_probs_from_logits(self, logits_tv: torch.Tensor, labels_t: torch.Tensor) -> torch.Tensor:
        """The same sums from full logits (the path without the chunked head)."""
        row_logp = -F.cross_entropy(logits_tv.float(), labels_t, ignore_index=IGNORE_INDEX, reduction="none")
        out = row_logp.new_zeros(self.n_documents + 1)
        return out.index_add(0, self.document_ids(row_logp.device), row_logp)[: self.n_documents]


class ChunkedDocumentLogProbs(torch.autograd.Function):
    """Per-document summed log-probabilities of `hidden_te @ weight_ve.T (+ bias_v)` at `labels_t`, in chunks.

    Forward communicates nothing and computes the gradients on the spot (chunked_loss.py says why), each chunk inside
    one document. Returns [n_documents] in fp32 (fp64 for fp64 inputs). Saved for backward (ctx attributes, on the
    device): the hidden-state gradient [t, e] in hidden's dtype, and per document on this slice an fp32 weight (and
    bias) accumulator, all for grad_output = 1 on that document's row loss. Backward communicates nothing: it scales
    each document's rows and accumulator by minus that document's incoming gradient; it can run once.
    """

    @staticmethod
    def forward(ctx, hidden_te, weight_ve, bias_v, labels_t, documents: DocumentRows, chunk_rows, softcap=None,
                fused_rows=None):
        t, e = hidden_te.shape
        v = weight_ve.shape[0]
        acc_dtype = torch.promote_types(hidden_te.dtype, torch.float32)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_bias = need_bias and bias_v is not None
        valid_t = labels_t != IGNORE_INDEX
        check_labels_on_device(labels_t, valid_t, v)
        safe_labels_t = labels_t.clamp(min=0)
        logps_d = torch.zeros(documents.n_documents, dtype=acc_dtype, device=hidden_te.device)
        grad_hidden_te = torch.zeros((t, e), dtype=hidden_te.dtype, device=hidden_te.device) if need_hidden else None
        weight_acc, bias_acc = {}, {}
        for d, a, b in documents.runs:
            if d >= documents.n_documents:  # the end padding: no labels, zero gradient (grad_hidden_te starts at 0)
                continue
            if need_weight:
                weight_acc[d] = torch.zeros(v, e, dtype=acc_dtype, device=weight_ve.device)
            if need_bias:
                bias_acc[d] = torch.zeros(v, dtype=acc_dtype, device=weight_ve.device)
            for start in range(a, b, chunk_rows):
                end = min(start + chunk_rows, b)
                logps_d[d] -= chunk_step(
                    hidden_te[start:end], weight_ve, bias_v, safe_labels_t[start:end], valid_t[start:end], softcap,
                    acc_dtype, None if grad_hidden_te is None else grad_hidden_te[start:end], weight_acc.get(d),
                    bias_acc.get(d), fused_rows)
        ctx.documents = documents
        ctx.saved = (grad_hidden_te, weight_acc, bias_acc)
        ctx.dtypes = (weight_ve.dtype, None if bias_v is None else bias_v.dtype)
        return logps_d

    @staticmethod
    def backward(ctx, grad_logps_d):
        if ctx.saved is None:
            raise RuntimeError("ChunkedDocumentLogProbs.backward ran twice; retain_graph=True over the head is not "
                               "supported (its gradients are scaled in place and freed).")
        grad_hidden_te, weight_acc, bias_acc = ctx.saved
        ctx.saved = None
        scale_d = grad_logps_d.neg()  # log p = -(row loss)
        if grad_hidden_te is not None:
            for d, a, b in ctx.documents.runs:
                if d < ctx.documents.n_documents:
                    grad_hidden_te[a:b].mul_(scale_d[d].to(grad_hidden_te.dtype))
        grad_weight = grad_bias = None
        if weight_acc:
            grad_weight = sum(acc.mul_(scale_d[d]) for d, acc in weight_acc.items()).to(ctx.dtypes[0])
        if bias_acc:
            grad_bias = sum(acc.mul_(scale_d[d]) for d, acc in bias_acc.items()).to(ctx.dtypes[1])
        return grad_hidden_te, grad_weight, grad_bias, None, None, None, None, None


@dataclass
class PreferenceBatch:
    """This rank's slice of packed pairs: `batch` (documents 2k, 2k + 1 = pair k's prompt + chosen, prompt +
    rejected) and each completion's token count (host ints, for IPO and the metrics)."""

    batch: ShardedBatch
    chosen_tokens: tuple[int, ...]
    rejected_tokens: tuple[int, ...]

    @property
    def n_documents(self) -> int:
        return 2 * len(self.chosen_tokens)

    def as_kwargs(self) -> dict:
        """The model's keyword arguments: it then returns the pairs' [2 * pairs] log-probabilities."""
        return {**self.batch.as_kwargs(), "documents": self.n_documents}

    def to(self, device) -> "PreferenceBatch":
        return PreferenceBatch(self.batch.to(device), self.chosen_tokens, self.rejected_tokens)


def check_pair(prompt_ids, chosen_ids, rejected_ids, seq_len: int | None = None, where: str = "a pair") -> int:
    """Raise ValueError, with the fix, for a pair that cannot be scored exactly; returns its packed length."""
    if len(prompt_ids) == 0:
        raise ValueError(f"{where} has no prompt tokens: a completion's first token is predicted from the prompt's "
                         "last one. Give the prompt at least one token (the tokenizer's BOS or the chat template).")
    for name, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        if len(ids) == 0:
            raise ValueError(f"{where} has no {name} completion tokens, so there is nothing to score; drop the row, "
                             f"or check that the {name} text does not tokenize into the prompt.")
    length = 2 * len(prompt_ids) + len(chosen_ids) + len(rejected_ids)
    if seq_len is not None and length > seq_len:
        raise ValueError(
            f"{where} is {length:,} tokens as prompt + chosen ({len(prompt_ids) + len(chosen_ids):,}) and prompt + "
            f"rejected ({len(prompt_ids) + len(rejected_ids):,}), longer than the sequence length {seq_len:,}: "
            f"raise --seq-len to at least {length:,} (a pair trains as one sequence) or drop the row; cutting it "
            "would score a different completion.")
    return length


def shard_pairs(pairs, layout: ParallelLayout, *, seq_len: int | None = None, vocab_size: int | None = None,
                pad_token_id: int = 0) -> PreferenceBatch:
    """Pack (prompt_ids, chosen_ids, rejected_ids) pairs into one sequence of 2 documents each, labels on the
    completions only, and take this rank's slice (shard_batch). Every rank of the SP group passes the same pairs."""
    input_ids, labels, lengths, chosen, rejected = [], [], [], [], []
    for k, (prompt, chosen_ids, rejected_ids) in enumerate(pairs):
        check_pair(prompt, chosen_ids, rejected_ids, seq_len, where=f"pair {k}")
        for completion in (chosen_ids, rejected_ids):
            input_ids += [*prompt, *completion]
            labels += [IGNORE_INDEX] * len(prompt) + list(completion)
            lengths.append(len(prompt) + len(completion))
        chosen.append(len(chosen_ids))
        rejected.append(len(rejected_ids))
    if seq_len is not None and len(input_ids) > seq_len:
        raise ValueError(f"{len(pairs)} pairs pack to {len(input_ids):,} tokens, more than the sequence length "
                         f"{seq_len:,}: raise --seq-len or pack fewer pairs per sequence.")
    batch = shard_batch(torch.tensor(input_ids), layout, labels=torch.tensor(labels), pad_token_id=pad_token_id,
                        vocab_size=vocab_size, document_lengths=lengths)
    return PreferenceBatch(batch, tuple(chosen), tuple(rejected))


def document_log_probs(model, hidden_bse, labels_bs, cu_seqlens, n_documents: int, layout: ParallelLayout):
    """[n_documents] completion log-probabilities of the whole packed sequence, the same on every SP rank
    (differentiable; summed over the SP group). `model`: the SequenceParallelCausalLM whose head scores them."""
    if cu_seqlens is None:
        raise ValueError("document log-probabilities need the packed documents' borders: build the batch with "
                         "ulysses_lc.objectives.preference.shard_pairs.")
    documents = DocumentRows.for_rank(cu_seqlens, layout.sp_rank, hidden_bse.shape[1], n_documents)
    head = model.causal_lm.get_output_embeddings()
    if isinstance(head, ChunkedLossHead):
        logps_d = head(hidden_bse, labels_bs, documents=documents)
    else:
        logits_bsv, cap = head(hidden_bse), final_logit_softcap(model.config)
        if cap:
            logits_bsv = torch.tanh(logits_bsv / cap) * cap
        logps_d = documents.log_probs_from_logits(logits_bsv.flatten(0, 1), labels_bs.flatten())
    return sp_sum(logps_d, layout)


@torch.no_grad()
def reference_log_probs(policy, batch: PreferenceBatch, reference=None) -> torch.Tensor:
    """The reference model's [2 * pairs] log-probabilities, without gradient: `reference` (a frozen
    SequenceParallelCausalLM, or a DeepSpeed engine of one) when given, else `policy` (the same, of a PeftModel)
    with its adapters switched off."""
    kwargs = batch.as_kwargs()
    if reference is not None:
        return reference(**kwargs).float()
    peft_model = getattr(getattr(policy, "module", policy), "model", None)
    if not is_peft_model(peft_model):
        raise ValueError("DPO needs a reference: pass a frozen copy of the model (reference=...), train LoRA "
                         "adapters (the reference is the model with them off), or precompute the reference's "
                         "log-probabilities.")
    with peft_model.disable_adapter():
        return policy(**kwargs).float()


@dataclass(frozen=True)
class PreferenceLoss:
    """The DPO loss of packed pairs (module docstring). beta: the KL weight (IPO's tau); label_smoothing: cDPO's
    eps, the probability that a preference is flipped (sigmoid only, in [0, 0.5))."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={self.loss_type!r}: ulysses_lc's preference losses are {LOSS_TYPES}.")
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}.")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing is the probability of a flipped preference, in [0, 0.5); got "
                             f"{self.label_smoothing}.")
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise ValueError(f"label_smoothing applies to the sigmoid loss; set it to 0 for {self.loss_type!r}.")

    def __call__(self, policy_logps: torch.Tensor, reference_logps: torch.Tensor, batch: PreferenceBatch):
        """(loss: the mean over pairs, metrics: detached scalars) from [2 * pairs] log-probabilities."""
        ratio = policy_logps - reference_logps.to(policy_logps.dtype)
        chosen, rejected = ratio[0::2], ratio[1::2]
        if self.loss_type == "sigmoid":
            logits = self.beta * (chosen - rejected)
            eps = self.label_smoothing
            losses = -(1 - eps) * F.logsigmoid(logits) - eps * F.logsigmoid(-logits)
        else:
            n_chosen = torch.tensor(batch.chosen_tokens, dtype=ratio.dtype, device=ratio.device)
            n_rejected = torch.tensor(batch.rejected_tokens, dtype=ratio.dtype, device=ratio.device)
            losses = (chosen / n_chosen - rejected / n_rejected - 1 / (2 * self.beta)) ** 2
        rewards_chosen, rewards_rejected = self.beta * chosen.detach(), self.beta * rejected.detach()
        metrics = {
            "rewards/chosen": rewards_chosen.mean(), "rewards/rejected": rewards_rejected.mean(),
            "rewards/margins": (rewards_chosen - rewards_rejected).mean(),
            "rewards/accuracies": (rewards_chosen > rewards_rejected).float().mean(),
            "logps/chosen": policy_logps.detach()[0::2].mean(), "logps/rejected": policy_logps.detach()[1::2].mean(),
        }
        return losses.mean(), metrics


__all__ = ["LOSS_TYPES", "ChunkedDocumentLogProbs", "DocumentRows", "PreferenceBatch", "PreferenceLoss",
           "check_pair", "document_log_probs", "reference_log_probs", "shard_pairs"]
