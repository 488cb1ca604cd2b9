"""The training token stream: documents joined end to end, cut into one `seq_len` window per step.

Documents (PG-19 books, text files, generated `tiny` books) are tokenized and joined with the
tokenizer's EOS between them into one causal stream; there is no block-diagonal mask, so every
token attends to every earlier token across document borders, as in the reference recipe's
PG-19 concatenation. Step `k` trains on tokens `[k * seq_len, (k + 1) * seq_len)`.

Tokenizing is done once per (tokenizer, source, token count) and cached on disk as a raw
uint32 file plus a JSON meta file; a rerun memory-maps the cache in seconds. On each node only
local rank 0 tokenizes; the other ranks wait for it and then map the same file.

This module knows nothing of the model or of sharding: the trainer splits each sequence
across sequence-parallel ranks itself.

Sources (one string):
  "pg19", "pg19:<split>"  PG-19 from the Hugging Face Hub (`PG19_HUB_ID`), streamed, so only as
                          many books as the run needs are read. split: train (default),
                          validation, test.
  "tiny"                  generated English-like books (`ulysses_lc.tiny.tiny_text`), offline.
  <dir>                   every *.txt below it, recursively, sorted by relative path; one
                          document per file.
  <file>.npy              pre-tokenized 1-D integer array, used as is (no EOS added).
  <file>.bin              pre-tokenized raw little-endian integers, `bin_dtype` (uint32 default),
                          used as is.
  <other file>            one UTF-8 text document.
"""

import hashlib
import json
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

# A parquet mirror of deepmind/pg19 with the same splits and text. The canonical
# "deepmind/pg19" repository is a loading script (pg19.py), which datasets>=4.0 refuses
# ("Dataset scripts are no longer supported"); this mirror needs no script and streams.
PG19_HUB_ID = "emozilla/pg19"
PG19_SPLITS = ("train", "validation", "test")

# Bump when the cache layout or the joining/chunking rules change, so old caches are not reused.
CACHE_FORMAT_VERSION = 1
CACHE_DTYPE = np.dtype("<u4")  # 4 bytes per token covers every vocabulary up to 4.29e9 entries

# 32k characters is ~8k tokens: large enough that chunk borders are rare, small enough that
# a 4M-character batch gives the Rust tokenizer ~128 pieces to spread over its threads.
DEFAULT_CHUNK_CHARS = 32_768
BATCH_CHARS = 4_000_000
TINY_DOC_CHARS = 400_000  # one generated "book" of the tiny source

# A chunk starts at a space that follows a non-space and precedes a letter: the pre-tokenizer
# regexes of byte-level BPE tokenizers (GPT-2, Qwen2/3, Llama-3) always start a new pre-token
# there (" word"), and BPE merges never cross pre-tokens, so cutting there changes no token.
_SAFE_CUT = re.compile(r"(?<=\S) (?=[^\W\d_])")


@dataclass(frozen=True)
class Source:
    """A parsed data source: `kind` is one of pg19, tiny, folder, text, npy, bin."""

    kind: str
    location: str  # hub id for pg19, absolute path for local kinds, "tiny" for tiny
    split: str | None = None
    seed: int = 0

    @property
    def pretokenized(self) -> bool:
        return self.kind in ("npy", "bin")


