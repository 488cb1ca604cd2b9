"""`build_token_stream`: read, tokenize and cache a source once, then hand out its windows as a `TokenStream`.

`check_source` runs the same checks on the source's first rows only, cheaply, before any weights load.
"""

import os
import warnings
from itertools import chain, islice
from pathlib import Path

import numpy as np

from .cache import CACHE_FORMAT_VERSION, CachePaths, build_or_reuse, default_cache_dir, digest, read_cache, wait_for
from .content import ContentChain, row_bytes, text_bytes, token_chain
from .packing import LONG_SAMPLES, pack, refuse_if_long
from .samples import chat_template_digest, detect_format, iter_samples, render, resolve_loss_on
from .sources import (Source, folder_files, iter_documents, iter_rows, load_pretokenized, parse_source, source_identity,
                      source_stat)
from .stream import TokenStream, WindowDocuments
from .tokenize import DEFAULT_CHUNK_CHARS, TOKEN_DTYPE, pad_token_id, tokenize_documents, tokenizer_fingerprint

# Bump when sample rendering, masks or packing change, so caches built by the old rules are not reused.
# 2: chat rows rendered with their own tools and chat_template_kwargs.
SAMPLES_VERSION = 2


def build_token_stream(
    source: str | os.PathLike,
    tokenizer,
    seq_len: int,
    num_steps: int = 1,
    *,
    text_column: str | None = None,
    data_config: str | None = None,
    data_revision: str | None = None,
    loss_on: str | None = None,
    packing: bool = False,
    long_samples: str = "split",
    pack_buffer: int = 4,
    cache_dir: str | os.PathLike | None = None,
    local_rank: int | None = None,
    builder: bool | None = None,
    seed: int = 0,
    bin_dtype: str = "uint32",
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    progress: bool = True,
    wait_timeout_s: float = 7200.0,
    poll_s: float = 1.0,
    held_out: int = 0,
) -> TokenStream:
    """Read, tokenize and cache `seq_len * num_steps` tokens of `source`; return them as a `TokenStream`.

    source: see `ulysses_lc.data` (pg19, tiny, .txt files and folders, .npy/.bin ids, hub ids
        'org/name[:split]', local .jsonl/.json/.parquet/.arrow/.csv files or a folder of them).
    tokenizer: a Hugging Face tokenizer with an EOS token (EOS ends each sample / joins documents);
        for .npy/.bin sources it may be None, else it is used to check the ids fit its vocabulary.
    text_column: the column of plain text, or of conversations (lists of {role, content}: read as 'messages')
        (None: 'messages', then 'prompt' + 'completion', then 'text', whichever the dataset has; see
        `ulysses_lc.data.samples`).
    data_config, data_revision: a hub dataset's config name and revision.
    loss_on: "completion" (train completions / assistant turns only) or "all"; None: completion for
        chat and prompt/completion data, all for plain text.
    packing: fill each window with whole samples, each its own document (`Sample.document_lengths`),
        the rest padding; False: samples joined into one causal stream, as documents always were.
    long_samples: with packing, a sample longer than seq_len is cut into seq_len pieces ("split")
        or refused ("refuse").
    pack_buffer: the packer sorts buffers of pack_buffer * seq_len tokens (see `packing`).
    local_rank: this process's rank on its node (default: $LOCAL_RANK, else 0). Rank 0 builds
        the cache; the others wait (torch.distributed barrier when initialised, so every rank
        must call this; else polling for the meta file) and then read it.
    builder: whether this process builds the cache (default: local_rank == 0, one builder per node). A job whose
        nodes share the cache folder passes `train.files.folder_owner(cache_dir, layout).writes`, so that one
        rank of the job builds it; builders of different jobs on one key take turns (a lock beside the cache).
    seed: which generated books the `tiny` source writes.
    A source with fewer tokens (packed: windows) than `num_steps` windows but at least one is used
    with wrap-around (a warning says after how many steps); none is a ValueError.
    held_out: this many windows more are read after the run's, and handed out as `stream.held_out` (a TokenStream
        of their own, for evaluation) instead of as the stream's: its windows, wrapping around, never reach them. A
        source without them all is a ValueError.
    """
    if seq_len < 1 or num_steps < 1 or held_out < 0:
        raise ValueError(f"seq_len={seq_len} and num_steps={num_steps} must both be >= 1, held_out={held_out} >= 0")
    src = parse_source(source, seed=seed, data_config=data_config, data_revision=data_revision)
    settings = _sample_settings(src, tokenizer, text_column, loss_on, packing, long_samples, pack_buffer)
    run_steps, num_steps = num_steps, num_steps + held_out  # everything below reads the held-out windows too
    want = seq_len * num_steps

    if src.pretokenized:
        tokens = load_pretokenized(src, bin_dtype, tokenizer, seq_len)
        identity = source_identity(src, bin_dtype=bin_dtype)
        stream_id = digest({"source": identity})
        used = tokens[:want]
        # Hashed only when a checkpoint is written or resumed (reading every id the run uses).
        stream = TokenStream(used, seq_len, stream_id=stream_id, content=lambda: token_chain(used),
                             stats={"sample_format": "token ids"})
        return _hold_out(stream, run_steps, held_out, source)

    if tokenizer is None:
        raise ValueError(f"source {os.fspath(source)!r} is text: pass the tokenizer of the model being trained")
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no eos_token, which joins documents; set one (tokenizer.eos_token = '...')"
        )
    if src.kind in ("text", "folder") and not packing:
        _check_size_upper_bound(src, seq_len)

    identity = source_identity(src)
    fingerprint = tokenizer_fingerprint(tokenizer)
    stream_fields = {"tokenizer": fingerprint, "eos": tokenizer.eos_token_id, "source": identity}
    if settings is not None:  # plain documents joined as always keep their old keys (and caches)
        stream_fields["samples"] = settings
    stream_id = digest(stream_fields)
    key_fields = {
        "format": CACHE_FORMAT_VERSION,
        **stream_fields,
        "num_tokens": want,
        "chunk_chars": chunk_chars,  # borders can change tokens for tokenizers where chunking is inexact
        "stat": source_stat(src),  # a file written since the build misses the cache (its ctime moved)
    }
    key = f"{src.kind}-{want}-{digest(key_fields)}"
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    paths = CachePaths(cache, key)

    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if builder if builder is not None else local_rank == 0:
        if settings is None:
            build = lambda: _tokenize_text(src, tokenizer, want, chunk_chars, progress)  # noqa: E731
        else:
            build = lambda: _build_samples(src, tokenizer, seq_len, num_steps, settings, chunk_chars, progress)  # noqa: E731
        hit = build_or_reuse(paths, build, key_fields)
    else:
        hit = True
        wait_for(paths, wait_timeout_s, poll_s)

    arrays, meta = read_cache(paths)
    tokens = arrays["tokens"]
    if len(tokens) < seq_len:
        raise ValueError(
            f"source {os.fspath(source)!r} gives {len(tokens):,} tokens but one step needs seq_len={seq_len:,}; "
            "add text, lower seq_len, or use 'tiny'"
        )
    documents = None
    if "doc_lengths" in arrays:
        documents = WindowDocuments(arrays["doc_lengths"], arrays["doc_starts"], arrays["padding"])
    stream = TokenStream(tokens, seq_len, stream_id=stream_id, cache_hit=hit, cache_path=paths.tokens,
                         mask=arrays.get("mask"), documents=documents, content=meta["content"], stats=meta)
    return _hold_out(stream, run_steps, held_out, source)


