"""Dataset sources, loss masks and packing: each against a hand-built reference or the tokenizer's own chat template."""

import json
import os
import re
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no test here may reach the network

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from ulysses_lc.constants import IGNORE_INDEX  # noqa: E402
from ulysses_lc.data import build_token_stream, check_source, packing  # noqa: E402
from ulysses_lc.tiny import tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def tiny_unmarked():
    """The tiny tokenizer without {% generation %} marks: masks come from rendering conversation prefixes."""
    tok = tiny_tokenizer()
    tok.chat_template = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", tok.chat_template)
    assert "% generation" not in tok.chat_template and "{% endgeneration" not in tok.chat_template
    return tok


def build(source, tokenizer, seq_len, num_steps, tmp_path, **kw):
    kw.setdefault("local_rank", 0)
    return build_token_stream(source, tokenizer, seq_len, num_steps, cache_dir=tmp_path / "cache", progress=False, **kw)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(i, turns=1):
    messages = [{"role": "system", "content": f"sys {i}"}]
    for t in range(turns):
        messages += [{"role": "user", "content": f"question {i}.{t} " * (1 + i % 3)},
                     {"role": "assistant", "content": f"answer {i}.{t} " * (1 + i % 4)}]
    return {"messages": messages}


def labels_of(ids, mask):
    return [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def whole(stream):
    """The stream's tokens and labels, all windows end to end."""
    samples = [stream.sample(k) for k in range(len(stream))]
    return torch.cat([s.input_ids for s in samples]).tolist(), torch.cat([s.labels for s in samples]).tolist()


# --- loss masks ------------------------------------------------------------------------------


def test_prompt_completion_mask_equals_hand_built(tiny, tmp_path):
    rows = [{"prompt": f"Q{i}: " + "p" * i, "completion": f"A{i} " + "c" * (7 - i % 5)} for i in range(12)]
    path = tmp_path / "pc.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    ids, labels = [], []
    for r in rows:  # tiny: one token per byte; the completion and the EOS after it are trained
        prompt, completion = list(r["prompt"].encode()), list(r["completion"].encode())
        ids += prompt + completion + [tiny.eos_token_id]
        labels += [IGNORE_INDEX] * len(prompt) + completion + [tiny.eos_token_id]
    stream = build(path, tiny, 50, len(ids) // 50, tmp_path)
    got_ids, got_labels = whole(stream)
    n = 50 * len(stream)
    assert got_ids == ids[:n] and got_labels == labels[:n]
    everything = build(path, tiny, 50, len(ids) // 50, tmp_path, loss_on="all")
    assert whole(everything)[1] == ids[:n]


@pytest.mark.parametrize("marked", [True, False])
def test_chat_equals_apply_chat_template_and_trains_assistant_turns(tiny, tiny_unmarked, tmp_path, marked):
    tok = tiny if marked else tiny_unmarked
    rows = [chat(i, turns=1 + i % 3) for i in range(10)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    ids, labels = [], []
    for r in rows:
        ref = tiny.apply_chat_template(r["messages"], tokenize=True, return_dict=True,
                                       return_assistant_tokens_mask=True)
        assert tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"] == ref["input_ids"]
        mask = list(ref["assistant_masks"])
        if not marked:
            # Without marks an assistant turn is all the template writes until the next turn begins:
            # also the "\n" after "<|end|>", and so the EOS after the last turn.
            mask = [int(m or (t and mask[t - 1])) for t, m in enumerate(mask)]
        ids += ref["input_ids"] + [tok.eos_token_id]
        labels += labels_of(ref["input_ids"], mask) + [tok.eos_token_id if mask[-1] else IGNORE_INDEX]
    stream = build(path, tok, 64, len(ids) // 64, tmp_path)
    got_ids, got_labels = whole(stream)
    n = 64 * len(stream)
    assert got_ids == ids[:n] and got_labels == labels[:n]
    trained = bytes(t for t, lab in zip(got_ids, got_labels) if lab != IGNORE_INDEX and t < 256).decode()
    assert "answer 0.0" in trained and "question" not in trained and "sys" not in trained


def test_conversational_prompt_completion(tiny_unmarked, tmp_path):
    tok = tiny_unmarked
    rows = [{"prompt": chat(i)["messages"][:2], "completion": chat(i)["messages"][2:]} for i in range(6)]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    ids, labels = [], []
    for r in rows:
        full = tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True)["input_ids"]
        prompt = tok.apply_chat_template(r["prompt"], tokenize=True, return_dict=True,
                                         add_generation_prompt=True)["input_ids"]
        assert full[: len(prompt)] == prompt
        ids += full + [tok.eos_token_id]
        labels += [IGNORE_INDEX] * len(prompt) + full[len(prompt):] + [tok.eos_token_id]
    stream = build(path, tok, 40, len(ids) // 40, tmp_path)
    n = 40 * len(stream)
    assert whole(stream) == (ids[:n], labels[:n])


# A chat template that reads what TRL passes from a row: its tools (written out before the conversation) and a
# chat_template_kwargs variable (enable_thinking=False writes an empty thought block before each answer, Qwen3's way).
TOOLS_TEMPLATE = (
    "{%- if tools -%}{{- '<|tools|>\\n' + (tools | tojson) + '<|end|>\\n' -}}{%- endif -%}"
    "{%- set think = '<think></think>' if enable_thinking is defined and not enable_thinking else '' -%}"
    "{%- for message in messages -%}"
    "{{- '<|' + message['role'] + '|>\\n' -}}"
    "{%- if message['role'] == 'assistant' -%}{{- think -}}"
    "{% generation %}{{- message['content'] + '<|end|>' -}}{% endgeneration %}"
    "{%- else -%}{{- message['content'] + '<|end|>' -}}{%- endif -%}"
    "{{- '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' + think -}}{%- endif -%}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def tools_tokenizer():
    """The tiny tokenizer with TOOLS_TEMPLATE."""
    tok = tiny_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    return tok


def tools_rows(i, tools_as_text=False):
    """A conversation with tools and enable_thinking (off on even rows), as `messages`."""
    user = {"role": "user", "content": f"Weather in city {i}?" + " please" * (i % 3)}
    answer = {"role": "assistant", "content": f"Sunny, {10 + i} degrees."}
    return {"messages": [user, answer], "tools": json.dumps(TOOLS) if tools_as_text else TOOLS,
            "chat_template_kwargs": {"enable_thinking": bool(i % 2)}}


def trl_sft_rows(tok, dataset, **sft_args):
    """TRL 1.16's SFTTrainer's own tokenization of `dataset`: (input_ids, labels) per row."""
    from accelerate.state import AcceleratorState
    from trl import SFTConfig, SFTTrainer

    from tests.models import build

    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, use_cpu=True, bf16=False, report_to=[], max_length=None, **sft_args)
        trainer = SFTTrainer(model=build("qwen3", vocab_size=len(tok)), args=args, processing_class=tok,
                             train_dataset=dataset)
        rows = [(r["input_ids"], r["labels"]) for r in trainer.train_dataset]
    AcceleratorState._reset_state(reset_partial_state=True)
    return rows


def test_samples_are_trls_tokens_with_the_rows_tools_and_template_kwargs():
    # Token for token against TRL's SFTTrainer on the same rows: chat (messages, tools as JSON text, marked template,
    # TRL's assistant_only_loss), conversational prompt/completion (tools as a list), and plain text and
    # prompt/completion. The one difference is ours by design: a sample ends with the EOS, appended (and trained after
    # a trained token) where the rendering does not end with it; TRL appends it to plain rows only.
    pytest.importorskip("trl")
    from ulysses_lc.data.samples import detect_format, iter_samples

    tok = tools_tokenizer()
    eos = tok.eos_token_id
    chats = [tools_rows(i, tools_as_text=True) for i in range(4)]
    prompt_completion = [{"prompt": r["messages"][:1], "completion": r["messages"][1:], "tools": r["tools"],
                          "chat_template_kwargs": r["chat_template_kwargs"]} for r in map(tools_rows, range(4))]
    plain_text = [{"text": f"document {i} " * (i + 1)} for i in range(3)]
    plain_pc = [{"prompt": f"Q{i}: why?", "completion": f" because {i}"} for i in range(3)]
    cases = [(chats, dict(assistant_only_loss=True)), (prompt_completion, {}), (plain_text, {}), (plain_pc, {})]
    for raw, sft_args in cases:
        dataset = datasets.Dataset.from_list(raw)
        rows = list(dataset)  # the rows as a dataset source gives them (tools as Arrow makes them)
        fmt = detect_format(rows[0])
        reference = trl_sft_rows(tok, dataset, **sft_args)
        ours = list(iter_samples(iter(rows), tok, fmt, "all" if fmt == "text" else "completion"))
        for (index, ids, mask), (ref_ids, ref_labels) in zip(ours, reference, strict=True):
            ids, labels = ids.tolist(), labels_of(ids.tolist(), mask)
            if ref_ids[-1] != eos:
                ref_ids = [*ref_ids, eos]
                ref_labels = [*ref_labels, eos if ref_labels[-1] != IGNORE_INDEX else IGNORE_INDEX]
            assert ids == ref_ids, (fmt, index, tok.decode(ids), tok.decode(ref_ids))
            assert labels == ref_labels, (fmt, index)
        if raw is chats:  # the same tokens without the template's marks, the assistant spans found by rendering
            unmarked = tools_tokenizer()
            unmarked.chat_template = re.sub(r"{%-?\s*(end)?generation\s*-?%}", "", TOOLS_TEMPLATE)
            again = list(iter_samples(iter(rows), unmarked, fmt, "completion"))
            assert [ids.tolist() for _, ids, _ in again] == [ids.tolist() for _, ids, _ in ours]
            trained = bytes(t for _, ids, mask in again for t, m in zip(ids, mask) if m and t < 256).decode()
            assert "Sunny" in trained and "weather" not in trained and "think" not in trained


def test_csv_and_a_folder_of_jsonl_as_plain_text(tiny, tmp_path):
    texts = [f"document number {i} " * (i + 1) for i in range(8)]
    datasets.Dataset.from_list([{"id": i, "body": t} for i, t in enumerate(texts)]).to_csv(str(tmp_path / "d.csv"))
    expected = list(f"{tiny.eos_token}".join(texts).encode().replace(tiny.eos_token.encode(), bytes([0])))
    expected = [tiny.eos_token_id if b == 0 else b for b in expected]  # EOS between documents, as for .txt
    stream = build(tmp_path / "d.csv", tiny, 100, 3, tmp_path, text_column="body")
    assert stream.tokens.tolist() == expected[:300] and stream.mask is None
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", [{"text": t} for t in texts[4:]])
    write_jsonl(folder / "a.jsonl", [{"text": t} for t in texts[:4]])
    assert build(folder, tiny, 100, 3, tmp_path).tokens.tolist() == expected[:300]


# --- packing ---------------------------------------------------------------------------------


def test_first_fit_decreasing():
    lengths = [5, 9, 2, 7, 3, 3, 8, 1, 10]
    bins = packing.first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)
    assert len(bins) == -(-sum(lengths) // 10)  # optimal here: 48 tokens in 5 bins
    assert bins == packing.first_fit_decreasing(lengths, 10)


def _packing_rows(n=40):
    return [{"prompt": f"p{i} " * (1 + i % 5), "completion": f"c{i} " * (1 + (7 * i) % 11)} for i in range(n)]


def _reference_samples(tok, rows):
    out = []
    for r in rows:
        prompt, completion = list(r["prompt"].encode()), list(r["completion"].encode())
        ids = prompt + completion + [tok.eos_token_id]
        out.append((ids, [IGNORE_INDEX] * len(prompt) + completion + [tok.eos_token_id]))
    return out


def test_packing_keeps_samples_whole_and_lengths_add_up(tiny, tmp_path):
    rows = _packing_rows()
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    reference = _reference_samples(tiny, rows)
    seq_len = 128
    stream = build(path, tiny, seq_len, 6, tmp_path, packing=True, pack_buffer=2)
    assert len(stream) == 6
    seen = []
    for k in range(len(stream)):
        s = stream.sample(k)
        assert sum(s.document_lengths) == seq_len and torch.equal(s.input_ids, stream.sequence(k))
        assert s.num_documents == len(s.document_lengths) - (s.padding_tokens > 0)
        at = 0
        for length in s.document_lengths[: s.num_documents]:
            ids, labels = s.input_ids[at : at + length].tolist(), s.labels[at : at + length].tolist()
            match = [j for j, (ref_ids, _) in enumerate(reference) if ref_ids == ids]
            assert match, "a packed document is not a whole sample"
            # The first label of a document is ignored: nothing in the document precedes it.
            assert labels == [IGNORE_INDEX] + reference[match[0]][1][1:]
            seen.append(match[0])
            at += length
        assert (s.labels[at:] == IGNORE_INDEX).all() and at + s.padding_tokens == seq_len
    assert len(seen) == len(set(seen)) and sum(s.padding_tokens for s in map(stream.sample, range(6))) < seq_len * 2
    # Deterministic, and a shorter run's windows are the longer run's first windows (resume).
    again = build_token_stream(path, tiny, seq_len, 3, cache_dir=tmp_path / "other", progress=False, local_rank=0,
                               packing=True, pack_buffer=2)
    for k in range(3):
        a, b = again.sample(k), stream.sample(k)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
        assert a.document_lengths == b.document_lengths


def test_long_samples_split_or_refused(tiny, tmp_path):
    rows = [{"text": "x" * 10}, {"text": "y" * 70}, {"text": "z" * 5}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    stream = build(path, tiny, 32, 3, tmp_path, packing=True)
    pieces = sorted(length for k in range(len(stream)) for length in stream.sample(k).document_lengths[
        : stream.sample(k).num_documents])
    assert pieces == sorted([11, 32, 32, 7, 6])  # 71 tokens (with EOS) cut into 32 + 32 + 7
    with pytest.raises(ValueError, match=r"sample 1 has 71 tokens, more than seq_len=32.*long_samples='split'"):
        build(path, tiny, 32, 4, tmp_path, packing=True, long_samples="refuse")
    with pytest.raises(ValueError, match="sample 1 has 71 tokens"):
        check_source(path, tiny, seq_len=32, packing=True, long_samples="refuse")


def test_packed_stream_resumes(tiny, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", _packing_rows())
    stream = build(path, tiny, 128, 4, tmp_path, packing=True)
    stream.position = 2
    resumed = build(path, tiny, 128, 4, tmp_path, packing=True)
    resumed.load_state_dict(stream.state_dict())
    assert resumed.position == 2
    with pytest.raises(ValueError, match="same source and tokenizer"):
        build(path, tiny, 128, 4, tmp_path).load_state_dict(stream.state_dict())  # unpacked: another stream


# --- cache -----------------------------------------------------------------------------------


def test_cache_hit_on_rerun_and_miss_when_a_setting_changes(tiny, tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "chat.jsonl", [chat(i) for i in range(12)])
    first = build(path, tiny, 256, 3, tmp_path, packing=True)
    assert not first.cache_hit
    from ulysses_lc.data import build as build_module

    with monkeypatch.context() as m:
        m.setattr(build_module, "iter_samples", lambda *a, **k: pytest.fail("a cache hit must not tokenize"))
        second = build(path, tiny, 256, 3, tmp_path, packing=True)
    assert second.cache_hit and second.cache_path == first.cache_path
    assert np.array_equal(first.mask, second.mask) and np.array_equal(first.tokens, second.tokens)
    changed = [
        build(path, tiny, 256, 3, tmp_path),  # no packing
        build(path, tiny, 256, 3, tmp_path, packing=True, loss_on="all"),
        build(path, tiny, 256, 3, tmp_path, packing=True, long_samples="refuse"),
        build(path, tiny, 256, 3, tmp_path, packing=True, pack_buffer=8),
    ]
    other_template = tiny_tokenizer()
    other_template.chat_template = other_template.chat_template.replace("<|end|>", "<|stop|>")
    changed.append(build(path, other_template, 256, 3, tmp_path, packing=True))
    write_jsonl(path, [chat(i) for i in range(13)])  # new content, size or mtime
    changed.append(build(path, tiny, 256, 3, tmp_path, packing=True))
    assert not any(s.cache_hit for s in changed)
    assert len({s.cache_path for s in changed} | {first.cache_path}) == len(changed) + 1


# --- bad input: each a ValueError with the fix, from check_source before any weights would load ----


def test_missing_column_names_the_columns(tiny, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"title": "a", "body": "b"}])
    with pytest.raises(ValueError, match=r"columns \['title', 'body'\].*text_column"):
        check_source(path, tiny)
    with pytest.raises(ValueError, match=r"text_column='content' is not a column.*\['title', 'body'\]"):
        check_source(path, tiny, text_column="content")
    with pytest.raises(ValueError, match=r"columns \['title', 'body'\]"):
        build(path, tiny, 16, 1, tmp_path)


def test_empty_dataset(tiny, tmp_path):
    path = tmp_path / "empty.parquet"
    datasets.Dataset.from_dict({"text": []}).to_parquet(str(path))
    with pytest.raises(ValueError, match="has no rows"):
        check_source(path, tiny)
    with pytest.raises(ValueError, match="has no rows"):
        build(path, tiny, 16, 1, tmp_path, packing=True)


def test_sample_without_completion_tokens_is_named(tiny, tmp_path):
    rows = [{"prompt": "q", "completion": "a"}, {"prompt": "q", "completion": "a"}, {"prompt": "q", "completion": ""}]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    with pytest.raises(ValueError, match=r"sample 2 has no completion tokens.*loss_on='all'"):
        check_source(path, tiny)
    chats = [chat(0), {"messages": [{"role": "user", "content": "no answer"}]}]
    path = write_jsonl(tmp_path / "chat.jsonl", chats)
    with pytest.raises(ValueError, match="sample 1 has no completion tokens"):
        check_source(path, tiny)
    with pytest.raises(ValueError, match="sample 1 has no completion tokens"):  # and every later row while building
        build(path, tiny, 64, 1, tmp_path, packing=True)
    assert build(path, tiny, 64, 1, tmp_path, loss_on="all").mask.all()


def test_completion_loss_refused_on_plain_text_and_token_ids(tiny, tmp_path):
    with pytest.raises(ValueError, match="loss_on='all'"):
        check_source("tiny", tiny, loss_on="completion")
    np.save(tmp_path / "ids.npy", np.arange(100))
    with pytest.raises(ValueError, match="without sample borders"):
        check_source(tmp_path / "ids.npy", packing=True)


def test_hub_id_offline_is_a_clear_error(tiny, tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    src = check_source.__globals__["parse_source"]("someorg/somedata:validation", data_config="en")
    assert (src.kind, src.location, src.split, src.config) == ("hub", "someorg/somedata", "validation", "en")
    with pytest.raises(ValueError, match=r"could not read the hub dataset 'someorg/somedata'.*local data files"):
        check_source("someorg/somedata", tiny)
    with pytest.raises(ValueError, match="apply to hub datasets"):
        check_source("tiny", tiny, data_config="en")
