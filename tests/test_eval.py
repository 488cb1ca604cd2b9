"""Evaluation at length (issue 41, section 2): loss by position and the passkey, against plain transformers.

The reference is plain transformers' forward on the same text: each row's cross-entropy from its logits, averaged
over the whole sequence and over each position bucket; for the passkey, the key rows' log-probabilities and argmax.
The SP side runs on 2 gloo ranks, at sp 2 and at sp 1 x dp 2 (each DP group its share of the sequences, the short
one repeating an uncounted sequence). Tolerance (fp32): 1e-5 relative on every mean loss and log-probability.
"""

import json
import math
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests._dist import run_shared
from tests.models import VOCAB, build
from ulysses_lc import IGNORE_INDEX, MemoryPlan, ParallelLayout, SequenceParallelCausalLM
from ulysses_lc.data import Sample, build_token_stream
from ulysses_lc.eval import Buckets, EvalResult, build_haystacks, compare_lines, evaluate, plot
from ulysses_lc.eval.data import eval_windows
from ulysses_lc.eval.passkey import key_tokens, make_key
from ulysses_lc.tiny import tiny_text, tiny_tokenizer

RTOL = 1e-5
SEQ = 301  # odd: sp 2 pads the last rank's slice
TRAINED = 100  # marked between equal-width buckets, as a trained length inside one would be


def _sequences():
    g = torch.Generator().manual_seed(7)
    plain = [torch.randint(0, VOCAB, (SEQ,), generator=g) for _ in range(2)]
    ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
    labels = ids.clone()
    labels[130:150] = IGNORE_INDEX  # a prompt inside the second document, as --loss-on completion leaves
    packed = Sample(ids, labels, [120, SEQ - 120], 2, 0)
    return [*plain, packed]


def _reference_rows(model, sequences):
    """[(position, loss)] of every labelled row of every sequence, from plain transformers' logits; packed documents
    run one by one, positions from 0 in each."""
    rows = []
    with torch.no_grad():
        for item in sequences:
            ids, labels, lengths = (item, item, [SEQ]) if torch.is_tensor(item) else \
                (item.input_ids, item.labels, item.document_lengths)
            start = 0
            for n in lengths:
                doc_ids, doc_labels = ids[start:start + n], labels[start:start + n]
                logits = model(input_ids=doc_ids[None]).logits[0].float()
                loss = F.cross_entropy(logits[:-1], doc_labels[1:], ignore_index=IGNORE_INDEX, reduction="none")
                rows += [(p, loss[p].item()) for p in range(n - 1) if doc_labels[p + 1] != IGNORE_INDEX]
                start += n
    return rows


def _eval_worker(rank, world_size, family, sequences, haystacks):
    results = {}
    # Every lever that assumes a backward armed: each layer checkpointed, offloaded down to the smallest tensor,
    # keeping its attention output. Evaluation in eval mode and under no_grad leaves them all unused.
    backward_levers = dict(plan=MemoryPlan.everything_checkpointed(2, keep_attention=True), min_offload_bytes=0)
    for sp, levers in ((2, backward_levers), (1, {}), (2, dict(chunked_loss=False, tiled_mlp=False))):
        layout = ParallelLayout.build(sp)
        model = SequenceParallelCausalLM(build(family), layout, **levers)
        result = evaluate(model, sequences, haystacks, buckets=4, trained_length=TRAINED, vocab_size=VOCAB)
        assert model.training  # back in the mode it was in
        held = model.checkpointing
        assert (held.host_bytes, held.host_pool_bytes, held.context.running(0), held.context.running(1)) == \
            (0, 0, None, None)
        results[f"sp{sp}" + ("_plain_head" if "chunked_loss" in levers else "")] = result
    return results


