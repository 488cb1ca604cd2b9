"""Passkey retrieval at length: a key hidden at a depth of a long haystack of real text, scored teacher-forced.

A haystack of exactly `seq_len` tokens (the format of Mohtashami & Jaggi, 2023, and LongLoRA):

    INTRO | filler ... | NEEDLE (" The pass key is 71432. Remember it. 71432 is the pass key. ") | filler ... |
    QUESTION (" What is the pass key? The pass key is") | the key's tokens (" 71432")

The filler is the evaluation text's own tokens; `depth` is the share of the filler before the needle (0: right after
the intro, 1: right before the question). Nothing is sampled: the haystack's labels are the key's tokens only, and
a forward scores them given everything before (teacher-forced): a key token is found when it is the argmax of its
row, and its log-probability says how sure the model was. A model that reads only the last few thousand tokens
finds a key near the question and misses one far from it, however low its loss.

The key is digits. Its tokens are those the tokenizer gives the question followed by " <key>" (a leading space, as
the answer would be written), less the question's own; a first token that is only whitespace belongs to the
question, so that no score counts a space as a digit found.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..constants import IGNORE_INDEX

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize "
         "it. I will quiz you about the important information there.\n")
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = " What is the pass key? The pass key is"
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Haystack:
    """One haystack: input_ids [s]; the key's tokens at [key_start, key_start + key_tokens); the needle's first token
    at needle_position."""

    input_ids: torch.Tensor
    key: str
    key_start: int
    key_tokens: int
    depth: float
    needle_position: int
    seed: int

    @property
    def labels(self) -> torch.Tensor:
        """Unshifted labels (shard_batch shifts them): the key's tokens, IGNORE_INDEX elsewhere."""
        labels = torch.full_like(self.input_ids, IGNORE_INDEX)
        end = self.key_start + self.key_tokens
        labels[self.key_start:end] = self.input_ids[self.key_start:end]
        return labels


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def key_tokens(tokenizer, key: str) -> tuple[list[int], list[int]]:
    """(question's ids, key's ids): the module docstring's tokenization of the question and its answer."""
    question = _encode(tokenizer, QUESTION)
    answered = _encode(tokenizer, QUESTION + " " + key)
    key_ids = answered[len(question):] if answered[:len(question)] == question else _encode(tokenizer, " " + key)
    while key_ids and not tokenizer.decode(key_ids[:1]).strip():
        question, key_ids = question + key_ids[:1], key_ids[1:]
    if not key_ids:
        raise ValueError(f"the key {key!r} tokenized to nothing but whitespace; pass a tokenizer that encodes digits.")
    return question, key_ids


def make_key(seed: int, digits: int) -> str:
    """The seed's key: `digits` random digits, the first not 0."""
    if digits < 1:
        raise ValueError(f"passkey digits={digits}: a key needs at least one digit.")
    rng = random.Random(f"ulysses_lc passkey {seed}")
    return str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(digits - 1))


def build_haystacks(tokenizer, fillers: list[torch.Tensor], seq_len: int, depths=DEPTHS, seeds: int = 1,
                    digits: int = 5) -> list[Haystack]:
    """One haystack of seq_len tokens per (seed, depth), seed by seed: seed k hides its own key (`make_key`) in
    fillers[k % len(fillers)] (token ids of the evaluation text, each at least seq_len long). ValueError with the fix
    for a prompt longer than the haystack, too little filler, or a depth outside [0, 1]."""
    depths = [float(d) for d in depths]
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"passkey depths {depths}: give shares of the haystack in [0, 1] (0: the start, 1: right "
                         "before the question), e.g. 0,0.25,0.5,0.75,1.")
    if seeds < 1 or not fillers:
        raise ValueError(f"passkey seeds={seeds} with {len(fillers)} filler texts: give at least one of each.")
    intro = _encode(tokenizer, INTRO)
    haystacks = []
    for seed in range(seeds):
        key = make_key(seed, digits)
        question, key_ids = key_tokens(tokenizer, key)
        needle = _encode(tokenizer, NEEDLE.format(key=key))
        fixed = len(intro) + len(needle) + len(question) + len(key_ids)
        room = seq_len - fixed
        if room < 0:
            raise ValueError(
                f"the passkey prompt (intro, key sentence, question and the {digits}-digit key: {fixed:,} tokens) is "
                f"longer than the haystack of {seq_len:,} tokens; evaluate at a length of at least {2 * fixed:,} "
                "tokens, or hide a shorter key (passkey digits).")
        filler = fillers[seed % len(fillers)].reshape(-1)
        if len(filler) < room:
            raise ValueError(f"the passkey filler has {len(filler):,} tokens of evaluation text, fewer than the "
                             f"{room:,} a haystack of {seq_len:,} tokens needs; give more evaluation text.")
        for depth in depths:
            before = round(depth * room)
            ids = torch.tensor(intro + filler[:before].tolist() + needle + filler[before:room].tolist() + question
                               + key_ids, dtype=torch.long)
            assert len(ids) == seq_len, (len(ids), seq_len)
            haystacks.append(Haystack(ids, key, seq_len - len(key_ids), len(key_ids), depth, len(intro) + before,
                                      seed))
    return haystacks


__all__ = ["DEPTHS", "Haystack", "INTRO", "NEEDLE", "QUESTION", "build_haystacks", "key_tokens", "make_key"]
