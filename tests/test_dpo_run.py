"""The main job's --method dpo on 2 gloo ranks (sp 2): preference rows from a .jsonl, packed, the reward margin rising,
metrics.jsonl, kill-and-resume on the same trajectory, the export, LoRA against its adapters off; and the refusals
(a pair longer than --seq-len, a completion with no tokens, DPO flags without --method dpo, a source of plain text).
The loss itself is held to TRL's in test_preference.py; here the job around it.
"""

import json
import os
from dataclasses import replace

import numpy as np
import pytest

from tests._dist import run_shared
from tests.test_training import Killed
from ulysses_lc.data.pairs import tiny_pairs
from ulysses_lc.train import EXPORT_DIR, TrainConfig, train

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pairs_file(tmp_path, n=12, max_chars=240):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in tiny_pairs(n, max_chars, seed=3)))
    return str(path)


def dpo_config(tmp_path, **overrides):
    base = TrainConfig(model="tiny", data=pairs_file(tmp_path), method="dpo", seq_len=1024, steps=6, lr=3e-3,
                       warmup_steps=1, dpo_beta=0.1, output_dir=str(tmp_path / "run"),
                       cache_dir=str(tmp_path / "cache"), export=True)
    return replace(base, **overrides)


def train_worker(rank, world_size, cfg, kill_after=None):
    def on_step(step, record):
        if kill_after is not None and step == kill_after:
            raise Killed

    try:
        return train(cfg, on_step=on_step)
    except Killed:
        return "killed"


def test_dpo_run_margin_rises_resumes_and_exports(tmp_path):
    cfg = dpo_config(tmp_path, packing=True, save_every=2)
    records = run_shared(train_worker, 2, cfg, kind="deepspeed")[0]
    margins = [r["reward_margin"] for r in records]
    assert margins[0] == pytest.approx(0.0, abs=1e-6)  # the policy starts as its reference copy
    assert all(b > a for a, b in zip(margins, margins[1:])), margins  # rising at every step
    assert records[-1]["reward_accuracy"] == 1.0 and records[-1]["loss"] < records[0]["loss"] - 0.3
    documents = [r["documents"] for r in records]
    assert max(documents) >= 4 and all(d % 2 == 0 for d in documents), documents  # packed: whole pairs, several
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["loss"] for m in metrics] == [r["loss"] for r in records]
    assert {"reward_margin", "reward_accuracy", "reward_chosen", "reward_rejected"} <= metrics[0].keys()
    assert (tmp_path / "run" / EXPORT_DIR / "config.json").exists()

    killed = replace(cfg, output_dir=str(tmp_path / "killed"), export=False)
    assert run_shared(train_worker, 2, killed, 3, kind="deepspeed") == ["killed", "killed"]
    resumed = run_shared(train_worker, 2, replace(killed, resume=True), kind="deepspeed")[0]
    np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in records[2:]], rtol=1e-6)


def test_dpo_lora_run_against_its_adapters_off(tmp_path):
    cfg = dpo_config(tmp_path, lora_r=4, steps=3, lr=1e-2)
    records = run_shared(train_worker, 2, cfg, kind="deepspeed")[0]
    margins = [r["reward_margin"] for r in records]
    assert margins[0] == pytest.approx(0.0, abs=1e-6)  # fresh adapters (B = 0): the policy is the reference
    assert margins[-1] > margins[1] > 0, margins
    assert (tmp_path / "run" / EXPORT_DIR / "adapter_config.json").exists()


def test_dpo_precomputed_reference_trains_as_the_copy_and_is_read_back_from_the_cache(tmp_path):
    # The precomputed reference is the model as loaded, as the frozen copy is: the same trajectory, without the copy.
    # 2 steps: the second's policy has moved from the reference.
    copy = run_shared(train_worker, 2, dpo_config(tmp_path, steps=2, export=False), kind="deepspeed")[0]
    pre = dpo_config(tmp_path, steps=2, export=False, dpo_reference="precomputed", output_dir=str(tmp_path / "pre"))
    first = run_shared(train_worker, 2, pre, kind="deepspeed")[0]
    (cached,) = (tmp_path / "cache").glob("dpo-reference-*.pt")
    mtime = cached.stat().st_mtime_ns
    again = run_shared(train_worker, 2, replace(pre, output_dir=str(tmp_path / "again")), kind="deepspeed")[0]
    assert cached.stat().st_mtime_ns == mtime  # read back, not computed again
    for run in (first, again):
        np.testing.assert_allclose([r["loss"] for r in run], [r["loss"] for r in copy], rtol=1e-6)
        np.testing.assert_allclose([r["reward_margin"] for r in run], [r["reward_margin"] for r in copy],
                                   rtol=1e-5, atol=1e-6)