@pytest.mark.parametrize("family", ["llama", "gemma3"])  # gemma3: sliding windows and final logit soft-capping
def test_eval_loss_by_position_and_key_scores_equal_plain_transformers_at_sp_1_and_2(family):
    sequences = _sequences()
    g = torch.Generator().manual_seed(3)
    # Haystacks scored on random weights: their numbers, not retrieval, are compared here (the byte tokenizer's
    # ids lie above this tiny vocabulary, so the haystacks are random ids, with the key rows chosen by hand).
    haystacks = [h for h in build_haystacks(_ByteIds(), [torch.randint(0, VOCAB, (SEQ,), generator=g)], SEQ,
                                            depths=[0.0, 1.0], digits=3)]
    results = run_shared(_eval_worker, 2, family, sequences, haystacks)
    assert results[0] == results[1]  # every rank holds the whole result
    reference = build(family).eval()
    rows = _reference_rows(reference, sequences)
    edges = Buckets.make(SEQ, 4, TRAINED).edges
    assert edges == (0, 75, 100, 150, 225, SEQ)
    keys = []
    with torch.no_grad():
        for h in haystacks:
            logp = reference(input_ids=h.input_ids[None]).logits[0].float().log_softmax(-1)
            span = range(h.key_start - 1, h.key_start + h.key_tokens - 1)
            keys.append((sum(logp[r, h.input_ids[r + 1]].item() for r in span) / h.key_tokens,
                         sum(int(logp[r].argmax() == h.input_ids[r + 1]) for r in span) / h.key_tokens))
    for name, result in results[0].items():
        assert result.tokens == len(rows) and result.sequences == 3, name
        assert math.isclose(result.loss, np.mean([loss for _, loss in rows]), rel_tol=RTOL), (name, result.loss)
        for bucket, lo, hi in zip(result.buckets, edges, edges[1:]):
            expected = [loss for p, loss in rows if lo <= p < hi]
            assert (bucket.start, bucket.end, bucket.tokens, bucket.beyond_trained) == (lo, hi, len(expected), lo >= TRAINED)
            assert math.isclose(bucket.loss, np.mean(expected), rel_tol=RTOL), (name, bucket)
        for depth, (logp, accuracy) in zip(result.passkey, keys):
            assert math.isclose(depth.logp, logp, rel_tol=RTOL) and depth.token_accuracy == accuracy, (name, depth)


class _ByteIds:
    """A stand-in tokenizer inside the tests' tiny vocabulary (VOCAB ids): character code mod VOCAB, digits kept
    apart, so the haystack's prompt and key fit the random-weight models above."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def decode(self, ids):
        return "".join(chr(i) if i >= 32 else "?" for i in ids)


# -- the passkey finds what a model learned, and misses what it did not ----------------------------------------

PASSKEY_SEQ = 512


def _trained_to_answer(key_seed: int):
    """A tiny Llama (byte tokenizer) trained, plain transformers on one process, to answer the passkey question with
    seed `key_seed`'s key, the needle hidden at every depth: it learned that key, not to read the needle."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = tiny_tokenizer()
    fillers = [torch.tensor(tokenizer(tiny_text(3 * PASSKEY_SEQ, seed=s), add_special_tokens=False)["input_ids"])
               for s in range(2)]
    train = [h for h in build_haystacks(tokenizer, fillers, PASSKEY_SEQ, depths=[0.0, 0.3, 0.6, 1.0], seeds=2)
             if h.seed == key_seed]
    config = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids, labels = torch.stack([h.input_ids for h in train]), torch.stack([h.labels for h in train])
    for _ in range(25):
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return config, model.state_dict(), fillers


def _passkey_worker(rank, world_size, config, state, fillers):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    hf.load_state_dict(state)
    model = SequenceParallelCausalLM(hf, ParallelLayout.build(2))
    haystacks = build_haystacks(tiny_tokenizer(), fillers, PASSKEY_SEQ, depths=[0.0, 0.5, 1.0], seeds=2)
    return [evaluate(model, haystacks=[h for h in haystacks if h.seed == seed], trained_length=256) for seed in (0, 1)]


def test_passkey_finds_the_key_a_model_was_trained_on_and_misses_another_at_sp_2():
    assert all(a != b for a, b in zip(make_key(0, 5), make_key(1, 5)))  # no digit of the other key is right by luck
    config, state, fillers = _trained_to_answer(key_seed=0)
    trained, other = run_shared(_passkey_worker, 2, config, state, fillers)[0]
    assert [p.depth for p in trained.passkey] == [0.0, 0.5, 1.0]
    assert all(p.found == 1.0 and p.token_accuracy == 1.0 and p.logp > -0.5 for p in trained.passkey), trained.passkey
    assert all(p.found == 0.0 and p.token_accuracy < 0.5 and p.logp < -3 for p in other.passkey), other.passkey
    assert trained.loss is None and "passkey 3/3 found, 100% of key tokens" in trained.line()
    assert "passkey 0/3 found" in other.line()


def test_key_tokens_leave_the_leading_space_to_the_question():
    tokenizer = tiny_tokenizer()
    question, key = key_tokens(tokenizer, "46311")
    assert tokenizer.decode(key) == "46311" and tokenizer.decode(question).endswith("key is ")


# -- refusals, the held-out text, the report ---------------------------------------------------------------------