def parse_source(source: str | os.PathLike, *, seed: int = 0) -> Source:
    """Turn the user's `source` string into a `Source`, refusing unknown names and missing paths."""
    text = os.fspath(source)
    if text == "tiny":
        return Source("tiny", "tiny", seed=seed)
    if text == "pg19" or text.startswith("pg19:"):
        split = text.partition(":")[2] or "train"
        if split not in PG19_SPLITS:
            raise ValueError(f"source {text!r}: PG-19 has no split {split!r}; use one of {', '.join(PG19_SPLITS)}")
        return Source("pg19", PG19_HUB_ID, split=split)
    path = Path(text).expanduser()
    if not path.exists():
        raise ValueError(
            f"source {text!r} is not 'pg19', 'pg19:<split>' or 'tiny', and no file or folder exists at "
            f"{path.resolve()}; pass an existing .txt file, a folder of .txt files, a .npy/.bin of "
            "token ids, 'pg19' (needs network) or 'tiny' (built in, offline)"
        )
    path = path.resolve()
    if path.is_dir():
        if not _folder_files(path):
            raise ValueError(f"source folder {path} holds no *.txt files; add some or pass a single file")
        return Source("folder", str(path))
    suffix = path.suffix.lower()
    if suffix in (".npy", ".bin"):
        return Source(suffix[1:], str(path))
    return Source("text", str(path))


def _folder_files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.rglob("*.txt") if p.is_file()), key=lambda p: p.relative_to(folder).as_posix())


def source_identity(src: Source, *, bin_dtype: str = "uint32") -> dict:
    """What identifies the source's content for the cache key: path + size + mtime, or hub id + split."""
    if src.kind == "pg19":
        return {"kind": "pg19", "hub_id": src.location, "split": src.split}
    if src.kind == "tiny":
        from .tiny import TINY_TEXT_VERSION

        return {"kind": "tiny", "version": TINY_TEXT_VERSION, "doc_chars": TINY_DOC_CHARS, "seed": src.seed}
    files = _folder_files(Path(src.location)) if src.kind == "folder" else [Path(src.location)]
    stats = [(f.as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    listing = hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]
    identity = {"kind": src.kind, "path": src.location, "files": len(stats), "listing": listing}
    if src.kind == "bin":
        identity["dtype"] = bin_dtype
    return identity


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
            pieces.append(np.asarray(ids, dtype=CACHE_DTYPE))
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
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=CACHE_DTYPE)
    if num_tokens is not None:
        tokens = tokens[:num_tokens]
    return tokens, {"documents": docs, "chunking_exact_on_probe": probe_exact}


def iter_documents(src: Source) -> Iterator[str]:
    """The source's documents as strings, in order (not for pre-tokenized sources)."""
    if src.kind == "tiny":
        from .tiny import tiny_text

        i = 0
        while True:
            yield tiny_text(TINY_DOC_CHARS, seed=src.seed * 1_000_003 + i)
            i += 1
    elif src.kind == "pg19":
        yield from _pg19_documents(src.location, src.split)
    else:
        files = _folder_files(Path(src.location)) if src.kind == "folder" else [Path(src.location)]
        for path in files:
            try:
                yield path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path} is not UTF-8 text ({e}); convert it (iconv -t utf-8) or pass token ids as .npy/.bin"
                ) from e


def _pg19_documents(hub_id: str, split: str) -> Iterator[str]:
    import datasets

    def unavailable(e: Exception) -> ValueError:
        return ValueError(
            f"could not read PG-19 ({hub_id!r}, split {split!r}) from the Hugging Face Hub: "
            f"{type(e).__name__}: {e}. Without network access, pass a local .txt file or a folder of "
            "books as the source, or 'tiny' for the built-in generated text."
        )

    # Hub and network failures surface as many types (OSError, httpx errors, RuntimeError
    # for scripts, DatasetNotFoundError); the user's fixes are the same for all of them.
    try:
        rows = iter(datasets.load_dataset(hub_id, split=split, streaming=True))
        first = next(rows, None)
    except Exception as e:  # noqa: BLE001
        raise unavailable(e) from e
    if first is None:
        return
    yield first["text"]
    while True:
        try:
            row = next(rows, None)
        except Exception as e:  # noqa: BLE001 - a dropped connection mid-stream
            raise unavailable(e) from e
        if row is None:
            return
        yield row["text"]


