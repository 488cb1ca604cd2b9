"""Data sources: parsing the user's source string, what identifies a source's content, reading documents."""

import hashlib
import json
import os
import re
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

# Local data files read through `datasets`, by suffix: the builder that reads them.
DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(:[\w.-]+)?$")  # org/name or org/name:split


@dataclass(frozen=True)
class Source:
    """A parsed data source: `kind` is one of pg19, tiny, folder, text, npy, bin (read by this package)
    or hub, files (read through `datasets`: a hub id, or local data files of one `builder`)."""

    kind: str
    location: str  # hub id for pg19 and hub, absolute path for local kinds, "tiny" for tiny
    split: str | None = None
    seed: int = 0
    config: str | None = None  # hub: the dataset's config name
    revision: str | None = None  # hub: a branch, tag or commit
    files: tuple[str, ...] = ()  # files: the data files, sorted
    builder: str | None = None  # files: json, parquet, arrow or csv

    @property
    def pretokenized(self) -> bool:
        return self.kind in ("npy", "bin")

    @property
    def tabular(self) -> bool:
        """Rows with columns (read through `datasets`) rather than documents of plain text."""
        return self.kind in ("hub", "files")


def parse_source(
    source: str | os.PathLike, *, seed: int = 0, data_config: str | None = None, data_revision: str | None = None
) -> Source:
    """Turn the user's `source` string into a `Source`, refusing unknown names and missing paths.

    Reads nothing but the file system's listing. data_config / data_revision: a hub dataset's
    config name and revision; refused for other sources.
    """
    src = _parse(os.fspath(source), seed)
    if (data_config is not None or data_revision is not None) and src.kind != "hub":
        raise ValueError(
            f"data_config={data_config!r} / data_revision={data_revision!r} apply to hub datasets (org/name), "
            f"not to the {src.kind} source {os.fspath(source)!r}; drop them"
        )
    if src.kind == "hub":
        return Source("hub", src.location, split=src.split, config=data_config, revision=data_revision)
    return src


def _parse(text: str, seed: int) -> Source:
    if text == "tiny":
        return Source("tiny", "tiny", seed=seed)
    if text == "pg19" or text.startswith("pg19:"):
        split = text.partition(":")[2] or "train"
        if split not in PG19_SPLITS:
            raise ValueError(f"source {text!r}: PG-19 has no split {split!r}; use one of {', '.join(PG19_SPLITS)}")
        return Source("pg19", PG19_HUB_ID, split=split)
    path = Path(text).expanduser()
    if not path.exists():
        if HUB_ID.match(text):
            hub_id, _, split = text.partition(":")
            return Source("hub", hub_id, split=split or "train")
        raise ValueError(
            f"source {text!r} is not 'pg19', 'pg19:<split>', 'tiny' or a hub id 'org/name[:split]', and no file "
            f"or folder exists at {path.resolve()}; pass an existing .txt file, a folder of .txt files, data "
            f"files ({', '.join(DATA_FILE_BUILDERS)}) or a folder of them, a .npy/.bin of token ids, 'pg19' "
            "(needs network) or 'tiny' (built in, offline)"
        )
    path = path.resolve()
    if path.is_dir():
        if folder_files(path):  # .txt first: a folder of books keeps the behaviour it always had
            return Source("folder", str(path))
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DATA_FILE_BUILDERS)
        if not files:
            raise ValueError(
                f"source folder {path} holds no *.txt files and no data files ({', '.join(DATA_FILE_BUILDERS)}); "
                "add some or pass a single file"
            )
        builders = sorted({DATA_FILE_BUILDERS[p.suffix.lower()] for p in files})
        if len(builders) > 1:
            raise ValueError(
                f"source folder {path} mixes data file formats ({', '.join(builders)}); `datasets` reads one "
                "format per source: move the others out or convert them"
            )
        return Source("files", str(path), split="train", files=tuple(map(str, files)), builder=builders[0])
    suffix = path.suffix.lower()
    if suffix in (".npy", ".bin"):
        return Source(suffix[1:], str(path))
    if suffix in DATA_FILE_BUILDERS:
        return Source("files", str(path), split="train", files=(str(path),), builder=DATA_FILE_BUILDERS[suffix])
    return Source("text", str(path))


