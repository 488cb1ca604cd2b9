"""--method dpo in the main job: the pairs' stream, the reference model, and one micro step's DPO loss.

Each sequence is one pair (or, with --packing, as many whole pairs as fit) laid out as two packed documents per pair
(preference.py). The reference (--dpo-reference):
  copy      a frozen copy of the model, loaded as the policy is, wrapped in a SequenceParallelCausalLM without
            checkpointing (it runs without gradient) and partitioned by ZeRO-3 like the policy: its bf16 weights
            over all ranks, what the dry run adds to the predicted memory;
  adapters  the policy with its LoRA adapters off (--lora-r): no second model;
  precomputed  the model as loaded (before any step; with --lora-r its adapters off), run once over every sequence
            of the data before training, its log-probabilities kept in the token cache under the weights' content,
            the data and the settings (`reference_entry`) and read back by later runs and resumes: no second model
            and no reference forward per step;
  auto      adapters with --lora-r, else copy.
Weighting: every pair of an optimizer step weighs the same, as in TRL's mean over its batch, however --packing
puts them into sequences and the step spreads those over micro steps and DP groups: a sequence's loss is the sum of
its pairs' losses x global_batch / (the step's pairs), since DeepSpeed then divides by global_batch (the mean over
micro steps, the gradient's over DP groups). Without --packing, one pair a sequence, that is each pair's loss.
The step's metrics: `loss` is the DPO loss; reward_margin, reward_accuracy, reward_chosen, reward_rejected are
TRL's rewards (beta x the log-ratio against the reference), means over the step's pairs.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from ..data import parse_source
from ..data.pairs import PairStream
from ..data.tokenize import tokenizer_fingerprint
from ..parallel.layout import ParallelLayout
from ..model import SequenceParallelCausalLM
from ..objectives.preference import PreferenceLoss, reference_log_probs, shard_pairs
from .loading import load_model, weights_digest

# TRL's metric names (rewards/margins, ...) as metrics.jsonl keys.
METRICS = {"rewards/margins": "reward_margin", "rewards/accuracies": "reward_accuracy",
           "rewards/chosen": "reward_chosen", "rewards/rejected": "reward_rejected"}


def check_pair_source(stream) -> None:
    """ValueError unless --data names preference rows --method dpo can read (cheap: the listing only). stream:
    settings.StreamSettings."""
    src = parse_source(stream.source, seed=stream.shape.seed, data_config=stream.shape.data_config)
    if src.kind != "tiny" and not src.tabular:
        raise ValueError(f"--method dpo trains preference rows (prompt / chosen / rejected): --data {stream.source} is "
                         f"{src.kind} text. Pass a .jsonl/.json/.parquet/.csv of such rows (or a hub dataset of "
                         "them), or --data tiny for generated pairs.")


def build_pair_stream(stream, tokenizer) -> PairStream:
    """Every pair of --data (stream: settings.StreamSettings), tokenized and checked against --seq-len before any
    weight loads."""
    src = parse_source(stream.source, seed=stream.shape.seed, data_config=stream.shape.data_config)
    return PairStream.build(src, tokenizer, stream.seq_len, packing=stream.shape.packing)


def load_reference(run, checked, device, layout: ParallelLayout):
    """The frozen copy (run: settings.RunSettings) as a DeepSpeed ZeRO-3 engine without optimizer; None for the
    adapters-off and the precomputed reference."""
    if run.objective.reference != "copy":
        return None
    from .engine_start import deepspeed_initialize

    model = run.model
    hf_model = load_model(model.name, checked.model_config, model.dtype, model.seed, device, checked.ds_config)
    wrapper = SequenceParallelCausalLM(hf_model.requires_grad_(False), layout, kernel=model.kernel,
                                       attention_head_groups=model.attention_head_groups, checkpointing=False,
                                       offload=False)
    config = {k: v for k, v in checked.ds_config.items() if k not in ("optimizer", "scheduler")}
    config["zero_optimization"] = {k: v for k, v in config.get("zero_optimization", {}).items()
                                   if k != "offload_optimizer"}
    engine, *_ = deepspeed_initialize(model=wrapper, config=config, mpu=layout.mpu)
    engine.eval()
    return engine


def pairs_in_step(stream: PairStream, position: int, global_batch: int) -> int:
    """The pairs of the optimizer step whose sequences start at `position`: its global_batch sequences, over every
    micro step and DP group (the same count on every rank)."""
    return sum(len(stream.sample(position + i)) for i in range(global_batch))


class DPOStep:
    """One micro step's DPO loss for a sequence of pairs: (loss, metrics, completion tokens, documents, padding)."""

    def __init__(self, objective, seq_len: int, layout: ParallelLayout, vocab_size: int, pad_token_id: int,
                 reference=None, adapters: bool = False):
        """objective: settings.ObjectiveSettings; adapters: the model has LoRA adapters (a precomputed reference is
        then the model with them off, else the model as loaded)."""
        self.loss = PreferenceLoss(objective.dpo_beta, objective.dpo_loss, objective.dpo_label_smoothing)
        self.layout, self.seq_len, self.vocab_size, self.pad_token_id = layout, seq_len, vocab_size, pad_token_id
        self.reference = reference
        self.adapters_off = adapters
        self.precomputed = None  # window -> [2 x pairs] reference log-probabilities (`precompute`)

    def batch(self, pairs, device):
        return shard_pairs(pairs, self.layout, seq_len=self.seq_len, vocab_size=self.vocab_size,
                           pad_token_id=self.pad_token_id).to(device)

    def precompute(self, engine, stream: PairStream, entry: "ReferenceEntry", writes: bool, device) -> bool:
        """The reference log-probabilities of every sequence of `stream`, from the cache `entry` when every rank finds
        it there under the same key, else from `engine` now (call before any step and before a checkpoint loads: the
        model as loaded is the reference), then written to the entry by the rank that `writes` the cache.
        Collective (the forwards are). Returns whether they were read from the cache."""
        saved = torch.load(entry.path, map_location="cpu") if entry.path.is_file() else None
        # The file holds its whole key: a name shared by other weights or data (a 64-bit prefix) is never read.
        found = torch.tensor([int(isinstance(saved, dict) and saved.get("key") == entry.key)], device=device)
        dist.all_reduce(found, op=dist.ReduceOp.MIN, group=self.layout.world_group)
        if found.item():
            self.precomputed = saved["log_probs"]
            return True
        table = []
        for window in range(len(stream)):
            batch = self.batch(stream.sample(window), device)
            table.append(reference_log_probs(engine, batch, None if self.adapters_off else engine).cpu())
        self.precomputed = table
        if writes:
            entry.path.parent.mkdir(parents=True, exist_ok=True)
            partial = entry.path.with_suffix(f".{os.getpid()}.partial")
            torch.save({"key": entry.key, "log_probs": table}, partial)
            partial.replace(entry.path)  # whole or absent: a killed write leaves no half file under the name
        return False

    def __call__(self, engine, pairs, device, window: int | None = None, step_pairs: int | None = None,
                 step_sequences: int = 1):
        """step_pairs, step_sequences: the optimizer step's pairs and sequences (global_batch), for the weighting
        (module docstring); None: this sequence's pairs, a step of one. The metrics are sums over the pairs, for
        `mean_metrics`."""
        batch = self.batch(pairs, device)
        if self.precomputed is not None:
            ref_logps = self.precomputed[window].to(device)
        else:
            ref_logps = reference_log_probs(engine, batch, self.reference)
        loss, metrics = self.loss(engine(**batch.as_kwargs()), ref_logps, batch)  # means over this sequence's pairs
        loss = loss * (len(pairs) * step_sequences / (step_pairs or len(pairs)))
        completion = sum(batch.chosen_tokens) + sum(batch.rejected_tokens)
        return (loss, {METRICS[k]: v * len(pairs) for k, v in metrics.items() if k in METRICS},
                torch.tensor(completion, device=device), batch.n_documents, self.seq_len - batch.batch.seq_len)