def test_dpo_precomputed_reference_is_keyed_on_the_weights_not_the_folders_name(tmp_path):
    # The SFT-then-DPO flow: a folder trained with a precomputed reference, then overwritten in place with other
    # weights (this run's export, copied over with its mtimes, as cp -p would). The second run's reference must be
    # the new weights, so its first loss is ln 2 (policy == reference), not a loss against the old reference.
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from ulysses_lc.tiny import tiny_model_config, tiny_tokenizer

    folder = tmp_path / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_model_config("tiny")).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    cfg = dpo_config(tmp_path, model=str(folder), steps=2, lr=1e-2, dpo_reference="precomputed", packing=True)
    first = run_shared(train_worker, 2, cfg, kind="deepspeed")[0]
    assert first[0]["loss"] == pytest.approx(np.log(2), abs=1e-6) and first[-1]["reward_margin"] > 0
    for f in (tmp_path / "run" / EXPORT_DIR).glob("*.safetensors"):
        shutil.copy2(f, folder / f.name)  # in place: the same file, new bytes, the export's mtime
    again = run_shared(train_worker, 2, replace(cfg, steps=1, export=False, output_dir=str(tmp_path / "again")),
                       kind="deepspeed")[0]
    assert again[0]["loss"] == pytest.approx(np.log(2), abs=1e-6), again[0]
    assert again[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert len(list((tmp_path / "cache").glob("dpo-reference-*.pt"))) == 2  # the first entry stays for its weights


def test_weights_digest_reads_a_file_once_and_sees_every_rewrite(tmp_path):
    import hashlib

    from ulysses_lc.train.loading import weights_digest

    def expected(*named):
        return hashlib.sha256(json.dumps([list(n) for n in named]).encode()).hexdigest()

    folder, memo = tmp_path / "model", tmp_path / "memo"
    folder.mkdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(b"A" * 64)
    (folder / "config.json").write_text("{}")  # not weights: the config is keyed as loaded
    first = weights_digest(str(folder), 0, memo)
    assert first == expected(("model.safetensors", hashlib.sha256(b"A" * 64).hexdigest()))
    assert weights_digest(str(folder), 0, memo) == first and len(list(memo.iterdir())) == 1  # read once
    stat = weights.stat()
    while weights.stat().st_ctime_ns == stat.st_ctime_ns:  # file times tick coarsely (ms): a write in a later tick
        weights.write_bytes(b"B" * 64)  # the same size, in place, and the old mtime put back (cp -p, rsync -t)
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_mtime_ns == stat.st_mtime_ns and weights.stat().st_size == stat.st_size
    assert weights_digest(str(folder), 0, memo) == expected(("model.safetensors", hashlib.sha256(b"B" * 64).hexdigest()))
    # A hub snapshot's file links to a blob named by its content hash: the name is taken, the bytes are not read.
    blob = tmp_path / "hub" / "blobs" / ("c" * 64)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"not read")
    snapshot = tmp_path / "hub" / "snapshots" / ("d" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(blob)
    assert weights_digest(str(snapshot), 0) == expected(("model.safetensors", "c" * 64))
    assert weights_digest("tiny", 0) != weights_digest("tiny", 1)


def test_packed_pairs_weigh_as_in_trls_batch_over_accumulation_and_dp(tmp_path):
    # --packing puts one to several pairs into a sequence; global batch 4 on 2 ranks at sp 1 is 2 DP groups x 2 micro
    # steps. TRL's loss is the mean over its batch's pairs, each pair weighing the same: the first step's gradient
    # (its norm, which DeepSpeed logs before clipping) must be TRL's on the same pairs, within 1e-4 relative (the SP
    # model's loss and gradients match plain transformers' to 1e-5 / 1e-4, test_preference.py). Both losses are ln 2
    # (the reference is a copy of the policy); the gradient is not 0.
    import datasets
    import torch
    from accelerate.state import AcceleratorState
    from trl import DPOConfig, DPOTrainer

    from ulysses_lc.data import parse_source
    from ulysses_lc.data.pairs import PairStream
    from ulysses_lc.tiny import tiny_tokenizer
    from ulysses_lc.train.loading import load_model
    from ulysses_lc.train.preflight import preflight
    from ulysses_lc.train.settings import RunSettings

    cfg = dpo_config(tmp_path, packing=True, sp_size=1, global_batch=4, steps=1, export=False)
    tokenizer = tiny_tokenizer()
    stream = PairStream.build(parse_source(cfg.data), tokenizer, cfg.seq_len, packing=True)
    counts = [len(stream.sample(i)) for i in range(4)]
    assert len(set(counts)) > 1, counts  # pairs a sequence differ: a mean per sequence would weigh them unevenly
    (record,) = run_shared(train_worker, 2, cfg, kind="deepspeed")[0]

    rows = [json.loads(line) for line in open(cfg.data)][: sum(counts)]  # the step's pairs: packed in order
    config = preflight(RunSettings(replace(cfg, output_dir=str(tmp_path / "trl"))), 2).model_config
    policy, ref = (load_model("tiny", config, torch.float32, cfg.seed, torch.device("cpu"), {}) for _ in range(2))
    args = DPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to=[], max_length=None,
                     beta=cfg.dpo_beta)
    trainer = DPOTrainer(model=policy.train(), ref_model=ref, args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list(rows))
    loss = trainer.compute_loss(trainer.model, trainer.data_collator([trainer.train_dataset[i] for i in
                                                                       range(len(rows))]))
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in trainer.model.parameters() if p.grad is not None))
    AcceleratorState._reset_state(reset_partial_state=True)
    assert record["loss"] == pytest.approx(loss.item(), rel=1e-5) and loss.item() == pytest.approx(np.log(2))
    assert record["grad_norm"] == pytest.approx(norm.item(), rel=1e-4), (record["grad_norm"], norm.item())


