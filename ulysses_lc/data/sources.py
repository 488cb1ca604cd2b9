"""Data sources: parsing the user's source string, what identifies a source's content, reading documents."""

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

# A parquet mirror of deepmind/pg19 with the same splits and text. The canonical
# "deepmind/pg19" repository is a loading script (pg19.py), which datasets>=4.0 refuses
# ("Dataset scripts are no longer supported"); this mirror needs no script and streams.
PG19_HUB_ID = "emozilla/pg19"
PG19_SPLITS = ("train", "validation", "test")

TINY_DOC_CHARS = 400_000  # one generated "book" of the tiny source


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
        if not folder_files(path):
            raise ValueError(f"source folder {path} holds no *.txt files; add some or pass a single file")
        return Source("folder", str(path))
    suffix = path.suffix.lower()
    if suffix in (".npy", ".bin"):
        return Source(suffix[1:], str(path))
    return Source("text", str(path))


def folder_files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.rglob("*.txt") if p.is_file()), key=lambda p: p.relative_to(folder).as_posix())


def source_identity(src: Source, *, bin_dtype: str = "uint32") -> dict:
    """What identifies the source's content for the cache key: path + size + mtime, or hub id + split."""
    if src.kind == "pg19":
        return {"kind": "pg19", "hub_id": src.location, "split": src.split}
    if src.kind == "tiny":
        from ..tiny import TINY_TEXT_VERSION

        return {"kind": "tiny", "version": TINY_TEXT_VERSION, "doc_chars": TINY_DOC_CHARS, "seed": src.seed}
    files = folder_files(Path(src.location)) if src.kind == "folder" else [Path(src.location)]
    stats = [(f.as_posix(), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    listing = hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]
    identity = {"kind": src.kind, "path": src.location, "files": len(stats), "listing": listing}
    if src.kind == "bin":
        identity["dtype"] = bin_dtype
    return identity



def iter_documents(src: Source) -> Iterator[str]:
    """The source's documents as strings, in order (not for pre-tokenized sources)."""
    if src.kind == "tiny":
        from ..tiny import tiny_text

        i = 0
        while True:
            yield tiny_text(TINY_DOC_CHARS, seed=src.seed * 1_000_003 + i)
            i += 1
    elif src.kind == "pg19":
        yield from _pg19_documents(src.location, src.split)
    else:
        files = folder_files(Path(src.location)) if src.kind == "folder" else [Path(src.location)]
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


def load_pretokenized(src: Source, bin_dtype: str, tokenizer, seq_len: int) -> np.ndarray:
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
