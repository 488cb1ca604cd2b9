"""Samples from dataset rows: plain text, chat `messages`, or `prompt` / `completion`, as token ids plus a loss mask.

A row becomes one sample: its token ids and a mask (1 where the token is trained, i.e. its label is
the token itself, 0 where the label is IGNORE_INDEX). Labels are unshifted, Hugging Face style:
mask[t] says whether token t is a target (predicted from the tokens before it).

Formats, chosen from the columns (the first that applies):
  text_column given   plain text in that column, trained whole.
  messages            a list of {role, content}, rendered with the tokenizer's chat template.
                      loss_on="completion" trains the assistant turns: the template's
                      {% generation %} marks where it has them, else each assistant turn's span
                      found by rendering the conversation up to it (refused when the template
                      renders earlier turns differently once later ones follow).
  prompt, completion  strings: prompt + completion; or message lists (TRL's conversational form):
                      the prompt rendered with the generation prompt, then the completion.
                      loss_on="completion" trains the completion.
  text                plain text, trained whole.
Chat rows are rendered with the row's own `tools` and `chat_template_kwargs` (e.g. enable_thinking), as TRL's
SFTTrainer renders them (`chat_template_kwargs`).
Every sample ends with the tokenizer's EOS (appended unless the rendering already ends with it),
trained when loss_on="all" or when the token before it is trained, so a completion learns to end.
"""

import hashlib
import json
import re
from typing import Iterable, Iterator

import numpy as np

from .tokenize import TOKEN_DTYPE

FORMATS = ("text", "messages", "prompt_completion")
LOSS_ON = ("completion", "all")
MASK_DTYPE = np.dtype("u1")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
# apply_chat_template's own arguments, which a row's chat_template_kwargs may not set (TRL would fail on them too).
_TEMPLATE_ARGUMENTS = ("conversation", "tools", "add_generation_prompt", "tokenize", "return_dict",
                       "return_assistant_tokens_mask", "continue_final_message", "chat_template")


def detect_format(columns: Iterable[str], text_column: str | None = None) -> str:
    """Which format rows with these columns hold (see the module docstring); a ValueError names the columns."""
    columns = list(columns)
    if text_column is not None:
        if text_column not in columns:
            raise ValueError(
                f"text_column={text_column!r} is not a column of this dataset; its columns are {columns}. "
                "Pass one of them (--text-column)"
            )
        return "text"
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "text" in columns:
        return "text"
    raise ValueError(
        f"this dataset has columns {columns}, none of 'text', 'messages' or 'prompt' + 'completion'; "
        "pass text_column=<the column with the text> (--text-column) or rename a column"
    )


def resolve_loss_on(loss_on: str | None, fmt: str) -> str:
    """The default is completion for chat and prompt/completion data, all for plain text."""
    if loss_on is None:
        return "all" if fmt == "text" else "completion"
    if loss_on not in LOSS_ON:
        raise ValueError(f"loss_on={loss_on!r}; use one of {', '.join(LOSS_ON)} (or None for the default)")
    if loss_on == "completion" and fmt == "text":
        raise ValueError(
            "loss_on='completion' needs chat ('messages') or 'prompt' + 'completion' columns, but this source "
            "is plain text, which has no completion; pass loss_on='all'"
        )
    return loss_on


