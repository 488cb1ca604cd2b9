"""Chunked parallel tokenization: long documents cut at safe word starts, encoded in batches by the Rust tokenizer."""

import hashlib
import json
import re
from typing import Iterator

import numpy as np

TOKEN_DTYPE = np.dtype("<u4")  # 4 bytes per token covers every vocabulary up to 4.29e9 entries

# 32k characters is ~8k tokens: large enough that chunk borders are rare, small enough that
# a 4M-character batch gives the Rust tokenizer ~128 pieces to spread over its threads.
DEFAULT_CHUNK_CHARS = 32_768
BATCH_CHARS = 4_000_000

# A chunk starts at a space that follows a non-space and precedes a letter: the pre-tokenizer
# regexes of byte-level BPE tokenizers (GPT-2, Qwen2/3, Llama-3) always start a new pre-token
# there (" word"), and BPE merges never cross pre-tokens, so cutting there changes no token.
_SAFE_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")


def pad_token_id(tokenizer) -> int:
    """The id that fills a sequence past its last token (labels there are ignored): the tokenizer's pad token,
    else its EOS, else 0. The one rule for packed windows, the main job's batches and the Trainer's collator."""
    for token_id in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if token_id is not None:
            return token_id
    return 0


def tokenizer_fingerprint(tokenizer) -> str:
    """name_or_path | vocabulary size | hash of the full tokenizer definition (vocab, merges, normalizer...)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = backend.to_str()
    else:
        definition = json.dumps(sorted(tokenizer.get_vocab().items()))
    digest = hashlib.sha256(definition.encode()).hexdigest()[:16]
    return f"{getattr(tokenizer, 'name_or_path', '')}|{len(tokenizer)}|{digest}"


def iter_chunks(text: str, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> Iterator[str]:
    """Cut `text` into pieces of about `chunk_chars` characters at safe word starts (see `_SAFE_CUT`).

    Pieces joined give back `text`. A piece grows past `chunk_chars` when no safe cut follows
    (e.g. text without spaces): correct tokens matter more than an even split.
    """
    start = 0
    while len(text) - start > chunk_chars:
        cut = _SAFE_CUT.search(text, start + chunk_chars)
        if cut is None:
            break
        yield text[start : cut.start()]
        start = cut.start()
    yield text[start:]


def split_into_chunks(text: str, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[str]:
    """`iter_chunks` as a list."""
    return list(iter_chunks(text, chunk_chars))


def _encode_batch(tokenizer, texts: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer(texts, add_special_tokens=False)["input_ids"]
    # The Rust tokenizer encodes a batch on all cores (rayon); encode_batch_fast also skips
    # the character offsets we do not need.
    encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
    return [enc.ids for enc in encode(texts, add_special_tokens=False)]


def chunking_is_exact(tokenizer, text: str, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> bool:
    """Whether tokenizing `text` in chunks gives the same ids as tokenizing it whole (a probe)."""
    chunks = split_into_chunks(text, chunk_chars)
    whole = _encode_batch(tokenizer, [text])[0]
    return whole == [t for ids in _encode_batch(tokenizer, chunks) for t in ids]


def tokenize_documents(
    documents: Iterator[str],
    tokenizer,
    num_tokens: int | None,
    *,
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    batch_chars: int = BATCH_CHARS,
    progress: bool = True,
) -> tuple[np.ndarray, dict]:
    """Tokenize documents in parallel chunks and join them with EOS between documents.

    Stops reading once `num_tokens` tokens are reached (None: read everything) and returns at
    most `num_tokens` tokens as a uint32 array, plus stats: documents read, and whether
    tokenizing the first chunk border separately matched tokenizing across it (None: no border).
    """
    from tqdm.auto import tqdm

    eos = tokenizer.eos_token_id
    pieces: list[np.ndarray] = []
    pending: list[str | None] = []  # text chunks, None for an EOS between documents
    total, pending_chars, docs = 0, 0, 0
    # Characters per token, to read only about as much text as the remaining tokens need.
    # Start at 1 (byte-level worst case): BPE tokenizers (~4) then take one more, larger batch.
    chars_per_token = 1.0
    probe_exact = None
    bar = tqdm(total=num_tokens, unit="tok", unit_scale=True, desc="tokenizing", disable=not progress)

    def flush():
        nonlocal total, pending, pending_chars, chars_per_token
        texts = [p for p in pending if p is not None]
        encoded = iter(_encode_batch(tokenizer, texts))
        added = 0
        for piece in pending:
            ids = [eos] if piece is None else next(encoded)
            pieces.append(np.asarray(ids, dtype=TOKEN_DTYPE))
            added += len(ids)
        if added:
            chars_per_token = max(pending_chars / added, 0.5)
        bar.update(added if num_tokens is None else max(0, min(added, num_tokens - total)))
        total += added
        pending, pending_chars = [], 0

    def batch_full() -> bool:
        if num_tokens is None:
            return pending_chars >= batch_chars
        wanted_chars = (num_tokens - total) * chars_per_token * 1.05 + 1
        return pending_chars >= min(batch_chars, max(wanted_chars, chunk_chars))

    def done() -> bool:
        return num_tokens is not None and total >= num_tokens

    try:
        for text in documents:
            if docs:
                pending.append(None)  # EOS between documents, never before the first or after the last
            docs += 1
            previous = None
            for chunk in iter_chunks(text, chunk_chars):
                if probe_exact is None and previous is not None:
                    whole, first, second = _encode_batch(tokenizer, [previous + chunk, previous, chunk])
                    probe_exact = whole == first + second
                pending.append(chunk)
                pending_chars += len(chunk)
                previous = chunk
                if batch_full():
                    flush()
                    if done():
                        break
            if done():
                break
        flush()
    finally:
        bar.close()
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=TOKEN_DTYPE)
    if num_tokens is not None:
        tokens = tokens[:num_tokens]
    return tokens, {"documents": docs, "chunking_exact_on_probe": probe_exact}