def check_source(
    source: str | os.PathLike,
    tokenizer=None,
    *,
    seq_len: int | None = None,
    rows: int = 8,
    text_column: str | None = None,
    data_config: str | None = None,
    data_revision: str | None = None,
    loss_on: str | None = None,
    packing: bool = False,
    long_samples: str = "split",
    seed: int = 0,
) -> dict:
    """Refuse a bad source cheaply, before any weights load: reads at most the first `rows` rows.

    Checks what `build_token_stream` would refuse on those rows (unknown or missing source, hub
    dataset unreachable, missing column, empty dataset, loss_on without completions, with
    `tokenizer` a sample with no completion tokens, with `seq_len` a sample too long under
    long_samples="refuse"). Later rows are checked while the cache is built. Returns what it found:
    {"kind", "format", "loss_on", "columns"} (format, loss_on and columns None where not read).
    """
    src = parse_source(source, seed=seed, data_config=data_config, data_revision=data_revision)
    _sample_settings(src, tokenizer, text_column, loss_on, packing, long_samples, 1)
    if src.pretokenized:
        return {"kind": src.kind, "format": None, "loss_on": None, "columns": None}
    if not src.tabular:
        return {"kind": src.kind, "format": "text", "loss_on": resolve_loss_on(loss_on, "text"), "columns": ["text"]}
    first = list(islice(iter_rows(src), rows))
    fmt, columns = _format_of(src, first[:1], text_column)
    first = list(_as_messages(first, fmt, text_column))
    resolved = resolve_loss_on(loss_on, fmt)
    if tokenizer is not None:
        for index, ids, _ in iter_samples(iter(first), tokenizer, fmt, resolved, text_column=text_column):
            if packing and seq_len is not None:
                refuse_if_long(index, len(ids), seq_len, long_samples)
    return {"kind": src.kind, "format": fmt, "loss_on": resolved, "columns": columns}