def refused_worker(rank, world_size, cfg):
    try:
        train(cfg)
    except ValueError as e:
        return str(e)
    return None


def test_dpo_pair_longer_than_seq_len_is_refused_before_the_weights_load(tmp_path):
    cfg = dpo_config(tmp_path, seq_len=256, data=pairs_file(tmp_path, n=2, max_chars=400))
    for message in run_shared(refused_worker, 2, cfg, kind="deepspeed"):
        assert "longer than the sequence length 256" in message and "raise --seq-len to at least" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


class _NoEosTokenizer:
    """Bytes as tokens and no EOS: an empty completion stays empty."""

    eos_token = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": list(text.encode())}


def test_pairs_that_cannot_train_and_misplaced_flags_are_refused(tmp_path):
    from ulysses_lc.data import parse_source
    from ulysses_lc.data.pairs import read_pairs
    from ulysses_lc.train.preference_step import check_pair_source
    from ulysses_lc.train.settings import RunSettings

    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "Say hi.", "chosen": "", "rejected": "No."}) + "\n")
    with pytest.raises(ValueError, match="no chosen completion tokens"):
        read_pairs(parse_source(str(path)), _NoEosTokenizer(), 1024)
    path.write_text(json.dumps({"prompt": "Say hi.", "answer": "hi"}) + "\n")
    with pytest.raises(ValueError, match="has no chosen, rejected"):
        read_pairs(parse_source(str(path)), _NoEosTokenizer(), 1024)
    for bad, words in [(dict(method="sft", dpo_beta=0.5), "add --method dpo"),
                       (dict(dpo_reference="adapters"), "add --lora-r"),
                       (dict(dpo_loss="ipo", dpo_label_smoothing=0.1), "label_smoothing"),
                       (dict(loss_on="all"), "drop --loss-on")]:
        with pytest.raises(ValueError, match=words):
            dpo_config(tmp_path, **bad).check()
    text = tmp_path / "book.txt"
    text.write_text("plain prose")
    with pytest.raises(ValueError, match="preference rows"):
        check_pair_source(RunSettings(dpo_config(tmp_path, data=str(text))).stream)