@dataclass(frozen=True)
class ReferenceEntry:
    """Where the precomputed reference log-probabilities live in the token cache, and the key they were made for."""

    path: Path
    key: str


def reference_entry(model, model_config, tokenizer, stream: PairStream, cache_dir: Path,
                    layout: ParallelLayout) -> ReferenceEntry:
    """The cache entry of the reference log-probabilities of this data under these weights (model:
    settings.ModelSettings; model_config: as loaded, RoPE planned). Collective: rank 0 hashes the weights and
    tells the others (one read of the files, loading.weights_digest says what it costs).

    Keyed on everything the log-probabilities depend on: the weights' content (not the model's name: the usual
    SFT-then-DPO flow overwrites one folder with new weights), the model config (RoPE and YaRN included), precision,
    attention kernel, whether the reference is the adapters off; the tokenizer and the data as token ids (the pairs'
    stream id, which also covers --packing), and --seq-len. Not beta or the loss: they act on the log-probabilities."""
    digest = [weights_digest(model.name, model.seed, cache_dir / "weights") if layout.rank == 0 else None]
    dist.broadcast_object_list(digest, src=0, group=layout.world_group)
    key = json.dumps({"weights": digest[0], "config": model_config.to_json_string(use_diff=False),
                      "dtype": str(model.dtype), "kernel": model.kernel, "adapters_off": model.lora_r > 0,
                      "tokenizer": tokenizer_fingerprint(tokenizer), "data": stream.stream_id,
                      "seq_len": stream.seq_len}, sort_keys=True)
    name = f"dpo-reference-{hashlib.sha256(key.encode()).hexdigest()[:16]}.pt"
    return ReferenceEntry(cache_dir / name, key)


def mean_metrics(per_micro: list[dict], step_pairs: int, layout: ParallelLayout) -> dict:
    """The step's metrics, means over its pairs (as TRL's over its batch) from each micro step's sums: over the micro
    steps and DP groups (the same on every rank of an SP group)."""
    keys = list(per_micro[0])
    values = torch.stack([torch.stack([m[k].float() for k in keys]) for m in per_micro]).sum(0)
    if layout.dp_size > 1:
        torch.distributed.all_reduce(values, group=layout.dp_group)
    return dict(zip(keys, (values / step_pairs).tolist()))


__all__ = ["DPOStep", "METRICS", "ReferenceEntry", "build_pair_stream", "check_pair_source", "load_reference",
           "mean_metrics", "pairs_in_step", "reference_entry"]