def test_bad_eval_inputs_are_refused_with_the_fix(tmp_path):
    tokenizer = tiny_tokenizer()
    filler = torch.zeros(4096, dtype=torch.long)
    with pytest.raises(ValueError, match=r"longer than the haystack of 200 tokens; evaluate at a length of at least"):
        build_haystacks(tokenizer, [filler], 200)
    with pytest.raises(ValueError, match="longer than the haystack"):
        build_haystacks(tokenizer, [filler], 1024, digits=900)  # a key longer than the haystack
    with pytest.raises(ValueError, match=r"depths \[0.5, 2.0\]: give shares of the haystack in \[0, 1\]"):
        build_haystacks(tokenizer, [filler], 1024, depths=[0.5, 2])
    with pytest.raises(ValueError, match="fewer than the"):
        build_haystacks(tokenizer, [filler[:100]], 1024)
    short = tmp_path / "short.txt"
    short.write_text("far too short for the length")
    with pytest.raises(ValueError, match=r"evaluation text .*short.txt.* cannot be read as windows of 1,024 tokens.*"
                                         r"give a longer text"):
        eval_windows(str(short), tokenizer, 1024, 1, cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match="bucket starts"):
        Buckets.make(1024, [0, 512, 2048])


def test_held_out_windows_are_never_read_by_training_and_a_short_source_is_refused(tmp_path):
    path = tmp_path / "ids.npy"
    np.save(path, np.arange(10 * 64, dtype=np.uint32))  # 10 windows of 64 ids, each id its own position
    stream = build_token_stream(str(path), None, 64, num_steps=6, held_out=2, cache_dir=tmp_path / "c", progress=False)
    held = stream.held_out
    assert len(stream) == 6 and len(held) == 2
    read = set()
    for step in range(40):  # training wraps around many times
        read.update(stream.sample(step).input_ids.tolist())
    assert read == set(range(6 * 64))  # all of its own windows, and nothing of the held-out ones
    assert {i for w in range(2) for i in held.sample(w).input_ids.tolist()} == set(range(6 * 64, 8 * 64))
    assert held.stream_id != stream.stream_id
    with pytest.raises(ValueError, match=r"held-out evaluation needs 5 more .* \(--eval-data\)"):
        build_token_stream(str(path), None, 64, num_steps=6, held_out=5, cache_dir=tmp_path / "c", progress=False)


def test_held_out_split_keeps_packed_windows_whole(tmp_path):
    from ulysses_lc.data.stream import TokenStream, WindowDocuments

    tokens = np.arange(3 * 8)
    docs = WindowDocuments(np.array([3, 5, 8, 2, 4, 2]), np.array([0, 2, 3, 6]), np.array([0, 0, 2]))
    stream = TokenStream(tokens, 8, stream_id="s", documents=docs)
    first, rest = stream.split(2)
    assert [first.sample(w).document_lengths for w in range(2)] == [[3, 5], [8]]
    assert rest.sample(0).document_lengths == [2, 4, 2] and rest.sample(0).padding_tokens == 2
    assert rest.sample(0).input_ids.tolist() == list(range(16, 24))


def _result(loss_shift=0.0, found=1.0):
    from ulysses_lc.eval import BucketLoss, PasskeyDepth

    buckets = [BucketLoss(0, 4096, 3.0 + loss_shift, 4096, False), BucketLoss(4096, 8192, 3.1 + loss_shift, 4096, False),
               BucketLoss(8192, 16384, 3.6 + loss_shift, 8192, True)]
    passkey = [PasskeyDepth(0.0, 30, 2, found, 0.9, -0.2), PasskeyDepth(1.0, 16000, 2, 1.0, 1.0, -0.1)]
    return EvalResult(16384, 3.3 + loss_shift, 16383, 1, buckets, 8192, passkey)


def test_report_line_json_scalars_comparison_and_plot(tmp_path, monkeypatch):
    result = _result()
    assert result.line(40) == ("eval step 40 | loss 3.3000 | by position 3.00 3.10 [8,192] 3.60 | passkey 4/4 found, "
                               "95% of key tokens (logp -0.15)")
    assert EvalResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    scalars = result.scalars()
    assert scalars["eval/loss"] == 3.3 and scalars["eval/loss_pos_8192"] == 3.6
    assert scalars["eval/passkey_found_depth_1"] == 1.0
    lines = compare_lines(_result(), _result(-0.5, 0.5), ("base", "trained"))
    assert any(line.startswith("pos 8,192-16,384 *") and line.endswith("-0.5000") for line in lines), lines
    assert any("passkey depth 0 found" in line and line.endswith("-0.5000") for line in lines), lines
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "pip install 'ulysses_lc[plot]'" in plot({"a": result}, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