def test_dry_run_counts_the_reference_copy_or_its_absence():
    from ulysses_lc.shape import ModelShape
    from ulysses_lc.train import dry_run
    from ulysses_lc.train.estimate import count_params, job_for
    from ulysses_lc.train.preflight import preflight
    from ulysses_lc.train.settings import RunSettings

    base = dict(model="tiny", data="tiny", seq_len=8192, dry_run=True, world_size=2, method="dpo")
    assert "reference a frozen copy, ZeRO-3 partitioned like the policy" in dry_run(TrainConfig(**base))
    assert "adapters off: no second model" in dry_run(TrainConfig(lora_r=4, **base))
    assert "reference precomputed" in dry_run(TrainConfig(dpo_reference="precomputed", **base))
    cfg = TrainConfig(**base)
    checked = preflight(RunSettings(cfg), 2)
    n = count_params(checked.model_config)
    shape = ModelShape.from_config(checked.model_config)
    sft = job_for(RunSettings(replace(cfg, method="sft")), checked, n).state_bytes()
    dpo = job_for(RunSettings(cfg), checked, n).state_bytes()
    # The copy's bf16 partition, and the second document's fp32 head-gradient accumulator (the head trains).
    assert dpo[0] - sft[0] == 2 * -(-n // 2) + shape.vocab * shape.hidden * 4 and dpo[1] == sft[1]
    precomputed = job_for(RunSettings(replace(cfg, dpo_reference="precomputed")), checked, n).state_bytes()
    assert precomputed[0] - sft[0] == shape.vocab * shape.hidden * 4  # no copy
    lora = TrainConfig(lora_r=4, **base)
    checked = preflight(RunSettings(lora), 2)
    assert job_for(RunSettings(lora), checked, n).state_bytes() == \
        job_for(RunSettings(replace(lora, method="sft")), checked, n).state_bytes()


# BENCHMARKS.md, "DPO beside SFT": the Qwen3-8B shape, LoRA r 16, one pair of two 131,072-token documents as one
# sequence (DPO), or one of those documents (SFT), the plan the run made; torch.cuda.max_memory_allocated (GB).
H200_POINTS = [  # layers, DPO, tokens, plan, measured
    (8, True, 2 * 131072, (3, 3, 0), 110.0),  # priced as packed short documents it was 123.7 GB, 12% over
    (36, True, 2 * 131072, (31, 2, 0), 119.3),  # benchmarks/results/2026-12-01/dpo_8b-36layers_2x128k.json
    (36, False, 131072, (25, 3, 25), 123.3),  # the SFT step beside it, same call
]


@pytest.mark.parametrize("layers, dpo, tokens, plan, measured", H200_POINTS)
def test_dry_run_prices_the_dpo_step_measured_on_an_h200(layers, dpo, tokens, plan, measured):
    # The prediction must hold the measured peak from above within 10% (as packed short documents the 36-layer
    # DPO step is priced 133.0 GB, 11% over).
    from transformers import Qwen3Config

    from ulysses_lc import MemoryPlan, ModelShape
    from ulysses_lc.parallel.ds_config import load_deepspeed_config
    from ulysses_lc.peft_support import count_trainable_parameters, lora_config
    from ulysses_lc.plan.sizing import GB, Job

    config = Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    total, trainable = count_trainable_parameters(config, lora_config(16))
    job = Job.from_ds_config(ModelShape.from_config(config), total, 1, 1, load_deepspeed_config("zero3"), packed=dpo,
                             trainable_params=trainable, preference=dpo, long_documents=dpo)
    predicted = job.predict(tokens, MemoryPlan(*plan)).gpu / GB
    assert measured <= predicted <= 1.10 * measured, predicted


def test_dpo_of_long_pairs_prices_its_documents_as_long():
    from ulysses_lc.train.settings import RunSettings

    assert RunSettings(TrainConfig(method="dpo", seq_len=262144)).stream.long_documents
    assert not RunSettings(TrainConfig(method="dpo", seq_len=262144, packing=True)).stream.long_documents


def test_dpo_data_parallel_run_each_group_its_own_pairs(tmp_path):
    # sp 1 on 2 ranks: two DP groups, one pair each per step. The precomputed reference must be each group's own
    # pair's (window indexing under DP): it trains the frozen copy's trajectory.
    base = dict(steps=2, export=False, sp_size=1)
    copy = run_shared(train_worker, 2, dpo_config(tmp_path, **base), kind="deepspeed")[0]
    assert [r["documents"] for r in copy] == [4, 4]  # 2 pairs a step, over both groups
    assert copy[0]["loss"] == pytest.approx(np.log(2), abs=1e-6) and copy[-1]["reward_margin"] > 0
    pre = dpo_config(tmp_path, dpo_reference="precomputed", output_dir=str(tmp_path / "pre"), **base)
    precomputed = run_shared(train_worker, 2, pre, kind="deepspeed")[0]
    np.testing.assert_allclose([r["loss"] for r in precomputed], [r["loss"] for r in copy], rtol=1e-6)