class TokenStream:
    """Consecutive `seq_len`-token windows over a token array, with a resumable position.

    `sequence(step)` wraps around: step `len(stream) + k` gives the same window as step `k`
    (a new epoch over the data). A stream shorter than one window is refused at build time.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, *, stream_id: str, cache_hit: bool = False, cache_path=None):
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 1")
        if len(tokens) < seq_len:
            raise ValueError(f"the token stream has {len(tokens):,} tokens but one step needs seq_len={seq_len:,}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.stream_id = stream_id  # tokenizer + source, not the length: resume may extend a run
        self.cache_hit = cache_hit  # True when this process read tokens some earlier build wrote
        self.cache_path = cache_path
        self.position = 0  # the next step `next_sequence` returns

    def __len__(self) -> int:
        """Distinct windows before the stream wraps around."""
        return len(self.tokens) // self.seq_len

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def sequence(self, step: int) -> torch.Tensor:
        """The step-th window as a LongTensor [seq_len] (wrapping around past the end)."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        start = (step % len(self)) * self.seq_len
        # A copy: the memory map is read-only and the trainer may write into its batch.
        return torch.from_numpy(np.array(self.tokens[start : start + self.seq_len], dtype=np.int64))

    def next_sequence(self) -> torch.Tensor:
        """The window at `position`, then advance `position` by one."""
        window = self.sequence(self.position)
        self.position += 1
        return window

    def state_dict(self) -> dict:
        return {"position": self.position, "seq_len": self.seq_len, "stream_id": self.stream_id}

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.seq_len:
            raise ValueError(
                f"checkpoint was written with seq_len={state['seq_len']:,} but this run uses {self.seq_len:,}; "
                "its data position would point at other windows. Resume with the same seq_len."
            )
        if state["stream_id"] != self.stream_id:
            raise ValueError(
                f"checkpoint's data stream {state['stream_id']} differs from this run's {self.stream_id} "
                "(another tokenizer or source); resume with the same source and tokenizer."
            )
        self.position = int(state["position"])


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "ulysses_lc" / "tokens"


def build_token_stream(
    source: str | os.PathLike,
    tokenizer,
    seq_len: int,
    num_steps: int = 1,
    *,
    cache_dir: str | os.PathLike | None = None,
    local_rank: int | None = None,
    seed: int = 0,
    bin_dtype: str = "uint32",
    chunk_chars: int = DEFAULT_CHUNK_CHARS,
    progress: bool = True,
    wait_timeout_s: float = 7200.0,
    poll_s: float = 1.0,
) -> TokenStream:
    """Read, tokenize and cache `seq_len * num_steps` tokens of `source`; return them as a `TokenStream`.

    tokenizer: a Hugging Face tokenizer with an EOS token (EOS joins documents); for .npy/.bin
        sources it may be None, else it is used to check the ids fit its vocabulary.
    local_rank: this process's rank on its node (default: $LOCAL_RANK, else 0). Rank 0 builds
        the cache; the others wait (torch.distributed barrier when initialised, so every rank
        must call this; else polling for the meta file) and then read it.
    seed: which generated books the `tiny` source writes.
    A source with fewer tokens than `seq_len * num_steps` but at least `seq_len` is used with
    wrap-around (a warning says after how many steps); fewer than `seq_len` is a ValueError.
    """
    if seq_len < 1 or num_steps < 1:
        raise ValueError(f"seq_len={seq_len} and num_steps={num_steps} must both be >= 1")
    src = parse_source(source, seed=seed)
    want = seq_len * num_steps

    if src.pretokenized:
        tokens = _load_pretokenized(src, bin_dtype, tokenizer, seq_len)
        identity = source_identity(src, bin_dtype=bin_dtype)
        stream_id = _digest({"source": identity})
        stream = TokenStream(tokens[:want], seq_len, stream_id=stream_id)
        _warn_if_short(stream, want)
        return stream

    if tokenizer is None:
        raise ValueError(f"source {os.fspath(source)!r} is text: pass the tokenizer of the model being trained")
    if tokenizer.eos_token_id is None:
        raise ValueError(
            "the tokenizer has no eos_token, which joins documents; set one (tokenizer.eos_token = '...')"
        )
    if src.kind in ("text", "folder"):
        _check_size_upper_bound(src, seq_len)

    identity = source_identity(src)
    fingerprint = tokenizer_fingerprint(tokenizer)
    stream_id = _digest({"tokenizer": fingerprint, "eos": tokenizer.eos_token_id, "source": identity})
    key_fields = {
        "format": CACHE_FORMAT_VERSION,
        "tokenizer": fingerprint,
        "eos": tokenizer.eos_token_id,
        "source": identity,
        "num_tokens": want,
        "chunk_chars": chunk_chars,  # borders can change tokens for tokenizers where chunking is inexact
    }
    key = f"{src.kind}-{want}-{_digest(key_fields)}"
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    paths = _CachePaths(cache, key)

    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_rank == 0:
        hit = _build_or_reuse(paths, src, tokenizer, want, key_fields, chunk_chars, progress)
    else:
        hit = True
        _wait_for(paths, wait_timeout_s, poll_s)

    tokens = _read_cache(paths)
    if len(tokens) < seq_len:
        raise ValueError(
            f"source {os.fspath(source)!r} gives {len(tokens):,} tokens but one step needs seq_len={seq_len:,}; "
            "add text, lower seq_len, or use 'tiny'"
        )
    stream = TokenStream(tokens, seq_len, stream_id=stream_id, cache_hit=hit, cache_path=paths.tokens)
    _warn_if_short(stream, want)
    return stream


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]