def folder_files(folder: Path) -> list[Path]:
    return sorted((p for p in folder.rglob("*.txt") if p.is_file()), key=lambda p: p.relative_to(folder).as_posix())


def source_identity(src: Source, *, bin_dtype: str = "uint32") -> dict:
    """What names the source: path and file names, or hub id + split (+ config and revision for hub datasets).

    Its content is identified by what the build reads (`content.ContentChain`), never by sizes or times: a file
    edited in place keeps its size, and `cp -p`, `rsync -t` or `tar` restore its modification time."""
    if src.kind == "pg19":
        return {"kind": "pg19", "hub_id": src.location, "split": src.split}
    if src.kind == "hub":
        return {"kind": "hub", "hub_id": src.location, "split": src.split, "config": src.config,
                "revision": src.revision}
    if src.kind == "tiny":
        from ..tiny import TINY_TEXT_VERSION

        return {"kind": "tiny", "version": TINY_TEXT_VERSION, "doc_chars": TINY_DOC_CHARS, "seed": src.seed}
    files = [Path(f).as_posix() for f in (src.files if src.kind == "files" else _local_files(src))]
    names = hashlib.sha256(json.dumps(files).encode()).hexdigest()[:16]
    identity = {"kind": src.kind, "path": src.location, "files": len(files), "names": names}
    if src.kind == "bin":
        identity["dtype"] = bin_dtype
    if src.kind == "files":
        identity["builder"] = src.builder
    return identity


def source_stat(src: Source) -> str | None:
    """A cheap fingerprint of the local files for the token cache's key: size, modification time and status change
    time (ctime, which every write sets and no tool can set back), so a file edited in place misses the cache on
    this machine; None for hub and generated sources."""
    if src.kind in ("pg19", "hub", "tiny"):
        return None
    files = [Path(f) for f in src.files] if src.kind == "files" else _local_files(src)
    stats = [(f.as_posix(), s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino) for f in files for s in [f.stat()]]
    return hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]


def _local_files(src: Source) -> list[Path]:
    return folder_files(Path(src.location)) if src.kind == "folder" else [Path(src.location)]


def iter_rows(src: Source) -> Iterator[dict]:
    """The source's rows as dicts, in order: dataset rows for hub/files sources, {"text": document} for the others.

    Hub and local datasets are streamed, so only the rows a run consumes are read.
    """
    if not src.tabular:
        yield from ({"text": doc} for doc in iter_documents(src))
        return
    import datasets

    what = f"hub dataset {src.location!r}" if src.kind == "hub" else f"{src.builder} files at {src.location}"

    def unreadable(e: Exception) -> ValueError:
        fix = (
            "Without network access (or with HF_HUB_OFFLINE=1) pass local data files "
            f"({', '.join(DATA_FILE_BUILDERS)}) or a folder of them; check the id, split and config."
            if src.kind == "hub"
            else f"Check that the files are valid {src.builder}."
        )
        return ValueError(f"could not read the {what} (split {src.split!r}): {type(e).__name__}: {e}. {fix}")

    # As for PG-19: hub, network and parser failures come as many types with the same fixes.
    try:
        if src.kind == "hub":
            dataset = datasets.load_dataset(src.location, name=src.config, split=src.split, streaming=True,
                                            revision=src.revision)
        else:
            dataset = datasets.load_dataset(src.builder, data_files=list(src.files), split="train", streaming=True)
        rows = iter(dataset)
    except Exception as e:  # noqa: BLE001
        raise unreadable(e) from e
    while True:
        try:
            row = next(rows, None)
        except Exception as e:  # noqa: BLE001
            raise unreadable(e) from e
        if row is None:
            return
        yield row


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
        for path in _local_files(src):
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