def chat_template_digest(tokenizer) -> str | None:
    """A hash of the tokenizer's chat template (it shapes chat samples but is not in the tokenizer fingerprint)."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return None
    text = template if isinstance(template, str) else repr(sorted(template.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def chat_template_kwargs(row: dict, index: int) -> dict:
    """The row's own keywords for apply_chat_template, as TRL 1.16's SFTTrainer and DPOTrainer pass them: its
    `tools` (a list of tool schemas, or their JSON text) and every key of its `chat_template_kwargs`. Without them a
    completion is trained after a prompt the model never sees (no tool list, thinking on instead of off)."""
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ValueError(f"sample {index}: 'tools' is text but not JSON ({e}); give a list of tool schemas or "
                             "their JSON text") from e
    extra = row.get("chat_template_kwargs") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"sample {index}: 'chat_template_kwargs' must be a mapping of the chat template's variables "
                         f"(e.g. {{\"enable_thinking\": false}}), got {type(extra).__name__}")
    clash = sorted(set(extra) & set(_TEMPLATE_ARGUMENTS))
    if clash:
        raise ValueError(f"sample {index}: 'chat_template_kwargs' sets {', '.join(clash)}, which the rendering "
                         "itself decides (tools come from the row's 'tools' column); drop them from the row")
    return {"tools": tools, **extra}


def iter_samples(
    rows: Iterator[dict], tokenizer, fmt: str, loss_on: str, *, text_column: str | None = None, batch: int = 256
) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """(row index, token ids uint32, mask uint8) for each row, in order; rows tokenized in batches."""
    column = text_column or "text"
    pending: list[tuple[int, str, list[tuple[int, int]]]] = []
    for index, row in enumerate(rows):
        if fmt == "messages" and loss_on == "completion" and has_generation_marks(tokenizer):
            yield (index, *_finish(index, *_marked_chat(row, index, tokenizer), tokenizer, loss_on))
            continue
        text, spans = render(row, index, fmt, tokenizer, column, with_spans=loss_on == "completion")
        pending.append((index, text, spans if loss_on == "completion" else [(0, len(text))]))
        if len(pending) >= batch:
            yield from _encode(pending, tokenizer, loss_on)
            pending = []
    yield from _encode(pending, tokenizer, loss_on)


def has_generation_marks(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and bool(_GENERATION_TAG.search(template))


def render(
    row: dict, index: int, fmt: str, tokenizer, text_column: str = "text", *, with_spans: bool = True
) -> tuple[str, list[tuple[int, int]]]:
    """The sample's text and the character spans loss_on="completion" trains ([] when not `with_spans`)."""
    if fmt == "text":
        text = _string(row[text_column], text_column, index)
        return text, [(0, len(text))]
    if fmt == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            return prompt + completion, [(len(prompt), len(prompt) + len(completion))]
        if isinstance(prompt, list) and isinstance(completion, list):
            kwargs = chat_template_kwargs(row, index)
            full = _chat(tokenizer, _messages(prompt + completion, index), **kwargs)
            if not with_spans:
                return full, []
            before = _chat(tokenizer, prompt, add_generation_prompt=True, **kwargs)
            if not full.startswith(before):
                raise _not_a_prefix(index)
            return full, [(len(before), len(full))]
        raise ValueError(
            f"sample {index}: 'prompt' is {type(prompt).__name__} and 'completion' is {type(completion).__name__}; "
            "use two strings or two lists of {role, content} messages"
        )
    assert fmt == "messages", fmt
    messages, kwargs = _messages(row["messages"], index), chat_template_kwargs(row, index)
    full = _chat(tokenizer, messages, **kwargs)
    if not with_spans:
        return full, []
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(_chat(tokenizer, messages[:turn], add_generation_prompt=True, **kwargs)) if turn else 0
        upto = _chat(tokenizer, messages[: turn + 1], **kwargs)
        if not full.startswith(upto) or start > len(upto):
            raise _not_a_prefix(index)
        spans.append((start, len(upto)))
    return full, spans


def _marked_chat(row: dict, index: int, tokenizer) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        _messages(row["messages"], index), tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        **chat_template_kwargs(row, index),
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def _encode(pending, tokenizer, loss_on: str):
    if not pending:
        return
    texts = [text for _, text, _ in pending]
    encoded = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    for (index, _, spans), ids, offsets in zip(pending, encoded["input_ids"], encoded["offset_mapping"]):
        mask = [int(any(start < end_span and end > start_span for start_span, end_span in spans))
                for start, end in offsets]
        yield (index, *_finish(index, ids, mask, tokenizer, loss_on))


def _finish(index: int, ids: list[int], mask: list[int], tokenizer, loss_on: str) -> tuple[np.ndarray, np.ndarray]:
    if loss_on == "completion" and not any(mask):
        raise ValueError(
            f"sample {index} has no completion tokens to train under loss_on='completion' (an empty completion, "
            "or no assistant turn); fix or drop that row, or pass loss_on='all'"
        )
    eos = tokenizer.eos_token_id
    if not ids or ids[-1] != eos:
        ids = [*ids, eos]
        mask = [*mask, 1 if loss_on == "all" or (mask and mask[-1]) else 0]
    return np.asarray(ids, dtype=TOKEN_DTYPE), np.asarray(mask, dtype=MASK_DTYPE)


def _chat(tokenizer, messages: list, add_generation_prompt: bool = False, **template_kwargs) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "chat data needs the tokenizer's chat template, and this tokenizer has none; set "
            "tokenizer.chat_template, or render the conversations to a 'text' column yourself"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **template_kwargs)


def _messages(messages, index: int) -> list:
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                 for m in messages):
        raise ValueError(f"sample {index}: 'messages' must be a list of {{role, content}} dicts, got {messages!r:.200}")
    return messages


def _string(value, column: str, index: int) -> str:
    if not isinstance(value, str):
        raise ValueError(f"sample {index}: column {column!r} holds {type(value).__name__}, not text; "
                         "pass text_column=<a text column>")
    return value


def _not_a_prefix(index: int) -> ValueError:
    return ValueError(
        f"sample {index}: the chat template renders the first turns of this conversation differently once later "
        "turns follow (Qwen3's drops past reasoning, for one), so the assistant turns cannot be located for "
        "loss_on='completion'; wrap assistant content in {% generation %}...{% endgeneration %} in "
        "tokenizer.chat_template, or pass loss_on='all'"
    )