def _warn_if_short(stream: TokenStream, want: int) -> None:
    if stream.num_tokens < want:
        warnings.warn(
            f"the source has {stream.num_tokens:,} tokens, fewer than the {want:,} the run asked for: "
            f"the data repeats after {len(stream)} steps",
            stacklevel=3,
        )


def _check_size_upper_bound(src: Source, seq_len: int) -> None:
    # Each token covers at least one UTF-8 byte (add_special_tokens=False), so the byte count
    # plus one EOS per border bounds the token count without tokenizing anything.
    files = _folder_files(Path(src.location)) if src.kind == "folder" else [Path(src.location)]
    bound = sum(f.stat().st_size for f in files) + len(files) - 1
    if bound < seq_len:
        raise ValueError(
            f"source {src.location} has {bound:,} bytes, so at most {bound:,} tokens, but one step needs "
            f"seq_len={seq_len:,}; add text, lower seq_len, or use 'tiny'"
        )


def _load_pretokenized(src: Source, bin_dtype: str, tokenizer, seq_len: int) -> np.ndarray:
    path = Path(src.location)
    if src.kind == "npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"{path} holds a {tokens.dtype} array of shape {tokens.shape}; save a 1-D integer array")
    else:
        try:
            dtype = np.dtype(bin_dtype).newbyteorder("<")
        except TypeError as e:
            raise ValueError(f"bin_dtype={bin_dtype!r} is not a numpy dtype; use uint16, uint32 or int64") from e
        if not np.issubdtype(dtype, np.integer):
            raise ValueError(f"bin_dtype={bin_dtype!r} is not an integer dtype; use uint16, uint32 or int64")
        size = path.stat().st_size
        if size % dtype.itemsize:
            raise ValueError(f"{path} has {size} bytes, not a multiple of {dtype.itemsize} ({bin_dtype}); check bin_dtype")
        tokens = np.memmap(path, dtype=dtype, mode="r") if size else np.zeros(0, dtype=dtype)
    if len(tokens) < seq_len:
        raise ValueError(f"{path} has {len(tokens):,} tokens but one step needs seq_len={seq_len:,}")
    if tokenizer is not None and len(tokens):
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= len(tokenizer):
            raise ValueError(
                f"{path} holds token ids in [{low}, {high}] but the tokenizer has {len(tokenizer)} entries; "
                "pre-tokenize with the model's tokenizer"
            )
    return tokens


