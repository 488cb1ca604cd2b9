"""Long real text with no network: the Python standard library's own source, split into train and held-out folders.

Each `.py` file under the running interpreter's stdlib (tests and site-packages left out) becomes one `.txt`
document; a file goes to `eval/` when the first byte of the sha1 of its path relative to the stdlib is below
`--eval-fraction` x 256, else to `train/`, so the split is the same on every machine with the same Python and no
module is in both. Real text (not generated): the long-context benchmarks train and evaluate on it.

    python benchmarks/stdlib_corpus.py --out ./stdlib_text     # writes stdlib_text/train/*.txt, stdlib_text/eval/*.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

SKIP_PARTS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_files() -> list[tuple[str, Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if SKIP_PARTS.intersection(Path(rel).parts):
            continue
        files.append((rel, path))
    return files


def write_corpus(out: Path, eval_fraction: float) -> dict:
    counts = {"train": [0, 0], "eval": [0, 0]}
    for split in counts:
        (out / split).mkdir(parents=True, exist_ok=True)
    for rel, path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        split = "eval" if hashlib.sha1(rel.encode()).digest()[0] < eval_fraction * 256 else "train"
        (out / split / (rel.replace("/", "__") + ".txt")).write_text(text, encoding="utf-8")
        counts[split][0] += 1
        counts[split][1] += len(text)
    info = {"python": sys.version.split()[0], "stdlib": sysconfig.get_paths()["stdlib"],
            **{f"{s}_files": c[0] for s, c in counts.items()}, **{f"{s}_chars": c[1] for s, c in counts.items()}}
    (out / "corpus.json").write_text(json.dumps(info, indent=1) + "\n")
    return info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--eval-fraction", type=float, default=0.15)
    args = p.parse_args()
    print(json.dumps(write_corpus(args.out, args.eval_fraction)))


if __name__ == "__main__":
    main()
