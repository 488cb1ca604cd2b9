"""Token stream: every source kind against serial whole-text tokenization, the cache, ranks, errors."""

import threading

import numpy as np
import pytest
import torch

from tests._dist import run_shared
from ulysses_lc import data
from ulysses_lc.data import (
    build_token_stream,
    iter_chunks,
    parse_source,
    split_into_chunks,
    tokenize_documents,
)
from ulysses_lc.tiny import TINY_TOKENIZER_NAME, tiny_text, tiny_tokenizer

# The Qwen2/Qwen3 pre-tokenizer regex: chunking must be exact for the default model's tokenizer family.
QWEN_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def tiny():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def bpe():
    """A real merge-based BPE with Qwen's pre-tokenizer, trained in code on generated text."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([tiny_text(100_000, seed=99)], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", name_or_path="test-bpe")


def serial_stream(tokenizer, docs):
    """The reference: each document tokenized whole, EOS between documents."""
    ids = []
    for i, doc in enumerate(docs):
        if i:
            ids.append(tokenizer.eos_token_id)
        ids += tokenizer(doc, add_special_tokens=False)["input_ids"]
    return ids


def build(source, tokenizer, seq_len, num_steps, tmp_path, **kw):
    kw.setdefault("local_rank", 0)
    return build_token_stream(
        source, tokenizer, seq_len, num_steps, cache_dir=tmp_path / "cache", progress=False, **kw
    )


# --- tiny ----------------------------------------------------------------------------------


def test_tiny_tokenizer_round_trip(tiny):
    text = "Héllo wörld — 日本語\n\n\ttabs  and  spaces."
    ids = tiny(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # id == byte value
    assert tiny.decode(ids) == text
    assert len(tiny) == 257 and tiny.eos_token_id == 256 and tiny.pad_token_id == 256
    assert tiny.name_or_path == TINY_TOKENIZER_NAME
    assert tiny.fingerprint == tiny_tokenizer().fingerprint
    assert data.tokenizer_fingerprint(tiny) == data.tokenizer_fingerprint(tiny_tokenizer())


def test_tiny_text_is_deterministic():
    a = tiny_text(20_000, seed=1)
    assert a == tiny_text(20_000, seed=1)
    assert len(a) == 20_000 and len(tiny_text(7, seed=1)) == 7
    assert a != tiny_text(20_000, seed=2)
    assert "CHAPTER I." in a and ". " in a


# --- chunked tokenization --------------------------------------------------------------------


def test_chunks_join_back_and_cut_before_a_word():
    text = tiny_text(30_000, seed=3)
    chunks = split_into_chunks(text, 500)
    assert "".join(chunks) == text and len(chunks) > 30
    assert all(c.startswith(" ") and c[1].isalpha() for c in chunks[1:])
    # No safe cut (no spaces): the text stays one piece rather than being cut mid-token.
    assert list(iter_chunks("x" * 5000, 100)) == ["x" * 5000]


@pytest.mark.parametrize("chunk_chars", [64, 1000])
def test_parallel_chunked_equals_serial(bpe, tiny, chunk_chars):
    """Exact equality (not approximate) for byte-level BPE with GPT-2/Qwen pre-tokenizer regexes."""
    docs = [tiny_text(12_000, seed=s) for s in range(3)] + ["short doc", "日本語のテキスト 2024 numbers 123"]
    for tokenizer in (bpe, tiny):
        expected = serial_stream(tokenizer, docs)
        tokens, stats = tokenize_documents(iter(docs), tokenizer, None, chunk_chars=chunk_chars, progress=False)
        assert tokens.tolist() == expected
        assert stats == {"documents": len(docs), "chunking_exact_on_probe": True}
        assert data.chunking_is_exact(tokenizer, docs[0], chunk_chars)
        # A token budget stops early and cuts exactly there.
        tokens, _ = tokenize_documents(iter(docs), tokenizer, 5000, chunk_chars=chunk_chars, progress=False)
        assert tokens.tolist() == expected[:5000]


def test_chunking_probe_detects_prepend_normalizers():
    """Llama-2-style tokenizers prepend "▁" to every encoded text, so each chunk border adds a token."""
    from tokenizers import Tokenizer, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁": 1, "a": 2, "▁a": 3, "</s>": 4}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a")], unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    llama_like = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    assert not data.chunking_is_exact(llama_like, "a a a a", chunk_chars=2)
    _, stats = tokenize_documents(iter(["a a a a"]), llama_like, None, chunk_chars=2, progress=False)
    assert stats["chunking_exact_on_probe"] is False


# --- sources ---------------------------------------------------------------------------------


def test_text_file_source(bpe, tmp_path):
    doc = tiny_text(20_000, seed=4)
    path = tmp_path / "book.txt"
    path.write_text(doc, encoding="utf-8")
    expected = serial_stream(bpe, [doc])
    stream = build(path, bpe, 512, len(expected) // 512, tmp_path, chunk_chars=700)
    assert len(stream) == len(expected) // 512
    assert stream.tokens.tolist() == expected[: 512 * len(stream)]
    assert stream.sequence(1).tolist() == expected[512:1024]
    assert stream.sequence(1).dtype == torch.long and stream.sequence(1).shape == (512,)


def test_folder_source_sorted_with_eos_between(bpe, tmp_path):
    folder = tmp_path / "books"
    (folder / "sub").mkdir(parents=True)
    docs = {"b.txt": tiny_text(3000, seed=5), "a.txt": tiny_text(2000, seed=6), "sub/c.txt": tiny_text(2500, seed=7)}
    for name, text in docs.items():
        (folder / name).write_text(text)
    (folder / "notes.md").write_text("not a .txt file, ignored")
    expected = serial_stream(bpe, [docs["a.txt"], docs["b.txt"], docs["sub/c.txt"]])
    assert expected.count(bpe.eos_token_id) == 2
    stream = build(folder, bpe, 100, len(expected) // 100, tmp_path, chunk_chars=300)
    assert stream.tokens.tolist() == expected[: 100 * (len(expected) // 100)]


def test_npy_source_used_as_is(tiny, tmp_path):
    ids = np.arange(1000, dtype=np.int64) % 257
    np.save(tmp_path / "ids.npy", ids)
    stream = build(tmp_path / "ids.npy", tiny, 100, 5, tmp_path)
    assert len(stream) == 5 and stream.tokens.tolist() == ids[:500].tolist()
    assert stream.sequence(7).tolist() == ids[200:300].tolist()  # wraps: step 7 == step 2


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_bin_source(tiny, tmp_path, dtype):
    ids = (np.arange(1000) * 7 % 257).astype(dtype)
    ids.astype(np.dtype(dtype).newbyteorder("<")).tofile(tmp_path / "ids.bin")
    stream = build(tmp_path / "ids.bin", tiny, 250, 4, tmp_path, bin_dtype=dtype)
    assert stream.tokens.tolist() == ids.tolist()


def test_tiny_source(tiny, tmp_path):
    stream = build("tiny", tiny, 4096, 3, tmp_path, seed=2)
    docs = [tiny_text(data.TINY_DOC_CHARS, seed=2 * 1_000_003)]
    assert stream.tokens.tolist() == serial_stream(tiny, docs)[: 3 * 4096]


def test_pretokenized_ids_must_fit_the_vocab(tiny, tmp_path):
    np.save(tmp_path / "ids.npy", np.array([1, 2, 300] * 100))
    with pytest.raises(ValueError, match="tokenizer has 257 entries"):
        build(tmp_path / "ids.npy", tiny, 10, 1, tmp_path)


# --- cache -----------------------------------------------------------------------------------


def test_cache_miss_then_hit_does_not_retokenize(bpe, tmp_path, monkeypatch):
    path = tmp_path / "book.txt"
    path.write_text(tiny_text(10_000, seed=8))
    first = build(path, bpe, 256, 4, tmp_path)
    assert not first.cache_hit and first.cache_path.exists()

    def fail(*args, **kwargs):
        raise AssertionError("a cache hit must not tokenize")

    monkeypatch.setattr(data.build, "tokenize_documents", fail)
    second = build(path, bpe, 256, 4, tmp_path)
    assert second.cache_hit and second.cache_path == first.cache_path
    assert np.array_equal(first.tokens, second.tokens)


def test_cache_key_changes_with_source_tokenizer_and_length(bpe, tiny, tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(tiny_text(10_000, seed=9))
    base = build(path, bpe, 256, 4, tmp_path).cache_path
    other_tok = build(path, tiny, 256, 4, tmp_path)
    longer = build(path, bpe, 256, 5, tmp_path)
    assert not other_tok.cache_hit and other_tok.cache_path != base
    assert not longer.cache_hit and longer.cache_path != base
    path.write_text(tiny_text(10_000, seed=10))  # new content, size or mtime
    edited = build(path, bpe, 256, 4, tmp_path)
    assert not edited.cache_hit and edited.cache_path != base


# --- errors ----------------------------------------------------------------------------------


def test_missing_path_and_bad_names(tiny, tmp_path):
    with pytest.raises(ValueError, match="no file or folder exists"):
        build(tmp_path / "nope.txt", tiny, 10, 1, tmp_path)
    with pytest.raises(ValueError, match="no split"):
        parse_source("pg19:dev")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.txt files"):
        parse_source(tmp_path / "empty")


def test_too_few_tokens_refused_before_tokenizing(bpe, tmp_path, monkeypatch):
    path = tmp_path / "short.txt"
    path.write_text("only a few words")
    monkeypatch.setattr(data.build, "tokenize_documents", lambda *a, **k: pytest.fail("tokenized a too-short source"))
    with pytest.raises(ValueError, match="16 bytes, so at most 16 tokens, but one step needs seq_len=100"):
        build(path, bpe, 100, 1, tmp_path)


def test_too_few_tokens_after_tokenizing(bpe, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text(tiny_text(400, seed=1))  # 400 bytes, but BPE merges make it ~100 tokens
    n = len(bpe(path.read_text(), add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match=f"gives {n} tokens but one step needs seq_len=300"):
        build(path, bpe, 300, 1, tmp_path)
    np.save(tmp_path / "ids.npy", np.arange(50))
    with pytest.raises(ValueError, match="has 50 tokens but one step needs seq_len=300"):
        build(tmp_path / "ids.npy", None, 300, 1, tmp_path)


def test_short_source_wraps_with_a_warning(bpe, tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(tiny_text(2000, seed=11))
    with pytest.warns(UserWarning, match="repeats after"):
        stream = build(path, bpe, 100, 1000, tmp_path)
    assert torch.equal(stream.sequence(len(stream)), stream.sequence(0))


def test_pg19_without_network_points_to_local_or_tiny(tiny, tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'emozilla/pg19' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match="tiny") as info:
        build("pg19", tiny, 128, 1, tmp_path)
    assert "local .txt file" in str(info.value) and "ConnectionError" in str(info.value)


def test_pg19_streams_books_joined_with_eos(tiny, tmp_path, monkeypatch):
    import datasets

    books = [tiny_text(3000, seed=s) for s in range(5)]
    calls = []

    def fake_load(name, split, streaming):
        calls.append((name, split, streaming))
        return ({"short_book_title": f"b{i}", "text": t} for i, t in enumerate(books))

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    stream = build("pg19:validation", tiny, 1000, 5, tmp_path)
    assert calls == [(data.PG19_HUB_ID, "validation", True)]
    assert stream.tokens.tolist() == serial_stream(tiny, books)[:5000]


# --- ranks -----------------------------------------------------------------------------------


def test_local_rank_1_waits_for_rank_0(bpe, tmp_path, monkeypatch):
    path = tmp_path / "book.txt"
    path.write_text(tiny_text(10_000, seed=12))
    result = {}
    looked = threading.Event()  # set once the waiter has found no complete cache: no guess at how long that takes
    complete = data.cache.cache_complete

    def watched(paths):
        done = complete(paths)
        if not done:
            looked.set()
        return done

    monkeypatch.setattr(data.cache, "cache_complete", watched)

    def waiter():
        result["stream"] = build(path, bpe, 256, 4, tmp_path, local_rank=1, poll_s=0.02, wait_timeout_s=60)

    thread = threading.Thread(target=waiter)
    thread.start()
    assert looked.wait(timeout=60)
    assert thread.is_alive()  # nothing to read yet: still waiting on rank 0
    built = build(path, bpe, 256, 4, tmp_path, local_rank=0)
    thread.join(timeout=30)
    assert not built.cache_hit and result["stream"].cache_hit
    assert np.array_equal(result["stream"].tokens, built.tokens)


def test_waiting_rank_fails_fast_when_rank_0_fails(bpe, tmp_path, monkeypatch):
    path = tmp_path / "book.txt"
    path.write_text(tiny_text(10_000, seed=13))

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(data.build, "tokenize_documents", broken)
    with pytest.raises(OSError):
        build(path, bpe, 256, 4, tmp_path, local_rank=0)
    with pytest.raises(RuntimeError, match="disk full"):
        build(path, bpe, 256, 4, tmp_path, local_rank=1, poll_s=0.02, wait_timeout_s=30)


def _two_rank_build(rank, world_size, path, cache_dir):
    stream = build_token_stream(path, tiny_tokenizer(), 256, 4, cache_dir=cache_dir, progress=False)
    return stream.cache_hit, stream.tokens.tolist()


def test_two_gloo_ranks_share_one_build(tmp_path):
    """Under torch.distributed the waiting rank uses the barrier; LOCAL_RANK comes from the launcher."""
    path = tmp_path / "book.txt"
    path.write_text(tiny_text(5000, seed=14))
    (hit0, tokens0), (hit1, tokens1) = run_shared(_two_rank_build, 2, str(path), str(tmp_path / "cache"))
    assert (hit0, hit1) == (False, True)
    assert tokens0 == tokens1 == list(path.read_bytes()[:1024])


# --- resume ----------------------------------------------------------------------------------


def test_state_dict_round_trip(tiny, tmp_path):
    stream = build("tiny", tiny, 512, 8, tmp_path)
    for _ in range(3):
        stream.next_sequence()
    state = stream.state_dict()
    resumed = build("tiny", tiny, 512, 20, tmp_path)  # a longer run resumes the same stream
    resumed.load_state_dict(state)
    assert resumed.position == 3
    assert torch.equal(resumed.next_sequence(), stream.next_sequence())
    other = build("tiny", tiny, 256, 8, tmp_path)
    with pytest.raises(ValueError, match="same seq_len"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="same source and tokenizer"):
        build("tiny", tiny, 512, 8, tmp_path, seed=1).load_state_dict(state)