def _sample_settings(src: Source, tokenizer, text_column, loss_on, packing, long_samples, pack_buffer) -> dict | None:
    """The settings that shape samples (part of the cache key), or None for documents joined as always."""
    if long_samples not in LONG_SAMPLES:
        raise ValueError(f"long_samples={long_samples!r}; use one of {', '.join(LONG_SAMPLES)}")
    if pack_buffer < 1:
        raise ValueError(f"pack_buffer={pack_buffer} must be >= 1 (windows of tokens the packer sorts at once)")
    if src.pretokenized:
        if packing or loss_on == "completion" or text_column is not None:
            raise ValueError(
                f"a .{src.kind} source holds token ids without sample borders or columns, so packing, "
                "loss_on='completion' and text_column do not apply; pass a text or dataset source, or drop them"
            )
        return None
    if not src.tabular:
        if text_column is not None:
            raise ValueError(f"text_column applies to dataset sources, not to the {src.kind} source; drop it")
        resolve_loss_on(loss_on, "text")  # plain documents: loss_on='completion' is refused here
        if not packing:
            return None
    return {
        "version": SAMPLES_VERSION,
        "text_column": text_column,
        "loss_on": loss_on,
        "packing": packing,
        "long_samples": long_samples if packing else None,
        "pack_buffer": pack_buffer if packing else None,
        "chat_template": chat_template_digest(tokenizer) if src.tabular else None,
    }


def _format_of(src: Source, first: list[dict], text_column: str | None) -> tuple[str, list[str]]:
    if not first:
        raise ValueError(
            f"the source {src.location} has no rows (split {src.split!r}); pass a dataset with data, or another split"
        )
    columns = list(first[0])
    fmt = detect_format(columns, text_column)
    if fmt == "text" and text_column is not None and _is_conversation(first[0][text_column]):
        fmt = "messages"  # a chat column under another name (`conversation`): read as messages, not refused as text
    return fmt, columns


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and "role" in m and "content" in m
                                                           for m in value)


def _as_messages(rows, fmt: str, text_column: str | None):
    """Rows whose `text_column` holds conversations, with them under 'messages' (where samples.render reads them)."""
    if fmt != "messages" or text_column is None:
        return rows
    return ({**row, "messages": row[text_column]} for row in rows)


def _build_samples(src: Source, tokenizer, seq_len, num_steps, settings, chunk_chars, progress):
    from tqdm.auto import tqdm

    read = ContentChain()
    rows = read.wrap(iter_rows(src), row_bytes)
    first = list(islice(rows, 1))
    fmt, columns = _format_of(src, first, settings["text_column"])
    loss_on = resolve_loss_on(settings["loss_on"], fmt)
    rows = _as_messages(chain(first, rows), fmt, settings["text_column"])
    want = seq_len * num_steps
    stats = {"requested_tokens": want, "sample_format": fmt, "loss_on_resolved": loss_on, "columns": columns}
    if fmt == "text" and loss_on == "all" and not settings["packing"]:
        # Plain text joined as always: the chunked tokenizer reads only the tokens the run needs.
        column = settings["text_column"] or "text"
        texts = (render(row, i, "text", tokenizer, column, with_spans=False)[0] for i, row in enumerate(rows))
        arrays, text_stats = _tokenize_text(src, tokenizer, want, chunk_chars, progress, documents=texts, read=read)
        return arrays, {**stats, **text_stats}
    samples = iter_samples(rows, tokenizer, fmt, loss_on, text_column=settings["text_column"])
    bar = tqdm(total=want, unit="tok", unit_scale=True, desc="tokenizing samples", disable=not progress)
    try:
        if settings["packing"]:
            packed = pack(samples, seq_len, num_steps, pad_id=pad_token_id(tokenizer), long_samples=settings["long_samples"],
                          buffer_windows=settings["pack_buffer"], on_window=lambda n: bar.update(seq_len))
            arrays = {"tokens": packed.tokens, "mask": packed.mask, "doc_lengths": packed.doc_lengths,
                      "doc_starts": packed.doc_starts, "padding": packed.padding}
            padding = int(packed.padding.sum())
            stats.update(windows=len(packed.padding), padding_tokens=padding, split_samples=packed.split_samples,
                         documents=int(len(packed.doc_lengths) - np.count_nonzero(packed.padding)))
        else:
            arrays = _join(samples, want, bar)
            stats["documents"] = arrays.pop("documents")
    finally:
        bar.close()
    stats["content"] = read.finish()
    return arrays, stats