@dataclass(frozen=True)
class _CachePaths:
    folder: Path
    key: str

    @property
    def tokens(self) -> Path:
        return self.folder / f"{self.key}.tokens"

    @property
    def meta(self) -> Path:  # written last: its presence marks a complete cache
        return self.folder / f"{self.key}.json"

    @property
    def error(self) -> Path:
        return self.folder / f"{self.key}.error"


def _atomic_write(path: Path, write) -> None:
    # A unique temporary name + rename: readers never see a half-written file, and two nodes
    # building the same key on a shared filesystem both succeed with identical contents.
    tmp = path.with_name(f"{path.name}.tmp-{os.uname().nodename}-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _cache_complete(paths: _CachePaths) -> bool:
    if not paths.meta.exists() or not paths.tokens.exists():
        return False
    meta = json.loads(paths.meta.read_text())
    return paths.tokens.stat().st_size == meta["num_tokens"] * CACHE_DTYPE.itemsize


def _build_or_reuse(paths, src, tokenizer, want, key_fields, chunk_chars, progress) -> bool:
    """Build the cache unless a complete one exists; returns whether it existed (a hit)."""
    dist = _initialized_dist()
    hit = False
    try:
        paths.folder.mkdir(parents=True, exist_ok=True)
        paths.error.unlink(missing_ok=True)
        hit = _cache_complete(paths)
        if not hit:
            started = time.time()
            tokens, stats = tokenize_documents(
                iter_documents(src), tokenizer, want, chunk_chars=chunk_chars, progress=progress
            )
            if stats["chunking_exact_on_probe"] is False:
                warnings.warn(
                    "tokenizing in chunks gave other ids than tokenizing whole text on a probe (this "
                    "tokenizer's pre-tokenizer does not split before ' word'); a few tokens per "
                    f"{chunk_chars:,}-character chunk border differ, which training tolerates",
                    stacklevel=3,
                )
            meta = {
                **key_fields,
                "key": paths.key,
                "dtype": CACHE_DTYPE.str,
                "num_tokens": int(len(tokens)),
                "requested_tokens": want,
                "build_seconds": round(time.time() - started, 3),
                **stats,
            }
            _atomic_write(paths.tokens, lambda f: f.write(tokens.tobytes()))
            _atomic_write(paths.meta, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    except BaseException as e:
        # Tell the waiting ranks, so they fail now instead of at their timeout.
        try:
            paths.error.write_text(f"{type(e).__name__}: {e}")
        except OSError:
            pass
        raise
    # Only on success: after a failure the waiting ranks read the error marker and fail on their own.
    if dist is not None:
        dist.barrier()
    return hit


def _initialized_dist():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed
    return None


def _wait_for(paths: _CachePaths, timeout_s: float, poll_s: float) -> None:
    # Poll the file rather than sit in a collective: tokenizing a large source can outlast the process
    # group's timeout (30 min under DeepSpeed), which would end in a watchdog error instead of this message.
    started = time.time()
    while not _cache_complete(paths):
        # An error marker from an earlier, unrelated failure is older than this wait; ignore it.
        if paths.error.exists() and paths.error.stat().st_mtime >= started - 300:
            raise RuntimeError(f"local rank 0 failed to build the token cache {paths.key}: {paths.error.read_text()}")
        if time.time() - started > timeout_s:
            raise RuntimeError(
                f"no complete token cache at {paths.meta} after {timeout_s:.0f} s; is local rank 0 building "
                "into the same cache_dir (on the same filesystem)?"
            )
        time.sleep(poll_s)
    dist = _initialized_dist()
    if dist is not None:
        dist.barrier()  # pairs with local rank 0's barrier after a successful build


def _read_cache(paths: _CachePaths) -> np.ndarray:
    meta = json.loads(paths.meta.read_text())
    if meta["num_tokens"] == 0:
        return np.zeros(0, dtype=CACHE_DTYPE)
    return np.memmap(paths.tokens, dtype=CACHE_DTYPE, mode="r", shape=(meta["num_tokens"],))
