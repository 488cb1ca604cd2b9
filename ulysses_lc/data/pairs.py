"""`PairStream`: preference pairs (prompt / chosen / rejected) tokenized as TRL does, packed into sequences.

Rows are TRL's preference rows, plain or chat: "prompt", "chosen", "rejected" as strings (an EOS is added to each
completion that lacks one), or as message lists (the prompt rendered with the generation prompt, each completion as
the prompt's conversation continued; every rendering with the row's `tools` and `chat_template_kwargs`, as TRL's). The completion starts where the tokenized prompt and prompt + completion
first differ (TRL's rule). "tiny": generated pairs (the chosen completion continues the prompt's story, the rejected
one is another story's), offline.

Sequence s holds pairs windows[s], each later trained as two packed documents (preference.py): one pair per
sequence, or with packing as many whole pairs as fit in seq_len, in order. Like TokenStream, `sample(step)` wraps
around and `position` resumes; the stream id is a digest of the token ids, so a resume on other data is refused.
Every row is checked before any step: a pair longer than seq_len, or one with no prompt or completion tokens, is
refused with its row number and the fix.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from .samples import chat_template_kwargs
from .sources import Source, iter_rows

PAIR_KEYS = ("prompt", "chosen", "rejected")
TINY_PAIRS = 64  # generated pairs of the tiny source: its epoch


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def tokenize_pair(row: dict, tokenizer, index: int = 0) -> tuple[list[int], list[int], list[int]]:
    """(prompt_ids, chosen_ids, rejected_ids) of a preference row (row `index` of its source, for errors), as TRL's
    DPOTrainer tokenizes it."""
    prompt, chosen, rejected = (row[k] for k in PAIR_KEYS)
    if isinstance(prompt, list):  # conversational
        template_kwargs = chat_template_kwargs(row, index)

        def render(messages, **kwargs):
            return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs,
                                                      **template_kwargs)["input_ids"])

        prompt_ids = render(prompt, add_generation_prompt=True)
        full = [render(prompt + completion) for completion in (chosen, rejected)]
    else:
        eos = tokenizer.eos_token or ""
        def ids(text):
            return list(tokenizer(text, add_special_tokens=True)["input_ids"])

        prompt_ids = ids(prompt)
        full = [ids(prompt + (c if c.endswith(eos) else c + eos)) for c in (chosen, rejected)]
    start = min(_common_prefix(prompt_ids, f) for f in full)
    return prompt_ids[:start], full[0][start:], full[1][start:]


def tiny_pairs(n: int, max_chars: int, seed: int = 0) -> list[dict]:
    """n plain-text pairs from tiny_text, each prompt + completion within max_chars."""
    from ..tiny import tiny_text

    rng = random.Random(seed)
    rows = []
    for i in range(n):
        text, other = tiny_text(max_chars, seed=seed * 1_000_003 + i), tiny_text(max_chars, seed=seed + n + i)
        cut = rng.randint(len(text) // 3, len(text) // 2)
        length = rng.randint(max(1, len(text) // 8), max(2, len(text) // 3))
        rows.append({"prompt": text[:cut], "chosen": text[cut:cut + length], "rejected": other[:length]})
    return rows


def read_pairs(src: Source, tokenizer, seq_len: int, limit: int | None = None) -> list[tuple]:
    """Every pair of `src` (the first `limit` rows at most), tokenized and checked against seq_len."""
    from ..objectives.preference import check_pair

    rows = tiny_pairs(TINY_PAIRS, seq_len // 4, src.seed) if src.kind == "tiny" else iter_rows(src)
    pairs = []
    for i, row in enumerate(rows):
        if limit is not None and i >= limit:
            break
        missing = [k for k in PAIR_KEYS if k not in row]
        if missing:
            raise ValueError(f"--method dpo reads preference rows with columns {', '.join(PAIR_KEYS)}; row {i} of "
                             f"{src.location} has no {', '.join(missing)} (it has {', '.join(row)}). Rename the "
                             "columns, or train it with --method sft.")
        pair = tokenize_pair(row, tokenizer, i)
        check_pair(*pair, seq_len, where=f"row {i} of {src.location}")
        pairs.append(pair)
    if not pairs:
        raise ValueError(f"{src.location} has no preference rows.")
    return pairs


def pack_pairs(pairs: list[tuple], seq_len: int, packing: bool) -> list[list[tuple]]:
    """Sequences of pairs: one each, or with packing as many consecutive whole pairs as fit in seq_len."""
    if not packing:
        return [[p] for p in pairs]
    windows, current, used = [], [], 0
    for pair in pairs:
        length = 2 * len(pair[0]) + len(pair[1]) + len(pair[2])
        if current and used + length > seq_len:
            windows.append(current)
            current, used = [], 0
        current.append(pair)
        used += length
    return windows + [current]


@dataclass
class PairStream:
    """Sequences of preference pairs with a resumable position (module docstring)."""

    windows: list[list[tuple]]
    seq_len: int
    stream_id: str
    position: int = 0

    @classmethod
    def build(cls, src: Source, tokenizer, seq_len: int, packing: bool = False, limit: int | None = None):
        windows = pack_pairs(read_pairs(src, tokenizer, seq_len, limit), seq_len, packing)
        digest = hashlib.sha256(repr((packing, windows)).encode()).hexdigest()[:16]
        return cls(windows, seq_len, f"pairs-{digest}")

    def __len__(self) -> int:
        return len(self.windows)

    def sample(self, step: int) -> list[tuple]:
        """The step-th sequence's pairs (wrapping around past the end)."""
        return self.windows[step % len(self.windows)]

    def state_dict(self) -> dict:
        return {"position": self.position, "seq_len": self.seq_len, "stream_id": self.stream_id}

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.seq_len or state["stream_id"] != self.stream_id:
            raise ValueError(f"the checkpoint trained other preference data (stream {state['stream_id']}, seq_len "
                             f"{state['seq_len']:,}; now {self.stream_id}, {self.seq_len:,}): resume with the same "
                             "--data, tokenizer, --seq-len and --packing, or start a new run (another --output-dir).")
        self.position = int(state["position"])


__all__ = ["PAIR_KEYS", "PairStream", "pack_pairs", "read_pairs", "tiny_pairs", "tokenize_pair"]