def _join(samples, want: int, bar) -> dict:
    """Samples end to end (each ends with EOS) until `want` tokens, as one causal stream."""
    ids_parts, mask_parts, total, count = [], [], 0, 0
    for _, ids, mask in samples:
        ids_parts.append(ids)
        mask_parts.append(mask)
        total += len(ids)
        count += 1
        bar.update(len(ids))
        if total >= want:
            break
    tokens = np.concatenate(ids_parts)[:want] if ids_parts else np.zeros(0, TOKEN_DTYPE)
    mask = np.concatenate(mask_parts)[:want] if mask_parts else np.zeros(0, np.uint8)
    return {"tokens": tokens, "mask": mask, "documents": count}


class DataRepeats(UserWarning):
    """The source holds fewer tokens than the run asked for: its windows repeat (the main job says so in its data
    line instead)."""


def _hold_out(stream: TokenStream, run_steps: int, held_out: int, source) -> TokenStream:
    """The run's stream, its last `held_out` windows split off as `held_out` (see build_token_stream)."""
    want = stream.seq_len * run_steps
    if not held_out:
        if stream.num_tokens < want:
            warnings.warn(
                f"the source has {stream.num_tokens:,} tokens, fewer than the {want:,} the run asked for: "
                f"the data repeats after {len(stream)} steps",
                DataRepeats,
                stacklevel=3,
            )
        return stream
    if len(stream) < run_steps + held_out:
        raise ValueError(
            f"source {os.fspath(source)!r} gives {len(stream):,} windows of {stream.seq_len:,} tokens: the run reads "
            f"{run_steps:,} and the held-out evaluation needs {held_out:,} more after them, which training never "
            "reads. Give the evaluation its own text (--eval-data), add text, or train fewer steps.")
    train, held = stream.split(run_steps)
    train.held_out = held
    return train


def _check_size_upper_bound(src: Source, seq_len: int) -> None:
    # Each token covers at least one UTF-8 byte (add_special_tokens=False), so the byte count
    # plus one EOS per border bounds the token count without tokenizing anything.
    files = folder_files(Path(src.location)) if src.kind == "folder" else [Path(src.location)]
    bound = sum(f.stat().st_size for f in files) + len(files) - 1
    if bound < seq_len:
        raise ValueError(
            f"source {src.location} has {bound:,} bytes, so at most {bound:,} tokens, but one step needs "
            f"seq_len={seq_len:,}; add text, lower seq_len, or use 'tiny'"
        )


def _tokenize_text(src: Source, tokenizer, want: int, chunk_chars: int, progress: bool, documents=None, read=None):
    """documents and read: the rendered rows of a dataset and the chain that hashed them (None: the source's
    documents, hashed here)."""
    if documents is None:
        read = ContentChain()
        documents = read.wrap(iter_documents(src), text_bytes)
    tokens, stats = tokenize_documents(documents, tokenizer, want, chunk_chars=chunk_chars, progress=progress)
    if stats["chunking_exact_on_probe"] is False:
        warnings.warn(
            "tokenizing in chunks gave other ids than tokenizing whole text on a probe (this "
            "tokenizer's pre-tokenizer does not split before ' word'); a few tokens per "
            f"{chunk_chars:,}-character chunk border differ, which training tolerates",
            stacklevel=4,
        )
    return {"tokens": tokens}, {"requested_tokens": want, **stats, "content": read.finish()}
